"""What every shard-by-shard stage shares: units, fingerprints, summary, manifest.

A filtering stage (static, domain) runs one task per input shard. The unit
key ties a task's staged output to its shard's name, size and mtime, so a
rerun after a crash redoes only unfinished shards.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import math

import numpy as np
import pyarrow as pa

from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA
from assay.shards import list_shards, read_manifest, require_dataset
from assay.staging import UnitResult


@dataclass(frozen=True)
class ShardUnit:
    index: int
    shard: str
    key: str


def plan_shards(input_dir: str | Path) -> list[ShardUnit]:
    require_dataset(input_dir)
    shards = list_shards(input_dir)
    if not shards:
        raise AssayError(f"{input_dir}: has no part-*.parquet shards")
    units = []
    for i, shard in enumerate(shards):
        st = shard.stat()
        sig = hashlib.blake2b(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
        units.append(ShardUnit(i, str(shard), f"{i:05d}-{sig}"))
    return units


def with_score_column(input_schema: pa.Schema, name: str) -> pa.Schema:
    """The stage's output schema: its input's, plus its float64 score column."""
    if name in input_schema.names:
        return input_schema
    return input_schema.append(pa.field(name, pa.float64()))


def scores_column(scores: dict[str, np.ndarray], n: int) -> pa.Array:
    """Per row, the non-NaN scores as the decisions' map<string, float64> (null when none)."""
    names = list(scores)
    matrix = np.column_stack([scores[k] for k in names]) if names else np.zeros((n, 0))
    rows = []
    for values in matrix:
        pairs = [(names[j], float(v)) for j, v in enumerate(values) if not math.isnan(v)]
        rows.append(pairs or None)
    return pa.array(rows, type=DECISION_SCHEMA.field("scores").type)


def file_fingerprint(path: str | Path) -> str:
    """Content hash of a small file or of a directory's files (models)."""
    path = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def stage_fingerprint(units: Sequence[ShardUnit], params: dict[str, Any], models: Sequence[str] = ()) -> str:
    blob = json.dumps({"units": [u.key for u in units], "params": params,
                       "models": [file_fingerprint(m) for m in models]}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def summarize(results: Sequence[UnitResult]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    for result in results:
        counts.update(result.counts)
    drops = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("drop:")}
    rest = {k: v for k, v in sorted(counts.items()) if not k.startswith("drop:")}
    return {**rest, "dropped": sum(drops.values()), "by_reason": drops,
            "units": len(results), "units_resumed": sum(1 for r in results if r.skipped)}


def stage_manifest(stage: str, input_dir: str | Path, fingerprint: str, params: dict[str, Any],
                   results: Sequence[UnitResult], seconds: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        upstream = read_manifest(input_dir).get("fingerprint")
    except AssayError:
        upstream = None
    summary = summarize(results)
    return {
        "format": "assay-dataset/1",
        "stage": stage,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "fingerprint": fingerprint,
        "inputs": [{"dataset": str(input_dir), "fingerprint": upstream}],
        "params": params,
        "counts": summary,
        "timings": {
            "seconds": round(seconds, 3),
            "task_seconds": round(sum(r.seconds for r in results), 3),
            "docs_per_second": round(summary.get("input", 0) / seconds, 1) if seconds else None,
        },
        **(extra or {}),
    }
