"""Benchmark: MinHash signatures + LSH (near-duplicate dedup), ours against datasketch, datatrove and rensa;
and semantic dedup's k-means (--kmeans).

    .venv/bin/python bench/dedup.py [--docs 3000] [--doc-files 1500] [--planted 300] [--skip-datatrove]
    .venv/bin/python bench/dedup.py --kmeans 20000,50000
    .venv/bin/python bench/dedup.py --kmeans-scale 100000,200000,400000,1000000 [--flat-max 400000]

rensa is optional (`pip install rensa==0.5.0`, no dependencies); without it its rows say "not installed".

The MinHash corpus is real files with known and planted near-duplicates:
every .py file that setuptools, pip and torch vendor (`*/_vendor/*`), the
standalone installs of the same libraries in site-packages, their
standard-library descendants (tomllib from tomli, importlib.metadata from
importlib_metadata, zipfile from zipp), then standard-library and other
site-packages files in sorted order up to `--docs`; then up to
`--doc-files` text files of /usr/share/doc (copyright files, READMEs,
changelogs: prose, and licences that repeat); then an edited copy of
`--planted` random documents (lines deleted, duplicated or with a word
replaced, 2-25% of them). Files over 1 MB, empty or not UTF-8 are left out.

Systems, each end to end (shingling + signatures + LSH candidate pairs and
clusters), 112 hashes, 14 bands x 8 rows, seed 1, one thread
(RAYON_NUM_THREADS=1 for rensa), CPU seconds (`time.process_time`, which a
machine shared with other jobs disturbs less than wall time):

- ours: `filters.minhash` (simplified text, hashed word 5-grams, numpy
  signatures, band keys, union-find), with the default scheme
  (permutations) and with `scheme: one_permutation` on the same shingles;
- datasketch 2.0 `MinHash(num_perm=112)` + `update_batch` (or `MinHash.bulk`
  + `LeanMinHash`), then `MinHashLSH(params=(14, 8))`, insertion session +
  one query per document; shingles either as a plain pipeline would make
  them (`\\w+` words of the lowercased text, n-grams joined in Python) or our
  words (`normalize()`) joined in Python;
- rensa 0.5.0: `RMinHash.from_token_sets` + `RMinHashLSH(0.8, 112, 14)`
  `insert_many` + `query_all`, on the same two kinds of shingle strings
  (rensa has no shingler); and rensa's signatures on our shingle hashes
  (`digest_matrix_from_flat_token_hashes`) with our LSH;
- datatrove: `MinhashDedupSignature` (its signature stage, writing its
  bucket files) with FineWeb's config on the first `--datatrove-docs`
  documents, and, when the default xxhash config fails, `hash_fc="sha1"`.

Ground truth is exact Jaccard on our shingle sets
(`filters.minhash.exact_similar_pairs`, prefix filtering, exact for every
pair at or above 0.7). Recall: share of pairs with J >= 0.8 (all of them,
those with J < 1, and the planted ones) that a system's LSH puts in one
cluster (connected components of its candidate pairs). Precision: share of
the pairs inside LSH clusters whose exact J >= 0.7. A system whose shingles
differ from ours (the plain `\\w+` pipeline) is judged on our sets, so its
recall is partly the definitions' difference.

--kmeans: `filters.semantic_dedup.semantic_duplicates` with its k-means
swapped for each candidate (our former NumPy k-means++, faiss with random,
k-means++ or AFK-MC2 seeding), on synthetic 384-d unit vectors in topics
with 2% planted near-copies; plus the purity of each on well-separated
topics. Memory of the LSH stage: bench/dedup_memory.py.

--kmeans-scale: the whole SemDeDup step (`semantic_duplicates`, defaults)
as the corpus grows, flat k-means (k = n / docs_per_cluster, so n * k work:
quadratic) against two-level k-means (sqrt(k) coarse clusters, each split
to its share: n * sqrt(k)) with one partition and with the default two. The
same synthetic vectors as --kmeans; flat runs only up to --flat-max.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_BYTES = 1 << 20
VENDOR_DIRS = ("setuptools/_vendor", "pip/_vendor", "pkg_resources/_vendor", "torch/_vendor")
#: Standard-library modules that started as a vendored library.
STDLIB_DESCENDANTS = {"tomli": ["tomllib"], "importlib_metadata": ["importlib/metadata"],
                      "zipp": ["zipfile", "zipfile.py"]}
SKIP_PARTS = {"__pycache__", "test", "tests", "idle_test", "site-packages"}


def _py_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix == ".py" else []
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)


def vendored_corpus() -> list[tuple[str, Path]]:
    """(group, path) for the vendored libraries, their standalone installs and stdlib descendants.

    group is "vendored:<lib>", "standalone:<lib>" or "stdlib:<lib>".
    """
    site = Path(sysconfig.get_paths()["purelib"])
    std = Path(sysconfig.get_paths()["stdlib"])
    libs: set[str] = set()
    out: list[tuple[str, Path]] = []
    for vendor in VENDOR_DIRS:
        root = site / vendor
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(("_", ".")) or entry.name.endswith(".dist-info"):
                continue
            name = entry.stem if entry.suffix == ".py" else entry.name
            files = _py_files(entry)
            if files:
                libs.add(name)
                out += [(f"vendored:{name}", p) for p in files]
    for name in sorted(libs):
        for candidate in (site / name, site / f"{name}.py"):
            out += [(f"standalone:{name}", p) for p in _py_files(candidate)]
        for rel in STDLIB_DESCENDANTS.get(name, []):
            out += [(f"stdlib:{name}", p) for p in _py_files(std / rel)]
    return out


def corpus(n_docs: int = 3000) -> list[tuple[str, str, str]]:
    """(group, path, text): the vendored corpus, then stdlib and site-packages files up to n_docs."""
    site = Path(sysconfig.get_paths()["purelib"])
    std = Path(sysconfig.get_paths()["stdlib"])
    chosen = vendored_corpus()
    seen = {p.resolve() for _, p in chosen}
    fillers = [("stdlib", p) for p in _py_files(std) if not SKIP_PARTS.intersection(p.relative_to(std).parts)]
    fillers += [("site-packages", p) for p in _py_files(site)
                if not any(part in ("_vendor",) for part in p.relative_to(site).parts)
                and not SKIP_PARTS.intersection(p.relative_to(site).parts)]
    docs = []
    for group, path in chosen + fillers:
        if len(docs) >= n_docs:
            break
        real = path.resolve()
        if group in ("stdlib", "site-packages") and real in seen:
            continue
        seen.add(real)
        try:
            if path.stat().st_size > MAX_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append((group, str(path), text))
    return docs


DOC_NAMES = ("copyright", "readme", "changelog", "news", "authors", "todo")


def doc_corpus(n_docs: int) -> list[tuple[str, str, str]]:
    """(group "doc", path, text) of /usr/share/doc text files (gzipped ones unpacked): licences, READMEs, changelogs."""
    import gzip

    root = Path("/usr/share/doc")
    out = []
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        if len(out) >= n_docs:
            break
        name = path.name.lower()
        if not path.is_file() or path.is_symlink() or not (name.startswith(DOC_NAMES) or name.endswith((".txt", ".md"))):
            continue
        try:
            raw = path.read_bytes()
            if name.endswith(".gz"):
                raw = gzip.decompress(raw)
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.strip() and len(raw) <= MAX_BYTES:
            out.append(("doc", str(path), text))
    return out


def plant_near_duplicates(docs: list[tuple[str, str, str]], count: int, seed: int = 0):
    """Edited copies of `count` random documents: each copy has 2-25% of its lines deleted, duplicated or
    with one word replaced (rate drawn per copy), so its word 5-gram Jaccard with the original spreads over
    about 0.66-0.96 (5th-95th percentile). Returns (the copies as documents, (original index, copy index) pairs)."""
    import random

    rng = random.Random(seed)
    eligible = [i for i, (_, _, t) in enumerate(docs) if t.count("\n") >= 20]
    chosen = sorted(rng.sample(eligible, min(count, len(eligible))))
    copies, pairs = [], []
    for i in chosen:
        group, path, text = docs[i]
        rate = rng.uniform(0.02, 0.25)
        lines = []
        for line in text.split("\n"):
            r = rng.random()
            if r < rate / 3:
                continue
            if r < 2 * rate / 3:
                lines += [line, line]
            elif r < rate and line.split():
                words = line.split(" ")
                words[rng.randrange(len(words))] = f"edit{rng.randrange(10**6)}"
                lines.append(" ".join(words))
            else:
                lines.append(line)
        pairs.append((i, len(docs) + len(copies)))
        copies.append((f"planted:{group}", path + "#copy", "\n".join(lines)))
    return copies, pairs


# --- measurements ----------------------------------------------------------------


def cluster_pairs(roots):
    """Every pair (i < j) of documents in one cluster."""
    import numpy as np

    order = np.argsort(roots, kind="stable")
    r = roots[order]
    out = []
    bounds = np.flatnonzero(np.diff(np.concatenate([[-1], r, [-1]])))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi - lo > 1:
            members = np.sort(order[lo:hi])
            i, j = np.triu_indices(hi - lo, k=1)
            out.append(np.stack([members[i], members[j]], axis=1))
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)


def quality_of(roots, truth_pairs, truth_sims, set_hashes, set_offsets, planted=None, threshold=0.8,
               precision_threshold=0.7):
    """recall (J >= threshold pairs clustered together), near recall (threshold <= J < 1), recall of the
    planted pairs with J >= threshold, precision, #cluster pairs."""
    import numpy as np

    from filters.minhash import jaccard

    hi = truth_sims >= threshold
    together = roots[truth_pairs[hi, 0]] == roots[truth_pairs[hi, 1]]
    near = truth_sims[hi] < 1.0
    pairs = cluster_pairs(roots)
    # Exact J of every clustered pair: look up the truth table first (all pairs >= 0.7 are there).
    sims = jaccard(set_hashes, set_offsets, pairs) if len(pairs) else np.empty(0)
    precision = float((sims >= precision_threshold).mean()) if len(pairs) else float("nan")
    planted_recall = float("nan")
    if planted is not None and len(planted):
        planted_recall = float((roots[planted[:, 0]] == roots[planted[:, 1]]).mean())
    return {
        "planted_recall": planted_recall,
        "recall": float(together.mean()) if hi.any() else float("nan"),
        "near_recall": float(together[near].mean()) if near.any() else float("nan"),
        "precision": precision,
        "cluster_pairs": int(len(pairs)),
    }


def lsh_clusters(sig, params):
    """Our LSH over any (n, bands * rows) signature matrix: the same step for every signature scheme."""
    import numpy as np

    from filters import minhash

    valid = np.flatnonzero(minhash.has_shingles(sig))
    pairs = [minhash.candidate_pairs_for_band(valid, minhash.band_buckets(sig[valid], b, params))
             for b in range(params.bands)]
    return minhash.clusters(len(sig), np.concatenate(pairs))


def run_ours(texts, params):
    from filters import minhash

    t0 = time.process_time()
    hashes, offsets = minhash.shingles(texts, params)
    t1 = time.process_time()
    sig = minhash.signatures_from_shingles(hashes, offsets, params)
    t2 = time.process_time()
    roots = lsh_clusters(sig, params)
    t3 = time.process_time()
    return {"shingle_s": t1 - t0, "sig_s": t2 - t1, "lsh_s": t3 - t2, "roots": roots, "sig": sig,
            "hashes": hashes, "offsets": offsets}


def run_ours_signatures(hashes, offsets, params, scheme: str):
    """Signatures of another scheme on the same shingles, then the same LSH."""
    import dataclasses

    from filters import minhash

    params = dataclasses.replace(params, scheme=scheme)
    t0 = time.process_time()
    sig = (minhash.one_permutation_signatures(hashes, offsets, params) if scheme == "one_permutation"
           else minhash.signatures_from_shingles(hashes, offsets, params))
    t1 = time.process_time()
    roots = lsh_clusters(sig, params)
    t2 = time.process_time()
    return {"sig_s": t1 - t0, "lsh_s": t2 - t1, "roots": roots, "sig": sig}


def shingle_strings(texts, params):
    """The same shingles as n-gram strings (bytes), built in Python from the normalised text."""
    from filters.minhash import normalize

    n = params.ngram
    out = []
    for text in normalize(texts).to_pylist():
        words = text.split(" ") if text else []
        if len(words) >= n:
            out.append([" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)])
        else:
            out.append([" ".join(words).encode()] if words else [])
    return out


def roots_from_neighbours(n, neighbours):
    import numpy as np

    from filters.minhash import clusters

    pairs = [(i, j) for i, found in enumerate(neighbours) for j in found if j != i]
    return clusters(n, np.array(pairs, dtype=np.int64).reshape(-1, 2))


def run_datasketch(shingles, params, bulk: bool):
    from datasketch import LeanMinHash, MinHash, MinHashLSH

    num_perm = params.bands * params.rows
    t0 = time.process_time()
    if bulk:
        sketches = [LeanMinHash(m) for m in MinHash.bulk(shingles, num_perm=num_perm, seed=params.seed)]
    else:
        sketches = []
        for items in shingles:
            m = MinHash(num_perm=num_perm, seed=params.seed)
            m.update_batch(items)
            sketches.append(m)
    t1 = time.process_time()
    lsh = MinHashLSH(num_perm=num_perm, params=(params.bands, params.rows))
    keep = [i for i, items in enumerate(shingles) if items]
    with lsh.insertion_session() as session:
        for i in keep:
            session.insert(i, sketches[i])
    neighbours = [lsh.query(sketches[i]) if shingles[i] else [] for i in range(len(shingles))]
    roots = roots_from_neighbours(len(shingles), neighbours)
    t2 = time.process_time()
    return {"sig_s": t1 - t0, "lsh_s": t2 - t1, "roots": roots}


def run_rensa(shingles, params):
    """rensa end to end on shingle strings: RMinHash.from_token_sets, then RMinHashLSH insert_many + query_all."""
    import rensa

    num_perm = params.bands * params.rows
    t0 = time.process_time()
    keep = [i for i, items in enumerate(shingles) if items]
    sketches = rensa.RMinHash.from_token_sets([shingles[i] for i in keep], num_perm, params.seed)
    t1 = time.process_time()
    lsh = rensa.RMinHashLSH(params.threshold, num_perm, params.bands)
    lsh.insert_many(sketches)
    found = lsh.query_all(sketches)
    neighbours = [[] for _ in shingles]
    for k, hits in enumerate(found):
        neighbours[keep[k]] = [keep[h] for h in hits]
    roots = roots_from_neighbours(len(shingles), neighbours)
    t2 = time.process_time()
    return {"sig_s": t1 - t0, "lsh_s": t2 - t1, "roots": roots}


WORD = re.compile(r"\w+")


def regex_shingles(texts: list[str], n: int, encode: bool) -> list[list]:
    """The plain pipeline's shingles: `\\w+` words of the lowercased text, word n-grams joined by spaces
    (a document of 1..n-1 words is one shingle), as bytes (datasketch) or str (rensa)."""
    out = []
    for text in texts:
        words = WORD.findall(text.lower())
        grams = ([" ".join(words[i : i + n]) for i in range(len(words) - n + 1)] if len(words) >= n
                 else [" ".join(words)] if words else [])
        out.append([g.encode() for g in grams] if encode else grams)
    return out


def run_rensa_on_our_shingles(hashes, offsets, params):
    """Our shingle hashes, rensa's signatures (RMinHash digest matrix), our LSH (band keys + union-find)."""
    import numpy as np
    import rensa

    num_perm = params.bands * params.rows
    t0 = time.process_time()
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(hashes, offsets.astype(np.uint64), num_perm,
                                                                 params.seed)
    t1 = time.process_time()
    sig = np.array(matrix.to_rows(), dtype=np.uint32).reshape(-1, num_perm)  # its only way out: lists
    t2 = time.process_time()
    roots = lsh_clusters(sig, params)
    t3 = time.process_time()
    return {"sig_s": t1 - t0, "export_s": t2 - t1, "lsh_s": t3 - t2, "roots": roots, "sig": sig}


def run_datatrove(texts, params, hash_fc: str):
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig

    config = MinhashConfig(n_grams=params.ngram, num_buckets=params.bands, hashes_per_bucket=params.rows,
                           seed=params.seed, hash_config=HashConfig(hash_fc=hash_fc))
    with tempfile.TemporaryDirectory() as tmp:
        stage = MinhashDedupSignature(output_folder=tmp, config=config)
        docs = (Document(text=t, id=str(i)) for i, t in enumerate(texts))
        t0 = time.process_time()
        stage.run(docs, rank=0)
        return time.process_time() - t0


# --- semantic dedup: k-means ----------------------------------------------------------


def numpy_kmeans(x, k, *, iterations, seed):
    """The NumPy spherical k-means++ that filters.semantic_dedup had before faiss (kept here to compare)."""
    import numpy as np

    n = len(x)
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    centroids = np.empty((k, x.shape[1]), dtype=np.float32)
    centroids[0] = x[rng.integers(n)]
    closest = 1.0 - x @ centroids[0]
    for i in range(1, k):
        weights = np.clip(closest, 0, None) ** 2
        total = weights.sum()
        pick = rng.choice(n, p=weights / total) if total > 0 else rng.integers(n)
        centroids[i] = x[pick]
        closest = np.minimum(closest, 1.0 - x @ centroids[i])
    labels = np.zeros(n, dtype=np.int64)
    for it in range(iterations):
        new = np.argmax(x @ centroids.T, axis=1)
        if it and np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, x)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        empty = norms[:, 0] == 0
        centroids = np.where(empty[:, None], centroids, sums / np.where(norms == 0, 1, norms))
    return labels, centroids


def faiss_kmeans(init: str):
    def run(x, k, *, iterations, seed):
        import faiss
        import numpy as np

        method = {"random": faiss.ClusteringInitMethod_RANDOM,
                  "k-means++": faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS,
                  "afk-mc2": faiss.ClusteringInitMethod_AFK_MC2}[init]
        km = faiss.Kmeans(x.shape[1], k, niter=iterations, spherical=True, seed=seed, verbose=False,
                          init_method=method, min_points_per_centroid=1,
                          max_points_per_centroid=max(256, -(-len(x) // k)))
        km.train(x)
        _, labels = km.index.search(x, 1)
        return labels[:, 0].astype(np.int64), km.centroids
    return run


def clustered_embeddings(n, d=384, per_topic=50, planted=0.02, seed=0):
    """Unit vectors around n / per_topic random topic directions (spread varying per topic, cosine
    within a topic about 0.5-0.9), plus `planted` * n near-copies of random members (cosine ~0.998).
    Returns (vectors, source row of every copy, topic of every vector)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    topics = max(1, n // per_topic)
    centers = rng.standard_normal((topics, d)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    spread = rng.uniform(0.35, 1.0, size=topics).astype(np.float32)
    topic = rng.integers(topics, size=n)
    x = centers[topic] + spread[topic, None] * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    m = int(planted * n)
    src = rng.choice(n, size=m, replace=False)
    copies = x[src] + 0.06 * rng.standard_normal((m, d)).astype(np.float32) / np.sqrt(d)
    copies /= np.linalg.norm(copies, axis=1, keepdims=True)
    return np.concatenate([x, copies]), src, np.concatenate([topic, topic[src]])


def kmeans_main(sizes: list[int]) -> None:
    import numpy as np

    import filters.semantic_dedup as sd
    from assay.config import SemanticDedupParams

    params = SemanticDedupParams()
    systems = [("NumPy k-means++ (before)", numpy_kmeans), ("faiss, random init", faiss_kmeans("random")),
               ("faiss, k-means++ init", faiss_kmeans("k-means++")), ("faiss, AFK-MC2 init (now)", faiss_kmeans("afk-mc2"))]
    # Seeding matters where topics are well separated and k equals their number (the tests' data).
    print("Well-separated topics (3,000 x 64, 30 topics, noise 0.05, k = 30, 20 iterations): purity per data seed\n")
    print("| k-means | seed 0 | seed 1 | seed 2 |")
    print("|---|---:|---:|---:|")
    for name, fn in systems:
        purities = []
        for seed in range(3):
            rng = np.random.default_rng(seed)
            centers = rng.standard_normal((30, 64)).astype(np.float32)
            topic = rng.integers(30, size=3000)
            x = centers[topic] / 8 + 0.05 * rng.standard_normal((3000, 64)).astype(np.float32) / 8
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            labels, _ = fn(x, 30, iterations=20, seed=0)
            purities.append(sum(np.bincount(topic[labels == c]).max() for c in np.unique(labels)) / len(x))
        print(f"| {name} | " + " | ".join(f"{p:.3f}" for p in purities) + " |")
    print()
    print(f"SemDeDup k-means: docs_per_cluster {params.docs_per_cluster}, {params.kmeans_iterations} iterations, "
          f"eps {params.eps}; synthetic 384-d unit vectors in topics of ~50 plus 2% planted near-copies.\n")
    print("| documents | k | k-means | wall s | CPU s | mean cosine to centroid | topic purity | planted pairs dropped | "
          "other drops | same pairs found as now | same member dropped |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    original = sd.kmeans
    for n in sizes:
        x, src, topic = clustered_embeddings(n)
        copies = np.arange(n, len(x))
        k = max(1, len(x) // params.docs_per_cluster)
        results = {}
        for name, fn in systems:
            calls = {}

            def timed(v, kk, *, iterations, seed, fn=fn, calls=calls):
                w, c = time.perf_counter(), time.process_time()
                out = fn(v, kk, iterations=iterations, seed=seed)
                calls["wall"], calls["cpu"], calls["out"] = time.perf_counter() - w, time.process_time() - c, out
                return out

            sd.kmeans = timed
            try:
                res = sd.semantic_duplicates(x, params)
            finally:
                sd.kmeans = original
            labels, cen = calls["out"]
            cen = cen / np.linalg.norm(cen, axis=1, keepdims=True)
            objective = float((x * cen[labels]).sum(axis=1).mean())
            purity = sum(np.bincount(topic[labels == c]).max() for c in np.unique(labels)) / len(x)
            dropped = ~res.keep
            pair = dropped[src] | dropped[copies]
            planted = np.zeros(len(x), bool)
            planted[src] = planted[copies] = True
            found = {frozenset((int(d), int(t))) for d, t in zip(np.flatnonzero(dropped), res.duplicate_of[dropped])}
            results[name] = (calls, f"{objective:.4f} | {purity:.3f}", pair.mean(), int((dropped & ~planted).sum()), dropped, found)
        _, _, _, _, ref, ref_found = results["faiss, AFK-MC2 init (now)"]
        for name, (calls, objective, recall, other, dropped, found) in results.items():
            same_pairs = len(found & ref_found) / max(1, len(found | ref_found))
            same = (dropped & ref).sum() / max(1, (dropped | ref).sum())
            print(f"| {len(x):,} | {k} | {name} | {calls['wall']:.2f} | {calls['cpu']:.2f} | {objective} | "
                  f"{recall:.3f} | {other} | {same_pairs:.3f} | {same:.3f} |")


def kmeans_scale_main(sizes: list[int], flat_max: int) -> None:
    import dataclasses

    import numpy as np

    from assay.config import SemanticDedupParams
    from filters.semantic_dedup import semantic_duplicates

    default = SemanticDedupParams()
    variants = [("flat k-means (before)", dataclasses.replace(default, max_flat_clusters=2**62)),
                ("two-level, 1 partition", dataclasses.replace(default, partitions=1)),
                (f"two-level, {default.partitions} partitions (now)", default)]
    print(f"SemDeDup as the corpus grows: docs_per_cluster {default.docs_per_cluster}, {default.kmeans_iterations} "
          f"iterations, eps {default.eps}, max_flat_clusters {default.max_flat_clusters}; synthetic 384-d unit "
          f"vectors in topics of ~50 plus 2% planted near-copies (cosine ~0.998); one thread.\n")
    # "same drops": of the documents either dropped, the share both dropped (which copy of a pair goes
    # depends on the centroids, so it is low when the pairs found are the same).
    print("| documents | k | SemDeDup | CPU s | wall s | planted pairs dropped | other drops | same drops as flat |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for n in sizes:
        x, src, _ = clustered_embeddings(n)
        copies = np.arange(n, len(x))
        planted = np.zeros(len(x), bool)
        planted[src] = planted[copies] = True
        flat_dropped = None
        for name, params in variants:
            if params.max_flat_clusters > default.max_flat_clusters and n > flat_max:
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            res = semantic_duplicates(x, params)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            dropped = ~res.keep
            if flat_dropped is None and params.max_flat_clusters > default.max_flat_clusters:
                flat_dropped = dropped
            same = "-" if flat_dropped is None else f"{(dropped & flat_dropped).sum() / max(1, (dropped | flat_dropped).sum()):.4f}"
            k = len(x) // default.docs_per_cluster
            if k <= default.max_flat_clusters and params is not variants[0][1]:
                name += f" (flat here: k <= {default.max_flat_clusters})"
            print(f"| {len(x):,} | {k:,} | {name} | {cpu:.2f} | {wall:.2f} | "
                  f"{(dropped[src] | dropped[copies]).mean():.4f} | {int((dropped & ~planted).sum())} | {same} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=3000, help=".py files")
    parser.add_argument("--doc-files", type=int, default=1500, help="/usr/share/doc text files")
    parser.add_argument("--planted", type=int, default=300, help="documents that get an edited copy")
    parser.add_argument("--skip-datatrove", action="store_true")
    parser.add_argument("--datatrove-docs", type=int, default=400,
                        help="datatrove runs on the first N documents only (it is slow); docs/s is per its N")
    parser.add_argument("--skip-rensa", action="store_true")
    parser.add_argument("--kmeans", default=None, metavar="N,N",
                        help="instead: semantic dedup's k-means side by side on N synthetic embeddings (e.g. 20000,100000)")
    parser.add_argument("--kmeans-scale", default=None, metavar="N,N",
                        help="instead: the SemDeDup step as the corpus grows, flat against two-level k-means")
    parser.add_argument("--flat-max", type=int, default=400_000,
                        help="with --kmeans-scale: run flat k-means only up to this many documents")
    args = parser.parse_args(argv)
    if args.kmeans_scale:
        kmeans_scale_main([int(v) for v in args.kmeans_scale.split(",")], args.flat_max)
        return
    if args.kmeans:
        kmeans_main([int(v) for v in args.kmeans.split(",")])
        return

    import numpy as np
    import pyarrow as pa

    from assay.config import DedupParams
    from filters import minhash

    params = DedupParams().minhash
    docs = corpus(args.docs) + doc_corpus(args.doc_files)
    copies, planted = plant_near_duplicates(docs, args.planted)
    docs += copies
    planted = np.array(planted, dtype=np.int64).reshape(-1, 2)
    plain = [t for _, _, t in docs]
    texts = pa.array(plain, pa.large_string())
    n = len(docs)
    groups = {}
    for g, _, _ in docs:
        kind = g.split(":")[0]
        groups[kind] = groups.get(kind, 0) + 1
    mb = sum(len(t.encode()) for t in plain) / 1e6
    print(f"corpus: {n} documents, {mb:.1f} MB ({', '.join(f'{k}: {v}' for k, v in groups.items())}); "
          f"planted: edited copies of {len(planted)} of them")
    # The first call in a process builds RE2 classes of non-ASCII characters from pyarrow's tables
    # (once per process, whatever the corpus size): timed here, outside the per-corpus figures.
    t0 = time.process_time()
    minhash.shingles(pa.array(["Ünïcödé wörds, ½ ٣ digits — and ASCII"] + plain[:50], pa.large_string()), params)
    print(f"one-time setup of the shingler (first call in a process): {time.process_time() - t0:.2f} s CPU")

    ours = run_ours(texts, params)
    set_h, set_o = minhash.shingle_sets(ours["hashes"], ours["offsets"])
    t0 = time.process_time()
    truth_pairs, truth_sims = minhash.exact_similar_pairs(set_h, set_o, 0.7)
    truth_s = time.process_time() - t0
    n80 = int((truth_sims >= params.threshold).sum())
    n_near = int(((truth_sims >= params.threshold) & (truth_sims < 1)).sum())
    planted_j = minhash.jaccard(set_h, set_o, planted)
    planted_hi = planted[planted_j >= params.threshold]
    print(f"exact Jaccard (prefix filtering, {truth_s:.1f} s): {len(truth_pairs)} pairs >= 0.7, "
          f"{n80} >= 0.8 ({n_near} of them with J < 1); planted pairs: {len(planted_hi)} of {len(planted)} "
          f"have J >= 0.8 (J of all planted: {np.percentile(planted_j, 5):.2f}-{np.percentile(planted_j, 95):.2f}, "
          f"5th-95th percentile)\n")

    rows: list[dict] = []

    def row(name, shingle_s=None, sig_s=None, lsh_s=None, roots=None, note="", docs_n=n, failed=None):
        total = None if failed else (shingle_s or 0) + (sig_s or 0) + (lsh_s or 0)
        q = quality_of(roots, truth_pairs, truth_sims, set_h, set_o, planted_hi) if roots is not None else None
        rows.append({"name": name, "shingle": shingle_s, "sig": sig_s, "lsh": lsh_s, "total": total, "q": q,
                     "note": failed or note, "n": docs_n})

    row("ours (filters.minhash)", ours["shingle_s"], ours["sig_s"], ours["lsh_s"], ours["roots"],
        "shingles: simplified text (datatrove's), hashed word 5-grams; scheme: permutations (default)")
    oph = run_ours_signatures(ours["hashes"], ours["offsets"], params, "one_permutation")
    row("ours, scheme: one_permutation", ours["shingle_s"], oph["sig_s"], oph["lsh_s"], oph["roots"],
        "same shingles; one pass, densified bins (dedup.minhash.scheme)")

    t0 = time.process_time()
    regex_bytes = regex_shingles(plain, params.ngram, encode=True)
    regex_bytes_s = time.process_time() - t0
    t0 = time.process_time()
    regex_str = regex_shingles(plain, params.ngram, encode=False)
    regex_str_s = time.process_time() - t0
    t0 = time.process_time()
    strings = shingle_strings(texts, params)
    strings_s = time.process_time() - t0
    for bulk, items, items_s, how in ((False, regex_bytes, regex_bytes_s, "plain: regex \\w+ words + Python n-grams"),
                                      (False, strings, strings_s, "our words (normalize()) + Python n-grams"),
                                      (True, strings, strings_s, "our words (normalize()) + Python n-grams")):
        name = ("datasketch MinHash.bulk + LeanMinHash + MinHashLSH" if bulk
                else "datasketch MinHash.update_batch + MinHashLSH")
        try:
            ds = run_datasketch(items, params, bulk)
            row(name, items_s, ds["sig_s"], ds["lsh_s"], ds["roots"], how)
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            row(name, failed=f"failed: {type(exc).__name__}: {exc}")

    if not args.skip_rensa:
        try:
            import rensa  # noqa: F401

            for items, items_s, how in ((regex_str, regex_str_s, "plain: regex \\w+ words + Python n-grams (str)"),
                                        (strings, strings_s, "our words (normalize()) + Python n-grams")):
                rs = run_rensa(items, params)
                row("rensa RMinHash.from_token_sets + RMinHashLSH", items_s, rs["sig_s"], rs["lsh_s"], rs["roots"],
                    f"Rust; {how}")
            combo = run_rensa_on_our_shingles(ours["hashes"], ours["offsets"], params)
            row("ours shingles + rensa digest_matrix_from_flat_token_hashes + our LSH", ours["shingle_s"],
                combo["sig_s"], combo["export_s"] + combo["lsh_s"], combo["roots"],
                f"Rust signatures on our shingle hashes; LSH s includes {combo['export_s']:.2f} s of to_rows() "
                "(its only export)")
        except ImportError:
            row("rensa", failed="not installed")
        except Exception as exc:  # noqa: BLE001
            row("rensa", failed=f"failed: {type(exc).__name__}: {exc}")

    if not args.skip_datatrove:
        subset = texts.slice(0, args.datatrove_docs).to_pylist()
        for hash_fc in ("xxhash", "sha1"):
            name = f"datatrove MinhashDedupSignature (hash_fc={hash_fc})"
            try:
                seconds = run_datatrove(subset, params, hash_fc)
                row(name, sig_s=seconds, docs_n=len(subset),
                    note=f"signature stage only (own tokenizer, writes bucket files), on the first {len(subset)} "
                         "documents: total and docs/s are for those")
            except Exception as exc:  # noqa: BLE001
                row(name, failed=f"failed: {type(exc).__name__}: {exc}")

    def fmt(x, spec=".2f"):
        return "" if x is None else format(x, spec)

    ours_speed = n / rows[0]["total"]
    print("CPU seconds (process_time), one thread; docs/s = documents / total; ours/theirs = our docs/s over theirs; "
          "recall and precision against exact Jaccard of our shingle sets.\n")
    print("| system | shingling s | signatures s | LSH s | total s | docs/s | ours/theirs | recall planted J>=0.8 | "
          "recall J>=0.8 | recall 0.8<=J<1 | precision (J>=0.7) | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        speed = r["n"] / r["total"] if r["total"] else None
        ratio = fmt(ours_speed / speed, ".1f") + "x" if speed and r is not rows[0] else ""
        q = r["q"]
        planted_rec = fmt(q["planted_recall"], ".3f") if q else ""
        rec = fmt(q["recall"], ".3f") if q else ""
        near = fmt(q["near_recall"], ".3f") if q else ""
        prec = fmt(q["precision"], ".3f") + f" ({q['cluster_pairs']} pairs)" if q else ""
        print(f"| {r['name']} | {fmt(r['shingle'])} | {fmt(r['sig'])} | {fmt(r['lsh'])} | {fmt(r['total'])} | "
              f"{fmt(speed, '.0f')} | {ratio} | {planted_rec} | {rec} | {near} | {prec} | {r['note']} |")

    sig = ours["sig"]
    est = (sig[truth_pairs[:, 0]] == sig[truth_pairs[:, 1]]).mean(axis=1)
    print(f"\nMinHash estimate vs exact J on the {len(truth_pairs)} pairs >= 0.7: "
          f"mean error {np.mean(est - truth_sims):+.4f}, mean |error| {np.mean(np.abs(est - truth_sims)):.4f}.")
    est = (oph["sig"][truth_pairs[:, 0]] == oph["sig"][truth_pairs[:, 1]]).mean(axis=1)
    print(f"scheme one_permutation on the same shingles: mean error {np.mean(est - truth_sims):+.4f}, "
          f"mean |error| {np.mean(np.abs(est - truth_sims)):.4f}.")
    if not args.skip_rensa and "combo" in locals():
        est = (combo["sig"][truth_pairs[:, 0]] == combo["sig"][truth_pairs[:, 1]]).mean(axis=1)
        print(f"rensa's digest on the same shingles: mean error {np.mean(est - truth_sims):+.4f}, "
              f"mean |error| {np.mean(np.abs(est - truth_sims)):.4f}.")
    print("Memory: `bench/dedup_memory.py` measures it.")


if __name__ == "__main__":
    main()
