"""The trainer's per-document record, ``telemetry/part-*.parquet`` (assay.schema.TELEMETRY_SCHEMA).

One row per document per step: its loss, its gradient norm, its tokens, and
whether the step was flagged. Rows are buffered and flushed as one part per
checkpoint interval, named by the interval's first step, so the files on disk
always end at a checkpoint and a resumed run can drop exactly the steps it
will redo. In a data-parallel run each rank writes the documents it trained on,
in parts named ``part-<step>-r<rank>``; readers take every part.
"""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.schema import TELEMETRY_SCHEMA
from assay.shards import COMPRESSION, atomic_write_bytes

__all__ = ["TelemetryLog", "read_telemetry"]

TELEMETRY_DIR = "telemetry"


def _first_step(path: Path) -> int:
    return int(path.stem.split("-")[1])


class TelemetryLog:
    def __init__(self, run_dir: str | Path, rank: int | None = None):
        self.directory = Path(run_dir) / TELEMETRY_DIR
        self.suffix = "" if rank is None else f"-r{rank:03d}"
        self._columns: dict[str, list] = {name: [] for name in TELEMETRY_SCHEMA.names}

    def add_step(self, step: int, doc_ids: list[str], loss: list[float], grad_norm: list[float] | None,
                 tokens: list[int], reason: str | None) -> None:
        """Record one step; ``reason`` flags every document of the step (a skipped step)."""
        n = len(doc_ids)
        c = self._columns
        c["step"].extend([step] * n)
        c["sample_id"].extend(doc_ids)
        c["loss"].extend(loss)
        c["grad_norm"].extend(grad_norm if grad_norm is not None else [None] * n)
        c["tokens"].extend(tokens)
        c["flagged"].extend([reason is not None] * n)
        c["reason"].extend([reason] * n)

    def flush(self) -> Path | None:
        """Write the buffered steps as one part (atomic); returns its path."""
        if not self._columns["step"]:
            return None
        table = pa.Table.from_pydict(self._columns, schema=TELEMETRY_SCHEMA)
        path = self.directory / f"part-{self._columns['step'][0]:08d}{self.suffix}.parquet"
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression=COMPRESSION)
        atomic_write_bytes(path, buffer.getvalue())
        self._columns = {name: [] for name in TELEMETRY_SCHEMA.names}
        return path

    def truncate_after(self, step: int) -> int:
        """Forget steps after ``step`` (a resume redoes them); returns the rows removed."""
        removed = 0
        for path in sorted(self.directory.glob("part-*.parquet")):
            table = pq.read_table(path)
            keep = pc.less_equal(table.column("step"), step)
            kept = table.filter(keep)
            removed += table.num_rows - kept.num_rows
            if kept.num_rows == 0:
                path.unlink()
            elif kept.num_rows < table.num_rows:
                buffer = io.BytesIO()
                pq.write_table(kept, buffer, compression=COMPRESSION)
                atomic_write_bytes(path, buffer.getvalue())
        return removed


def read_telemetry(run_dir: str | Path) -> pa.Table:
    """All telemetry of a run, ordered by step."""
    parts = sorted((Path(run_dir) / TELEMETRY_DIR).glob("part-*.parquet"), key=lambda p: (_first_step(p), p.name))
    if not parts:
        return TELEMETRY_SCHEMA.empty_table()
    table = pa.concat_tables([pq.read_table(p, schema=TELEMETRY_SCHEMA) for p in parts])
    if any("-r" in p.stem for p in parts):  # ranks' parts interleave steps; Arrow's sort is stable
        table = table.take(pc.sort_indices(table, [("step", "ascending")]))
    return table
