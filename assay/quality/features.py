"""Hashed word counts: the quality head's text features when `quality.features: words`.

GPT-3's quality classifier (Brown et al. 2020, appendix A) was a logistic
regression on Spark's HashingTF features of the words of a document, trained
on a reference set against an unfiltered pool. The same here: words are
scikit-learn's default token (two or more word characters, lower-cased), each
hashed (CRC-32, stable across processes and machines) into one of `dim`
buckets; a document is the vector of log(1 + count) per bucket, L2-normalised,
over the whole text (not only the encoder's first window).

Measured on the demo pool (BENCHMARKS.md), these features rank good prose
above machine junk far better than the encoder's first-window embedding,
which mostly encodes the format a document shares with its source.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import torch

TOKEN = re.compile(r"(?u)\b\w\w+\b")

_BUCKETS: dict[tuple[str, int], int] = {}
_MAX_CACHED = 2_000_000


def _bucket(token: str, dim: int) -> int:
    key = (token, dim)
    found = _BUCKETS.get(key)
    if found is None:
        if len(_BUCKETS) > _MAX_CACHED:
            _BUCKETS.clear()
        found = _BUCKETS[key] = zlib.crc32(token.encode("utf-8", "surrogatepass")) % dim
    return found


def hashed_words(texts: Sequence[str], dim: int, markup: bool = False) -> torch.Tensor:
    """A sparse (len(texts), dim) float32 COO tensor of L2-normalised log(1 + count) per hash bucket.

    `markup`: count the words of the text with its Markdown/reST/HTML markup taken out
    (`filters.markup`), so badge URLs, directive names and table bars are not words of a README.
    """
    if dim < 1:
        raise ValueError(f"dim must be positive, not {dim}")
    if markup and len(texts):
        import pyarrow as pa

        from filters.markup import markup_to_text

        texts = markup_to_text(pa.array(list(texts), pa.large_string())).to_pylist()
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for r, text in enumerate(texts):
        counts = Counter(TOKEN.findall(text.lower()))
        if not counts:
            continue
        buckets = np.fromiter((_bucket(t, dim) for t in counts), dtype=np.int64, count=len(counts))
        # Two words can share a bucket (a hash collision): their counts add up.
        unique, inverse = np.unique(buckets, return_inverse=True)
        summed = np.bincount(inverse, weights=np.fromiter(counts.values(), dtype=np.float64, count=len(counts)))
        value = np.log1p(summed)
        value /= np.linalg.norm(value)
        rows.append(np.full(len(unique), r, dtype=np.int64))
        cols.append(unique)
        vals.append(value.astype(np.float32))
    if rows:
        index = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(cols)]))
        values = torch.from_numpy(np.concatenate(vals))
    else:
        index, values = torch.zeros((2, 0), dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    return torch.sparse_coo_tensor(index, values, (len(texts), dim), check_invariants=True).coalesce()


#: The shape features (ours, not GPT-3's: its classifier had words only), in the order they follow the
#: word buckets. Each is a statistic the heuristics already compute (`filters.gopher`, `filters.records`)
#: or the share of letters among non-space characters, mapped to about [0, 1] by a fixed transform (no
#: statistics of a training set), so a head generalises to junk whose words it never saw (a charmap, a
#: keyboard table) by its shape: few alphabetic words, few stop words, repeated lines, key-value fields.
SHAPE_FEATURES: tuple[str, ...] = (
    "alpha_words_frac", "stop_words", "mean_word_length", "log_word_count", "hash_word_ratio",
    "bullet_lines_frac", "dup_line_frac", "dup_line_char_frac", "top_2_gram_char_frac",
    "dup_5_gram_char_frac", "field_lines_frac", "letter_frac",
)


def _shape_filters(markup: bool) -> list:
    """The filters whose statistics the shape features read, with their default parameters.

    The parameters are fixed here, not read from params.yaml, so a saved head's features do not move
    when a threshold does.
    """
    from assay.config import GopherQualityParams, GopherRepetitionParams, RecordsParams
    from filters.gopher import GopherQualityFilter, GopherRepetitionFilter
    from filters.records import RecordsFilter

    return [GopherQualityFilter(GopherQualityParams(), markup=markup),
            GopherRepetitionFilter(GopherRepetitionParams(), markup=markup),
            RecordsFilter(RecordsParams())]


def reusable_filters(filters: Sequence, markup: bool) -> list[str]:
    """The names of `filters` configured exactly as the shape features' own (same class, parameters,
    words and markup), whose scores can therefore stand in for a recomputation (`shape_features(known=)`).
    A filter whose parameters differ in anything, even a threshold, is not reused: slower, never wrong."""
    own = {f.name: f for f in _shape_filters(markup)}
    return [f.name for f in filters
            if f.name in own and type(f) is type(own[f.name]) and vars(f) == vars(own[f.name])]


#: The scores each of `_shape_filters` contributes, by filter name.
_SHAPE_SCORES: dict[str, tuple[str, ...]] = {
    "gopher_quality": ("alpha_words_frac", "stop_words", "mean_word_length", "word_count", "hash_word_ratio",
                       "bullet_lines_frac"),
    "gopher_repetition": ("dup_line_frac", "dup_line_char_frac", "top_2_gram_char_frac", "dup_5_gram_char_frac"),
    "records": ("field_lines_frac",),
}


def shape_features(texts: Sequence[str], markup: bool = False,
                   known: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """(len(texts), len(SHAPE_FEATURES)) float32: each text's shape statistics (see SHAPE_FEATURES).

    The Gopher statistics are computed as the heuristics compute them with their default parameters
    (whitespace words; `markup`: on the text with its markup taken out, like the words), the field-line
    share as the records rule's default computes it (`_shape_filters`).

    `known`: scores the stage's heuristics already computed for these texts, by score name
    (`gopher_quality:stop_words`, ...), only from filters `reusable_filters` accepts; a filter is rerun
    only on the texts for which any of its scores is missing or NaN.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from assay.config import GopherQualityParams

    n = len(texts)
    if n == 0:
        return np.zeros((0, len(SHAPE_FEATURES)), dtype=np.float32)
    array = pa.array(list(texts), pa.large_string())
    batch = pa.record_batch({"text": array, "kind": pa.array(["text"] * n)})
    known = known or {}
    scores: dict[str, np.ndarray] = {}
    for filt in _shape_filters(markup):
        names = [f"{filt.name}:{name}" for name in _SHAPE_SCORES[filt.name]]
        have = np.stack([np.asarray(known[k], dtype=np.float64) if k in known else np.full(n, np.nan)
                         for k in names])
        missing = np.flatnonzero(np.isnan(have).any(axis=0))
        if len(missing):
            sub = batch if len(missing) == n else batch.take(pa.array(missing, pa.int64()))
            computed = filt.apply(sub).scores
            for j, k in enumerate(names):
                have[j, missing] = computed[k]
        scores.update(zip(names, have))

    def get(name: str) -> np.ndarray:
        return np.nan_to_num(scores[name], nan=0.0, posinf=0.0, neginf=0.0)

    # Counting the few whitespace characters and deleting the non-letters is 3x cheaper than counting
    # \S and \pL matches, and exact: RE2's \s and \S are complements, code point by code point.
    length = np.asarray(pc.utf8_length(array), dtype=np.float64)
    visible = length - np.asarray(pc.count_substring_regex(array, pattern=r"\s"), dtype=np.float64)
    letters = np.asarray(pc.utf8_length(pc.replace_substring_regex(array, pattern=r"[^\pL]+", replacement="")),
                         dtype=np.float64)
    stop_words = len(GopherQualityParams().stop_words)
    columns = {
        "alpha_words_frac": get("gopher_quality:alpha_words_frac"),
        "stop_words": get("gopher_quality:stop_words") / stop_words,
        "mean_word_length": np.clip(get("gopher_quality:mean_word_length") / 10.0, 0.0, 2.0),
        "log_word_count": np.clip(np.log1p(get("gopher_quality:word_count")) / np.log1p(1e5), 0.0, 1.5),
        "hash_word_ratio": np.clip(get("gopher_quality:hash_word_ratio"), 0.0, 1.0),
        "bullet_lines_frac": get("gopher_quality:bullet_lines_frac"),
        "dup_line_frac": get("gopher_repetition:dup_line_frac"),
        "dup_line_char_frac": get("gopher_repetition:dup_line_char_frac"),
        "top_2_gram_char_frac": get("gopher_repetition:top_2_gram_char_frac"),
        "dup_5_gram_char_frac": get("gopher_repetition:dup_5_gram_char_frac"),
        "field_lines_frac": get("records:field_lines_frac"),
        "letter_frac": np.divide(letters, visible, out=np.zeros(n), where=visible > 0),
    }
    return np.stack([columns[name] for name in SHAPE_FEATURES], axis=1).astype(np.float32)


def with_shape(words: torch.Tensor, shape: np.ndarray, scale: float) -> torch.Tensor:
    """The sparse word features with `scale` * `shape` appended as dense columns (after the buckets)."""
    n, dim = words.shape
    k = shape.shape[1]
    rows = np.repeat(np.arange(n, dtype=np.int64), k)
    cols = np.tile(np.arange(dim, dim + k, dtype=np.int64), n)
    index = torch.cat([words.indices(), torch.from_numpy(np.stack([rows, cols]))], dim=1)
    values = torch.cat([words.values(), torch.from_numpy((scale * shape).reshape(-1).astype(np.float32))])
    return torch.sparse_coo_tensor(index, values, (n, dim + k), check_invariants=True).coalesce()


def head_features(texts: Sequence[str], hash_dim: int, markup: bool, shape: Sequence[str] = (),
                  shape_scale: float = 1.0, known: Mapping[str, np.ndarray] | None = None) -> torch.Tensor:
    """A words head's input: hashed words, then (when `shape` names SHAPE_FEATURES) the shape features
    (`known`: see `shape_features`)."""
    words = hashed_words(texts, hash_dim, markup=markup)
    if not shape:
        return words
    if tuple(shape) != SHAPE_FEATURES:
        raise ValueError(f"a head's shape features are {list(shape)}; this version computes {list(SHAPE_FEATURES)}")
    return with_shape(words, shape_features(texts, markup=markup, known=known), shape_scale)
