"""The local vector store at 100k × 384: build time, queries/s and recall@10.

    python bench/vectors.py [--n 100000] [--dim 384] [--queries 1000] [--no-clustered]

Two data sets: random unit vectors, and clustered ones (1,000 Gaussian blobs,
queries drawn near the blobs, which is closer to real embeddings and harder
for HNSW). Each goes into two `LocalVectorStore`s:

- flat: exact_max = n, so `IndexFlatIP` (exact);
- HNSW: exact_max = n / 2, so `IndexHNSWFlat` (M32, efConstruction 40, efSearch 64).

"build" is `upsert_documents` (SQLite rows + faiss index) and "save" the
atomic save to disk. "open + graph answer" opens the saved store read-only and
answers one graph question (`get` without the vector: no index read); "open +
first near" then runs one vector query, which reads the faiss index. Queries run through the store's API, both as one
`near_many` batch and one `near` call at a time, unfiltered and with property
filters of three selectivities. Recall@10 is against numpy brute force on the
same filter. Timings drift by about 20% between runs on shared machines.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assay.vectors import DocumentRecord  # noqa: E402
from assay.vectors.local import LocalVectorStore  # noqa: E402

SOURCES = ("web", "code", "books", "papers", "forums")


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_data(n: int, dim: int, queries: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return unit(rng.standard_normal((n, dim), dtype=np.float32)), unit(rng.standard_normal((queries, dim), dtype=np.float32))


def clustered_data(n: int, dim: int, queries: int, rng: np.random.Generator, blobs: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    centres = unit(rng.standard_normal((blobs, dim), dtype=np.float32))
    data = centres[rng.integers(0, blobs, n)] + rng.standard_normal((n, dim), dtype=np.float32) * 0.03
    near = centres[rng.integers(0, blobs, queries)] + rng.standard_normal((queries, dim), dtype=np.float32) * 0.03
    return unit(data), unit(near)


def properties(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "source": rng.integers(0, len(SOURCES), n),
        "code": rng.random(n) < 0.5,
        "kept": rng.random(n) < 0.8,
    }


#: name → (where, mask function of the properties)
FILTERS = {
    "none": (None, None),
    "status=kept (80%)": ({"status": "kept"}, lambda p: p["kept"]),
    "kept & code (40%)": ({"status": "kept", "kind": "code"}, lambda p: p["kept"] & p["code"]),
    "source=papers & code (10%)": ({"source": "papers", "kind": "code"}, lambda p: (p["source"] == 3) & p["code"]),
}


def records(vectors: np.ndarray, props: dict[str, np.ndarray]):
    for i in range(len(vectors)):
        yield DocumentRecord(
            doc_id=f"d{i}",
            vector=vectors[i],
            kind="code" if props["code"][i] else "text",
            source=SOURCES[props["source"][i]],
            status="kept" if props["kept"][i] else "near_dup",
            quality=None,
        )


def truths(vectors: np.ndarray, queries: np.ndarray, props: dict[str, np.ndarray], k: int = 10) -> dict[str, np.ndarray]:
    """Brute-force top-k ids per filter, from one pass of query blocks."""
    penalties = {
        name: (np.zeros(len(vectors), np.float32) if mask_of is None
               else np.where(mask_of(props), np.float32(0), np.float32(-np.inf)))
        for name, (_where, mask_of) in FILTERS.items()
    }
    out = {name: np.empty((len(queries), k), np.int64) for name in FILTERS}
    for start in range(0, len(queries), 100):
        scores = queries[start : start + 100] @ vectors.T
        for name, penalty in penalties.items():
            out[name][start : start + 100] = np.argpartition(-(scores + penalty), k, axis=1)[:, :k]
    return out


def recall(store_hits, expected: np.ndarray) -> float:
    found = 0
    for hits, want in zip(store_hits, expected):
        found += len({int(h.doc_id[1:]) for h in hits} & set(want.tolist()))
    return found / expected.size


def bench_store(label: str, index_name: str, vectors, queries, props, expected, exact_max: int, folder: Path, one_by_one: int) -> list[str]:
    rows = []
    store = LocalVectorStore(folder, exact_max=exact_max)
    started = time.perf_counter()
    store.upsert_documents(records(vectors, props))
    build = time.perf_counter() - started
    started = time.perf_counter()
    store.save()
    save = time.perf_counter() - started
    assert store.index_kind == index_name, (store.index_kind, index_name)
    # A reader's first answers: a graph question reads no index; the first vector query reads it.
    started = time.perf_counter()
    with LocalVectorStore(folder, read_only=True) as reader:
        reader.get("d0", with_vector=False)
        graph_s = time.perf_counter() - started
        reader.near(queries[0], 10)
        near_s = time.perf_counter() - started
    for name, (where, _mask_of) in FILTERS.items():
        store.near_many(queries[:5], 10, where)  # warm the filter mask cache as a real caller would
        started = time.perf_counter()
        hits = store.near_many(queries, 10, where)
        batch_qps = len(queries) / (time.perf_counter() - started)
        started = time.perf_counter()
        for query in queries[:one_by_one]:
            store.near(query, 10, where)
        single_qps = one_by_one / (time.perf_counter() - started)
        first = name == "none"
        rows.append(
            f"| {label} | {index_name} | {name} | {f'{build:.2f}' if first else ''} | {f'{save:.2f}' if first else ''} "
            f"| {f'{graph_s:.3f}' if first else ''} | {f'{near_s:.3f}' if first else ''} "
            f"| {batch_qps:,.0f} | {single_qps:,.0f} | {recall(hits, expected[name]):.3f} |"
        )
        print(rows[-1], flush=True)
    store.close()
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--one-by-one", type=int, default=100, help="queries timed through single near() calls")
    parser.add_argument("--no-clustered", action="store_true", help="random data only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    header = [
        f"{args.n:,} × {args.dim} vectors, {args.queries:,} queries, top 10; "
        f"q/s batch = one near_many call, q/s single = {args.one_by_one} near() calls",
        "",
        "| data | index | filter | build s | save s | open + graph answer s | open + first near s | q/s batch "
        "| q/s single | recall@10 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    rows: list[str] = []
    sets = [("random", random_data)] + ([] if args.no_clustered else [("clustered", clustered_data)])
    tmp = Path(tempfile.mkdtemp(prefix="assay-bench-vectors-"))
    try:
        for label, make in sets:
            vectors, queries = make(args.n, args.dim, args.queries, rng)
            props = properties(args.n, rng)
            expected = truths(vectors, queries, props)
            rows += bench_store(label, "flat", vectors, queries, props, expected, args.n, tmp / f"{label}-flat", args.one_by_one)
            rows += bench_store(label, "hnsw", vectors, queries, props, expected, args.n // 2, tmp / f"{label}-hnsw", args.one_by_one)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = "\n".join(header + rows)
    print()
    print(table)
    return table


if __name__ == "__main__":
    main()
