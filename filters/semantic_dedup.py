"""Semantic dedup in the manner of SemDeDup (Abbas et al., 2023), on stored embeddings.

1. k-means over the L2-normalised embeddings (k from the corpus size);
2. inside each cluster, members are ordered by preference: farthest from
   the centroid first (SemDeDup's choice: prototypical examples are the
   redundant ones) or highest quality first;
3. a member is a duplicate when its cosine similarity to any member earlier
   in that order exceeds `1 - eps` (eps 0.01 by default, NeMo Curator's).

Pure NumPy: the pairwise step is one matrix product per cluster, so clusters
must stay small (`docs_per_cluster`); k-means runs in float32 batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from assay.config import SemanticDedupParams

REASON = "semantic_dup"


def kmeans(x: np.ndarray, k: int, *, iterations: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (cosine) with k-means++ seeding: (labels, unit centroids)."""
    n = len(x)
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    centroids = np.empty((k, x.shape[1]), dtype=np.float32)
    centroids[0] = x[rng.integers(n)]
    closest = 1.0 - x @ centroids[0]
    for i in range(1, k):  # k-means++: far points are likelier seeds
        weights = np.clip(closest, 0, None) ** 2
        total = weights.sum()
        pick = rng.choice(n, p=weights / total) if total > 0 else rng.integers(n)
        centroids[i] = x[pick]
        closest = np.minimum(closest, 1.0 - x @ centroids[i])
    labels = np.zeros(n, dtype=np.int64)
    for _ in range(iterations):
        new = np.argmax(x @ centroids.T, axis=1)
        if _ and np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, x)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        empty = norms[:, 0] == 0
        centroids = np.where(empty[:, None], centroids, sums / np.where(norms == 0, 1, norms))
    return labels, centroids


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
