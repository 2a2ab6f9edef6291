"""A document's story across stages: `assay show` and `assay why`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.errors import AssayError
from assay.shards import DECISIONS_DIR, QUARANTINE_DIR, iter_batches, list_shards, read_manifest, require_dataset


def find_document(directory: str | Path, doc_id: str) -> dict[str, Any] | None:
    """The document row with `doc_id`, else its quarantine record, else None."""
    require_dataset(directory)
    for batch in iter_batches(directory, filter_ids=[doc_id]):
        return {**batch.slice(0, 1).to_pylist()[0], "status": "document"}
    for batch in iter_batches(Path(directory) / QUARANTINE_DIR, filter_ids=[doc_id]):
        row = batch.slice(0, 1).to_pylist()[0]
        raw = row.pop("raw")
        row["raw_preview"] = raw[:400].decode("utf-8", errors="replace") if raw else None
        row["raw_bytes"] = len(raw) if raw else None
        return {**row, "status": "quarantined"}
    return None


def decisions_for(directory: str | Path, doc_id: str) -> list[dict[str, Any]]:
    folder = Path(directory) / DECISIONS_DIR
    rows = []
    for shard in list_shards(folder):
        table = pq.read_table(shard, filters=pc.field("id") == doc_id)
        for row in table.to_pylist():
            row["scores"] = dict(row["scores"]) if row["scores"] else {}
            rows.append(row)
    return rows


def why(doc_id: str, directories: list[str | Path]) -> list[dict[str, Any]]:
    """Every decision about `doc_id` in the given stage outputs, oldest first."""
    if not directories:
        raise AssayError("give at least one --data DIR")
    story = []
    for directory in directories:
        require_dataset(directory)
        try:
            created = read_manifest(directory).get("created_at", "")
        except AssayError:
            created = ""
        for row in decisions_for(directory, doc_id):
            story.append({"dataset": str(directory), "created_at": created, **row})
    story.sort(key=lambda r: (r["created_at"], r["dataset"]))
    return story
