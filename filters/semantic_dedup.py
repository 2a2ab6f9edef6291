"""Semantic dedup in the manner of SemDeDup (Abbas et al., 2023), on stored embeddings.

1. k-means over the L2-normalised embeddings (k from the corpus size; in
   two levels when k is large, see `cluster`);
2. inside each cluster, members are ordered by preference: farthest from
   the centroid first (SemDeDup's choice: prototypical examples are the
   redundant ones) or highest quality first;
3. a member is a duplicate when its cosine similarity to any member earlier
   in that order exceeds `1 - eps` (eps 0.01 by default, NeMo Curator's).

k-means is faiss's (spherical); the pairwise step is one NumPy matrix
product per cluster, so clusters must stay small (`docs_per_cluster`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from assay.config import SemanticDedupParams

REASON = "semantic_dup"


def kmeans(x: np.ndarray, k: int, *, iterations: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (cosine) with faiss: (labels, unit centroids).

    `faiss.Kmeans(spherical=True)`: assignment by inner product, centroids
    re-normalised after every update, empty clusters split from large ones,
    seeded with AFK-MC2 (a Markov-chain approximation of k-means++; Bachem
    et al. 2016). It replaced a NumPy k-means++ of our own: on 20,400 and
    51,000 embeddings with planted near-copies (`bench/dedup.py --kmeans`)
    it found the same duplicate pairs with 2.4-3x less CPU time, at a
    mean cosine to the centroid 0.001-0.007 lower. faiss's uniform random
    seeding is as fast but merges well-separated topics (purity 0.69-0.84
    where k-means++-style seeding gets 0.97-1.0, tests/test_dedup_filters.py),
    and its exact k-means++ seeding costs as much as our NumPy one.
    """
    import faiss  # the vector store's dependency; imported here so the rest of dedup does not need it

    x = np.ascontiguousarray(x, dtype=np.float32)
    n = len(x)
    if n == 0:
        raise ValueError("kmeans needs at least one vector")
    k = max(1, min(k, n))
    # min_points_per_centroid=1: small clusters are what SemDeDup asks for (docs_per_cluster), not a mistake.
    km = faiss.Kmeans(x.shape[1], k, niter=iterations, spherical=True, seed=seed, verbose=False,
                      init_method=faiss.ClusteringInitMethod_AFK_MC2,
                      min_points_per_centroid=1, max_points_per_centroid=max(256, -(-n // k)))
    km.train(x)
    _, labels = km.index.search(x, 1)
    centroids = km.centroids / np.maximum(np.linalg.norm(km.centroids, axis=1, keepdims=True), 1e-12)
    return labels[:, 0].astype(np.int64), centroids.astype(np.float32)


def cluster(x: np.ndarray, k: int, *, iterations: int, seed: int, max_flat: int) -> tuple[np.ndarray, np.ndarray]:
    """k clusters of the unit vectors x: (labels, unit centroids).

    Up to `max_flat` clusters this is one flat `kmeans`. Above it, flat
    k-means costs n * k per iteration, and with k = n / docs_per_cluster that
    is quadratic in the corpus (1,022 s for 200k documents against 192 s for
    100k, BENCHMARKS.md). So the vectors are first split into ceil(sqrt(k))
    coarse clusters, and each part gets its share of the k clusters
    (proportional to its size), recursively: about n * sqrt(k) per
    iteration. The price is that two near-copies split by a coarse boundary
    are not compared (`semantic_duplicates` answers that with several
    partitions); the fine level is the same k-means.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = len(x)
    k = max(1, min(k, n))
    if k <= max_flat:
        return kmeans(x, k, iterations=iterations, seed=seed)
    coarse = int(np.ceil(np.sqrt(k)))
    coarse_labels, _ = kmeans(x, coarse, iterations=iterations, seed=seed)
    labels = np.empty(n, dtype=np.int64)
    centroids = []
    found = 0
    with _one_thread():
        for part in _groups(coarse_labels):
            share = max(1, int(round(k * len(part) / n)))
            part_labels, part_centroids = cluster(x[part], share, iterations=iterations, seed=seed,
                                                  max_flat=max_flat)
            labels[part] = part_labels + found
            centroids.append(part_centroids)
            found += len(part_centroids)
    return labels, np.concatenate(centroids)


@contextmanager
def _one_thread() -> Iterator[None]:
    """faiss on one OpenMP thread. The parts of a two-level k-means are small (~n / sqrt(k) vectors); on
    them OpenMP's fork/join and spin-waiting cost more than the threads gain: with 2 threads on the shared
    2-core machine, SemDeDup of 200k vectors took 72 CPU s against 11 on one (BENCHMARKS.md)."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def _groups(labels: np.ndarray) -> list[np.ndarray]:
    """Rows of each label, ascending within a group: one sort, not a scan of every row per label
    (that scan alone is n * k, quadratic at SemDeDup's k)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    return np.split(order, bounds)


@dataclass
class SemanticResult:
    keep: np.ndarray  # bool per row
    duplicate_of: np.ndarray  # int row of the kept document, -1 when kept
    cluster: np.ndarray  # k-means cluster per row (the first partition's)
    max_similarity: np.ndarray  # to a preferred member of its cluster, best over partitions (NaN for the first)


def semantic_duplicates(
    vectors: np.ndarray, params: SemanticDedupParams, quality: np.ndarray | None = None
) -> SemanticResult:
    """SemDeDup over the rows of `vectors`.

    With flat k-means (k <= max_flat_clusters) this is one pass, as the
    paper. With two-level k-means a near-copy pair split by a coarse
    boundary is never compared (1.5% of planted pairs at 204k documents,
    BENCHMARKS.md), so `partitions` independent clusterings (seeds seed,
    seed + 1, ...) each judge the documents the earlier ones kept, the way
    LSH uses several tables: a pair is missed only when every partition
    splits it.
    """
    n = len(vectors)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    keep = np.ones(n, dtype=bool)
    duplicate_of = np.full(n, -1, dtype=np.int64)
    best = np.full(n, np.nan)
    labels = np.zeros(n, dtype=np.int64)
    if n == 0:
        return SemanticResult(keep, duplicate_of, labels, best)
    two_level = n // max(1, params.docs_per_cluster) > params.max_flat_clusters
    for partition in range(params.partitions if two_level else 1):
        rows = np.flatnonzero(keep)
        k = max(1, len(rows) // max(1, params.docs_per_cluster))
        part_labels, centroids = cluster(x[rows], k, iterations=params.kmeans_iterations,
                                         seed=params.seed + partition, max_flat=params.max_flat_clusters)
        if partition == 0:
            labels = part_labels
        for members in _groups(part_labels):
            if len(members) > 1:
                _drop_near_copies(x, rows[members], centroids[part_labels[members[0]]], params, quality,
                                  keep, duplicate_of, best)
    # A later partition may drop the document an earlier duplicate points at: point at what it kept.
    dropped = np.flatnonzero(~keep)
    while True:
        stale = dropped[~keep[duplicate_of[dropped]]]
        if len(stale) == 0:
            break
        duplicate_of[stale] = duplicate_of[duplicate_of[stale]]
    return SemanticResult(keep, duplicate_of, labels, best)


def _drop_near_copies(x: np.ndarray, members: np.ndarray, centroid: np.ndarray, params: SemanticDedupParams,
                      quality: np.ndarray | None, keep: np.ndarray, duplicate_of: np.ndarray,
                      best: np.ndarray) -> None:
    """One cluster: order the members by preference, drop each whose cosine to an earlier one is over 1 - eps."""
    if params.keep == "quality" and quality is not None:
        q = np.nan_to_num(np.asarray(quality, dtype=np.float64)[members], nan=-np.inf)
        order = members[np.lexsort((members, -q))]
    else:  # farthest from the centroid first; ties by row for determinism
        order = members[np.lexsort((members, x[members] @ centroid))]
    sims = x[order] @ x[order].T
    earlier = np.triu(sims, k=1)  # [i, j]: similarity of j to an earlier i
    earlier[np.tril_indices(len(order))] = -np.inf
    top = earlier.argmax(axis=0)
    top_sim = earlier[top, np.arange(len(order))]
    best[order[1:]] = np.fmax(best[order[1:]], top_sim[1:])
    dropped = top_sim > 1.0 - params.eps
    for j in np.flatnonzero(dropped):
        target = top[j]
        while dropped[target]:  # point at a kept document, not at another duplicate
            target = top[target]
        keep[order[j]] = False
        duplicate_of[order[j]] = order[target]
