r"""Near-duplicate dedup: vectorised MinHash + LSH, partitionable by band.

The pipeline, with `MinHashParams` (FineWeb's defaults: word 5-grams,
14 bands x 8 rows = 112 hashes, seed 1, tuned for Jaccard 0.8):

1. `shingles` (via `words`): the text is simplified as datatrove's
   `simplify_text` does for FineWeb's MinHash stage (`normalize` is the
   readable reference): lowercase; NFD and combining marks (\p{Mn}) dropped,
   so accents go; every run of digits (\p{Nd}) becomes "0" (datatrove also
   folds a decimal part, "3.14" -> "0"; here it is "0 0"); punctuation,
   symbols, separators and control characters (\p{P} \p{S} \p{Z} \p{Cc}:
   datatrove's PUNCTUATION list, "_" included) separate words, like
   whitespace. The lines with non-ASCII characters get the Unicode steps
   with pyarrow.compute (`_simplify_non_ascii_lines`: the rest of such a
   row is not run through them); then every row is split on its UTF-8 bytes
   with numpy.
   Each distinct word of a batch is hashed once (`hash_strings`: 8-byte
   chunks through the MurmurHash3 finaliser, pure integer numpy, the same on
   every machine); the n-gram starting at word i is
   fmix64(sum_k word_hash[i + k] * P_k) with odd position multipliers P_k.
   A document with 1..n-1 words gets one shingle of all its words; a
   document without words gets none.
2. `signatures`: 112 hash functions h_k(x) = (a_k * x + b_k) mod 2^32 (a_k
   odd: each is a permutation of the 32-bit range, as datasketch 2's
   "affine32" scheme) on the low 32 bits of every shingle hash, by numpy
   broadcasting over blocks of 4096 shingles of many documents and a
   segmented minimum (np.minimum.reduceat) per document: (n, 112) uint32. A
   document without shingles has every value EMPTY (2^32 - 1) and takes no
   part in LSH. With `scheme: one_permutation`,
   `one_permutation_signatures` instead: one pass, each shingle in one of
   112 bins by its hash, the minimum per bin, empty bins densified (its
   docstring); about 6x faster, a different signature.
3. `band_buckets`: one 64-bit key per document for one band (its 8 values
   and the band number, hashed). `candidate_pairs_for_band` sorts the keys
   and links every member of a bucket to the bucket's smallest doc index (a
   star: m - 1 pairs for m members instead of m(m-1)/2; the union-find needs
   no more). Each band needs only its own key column, so the 14 bands can
   run as independent tasks (Dask/Ray) whose pairs are concatenated.
4. `UnionFind` / `clusters`: connected components of the pairs; the root of
   a component is its smallest doc index.
5. `near_duplicates`: per cluster, the kept document is the one with the
   highest `quality`, then the earliest id (`filters.exact_dedup.choose_kept`);
   the others map to it.

Memory of the LSH stage per document (`lsh_bytes_per_doc`, the arrays'
sizes): the signature (4 bytes x 112 = 448), plus, per band task running
at once, the task's arrays: the alive rows' indexes (8), their band columns
(4 x 8 = 32), the key and one column being mixed in (16), the sort order,
sorted keys and sorted doc indexes (24) and the run flags and numbers (9):
89 bytes, so 537 bytes a document with one band at a time. Measured
(`bench/dedup_memory.py`, 1M documents: peak RSS and numpy's traced
allocations): 553 bytes with one band task at a time, 625 with two. Every
band's keys held at once (`candidate_pairs`) is 448 + 112 bytes of keys
before its sort. Candidate pairs add 16 bytes each, the union-find 8 bytes
a document (+1 for the rank).

Ground truth for tests and benchmarks: `shingle_sets`, `jaccard` and
`exact_similar_pairs` (prefix filtering: exact for every pair at or above
the threshold).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import MinHashParams
from filters.exact_dedup import _as_id_array, _as_string_array, choose_kept

#: Signature value of a document without shingles (and the dtype's maximum).
EMPTY = np.uint32(0xFFFFFFFF)
SIG_DTYPE = np.dtype(np.uint32)

_NUMBERS = r"\p{Nd}+"
_MARKS = r"\p{Mn}+"

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
#: Odd multipliers for the position of a word inside a shingle (splitmix64 outputs | 1).
_POS = np.array(
    [0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93,
     0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3],
    dtype=np.uint64,
)
_LEN_TAG = np.uint64(0x2545F4914F6CDD1D)


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser (a bijection), in place on a uint64 array."""
    t = x >> _S33
    x ^= t
    x *= _M1
    np.right_shift(x, _S33, out=t)  # one temporary for the three shifts
    x ^= t
    x *= _M2
    np.right_shift(x, _S33, out=t)
    x ^= t
    return x


def _position_multipliers(n: int) -> np.ndarray:
    if n <= len(_POS):
        return _POS[:n]
    extra = _fmix64(np.arange(len(_POS), n, dtype=np.uint64) + np.uint64(0x632BE59BD9B4E019)) | np.uint64(1)
    return np.concatenate([_POS, extra])


# --- 1. shingles -----------------------------------------------------------------


#: What separates words: whitespace, punctuation, symbols, separators and
#: control characters (datatrove's PUNCTUATION list and whitespace, `_` too).
_SEPARATORS = r"[\s\p{P}\p{S}\p{Cc}\p{Z}]+"


def _code_point_numbers() -> np.ndarray:
    """Non-ASCII code points of planes 0-3 and 14: the other planes hold no letters, marks, digits or punctuation."""
    return np.concatenate([np.arange(0x80, 0xD800), np.arange(0xE000, 0x40000), np.arange(0xE0000, 0xE1000)])


@functools.lru_cache(maxsize=1)
def _code_points() -> pa.Array:
    """`_code_point_numbers` as a string array, one character a row."""
    # Built by Arrow (padded buffers): its string kernels may read past the end of a bare numpy buffer.
    return pa.array(list(map(chr, _code_point_numbers().tolist())), pa.large_string())


@functools.lru_cache(maxsize=None)
def _non_ascii_class(kind: str) -> str:
    r"""An RE2 character class (one or more) of non-ASCII code points, from pyarrow's own tables.

    RE2 has no class subtraction; classes without ASCII make the non-ASCII
    pre-pass fast (their matches are rare, where `\p{P}` would match every
    ASCII bracket and dot). kind: "separator" (P, S, Cc, Z), "digit" (Nd),
    or "decomposing" (characters that NFD, before or after lowercasing,
    changes, and marks: a row without any is left alone by NFD and the
    mark removal).
    """
    chars = _code_points()
    if kind == "separator":
        hit = pc.match_substring_regex(chars, r"^[\p{P}\p{S}\p{Cc}\p{Z}]$")
    elif kind == "digit":
        hit = pc.match_substring_regex(chars, r"^\p{Nd}$")
    elif kind == "decomposing":
        lower = pc.utf8_lower(chars)
        hit = pc.or_(pc.or_(pc.not_equal(pc.utf8_normalize(chars, "NFD"), chars),
                            pc.not_equal(pc.utf8_normalize(lower, "NFD"), lower)),
                     pc.match_substring_regex(chars, r"^\p{M}$"))
    else:
        raise ValueError(kind)
    hit = hit.to_numpy(zero_copy_only=False)
    cps = _code_point_numbers()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], hit.astype(np.int8), [0]])))
    ranges = []
    for lo, hi in zip(edges[::2], edges[1::2] - 1):
        lo_cp, hi_cp = int(cps[lo]), int(cps[hi])
        ranges.append(f"\\x{{{lo_cp:X}}}" if lo_cp == hi_cp else f"\\x{{{lo_cp:X}}}-\\x{{{hi_cp:X}}}")
    return "[" + "".join(ranges) + "]+"


def normalize(texts) -> pa.Array:
    r"""The simplified text, every separator run as one space (a readable reference).

    lowercase, NFD and combining marks (\p{Mn}) dropped, every run of digits
    (\p{Nd}) replaced by 0, separators (`_SEPARATORS`) folded to one space.
    `words` computes the same words (the tests check it), faster.
    """
    texts = _as_string_array(texts)
    if len(texts) == 0:
        return texts
    texts = pc.utf8_normalize(pc.utf8_lower(texts), "NFD")
    texts = pc.replace_substring_regex(texts, _MARKS, "")
    texts = pc.replace_substring_regex(texts, _NUMBERS, "0")
    return pc.utf8_trim(pc.replace_substring_regex(texts, _SEPARATORS, " "), " ")


def _simplify_non_ascii(texts: pa.Array) -> pa.Array:
    """The Unicode part of `normalize` for rows with non-ASCII characters.

    Lowercase; NFD and drop combining marks (only rows with a character that
    NFD changes, or a mark); non-ASCII separators to spaces, non-ASCII digit
    runs to 0. What is left is done on bytes by `_split_words` (ASCII
    letters, digits and separators; any other non-ASCII character is part of
    a word).
    """
    texts = pc.utf8_lower(texts)
    decomposing = pc.match_substring_regex(texts, _non_ascii_class("decomposing"))
    if pc.any(decomposing).as_py():
        sub = pc.utf8_normalize(texts.filter(decomposing), "NFD")
        sub = pc.replace_substring_regex(sub, _MARKS, "")
        texts = pc.replace_with_mask(texts, decomposing, sub.cast(texts.type))
    texts = pc.replace_substring_regex(texts, _non_ascii_class("separator"), " ")
    return pc.replace_substring_regex(texts, _non_ascii_class("digit"), "0")


def _simplify_non_ascii_lines(texts: pa.Array) -> pa.Array:
    """`_simplify_non_ascii` of only the lines that have a non-ASCII character, the rows joined back.

    A file with one accented name in its header would otherwise go whole
    through the Unicode steps (regexes over huge character classes, NFD).
    The result is the same: every step is local to a character or a run of
    non-ASCII characters, and "\\n" is ASCII, so nothing it changes spans a
    line break.
    """
    lines = pc.split_pattern(texts, "\n")
    flat = lines.flatten()
    non_ascii = pc.invert(pc.string_is_ascii(flat))
    flat = pc.replace_with_mask(flat, non_ascii, _simplify_non_ascii(flat.filter(non_ascii)).cast(flat.type))
    rebuilt = type(lines).from_arrays(lines.offsets, flat)
    return pc.binary_join(rebuilt, pa.scalar("\n", flat.type))


_BYTE_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [2**64 - 1], dtype=np.uint64)
_CHUNK_TAG = np.uint64(0x9E3779B97F4A7C15)


def _hash_spans(padded: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`hash_strings` of padded[starts[i]:starts[i] + lengths[i]]; `padded` ends with 8 spare bytes."""
    if len(starts) == 0:
        return np.empty(0, dtype=np.uint64)
    # Every 8-byte window of the buffer as one little-endian uint64 (unaligned view, no copy).
    windows = np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))
    # Chunk 0 of every string (an empty string's is 0, and fmix64(0) == 0: no chunk at all).
    values = windows[starts]
    values &= _BYTE_MASKS[np.minimum(lengths, 8)]
    out = _fmix64(values)
    many = np.flatnonzero(lengths > 8)
    if len(many):
        counts = (lengths[many] - 1) // 8  # chunks after the first
        owner = np.repeat(many, counts)
        first = np.zeros(len(many) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        index = np.arange(1, len(owner) + 1) - np.repeat(first[:-1], counts)  # chunk number in its string
        values = windows[starts[owner] + 8 * index]
        values &= _BYTE_MASKS[np.minimum(lengths[owner] - 8 * index, 8)]
        values += index.astype(np.uint64) * _CHUNK_TAG
        out[many] += np.add.reduceat(_fmix64(values), first[:-1])
    out += lengths.astype(np.uint64) * _LEN_TAG
    return _fmix64(out)


def hash_strings(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """64-bit hash of every string data[offsets[i]:offsets[i+1]], vectorised over all strings.

    Each string is read as little-endian 8-byte chunks (the last one zero
    padded); chunk c plus c * K goes through the MurmurHash3 finaliser, the
    chunks of a string are summed, and the sum plus length * K' is finalised
    again. Strings of up to 8 bytes never collide (a bijection per length).
    Pure integer numpy, so the same bytes give the same hash on every machine.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if len(offsets) < 2:
        return np.empty(0, dtype=np.uint64)
    base, stop = int(offsets[0]), int(offsets[-1])
    padded = np.zeros(stop - base + 8, dtype=np.uint8)
    padded[: stop - base] = np.asarray(data, dtype=np.uint8)[base:stop]
    return _hash_spans(padded, offsets[:-1] - base, np.diff(offsets))


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of an already sorted array, by one comparison (np.unique hashes or sorts again)."""
    if len(values) == 0:
        return values
    first = np.empty(len(values), dtype=bool)
    first[0] = True
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return values[first]


def _split_words(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every word (in order) and per-row word counts, on the UTF-8 bytes with numpy.

    A word is a maximal run of ASCII letters (lowered), ASCII digits and
    non-ASCII bytes inside one row; a run of digits counts as one "0"; every
    other ASCII byte (each one is P, S, Cc or Zs) separates words. The hash
    of a word is `hash_strings` of its simplified bytes, computed where the
    word lies (no copy of the words), except for the few words with a run of
    several digits, which are gathered and hashed apart.
    """
    n = len(texts)
    buffers = texts.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64)[texts.offset : texts.offset + n + 1]
    if buffers[2] is None or offsets[-1] == offsets[0]:
        return np.empty(0, dtype=np.uint64), np.zeros(n, dtype=np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    size = len(data)
    high = data >= 0x80
    digit = (data - np.uint8(48)) < 10
    simple = np.zeros(size + 8, dtype=np.uint8)  # the simplified bytes, 8 spare zeros for the windows
    body = simple[:size]
    np.bitwise_or(data, np.uint8(0x20), out=body)  # ASCII letters lowered
    word = ((body - np.uint8(97)) < 26) | digit | high
    np.copyto(body, data, where=high)
    body[digit] = 48
    # Word boundaries: where `word` flips (one comparison, no padded copy), plus the buffer's two ends.
    flips = np.flatnonzero(word[1:] != word[:-1])
    flips += 1
    parts = [flips]
    if word[0]:
        parts.insert(0, np.zeros(1, dtype=flips.dtype))
    if word[-1]:
        parts.append(np.full(1, size, dtype=flips.dtype))
    edges = np.concatenate(parts) if len(parts) > 1 else flips
    starts, ends = edges[0::2], edges[1::2]
    # A word must not run from one row into the next.
    inner = _sorted_unique(offsets[1:-1][(offsets[1:-1] > 0) & (offsets[1:-1] < size)])
    crossing = inner[word[inner] & word[inner - 1]]
    if len(crossing):
        starts = np.sort(np.concatenate([starts, crossing]))
        ends = np.sort(np.concatenate([ends, crossing]))
    lengths = ends - starts
    hashes = _hash_spans(simple, starts, lengths)
    # Digits after a digit of the same word are dropped: rehash those words from their kept bytes.
    dropped = np.flatnonzero(digit[1:] & digit[:-1]) + 1
    if len(dropped) and len(crossing):
        at_crossing = crossing[np.minimum(np.searchsorted(crossing, dropped), len(crossing) - 1)] == dropped
        dropped = dropped[~at_crossing]
    if len(dropped):
        owners = np.searchsorted(starts, dropped, side="right") - 1
        redo = _sorted_unique(owners)
        first = np.zeros(len(redo) + 1, dtype=np.int64)
        np.cumsum(lengths[redo], out=first[1:])
        at = np.repeat(starts[redo] - first[:-1], lengths[redo]) + np.arange(first[-1])
        keep = np.ones(size, dtype=bool)
        keep[dropped] = False
        kept = keep[at]
        new_lengths = np.add.reduceat(kept, first[:-1], dtype=np.int64)
        new_offsets = np.zeros(len(redo) + 1, dtype=np.int64)
        np.cumsum(new_lengths, out=new_offsets[1:])
        hashes[redo] = hash_strings(body[at[kept]], new_offsets)
    counts = np.diff(np.searchsorted(starts, offsets))
    return hashes, counts


def words(texts) -> tuple[np.ndarray, np.ndarray]:
    """(word hashes uint64 of all documents in row order, offsets (n + 1) int64).

    The words of `normalize(texts)` split on spaces, hashed with
    `hash_strings`; rows with non-ASCII characters get the Unicode steps
    first (`_simplify_non_ascii`), then all rows are split on bytes
    (`_split_words`).
    """
    texts = _as_string_array(texts)
    n = len(texts)
    offsets = np.zeros(n + 1, dtype=np.int64)
    if n == 0:
        return np.empty(0, np.uint64), offsets
    non_ascii = pc.invert(pc.string_is_ascii(texts))
    if pc.any(non_ascii).as_py():
        rows = texts.filter(non_ascii)
        texts = pc.replace_with_mask(texts, non_ascii, _simplify_non_ascii_lines(rows).cast(texts.type))
    hashes, counts = _split_words(texts)
    np.cumsum(counts, out=offsets[1:])
    return hashes, offsets


def shingles_from_words(word_hashes: np.ndarray, word_offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Word n-gram hashes (uint64) of every document, and their offsets (n + 1).

    The n-gram starting at word i is fmix64(sum_k hash(word i+k) * P_k) with
    odd position multipliers P_k, computed for every i at once; the n - 1
    last starts of each document are then dropped. A document of 1..n-1
    words gets one shingle, its words combined the same way plus a length
    tag, at the place of its first word, so the output stays in order.
    """
    word_hashes = np.asarray(word_hashes, dtype=np.uint64)
    word_offsets = np.asarray(word_offsets, dtype=np.int64)
    n_docs = len(word_offsets) - 1
    lengths = np.diff(word_offsets)
    counts = np.where(lengths >= ngram, lengths - ngram + 1, np.minimum(lengths, 1))
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = len(word_hashes)
    if total == 0:
        return np.empty(0, dtype=np.uint64), offsets
    mult = _position_multipliers(ngram)
    padded = np.zeros(total + ngram - 1, dtype=np.uint64)
    padded[:total] = word_hashes
    acc = padded[:total] * mult[0]
    tmp = np.empty_like(acc)
    for k in range(1, ngram):
        np.multiply(padded[k : k + total], mult[k], out=tmp)
        acc += tmp
    valid = np.ones(total, dtype=bool)
    ends = word_offsets[1:][lengths > 0]
    for k in range(1, ngram):
        valid[np.maximum(ends - k, 0)] = False  # the n - 1 last starts of each document
    short = np.flatnonzero((lengths > 0) & (lengths < ngram))
    if len(short):
        first = word_offsets[short]
        tag = np.zeros(len(short), dtype=np.uint64)
        for k in range(ngram - 1):
            has = lengths[short] > k
            tag[has] += word_hashes[first[has] + k] * mult[k]
        acc[first] = tag + lengths[short].astype(np.uint64) * _LEN_TAG
        valid[first] = True
    out = acc[valid]
    assert len(out) == offsets[-1]
    return _fmix64(out), offsets


def _batches(texts: pa.Array, batch_docs: int, batch_bytes: int):
    """Slices of at most batch_docs rows and (unless one row is bigger) batch_bytes of text."""
    sizes = pc.binary_length(texts).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(sizes)
    start = 0
    while start < len(texts):
        before = ends[start - 1] if start else 0
        stop = int(np.searchsorted(ends, before + batch_bytes, side="right"))
        stop = min(max(stop, start + 1), start + batch_docs, len(texts))
        yield texts.slice(start, stop - start)
        start = stop


def shingles(texts, params: MinHashParams | None = None, batch_docs: int = 4096,
             batch_bytes: int = 16 << 20) -> tuple[np.ndarray, np.ndarray]:
    """(shingle hashes uint64, offsets (n + 1)): document i owns hashes[offsets[i]:offsets[i+1]].

    The same shingles the signatures are made of, so exact Jaccard on these
    sets is what MinHash estimates (up to 32-bit collisions, negligible).
    Computed in batches of rows (`signatures` explains the sizes).
    """
    params = params or MinHashParams()
    texts = _as_string_array(texts)
    parts, counts = [], []
    for batch in _batches(texts, batch_docs, batch_bytes):
        word_hashes, word_offsets = words(batch)
        hashes, offsets = shingles_from_words(word_hashes, word_offsets, params.ngram)
        parts.append(hashes)
        counts.append(np.diff(offsets))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    if not parts:
        return np.empty(0, dtype=np.uint64), offsets
    np.cumsum(np.concatenate(counts), out=offsets[1:])
    return np.concatenate(parts), offsets


# --- 2. signatures ---------------------------------------------------------------


def permutations(params: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): bands*rows uint32 pairs, a odd, from params.seed."""
    rng = np.random.Generator(np.random.PCG64(params.seed))
    num = params.bands * params.rows
    a = rng.integers(0, 2**32, size=num, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
    b = rng.integers(0, 2**32, size=num, dtype=np.uint64).astype(np.uint32)
    return a, b


def signatures_from_shingles(hashes: np.ndarray, offsets: np.ndarray, params: MinHashParams | None = None,
                             block: int = 4096) -> np.ndarray:
    """MinHash signatures (n, bands*rows) uint32 of shingle sets given as a flat array + offsets."""
    params = params or MinHashParams()
    a, b = permutations(params)
    num = len(a)
    n_docs = len(offsets) - 1
    out = np.full((n_docs, num), EMPTY, dtype=SIG_DTYPE)
    total = len(hashes)
    if total == 0:
        return out
    x = hashes.astype(np.uint32)  # low 32 bits; the shingle hashes are already mixed
    counts = np.diff(offsets)
    docs_nz = np.flatnonzero(counts > 0)
    starts_nz = offsets[:-1][docs_nz]
    a_col = a[:, None]
    b_col = b[:, None]
    buf = np.empty((num, block), dtype=np.uint32)
    for start in range(0, total, block):
        end = min(start + block, total)
        width = end - start
        i0 = int(np.searchsorted(starts_nz, start, side="right")) - 1
        i1 = int(np.searchsorted(starts_nz, end, side="left"))
        seg = starts_nz[i0:i1] - start
        seg[0] = 0
        view = buf[:, :width]
        np.multiply(a_col, x[start:end], out=view)
        view += b_col
        mins = np.minimum.reduceat(view, seg, axis=1)  # (num, segments)
        rows = docs_nz[i0:i1]
        np.minimum(out[rows], mins.T, out=mins.T)
        out[rows] = mins.T
    return out


@functools.lru_cache(maxsize=8)
def _probe_table(num: int, attempts: int, seed: int) -> np.ndarray:
    """(num, attempts) bins to copy an empty bin from, the same for every document (optimal densification)."""
    i = np.arange(num, dtype=np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
    a = np.arange(1, attempts + 1, dtype=np.uint64)[None, :] * np.uint64(0xD6E8FEB86659FD93)
    h = _fmix64(i ^ a ^ np.uint64((seed * 0x94D049BB133111EB) % 2**64))
    return ((h >> np.uint64(32)) * np.uint64(num) >> np.uint64(32)).astype(np.int64)


def one_permutation_signatures(hashes: np.ndarray, offsets: np.ndarray, params: MinHashParams | None = None,
                               attempts: int = 64) -> np.ndarray:
    """One-permutation MinHash (Li, Owen & Zhang 2012) with optimal densification (Shrivastava 2017).

    Each shingle hash h (already mixed by fmix64) is multiplied by an odd
    constant from params.seed, g = h * c mod 2^64; it falls in bin
    (g_high32 * num) >> 32 of num = bands * rows bins with value g_low32,
    and a bin keeps its minimum value. An empty bin i copies the
    value of the first non-empty bin among probes p(i, 1), p(i, 2), ... (a
    fixed hash sequence, the same for every document, so two documents copy
    from the same bins), and after `attempts` probes from the next non-empty
    bin after i (rotation). One pass over the shingles instead of num
    (`signatures_from_shingles`): the same expectation, P[bin equal] = J,
    and for sets much larger than num a lower variance (bins sample without
    replacement). Documents without shingles stay all EMPTY.
    """
    params = params or MinHashParams()
    num = params.bands * params.rows
    n_docs = len(offsets) - 1
    out = np.full(n_docs * num, EMPTY, dtype=SIG_DTYPE)
    if len(hashes) == 0:
        return out.reshape(n_docs, num)
    # The seed picks an odd multiplier (a bijection of the 64-bit hashes): bin from the product's high
    # half, value from its low half.
    mult = _fmix64(np.array([params.seed + 0x632BE59BD9B4E019], dtype=np.uint64)) | np.uint64(1)
    mixed = np.asarray(hashes, dtype=np.uint64) * mult[0]
    values = mixed.astype(np.uint32)
    key = mixed  # reused in place: key = doc * num + bin
    key >>= np.uint64(32)
    key *= np.uint64(num)
    key >>= np.uint64(32)
    key = key.view(np.int64)
    key += np.repeat(np.arange(n_docs, dtype=np.int64) * num, np.diff(offsets))
    np.minimum.at(out, key, values)
    out = out.reshape(n_docs, num)
    filled = out != EMPTY
    partial = np.flatnonzero(filled.any(axis=1) & ~filled.all(axis=1))
    if len(partial) == 0:
        return out
    sub, sub_filled = out[partial], filled[partial]
    row, col = np.nonzero(~sub_filled)
    probes = _probe_table(num, attempts, params.seed)
    for a in range(attempts):
        source = probes[col, a]
        hit = sub_filled[row, source]
        sub[row[hit], col[hit]] = sub[row[hit], source[hit]]
        row, col = row[~hit], col[~hit]
        if len(row) == 0:
            break
    if len(row):  # rotation: the next bin after `col` that is filled (cyclically)
        order = np.concatenate([sub_filled, sub_filled], axis=1)[row]
        steps = np.argmax(order[np.arange(len(row))[:, None], col[:, None] + 1 + np.arange(num)[None, :]], axis=1)
        sub[row, col] = sub[row, (col + 1 + steps) % num]
    out[partial] = sub
    return out


def signatures(texts: Sequence[str] | pa.Array, params: MinHashParams | None = None,
               batch_docs: int = 1024, batch_bytes: int = 16 << 20) -> np.ndarray:
    """MinHash signatures, (n, bands*rows) uint32; rows of EMPTY for documents without words.

    Works in batches of at most `batch_docs` documents and `batch_bytes` of
    text, so memory stays bounded whatever the input; the result does not
    depend on the batching.
    """
    params = params or MinHashParams()
    schemes = {"permutations": signatures_from_shingles, "one_permutation": one_permutation_signatures}
    if params.scheme not in schemes:
        raise ValueError(f"dedup.minhash.scheme = {params.scheme!r}; expected one of {sorted(schemes)}")
    texts = _as_string_array(texts)
    parts = []
    for batch in _batches(texts, batch_docs, batch_bytes):
        hashes, offsets = shingles(batch, params)
        parts.append(schemes[params.scheme](hashes, offsets, params))
    if not parts:
        return np.empty((0, params.bands * params.rows), dtype=SIG_DTYPE)
    return np.concatenate(parts)


def has_shingles(signatures: np.ndarray, block: int = 1 << 16) -> np.ndarray:
    """False for documents without any shingle (all-EMPTY rows): they take no part in LSH.

    In blocks of rows, so the comparison's bool temporary stays small (a
    whole (n, 112) one is 112 bytes a document, a fifth of the signatures).
    """
    out = np.empty(len(signatures), dtype=bool)
    for start in range(0, len(signatures), block):
        out[start : start + block] = (signatures[start : start + block] != EMPTY).any(axis=1)
    return out


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Share of equal signature values (the MinHash estimate of Jaccard), row by row."""
    return (np.atleast_2d(sig_a) == np.atleast_2d(sig_b)).mean(axis=1)


# --- 3. LSH, band by band ----------------------------------------------------------


def band_keys(band_values: np.ndarray, band: int) -> np.ndarray:
    """One uint64 bucket key per row of one band's signature values (m, rows): their hash and the band number."""
    band_values = np.asarray(band_values)
    mult = _position_multipliers(band_values.shape[1])
    key = np.full(len(band_values), ((band + 1) * int(_LEN_TAG)) % 2**64, dtype=np.uint64)
    column = np.empty(len(band_values), dtype=np.uint64)
    for j in range(band_values.shape[1]):
        column[:] = band_values[:, j]  # one column at a time: 8 B a document, not a (m, rows) uint64 copy
        column *= mult[j]
        key += column
        if j % 2 == 1:
            _fmix64(key)
    return _fmix64(key)


def band_buckets(signatures: np.ndarray, band: int, params: MinHashParams | None = None) -> np.ndarray:
    """One uint64 bucket key per document for `band` (hash of its rows and the band number)."""
    params = params or MinHashParams()
    if not 0 <= band < params.bands:
        raise ValueError(f"band {band} outside 0..{params.bands - 1}")
    return band_keys(signatures[:, band * params.rows : (band + 1) * params.rows], band)


def candidate_pairs_for_band(doc_index: np.ndarray, bucket_keys: np.ndarray) -> np.ndarray:
    """(m, 2) int64 pairs (bucket's smallest doc index, other member) for every shared bucket.

    `doc_index` names the documents (global row numbers, so that bands and
    shards computed apart can be unioned); `bucket_keys` are their keys for
    one band (or for several bands, as the keys carry the band number).
    """
    doc_index = np.asarray(doc_index, dtype=np.int64)
    bucket_keys = np.asarray(bucket_keys)
    if len(doc_index) != len(bucket_keys):
        raise ValueError(f"{len(doc_index)} doc indexes but {len(bucket_keys)} keys")
    if len(doc_index) < 2:
        return np.empty((0, 2), dtype=np.int64)
    order = np.lexsort((doc_index, bucket_keys))
    keys = bucket_keys[order]
    docs = doc_index[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    heads = np.flatnonzero(first)
    run = np.cumsum(first) - 1
    member = ~first
    pairs = np.stack([docs[heads[run[member]]], docs[member]], axis=1)
    return pairs[pairs[:, 0] != pairs[:, 1]]


def candidate_pairs(signatures: np.ndarray, params: MinHashParams | None = None,
                    doc_index: np.ndarray | None = None) -> np.ndarray:
    """All bands at once: one sort over every (band key, doc); unique pairs (a < b).

    Documents without shingles are left out. The same pairs as the union of
    `candidate_pairs_for_band` over the bands, deduplicated.
    """
    params = params or MinHashParams()
    if doc_index is None:
        doc_index = np.arange(len(signatures), dtype=np.int64)
    valid = has_shingles(signatures)
    sig = signatures[valid]
    docs = np.asarray(doc_index, dtype=np.int64)[valid]
    keys = np.concatenate([band_buckets(sig, band, params) for band in range(params.bands)])
    pairs = candidate_pairs_for_band(np.tile(docs, params.bands), keys)
    if len(pairs) == 0:
        return pairs
    width = np.int64(pairs.max()) + 1
    codes = np.unique(pairs[:, 0] * width + pairs[:, 1])
    return np.stack([codes // width, codes % width], axis=1)


def lsh_bytes_per_doc(params: MinHashParams | None = None, signature_dtype=SIG_DTYPE) -> dict[str, int]:
    """Bytes per document of the LSH stage, from its arrays' sizes (the module docstring lists them).

    signature; band_keys (every band's key, `candidate_pairs`); band_task (what one
    `assay.stages.dedup.band_pairs` call allocates: indexes, band columns, key, sort); all_at_once
    (signature + band_keys); band_by_band (signature + one band task).
    """
    params = params or MinHashParams()
    sig = params.bands * params.rows * np.dtype(signature_dtype).itemsize
    keys = params.bands * 8
    band_task = 8 + params.rows * np.dtype(signature_dtype).itemsize + 16 + 24 + 9
    return {"signature": sig, "band_keys": keys, "band_task": band_task, "all_at_once": sig + keys,
            "band_by_band": sig + band_task}


# --- 4. union-find -------------------------------------------------------------------


class UnionFind:
    """Disjoint sets over 0..n-1.

    `find`/`union` are the textbook scalar operations (path compression,
    union by rank). `union_pairs` takes millions of pairs at once: rounds of
    "hook every root under the smallest root it is paired with" (np.minimum.at;
    hooks always go to a smaller index, so no cycle can form) each followed by
    pointer jumping until every node points at its root (full path
    compression); a few rounds suffice.
    """

    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)
        self.rank = np.zeros(n, dtype=np.int8)

    def __len__(self) -> int:
        return len(self.parent)

    def find(self, x: int) -> int:
        parent = self.parent
        root = int(x)
        while parent[root] != root:
            root = int(parent[root])
        while parent[x] != root:
            parent[x], x = root, int(parent[x])
        return root

    def union(self, x: int, y: int) -> bool:
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return False
        if self.rank[rx] < self.rank[ry]:
            rx, ry = ry, rx
        self.parent[ry] = rx
        if self.rank[rx] == self.rank[ry]:
            self.rank[rx] += 1
        return True

    def _compress(self) -> None:
        parent = self.parent
        while True:
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
        self.parent = parent

    def union_pairs(self, pairs: np.ndarray) -> None:
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        u, v = pairs[:, 0], pairs[:, 1]
        while len(u):
            self._compress()
            ru, rv = self.parent[u], self.parent[v]
            open_ = ru != rv
            if not open_.any():
                break
            u, v, ru, rv = u[open_], v[open_], ru[open_], rv[open_]
            np.minimum.at(self.parent, np.maximum(ru, rv), np.minimum(ru, rv))
        self._compress()

    def roots(self) -> np.ndarray:
        """The root of every element, relabelled to the smallest index of its set."""
        self._compress()
        root = self.parent
        smallest = np.full(len(root), len(root), dtype=np.int64)
        np.minimum.at(smallest, root, np.arange(len(root), dtype=np.int64))
        return smallest[root]


def clusters(n: int, pairs: np.ndarray) -> np.ndarray:
    """Connected components of `pairs` over n documents: the smallest doc index of each one's cluster."""
    uf = UnionFind(n)
    uf.union_pairs(pairs)
    return uf.roots()


# --- 5. the decision -------------------------------------------------------------------


def near_duplicates(ids, signatures: np.ndarray, params: MinHashParams | None = None,
                    quality=None) -> tuple[np.ndarray, np.ndarray]:
    """(kept id of each document's cluster, kept flag) for every document.

    Documents sharing a bucket in any band are linked, clusters are the
    connected components, and each cluster keeps the document with the
    highest quality, then the earliest id; the others map to it. Documents
    without shingles are their own cluster.
    """
    params = params or MinHashParams()
    ids_pa = _as_id_array(ids)
    n = len(signatures)
    if len(ids_pa) != n:
        raise ValueError(f"{len(ids_pa)} ids but {n} signatures")
    valid = np.flatnonzero(has_shingles(signatures))
    sig = signatures[valid]
    pairs = [candidate_pairs_for_band(valid, band_buckets(sig, band, params)) for band in range(params.bands)]
    roots = clusters(n, np.concatenate(pairs) if pairs else np.empty((0, 2), np.int64))
    kept = choose_kept(roots, ids_pa, quality)
    kept_ids = ids_pa.take(pa.array(kept)).to_numpy(zero_copy_only=False)
    return kept_ids, kept == np.arange(n)


# --- ground truth: exact Jaccard --------------------------------------------------------


def shingle_sets(hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicated, sorted shingles of every document (flat + offsets)."""
    n = len(offsets) - 1
    doc = np.repeat(np.arange(n), np.diff(offsets))
    order = np.lexsort((hashes, doc))
    h, d = hashes[order], doc[order]
    keep = np.ones(len(h), dtype=bool)
    keep[1:] = (h[1:] != h[:-1]) | (d[1:] != d[:-1])
    h, d = h[keep], d[keep]
    new_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(d, minlength=n), out=new_offsets[1:])
    return h, new_offsets


def jaccard(hashes: np.ndarray, offsets: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Exact Jaccard of the shingle sets of each pair (sets from `shingle_sets`)."""
    out = np.empty(len(pairs), dtype=np.float64)
    for k, (i, j) in enumerate(np.asarray(pairs).tolist()):
        a = hashes[offsets[i] : offsets[i + 1]]
        b = hashes[offsets[j] : offsets[j + 1]]
        if len(a) == 0 and len(b) == 0:
            out[k] = np.nan
            continue
        inter = len(np.intersect1d(a, b, assume_unique=True))
        out[k] = inter / (len(a) + len(b) - inter)
    return out


def exact_similar_pairs(hashes: np.ndarray, offsets: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (i < j) whose shingle sets have Jaccard >= threshold, and that Jaccard.

    Exact (no sampling): an inverted index over each set's prefix under a
    global rarest-first order (prefix filtering, Chaudhuri et al. 2006): if
    J(x, y) >= t then x and y share one of the first |x| - ceil(t|x|) + 1
    rarest shingles of x and of y; every pair that does becomes a candidate,
    and each candidate's Jaccard is computed exactly. Sets from `shingle_sets`.
    """
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    doc = np.repeat(np.arange(n), lengths)
    uniq, token, freq = np.unique(hashes, return_inverse=True, return_counts=True)
    token = token.reshape(-1)
    # Global order: rarest first, ties by token id.
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[np.lexsort((np.arange(len(uniq)), freq))] = np.arange(len(uniq))
    r = rank[token]
    order = np.lexsort((r, doc))
    r, d = r[order], doc[order]
    pos = np.arange(len(r)) - offsets[d]
    t = threshold - 1e-9
    prefix = lengths - np.ceil(t * lengths).astype(np.int64) + 1
    in_prefix = pos < prefix[d]
    pr, pd = r[in_prefix], d[in_prefix]
    # Inverted index on prefix tokens: all pairs of documents per token.
    order = np.lexsort((pd, pr))
    pr, pd = pr[order], pd[order]
    first = np.ones(len(pr), dtype=bool)
    first[1:] = pr[1:] != pr[:-1]
    starts = np.flatnonzero(first)
    sizes = np.diff(np.append(starts, len(pr)))
    cand = []
    for size in np.unique(sizes[sizes > 1]):
        group_starts = starts[sizes == size]
        iu, ju = np.triu_indices(size, k=1)
        cand.append(np.stack([pd[group_starts[:, None] + iu], pd[group_starts[:, None] + ju]], axis=-1).reshape(-1, 2))
    if not cand:
        return np.empty((0, 2), np.int64), np.empty(0)
    cand = np.unique(np.concatenate(cand), axis=0)
    la, lb = lengths[cand[:, 0]], lengths[cand[:, 1]]
    cand = cand[(np.minimum(la, lb) >= t * np.maximum(la, lb))]
    sims = jaccard(hashes, offsets, cand)
    hit = sims >= threshold
    return cand[hit], sims[hit]
