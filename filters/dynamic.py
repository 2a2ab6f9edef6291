"""Tier 2: judge documents by what training made of them.

Two inputs, both written by `training/` and read back here as Arrow tables:

- the scoring pass (`assay score`, assay.schema.SCORE_SCHEMA): one row per
  document and checkpoint, with the document's loss, gradient norm and the
  cosine (`alignment`) between its gradient and a clean reference set's;
- round 0's telemetry (assay.schema.TELEMETRY_SCHEMA): one row per document
  per step it was drawn in, with its loss, gradient norm and skip flag.

`document_signals` folds both into one row per document (SIGNAL_COLUMNS).
Each filter below then answers keep/drop for every row of that table, in
the manner of filters/base.py, with reasons `dynamic:<signal>`. Filters that
compare a document with its peers (the robust z-scores) need the whole table
in one batch: the statistics are per stratum, over every judged document.

Reference documents (`reference` true: the clean set whose gradient is the
yardstick) are never judged and are left out of every statistic, so the
yardstick cannot judge itself. A document with no value for a signal is not
judged by it.

Outliers use the modified z-score of Iglewicz & Hoaglin (1993),
z = (x - median) / (1.4826 MAD), whose published cut-off is |z| > 3.5; when
the MAD is zero, 1.2533 times the mean absolute deviation stands in (their
fallback). Strata are kind x language x length band, so man pages are
compared with man pages and Python with Python (see `strata`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from filters.base import FilterResult

NAME = "dynamic"

#: z = (x - median) / (MAD_SCALE * MAD) is a standard normal z for normal data.
MAD_SCALE = 1.4826
#: Iglewicz & Hoaglin's stand-in when the MAD is 0: MEAN_AD_SCALE * mean |x - median|.
MEAN_AD_SCALE = 1.2533

#: One row per document: what `document_signals` returns and the filters read.
SIGNAL_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("kind", pa.string()),
    pa.field("lang", pa.string()),
    pa.field("reference", pa.bool_(), nullable=False),
    pa.field("tokens", pa.float64()),            # target tokens scored (last checkpoint)
    pa.field("checkpoints", pa.int64()),         # scored checkpoints averaged
    pa.field("alignment", pa.float64()),         # mean cosine with the reference gradient over them
    pa.field("alignment_last", pa.float64()),    # the same at the last checkpoint only
    pa.field("loss", pa.float64()),              # scoring-pass loss, last checkpoint
    pa.field("grad_norm", pa.float64()),         # scoring-pass gradient norm, last checkpoint
    pa.field("reducible_loss", pa.float64()),    # loss - ref_loss (RHO-LOSS); NaN without a reference model
    pa.field("order_rise", pa.float64()),        # relative loss rise with each row's tokens shuffled, last checkpoint
    pa.field("non_finite", pa.bool_(), nullable=False),
    pa.field("draws", pa.int64()),               # training steps that drew the document
    pa.field("skipped_draws", pa.int64()),       # ... of which skipped (spike) steps
    pa.field("skipped_step_z", pa.float64()),    # its highest z within a skipped step (NaN when none)
    pa.field("anomalous_draws", pa.int64()),     # draws where it stood out within its own step
    pa.field("loss_drop", pa.float64()),         # 1 - last draw's loss / first draw's loss
])


# ------------------------------------------------------------------ statistics
def robust_z(values: np.ndarray, groups: np.ndarray, judged: np.ndarray) -> np.ndarray:
    """Modified z-score of each value within its group, from the judged, finite members.

    Rows that are not judged still get a z (against their group's judged
    members); rows whose group has no judged finite member, or whose value is
    NaN, get NaN.
    """
    values = np.asarray(values, dtype=np.float64)
    z = np.full(len(values), np.nan)
    usable = judged & np.isfinite(values)
    # One sort, then a slice per group: telemetry has a group per training step.
    _, inverse = np.unique(np.asarray(groups), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    for members in np.split(order, bounds):
        base = values[members[usable[members]]]
        if len(base) == 0:
            continue
        median = np.median(base)
        spread = MAD_SCALE * np.median(np.abs(base - median))
        if spread == 0:
            spread = MEAN_AD_SCALE * np.mean(np.abs(base - median))
        with np.errstate(divide="ignore", invalid="ignore"):
            diff = values[members] - median
            z[members] = np.where(spread > 0, diff / spread, np.where(diff == 0, 0.0, np.sign(diff) * np.inf))
    return z


def length_band(tokens: np.ndarray, edges: list[int]) -> np.ndarray:
    """0 for documents under edges[0] tokens, 1 up to edges[1], and so on."""
    return np.searchsorted(np.asarray(sorted(edges), dtype=np.float64), np.nan_to_num(tokens), side="right")


def strata(kind: np.ndarray, lang: np.ndarray, tokens: np.ndarray, edges: list[int] | None, min_docs: int,
           judged: np.ndarray) -> np.ndarray:
    """Each document's stratum: kind/lang/length band, or the finest coarser level with enough documents.

    A stratum of fewer than `min_docs` judged documents has no stable median
    or MAD, so its members fall back to kind/band, then kind, then "all".
    `edges` None: kind alone (or "all").
    """
    kind = np.array(["?" if k is None else str(k) for k in kind], dtype=object)
    lang = np.array(["?" if v is None else str(v) for v in lang], dtype=object)
    band = np.array([f"len{b}" for b in length_band(tokens, edges or [])], dtype=object)
    levels = [np.full(len(kind), "all", dtype=object), kind, kind + "/" + band, kind + "/" + lang + "/" + band]
    if edges is None:
        levels = levels[:2]
    chosen = levels[0].copy()
    for level in levels[1:]:
        keys, inverse = np.unique(level.astype(str), return_inverse=True)
        counts = np.bincount(inverse[judged], minlength=len(keys))
        big = counts[inverse] >= min_docs
        chosen[big] = level[big]
    return chosen


# ------------------------------------------------------------------ the signals
#: The columns read from each input, with their contract types (assay.schema's
#: SCORE_SCHEMA and TELEMETRY_SCHEMA); other columns are ignored.
SCORE_COLUMNS = {"step": pa.int64(), "sample_id": pa.string(), "kind": pa.string(), "lang": pa.string(),
                 "tokens": pa.int32(), "loss": pa.float32(), "grad_norm": pa.float32(), "alignment": pa.float32(),
                 "reference": pa.bool_()}
OPTIONAL_SCORE_COLUMNS = {"ref_loss": pa.float32(), "order_rise": pa.float32()}
TELEMETRY_COLUMNS = {"step": pa.int64(), "sample_id": pa.string(), "loss": pa.float32(), "grad_norm": pa.float32(),
                     "tokens": pa.int32(), "flagged": pa.bool_(), "reason": pa.string()}


def _conform(table: pa.Table, what: str, required: dict[str, pa.DataType],
             optional: dict[str, pa.DataType] | None = None) -> pa.Table:
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; expected {sorted(required)}")
    columns = {**required, **{k: v for k, v in (optional or {}).items() if k in table.column_names}}
    try:
        return pa.table({name: pc.cast(table.column(name), dtype) for name, dtype in columns.items()})
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ValueError(f"{what}: a column does not have its contract type ({exc})") from None


def _column(table: pa.Table, name: str, dtype=np.float64) -> np.ndarray:
    col = table.column(name)
    if pa.types.is_null(col.type):
        return np.full(len(col), np.nan)
    if pa.types.is_floating(col.type) or pa.types.is_integer(col.type):
        return np.asarray(pc.fill_null(pc.cast(col, pa.float64()), np.nan).to_numpy(zero_copy_only=False), dtype=dtype)
    return np.asarray(col.to_numpy(zero_copy_only=False))


def _group_last(order_key: np.ndarray, inverse: np.ndarray, n: int) -> np.ndarray:
    """Row index of each group's row with the largest `order_key`."""
    order = np.lexsort((order_key, inverse))
    last = np.full(n, -1)
    last[inverse[order]] = order  # later assignments (larger keys) win
    return last


def _group_first(order_key: np.ndarray, inverse: np.ndarray, n: int) -> np.ndarray:
    order = np.lexsort((-order_key, inverse))
    first = np.full(n, -1)
    first[inverse[order]] = order
    return first


def _score_signals(scores: pa.Table, checkpoints: list[int] | None) -> dict[str, np.ndarray]:
    steps = _column(scores, "step").astype(np.int64)
    if checkpoints is not None:
        missing = sorted(set(checkpoints) - set(steps.tolist()))
        if missing:
            raise ValueError(f"dynamic.checkpoints names step(s) {missing} that the scores do not have "
                             f"(scored: {sorted(set(steps.tolist()))})")
        rows = np.isin(steps, checkpoints)
        scores, steps = scores.filter(pa.array(rows)), steps[rows]
    ids, inverse = np.unique(np.asarray(scores.column("sample_id").to_pylist(), dtype=object).astype(str),
                             return_inverse=True)
    n = len(ids)
    loss, norm, align = (_column(scores, c) for c in ("loss", "grad_norm", "alignment"))
    bad = ~(np.isfinite(loss) & np.isfinite(norm) & np.isfinite(align))
    ok = ~bad
    count = np.bincount(inverse[ok], minlength=n)
    total = np.bincount(inverse[ok], weights=align[ok], minlength=n)
    last = _group_last(steps, inverse, n)
    ref_loss = _column(scores, "ref_loss") if "ref_loss" in scores.column_names else np.full(len(steps), np.nan)
    rise = _column(scores, "order_rise") if "order_rise" in scores.column_names else np.full(len(steps), np.nan)
    kind = np.asarray(scores.column("kind").to_pylist(), dtype=object)
    lang = np.asarray(scores.column("lang").to_pylist(), dtype=object)
    reference = np.asarray(pc.fill_null(scores.column("reference"), False).to_numpy(zero_copy_only=False), dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_align = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return {
        "id": ids, "kind": kind[last], "lang": lang[last], "reference": reference[last],
        "tokens": _column(scores, "tokens")[last], "checkpoints": count.astype(np.int64),
        "alignment": mean_align, "alignment_last": align[last], "loss": loss[last], "grad_norm": norm[last],
        "reducible_loss": loss[last] - ref_loss[last], "order_rise": rise[last],
        "non_finite": np.bincount(inverse[bad], minlength=n) > 0,
    }


def _within_step_z(steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each row's modified z-score among the documents of its own step."""
    return robust_z(values, steps, np.ones(len(values), dtype=bool))


def _telemetry_signals(telemetry: pa.Table, anomaly_z: float, min_gap: int) -> dict[str, np.ndarray]:
    steps = _column(telemetry, "step").astype(np.int64)
    ids, inverse = np.unique(np.asarray(telemetry.column("sample_id").to_pylist(), dtype=object).astype(str),
                             return_inverse=True)
    n = len(ids)
    loss, norm = _column(telemetry, "loss"), _column(telemetry, "grad_norm")
    reasons = np.asarray(pc.fill_null(telemetry.column("reason"), "").to_pylist(), dtype=object).astype(str)
    flagged = np.asarray(pc.fill_null(telemetry.column("flagged"), False).to_numpy(zero_copy_only=False), dtype=bool)
    skipped = flagged & np.char.startswith(reasons, "skipped_step")
    # A document stands out within its step when its loss or gradient norm is
    # far above its batch-mates'; when the whole step is high, none does.
    z = np.fmax(_within_step_z(steps, loss), _within_step_z(steps, norm))
    bad = ~np.isfinite(loss) | (~np.isnan(norm) & ~np.isfinite(norm))
    skipped_z = np.full(n, -np.inf)
    np.maximum.at(skipped_z, inverse[skipped], np.nan_to_num(z[skipped], nan=-np.inf, posinf=np.inf))
    skipped_z[np.isneginf(skipped_z)] = np.nan
    first, last = _group_first(steps, inverse, n), _group_last(steps, inverse, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        drop = 1.0 - loss[last] / loss[first]
    drop[(steps[last] - steps[first]) < max(min_gap, 1)] = np.nan
    return {
        "id": ids, "draws": np.bincount(inverse, minlength=n).astype(np.int64),
        "skipped_draws": np.bincount(inverse[skipped], minlength=n).astype(np.int64),
        "skipped_step_z": skipped_z,
        "anomalous_draws": np.bincount(inverse[np.nan_to_num(z, nan=-np.inf) > anomaly_z], minlength=n).astype(np.int64),
        "loss_drop": drop, "non_finite": np.bincount(inverse[bad], minlength=n) > 0,
    }


def document_signals(scores: pa.Table | None, telemetry: pa.Table | None, *, checkpoints: list[int] | None = None,
                     anomaly_z: float = 3.5, min_gap: int = 50) -> pa.Table:
    """One row per document seen by either input (SIGNAL_SCHEMA).

    `checkpoints`: the scored steps to average alignment over (None: all).
    `anomaly_z`: the within-step z above which a draw counts as anomalous.
    `min_gap`: the fewest steps between a document's first and last draw for
    its loss drop to be measured.
    """
    parts = []
    if scores is not None and scores.num_rows:
        parts.append(_score_signals(_conform(scores, "scores", SCORE_COLUMNS, OPTIONAL_SCORE_COLUMNS), checkpoints))
    if telemetry is not None and telemetry.num_rows:
        parts.append(_telemetry_signals(_conform(telemetry, "telemetry", TELEMETRY_COLUMNS), anomaly_z, min_gap))
    if not parts:
        return SIGNAL_SCHEMA.empty_table()
    ids = np.unique(np.concatenate([p["id"] for p in parts]))
    n = len(ids)
    columns: dict[str, np.ndarray] = {"id": ids, "non_finite": np.zeros(n, dtype=bool), "reference": np.zeros(n, dtype=bool)}
    for field_ in SIGNAL_SCHEMA:
        if field_.name in columns:
            continue
        if pa.types.is_integer(field_.type):
            columns[field_.name] = np.zeros(n, dtype=np.int64)
        elif pa.types.is_floating(field_.type):
            columns[field_.name] = np.full(n, np.nan)
        else:
            columns[field_.name] = np.full(n, None, dtype=object)
    for part in parts:
        where = np.searchsorted(ids, part["id"])
        for name, values in part.items():
            if name == "id":
                continue
            if name == "non_finite":
                columns[name][where] |= values
            else:
                columns[name][where] = values
    return pa.Table.from_pydict({f.name: pa.array(columns[f.name].tolist() if f.type == pa.string() else columns[f.name],
                                                  type=f.type, from_pandas=True) for f in SIGNAL_SCHEMA},
                                schema=SIGNAL_SCHEMA)


# ------------------------------------------------------------------ the filters
def _np(batch: pa.RecordBatch | pa.Table, name: str) -> np.ndarray:
    return _column(batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch]), name)


def _judged(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    return ~np.asarray(pc.fill_null(batch.column("reference"), False).to_numpy(zero_copy_only=False), dtype=bool)


def _verdict(n: int, drops: list[tuple[np.ndarray, str]], scores: dict[str, np.ndarray]) -> FilterResult:
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    for mask, why in drops:
        for i in np.flatnonzero(mask & keep):
            reason[i] = why
        keep &= ~mask
    return FilterResult(keep, reason, scores)


def _threshold(value: float, where: np.ndarray) -> np.ndarray:
    return np.where(where, float(value), np.nan)


@dataclass
class NonFiniteFilter:
    """A NaN or infinite loss, gradient norm or alignment, in scoring or in training."""

    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        bad = np.asarray(batch.column("non_finite").to_numpy(zero_copy_only=False), dtype=bool) & _judged(batch)
        return _verdict(batch.num_rows, [(bad, f"{NAME}:non_finite")],
                        {"non_finite": np.where(bad, 1.0, np.nan)})


@dataclass
class AlignmentFilter:
    """The primary signal: the cosine between a document's gradient and the clean reference gradient.

    Averaged over the scored checkpoints. A document whose training step
    would not lower the reference set's loss (TracIn / LESS, first order)
    has a low or negative cosine. Three cut-offs, each optional:
    `threshold` on the cosine itself (`dynamic:alignment`); `low_z`, the
    modified z within the document's stratum (`dynamic:alignment_stratum_low`),
    which judges documentation against documentation: real kinds differ in
    their typical cosine more than garbage differs from the lowest of them;
    and `high_z` (`dynamic:alignment_stratum_high`): a document whose
    gradient points far more along the reference than its stratum's do is
    not of its stratum's kind (on planted data: prose labelled as code lines
    up with the reference like prose does, well above real code).
    """

    threshold: float | None = 0.0
    low_z: float | None = None
    high_z: float | None = None
    length_bands: tuple[int, ...] = (256, 2048)
    min_stratum_docs: int = 20
    #: "kind_lang_band": the z within `strata` (kind x language x length band); "kind": within kind
    #: alone (a kind of fewer than min_stratum_docs judged documents joins "all").
    z_strata: str = "kind_lang_band"
    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        n, judged = batch.num_rows, _judged(batch)
        value = _np(batch, "alignment")
        has = judged & np.isfinite(value)
        scores = {"alignment": value}
        drops = []
        if self.threshold is not None:
            drops.append((has & (value < self.threshold), f"{NAME}:alignment"))
            scores["alignment_threshold"] = _threshold(self.threshold, has)
        if self.low_z is not None or self.high_z is not None:
            bands = list(self.length_bands) if self.z_strata == "kind_lang_band" else None
            groups = strata(_np(batch, "kind"), _np(batch, "lang"), _np(batch, "tokens"), bands,
                            self.min_stratum_docs, has)
            z = robust_z(value, groups, has)
            scores["alignment_z"] = np.where(has, z, np.nan)
            if self.low_z is not None:
                scores["alignment_z_low_threshold"] = _threshold(-self.low_z, has)
                drops.append((has & (z < -self.low_z), f"{NAME}:alignment_stratum_low"))
            if self.high_z is not None:
                scores["alignment_z_high_threshold"] = _threshold(self.high_z, has)
                drops.append((has & (z > self.high_z), f"{NAME}:alignment_stratum_high"))
        return _verdict(n, drops, scores)


@dataclass
class StratumOutlierFilter:
    """`signal` far from its stratum's median: `dynamic:<signal>_high` or `dynamic:<signal>_low`.

    Both ends matter for loss: high is noise, encoding debris and shuffled
    text; very low is boilerplate, repeated licence headers and tables
    (perplexity pruning, Marion et al. 2023, finds the low end worth
    pruning too). Either end is switched off with None. `z_strata` as
    AlignmentFilter's: "kind_lang_band" (`strata`) or "kind".
    """

    signal: str
    high_z: float | None = 3.5
    low_z: float | None = 3.5
    length_bands: tuple[int, ...] = (256, 2048)
    min_stratum_docs: int = 20
    z_strata: str = "kind_lang_band"
    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        n, judged = batch.num_rows, _judged(batch)
        value = _np(batch, self.signal)
        has = judged & np.isfinite(value)
        if self.high_z is None and self.low_z is None:
            return FilterResult.keep_all(n)
        bands = list(self.length_bands) if self.z_strata == "kind_lang_band" else None
        groups = strata(_np(batch, "kind"), _np(batch, "lang"), _np(batch, "tokens"), bands, self.min_stratum_docs, has)
        z = robust_z(value, groups, has)
        scores = {self.signal: np.where(np.isfinite(value), value, np.nan), f"{self.signal}_z": np.where(has, z, np.nan)}
        drops = []
        if self.high_z is not None:
            drops.append((has & (z > self.high_z), f"{NAME}:{self.signal}_high"))
            scores[f"{self.signal}_z_high_threshold"] = _threshold(self.high_z, has)
        if self.low_z is not None:
            drops.append((has & (z < -self.low_z), f"{NAME}:{self.signal}_low"))
            scores[f"{self.signal}_z_low_threshold"] = _threshold(-self.low_z, has)
        return _verdict(n, drops, scores)


@dataclass
class SkippedStepFilter:
    """Documents of a skipped (spike) step that stood out within it (`dynamic:skipped_step`).

    When the whole step was high and the document was not far above its
    batch-mates (z <= `step_z`), the step is to blame, not the document: it
    is kept (the stage says so in the decision's detail).
    """

    step_z: float | None = 3.5
    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        n, judged = batch.num_rows, _judged(batch)
        skipped = _np(batch, "skipped_draws")
        z = _np(batch, "skipped_step_z")
        inside = judged & (skipped > 0)
        scores = {"skipped_draws": np.where(inside, skipped, np.nan), "skipped_step_z": np.where(inside, z, np.nan)}
        if self.step_z is None:
            return FilterResult(np.ones(n, dtype=bool), [None] * n, scores)
        scores["skipped_step_z_threshold"] = _threshold(self.step_z, inside)
        return _verdict(n, [(inside & (np.nan_to_num(z, nan=-np.inf) > self.step_z), f"{NAME}:skipped_step")], scores)


@dataclass
class RepeatAnomalyFilter:
    """Documents that stood out within their own step on `min_draws` or more draws (`dynamic:repeat_anomaly`)."""

    min_draws: int | None = 2
    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        n, judged = batch.num_rows, _judged(batch)
        count = _np(batch, "anomalous_draws")
        has = judged & (_np(batch, "draws") > 0)
        scores = {"anomalous_draws": np.where(has & (count > 0), count, np.nan)}
        if self.min_draws is None:
            return FilterResult(np.ones(n, dtype=bool), [None] * n, scores)
        scores["anomalous_draws_threshold"] = _threshold(self.min_draws, has & (count > 0))
        return _verdict(n, [(has & (count >= self.min_draws), f"{NAME}:repeat_anomaly")], scores)


@dataclass
class NotLearningFilter:
    """Loss that does not fall between a document's first and last draw (`dynamic:not_learning`).

    `loss_drop` = 1 - last / first, measured only when the draws are far
    enough apart (`document_signals`' min_gap); dropped under `min_drop`.
    """

    min_drop: float | None = 0.0
    name: str = NAME

    def apply(self, batch: pa.RecordBatch | pa.Table) -> FilterResult:
        n, judged = batch.num_rows, _judged(batch)
        drop = _np(batch, "loss_drop")
        has = judged & np.isfinite(drop)
        scores = {"loss_drop": np.where(has, drop, np.nan)}
        if self.min_drop is None:
            return FilterResult(np.ones(n, dtype=bool), [None] * n, scores)
        scores["loss_drop_threshold"] = _threshold(self.min_drop, has)
        return _verdict(n, [(has & (drop < self.min_drop), f"{NAME}:not_learning")], scores)


#: The score and threshold behind each reason that is not `dynamic:<signal>_high` or `_low`.
_EVIDENCE = {
    "non_finite": ("non_finite",),
    "alignment": ("alignment", "alignment_threshold"),
    "alignment_stratum_low": ("alignment_z", "alignment_z_low_threshold", "alignment"),
    "alignment_stratum_high": ("alignment_z", "alignment_z_high_threshold", "alignment"),
    "skipped_step": ("skipped_step_z", "skipped_step_z_threshold", "skipped_draws"),
    "repeat_anomaly": ("anomalous_draws", "anomalous_draws_threshold"),
    "not_learning": ("loss_drop", "loss_drop_threshold"),
}


def evidence(reason: str) -> tuple[str, ...]:
    """The `scores` keys behind a tier-2 reason, the value and the threshold it crossed first:
    `dynamic:loss_high` -> (`loss_z`, `loss_z_high_threshold`, `loss`). `assay why` and the
    report show these first; a reason's text does not name its keys (`alignment_stratum_low` is
    judged on `alignment_z`). Empty for another stage's reason."""
    group, _, what = reason.partition(":")
    if group != NAME or not what:
        return ()
    if what in _EVIDENCE:
        return _EVIDENCE[what]
    signal, _, side = what.rpartition("_")
    if side in ("high", "low") and signal:  # StratumOutlierFilter's
        return f"{signal}_z", f"{signal}_z_{side}_threshold", signal
    return ()


def judge(signals: pa.Table, filters: list) -> FilterResult:
    """The cascade over the whole signal table: a row's reason is the first filter's that drops it.

    Every filter sees every row (so `scores` holds every signal's value and
    threshold, also for kept rows and for rows an earlier filter dropped).
    """
    batch = signals.combine_chunks()
    n = batch.num_rows
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    scores: dict[str, np.ndarray] = {}
    for f in filters:
        result = f.apply(batch)
        for i in np.flatnonzero(keep & ~result.keep):
            reason[i] = result.reason[i]
        keep &= result.keep
        scores.update(result.scores)
    return FilterResult(keep, reason, scores)


def build_dynamic_filters(params) -> list:
    """The cascade for `params` (assay.config.DynamicParams), in the order reasons take precedence."""
    bands, min_docs = tuple(params.length_bands), params.min_stratum_docs
    return [
        NonFiniteFilter(),
        AlignmentFilter(params.alignment_threshold, params.alignment_low_z, params.alignment_high_z, bands, min_docs,
                        params.alignment_z_strata),
        # Measured and cut as the alignment's partner (one-sided, the same strata): BENCHMARKS.md tier 2.
        StratumOutlierFilter("order_rise", None, params.order_rise_low_z, bands, min_docs, params.alignment_z_strata),
        SkippedStepFilter(params.skipped_step_z),
        StratumOutlierFilter("loss", params.loss_high_z, params.loss_low_z, bands, min_docs),
        StratumOutlierFilter("grad_norm", params.grad_norm_high_z, None, bands, min_docs),
        StratumOutlierFilter("reducible_loss", None, params.reducible_low_z, bands, min_docs),
        RepeatAnomalyFilter(params.repeat_draws),
        NotLearningFilter(params.min_loss_drop),
    ]


def signals_for(scores: pa.Table | None, telemetry: pa.Table | None, params) -> pa.Table:
    """`document_signals` with the knobs of `params` (DynamicParams)."""
    return document_signals(scores, telemetry, checkpoints=params.checkpoints, anomaly_z=params.anomaly_z,
                            min_gap=params.min_drop_gap)
