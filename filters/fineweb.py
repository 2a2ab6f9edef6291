"""FineWeb's own quality rules (Penedo et al. 2024), as datatrove's `FineWebQualityFilter`.

Over the non-blank lines of `text.split("\\n")` (lines are not stripped, so
a line with trailing spaces does not "end in punctuation"):

- `empty`: no non-blank line;
- `line_punct_ratio`: lines ending in a sentence terminal (Unicode
  Sentence_Terminal) must be at least `line_punct_thr`;
- `short_line_ratio`: lines of at most `short_line_length` characters may be
  at most `short_line_thr`;
- `char_dup_ratio`: characters of lines that repeat an earlier line, over the
  text's characters other than newlines, at most `char_duplicates_ratio`;
- `list_ratio`: newlines per word (spaCy English words) at most `new_line_ratio`.

Checked in that order; the first failure is the reason.

One difference from FineWeb and datatrove, on by default
(`static.heuristics.reflow`): the lines are those of the text with its
hard-wrapped paragraphs joined (`filters.text_units.reflow_hard_wrapped`),
since these rules take a line to be a web extraction's paragraph; a line
of a README wrapped at 72-80 columns usually ends mid-sentence.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import FineWebQualityParams
from filters.base import FilterResult
from filters.text_units import (
    TERMINAL_PUNCTUATION,
    WS_CLASS,
    above,
    batch_text,
    below,
    bool_array,
    ratio,
    regex_escape_class,
    verdicts,
)

_ENDS_IN_TERMINAL = f"[{regex_escape_class(TERMINAL_PUNCTUATION)}]$"


class FineWebQualityFilter:
    name = "fineweb_quality"

    def __init__(self, params: FineWebQualityParams | None = None, reflow: tuple[int, int] | None = None,
                 markup: bool = False) -> None:
        self.params = params or FineWebQualityParams()
        #: (min_width, max_width): judge lines after `reflow_hard_wrapped` (ours); None: as FineWeb.
        self.reflow = reflow
        #: Judge the text with its markup taken out (`filters.markup`, ours), before any reflow.
        self.markup = markup

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        p = self.params
        units = batch_text(batch)
        if self.markup:
            units = units.plain()
        if self.reflow is not None:
            units = units.reflowed(*self.reflow)
        all_lines = units.newline_lines
        lines = all_lines.take(bool_array(pc.match_substring_regex(all_lines.values, f"[^{WS_CLASS}]")))
        n_lines = lines.counts
        punct = bool_array(pc.match_substring_regex(lines.values, _ENDS_IN_TERMINAL))
        short = lines.length <= p.short_line_length
        dup = lines.duplicates()
        newlines = units.count("\n")
        scores = {
            "line_punct_ratio": ratio(lines.sum(punct), n_lines),
            "short_line_ratio": ratio(lines.sum(short), n_lines),
            "char_dup_ratio": ratio(lines.sum(np.where(dup, lines.length, 0)), units.length - newlines),
            "list_ratio": ratio(newlines, units.words.counts),
        }
        return verdicts(self.name, units.n, [
            ("empty", n_lines == 0),
            ("line_punct_ratio", below(scores["line_punct_ratio"], p.line_punct_thr)),
            ("short_line_ratio", above(scores["short_line_ratio"], p.short_line_thr)),
            ("char_dup_ratio", above(scores["char_dup_ratio"], p.char_duplicates_ratio)),
            ("list_ratio", above(scores["list_ratio"], p.new_line_ratio)),
        ], scores)
