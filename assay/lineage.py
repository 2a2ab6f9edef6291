"""A document's story across stages: `assay show` and `assay why`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA
from assay.shards import (DECISIONS_DIR, QUARANTINE_DIR, iter_batches, open_shard, read_manifest, read_shard,
                          require_documents, stream_shards)


def find_document(directory: str | Path, doc_id: str) -> dict[str, Any] | None:
    """The document row with `doc_id`, else its quarantine record, else None."""
    require_documents(directory)
    for batch in iter_batches(directory, filter_ids=[doc_id]):
        return {**batch.slice(0, 1).to_pylist()[0], "status": "document"}
    stream_shards(directory, QUARANTINE_DIR)  # all there, or an error: not "not in DIR" for a lost part
    for batch in iter_batches(Path(directory) / QUARANTINE_DIR, filter_ids=[doc_id]):
        row = batch.slice(0, 1).to_pylist()[0]
        raw = row.pop("raw")
        row["raw_preview"] = raw[:400].decode("utf-8", errors="replace") if raw else None
        row["raw_bytes"] = len(raw) if raw is not None else None  # an empty file's record holds b"": 0 bytes
        return {**row, "status": "quarantined"}
    return None


def decisions_for(directory: str | Path, doc_id: str) -> list[dict[str, Any]]:
    rows = []
    for shard in stream_shards(directory, DECISIONS_DIR):  # a lost part is an error, not fewer decisions
        # A damaged shard (garbage bytes, cut short) is an error that names it, not pyarrow's
        # traceback: the footer and the columns are checked first, then the filtered read.
        open_shard(shard, shard, DECISION_SCHEMA, ("id", "stage", "kept", "reason", "scores"))
        table = read_shard(shard, filters=pc.field("id") == doc_id)
        for row in table.to_pylist():
            row["scores"] = dict(row["scores"]) if row["scores"] else {}
            rows.append(row)
    return rows


def why(doc_id: str, directories: list[str | Path]) -> list[dict[str, Any]]:
    """Every decision about `doc_id` in the given stage outputs, oldest first."""
    if not directories:
        raise AssayError("give at least one --data DIR")
    story = []
    seen: set[Path] = set()
    for directory in directories:
        # Documents, as `show` asks: a decisions/ or scores folder is a dataset to require_dataset
        # (part-*.parquet), and reading its missing decisions/ said "no decisions about ID".
        # A stage's output that kept nothing has no shard and passes.
        require_documents(directory)
        resolved = Path(directory).resolve()
        if resolved in seen:  # one dataset given twice (`--data X --data X/`, or through a link): its decisions once
            continue
        seen.add(resolved)
        try:
            created = read_manifest(directory).get("created_at", "")
        except AssayError:
            created = ""
        for row in decisions_for(directory, doc_id):
            story.append({"dataset": str(directory), "created_at": created, **row})
    story.sort(key=lambda r: (r["created_at"], r["dataset"]))
    return story


def scores_behind(reason: str | None, scores: dict[str, float]) -> list[tuple[str, float]]:
    """The scores a decision's reason rests on, the value and its threshold first.

    Tier 2's are named by its filters (`filters.dynamic.evidence`: `dynamic:loss_high` rests on
    `loss_z` and `loss_z_high_threshold`); another stage's are the keys that start with the reason,
    else with its filter's name (`gopher_quality:`). Empty for a kept document.
    """
    from filters.dynamic import evidence

    if not reason:
        return []
    named = evidence(reason)
    if named:
        return [(key, scores[key]) for key in named if key in scores]
    group = reason.split(":", 1)[0] + ":"
    return ([(k, v) for k, v in sorted(scores.items()) if k.startswith(reason)]
            or [(k, v) for k, v in sorted(scores.items()) if k.startswith(group)])
