"""Semantic dedup in the manner of SemDeDup (Abbas et al., 2023), on stored embeddings.

1. k-means over the L2-normalised embeddings (k from the corpus size);
2. inside each cluster, members are ordered by preference: farthest from
   the centroid first (SemDeDup's choice: prototypical examples are the
   redundant ones) or highest quality first;
3. a member is a duplicate when its cosine similarity to any member earlier
   in that order exceeds `1 - eps` (eps 0.01 by default, NeMo Curator's).

k-means is faiss's (spherical); the pairwise step is one NumPy matrix
product per cluster, so clusters must stay small (`docs_per_cluster`).
"""

from __future__ import annotations

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


@dataclass
class SemanticResult:
    keep: np.ndarray  # bool per row
    duplicate_of: np.ndarray  # int row of the kept document, -1 when kept
    cluster: np.ndarray  # k-means cluster per row
    max_similarity: np.ndarray  # to a preferred member of its cluster (NaN for the first)


def semantic_duplicates(
    vectors: np.ndarray, params: SemanticDedupParams, quality: np.ndarray | None = None
) -> SemanticResult:
    n = len(vectors)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    keep = np.ones(n, dtype=bool)
    duplicate_of = np.full(n, -1, dtype=np.int64)
    best = np.full(n, np.nan)
    if n == 0:
        return SemanticResult(keep, duplicate_of, np.zeros(0, dtype=np.int64), best)
    k = max(1, n // max(1, params.docs_per_cluster))
    labels, centroids = kmeans(x, k, iterations=params.kmeans_iterations, seed=params.seed)
    threshold = 1.0 - params.eps
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        if len(members) < 2:
            continue
        if params.keep == "quality" and quality is not None:
            q = np.nan_to_num(np.asarray(quality, dtype=np.float64)[members], nan=-np.inf)
            order = members[np.lexsort((members, -q))]
        else:  # farthest from the centroid first; ties by row for determinism
            similarity_to_centroid = x[members] @ centroids[c]
            order = members[np.lexsort((members, similarity_to_centroid))]
        sims = x[order] @ x[order].T
        earlier = np.triu(sims, k=1)  # [i, j]: similarity of j to an earlier i
        earlier[np.tril_indices(len(order))] = -np.inf
        top = earlier.argmax(axis=0)
        top_sim = earlier[top, np.arange(len(order))]
        best[order[1:]] = top_sim[1:]
        dropped = top_sim > threshold
        for j in np.flatnonzero(dropped):
            target = top[j]
            while dropped[target]:  # point at a kept document, not at another duplicate
                target = top[target]
            keep[order[j]] = False
            duplicate_of[order[j]] = order[target]
    return SemanticResult(keep, duplicate_of, labels, best)
