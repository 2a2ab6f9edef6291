"""`assay quality train`: build a labelled set, train the head, evaluate it held out.

Two ways to get labels:
- the reference recipe (GPT-3, LLaMA): positives are documents of curated
  reference sources, negatives are sampled from the rest of the raw corpus's
  text, but only from the part of it chosen by `quality.negatives_share`
  (by a hash of the id, `assay.quality.pool.in_negatives_part`), so the
  rest of the pool is never trained on and tier 1 can be measured on it. On
  the demo corpus the reference is the Python reference topics and the man
  pages; the negatives come from the pool of installed software's files.
  The head's logit is then Platt-scaled (`quality.calibration`) on the
  pool's dev part, whose labels are by provenance (`assay.quality.pool`), so
  `quality` is a probability of good prose and `static.threshold` a
  probability cut; corpora without the pool's labelled sources get no
  calibration (the raw probability is the score).
- a labelled file (.jsonl, .csv or .parquet) with `label` and either `text`
  or `id` (ids are looked up in --data).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import pyarrow.compute as pc

from assay.config import FEATURES_WORDS, Params
from assay.encoder import Encoder
from assay.errors import AssayError
from assay.installation import installation
from assay.quality.features import SHAPE_FEATURES, head_features
from assay.quality.head import FINETUNED_ENCODER, HeadConfig, fit_logistic, save_head
from assay.quality.metrics import calibration_table, expected_calibration_error, precision_recall, roc_auc
from assay.quality.calibration import fit_platt
from assay.quality.pool import DEV, GOOD, POOL_LABELS, UNLABELLED, in_negatives_part, pool_labels, pool_parts
from assay.schema import KIND_TEXT
from assay.shards import iter_batches, require_dataset

#: Examples kept per class at most (reservoir-sampled), so that building the
#: set streams any corpus in bounded memory.
MAX_PER_CLASS = 20_000


@dataclass
class Examples:
    texts: list[str]
    labels: np.ndarray  # bool
    ids: list[str]
    #: Labelled documents the head is not trained on, for Platt scaling (the reference recipe: the
    #: pool's dev part, labels by provenance); None: no calibration.
    calibration: "Examples | None" = None


def reference_examples(data: str | Path, params: Params, exclude_sources: Collection[str] = ()) -> Examples:
    """Positives: text of the reference sources. Negatives: other raw text, sampled.

    `exclude_sources`: documents of these sources are read as if the corpus did not hold them (neither
    negatives nor calibration examples; the bench rebuilds the head before tier1f's extra pool kinds so).

    With `quality.provenance_labels` (ours, tier1f), the negatives part of the demo pool is read by its
    provenance labels (`assay.quality.pool.POOL_LABELS`): documents of good kinds are positives beside the
    reference set, those of unlabelled kinds are left out, only junk kinds (and text of sources the pool
    does not know) are negatives. GPT-3's recipe takes the whole unfiltered pool as negatives, its good
    prose included.
    """
    require_dataset(data)
    q = params.quality
    reference = pa.array(q.reference_sources, pa.string())
    excluded = pa.array(sorted(exclude_sources), pa.string())
    rng = random.Random(q.seed)
    positives: list[tuple[str, str]] = []
    negatives: list[tuple[str, str]] = []
    dev: list[tuple[str, str, bool]] = []
    seen_neg = 0
    for batch in iter_batches(data, columns=["id", "text", "kind", "source"]):
        batch = batch.filter(pc.equal(batch.column("kind"), KIND_TEXT))
        if len(excluded):
            batch = batch.filter(pc.invert(pc.is_in(batch.column("source"), value_set=excluded)))
        is_ref = pc.is_in(batch.column("source"), value_set=reference).to_numpy(zero_copy_only=False)
        ids, texts = batch.column("id").to_pylist(), batch.column("text").to_pylist()
        sources = batch.column("source").to_pylist()
        may_be_negative = in_negatives_part(ids, q.negatives_share, q.seed)
        if q.provenance_labels:
            provenance = pool_labels(sources, [len(t) for t in texts])
            for i in np.flatnonzero(may_be_negative & ~is_ref).tolist():
                if provenance[i] == GOOD and len(positives) < MAX_PER_CLASS:
                    positives.append((ids[i], texts[i]))
                if provenance[i] == GOOD or (provenance[i] == UNLABELLED and sources[i] in POOL_LABELS):
                    may_be_negative[i] = False
        if q.negatives_share + q.dev_share <= 1.0:  # else there is no dev part to calibrate on
            parts = pool_parts(ids, q.negatives_share, q.dev_share, q.seed)
            labels = pool_labels(sources, [len(t) for t in texts])
            for i in np.flatnonzero((parts == DEV) & (labels != UNLABELLED) & ~is_ref).tolist():
                if len(dev) < 2 * MAX_PER_CLASS:
                    dev.append((ids[i], texts[i], bool(labels[i] == GOOD)))
        for i, flag in enumerate(is_ref):
            if flag:
                if len(positives) < MAX_PER_CLASS:
                    positives.append((ids[i], texts[i]))
            elif may_be_negative[i]:  # reservoir sample: every negative equally likely
                seen_neg += 1
                if len(negatives) < MAX_PER_CLASS:
                    negatives.append((ids[i], texts[i]))
                else:
                    j = rng.randrange(seen_neg)
                    if j < MAX_PER_CLASS:
                        negatives[j] = (ids[i], texts[i])
    if not positives:
        raise AssayError(
            f"{data}: no text from the reference sources {q.reference_sources}; "
            "set quality.reference_sources or pass --labels FILE"
        )
    if not negatives:
        raise AssayError(f"{data}: no text outside the reference sources to sample negatives from "
                         f"(in the quality.negatives_share={q.negatives_share} part)")
    wanted = max(1, round(len(positives) * q.negatives_per_positive))
    negatives = sorted(negatives) if len(negatives) <= wanted else sorted(rng.sample(negatives, wanted))
    rows = [(i, t, True) for i, t in positives] + [(i, t, False) for i, t in negatives]
    dev_labels = np.array([r[2] for r in dev], dtype=bool)
    calibration = (Examples([r[1] for r in dev], dev_labels, [r[0] for r in dev])
                   if dev_labels.any() and not dev_labels.all() else None)
    return Examples([r[1] for r in rows], np.array([r[2] for r in rows]), [r[0] for r in rows], calibration)


def _read_table(path: Path) -> pa.Table:
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            return pq.read_table(path)
        if name.endswith(".csv"):
            return pcsv.read_csv(path)
        if name.endswith((".jsonl", ".json", ".ndjson")):
            return pjson.read_json(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise AssayError(f"{path}: cannot read labels ({str(exc).splitlines()[0]})") from None
    raise AssayError(f"{path}: labels must be .jsonl, .csv or .parquet")


def labelled_examples(path: str | Path, data: str | Path | None) -> Examples:
    path = Path(path)
    if not path.is_file():
        raise AssayError(f"{path}: " + ("a directory, not a labels file" if path.is_dir() else "no such labels file"))
    table = _read_table(path)
    names = table.column_names
    if "label" not in names or not ({"text", "id"} & set(names)):
        raise AssayError(f"{path}: needs a `label` column and `text` or `id` (has: {', '.join(names)})")
    labels = np.asarray(table.column("label").cast(pa.float64()).to_numpy(zero_copy_only=False)) >= 0.5
    if "text" in names:
        texts = table.column("text").cast(pa.string()).to_pylist()
        ids = table.column("id").cast(pa.string()).to_pylist() if "id" in names else [f"row:{i}" for i in range(len(texts))]
    else:
        if data is None:
            raise AssayError(f"{path}: has ids but no text; pass --data DIR to look the ids up")
        ids = table.column("id").cast(pa.string()).to_pylist()
        found: dict[str, str] = {}
        for batch in iter_batches(data, columns=["id", "text"], filter_ids=ids):
            found.update(zip(batch.column("id").to_pylist(), batch.column("text").to_pylist()))
        missing = [i for i in ids if i not in found]
        if missing:
            raise AssayError(f"{path}: {len(missing)} ids not found in {data} (first: {missing[0]})")
        texts = [found[i] for i in ids]
    if labels.all() or not labels.any():
        raise AssayError(f"{path}: labels must include both classes")
    return Examples(texts, labels, ids)


def split(n: int, labels: np.ndarray, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified train / held-out split of row indices."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in (True, False):
        rows = np.flatnonzero(labels == cls)
        rng.shuffle(rows)
        k = max(1, int(round(len(rows) * holdout))) if len(rows) > 1 else 0
        test.extend(rows[:k])
        train.extend(rows[k:])
    return np.sort(np.array(train, dtype=int)), np.sort(np.array(test, dtype=int))


def evaluate(labels: np.ndarray, probabilities: np.ndarray, threshold: float) -> dict[str, Any]:
    table = calibration_table(labels, probabilities)
    return {
        "n": int(len(labels)),
        "positives": int(labels.sum()),
        "auc": roc_auc(labels, probabilities),
        "at_threshold": precision_recall(labels, probabilities, threshold),
        "calibration": table,
        "ece": expected_calibration_error(table),
    }


def train_head(
    examples: Examples, params: Params, out: str | Path, *, recipe: str, finetune: bool = False,
    progress=None,
) -> dict[str, Any]:
    """Featurise (embed, or hash words), fit, evaluate held out, save. Returns the report (also in config.json)."""
    started = time.perf_counter()
    q = params.quality
    threshold = params.static.threshold
    train_rows, test_rows = split(len(examples.texts), examples.labels, q.holdout, q.seed)
    encoder_params = dataclasses.asdict(params.static.encoder)
    if q.features == FEATURES_WORDS:
        if finetune:
            raise AssayError("--finetune fine-tunes the encoder: it needs quality.features: embedding")
        shape = list(SHAPE_FEATURES) if q.shape else []
        features = head_features(examples.texts, q.hash_dim, q.markup, shape, q.shape_scale)
        train_x = features.index_select(0, torch.as_tensor(train_rows, dtype=torch.int64))
        test_x = features.index_select(0, torch.as_tensor(test_rows, dtype=torch.int64))
        head = fit_logistic(train_x, examples.labels[train_rows], l2=q.words_l2)
        dim, bf16, l2 = q.hash_dim + len(shape), None, q.words_l2
    else:
        encoder = Encoder(params.static.encoder)
        embeddings = encoder.encode(examples.texts, progress=progress)
        train_x, test_x = embeddings[train_rows], embeddings[test_rows]
        head = fit_logistic(train_x, examples.labels[train_rows], l2=q.l2)
        dim, bf16, l2 = encoder.dim, encoder.bf16, q.l2
    report: dict[str, Any] = {"head": {**evaluate(examples.labels[test_rows], head.probabilities(test_x), threshold),
                                       "scale": "raw"}}
    if finetune:
        from assay.quality.finetune import finetune_encoder

        encoder, head = finetune_encoder(encoder, head, [examples.texts[i] for i in train_rows],
                                         examples.labels[train_rows], epochs=q.finetune_epochs, lr=q.finetune_lr, seed=q.seed)
        out_encoder = Path(out) / FINETUNED_ENCODER
        encoder.model.save_pretrained(out_encoder)
        encoder.tokenizer.save_pretrained(out_encoder)
        test_embeddings = encoder.encode([examples.texts[i] for i in test_rows])
        report["finetuned"] = {**evaluate(examples.labels[test_rows], head.probabilities(test_embeddings), threshold),
                               "scale": "raw"}
        test_x = test_embeddings
        encoder_params["model"] = FINETUNED_ENCODER
    calibration = None
    if q.calibration:
        if examples.calibration is not None:
            cal = examples.calibration
            cal_x = (head_features(cal.texts, q.hash_dim, q.markup, shape, q.shape_scale) if q.features == FEATURES_WORDS
                     else encoder.encode(cal.texts))
            cal_logits, cal_labels = head.logits(cal_x), cal.labels
            fitted_on = "the pool's dev part (labels by provenance)"
        else:
            # No dev part (a labels file, or a corpus without the demo's pool): calibrate on the
            # head's own held-out split rather than leave a raw score that static.threshold,
            # a calibrated cut, would misread. Its held-out ECE is then not independent.
            cal_logits, cal_labels = head.logits(test_x), examples.labels[test_rows]
            fitted_on = "the head's held-out split (no dev part; its ECE below is not independent)"
        try:
            platt = fit_platt(cal_logits, cal_labels)
            calibration = platt.to_dict()
            report["calibration"] = {**calibration, "fitted_on": fitted_on}
            # The held-out numbers on the scale the stage scores with (static.threshold is a calibrated cut).
            key = "finetuned" if finetune else "head"
            report[key] = {**evaluate(examples.labels[test_rows], platt(head.logits(test_x)), threshold),
                           "scale": "calibrated"}
        except ValueError as exc:  # e.g. a dev part too small to rank its classes: the score stays raw
            report["calibration"] = {"skipped": str(exc)}
    final = report["finetuned" if finetune else "head"]
    config = HeadConfig(
        encoder=encoder_params,
        dim=dim,
        threshold=threshold,
        recipe=recipe,
        finetuned=finetune,
        metrics=final,
        training={
            "examples": len(examples.texts),
            "train": int(len(train_rows)),
            "held_out": int(len(test_rows)),
            "positives": int(examples.labels.sum()),
            "l2": l2,
            "seed": q.seed,
            "seconds": round(time.perf_counter() - started, 2),
            "trained_at": datetime.now(timezone.utc).isoformat(),
            "bf16": bf16,
        },
        features=q.features,
        calibration=calibration,
        markup=q.markup and q.features == FEATURES_WORDS,
        shape=shape if q.features == FEATURES_WORDS else [],
        shape_scale=q.shape_scale,
        installation=installation(),
    )
    save_head(out, head, config)
    return {**report, "training": config.training, "out": str(out), "recipe": recipe}


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=float)
