"""Exact and near-duplicate dedup building blocks (filters.exact_dedup, filters.minhash).

The MinHash tests run on real files this machine has: standard-library
modules, and the libraries setuptools/pip vendor (`*/_vendor/*`) against
their standalone installs and standard-library descendants, a corpus with
known near-duplicates where exact Jaccard is the ground truth.
"""

from __future__ import annotations

import random
import re
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from assay.config import DedupParams, MinHashParams
from assay.errors import AssayError
from filters import minhash
from filters.exact_dedup import choose_kept, exact_duplicates, normalize, normalized_hashes

SITE = Path(sysconfig.get_paths()["purelib"])
STDLIB = Path(sysconfig.get_paths()["stdlib"])
PARAMS = DedupParams().minhash


def _hashes(texts, kinds):
    return normalized_hashes(pa.array(texts, pa.large_string()), pa.array(kinds))


# --- exact dedup -------------------------------------------------------------------


def test_exact_nfc_and_nfd_are_equal():
    composed = "Café crème brûlée, naïve façade"
    decomposed = unicodedata.normalize("NFD", composed)
    assert composed != decomposed
    h = _hashes([composed, decomposed, decomposed + "s", composed], ["text", "text", "text", "code"])
    assert h[0] == h[1] and h[0] != h[2]
    assert h[3] == h[0]  # the kind is not hashed: same normalised content, same hash
    assert h.dtype == np.dtype("S16") and h.shape == (4,)


def test_exact_text_whitespace_folding():
    texts = ["The cat  sat\n\non the\tmat. ", "  The cat sat on the mat.", "The cat sat on\u00a0the mat.",
             "The cat sat on the mat!", "Thecat sat on the mat."]
    h = _hashes(texts, ["text"] * len(texts))
    assert h[0] == h[1] == h[2]
    assert h[3] != h[0] and h[4] != h[0]
    assert normalize(texts[:1], ["text"]).to_pylist() == ["The cat sat on the mat."]


def test_exact_code_trailing_whitespace_but_not_indentation():
    base = "def f(x):\n    if x:\n        return 1\n    return 2\n"
    trailing = "def f(x):   \n    if x:\t\n        return 1 \n    return 2\n\n\n"
    crlf = base.replace("\n", "\r\n")
    reindented = "def f(x):\n  if x:\n    return 1\n  return 2\n"
    joined = "def f(x): if x: return 1 return 2\n"
    h = _hashes([base, trailing, crlf, reindented, joined], ["code"] * 5)
    assert h[0] == h[1] == h[2]
    assert h[3] != h[0]  # indentation is content in code
    assert h[4] != h[0]  # so are newlines
    # The same files as text: all whitespace folds, indentation no longer counts.
    t = _hashes([base, reindented, joined], ["text"] * 3)
    assert t[0] == t[1] == t[2]
    assert normalize([trailing], ["code"]).to_pylist() == [base.rstrip("\n")]


def test_exact_mixed_kinds_keep_row_order():
    texts = ["a  b", "x = 1  \n", "a b", "x = 1\n"]
    kinds = ["text", "code", "text", "code"]
    assert normalize(texts, kinds).to_pylist() == ["a b", "x = 1", "a b", "x = 1"]
    h = _hashes(texts, kinds)
    assert h[0] == h[2] and h[1] == h[3] and h[0] != h[1]


def test_exact_keep_rule_quality_then_id():
    texts = ["same text"] * 4 + ["other"] * 3 + ["alone"]
    ids = ["d", "b", "c", "a", "z2", "z1", "z3", "q"]
    h = _hashes(texts, ["text"] * len(texts))
    # No quality: the earliest id of each group is kept.
    assert exact_duplicates(ids, h) == {"d": "a", "b": "a", "c": "a", "z2": "z1", "z3": "z1"}
    # Highest quality wins; None and NaN are lowest; ties go to the earliest id.
    quality = [0.9, 0.9, None, float("nan"), None, float("nan"), 0.1, 0.5]
    assert exact_duplicates(ids, h, quality) == {"d": "b", "c": "b", "a": "b", "z2": "z3", "z1": "z3"}
    assert exact_duplicates(ids, h, pa.array(quality)) == exact_duplicates(ids, h, quality)
    # Deterministic: any row order (or split into shards) gives the same answer.
    perm = np.random.default_rng(0).permutation(len(ids))
    shuffled = exact_duplicates([ids[i] for i in perm], h[perm], [quality[i] for i in perm])
    assert shuffled == exact_duplicates(ids, h, quality)


def test_exact_hashes_are_global_across_shards():
    texts = [f"document {i % 7}  with words" for i in range(40)]
    kinds = ["text"] * 40
    whole = _hashes(texts, kinds)
    shards = np.concatenate([_hashes(texts[:13], kinds[:13]), _hashes(texts[13:], kinds[13:])])
    assert whole.tobytes() == shards.tobytes()
    dups = exact_duplicates([f"id{i:02d}" for i in range(40)], shards)
    assert len(dups) == 40 - 7 and set(dups.values()) == {f"id{i:02d}" for i in range(7)}


def test_choose_kept_groups():
    kept = choose_kept(np.array([5, 5, 1, 1, 1, 9]), ["b", "a", "x", "y", "w", "k"], [None, None, 0.2, 0.7, 0.7, None])
    assert kept.tolist() == [1, 1, 4, 4, 4, 5]


# --- MinHash: shingles and signatures -------------------------------------------------


def test_fast_word_split_matches_the_reference_normalisation():
    texts = [
        "The Quick  brown_fox; x+y=3.14 and v1.2.10 (ok)",
        "İstanbul naïve—résumé “quoted” «x» 1٣2 ٣ a\u00a0b\u2028c\x85d ½ ² Ünïcode",
        "日本語のテキスト、句読点。 x",
        "", "   ", "!!!", "a", "\ufffd bad \u200b zero-width", "abc\U000E0100def a\u0301b",
        # Words and digit runs at row boundaries (with an empty row between) must not merge.
        "abc", "", "def", "12", "34", "x1", "2y", "é", "ü99", "9",
        (STDLIB / "textwrap.py").read_text("utf-8"),
    ]
    word_hashes, offsets = minhash.words(texts)
    for i, text in enumerate(minhash.normalize(texts).to_pylist()):
        expected = [w.encode() for w in text.split(" ") if w]
        data = np.frombuffer(b"".join(expected), dtype=np.uint8)
        bounds = np.concatenate([[0], np.cumsum([len(w) for w in expected])]).astype(np.int64)
        assert word_hashes[offsets[i] : offsets[i + 1]].tolist() == minhash.hash_strings(data, bounds).tolist(), i
    assert minhash.normalize(texts[:3]).to_pylist() == [
        "the quick brown fox x y 0 0 and v0 0 0 ok",
        "istanbul naive resume quoted x 0 0 a b c d ½ ² unicode",
        "日本語のテキスト 句読点 x",
    ]


def _reference_hash(word: bytes) -> int:
    def fmix(x):
        for m in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, None):
            x ^= x >> 33
            if m:
                x = (x * m) % 2**64
        return x

    chunks = [word[i : i + 8] for i in range(0, len(word), 8)]
    total = sum(fmix((int.from_bytes(c, "little") + k * 0x9E3779B97F4A7C15) % 2**64) for k, c in enumerate(chunks))
    return fmix((total + len(word) * int(minhash._LEN_TAG)) % 2**64)


def test_hash_strings_matches_its_definition():
    words = [b"", b"a", b"abcdefgh", b"abcdefghi", b"abcdefgh\x00", b"x" * 17, "caf\u00e9".encode(), b"0123456789" * 5]
    data = np.frombuffer(b"".join(words), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(w) for w in words])]).astype(np.int64)
    got = minhash.hash_strings(data, offsets).tolist()
    assert got == [_reference_hash(w) for w in words]
    assert len(set(got)) == len(words)
    # A slice that does not start at 0 hashes the same.
    assert minhash.hash_strings(data, offsets[3:]).tolist() == got[3:]


def test_shingles_short_documents_and_empty():
    params = MinHashParams()
    hashes, offsets = minhash.shingles(["one two three", "one two three four five six", "", "... !!", "one"], params)
    assert np.diff(offsets).tolist() == [1, 2, 0, 0, 1]
    sig = minhash.signatures(["one two three", "", "... !!"], params)
    assert sig.shape == (3, params.bands * params.rows) and sig.dtype == np.uint32
    assert minhash.has_shingles(sig).tolist() == [True, False, False]
    assert len(minhash.candidate_pairs(sig, params)) == 0  # empty documents never collide


def _reference_shingles(word_hashes: list[int], n: int) -> list[int]:
    """The n-gram hashes of one document, one at a time in Python integers."""
    mult = [int(m) for m in minhash._position_multipliers(n)]

    def fmix(x):
        for m in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, None):
            x ^= x >> 33
            if m:
                x = (x * m) % 2**64
        return x

    if not word_hashes:
        return []
    if len(word_hashes) < n:
        acc = sum(w * m for w, m in zip(word_hashes, mult)) + len(word_hashes) * int(minhash._LEN_TAG)
        return [fmix(acc % 2**64)]
    return [fmix(sum(word_hashes[i + k] * mult[k] for k in range(n)) % 2**64)
            for i in range(len(word_hashes) - n + 1)]


def test_shingles_are_word_ngrams():
    texts = ["w1 w2 w3 w4 w5 w6 w7", "", "only three words", "a b c d e", "x", "p q r s t u v w x y z " * 3]
    word_hashes, word_offsets = minhash.words(texts)
    for n in (1, 3, 5):
        hashes, offsets = minhash.shingles_from_words(word_hashes, word_offsets, n)
        for i in range(len(texts)):
            doc_words = word_hashes[word_offsets[i] : word_offsets[i + 1]].tolist()
            assert hashes[offsets[i] : offsets[i + 1]].tolist() == _reference_shingles(doc_words, n), (n, i)
    # Word order matters; repeating a document's text does not change its set much.
    a, _ = minhash.shingles(["a b c d e f"], PARAMS)
    b, _ = minhash.shingles(["f e d c b a"], PARAMS)
    assert not set(a.tolist()) & set(b.tolist())


def test_signatures_do_not_depend_on_batching():
    texts = [p.read_text("utf-8") for p in sorted(STDLIB.glob("*.py"))[:60]]
    whole = minhash.signatures(texts, PARAMS)
    assert np.array_equal(whole, minhash.signatures(texts, PARAMS, batch_docs=7))
    assert np.array_equal(whole, minhash.signatures(pa.array(texts, pa.large_string()), PARAMS, batch_bytes=50_000))
    hashes, offsets = minhash.shingles(texts, PARAMS)
    small_h, small_o = minhash.shingles(texts, PARAMS, batch_docs=5, batch_bytes=10_000)
    assert np.array_equal(hashes, small_h) and np.array_equal(offsets, small_o)
    assert np.array_equal(whole, minhash.signatures_from_shingles(hashes, offsets, PARAMS, block=333))
    # Reference: the definition, one document at a time.
    a, b = minhash.permutations(PARAMS)
    for i in (0, 17, 59):
        x = hashes[offsets[i] : offsets[i + 1]].astype(np.uint32)
        ref = (a[:, None] * x[None, :] + b[:, None]).min(axis=1)
        assert np.array_equal(whole[i], ref)


def _stdlib_texts(n: int) -> tuple[list[str], list[str]]:
    files = sorted(STDLIB.glob("*.py"))[:n]
    return [p.name for p in files], [p.read_text("utf-8") for p in files]


def test_identical_texts_always_collide():
    names, texts = _stdlib_texts(120)
    copies = [t.upper().replace("\n", "\n\n") for t in texts]  # same words after normalisation
    sig = minhash.signatures(texts + copies, PARAMS)
    assert np.array_equal(sig[: len(texts)], sig[len(texts) :])
    roots = minhash.clusters(len(sig), minhash.candidate_pairs(sig, PARAMS))
    assert (roots[: len(texts)] == roots[len(texts) :]).all()


def test_unrelated_texts_never_collide():
    names, texts = _stdlib_texts(400)  # every top-level stdlib module
    assert len(texts) >= 150
    sig = minhash.signatures(texts, PARAMS)
    pairs = np.unique(minhash.candidate_pairs(sig, PARAMS), axis=0)
    hashes, offsets = minhash.shingle_sets(*minhash.shingles(texts, PARAMS))
    sims = minhash.jaccard(hashes, offsets, pairs)
    collided = {(names[i], names[j]): round(float(s), 3) for (i, j), s in zip(pairs, sims)}
    # The only collisions are real near-duplicates (sre_* are deprecation shims of each other).
    assert all(s >= 0.5 for s in sims), collided
    assert len(pairs) <= 5, collided


def _edit_runs(text: str, fraction: float, rng: random.Random, run: int = 20) -> str:
    """Replace `fraction` of the words, in runs of `run` consecutive words (an edited passage)."""
    spans = [m.span() for m in re.finditer(r"[A-Za-z]+", text)]
    chosen: set[int] = set()
    while len(chosen) < fraction * len(spans):
        start = rng.randrange(0, max(1, len(spans) - run))
        chosen.update(range(start, min(len(spans), start + run)))
    out, last = [], 0
    for k in sorted(chosen):
        a, b = spans[k]
        out += [text[last:a], "".join(rng.choices("qxzjkv", k=6))]
        last = b
    return "".join(out) + text[last:]


def test_lightly_edited_copies_are_found():
    rng = random.Random(0)
    names, texts = _stdlib_texts(400)
    originals = [t for t in texts if 2000 <= len(re.findall(r"[A-Za-z]+", t)) <= 20000][:40]
    edited = [_edit_runs(t, 0.05, rng) for t in originals]
    n = len(originals)
    both = originals + edited
    sig = minhash.signatures(both, PARAMS)
    hashes, offsets = minhash.shingle_sets(*minhash.shingles(both, PARAMS))
    sims = minhash.jaccard(hashes, offsets, np.stack([np.arange(n), np.arange(n) + n], axis=1))
    assert sims.min() >= 0.75 and sims.max() < 1
    ids = [f"orig{i:02d}" for i in range(n)] + [f"edit{i:02d}" for i in range(n)]
    kept_id, kept = minhash.near_duplicates(ids, sig, PARAMS)
    # Every edited copy is dropped in favour of its original ("edit" < "orig").
    found = [kept_id[i + n] == kept_id[i] for i in range(n)]
    assert all(found), [(ids[i], round(float(sims[i]), 3)) for i in range(n) if not found[i]]
    est = minhash.estimated_jaccard(sig[:n], sig[n:])
    assert np.abs(est - sims).mean() < 0.04


# --- LSH, union-find, the decision -------------------------------------------------------


def test_band_partition_equals_all_bands_at_once():
    names, texts = _stdlib_texts(150)
    texts = texts + [t.replace("def ", "def  ") for t in texts[:30]] + texts[40:50]
    sig = minhash.signatures(texts, PARAMS)
    valid = np.flatnonzero(minhash.has_shingles(sig))
    per_band = [minhash.candidate_pairs_for_band(valid, minhash.band_buckets(sig[valid], b, PARAMS))
                for b in range(PARAMS.bands)]
    union = {tuple(p) for part in per_band for p in part.tolist()}
    at_once = {tuple(p) for p in minhash.candidate_pairs(sig, PARAMS).tolist()}
    assert union == at_once and len(union) >= 40
    # Bands (and shards of documents) processed apart, in any order: same clusters.
    shuffled = np.concatenate(per_band[::-1])[::-1]
    assert np.array_equal(minhash.clusters(len(sig), shuffled),
                          minhash.clusters(len(sig), minhash.candidate_pairs(sig, PARAMS)))
    # Band keys are per band: the same rows in another band give another key.
    first, second = minhash.band_buckets(sig, 0, PARAMS), minhash.band_buckets(sig, 1, PARAMS)
    assert not np.array_equal(first, second)
    with pytest.raises(ValueError):
        minhash.band_buckets(sig, PARAMS.bands, PARAMS)


def test_candidate_pairs_for_band_star():
    docs = np.array([10, 11, 12, 13, 14, 15])
    pairs = minhash.candidate_pairs_for_band(docs, np.array([7, 3, 7, 7, 3, 9], np.uint64))
    assert sorted(map(tuple, pairs.tolist())) == [(10, 12), (10, 13), (11, 14)]


def _reference_components(n, pairs):
    uf = minhash.UnionFind(n)
    for a, b in pairs:
        uf.union(int(a), int(b))
    roots = np.array([uf.find(i) for i in range(n)])
    smallest = {}
    for i, r in enumerate(roots):
        smallest.setdefault(r, i)
    return np.array([smallest[r] for r in roots])


def test_union_find_vectorised_matches_scalar():
    rng = np.random.default_rng(1)
    for n, m in ((50, 30), (2000, 1500), (2000, 4000)):
        pairs = rng.integers(0, n, size=(m, 2))
        assert np.array_equal(minhash.clusters(n, pairs), _reference_components(n, pairs))
    chain = np.stack([np.arange(1, 5000), np.arange(0, 4999)], axis=1)[::-1]
    assert (minhash.clusters(5000, chain) == 0).all()
    assert minhash.clusters(3, np.empty((0, 2), np.int64)).tolist() == [0, 1, 2]


def test_union_find_millions_of_pairs_quickly():
    import time

    rng = np.random.default_rng(2)
    n = 1_000_000
    pairs = rng.integers(0, n, size=(1_500_000, 2))
    t0 = time.perf_counter()
    roots = minhash.clusters(n, pairs)
    assert time.perf_counter() - t0 < 15
    assert (roots <= np.arange(n)).all() and (roots[roots] == roots).all()
    assert (roots[pairs[:, 0]] == roots[pairs[:, 1]]).all()


def test_near_duplicates_keep_rule():
    names, texts = _stdlib_texts(20)
    docs = [texts[3], texts[3].upper(), texts[5], texts[3] + " extra words", texts[5], texts[7], ""]
    ids = ["c", "a", "m", "b", "k", "z", "e"]
    sig = minhash.signatures(docs, PARAMS)
    kept_id, kept = minhash.near_duplicates(ids, sig, PARAMS)
    assert kept_id.tolist() == ["a", "a", "k", "a", "k", "z", "e"]
    assert kept.tolist() == [False, True, False, False, True, True, True]
    kept_id, kept = minhash.near_duplicates(ids, sig, PARAMS, quality=[0.2, None, 0.9, 0.8, float("nan"), None, None])
    assert kept_id.tolist() == ["b", "b", "m", "b", "m", "z", "e"]
    assert kept.tolist() == [False, False, True, True, False, True, True]


# --- MinHash against exact Jaccard on a corpus with known near-duplicates -------------------


def _py_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix == ".py" else []
    return sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts) if path.is_dir() else []


def vendored_corpus(unrelated: int = 300) -> tuple[list[str], list[str]]:
    """(labels, texts): libraries setuptools vendors, every other copy of them, and unrelated stdlib files."""
    vendor = SITE / "setuptools" / "_vendor"
    libs = sorted(p.name for p in vendor.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")
                  and not p.name.startswith((".", "_")))
    descendants = {"tomli": ["tomllib"], "importlib_metadata": ["importlib/metadata"],
                   "zipp": ["zipfile", "zipfile.py"]}
    paths: list[tuple[str, Path]] = []
    for lib in libs:
        copies = (vendor, SITE / "pip" / "_vendor", SITE / "pkg_resources" / "_vendor", SITE / "torch" / "_vendor")
        for base in (*copies, SITE):
            where = base.relative_to(SITE).as_posix() if base != SITE else "site-packages"
            paths += [(f"{where}:{lib}", p) for p in _py_files(base / lib) + _py_files(base / f"{lib}.py")]
        for rel in descendants.get(lib, []):
            paths += [(f"stdlib:{lib}", p) for p in _py_files(STDLIB / rel)]
    others = [p for p in sorted(STDLIB.glob("*.py")) + sorted(STDLIB.glob("*/*.py"))
              if not any(part in ("test", "tests", "tomllib", "importlib", "zipfile", "encodings") for part in p.parts)]
    paths += [("unrelated", p) for p in others[:unrelated]]
    labels, texts = [], []
    for label, path in paths:
        text = path.read_text("utf-8", errors="replace")
        if text.strip():
            labels.append(f"{label}:{path.name}")
            texts.append(text)
    return labels, texts


@pytest.fixture(scope="module")
def vendored():
    labels, texts = vendored_corpus()
    hashes, offsets = minhash.shingles(texts, PARAMS)
    set_hashes, set_offsets = minhash.shingle_sets(hashes, offsets)
    sig = minhash.signatures_from_shingles(hashes, offsets, PARAMS)
    return labels, texts, set_hashes, set_offsets, sig


def test_exact_similar_pairs_is_exact(vendored):
    labels, texts, hs, so, _ = vendored
    # Brute force: the Jaccard of every pair of the first 150 files (vendored libraries and their copies).
    n = 150
    sub_h, sub_o = hs[: so[n]], so[: n + 1]
    i, j = np.triu_indices(n, k=1)
    all_pairs = np.stack([i, j], axis=1)
    sims = minhash.jaccard(sub_h, sub_o, all_pairs)
    brute = {tuple(p): s for p, s in zip(all_pairs.tolist(), sims) if s >= 0.5}
    got_pairs, got_sims = minhash.exact_similar_pairs(sub_h, sub_o, 0.5)
    got = dict(zip(map(tuple, got_pairs.tolist()), got_sims))
    assert got.keys() == brute.keys() and len(got) >= 20
    assert all(abs(got[p] - s) < 1e-12 for p, s in brute.items())


def test_minhash_recall_and_precision_against_exact_jaccard(vendored):
    labels, texts, hs, so, sig = vendored
    truth, sims = minhash.exact_similar_pairs(hs, so, 0.7)
    roots = minhash.clusters(len(texts), minhash.candidate_pairs(sig, PARAMS))
    high = sims >= PARAMS.threshold
    together = roots[truth[:, 0]] == roots[truth[:, 1]]
    recall = together[high].mean()
    near = high & (sims < 1)
    # Precision: share of the pairs LSH puts in one cluster whose exact Jaccard is >= 0.7.
    members = [np.flatnonzero(roots == r) for r in np.unique(roots)]
    clustered = np.array([(a, b) for m in members if len(m) > 1 for i, a in enumerate(m) for b in m[i + 1 :]])
    clustered_sims = minhash.jaccard(hs, so, clustered)
    precision = (clustered_sims >= 0.7).mean()
    report = (f"{len(texts)} files, {high.sum()} pairs with J >= 0.8 ({near.sum()} with J < 1): "
              f"recall {recall:.3f} (near-only {together[near].mean():.3f}), "
              f"precision (clustered pairs with J >= 0.7) {precision:.3f} of {len(clustered)}")
    print(report)
    assert high.sum() >= 40 and near.sum() >= 15, report
    assert recall >= 0.95, report
    assert precision >= 0.7, report
    # The MinHash estimate is unbiased on these pairs.
    est = minhash.estimated_jaccard(sig[truth[:, 0]], sig[truth[:, 1]])
    assert abs((est - sims).mean()) < 0.02 and np.abs(est - sims).mean() < 0.05, report


def test_lsh_memory_per_document():
    mem = minhash.lsh_bytes_per_doc(PARAMS)
    assert mem == {"signature": 448, "band_keys": 112, "band_task": 89, "all_at_once": 560, "band_by_band": 537}


# --- semantic dedup (SemDeDup on embeddings) -------------------------------------------


def _clustered_unit_vectors(n=3000, d=64, topics=30, noise=0.15, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((topics, d)).astype(np.float32)
    topic = rng.integers(topics, size=n)
    x = centers[topic] / np.sqrt(d) + noise * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    return x / np.linalg.norm(x, axis=1, keepdims=True), topic


def test_kmeans_is_faiss_spherical_kmeans():
    import faiss

    from filters.semantic_dedup import kmeans

    x, _ = _clustered_unit_vectors()
    labels, centroids = kmeans(x, 30, iterations=10, seed=3)
    ref = faiss.Kmeans(x.shape[1], 30, niter=10, spherical=True, seed=3, verbose=False, min_points_per_centroid=1,
                       max_points_per_centroid=256, init_method=faiss.ClusteringInitMethod_AFK_MC2)
    ref.train(x)
    _, ref_labels = ref.index.search(x, 1)
    assert np.array_equal(labels, ref_labels[:, 0])
    assert np.allclose(np.linalg.norm(centroids, axis=1), 1, atol=1e-5)
    # Well-separated topics come out as clusters, one topic each (AFK-MC2 seeding, 0.97-1.0 over three
    # data seeds; faiss's default random seeding merges topics here, purity 0.69-0.84).
    x, topic = _clustered_unit_vectors(noise=0.05)
    labels, _ = kmeans(x, 30, iterations=20, seed=0)
    purity = sum(np.bincount(topic[labels == c]).max() for c in np.unique(labels)) / len(x)
    assert purity >= 0.95, purity
    with pytest.raises(ValueError, match="at least one vector"):
        kmeans(np.empty((0, 8), np.float32), 1, iterations=5, seed=0)


def test_semantic_duplicates_finds_planted_copies():
    from assay.config import SemanticDedupParams
    from filters.semantic_dedup import semantic_duplicates

    rng = np.random.default_rng(1)
    x, _ = _clustered_unit_vectors(n=2000, noise=0.3)
    src = rng.choice(len(x), size=100, replace=False)
    copies = x[src] + 0.05 * rng.standard_normal((100, x.shape[1])).astype(np.float32) / np.sqrt(x.shape[1])
    copies /= np.linalg.norm(copies, axis=1, keepdims=True)
    vectors = np.concatenate([x, copies])
    result = semantic_duplicates(vectors, SemanticDedupParams(docs_per_cluster=50, eps=0.01))
    pair_dropped = ~result.keep[src] | ~result.keep[len(x):]
    assert pair_dropped.mean() >= 0.95, pair_dropped.mean()
    # The originals are not near one another (cosine < 0.99): only planted pairs may be dropped.
    dropped = np.flatnonzero(~result.keep)
    planted = set(src.tolist()) | set(range(len(x), len(vectors)))
    assert set(dropped.tolist()) <= planted
    assert np.all(result.duplicate_of[dropped] >= 0) and np.all(result.keep[result.duplicate_of[dropped]])


def test_large_k_clusters_in_two_levels_and_still_finds_planted_copies():
    """Above max_flat_clusters, k-means runs coarse-then-fine (n * sqrt(k) work, not n * k). The fine
    clusters nest inside the coarse ones, their number is about k, and SemDeDup still drops the planted
    near-copies and nothing else."""
    from assay.config import SemanticDedupParams
    from filters.semantic_dedup import cluster, kmeans, semantic_duplicates

    rng = np.random.default_rng(2)
    x, _ = _clustered_unit_vectors(n=3000, noise=0.3)
    # Up to max_flat, cluster is exactly the flat faiss k-means.
    flat = kmeans(x, 60, iterations=10, seed=0)
    same = cluster(x, 60, iterations=10, seed=0, max_flat=60)
    assert np.array_equal(flat[0], same[0]) and np.allclose(flat[1], same[1])

    labels, centroids = cluster(x, 60, iterations=10, seed=0, max_flat=8)
    coarse, _ = kmeans(x, 8, iterations=10, seed=0)  # ceil(sqrt(60)) = 8 coarse clusters, as cluster's first level
    assert set(np.unique(labels)) == set(range(len(centroids)))
    assert 50 <= len(centroids) <= 70, len(centroids)
    for c in range(len(centroids)):
        assert len(np.unique(coarse[labels == c])) == 1  # every fine cluster lies inside one coarse cluster
    assert np.allclose(np.linalg.norm(centroids, axis=1), 1, atol=1e-5)

    # Diffuse topics, so that coarse boundaries split some pairs: a second partition must catch them.
    x, _ = _clustered_unit_vectors(n=3000, topics=300, noise=3.0)
    src = rng.choice(len(x), size=150, replace=False)
    copies = x[src] + 0.05 * rng.standard_normal((150, x.shape[1])).astype(np.float32) / np.sqrt(x.shape[1])
    copies /= np.linalg.norm(copies, axis=1, keepdims=True)
    vectors = np.concatenate([x, copies])
    recalls, drops = [], []
    for partitions in (1, 2):
        result = semantic_duplicates(vectors, SemanticDedupParams(docs_per_cluster=50, eps=0.01,
                                                                  max_flat_clusters=8, partitions=partitions))
        assert result.cluster.max() + 1 > 8  # the two-level path ran
        recalls.append((~result.keep[src] | ~result.keep[len(x):]).mean())
        dropped = np.flatnonzero(~result.keep)
        drops.append(set(dropped.tolist()))
        assert drops[-1] <= set(src.tolist()) | set(range(len(x), len(vectors)))
        # Never both of a pair, and every duplicate points at a document that stayed.
        assert not np.any(~result.keep[src] & ~result.keep[len(x):])
        assert np.all(result.keep[result.duplicate_of[dropped]])
    assert drops[0] <= drops[1]  # the second partition only adds to the first's verdicts
    assert recalls[0] >= 0.95 and recalls[1] == 1.0, recalls


def test_lsh_band_task_memory_is_measured_not_just_the_formula():
    """One band task of the dedup stage allocates far less than a copy of the signatures (448 B a document):
    only its band's columns, one key and the sort (traced numpy allocations, peak over the start)."""
    import tracemalloc

    from assay.stages.dedup import Corpus, band_pairs

    n = 100_000
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 2**32 - 1, size=(n, PARAMS.bands * PARAMS.rows), dtype=np.uint32)
    sig[::50] = sig[1::50]  # some shared buckets
    corpus = Corpus(ids=None, kinds=None, sources=None, langs=None, paths=None, quality=None, hashes=None,
                    signatures=sig, shard_of=None)
    alive = np.ones(n, dtype=bool)
    params = DedupParams()
    tracemalloc.start()
    try:
        pairs = band_pairs(corpus, alive, 3, params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(pairs) == n // 50
    assert peak / n < 200, f"{peak / n:.0f} B a document"
    mine = minhash.candidate_pairs_for_band(np.arange(n), minhash.band_buckets(sig, 3, PARAMS))
    assert np.array_equal(pairs, mine)


def test_gather_moves_signatures_out_of_the_scans():
    """The flow keeps its scans after gather; if they kept their signatures too, every one would be held twice."""
    from assay.stages.dedup import ShardScan, gather

    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 2**32, size=(m, 112), dtype=np.uint32) for m in (5, 0, 7)]
    scans = [ShardScan([f"{i}-{j}" for j in range(len(s))], ["text"] * len(s), ["src"] * len(s), ["en"] * len(s),
                       ["p"] * len(s), np.zeros(len(s)), np.zeros(len(s), np.uint64), s.copy())
             for i, s in enumerate(shards)]
    corpus = gather(scans)
    assert np.array_equal(corpus.signatures, np.concatenate(shards))
    assert all(s.signatures is None for s in scans)
    assert list(corpus.shard_of) == [0] * 5 + [2] * 7


# --- one-permutation signatures (dedup.minhash.scheme: one_permutation) -----------------------

OPH = MinHashParams(scheme="one_permutation")


def test_one_permutation_signatures_definition_and_densification():
    texts = [p.read_text("utf-8") for p in sorted(STDLIB.glob("*.py"))[:40]] + ["", "one two three", "a b c d e f"]
    whole = minhash.signatures(texts, OPH)
    assert np.array_equal(whole, minhash.signatures(texts, OPH, batch_docs=7))  # batching changes nothing
    assert not np.array_equal(whole, minhash.signatures(texts, PARAMS))  # a different scheme
    hashes, offsets = minhash.shingles(texts, OPH)
    num = OPH.bands * OPH.rows
    mult = minhash._fmix64(np.array([OPH.seed + 0x632BE59BD9B4E019], dtype=np.uint64)) | np.uint64(1)
    for i in (0, 17, 39):  # long files: every bin filled, each the minimum of its shingles' values
        g = hashes[offsets[i] : offsets[i + 1]] * mult[0]
        bins = ((g >> np.uint64(32)) * np.uint64(num)) >> np.uint64(32)
        ref = np.array([g[bins == k].astype(np.uint32).min() for k in range(num)], dtype=np.uint32)
        assert np.array_equal(whole[i], ref)
    assert (whole[40] == minhash.EMPTY).all()  # no words: no signature, no LSH
    assert len(np.unique(whole[41])) == 1 and whole[41, 0] != minhash.EMPTY  # one shingle fills every bin
    assert (whole[42] != minhash.EMPTY).all() and len(np.unique(whole[42])) == 2  # two shingles, densified
    # Densification copies from the same bins in every document: identical sets stay identical.
    again = minhash.signatures(["a b c d e f", "one two three"], OPH)
    assert np.array_equal(again, whole[[42, 41]])
    with pytest.raises(AssayError, match="dedup.minhash.scheme"):  # refused where params are made
        MinHashParams(scheme="nope")


def test_one_permutation_recall_against_exact_jaccard(vendored):
    labels, texts, hs, so, _ = vendored
    hashes, offsets = minhash.shingles(texts, OPH)
    sig = minhash.one_permutation_signatures(hashes, offsets, OPH)
    truth, sims = minhash.exact_similar_pairs(hs, so, 0.7)
    roots = minhash.clusters(len(texts), minhash.candidate_pairs(sig, OPH))
    high = sims >= OPH.threshold
    recall = (roots[truth[high, 0]] == roots[truth[high, 1]]).mean()
    est = minhash.estimated_jaccard(sig[truth[:, 0]], sig[truth[:, 1]])
    assert recall >= 0.95, recall
    assert abs((est - sims).mean()) < 0.02 and np.abs(est - sims).mean() < 0.05
