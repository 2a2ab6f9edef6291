"""Benchmark: MinHash signatures + LSH (near-duplicate dedup), ours against datasketch, datatrove and rensa.

    .venv/bin/python bench/dedup.py [--docs 3000] [--skip-datatrove] [--skip-rensa]

The corpus is real Python source with known near-duplicates: every .py file
that setuptools, pip and torch vendor (`*/_vendor/*`), the standalone
installs of the same libraries in site-packages, their standard-library
descendants (tomllib from tomli, importlib.metadata from importlib_metadata,
zipfile from zipp), then standard-library and other site-packages files in
sorted order up to `--docs` (files over 1 MB, empty or not UTF-8 are left
out). Every system sees the same shingles: word 5-grams of
`filters.minhash.normalize` (datatrove-style simplified text), as uint64
hashes for us (and rensa's flat-hash API) and as the n-gram strings for
datasketch and rensa's token API. Everything runs single-threaded in this
process (RAYON_NUM_THREADS=1 for rensa), and times are CPU seconds of this
process (`time.process_time`), which a machine shared with other jobs
disturbs less than wall time.

- ours: `filters.minhash` end to end: shingling (normalise, split, hash) +
  signatures (numpy, 112 affine hashes, segmented min) + LSH (14 band keys,
  per-band candidate pairs, vectorised union-find);
- datasketch 2.0: n-gram strings built in Python from the same normalised
  text, then `MinHash(num_perm=112)` + `update_batch` per document, or the
  bulk API (`MinHash.bulk` + `LeanMinHash`), then `MinHashLSH(num_perm=112,
  params=(14, 8))` insertion session + one query per document;
- datatrove: `MinhashDedupSignature` (its signature stage, writing its bucket
  files) with FineWeb's config, and, when the default xxhash config fails,
  the same with `HashConfig(hash_fc="sha1")`;
- rensa (if installed): `RMinHash.from_token_sets` + `RMinHashLSH(0.8, 112,
  14)`, and its `digest_matrix_from_flat_token_hashes` on our shingle hashes.

Ground truth is exact Jaccard on the same shingle sets
(`filters.minhash.exact_similar_pairs`, prefix filtering, exact for every
pair at or above 0.7). Recall: share of pairs with J >= 0.8 that a system's
LSH puts in one cluster (connected components of its candidate pairs).
Precision: share of the pairs inside LSH clusters whose exact J >= 0.7.
"""

from __future__ import annotations

import argparse
import os
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


def quality_of(roots, truth_pairs, truth_sims, set_hashes, set_offsets, threshold=0.8, precision_threshold=0.7):
    """recall (J >= threshold pairs clustered together), near recall (threshold <= J < 1), precision, #cluster pairs."""
    import numpy as np

    from filters.minhash import jaccard

    hi = truth_sims >= threshold
    together = roots[truth_pairs[hi, 0]] == roots[truth_pairs[hi, 1]]
    near = truth_sims[hi] < 1.0
    pairs = cluster_pairs(roots)
    # Exact J of every clustered pair: look up the truth table first (all pairs >= 0.7 are there).
    sims = jaccard(set_hashes, set_offsets, pairs) if len(pairs) else np.empty(0)
    precision = float((sims >= precision_threshold).mean()) if len(pairs) else float("nan")
    return {
        "recall": float(together.mean()) if hi.any() else float("nan"),
        "near_recall": float(together[near].mean()) if near.any() else float("nan"),
        "precision": precision,
        "cluster_pairs": int(len(pairs)),
    }


def run_ours(texts, params):
    import numpy as np

    from filters import minhash

    t0 = time.process_time()
    hashes, offsets = minhash.shingles(texts, params)
    t1 = time.process_time()
    sig = minhash.signatures_from_shingles(hashes, offsets, params)
    t2 = time.process_time()
    valid = np.flatnonzero(minhash.has_shingles(sig))
    pairs = [minhash.candidate_pairs_for_band(valid, minhash.band_buckets(sig[valid], b, params))
             for b in range(params.bands)]
    roots = minhash.clusters(len(texts), np.concatenate(pairs))
    t3 = time.process_time()
    return {"shingle_s": t1 - t0, "sig_s": t2 - t1, "lsh_s": t3 - t2, "roots": roots, "sig": sig,
            "hashes": hashes, "offsets": offsets}


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


def run_rensa(shingles, hashes, offsets, params):
    import numpy as np
    import rensa

    num_perm = params.bands * params.rows
    t0 = time.process_time()
    keep = [i for i, items in enumerate(shingles) if items]
    sketches = rensa.RMinHash.from_token_sets([shingles[i] for i in keep], num_perm, params.seed)
    t1 = time.process_time()
    lsh = rensa.RMinHashLSH(0.8, num_perm, params.bands)
    lsh.insert_many(sketches)
    found = lsh.query_all(sketches)
    neighbours = [[] for _ in shingles]
    for k, hits in enumerate(found):
        neighbours[keep[k]] = [keep[h] for h in hits]
    roots = roots_from_neighbours(len(shingles), neighbours)
    t2 = time.process_time()
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(hashes, offsets.astype(np.uint64), num_perm,
                                                                 params.seed)
    t3 = time.process_time()
    assert matrix.len() == len(offsets) - 1
    return {"sig_s": t1 - t0, "lsh_s": t2 - t1, "roots": roots, "flat_sig_s": t3 - t2}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--skip-datatrove", action="store_true")
    parser.add_argument("--datatrove-docs", type=int, default=400,
                        help="datatrove runs on the first N documents only (it is slow); docs/s is per its N")
    parser.add_argument("--skip-rensa", action="store_true")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow as pa

    from assay.config import DedupParams
    from filters import minhash

    params = DedupParams().minhash
    docs = corpus(args.docs)
    texts = pa.array([t for _, _, t in docs], pa.large_string())
    n = len(docs)
    groups = {}
    for g, _, _ in docs:
        kind = g.split(":")[0]
        groups[kind] = groups.get(kind, 0) + 1
    mb = sum(len(t.encode()) for _, _, t in docs) / 1e6
    print(f"corpus: {n} .py files, {mb:.1f} MB ({', '.join(f'{k}: {v}' for k, v in groups.items())})")
    minhash.shingles(texts.slice(0, 50), params)  # warm up (RE2 classes, numpy)

    ours = run_ours(texts, params)
    set_h, set_o = minhash.shingle_sets(ours["hashes"], ours["offsets"])
    t0 = time.process_time()
    truth_pairs, truth_sims = minhash.exact_similar_pairs(set_h, set_o, 0.7)
    truth_s = time.process_time() - t0
    n80 = int((truth_sims >= params.threshold).sum())
    n_near = int(((truth_sims >= params.threshold) & (truth_sims < 1)).sum())
    print(f"exact Jaccard (prefix filtering, {truth_s:.1f} s): {len(truth_pairs)} pairs >= 0.7, "
          f"{n80} >= 0.8 ({n_near} of them with J < 1)\n")

    rows: list[dict] = []

    def row(name, shingle_s=None, sig_s=None, lsh_s=None, roots=None, note="", docs_n=n, failed=None):
        total = None if failed else (shingle_s or 0) + (sig_s or 0) + (lsh_s or 0)
        q = quality_of(roots, truth_pairs, truth_sims, set_h, set_o) if roots is not None else None
        rows.append({"name": name, "shingle": shingle_s, "sig": sig_s, "lsh": lsh_s, "total": total, "q": q,
                     "note": failed or note, "n": docs_n})

    row("ours (filters.minhash)", ours["shingle_s"], ours["sig_s"], ours["lsh_s"], ours["roots"])

    t0 = time.process_time()
    strings = shingle_strings(texts, params)
    strings_s = time.process_time() - t0
    for bulk in (False, True):
        name = ("datasketch MinHash.bulk + LeanMinHash + MinHashLSH" if bulk
                else "datasketch MinHash.update_batch + MinHashLSH")
        try:
            ds = run_datasketch(strings, params, bulk)
            row(name, strings_s, ds["sig_s"], ds["lsh_s"], ds["roots"], "shingling: normalize() + Python n-grams")
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            row(name, failed=f"failed: {type(exc).__name__}: {exc}")

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

    if not args.skip_rensa:
        try:
            import rensa  # noqa: F401

            rs = run_rensa(strings, ours["hashes"], ours["offsets"], params)
            row("rensa RMinHash.from_token_sets + RMinHashLSH", strings_s, rs["sig_s"], rs["lsh_s"], rs["roots"],
                "Rust; shingling: normalize() + Python n-grams")
            row("rensa digest_matrix_from_flat_token_hashes (our shingles)", ours["shingle_s"], rs["flat_sig_s"],
                note="Rust signatures on our shingle hashes; no LSH")
        except ImportError:
            row("rensa", failed="not installed")
        except Exception as exc:  # noqa: BLE001
            row("rensa", failed=f"failed: {type(exc).__name__}: {exc}")

    def fmt(x, spec=".2f"):
        return "" if x is None else format(x, spec)

    ours_speed = n / rows[0]["total"]
    print("CPU seconds (process_time); docs/s = documents / total; ours/theirs = our docs/s over theirs.\n")
    print("| system | shingling s | signatures s | LSH s | total s | docs/s | ours/theirs | recall J>=0.8 | "
          "recall 0.8<=J<1 | precision (J>=0.7) | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        speed = r["n"] / r["total"] if r["total"] else None
        ratio = fmt(ours_speed / speed, ".1f") + "x" if speed and r is not rows[0] else ""
        q = r["q"]
        rec = fmt(q["recall"], ".3f") if q else ""
        near = fmt(q["near_recall"], ".3f") if q else ""
        prec = fmt(q["precision"], ".3f") + f" ({q['cluster_pairs']} pairs)" if q else ""
        print(f"| {r['name']} | {fmt(r['shingle'])} | {fmt(r['sig'])} | {fmt(r['lsh'])} | {fmt(r['total'])} | "
              f"{fmt(speed, '.0f')} | {ratio} | {rec} | {near} | {prec} | {r['note']} |")

    mem = minhash.lsh_bytes_per_doc(params)
    sig = ours["sig"]
    measured = sig.nbytes / n + params.bands * 8
    print(f"\nLSH memory per document: signature {mem['signature']} B ({sig.dtype}, {sig.shape[1]} hashes) "
          f"+ band keys {mem['band_keys']} B = {mem['all_at_once']} B (measured {measured:.0f} B); "
          f"band by band {mem['band_by_band']} B.")
    print(f"Per million documents: {mem['all_at_once'] * 1e6 / 2**20:.0f} MiB all bands at once, "
          f"{mem['band_by_band'] * 1e6 / 2**20:.0f} MiB band by band "
          f"(union-find: +{16 * 1e6 / 2**20:.0f} MiB; candidate pairs: 16 B each).")
    est = (sig[truth_pairs[:, 0]] == sig[truth_pairs[:, 1]]).mean(axis=1)
    print(f"MinHash estimate vs exact J on the {len(truth_pairs)} pairs >= 0.7: "
          f"mean error {np.mean(est - truth_sims):+.4f}, mean |error| {np.mean(np.abs(est - truth_sims)):.4f}.")


if __name__ == "__main__":
    main()
