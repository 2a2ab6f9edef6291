"""Stage logic over shards, as plain functions the Prefect flows map over."""
