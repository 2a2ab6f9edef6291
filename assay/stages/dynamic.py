"""Tier 2 as a stage: the scoring pass and round 0's telemetry decide the next version.

The verdicts need the whole corpus at once (outliers are judged within
strata of every scored document), so they are computed once per run
(`verdicts`), from inputs that are small: one row per document and
checkpoint, and one per document and step. Then one task per input shard
writes its kept documents and a decision for every document, as every stage
does (assay.staging). A document that neither input mentions is kept, with
the detail "not scored": tier 2 has nothing to say about it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.config import DynamicParams, Params
from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA, TELEMETRY_SCHEMA
from assay.shards import MANIFEST, shard_batches
from assay.stages.shard_stage import file_fingerprint, open_planned, scores_column, with_score_column
from assay.staging import UnitResult, UnitWriter, finished_unit
from filters.dynamic import build_dynamic_filters, judge, signals_for

STAGE = "dynamic"
#: The score column the stage appends to the documents it keeps.
ALIGNMENT = "alignment"
TELEMETRY_DIR = "telemetry"
#: A run's checkpoints and tokenizer (training.checkpoint.CHECKPOINTS, training.tokenizer.TOKENIZER_FILE;
#: named here so that the stage does not import torch to find them).
CHECKPOINTS_DIR, TOKENIZER_FILE = "checkpoints", "tokenizer.json"
NOT_SCORED = "not scored"
REFERENCE = "reference set: never judged"


def _score_parts(scores_dir: str | Path) -> list[Path]:
    """The parts a finished scoring pass lists in its manifest (an unfinished one has none)."""
    scores_dir = Path(scores_dir)
    manifest = scores_dir / MANIFEST
    if not manifest.is_file():
        raise AssayError(f"{scores_dir}: no finished scores ({MANIFEST} missing); run `assay score` first")
    try:
        names = json.loads(manifest.read_text())["shards"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise AssayError(f"{manifest}: not a scoring pass's manifest (no shards list)") from None
    missing = [n for n in names if not (scores_dir / n).is_file()]
    if missing or not names:
        raise AssayError(f"{scores_dir}: {len(missing)} of {len(names)} score part(s) missing; rerun `assay score`")
    return [scores_dir / n for n in names]


def _telemetry_parts(run_dir: str | Path) -> list[Path]:
    parts = sorted((Path(run_dir) / TELEMETRY_DIR).glob("part-*.parquet"))
    if not parts:
        raise AssayError(f"{run_dir}: no telemetry ({TELEMETRY_DIR}/part-*.parquet); is it a training run?")
    return parts


def require_signals(scores_dir: str | Path, run_dir: str | Path) -> None:
    """Fail with a clear message, before any work, when the scores or the telemetry are missing."""
    _score_parts(scores_dir)
    _telemetry_parts(run_dir)


def _scores_manifest(scores_dir: str | Path) -> dict:
    _score_parts(scores_dir)  # a finished pass, with a manifest that parses
    return json.loads((Path(scores_dir) / MANIFEST).read_text())


def require_scores_of_run(scores_dir: str | Path, run_dir: str | Path) -> None:
    """Refuse scores computed with another model than `run_dir`'s (another run, or this folder
    retrained since): tier 2 would judge documents by a model its telemetry is not of.

    Compared by content (the fingerprints `assay score` records of each checkpoint and of the
    tokenizer), not by the run's path, so a run that was moved or renamed still passes. Scores
    whose manifest records none (written before it did, or by hand) are not checked.
    """
    manifest = _scores_manifest(scores_dir)
    inputs = manifest.get("inputs") or {}
    checkpoints = inputs.get("checkpoints") or []
    if not checkpoints or "tokenizer" not in inputs or any("fingerprint" not in c for c in checkpoints):
        return
    run = Path(run_dir)
    steps = ", ".join(str(c["step"]) for c in checkpoints)
    for checkpoint in checkpoints:
        name = Path(checkpoint["path"]).name
        if not (run / CHECKPOINTS_DIR / name).is_dir():
            raise AssayError(f"{scores_dir}: scored with the checkpoint(s) of step {steps} of {inputs.get('run')}, "
                             f"and {run_dir} has no {CHECKPOINTS_DIR}/{name}; score {run_dir} "
                             f"(`assay score --run {run_dir}`) or pass the run they are of")
    now = [file_fingerprint(run / TOKENIZER_FILE)] + [file_fingerprint(run / CHECKPOINTS_DIR / Path(c["path"]).name)
                                                     for c in checkpoints]
    if now != [inputs["tokenizer"]] + [c["fingerprint"] for c in checkpoints]:
        raise AssayError(f"{scores_dir}: scored with another model than {run_dir}'s (its checkpoint(s) of step "
                         f"{steps} or its tokenizer differ from those the scores were computed with, from "
                         f"{inputs.get('run')}); score {run_dir} again (`assay score --run {run_dir}`)")


def require_scores_of_input(scores_dir: str | Path, shards: Sequence[str], input_dir: str | Path) -> None:
    """Refuse scores that score none of the input's documents: scores of another dataset would keep
    every document as "not scored". Only the id columns are read, and only until one is found;
    a dataset's identity (its DVC or byte hash) would read every byte of it."""
    scored = pc.unique(pa.concat_tables(
        [pq.read_table(p, columns=["sample_id"]) for p in _score_parts(scores_dir)]).column(0))
    documents = 0
    for shard in shards:
        ids = pq.read_table(shard, columns=["id"]).column(0)
        if pc.any(pc.is_in(ids, value_set=scored)).as_py():
            return
        documents += len(ids)
    if documents:
        raise AssayError(f"{scores_dir}: scores none of the {documents:,} documents of {input_dir} (scores of "
                         f"another dataset?); score it (`assay score --data {input_dir}`) or pass its scores")


def require_scores_of_version(scores_dir: str | Path, input_dir: str | Path) -> None:
    """Refuse scores computed on another version of the data than `input_dir` (`--allow-data-change`
    passes them): the ids may be the same and the texts not, and each document would be judged by the
    signals of another text (a probe, 2026-12-07, with the ids check above passing).

    Compared by the identity `assay score` records (DVC's md5, or the digest of the bytes of data DVC
    does not track, as training compares its --resume); where one side is named by DVC and the
    other by its bytes, by the bytes. Scores whose manifest records none are not checked.
    """
    from assay.versions import content_digest, open_version

    recorded = ((_scores_manifest(scores_dir).get("inputs") or {}).get("dataset") or {}).get("data_hash")
    if not isinstance(recorded, str):
        return
    now = open_version(input_dir).data_hash
    if now != recorded and recorded.startswith("local-") and not now.startswith("local-"):
        now = content_digest(input_dir)  # tracked now, scored while it was not: compare the bytes
    if now != recorded:
        raise AssayError(f"{scores_dir}: scored on data {recorded}, but {input_dir} is now {now} (another run's "
                         f"output, even of the same documents, is another version): a document whose text changed "
                         f"would be judged by the signals of another text; score it again (`assay score --data "
                         f"{input_dir}`), or pass --allow-data-change to judge the documents whose ids were scored")


def signals_fingerprint(scores_dir: str | Path, run_dir: str | Path) -> dict[str, str]:
    """What the verdicts are made from besides the input shards: a content hash of each folder."""
    return {"scores": file_fingerprint(scores_dir), "telemetry": file_fingerprint(Path(run_dir) / "telemetry")}


def require_same_signals(scores_dir: str | Path, run_dir: str | Path, planned: dict[str, str]) -> None:
    """Refuse to commit verdicts made from signals that a score or training run replaced during this run."""
    now = signals_fingerprint(scores_dir, run_dir)
    where = {"scores": str(scores_dir), "telemetry": str(Path(run_dir) / "telemetry")}
    changed = [where[k] for k in planned if now[k] != planned[k]]
    if changed:
        raise AssayError(f"{' and '.join(changed)}: changed during this run (a newer `assay score` or training "
                         "run wrote there); nothing was published; rerun this stage")


def read_scores(scores_dir: str | Path) -> pa.Table:
    """The scoring pass's rows (`assay score`'s output); a clear error when there are none."""
    return pa.concat_tables([pq.read_table(p) for p in _score_parts(scores_dir)], promote_options="default")


def read_run_telemetry(run_dir: str | Path) -> pa.Table:
    """A training run's telemetry; a clear error when the run has none."""
    return pa.concat_tables([pq.read_table(p, schema=TELEMETRY_SCHEMA) for p in _telemetry_parts(run_dir)])


def verdicts(scores: pa.Table, telemetry: pa.Table | None, params: DynamicParams) -> pa.Table:
    """One row per document either input mentions: id, kept, reason, scores (map), detail, alignment."""
    try:
        signals = signals_for(scores, telemetry, params)
    except ValueError as exc:  # a scores or telemetry table off its contract
        raise AssayError(str(exc)) from None
    result = judge(signals, build_dynamic_filters(params))
    n = signals.num_rows
    reference = np.asarray(signals.column("reference").to_numpy(zero_copy_only=False), dtype=bool)
    skipped = np.asarray(signals.column("skipped_draws").to_numpy(zero_copy_only=False))
    detail: list[str | None] = [None] * n
    for i in np.flatnonzero(reference):
        detail[i] = REFERENCE
    for i in np.flatnonzero(result.keep & ~reference & (skipped > 0)):
        detail[i] = f"in {int(skipped[i])} skipped step(s); the step stood out, not the document"
    return pa.table({
        "id": signals.column("id"),
        "kept": pa.array(result.keep),
        "reason": pa.array(result.reason, pa.string()),
        "scores": scores_column(result.scores, n),
        "detail": pa.array(detail, pa.string()),
        ALIGNMENT: signals.column("alignment"),
    })


def dynamic_unit(index: int, shard: str, out_dir: str, params: Params, key: str, judged: pa.Table,
                 progress: Callable[[int], None] | None = None) -> UnitResult:
    """Write one input shard's kept documents and every document's decision (resumable)."""
    done = finished_unit(out_dir, key)
    if done is not None:
        return done
    started = time.perf_counter()
    parquet = open_planned(shard, key)
    schema = with_score_column(parquet.schema_arrow, ALIGNMENT)
    table = {name: judged.column(name).combine_chunks() for name in judged.column_names}
    writer = UnitWriter(out_dir, key, schema, target_bytes=params.io.shard_bytes)
    try:
        for batch in shard_batches(parquet, shard, batch_size=params.io.batch_rows, max_bytes=params.io.batch_bytes):
            n = batch.num_rows
            where = pc.index_in(batch.column("id"), value_set=table["id"])
            found = np.asarray(pc.is_valid(where).to_numpy(zero_copy_only=False), dtype=bool)
            rows = pc.fill_null(where, 0)
            kept = np.where(found, table["kept"].take(rows).to_numpy(zero_copy_only=False), True).astype(bool)
            reason = pc.if_else(pa.array(found), table["reason"].take(rows), pa.nulls(n, pa.string()))
            scores = pc.if_else(pa.array(found), table["scores"].take(rows),
                                pa.nulls(n, DECISION_SCHEMA.field("scores").type))
            detail = pc.if_else(pa.array(found), table["detail"].take(rows),
                                pa.array([NOT_SCORED] * n, pa.string()))
            alignment = pc.if_else(pa.array(found), table[ALIGNMENT].take(rows), pa.nulls(n, pa.float64()))
            out = batch if ALIGNMENT in batch.schema.names else batch.append_column(ALIGNMENT, alignment)
            writer.docs.write(out.filter(pa.array(kept)))
            writer.write_decisions(pa.RecordBatch.from_arrays(
                [batch.column("id"), pa.array([STAGE] * n, pa.string()), pa.array(kept), reason, scores, detail],
                schema=DECISION_SCHEMA))
            writer.counts["not_scored"] += int((~found).sum())
            if progress:
                progress(n)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(bytes_in=Path(shard).stat().st_size, seconds=time.perf_counter() - started)
