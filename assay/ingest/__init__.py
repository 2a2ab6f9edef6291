"""Ingest: sources (directories, JSON lines, Parquet, Hugging Face, the demo) → a raw dataset.

The pieces, in the order a run uses them:
`plan` (SOURCE → units), `readers.ingest_unit` (one unit → staged shards),
`assay.staging.commit` (staged → dataset), and `summarize` (the counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
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
        jsonl_parser=ingest.jsonl_parser,
        jsonl_block_bytes=ingest.jsonl_block_bytes,
        jsonl_threads=ingest.jsonl_threads if isinstance(ingest.jsonl_threads, int) else 0,  # auto: see below
    )
    return dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})


#: Worker threads `jsonl_threads: auto` gives a file when a core would otherwise idle. Two, because
#: past two the one writer (the reading thread) is the limit: on bench/ingest.py's file, 2 workers
#: took 1.21 s against 1.30 s for 1 and 1.75 s for none, on 2 cores (BENCHMARKS.md, Ingest).
AUTO_JSONL_THREADS = 2


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def jsonl_threads_for_run(setting: int | str, units: int, max_workers: int, cores: int | None = None) -> int:
    """`ingest.jsonl_threads` for a run of `units` tasks: a number as it is; "auto" as the params say.

    Threads only pay where a core is free (they cost CPU: 1.93 against 1.75 CPU s for that file),
    and a run with as many files as workers already keeps every core busy.
    """
    if isinstance(setting, int):
        return setting
    workers = min(max_workers, cores if cores is not None else available_cores())
    return AUTO_JSONL_THREADS if units < workers else 0


def fingerprint(units: Sequence[Unit], options: IngestOptions, params: Params) -> str:
    """Inputs (names, sizes, mtimes) and every setting that changes the output.

    Not the reader's threads: they change when work is done, not what is written, and "auto"
    resolves by the run's shape, so a rerun with another max_workers still resumes.
    """
    settings = dataclasses.asdict(options)
    del settings["jsonl_threads"]
    blob = json.dumps(
        {"units": [u.signature for u in units], "options": settings, "demo": params.section("demo")},
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
