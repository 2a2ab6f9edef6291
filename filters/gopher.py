"""Gopher's quality and repetition rules (Rae et al. 2021, appendix A and table A1).

Both filters answer for a whole record batch at once: words, lines and
paragraphs come from `filters.text_units` (computed once per batch and
shared between filters), and every rule is a numpy expression over per-row
numbers. The rules, their order and their arithmetic follow datatrove's
`GopherQualityFilter` and `GopherRepetitionFilter`, which FineWeb used; a
row's reason is the first rule it fails, in that order. Every row gets every
score, whether it passed or not.

Words. The paper (appendix A) states its rules over the words of a
document, which we read as whitespace-separated strings; datatrove splits
words with spaCy's English tokenizer, so every punctuation mark is a
word of its own, without a letter, and punctuation-heavy prose fails the 80%
`alpha_words_frac` rule. `words="paper"` (the default, `static.heuristics.words`)
follows the paper: every rule that counts words (word count, mean length,
symbol ratios, alphabetic share, stop words, n-grams) sees whitespace-separated
words, all of them. `words="datatrove"` reproduces datatrove exactly (spaCy
tokens; the word count and mean length leave out all-symbol tokens), for
comparisons with it.

A threshold set to None (`null` in params.yaml) turns its rule off.
Otherwise thresholds are taken literally, where datatrove also turns a rule
off for 0 (a falsy threshold).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import GopherQualityParams, GopherRepetitionParams
from filters.base import FilterResult
from filters.text_units import (
    HAS_ALPHA,
    SYMBOL,
    WORDS_DATATROVE,
    WORDS_PAPER,
    WS_CLASS,
    Pieces,
    Tokens,
    above,
    batch_text,
    below,
    bool_array,
    group,
    per_row_sum,
    ratio,
    verdicts,
)


class GopherQualityFilter:
    """Gopher quality rules, in datatrove's order.

    - `word_count`: words within [min_doc_words, max_doc_words] (datatrove: words that are not all symbols);
    - `mean_word_length`: their mean length within [min_avg_word_length, max_avg_word_length];
    - `hash_word_ratio`, `ellipsis_word_ratio`: `#` and `...`/`…` per word (all
      words, symbols included) at most max_symbol_word_ratio;
    - `bullet_lines_frac`: lines starting with `•` or `-` at most max_bullet_lines_ratio;
    - `ellipsis_lines_frac`: lines ending in `...` or `…` at most max_ellipsis_lines_ratio;
    - `alpha_words_frac`: words with a letter at least min_alpha_words_ratio;
    - `stop_words`: at least min_stop_words distinct stop words (case-sensitive, as datatrove).

    Words are whitespace-separated (`words="paper"`) or spaCy English tokens
    (`words="datatrove"`), see the module docstring; lines are `str.splitlines()`.
    """

    name = "gopher_quality"

    def __init__(self, params: GopherQualityParams | None = None, words: str = WORDS_PAPER,
                 markup: bool = False) -> None:
        self.params = params or GopherQualityParams()
        self.words = _check_words(words)
        #: Score the text with its markup taken out (`filters.markup`, ours); False: the text as it is.
        self.markup = markup

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        p = self.params
        units = batch_text(batch)
        if self.markup:
            units = units.plain()
        words = units.words_for(self.words)
        offsets = words.offsets
        n_tokens = words.counts
        # datatrove leaves all-symbol tokens out of the count; the paper counts every word.
        symbol = (words.flags & SYMBOL) != 0 if self.words == WORDS_DATATROVE else np.zeros(len(words.ids), bool)
        n_words = n_tokens - per_row_sum(symbol, offsets)
        mean_length = ratio(per_row_sum(np.where(symbol, 0, words.length), offsets), n_words)
        hashes = ratio(units.count("#"), n_tokens)
        ellipses = ratio(units.count("...") + units.count("…"), n_tokens)

        lines = units.lines
        bullets = bool_array(pc.match_substring_regex(lines.values, f"^[{WS_CLASS}]*[•\\-]"))
        trailing_ellipsis = bool_array(pc.match_substring_regex(lines.values, f"(?:\\.\\.\\.|…)[{WS_CLASS}]*$"))
        bullet_frac = ratio(lines.sum(bullets), lines.counts)
        ellipsis_frac = ratio(lines.sum(trailing_ellipsis), lines.counts)

        alpha_frac = ratio(per_row_sum((words.flags & HAS_ALPHA) != 0, offsets), n_tokens)
        stop_words = _distinct_per_row(words, words.ids_of(p.stop_words))

        n = units.n
        rules = [
            ("word_count", below(n_words, p.min_doc_words) | above(n_words, p.max_doc_words)),
            ("mean_word_length", below(mean_length, p.min_avg_word_length) | above(mean_length, p.max_avg_word_length)),
            ("hash_word_ratio", above(hashes, p.max_symbol_word_ratio)),
            ("ellipsis_word_ratio", above(ellipses, p.max_symbol_word_ratio)),
            ("bullet_lines_frac", above(bullet_frac, p.max_bullet_lines_ratio)),
            ("ellipsis_lines_frac", above(ellipsis_frac, p.max_ellipsis_lines_ratio)),
            ("alpha_words_frac", below(alpha_frac, p.min_alpha_words_ratio)),
            ("stop_words", below(stop_words, p.min_stop_words)),
        ]
        scores = {
            "word_count": n_words,
            "mean_word_length": mean_length,
            "hash_word_ratio": hashes,
            "ellipsis_word_ratio": ellipses,
            "bullet_lines_frac": bullet_frac,
            "ellipsis_lines_frac": ellipsis_frac,
            "alpha_words_frac": alpha_frac,
            "stop_words": stop_words,
        }
        return verdicts(self.name, n, rules, scores)


def _check_words(words: str) -> str:
    if words not in (WORDS_PAPER, WORDS_DATATROVE):
        raise ValueError(f"words must be {WORDS_PAPER!r} or {WORDS_DATATROVE!r}, not {words!r}")
    return words


def _distinct_per_row(words: Tokens, wanted: np.ndarray) -> np.ndarray:
    """How many distinct tokens of `wanted` (vocabulary ids) each row contains."""
    n_rows = len(words.offsets) - 1
    hit = np.flatnonzero(np.isin(words.ids, wanted))
    if not len(hit):
        return np.zeros(n_rows, dtype=np.int64)
    pairs = np.unique(words.row[hit].astype(np.int64) * (int(wanted.max()) + 1) + words.ids[hit])
    return np.bincount(pairs // (int(wanted.max()) + 1), minlength=n_rows)


def _duplicate_stats(pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
    """Per row: how many pieces repeat an earlier one, and their characters."""
    dup = pieces.duplicates()
    return pieces.sum(dup), pieces.sum(np.where(dup, pieces.length, 0))


_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def _ngram_chars(words: Tokens, top_sizes: set[int], dup_sizes: set[int]) -> dict[tuple[str, int], np.ndarray]:
    """Per-row characters of the top n-gram (`("top", n)`) and of repeated n-grams (`("dup", n)`).

    n-grams are 64-bit polynomial hashes of their words' vocabulary ids,
    seeded with the row (a collision needs two different word sequences to
    agree on 64 bits; with a million n-grams per batch the chance is about
    1e-7). An n-gram can only repeat if its first n-1 words repeat, so each
    size only looks at the positions whose (n-1)-gram repeated: the work
    shrinks quickly with n on ordinary text.
    """
    n_rows = len(words.offsets) - 1
    out: dict[tuple[str, int], np.ndarray] = {}
    biggest = max(top_sizes | dup_sizes, default=0)
    size = len(words.ids)
    if biggest == 0:
        return out
    row = words.row
    row_start = words.offsets[:-1]
    row_len = words.counts
    pos_in_row = np.arange(size, dtype=np.int64) - row_start[row]
    char_cum = np.concatenate([[0], np.cumsum(words.length, dtype=np.int64)])
    token = words.ids.astype(np.uint64) + np.uint64(1)

    def chars(positions: np.ndarray, n: int, joiner: int) -> np.ndarray:
        return char_cum[positions + n] - char_cum[positions] + joiner * (n - 1)

    cand = np.arange(size, dtype=np.int64)
    hashes = row.astype(np.uint64) * np.uint64(0x100000001B3) ^ token
    for n in range(1, biggest + 1):
        if n > 1:
            valid = pos_in_row[cand] <= row_len[row[cand]] - n
            cand, hashes = cand[valid], hashes[valid]
            hashes = hashes * _HASH_MULTIPLIER + token[cand + n - 1]
        if len(cand):
            inverse, counts, first = group(hashes)
            repeated = counts[inverse] > 1
        else:
            first = inverse = counts = np.zeros(0, dtype=np.int64)
            repeated = np.zeros(0, dtype=bool)
        if n in top_sizes:
            top = np.zeros(n_rows, dtype=np.int64)
            # Without a repeated n-gram, the top one is the row's first (count 1).
            long_enough = row_len >= n
            top[long_enough] = chars(row_start[long_enough], n, joiner=1)
            multi = np.flatnonzero(counts > 1)
            if len(multi):
                first_pos = cand[first[multi]]
                rows = row[first_pos]
                order = np.lexsort((first_pos, -counts[multi], rows))
                lead = np.ones(len(order), dtype=bool)
                lead[1:] = rows[order][1:] != rows[order][:-1]
                best = order[lead]
                top[rows[best]] = counts[multi][best] * chars(first_pos[best], n, joiner=1)
            out[("top", n)] = top
        if n in dup_sizes:
            is_first = np.zeros(len(cand), dtype=bool)
            is_first[first] = True
            out[("dup", n)] = _greedy_duplicates(cand[repeated], is_first[repeated], inverse[repeated],
                                                 row, n, n_rows, lambda p: chars(p, n, joiner=0))
        cand, hashes = cand[repeated], hashes[repeated]
    return out


def _greedy_duplicates(pos: np.ndarray, is_first: np.ndarray, gram: np.ndarray, row: np.ndarray, n: int,
                       n_rows: int, chars: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Characters in repeated n-grams per row, scanning left to right as datatrove does.

    The scan remembers n-grams as it goes; an n-gram seen before counts its
    characters (words joined without spaces) and the scan jumps past it,
    otherwise it moves one word on. `pos` are the positions of n-grams that
    occur more than once (only they can count), in order. When no such
    position falls inside the jump of an earlier repeat, every non-first
    occurrence counts: that is most rows, done with numpy. The other rows
    are scanned in Python, over their repeated positions only.
    """
    out = np.zeros(n_rows, dtype=np.int64)
    if not len(pos):
        return out
    rows = row[pos]
    later = ~is_first
    reach = np.where(later, pos + n, 0)
    reach_before = np.concatenate([[0], np.maximum.accumulate(reach)[:-1]])
    conflict = np.zeros(n_rows, dtype=bool)
    conflict[rows[pos < reach_before]] = True
    simple = later & ~conflict[rows]
    out += np.bincount(rows[simple], weights=chars(pos[simple]), minlength=n_rows).astype(np.int64)
    hard = np.flatnonzero(conflict[rows])
    if len(hard):
        current, seen, resume, total = -1, set(), -1, 0
        for p, g, c, r in zip(pos[hard].tolist(), gram[hard].tolist(), chars(pos[hard]).tolist(), rows[hard].tolist()):
            if r != current:
                if current >= 0:
                    out[current] = total
                current, seen, resume, total = r, set(), -1, 0
            if p < resume:
                continue
            if g in seen:
                total += c
                resume = p + n
            else:
                seen.add(g)
        out[current] = total
    return out


class GopherRepetitionFilter:
    """Gopher repetition rules, in datatrove's order.

    - `empty`: the text is empty;
    - `dup_para_frac`, `dup_para_char_frac`: paragraphs (split on blank lines
      after stripping) that repeat an earlier one, as a share of paragraphs,
      and their characters as a share of the text;
    - `dup_line_frac`, `dup_line_char_frac`: the same for lines (split on runs of "\\n");
    - `top_{n}_gram_char_frac`: count x characters (words joined by spaces) of
      the most frequent word n-gram, as a share of the text's characters;
    - `dup_{n}_gram_char_frac`: characters (words joined without spaces) of
      repeated word n-grams, as a share of the text's characters.

    n-grams are over whitespace-separated words (`words="paper"`) or spaCy
    tokens (`words="datatrove"`). One deliberate difference: datatrove
    compares n-grams as their words joined without spaces (so `ab c` and
    `a bc` are the same 2-gram); we compare the words themselves.
    """

    name = "gopher_repetition"

    def __init__(self, params: GopherRepetitionParams | None = None, words: str = WORDS_PAPER,
                 markup: bool = False) -> None:
        self.params = params or GopherRepetitionParams()
        self.words = _check_words(words)
        #: Score the text with its markup taken out (`filters.markup`, ours); False: the text as it is.
        self.markup = markup

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        p = self.params
        units = batch_text(batch)
        if self.markup:
            units = units.plain()
        n = units.n
        length = units.length
        para_dups, para_dup_chars = _duplicate_stats(units.paragraphs)
        line_dups, line_dup_chars = _duplicate_stats(units.line_runs)
        scores: dict[str, np.ndarray] = {
            "dup_para_frac": ratio(para_dups, units.paragraphs.counts),
            "dup_para_char_frac": ratio(para_dup_chars, length),
            "dup_line_frac": ratio(line_dups, units.line_runs.counts),
            "dup_line_char_frac": ratio(line_dup_chars, length),
        }
        rules = [
            ("empty", length == 0),
            ("dup_para_frac", above(scores["dup_para_frac"], p.dup_para_frac)),
            ("dup_para_char_frac", above(scores["dup_para_char_frac"], p.dup_para_char_frac)),
            ("dup_line_frac", above(scores["dup_line_frac"], p.dup_line_frac)),
            ("dup_line_char_frac", above(scores["dup_line_char_frac"], p.dup_line_char_frac)),
        ]
        top_rules, dup_rules = [], []
        grams = _ngram_chars(units.words_for(self.words), set(p.top_n_grams), set(p.dup_n_grams))
        for size, threshold in sorted(p.top_n_grams.items()):
            key = f"top_{size}_gram_char_frac"
            scores[key] = ratio(grams[("top", size)], length)
            top_rules.append((key, above(scores[key], threshold)))
        for size, threshold in sorted(p.dup_n_grams.items()):
            key = f"dup_{size}_gram_char_frac"
            scores[key] = ratio(grams[("dup", size)], length)
            dup_rules.append((key, above(scores[key], threshold)))
        return verdicts(self.name, n, rules + top_rules + dup_rules, scores)
