"""Tier 1's heuristic pre-filters as one chain.

`build_heuristics` makes the enabled filters from `static.heuristics` in
FineWeb's order (Gopher repetition, Gopher quality, C4, FineWeb quality);
`apply_chain` runs them over a batch as a cascade: a row is dropped by the
first filter that drops it, and that filter's reason is the row's reason.

Only natural-language rows (`kind == "text"`) are judged; code and any
other kind pass untouched (reason None, NaN scores), because the web-text
thresholds mean nothing for source code. Every filter scores every text row,
kept or not, so the decisions table shows all the numbers behind a verdict;
the work is shared (words, lines and paragraphs are computed once per batch
by `filters.text_units`).

One difference from a datatrove pipeline by design: there, C4 rewrites the
text (drops lines) and FineWeb quality judges the rewritten text; here no
filter changes text, so FineWeb quality judges the original. Filter by
filter the verdicts are datatrove's; as a chain they differ on about 1% of
the demo sample (documents whose C4 cleaning moves them across one of
FineWeb's thresholds, mostly the punctuation and duplicate-line rules).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import HeuristicsParams
from assay.schema import KIND_TEXT
from filters.base import Filter, FilterResult
from filters.c4 import C4Filter
from filters.fineweb import FineWebQualityFilter
from filters.gopher import GopherQualityFilter, GopherRepetitionFilter


def build_heuristics(params: HeuristicsParams | None = None) -> list[Filter]:
    """The enabled heuristic filters, in the order `apply_chain` runs them."""
    params = params or HeuristicsParams()
    filters: list[Filter] = []
    if params.gopher_repetition.enabled:
        filters.append(GopherRepetitionFilter(params.gopher_repetition))
    if params.gopher_quality.enabled:
        filters.append(GopherQualityFilter(params.gopher_quality))
    if params.c4.enabled:
        filters.append(C4Filter(params.c4))
    if params.fineweb_quality.enabled:
        filters.append(FineWebQualityFilter(params.fineweb_quality))
    return filters


def apply_chain(filters: Sequence[Filter], batch: pa.RecordBatch | pa.Table) -> FilterResult:
    """Run `filters` over the text rows of `batch` as a cascade (see the module docstring)."""
    n = batch.num_rows
    if not filters or n == 0:
        return FilterResult.keep_all(n)
    if "kind" in batch.schema.names:
        is_text = np.asarray(pc.fill_null(pc.equal(batch.column("kind"), KIND_TEXT), False), dtype=bool)
    else:
        is_text = np.ones(n, dtype=bool)
    rows = np.flatnonzero(is_text)
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    scores: dict[str, np.ndarray] = {}
    if not len(rows):
        return FilterResult(keep, reason, scores)
    text_batch = batch if len(rows) == n else batch.filter(pa.array(is_text))
    alive = np.ones(len(rows), dtype=bool)
    for filt in filters:
        result = filt.apply(text_batch)
        dropped = np.flatnonzero(alive & ~result.keep)
        for i in dropped.tolist():
            reason[rows[i]] = result.reason[i]
        alive &= result.keep
        for key, values in result.scores.items():
            full = np.full(n, np.nan, dtype=np.float64)
            full[rows] = values
            scores[key] = full
    keep[rows] = alive
    return FilterResult(keep, reason, scores)
