"""The knowledge graph the dedup stage writes: documents, sources, duplicate clusters.

Every input document goes in, kept or dropped, with its status, so a user can
see what was removed and what it duplicated. Upserts are by deterministic
uuid5 ids, so a later run updates the graph in place.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from assay.config import Params
from assay.vectors import ClusterRecord, DocumentRecord, open_store

KEPT = "kept"


def cluster_groups(corpus, verdicts) -> dict[str, tuple[str, list[int]]]:
    """cluster id → (kind, member rows): one cluster per kept document that has duplicates."""
    groups: dict[str, tuple[str, list[int]]] = {}
    members: dict[tuple[str, int], list[int]] = defaultdict(list)
    for row, reason in enumerate(verdicts.reason):
        if verdicts.near_cluster[row] >= 0:
            members[("near", int(verdicts.near_cluster[row]))].append(row)
        if reason in ("exact_dup", "semantic_dup"):
            members[(reason.split("_")[0], int(verdicts.duplicate_of[row]))].append(row)
    for (kind, kept), rows in members.items():
        rows = sorted(set(rows) | {kept})
        if len(rows) > 1:
            groups[f"{kind}:{corpus.ids[kept]}"] = (kind, rows)
    return groups


def upsert_graph(out: str, corpus, verdicts, vectors: np.ndarray | None, params: Params) -> dict[str, Any]:
    groups = cluster_groups(corpus, verdicts)
    clusters_of_row: dict[int, list[str]] = defaultdict(list)
    for cluster_id, (_, rows) in groups.items():
        for row in rows:
            clusters_of_row[row].append(cluster_id)

    def records() -> Iterator[DocumentRecord]:
        # Made as the store consumes them (in chunks): a list of every record cost ~2.3 KB a
        # document at the stage's peak (bench/memory_bound.py dedup).
        for row, doc_id in enumerate(corpus.ids):
            quality = corpus.quality[row]
            yield DocumentRecord(
                doc_id=str(doc_id),
                vector=vectors[row] if vectors is not None and vectors.shape[1] else None,
                kind=corpus.kinds[row], lang=corpus.langs[row], source=corpus.sources[row], path=corpus.paths[row],
                quality=None if np.isnan(quality) else float(quality),
                status=verdicts.reason[row] or KEPT,
                clusters=sorted(clusters_of_row.get(row, [])),
                duplicate_of=str(corpus.ids[verdicts.duplicate_of[row]]) if verdicts.duplicate_of[row] >= 0 else None,
            )

    with open_store(params.vectors, Path(out)) as store:
        store.upsert_clusters(ClusterRecord(cluster_id, kind, [str(corpus.ids[r]) for r in rows])
                              for cluster_id, (kind, rows) in groups.items())
        store.upsert_documents(records())
        total = store.count()
        backend = type(store).__name__
    by_kind = Counter(kind for kind, _ in groups.values())
    return {"backend": backend, "documents": len(corpus.ids), "clusters": len(groups),
            "clusters_by_kind": dict(sorted(by_kind.items())), "store_count": total}
