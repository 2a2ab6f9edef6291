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
from collections.abc import Sequence

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
