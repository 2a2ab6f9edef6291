"""Test data shared by the vector-store tests: a small corpus with a known graph."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from assay.vectors import ClusterRecord, DocumentRecord

WEAVIATE_SKIP = (
    "WEAVIATE_URL is not set: no Weaviate server to run the contract against "
    "(e.g. `docker run -p 8080:8080 -p 50051:50051 cr.weaviate.io/semitechnologies/weaviate:1.27.0` "
    "and WEAVIATE_URL=http://localhost:8080)"
)

DIM = 16
N_DOCS = 300
SOURCES = ("web", "code", "books")  # doc i comes from SOURCES[i % 3]

#: cluster_id → (kind, member indices, kept index, drop status). Doc 2 is in
#: near-0 and sem-0; near-0 (listed first) makes it a near_dup of doc 0.
CLUSTERS = {
    "near-0": ("near", [0, 1, 2], 0, "near_dup"),
    "near-1": ("near", [3, 6], 3, "near_dup"),
    "sem-0": ("semantic", [2, 4, 5, 8], 4, "semantic_dup"),
    "exact-0": ("exact", [9, 10], 9, "exact_dup"),
}
#: Sources sharing clusters: near-0 has web/code/books, sem-0 code/books
#: (doc 2 is books and in both), exact-0 web/code; near-1 is web only.
EXPECTED_OVERLAP = [("books", "code", 2), ("code", "web", 2), ("books", "web", 1)]


def doc_id(i: int) -> str:
    return f"d{i:03d}"


def unit_vectors(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass
class Corpus:
    vectors: np.ndarray
    records: list[DocumentRecord]
    clusters: list[ClusterRecord] = field(default_factory=list)

    def by_id(self, key: str) -> DocumentRecord:
        return self.records[int(key[1:])]


def make_corpus(n: int = N_DOCS, dim: int = DIM, seed: int = 0) -> Corpus:
    vectors = unit_vectors(n, dim, seed)
    records = []
    for i in range(n):
        source = SOURCES[i % 3]
        records.append(DocumentRecord(
            doc_id=doc_id(i),
            vector=vectors[i] * (1.0 + i % 4),  # not unit length: stores must normalise for cosine
            kind="code" if source == "code" else "text",
            lang=None if i % 7 == 0 else ("en" if i % 2 else "de"),
            source=source,
            path=f"{source}/{i}.txt",
            quality=None if i % 5 == 0 else round(i / n, 4),
            status="kept",
        ))
    clusters = []
    for cluster_id, (kind, members, kept, drop) in CLUSTERS.items():
        clusters.append(ClusterRecord(cluster_id, kind, members=[doc_id(m) for m in members]))
        for m in members:
            records[m].clusters.append(cluster_id)
            if m != kept and records[m].duplicate_of is None:  # the first cluster decides
                records[m].status = drop
                records[m].duplicate_of = doc_id(kept)
    return Corpus(vectors, records, clusters)
