"""Tier 1's heuristic pre-filters as one chain.

`build_heuristics` makes the enabled filters from `static.heuristics` in
FineWeb's order (Gopher repetition, Gopher quality, C4, FineWeb quality),
with our key-value records rule (`filters.records`) after Gopher's;
`apply_chain` runs them over a batch as a cascade: a row is dropped by the
first filter that drops it, and that filter's reason is the row's reason.

Only natural-language rows (`kind == "text"`) are judged; code and any
other kind pass untouched (reason None, NaN scores), because the web-text
thresholds mean nothing for source code. Every filter scores every text row,
kept or not, so the decisions table shows all the numbers behind a verdict;
the work is shared (words, lines and paragraphs are computed once per batch
by `filters.text_units`).

Which filters judge which text is a per-source choice (`static.source_rules`,
`apply_by_source`; a key may be a shell pattern such as `doc-*`): a source
can be judged by a subset of the filters, never by none of them.

C4's and FineWeb's line rules were designed for web-page extractions, where
a line is a paragraph. Before them, hard-wrapped paragraphs are joined
(`static.heuristics.reflow`, `filters.text_units.reflow_hard_wrapped`): a
difference from the papers and datatrove (off in the datatrove comparison).

The heuristics score the text with its Markdown/reST/HTML markup taken out
(`static.heuristics.markup`, `filters.markup`): the rules were set on
extracted web text. Also ours, also off in the datatrove comparison.

Words are counted as the papers count them (`static.heuristics.words`,
see `filters.gopher`); with `words: datatrove`, filter by filter the
verdicts are datatrove's (tests/test_heuristics_datatrove.py). One
difference from a datatrove pipeline by design: there, C4 rewrites the text
(drops lines) and FineWeb quality judges the rewritten text; here no filter
changes text, so FineWeb quality judges the original. As a chain the
verdicts differ from datatrove's on about 1.5% of the benchmark sample
(documents whose C4 cleaning moves them across one of FineWeb's thresholds).
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import HeuristicsParams
from assay.schema import KIND_TEXT
from filters.base import Filter, FilterResult
from filters.c4 import C4Filter
from filters.fineweb import FineWebQualityFilter
from filters.gopher import GopherQualityFilter, GopherRepetitionFilter
from filters.records import RecordsFilter


#: Every heuristic filter, in FineWeb's order (the names `static.source_rules` may use).
FILTER_NAMES = ("gopher_repetition", "gopher_quality", "records", "c4", "fineweb_quality")


def build_heuristics(params: HeuristicsParams | None = None) -> list[Filter]:
    """The enabled heuristic filters, in the order `apply_chain` runs them."""
    params = params or HeuristicsParams()
    filters: list[Filter] = []
    markup = params.markup.enabled
    if params.gopher_repetition.enabled:
        filters.append(GopherRepetitionFilter(params.gopher_repetition, words=params.words, markup=markup))
    if params.gopher_quality.enabled:
        filters.append(GopherQualityFilter(params.gopher_quality, words=params.words, markup=markup))
    if params.records.enabled:
        filters.append(RecordsFilter(params.records))
    reflow = (params.reflow.min_width, params.reflow.max_width) if params.reflow.enabled else None
    if params.c4.enabled:
        filters.append(C4Filter(params.c4, reflow=reflow, markup=markup))
    if params.fineweb_quality.enabled:
        filters.append(FineWebQualityFilter(params.fineweb_quality, reflow=reflow, markup=markup))
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


def check_source_rules(filters: Sequence[Filter], source_rules: Mapping[str, Sequence[str]]) -> None:
    """Every listed source must be judged by at least one enabled filter, named correctly."""
    enabled = {f.name for f in filters}
    for source, names in source_rules.items():
        unknown = sorted(set(names) - set(FILTER_NAMES))
        if unknown:
            raise ValueError(f"source_rules[{source!r}]: unknown filter {unknown[0]!r} (known: {', '.join(FILTER_NAMES)})")
        if not enabled.intersection(names):
            raise ValueError(
                f"source_rules[{source!r}] = {list(names)} leaves the source with no enabled heuristic filter; "
                "every text source is judged by at least one (enabled: " + (", ".join(sorted(enabled)) or "none") + ")"
            )


def rules_for(source: str, source_rules: Mapping[str, Sequence[str]]) -> Sequence[str] | None:
    """The filter names `source_rules` gives `source`: its exact entry, else the first key that
    matches it as a shell pattern (`fnmatch`, in the order listed), else None (every filter)."""
    if source in source_rules:
        return source_rules[source]
    for key, names in source_rules.items():
        if any(c in key for c in "*?[") and fnmatch.fnmatchcase(source, key):
            return names
    return None


def apply_by_source(filters: Sequence[Filter], batch: pa.RecordBatch | pa.Table,
                    source_rules: Mapping[str, Sequence[str]]) -> FilterResult:
    """`apply_chain`, with the filters of each row's source (`rules_for`; unlisted sources: all of `filters`).

    Scores of a filter that did not judge a row are NaN.
    """
    n = batch.num_rows
    if not source_rules or "source" not in batch.schema.names or n == 0:
        return apply_chain(filters, batch)
    check_source_rules(filters, source_rules)
    sources = batch.column("source")
    if isinstance(sources, pa.ChunkedArray):
        sources = sources.combine_chunks()
    encoded = pc.dictionary_encode(pc.fill_null(sources, ""))
    # Rows whose sources share a rule set are judged together: one group per distinct choice.
    choice = [rules_for(s, source_rules) for s in encoded.dictionary.to_pylist()]
    keys = sorted({tuple(c) for c in choice if c is not None})
    group_of = np.array([-1 if c is None else keys.index(tuple(c)) for c in choice], dtype=np.int64)
    position = group_of[np.asarray(encoded.indices, dtype=np.int64)] if len(choice) else np.full(n, -1)
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    scores: dict[str, np.ndarray] = {}
    for which in np.unique(position).tolist():
        rows = np.flatnonzero(position == which)
        chosen = filters if which < 0 else [f for f in filters if f.name in keys[which]]
        sub = batch if len(rows) == n else batch.take(pa.array(rows, pa.int64()))
        result = apply_chain(chosen, sub)
        keep[rows] = result.keep
        for j, i in enumerate(rows.tolist()):
            reason[i] = result.reason[j]
        for key, values in result.scores.items():
            scores.setdefault(key, np.full(n, np.nan))[rows] = values
    return FilterResult(keep, reason, scores)
