"""Pure data-quality filters over Arrow record batches (no Prefect, DVC or Weaviate here)."""
