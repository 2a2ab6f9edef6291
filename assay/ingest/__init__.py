"""Ingest: sources (directories, JSON lines, Parquet, Hugging Face, the demo) → a raw dataset.

The pieces, in the order a run uses them:
`plan` (SOURCE → units), `readers.ingest_unit` (one unit → staged shards),
`assay.staging.commit` (staged → dataset), and `summarize` (the counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from assay.config import Params
from assay.ingest.plan import IngestOptions, Unit
from assay.staging import DATASET_FORMAT, UnitResult

STAGE = "ingest"


def options_from_params(params: Params, **overrides: Any) -> IngestOptions:
    """Options for a run: params.yaml, then the CLI's explicit flags."""
    ingest, io = params.ingest, params.io
    options = IngestOptions(
        text_field=ingest.text_field,
        id_field=ingest.id_field,
        max_bytes=ingest.max_bytes,
        shard_bytes=io.shard_bytes,
        batch_rows=io.batch_rows,
        unit_bytes=ingest.unit_bytes,
        skip_dirs=tuple(ingest.skip_dirs),
        fallback_encodings=tuple(ingest.fallback_encodings),
        encoding_confidence=ingest.encoding_confidence,
    )
    return dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})


def fingerprint(units: Sequence[Unit], options: IngestOptions, params: Params) -> str:
    """Inputs (names, sizes, mtimes) and every setting that changes the output."""
    blob = json.dumps(
        {"units": [u.signature for u in units], "options": dataclasses.asdict(options), "demo": params.section("demo")},
        sort_keys=True,
        default=str,
    )
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def summarize(results: Sequence[UnitResult]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    for result in results:
        counts.update(result.counts)
    documents = counts.pop("documents", 0)
    quarantined = counts.pop("quarantined", 0)
    by_reason = {k: v for k, v in sorted(counts.items()) if k.startswith("invalid:")}
    by_kind = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("kind:")}
    skipped = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("skipped:")}
    if counts.get("blank_lines"):
        skipped["blank_lines"] = counts["blank_lines"]
    summary: dict[str, Any] = {
        "input_records": documents + quarantined,
        "documents": documents,
        "quarantined": quarantined,
        "by_reason": by_reason,
        "by_kind": by_kind,
        "skipped": skipped,
        "bytes_in": sum(r.bytes_in for r in results),
        "bytes_out": sum(r.bytes_out for r in results),
        "units": len(results),
        "units_resumed": sum(1 for r in results if r.skipped),
    }
    # How many JSONL lines Arrow's reader took and how many went line by line: a dirty
    # or oddly typed file shows here as a high Python share, the reason it ran slower.
    if "jsonl_lines_arrow" in counts or "jsonl_lines_python" in counts:
        summary["jsonl_lines"] = {"arrow": counts.get("jsonl_lines_arrow", 0),
                                  "python": counts.get("jsonl_lines_python", 0)}
    return summary


def manifest_for(
    sources: Sequence[str], units: Sequence[Unit], options: IngestOptions, params: Params,
    results: Sequence[UnitResult], seconds: float,
) -> dict[str, Any]:
    summary = summarize(results)
    return {
        "format": DATASET_FORMAT,
        "stage": STAGE,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "fingerprint": fingerprint(units, options, params),
        "sources": list(sources),
        "inputs": [{"source": u.source, "kind": u.kind, "signature": u.signature, "bytes": u.size} for u in units],
        "params": {"ingest": dataclasses.asdict(options), "demo": params.section("demo") if "demo" in sources else None},
        "counts": summary,
        "timings": {
            "seconds": round(seconds, 3),
            "task_seconds": round(sum(r.seconds for r in results), 3),
            "docs_per_second": round(summary["input_records"] / seconds, 1) if seconds else None,
            "mb_per_second": round(summary["bytes_in"] / 2**20 / seconds, 2) if seconds else None,
        },
    }
