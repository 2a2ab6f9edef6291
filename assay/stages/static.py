"""Tier 1 on one shard: heuristics, then the encoder, then the confidence score.

A cascade, per record batch:
1. the heuristic chain judges `kind == text` rows, each with its source's
   filters (`static.source_rules`; every filter for sources not listed);
2. every survivor, text or code, is embedded once by the shared encoder and
   its vector is stored (`embeddings/`) for dedup and the knowledge graph;
3. text survivors get `quality`, the head's probability of good prose
   (Platt-calibrated on the demo pool's dev part when the head was trained
   by the reference recipe, `assay.quality.calibration`); a text row is kept
   when `quality >= static.threshold`. Code passes to tier 3 with a null quality.
Every input row gets a decision: the heuristic's reason and scores, or
`quality:below_threshold` with its score, or kept with its scores.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.allocator import bound_heap_growth
from assay.config import Params, StaticParams
from assay.encoder import Encoder, shared_encoder
from assay.quality.scorer import Scorer, build_scorer, encoder_for
from assay.schema import DECISION_SCHEMA, KIND_TEXT, embedding_schema
from assay.stages.shard_stage import open_planned, scores_column, with_score_column
from assay.shards import shard_batches
from assay.staging import UnitResult, UnitWriter, finished_unit
from filters.base import Filter
from filters.heuristics import apply_by_source, build_heuristics, check_source_rules

STAGE = "static"
QUALITY = "quality"
BELOW_THRESHOLD = "quality:below_threshold"
EMBEDDINGS = "embeddings"


@dataclass
class StaticModels:
    heuristics: list[Filter]
    encoder: Encoder
    scorer: Scorer
    #: Names of the heuristics whose scores the scorer reads instead of recomputing them (`Scorer.reusable`).
    shared: list[str]


_MODELS: dict[str, StaticModels] = {}
_MODELS_LOCK = threading.Lock()


def load_models(params: StaticParams) -> StaticModels:
    """Models are loaded once per process and shared by the stage's tasks."""
    # Before any document is read: with glibc's dynamic mmap threshold, the 0.4-5 MB documents' buffers come
    # from the heaps after the first large free and fragment them, and static's RSS rose through a 1-2 GB run;
    # with the threshold fixed it stays level (assay/allocator.py, RELIABILITY.md).
    bound_heap_growth()
    key = json.dumps(params.__dict__, default=lambda o: o.__dict__, sort_keys=True)
    with _MODELS_LOCK:
        if key not in _MODELS:
            heuristics = build_heuristics(params.heuristics)
            check_source_rules(heuristics, params.source_rules)  # a bad choice fails before any model loads
            encoder = shared_encoder(encoder_for(params))
            scorer = build_scorer(params)
            _MODELS[key] = StaticModels(heuristics, encoder, scorer, scorer.reusable(heuristics))
        return _MODELS[key]


def judge_batch(batch: pa.RecordBatch, params: StaticParams, models: StaticModels) -> tuple[
    np.ndarray, list[str | None], dict[str, np.ndarray], np.ndarray, np.ndarray
]:
    """(keep, reason, scores, embedded_rows, embeddings) for one batch."""
    n = batch.num_rows
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    scores: dict[str, np.ndarray] = {}

    result = apply_by_source(models.heuristics, batch, params.source_rules)
    keep[:] = result.keep
    reason = list(result.reason)
    scores.update(result.scores)

    survivors = np.flatnonzero(keep)
    texts = batch.column("text")
    survivor_texts = texts.take(pa.array(survivors, pa.int64())).to_pylist() if len(survivors) else []
    embeddings = models.encoder.encode(survivor_texts)

    is_text = np.asarray(pc.fill_null(pc.equal(batch.column("kind"), KIND_TEXT), False), dtype=bool)
    quality = np.full(n, np.nan)
    scored = [j for j, i in enumerate(survivors) if is_text[i]]
    if scored:
        rows = survivors[scored]
        known = {k: v[rows] for k, v in scores.items() if k.split(":", 1)[0] in models.shared}
        quality[rows] = models.scorer.score([survivor_texts[j] for j in scored], embeddings[scored], known)
        low = rows[quality[rows] < params.threshold]
        keep[low] = False
        for i in low:
            reason[i] = BELOW_THRESHOLD
    scores[QUALITY] = quality
    return keep, reason, scores, survivors, embeddings


def static_unit(index: int, shard: str, out_dir: str, params: Params, key: str,
                progress: Callable[[int], None] | None = None) -> UnitResult:
    """Run tier 1 over one input shard into `out_dir`'s staging area (resumable)."""
    done = finished_unit(out_dir, key)
    if done is not None:
        return done
    started = time.perf_counter()
    static = params.static
    models = load_models(static)
    parquet = open_planned(shard, key)
    schema = with_score_column(parquet.schema_arrow, QUALITY)
    writer = UnitWriter(out_dir, key, schema, target_bytes=params.io.shard_bytes,
                        extra={EMBEDDINGS: embedding_schema(models.encoder.dim)})
    try:
        for batch in shard_batches(parquet, shard, batch_size=params.io.batch_rows, max_bytes=params.io.batch_bytes):
            keep, reason, scores, embedded, vectors = judge_batch(batch, static, models)
            n = batch.num_rows
            out = batch if QUALITY in batch.schema.names else batch.append_column(QUALITY, pa.array(scores[QUALITY], pa.float64(), from_pandas=True))
            writer.docs.write(out.filter(pa.array(keep)))
            writer.streams[EMBEDDINGS].write(pa.RecordBatch.from_arrays(
                [batch.column("id").take(pa.array(embedded, pa.int64())),
                 pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), models.encoder.dim)],
                schema=embedding_schema(models.encoder.dim)))
            writer.write_decisions(pa.RecordBatch.from_arrays(
                [batch.column("id"), pa.array([STAGE] * n, pa.string()), pa.array(keep),
                 pa.array(reason, pa.string()), scores_column(scores, n), pa.nulls(n, pa.string())],
                schema=DECISION_SCHEMA))
            writer.counts["embedded"] += len(embedded)
            if progress:
                progress(n)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(bytes_in=Path(shard).stat().st_size, seconds=time.perf_counter() - started)
