"""The vector-store contract: every backend must pass every test here.

`backend` is "local" (always) or "weaviate" (only with WEAVIATE_URL; see
conftest.py). Tests that exist only for the local store are at the end.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from assay.config import VectorParams
from assay.errors import AssayError
from assay.vectors import ClusterRecord, DocumentRecord, open_store
from assay.vectors.local import LocalVectorStore

from contract_data import CLUSTERS, DIM, EXPECTED_OVERLAP, N_DOCS, doc_id, make_corpus, unit_vectors

ROOT = Path(__file__).resolve().parents[2]


def brute_force(vectors: np.ndarray, query: np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[int]:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = unit @ (query / np.linalg.norm(query))
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    order = np.argsort(-scores, kind="stable")
    return [int(i) for i in order[:k] if np.isfinite(scores[i])]


def ids(hits) -> list[str]:
    return [h.doc_id for h in hits]


def check_topk(store, hits, expected: list[int], k: int) -> None:
    """Exact stores: the brute-force top k. Approximate ones: recall@k ≥ 0.8."""
    want = [doc_id(i) for i in expected]
    if store.exact:
        assert ids(hits) == want
    else:
        assert len(set(ids(hits)) & set(want)) >= 0.8 * len(want)


# --- writes and reads ---------------------------------------------------------------


def test_upsert_then_get_round_trips(graph, corpus):
    assert graph.count() == N_DOCS
    for i in (0, 1, 2, 7, 10, 123):
        want = corpus.records[i]
        got = graph.get(want.doc_id)
        assert got is not None
        assert got.properties() == want.properties()
        assert got.clusters == sorted(want.clusters)
        assert got.duplicate_of == want.duplicate_of
        direction = np.asarray(want.vector) / np.linalg.norm(want.vector)
        assert np.allclose(got.vector / np.linalg.norm(got.vector), direction, atol=1e-5)
    assert graph.get("no-such-doc") is None
    nulls = graph.get(doc_id(0))  # i % 7 == 0 and i % 5 == 0: lang and quality are null
    assert nulls.lang is None and nulls.quality is None
    # Without its vector (what the graph commands ask): the same record, vector None.
    for i in (1, 123):
        bare = graph.get(corpus.records[i].doc_id, with_vector=False)
        assert bare.vector is None
        assert dataclasses.replace(graph.get(corpus.records[i].doc_id), vector=None) == bare
    assert graph.get("no-such-doc", with_vector=False) is None


def test_upsert_twice_updates_in_place(graph, corpus):
    record = dataclasses.replace(corpus.records[42], status="semantic_dup", quality=0.25, vector=-corpus.vectors[42],
                                 clusters=["near-1"], duplicate_of=doc_id(3))
    assert graph.upsert_documents([record]) == 1
    assert graph.count() == N_DOCS
    got = graph.get(record.doc_id)
    assert (got.status, got.quality, got.clusters, got.duplicate_of) == ("semantic_dup", 0.25, ["near-1"], doc_id(3))
    assert np.allclose(got.vector / np.linalg.norm(got.vector), -corpus.vectors[42], atol=1e-5)
    assert graph.near(-corpus.vectors[42], 1)[0].doc_id == record.doc_id
    assert doc_id(42) in graph.cluster_members("near-1")
    assert doc_id(42) in graph.duplicates_of(doc_id(3))
    # The same batch again changes nothing, and neither does re-importing everything.
    graph.upsert_documents([record])
    graph.upsert_documents(corpus.records)
    assert graph.count() == N_DOCS
    back = graph.get(record.doc_id)
    assert (back.status, back.clusters, back.duplicate_of) == ("kept", [], None)
    assert doc_id(42) not in graph.cluster_members("near-1")


def test_document_without_vector(store):
    store.upsert_documents([DocumentRecord("a", unit_vectors(1)[0], source="web", status="kept"),
                            DocumentRecord("b", None, source="web", status="kept")])
    assert store.count() == 2
    assert store.get("b").vector is None
    assert ids(store.near(unit_vectors(1)[0], 5)) == ["a"]
    with pytest.raises(AssayError, match="no vector"):
        store.near_id("b", 3)
    # A vector can be removed by upserting the document without one.
    store.upsert_documents([DocumentRecord("a", None, source="web", status="kept")])
    assert store.near(unit_vectors(1)[0], 5) == []


def test_bad_input_is_an_assay_error(store):
    with pytest.raises(AssayError):
        store.upsert_documents([DocumentRecord("", unit_vectors(1)[0])])
    with pytest.raises(AssayError):
        store.upsert_documents([DocumentRecord("z", np.zeros(DIM, np.float32))])
    with pytest.raises(AssayError):
        store.upsert_clusters([ClusterRecord("c", "fuzzy")])
    with pytest.raises(AssayError):
        store.near(unit_vectors(1)[0], 3, where={"colour": "red"})


# --- vector queries ---------------------------------------------------------------------


def test_near_returns_the_top_k(graph, corpus):
    queries = unit_vectors(20, seed=1)
    for query in queries:
        hits = graph.near(query, 10)
        assert len(hits) == 10
        check_topk(graph, hits, brute_force(corpus.vectors, query, 10), 10)
        # Scores are cosine similarities, best first.
        for hit in hits:
            assert hit.score == pytest.approx(float(corpus.vectors[int(hit.doc_id[1:])] @ query), abs=1e-4)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert hits[0].source == corpus.by_id(hits[0].doc_id).source
        assert hits[0].properties == corpus.by_id(hits[0].doc_id).properties()
    # A stored vector's own document comes first, at similarity 1.
    top = graph.near(corpus.records[17].vector, 1)[0]
    assert top.doc_id == doc_id(17) and top.score == pytest.approx(1.0, abs=1e-4)
    assert len(graph.near(queries[0], N_DOCS + 50)) == N_DOCS


def test_near_id_excludes_itself(graph, corpus):
    for i in (5, 77, 250):
        hits = graph.near_id(doc_id(i), 5)
        assert doc_id(i) not in ids(hits)
        expected = [j for j in brute_force(corpus.vectors, corpus.vectors[i], 6) if j != i][:5]
        check_topk(graph, hits, expected, 5)
    with pytest.raises(AssayError, match="no document"):
        graph.near_id("missing", 3)


def test_where_filters(graph, corpus):
    query = unit_vectors(1, seed=7)[0]
    cases = [
        {"status": "kept"},
        {"status": "kept", "kind": "code"},
        {"source": "books", "lang": "en"},
        {"quality": None},
        {"status": "near_dup"},  # FIELD tokenization: not "near"
        {"lang": None, "kind": "text"},
    ]
    for where in cases:
        allowed = np.array([all(getattr(r, key) == value for key, value in where.items()) for r in corpus.records])
        hits = graph.near(query, 10, where=where)
        expected = brute_force(corpus.vectors, query, 10, allowed)
        assert len(hits) == len(expected), where
        check_topk(graph, hits, expected, len(expected))
        for hit in hits:
            assert all(hit.properties[key] == value for key, value in where.items())
    assert graph.near(query, 10, where={"status": "no-such-status"}) == []
    # near_id with a filter.
    hits = graph.near_id(doc_id(1), 3, where={"source": "code"})
    assert doc_id(1) not in ids(hits) and {h.source for h in hits} == {"code"}


def test_graph_queries(graph):
    assert graph.cluster_members("near-0") == [doc_id(0), doc_id(1), doc_id(2)]
    assert graph.cluster_members("sem-0") == [doc_id(i) for i in (2, 4, 5, 8)]
    assert graph.cluster_members("no-such-cluster") == []
    of_2 = graph.clusters_of(doc_id(2))
    assert [(c.cluster_id, c.kind, c.size) for c in of_2] == [("near-0", "near", 3), ("sem-0", "semantic", 4)]
    assert graph.clusters_of(doc_id(200)) == []
    assert graph.duplicates_of(doc_id(0)) == [doc_id(1), doc_id(2)]
    assert graph.duplicates_of(doc_id(4)) == [doc_id(5), doc_id(8)]
    assert graph.duplicates_of(doc_id(1)) == []
    cluster = graph.get_cluster("exact-0")
    assert (cluster.kind, cluster.size, cluster.members) == ("exact", 2, [doc_id(9), doc_id(10)])
    assert graph.get_cluster("nope") is None
    for cluster_id, (kind, members, _kept, _drop) in CLUSTERS.items():
        assert graph.cluster_members(cluster_id) == sorted(doc_id(m) for m in members)


def test_a_cluster_larger_than_a_query_page_is_returned_whole(store):
    """Weaviate answers a filtered query a page at a time and stops paging by
    offset at QUERY_MAXIMUM_RESULTS; a big cluster must still come back whole."""
    from assay.vectors.weaviate_store import PAGE

    n = PAGE + 150
    vectors = unit_vectors(n, seed=5)
    members = [f"big-{i:05d}" for i in range(n)]
    store.upsert_documents([
        DocumentRecord(m, vectors[i], source="web", status="near_dup" if i else "kept", clusters=["big"],
                       duplicate_of=None if i == 0 else members[0])
        for i, m in enumerate(members)
    ])
    store.upsert_clusters([ClusterRecord("big", "near", members=members)])
    assert store.cluster_members("big") == members
    assert store.duplicates_of(members[0]) == members[1:]


def test_source_overlap(graph):
    assert graph.source_overlap() == EXPECTED_OVERLAP


def test_source_counts(graph, corpus):
    """`assay sources`: each source with its documents, most first, then by name (none: in no source)."""
    from collections import Counter

    counts = Counter(r.source for r in corpus.records if r.source is not None)
    assert graph.source_counts() == sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def test_clusters_written_before_or_after_documents(store):
    vectors = unit_vectors(3, seed=3)
    # A document naming a cluster that does not exist yet: a placeholder.
    store.upsert_documents([DocumentRecord("x", vectors[0], source="web", status="kept", clusters=["later"])])
    assert [(c.cluster_id, c.kind, c.size) for c in store.clusters_of("x")] == [("later", "unknown", 0)]
    # upsert_clusters fills it in and links stored members (once, however often it runs).
    store.upsert_documents([DocumentRecord("y", vectors[1], source="code", status="near_dup", duplicate_of="x")])
    for _ in range(2):
        store.upsert_clusters([ClusterRecord("later", "near", members=["x", "y", "not-stored"])])
    assert [(c.cluster_id, c.kind, c.size) for c in store.clusters_of("x")] == [("later", "near", 3)]
    assert store.cluster_members("later") == ["x", "y"]
    assert store.get("y").clusters == ["later"]
    assert store.source_overlap() == [("code", "web", 1)]
    # duplicate_of may name a document that arrives later.
    store.upsert_documents([DocumentRecord("w", vectors[2], source="web", status="exact_dup", duplicate_of="v"),
                            DocumentRecord("v", vectors[2], source="web", status="kept")])
    assert store.duplicates_of("v") == ["w"]
    assert store.get("w").duplicate_of == "v"


def test_persistence(opener, corpus):
    store = opener()
    store.upsert_clusters(corpus.clusters)
    store.upsert_documents(corpus.records)
    query = unit_vectors(1, seed=9)[0]
    before = (ids(store.near(query, 10)), ids(store.near(query, 5, where={"kind": "code"})),
              store.source_overlap(), store.duplicates_of(doc_id(0)), store.get(doc_id(5)))
    store.close()
    again = opener()
    after = (ids(again.near(query, 10)), ids(again.near(query, 5, where={"kind": "code"})),
             again.source_overlap(), again.duplicates_of(doc_id(0)), again.get(doc_id(5)))
    assert again.count() == N_DOCS
    assert after[:4] == before[:4]
    assert after[4].properties() == before[4].properties()
    assert np.allclose(after[4].vector, before[4].vector)


# --- local store only ------------------------------------------------------------------------


def test_local_flat_is_exact_and_hnsw_above_exact_max(tmp_path):
    corpus = make_corpus(n=600, dim=DIM, seed=4)
    flat = LocalVectorStore(tmp_path / "flat", exact_max=600)
    flat.upsert_documents(corpus.records)
    assert flat.exact and flat.index_kind == "flat"
    hnsw = LocalVectorStore(tmp_path / "hnsw", exact_max=200)
    hnsw.upsert_documents(corpus.records)
    assert not hnsw.exact and hnsw.index_kind == "hnsw"
    queries = unit_vectors(50, seed=5)
    found = 0
    for query in queries:
        expected = brute_force(corpus.vectors, query, 10)
        assert ids(flat.near(query, 10)) == [doc_id(i) for i in expected]
        found += len(set(ids(hnsw.near(query, 10))) & {doc_id(i) for i in expected})
    assert found / (10 * len(queries)) > 0.95
    # A filter matching at most exact_max documents is searched exactly, HNSW or not.
    allowed = np.array([r.source == "books" for r in corpus.records])  # 200 documents
    for query in queries[:10]:
        assert ids(hnsw.near(query, 10, where={"source": "books"})) == [doc_id(i) for i in brute_force(corpus.vectors, query, 10, allowed)]
    # Updating HNSW vectors: the old vectors are gone from the results.
    moved = [dataclasses.replace(r, vector=-r.vector) for r in corpus.records[:150]]
    hnsw.upsert_documents(moved)
    assert hnsw.count() == 600
    assert hnsw.near(-corpus.vectors[3], 1)[0].doc_id == doc_id(3)
    assert doc_id(3) not in ids(hnsw.near(corpus.vectors[3], 5))
    hnsw.close()
    reopened = LocalVectorStore(tmp_path / "hnsw", exact_max=200)
    assert reopened.index_kind == "hnsw" and reopened.near(-corpus.vectors[3], 1)[0].doc_id == doc_id(3)
    reopened.close()
    # Raising exact_max turns it back into an exact store.
    exact_again = LocalVectorStore(tmp_path / "hnsw", exact_max=10_000)
    assert exact_again.exact
    assert exact_again.near(-corpus.vectors[3], 1)[0].doc_id == doc_id(3)
    exact_again.close()
    flat.close()


def test_local_layout_and_failed_block_discards(tmp_path, corpus):
    with LocalVectorStore(tmp_path / "v") as store:
        store.upsert_documents(corpus.records[:10])
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["CURRENT", "gen-000001"]
    with pytest.raises(RuntimeError):
        with LocalVectorStore(tmp_path / "v") as store:
            store.upsert_documents(corpus.records[10:20])
            raise RuntimeError("the stage failed")
    with LocalVectorStore(tmp_path / "v", read_only=True) as store:
        assert store.count() == 10
        with pytest.raises(AssayError, match="read-only"):
            store.upsert_documents(corpus.records[10:20])
    with LocalVectorStore(tmp_path / "v") as store:
        store.upsert_documents(corpus.records[10:20])
    with LocalVectorStore(tmp_path / "v") as store:
        store.upsert_documents(corpus.records[20:30])
    # Two generations are kept: the current one and the one before it.
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["CURRENT", "gen-000002", "gen-000003"]
    store = LocalVectorStore(tmp_path / "v")
    assert store.count() == 30
    store.drop()
    assert not (tmp_path / "v").exists()


KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, {root!r})
    import assay.vectors.local as local
    from assay.vectors import DocumentRecord

    store = local.LocalVectorStore({path!r})
    rng = np.random.default_rng(1)
    store.upsert_documents([DocumentRecord(f"new{{i}}", rng.standard_normal(16), source="new", status="kept")
                            for i in range(50)])
    where = {where!r}
    if where == "index":      # the SQLite file of the new generation is written, the index half-written
        def write_index(index, path):
            with open(path, "wb") as handle:
                handle.write(b"partial")
            os._exit(9)
        local.faiss.write_index = write_index
    else:                     # the new generation is complete, CURRENT not yet switched
        local.atomic_write_json = lambda *a, **k: os._exit(9)
    store.save()
    os._exit(0)
""")


@pytest.mark.parametrize("where", ["index", "pointer"])
def test_local_save_killed_midway_keeps_the_previous_state(tmp_path, corpus, where):
    path = tmp_path / "v"
    with LocalVectorStore(path) as store:
        store.upsert_clusters(corpus.clusters)
        store.upsert_documents(corpus.records)
    query = unit_vectors(1, seed=11)[0]
    with LocalVectorStore(path, read_only=True) as store:
        before = (ids(store.near(query, 10)), store.source_overlap())
    script = KILL_SCRIPT.format(root=str(ROOT), path=str(path), where=where)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr
    leftovers = [p.name for p in path.iterdir() if p.name.startswith(".")]
    if where == "index":
        assert leftovers, "the killed save should have left its temporary generation"
    with LocalVectorStore(path, read_only=True) as store:
        assert store.count() == N_DOCS
        assert (ids(store.near(query, 10)), store.source_overlap()) == before
    # The next writer cleans up the leftovers and saves normally.
    with LocalVectorStore(path) as store:
        assert not [p for p in path.iterdir() if p.name.startswith(".")]
        store.upsert_documents([DocumentRecord("after", query, source="web", status="kept")])
    with LocalVectorStore(path, read_only=True) as store:
        assert store.count() == N_DOCS + 1


def test_local_dimension_mismatch(tmp_path):
    store = LocalVectorStore(tmp_path / "v")
    store.upsert_documents([DocumentRecord("a", unit_vectors(1)[0])])
    with pytest.raises(AssayError, match="dimension"):
        store.upsert_documents([DocumentRecord("b", np.ones(DIM + 1))])
    with pytest.raises(AssayError, match="dimension"):
        store.near(np.ones(DIM + 1), 3)
    store.close()


def test_open_store_chooses_the_backend(tmp_path, monkeypatch):
    monkeypatch.delenv("WEAVIATE_URL", raising=False)
    store = open_store(VectorParams(), tmp_path)
    assert isinstance(store, LocalVectorStore) and store.path == tmp_path / "vectors" and store.exact_max == 100_000
    store.close()
    with pytest.raises(AssayError, match="weaviate_url"):
        open_store(VectorParams(backend="weaviate"), tmp_path)
    with pytest.raises(AssayError, match="one of local, weaviate"):
        open_store(VectorParams(backend="milvus"), tmp_path)
    # WEAVIATE_URL wins over backend: local; with nothing listening, a one-line AssayError.
    monkeypatch.setenv("WEAVIATE_URL", "http://127.0.0.1:9")
    with pytest.raises(AssayError, match="cannot reach Weaviate at http://127.0.0.1:9") as info:
        open_store(VectorParams(backend="local"), tmp_path)
    assert "\n" not in str(info.value)
