"""What every shard-by-shard stage shares: units, fingerprints, summary, manifest.

A filtering stage (static, domain) runs one task per input shard. The unit
key ties a task's staged output to its shard's name, size, mtime and ctime, so
a rerun after a crash redoes only unfinished shards.

The same key says whether a shard is still the file the stage planned on. An
upstream stage rerun publishes a new version under the same part names; a
stage reading across that would judge parts of two versions as one input.
Each task checks its shard once it has it open, and the flow checks the whole
input again before it commits.
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
import pyarrow.parquet as pq

from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA, DOCUMENT_SCHEMA
from assay.shards import kept_nothing, list_shards, open_shard, read_manifest, require_dataset
from assay.staging import DATASET_FORMAT, UnitResult


@dataclass(frozen=True)
class ShardUnit:
    index: int
    shard: str
    key: str


def plan_shards(input_dir: str | Path) -> list[ShardUnit]:
    """One unit per input shard; none for a dataset its stage published empty (`shards.kept_nothing`)."""
    require_dataset(input_dir)
    shards = list_shards(input_dir)
    if not shards and not kept_nothing(input_dir):
        raise AssayError(f"{input_dir}: has no part-*.parquet shards")
    return [ShardUnit(i, str(shard), f"{i:05d}-{_signature(shard)}") for i, shard in enumerate(shards)]


def _signature(shard: Path) -> str:
    st = shard.stat()
    # ctime too: an edit in place that keeps the size and sets the mtime back (os.utime, touch -d,
    # rsync -t) still moves the ctime, which no user call can set. The cost is conservative: a
    # chmod or a new hard link also moves it, and the shard is judged again rather than resumed.
    stamp = f"{shard.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    return hashlib.blake2b(stamp.encode(), digest_size=8).hexdigest()


def open_planned(shard: str, key: str) -> pq.ParquetFile:
    """A task's input shard, opened, if it is still the file its unit key was planned on."""
    parquet = open_shard(shard, shard, DOCUMENT_SCHEMA)
    # Checked once the file is open: the reader keeps it open, so what it reads is what was planned.
    if not key.endswith("-" + _signature(Path(shard))):
        raise AssayError(f"{shard}: replaced since this stage planned its run (an upstream stage published "
                         "a new version of its input); rerun this stage")
    return parquet


def require_unchanged(input_dir: str | Path, units: Sequence[ShardUnit]) -> None:
    """Refuse to commit output judged from an input that changed during the run, naming a changed shard."""
    now = plan_shards(input_dir)
    if [u.key for u in now] != [u.key for u in units]:
        planned = {Path(u.shard).name: u.key for u in units}
        changed = next((Path(u.shard).name for u in now if planned.get(Path(u.shard).name) != u.key),
                       f"{len(units)} shards planned, {len(now)} now")
        raise AssayError(f"{input_dir}: changed during this run ({changed}: an upstream stage published a new "
                         "version); nothing was published; rerun this stage")


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
        "format": DATASET_FORMAT,
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
