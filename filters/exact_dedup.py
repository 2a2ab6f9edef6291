"""Exact deduplication: one 128-bit hash of normalised content per document.

Global across shards: each shard hashes its own rows with `normalized_hashes`
(16 bytes a document), the hashes of all shards are concatenated with their
ids (and, optionally, `quality`), and `exact_duplicates` picks one document
per hash with a deterministic rule, so the answer does not depend on shard
order or on how the corpus was split.

Normalisation (vectorised with pyarrow.compute; hashing is blake2b-128 per
row over the normalised UTF-8 bytes, stable on every machine):

- every document: Unicode NFC, so precomposed and decomposed accents agree;
- text (`kind == "text"`, and anything that is not "code"): every run of
  whitespace (ASCII, Unicode space separators, NEL, vertical tab) becomes one
  space, and the ends are stripped;
- code (`kind == "code"`): trailing whitespace is stripped from every line
  (so CRLF line ends become LF) and from the end of the file; indentation and
  newlines are kept, so files that differ only in trailing spaces are equal
  and files that differ in indentation are not.

The hash does not include the kind: a text and a code document whose
normalised contents are byte-identical are duplicates.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.schema import KIND_CODE

#: Whitespace runs folded to one space in text (RE2 syntax: \s is ASCII only).
_TEXT_WS = r"[\s\x{0B}\x{85}\p{Z}]+"
#: Whitespace at the end of each line of code (not the newline itself).
_CODE_TRAILING_WS = r"(?m)[\t\x{0B}\x{0C}\r \p{Zs}]+$"

#: dtype of one hash: 16 raw bytes (compare, sort and np.unique them as they
#: are; use `.tobytes()` on the array, not on an item, to keep trailing zeros).
HASH_DTYPE = np.dtype("S16")


def _as_string_array(values) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        values = pa.array(list(values), pa.large_string())
    if not pa.types.is_large_string(values.type):
        values = values.cast(pa.large_string())
    return values.fill_null("")


def iter_utf8(values: pa.Array):
    """Zero-copy memoryviews of the UTF-8 bytes of every row of a large_string array."""
    values = _as_string_array(values)
    n = len(values)
    if n == 0:
        return
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64)[values.offset : values.offset + n + 1]
    data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
    starts = offsets[:-1].tolist()
    ends = offsets[1:].tolist()
    for start, end in zip(starts, ends):
        yield data[start:end]


def normalize_text(texts: pa.Array) -> pa.Array:
    """NFC, whitespace runs folded to one space, ends stripped."""
    texts = pc.utf8_normalize(_as_string_array(texts), "NFC")
    return pc.utf8_trim_whitespace(pc.replace_substring_regex(texts, _TEXT_WS, " "))


def normalize_code(texts: pa.Array) -> pa.Array:
    """NFC, trailing whitespace of every line and of the file stripped; indentation kept."""
    texts = pc.utf8_normalize(_as_string_array(texts), "NFC")
    return pc.utf8_rtrim_whitespace(pc.replace_substring_regex(texts, _CODE_TRAILING_WS, ""))


def normalize(texts, kinds) -> pa.Array:
    """The normalised content of every row (code rows and text rows each their way)."""
    texts = _as_string_array(texts)
    kinds = _as_string_array(kinds)
    if len(kinds) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(kinds)} kinds")
    is_code = pc.fill_null(pc.equal(kinds, KIND_CODE), False)
    code_rows = np.flatnonzero(is_code.to_numpy(zero_copy_only=False))
    if len(code_rows) == 0:
        return normalize_text(texts)
    if len(code_rows) == len(texts):
        return normalize_code(texts)
    text_rows = np.flatnonzero(~is_code.to_numpy(zero_copy_only=False))
    code = normalize_code(texts.take(pa.array(code_rows)))
    text = normalize_text(texts.take(pa.array(text_rows)))
    # Put the two parts back in row order.
    order = np.empty(len(texts), dtype=np.int64)
    order[code_rows] = np.arange(len(code_rows))
    order[text_rows] = len(code_rows) + np.arange(len(text_rows))
    return pa.concat_arrays([code, text]).take(pa.array(order))


def hash_rows(values: pa.Array) -> np.ndarray:
    """blake2b-128 of the UTF-8 bytes of every row, as an (n,) S16 array."""
    digests = [hashlib.blake2b(row, digest_size=16).digest() for row in iter_utf8(values)]
    return np.frombuffer(b"".join(digests), dtype=HASH_DTYPE).copy() if digests else np.empty(0, HASH_DTYPE)


def normalized_hashes(texts: pa.Array, kinds: pa.Array) -> np.ndarray:
    """128-bit hash (dtype S16) of every document's normalised content (see module doc)."""
    return hash_rows(normalize(texts, kinds))


# --- the keep rule -------------------------------------------------------------


def _as_id_array(ids) -> pa.Array:
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, pa.Array):
        ids = pa.array(list(ids), pa.string())
    return ids


def _quality_array(quality, n: int) -> np.ndarray:
    """float64 quality with None/NaN (and a missing column) as -inf: the lowest."""
    if quality is None:
        return np.full(n, -np.inf)
    if isinstance(quality, pa.ChunkedArray):
        quality = quality.combine_chunks()
    if isinstance(quality, pa.Array):
        q = quality.cast(pa.float64()).to_numpy(zero_copy_only=False)
    else:
        q = np.array([np.nan if v is None else v for v in quality], dtype=np.float64)
    q = np.asarray(q, dtype=np.float64).copy()
    if len(q) != n:
        raise ValueError(f"{n} ids but {len(q)} quality values")
    q[np.isnan(q)] = -np.inf
    return q


def id_ranks(ids) -> np.ndarray:
    """Rank of every id in lexicographic order (UTF-8 byte order = code point order)."""
    ids = _as_id_array(ids)
    order = pc.sort_indices(ids).to_numpy()
    ranks = np.empty(len(ids), dtype=np.int64)
    ranks[order] = np.arange(len(ids))
    return ranks


def choose_kept(groups: np.ndarray, ids, quality=None) -> np.ndarray:
    """For every row, the row index of its group's kept document.

    The kept document of a group is the one with the highest `quality`
    (None/NaN count as lowest), then the earliest id in lexicographic order.
    The rule depends only on (id, quality) pairs, so it gives the same answer
    whatever the order of the rows or the split into shards.
    """
    groups = np.asarray(groups)
    n = len(groups)
    ids = _as_id_array(ids)
    if len(ids) != n:
        raise ValueError(f"{n} groups but {len(ids)} ids")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    q = _quality_array(quality, n)
    order = np.lexsort((id_ranks(ids), -q, groups))
    g = groups[order]
    first = np.ones(n, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    run = np.cumsum(first) - 1
    kept_sorted = order[np.flatnonzero(first)][run]
    kept = np.empty(n, dtype=np.int64)
    kept[order] = kept_sorted
    return kept


def exact_duplicates(ids, hashes: np.ndarray, quality=None) -> dict[str, str]:
    """{dropped id: kept id} for every document whose hash another document shares.

    `ids`, `hashes` (from `normalized_hashes`, any shards concatenated) and
    `quality` are aligned; kept documents are not keys.
    """
    hashes = np.asarray(hashes)
    ids_pa = _as_id_array(ids)
    if len(ids_pa) != len(hashes):
        raise ValueError(f"{len(ids_pa)} ids but {len(hashes)} hashes")
    if len(hashes) == 0:
        return {}
    _, groups = np.unique(hashes, return_inverse=True)
    kept = choose_kept(groups.reshape(-1), ids_pa, quality)
    dup_rows = np.flatnonzero(kept != np.arange(len(kept)))
    if len(dup_rows) == 0:
        return {}
    dups = ids_pa.take(pa.array(dup_rows)).to_pylist()
    keepers = ids_pa.take(pa.array(kept[dup_rows])).to_pylist()
    return dict(zip(dups, keepers))
