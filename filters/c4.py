"""C4's heuristic rules (Raffel et al. 2020), as FineWeb applied them.

C4 was defined as a *cleaner*: it removes lines and only drops a page on a
few rules. datatrove's `C4QualityFilter` works the same way, rewriting the
document's text. Our filters never change text, so the line rules are
translated into a keep/drop verdict like this (the verdict is datatrove's):

1. Every line (`str.splitlines()`, stripped) is checked in datatrove's order.
   A line is *removed* when it has a word (whitespace-separated) longer than
   `max_word_length`, when it lacks terminal punctuation (only with
   `filter_no_terminal_punct`, off by default: FineWeb's change), or when it
   has fewer than `min_words_per_line` words. Wikipedia-style citations
   (`[1]`, `[edit]`, `[citation needed]`) are taken out of a line before the
   remaining checks, as datatrove does.
2. Lines that survive are checked, in order, for: "lorem ipsum" (any case),
   which drops the document (`c4:lorem_ipsum`); "javascript" (any case),
   which removes the line; a `{`, which drops the document
   (`c4:curly_bracket`); cookie/terms-of-use boilerplate, which removes the
   line. The first line that drops the document gives the reason.
3. The sentences of the lines that are left (spaCy's sentencizer rules, see
   `filters.text_units.sentence_counts`) must number at least
   `min_num_sentences` (`c4:too_few_sentences`).

`max_word_length`, `min_words_per_line` and `min_num_sentences` are turned
off by None (null in params.yaml) or, as in datatrove, by -1. Words within a
line are whitespace-separated, as in C4 and datatrove; sentences follow
spaCy's sentencizer rules, as datatrove counts them (C4 itself used NLTK's
Punkt, which needs a model download), whatever `static.heuristics.words` says.

One difference from C4 and datatrove, on by default (`static.heuristics.reflow`;
the filter's `reflow` argument): the lines judged are those of the text with
its hard-wrapped paragraphs joined (`filters.text_units.reflow_hard_wrapped`).
C4's rules take a line to be a paragraph, as it is in web extractions; in a
README wrapped at 72-80 columns most lines end mid-sentence and many are
under `min_words_per_line`. Text already in one-paragraph-per-line form is
unchanged.

So a kept document (without reflow) is one datatrove would have kept (with some lines cut);
the cut itself is reported, not applied: `c4:lines_removed_frac` is the
share of lines the cleaner would remove and `c4:sentences` the sentences it
would keep. A later stage that wants C4's cleaning can re-derive the kept
lines from these same rules.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import C4Params
from filters.base import FilterResult
from filters.text_units import (
    WORDS,
    Pieces,
    batch_text,
    bool_array,
    ratio,
    sentence_counts,
    verdicts,
)

CITATION_RE = r"\[\p{Nd}*\]|\[edit\]|\[citation needed\]"
POLICY_RE = "terms of use|privacy policy|cookie policy|uses cookies|use of cookies|use cookies"
#: A line "ends in terminal punctuation" when it ends in one of . ? ! " ' and not in "...".
TERMINAL_RE = "[.?!\"']$"


class C4Filter:
    name = "c4"

    def __init__(self, params: C4Params | None = None, reflow: tuple[int, int] | None = None,
                 markup: bool = False) -> None:
        self.params = params or C4Params()
        #: (min_width, max_width): judge lines after `reflow_hard_wrapped` (ours, see the docstring); None: as C4.
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
        n = units.n
        lines: Pieces = units.lines
        stripped = pc.utf8_trim_whitespace(lines.values)
        line_words = pc.utf8_split_whitespace(stripped)
        word_counts = np.asarray(pc.list_value_length(line_words), dtype=np.int64)

        removed = np.zeros(len(lines.values), dtype=bool)
        if p.max_word_length not in (None, -1):
            word_lengths = np.asarray(pc.utf8_length(pc.list_flatten(line_words)), dtype=np.int64)
            long_words = (word_lengths > p.max_word_length).astype(np.int64)
            ends = np.cumsum(word_counts)
            long_cum = np.concatenate([[0], np.cumsum(long_words)])
            removed |= (long_cum[ends] - long_cum[ends - word_counts]) > 0
        text = pc.replace_substring_regex(stripped, CITATION_RE, "")
        if p.filter_no_terminal_punct:
            ends_ok = bool_array(pc.match_substring_regex(text, TERMINAL_RE))
            ellipsis = bool_array(pc.ends_with(text, "..."))
            removed |= ~ends_ok | ellipsis
        if p.min_words_per_line not in (None, -1):
            removed |= word_counts < p.min_words_per_line

        def has(pattern: str, regex: bool = False, ignore_case: bool = True) -> np.ndarray:
            match = pc.match_substring_regex if regex else pc.match_substring
            return bool_array(match(text, pattern, ignore_case=ignore_case)) & ~removed

        line_no = np.arange(len(lines.values))
        fatal_lorem = has("lorem ipsum") if p.filter_lorem_ipsum else np.zeros_like(removed)
        javascript = has("javascript") if p.filter_javascript else np.zeros_like(removed)
        removed |= javascript & ~fatal_lorem
        fatal_curly = has("{", ignore_case=False) & ~fatal_lorem if p.filter_curly_bracket else np.zeros_like(removed)
        if p.filter_policy:
            removed |= has(POLICY_RE, regex=True) & ~fatal_lorem & ~fatal_curly
        fatal = fatal_lorem | fatal_curly
        kept = ~removed & ~fatal

        # The first fatal line of each row decides between lorem_ipsum and curly_bracket.
        first_fatal = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(first_fatal, lines.row[fatal], line_no[fatal])
        has_fatal = first_fatal < np.iinfo(np.int64).max
        lorem_first = np.zeros(n, dtype=bool)
        lorem_first[has_fatal] = fatal_lorem[first_fatal[has_fatal]]

        kept_idx = np.flatnonzero(kept)
        sentences = np.zeros(n, dtype=np.int64)
        if len(kept_idx):
            per_line = sentence_counts(WORDS.split(text.take(pa.array(kept_idx))))
            sentences = np.bincount(lines.row[kept_idx], weights=per_line, minlength=n).astype(np.int64)
        off = p.min_num_sentences in (None, -1)
        few_sentences = np.zeros(n, dtype=bool) if off else sentences < p.min_num_sentences

        scores = {
            "sentences": sentences,
            "lines_removed_frac": ratio(lines.sum(removed), lines.counts),
        }
        return verdicts(self.name, n, [
            ("lorem_ipsum", has_fatal & lorem_first),
            ("curly_bracket", has_fatal & ~lorem_first),
            ("too_few_sentences", few_sentences),
        ], scores)
