"""The dynamic micro-batch scheduler of the pipeline: re-chosen between steps from measured load.

A step's batch is rows of unequal length (one document per row, never packed; the last
row of a document is padded). ``torch.distributed.pipelining`` gives every micro-batch of
one ``schedule.step`` the same shape, since each stage receives into buffers of one size.
So a *plan* is a list of passes: each pass is one pipeline flush of ``M`` micro-batches of
``m`` rows × ``width`` columns. Rows are sorted by length and cut into contiguous length
buckets; a pass over short rows runs narrow (columns past its longest row are dropped:
causal attention never looks right, so the kept positions compute exactly what they
would have), and rows missing to fill ``M × m`` are masked filler rows (zero loss, zero
gradient). Every micro-batch of a pass has the same padded token load ``m × width``:
equal load per micro-batch, not equal row count over the step.

The choice: each stage measures, per micro-batch, its forward and backward seconds and
the bytes it saved for backward. Per stage a least-squares fit of ``a + b·m·w + c·m·w²``
(the constant is the per-micro-batch overhead, the quadratic term attention) predicts a
micro-batch's time and activation bytes at any shape. A pass costs
``(M + fill) × slowest rank's (forward + backward) + M × overhead``: ``fill`` is the
pipeline's fill-and-drain in micro-batch slots, ``overhead`` what each micro-batch costs
besides its compute (P2P transfers, the schedule's own work). Both are fitted to the passes'
measured wall times (their residual over ``M ×`` compute); before two different passes are
seen, ``fill`` is the schedule's theoretical value and the rest of the residual is
overhead. Among all bucketings and micro-batch
counts the scheduler takes the one with the least predicted time whose predicted peak of
live activations stays under the memory cap. Pure and single-process: decisions are a
function of the lengths and the observations, so every rank, given the same gathered
observations, makes the same one.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

__all__ = ["FILL_SLOTS", "MicroBatchScheduler", "Pass", "Plan", "Sample", "static_plan"]

#: Theoretical fill + drain of a pass, in micro-batch slots of one rank's forward+backward,
#: for ``pp`` ranks with ``v`` stages each: GPipe and 1F1B idle ``pp - 1`` slots (Huang et al.
#: 2019; Narayanan et al. 2021); interleaving divides that by ``v`` (Narayanan et al. 2021);
#: zero-bubble schedules fill most of the rest with weight gradients (Qi et al. 2023), counted
#: here as a third of the interleaved bubble. Only a prior: measured passes replace it.
FILL_SLOTS: dict[str, Callable[[int, int], float]] = {
    "GPipe": lambda pp, v: pp - 1,
    "1F1B": lambda pp, v: pp - 1,
    "Interleaved1F1B": lambda pp, v: (pp - 1) / v,
    "InterleavedZeroBubble": lambda pp, v: (pp - 1) / v / 3,
    "ZBVZeroBubble": lambda pp, v: (pp - 1) / v / 3,
    "DualPipeV": lambda pp, v: (pp - 1) / v / 3,
}


@dataclass(frozen=True)
class Pass:
    """One pipeline flush: ``microbatches[i]`` are row indices of the step's batch (-1: filler)."""

    microbatches: tuple[tuple[int, ...], ...]
    width: int

    @property
    def n_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def rows(self) -> int:
        return len(self.microbatches[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_microbatches, self.rows, self.width)


@dataclass(frozen=True)
class Plan:
    passes: tuple[Pass, ...]
    predicted_seconds: float | None = None
    predicted_peak_bytes: float | None = None

    def rows(self) -> list[int]:
        return sorted(r for p in self.passes for mb in p.microbatches for r in mb if r >= 0)


def static_plan(n_rows: int, n_microbatches: int, width: int) -> Plan:
    """The static pipeline: the batch in its order, ``n_microbatches`` equal slices, full width."""
    if n_microbatches < 1:
        raise ValueError(f"pp_microbatches must be >= 1, not {n_microbatches}")
    m = math.ceil(n_rows / n_microbatches)
    rows = list(range(n_rows)) + [-1] * (m * n_microbatches - n_rows)
    return Plan((Pass(tuple(tuple(rows[i * m:(i + 1) * m]) for i in range(n_microbatches)), width),))


@dataclass(frozen=True)
class Sample:
    """One micro-batch on one stage: shape, measured seconds and bytes saved for backward."""

    stage: int
    rows: int
    width: int
    forward_s: float
    backward_s: float
    activation_bytes: float


def _features(rows: np.ndarray, width: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(rows, dtype=float), rows * width, rows * width.astype(float) ** 2], axis=1)


def _fit(rows, width, y, intercept: bool) -> np.ndarray:
    """Non-negative least squares on [1, m·w, m·w²], dropping terms the data cannot separate."""
    x = _features(np.asarray(rows), np.asarray(width))
    y = np.asarray(y, dtype=float)
    cols = [0, 1, 2] if intercept else [1, 2]
    distinct = len({(int(r) * int(w), int(r) * int(w) ** 2) for r, w in zip(rows, width)})
    if distinct < len(cols):  # too few shapes: proportional to tokens only
        cols = [1]
    coef = np.zeros(3)
    active = list(cols)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [c for c, s in zip(active, sol) if s > 0] or [1]
        if active == [1] and len(sol) == 1:
            coef[1] = max(sol[0], 0.0)
            return coef
    return coef


@dataclass
class MicroBatchScheduler:
    """Chooses each step's plan from the row lengths and what the stages measured.

    ``stage_rank[s]`` is the pp rank holding stage ``s``; ``memory_cap`` bounds the predicted
    peak of live activation bytes on any rank (None: the first observed plan's measured peak,
    so the dynamic plan never needs more activation memory than the static one did).
    ``trim`` False keeps every pass at full width: sparse attention's block layout assumes the
    whole sequence, and MoE's routing counts include padding positions in one process too.
    """

    schedule: str
    pp: int
    stage_rank: Sequence[int]
    full_width: int
    memory_cap: float | None = None
    trim: bool = True
    max_passes: int = 3
    #: Widths are rounded up to a multiple of this: each distinct pass shape costs a stage
    #: set-up (shape inference over P2P) the first time it is used.
    width_quantum: int = 16
    valid_microbatches: Callable[[int], bool] = lambda m: True
    #: Predicted gain (fraction) needed to leave the baseline plan.
    margin: float = 0.05
    history: int = 256
    samples: list[Sample] = field(default_factory=list)
    #: Observed passes: (micro-batches, rows, width, wall seconds).
    passes_seen: list[tuple[int, int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.schedule not in FILL_SLOTS:
            raise ValueError(f"unknown schedule {self.schedule!r}; one of {', '.join(FILL_SLOTS)}")
        self.v = len(self.stage_rank) // self.pp

    # ------------------------------------------------------------------ observing
    def observe(self, samples: Sequence[Sample], passes: Sequence[tuple[Pass, float]] = (),
                peak_bytes: float | None = None) -> None:
        """Record a step: its per-micro-batch samples, each pass with its wall seconds, and the
        peak of live activation bytes measured on the busiest rank."""
        self.samples.extend(samples)
        del self.samples[:-self.history]
        if self.memory_cap is None and peak_bytes is not None:
            self.memory_cap = float(peak_bytes)
        self.passes_seen.extend((p.n_microbatches, p.rows, p.width, float(wall)) for p, wall in passes)
        del self.passes_seen[:-32]

    def overheads(self, models=None) -> tuple[float, float]:
        """(fill slots, seconds per micro-batch) fitted to the observed passes' wall times."""
        prior = float(FILL_SLOTS[self.schedule](self.pp, self.v))
        if not self.passes_seen or not self.samples:
            return prior, 0.0
        models = models or self._models()
        n_mb = np.array([x[0] for x in self.passes_seen], dtype=float)
        busy = np.array([self._rank_time(models, r, w) for _, r, w, _ in self.passes_seen])
        residual = np.array([x[3] for x in self.passes_seen]) - n_mb * busy
        if len({(m, round(b, 12)) for m, b in zip(n_mb, busy)}) >= 2:
            x = np.stack([busy, n_mb], axis=1)
            sol, *_ = np.linalg.lstsq(x, residual, rcond=None)
            if (sol >= 0).all():
                return float(sol[0]), float(sol[1])
            if sol[0] < 0:  # no measurable fill: all of it is per-micro-batch overhead
                return 0.0, max(float(np.median(residual / n_mb)), 0.0)
        return prior, max(float(np.median((residual - prior * busy) / n_mb)), 0.0)

    def fill_slots(self) -> float:
        return self.overheads()[0]

    def _models(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per stage: coefficients of forward seconds, backward seconds, activation bytes."""
        out = {}
        for stage in sorted({s.stage for s in self.samples}):
            mine = [s for s in self.samples if s.stage == stage]
            r, w = [s.rows for s in mine], [s.width for s in mine]
            out[stage] = (_fit(r, w, [s.forward_s for s in mine], True),
                          _fit(r, w, [s.backward_s for s in mine], True),
                          _fit(r, w, [s.activation_bytes for s in mine], False))
        return out

    @staticmethod
    def _eval(coef: np.ndarray, rows: int, width: int) -> float:
        return float(coef @ np.array([1.0, rows * width, rows * width**2]))

    def _rank_time(self, models, rows: int, width: int) -> float:
        per_rank = np.zeros(self.pp)
        for stage, (f, b, _) in models.items():
            per_rank[self.stage_rank[stage]] += self._eval(f, rows, width) + self._eval(b, rows, width)
        return float(per_rank.max())

    def _rank_bytes(self, models, rows: int, width: int) -> float:
        per_rank = np.zeros(self.pp)
        for stage, (_, _, a) in models.items():
            per_rank[self.stage_rank[stage]] += self._eval(a, rows, width)
        return float(per_rank.max())

    def in_flight(self, n_microbatches: int) -> int:
        """Micro-batches whose activations a rank holds at once (per local stage): GPipe runs
        every forward before any backward; the others start backwards after ``pp`` forwards."""
        if self.schedule == "GPipe":
            return n_microbatches
        return min(n_microbatches, self.pp)

    # ------------------------------------------------------------------- planning
    def _width(self, longest: int) -> int:
        if not self.trim:
            return self.full_width
        q = self.width_quantum
        return min(self.full_width, max(q, math.ceil(longest / q) * q))

    def _best_pass(self, models, n_rows: Sequence[int], widths: Sequence[int], fill: float,
                   overhead: float) -> tuple[float, float, int] | None:
        """(seconds, peak bytes, M) of the best micro-batch count for a pass in which rank ``r`` of
        the data-parallel group runs ``n_rows[r]`` rows at ``widths[r]`` (one rank: pp alone). All
        run ``M`` micro-batches, a rank with fewer rows than ``M`` whole filler ones; the pass takes
        its slowest rank's time."""
        most = max(n_rows)
        best = None
        seen_m = set()
        for n_mb in range(1, most + 1):
            m = math.ceil(most / n_mb)
            if m in seen_m or not self.valid_microbatches(n_mb):
                continue
            if m * n_mb - most >= m:  # a whole micro-batch of filler on the busiest rank: never better
                continue
            seen_m.add(m)
            shapes = [(max(1, math.ceil(n / n_mb)), w) for n, w in zip(n_rows, widths)]
            seconds = max((n_mb + fill) * self._rank_time(models, mr, w) + n_mb * overhead for mr, w in shapes)
            peak = max(self.in_flight(n_mb) * self._rank_bytes(models, mr, w) for mr, w in shapes)
            # A hair of slack: the fitted bytes of the very plan that set the cap must fit it.
            if self.memory_cap is not None and peak > self.memory_cap * (1 + 1e-6):
                continue
            if best is None or (seconds, peak) < best[:2]:
                best = (seconds, peak, n_mb)
        return best

    def predict(self, plan: Plan) -> tuple[float, float]:
        """(seconds, peak live activation bytes) the models predict for ``plan``."""
        models = self._models()
        fill, overhead = self.overheads(models)
        seconds = sum((p.n_microbatches + fill) * self._rank_time(models, p.rows, p.width)
                      + p.n_microbatches * overhead for p in plan.passes)
        peak = max(self.in_flight(p.n_microbatches) * self._rank_bytes(models, p.rows, p.width) for p in plan.passes)
        return seconds, peak

    def plan(self, lengths: Sequence[int], baseline: Plan | None = None) -> Plan | None:
        """The fastest plan under the memory cap for rows of these lengths (input positions
        that carry a target); None until there are observations to predict from.

        With a ``baseline`` (the static plan), it is kept unless the best plan is predicted at
        least ``margin`` faster or the baseline breaks the cap: the fits come from wall clocks,
        and a plan switched on a noise-sized difference costs a stage set-up and buys nothing."""
        plans = self.plan_together([lengths], None if baseline is None else [baseline])
        return None if plans is None else plans[0]

    def plan_together(self, lengths: Sequence[Sequence[int]],
                      baselines: Sequence[Plan] | None = None) -> list[Plan] | None:
        """:meth:`plan` for the ranks of a data-parallel group, rank ``r`` holding rows of
        ``lengths[r]``: their plans run the same number of passes with the same micro-batch
        counts, so that each stage's FSDP/DDP collectives pair up across the ranks; rows and
        widths are each rank's own. Buckets are cut at common widths, a pass costs its slowest
        rank's time, and a rank with no rows in a bucket runs that pass on filler rows."""
        if not self.samples:
            return None
        models = self._models()
        fill, overhead = self.overheads(models)
        orders, widths = [], []
        for rank_lengths in lengths:
            order = sorted(range(len(rank_lengths)), key=lambda r: (-int(rank_lengths[r]), r))
            orders.append(order)
            widths.append([self._width(int(rank_lengths[r])) for r in order])
        # Cut widths: a bucket holds the rows at most one cut and above the next; cutting only at
        # widths some row has, so a bucket never splits rows that would run at the same width.
        negated = [[-w for w in ws] for ws in widths]  # ascending, for bisect
        every = sorted({w for ws in widths for w in ws}, reverse=True)
        cuts = every[1:] if self.trim else []
        best: tuple[float, float, list] | None = None
        for k in range(0, min(self.max_passes, len(cuts) + 1)):
            for chosen in combinations(cuts, k):
                bounds = [math.inf, *chosen, 0]
                total, peak, passes = 0.0, 0.0, []
                for high, low in zip(bounds, bounds[1:]):
                    # Each rank's rows of width in (low, high]: a slice of its rows sorted widest first.
                    # Never empty on every rank: a cut is some row's width, and the first bucket holds the widest.
                    spans = [(bisect_left(neg, -high), bisect_left(neg, -low)) for neg in negated]
                    rows = [order[a:b] for order, (a, b) in zip(orders, spans)]
                    pass_widths = [ws[a] if a < b else self._width(0) for ws, (a, b) in zip(widths, spans)]
                    found = self._best_pass(models, [len(r) for r in rows], pass_widths, fill, overhead)
                    if found is None:
                        break
                    total += found[0]
                    peak = max(peak, found[1])
                    passes.append((rows, pass_widths, found[2]))
                else:
                    if best is None or (total, peak) < best[:2]:
                        best = (total, peak, passes)
        if best is None:
            return None
        chosen = []
        for rank in range(len(lengths)):
            out = []
            for rows, pass_widths, n_mb in best[2]:
                mine = rows[rank]
                m = max(1, math.ceil(len(mine) / n_mb))
                mine = mine + [-1] * (m * n_mb - len(mine))
                out.append(Pass(tuple(tuple(mine[i * m:(i + 1) * m]) for i in range(n_mb)), pass_widths[rank]))
            chosen.append(Plan(tuple(out), best[0], best[1]))
        if baselines is not None:
            predicted = [self.predict(b) for b in baselines]
            seconds, peak = max(p[0] for p in predicted), max(p[1] for p in predicted)
            fits = self.memory_cap is None or peak <= self.memory_cap * (1 + 1e-6)
            if fits and best[0] * (1 + self.margin) >= seconds:
                return [Plan(b.passes, seconds, peak) for b in baselines]
        return chosen
