"""A dedup output's vector store with a damaged file, and the graph commands that read it.

A truncated `graph.sqlite` or `vectors.faiss` ended `assay graph` and `assay similar` in rc 2 with
SQLite's "database disk image is malformed" or faiss's C++ "read error"; an empty `graph.sqlite`
read as an empty graph ("<id>: not in the graph"). Each is now one line, rc 1, naming the file
and what to do. Also here: `assay query --status` with a status no document can have, and the
plain `assay sources` listing (with `LocalVectorStore.source_counts` and its Weaviate twin).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from test_cli import _column, run  # the CLI through its entry point, and a rich table's column read back

from assay.vectors import ClusterRecord, DocumentRecord

VALID_STATUSES = "kept, exact_dup, near_dup, semantic_dup"


@pytest.fixture
def dedup_out(tmp_path) -> Path:
    """A dedup output as the CLI tests build one: shards, and a local store holding a small graph
    (two sources, a near-duplicate cluster, a document without a source)."""
    from assay.config import load_params
    from assay.vectors import open_store
    from corpus import write_documents

    data = write_documents(tmp_path / "dedup", [("a", "alpha text"), ("b", "beta text"), ("c", "gamma text")])
    with open_store(load_params(None).vectors, data) as store:
        store.upsert_documents([
            DocumentRecord("A", np.array([1, 0, 0, 0.1], np.float32), source="repo-a", status="kept", path="a",
                           clusters=["c1"]),
            DocumentRecord("B", np.array([1, 0, 0.1, 0], np.float32), source="repo-b", status="near_dup", path="b",
                           clusters=["c1"], duplicate_of="A"),
            DocumentRecord("C", np.array([0, 1, 0, 0], np.float32), source="repo-a", status="kept", path="c"),
            DocumentRecord("D", np.array([0, 0, 1, 0], np.float32), status="kept", path="d"),
        ])
        store.upsert_clusters([ClusterRecord("c1", "near", ["A", "B"])])
    return data


def _generation(data: Path) -> Path:
    current = json.loads((data / "vectors" / "CURRENT").read_text())
    return data / "vectors" / current["generation"]


def _assert_one_line_error(args: list[str], *, names: Path, says: str) -> None:
    proc = run(*args, check=False)
    assert proc.returncode == 1, (args, proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("assay: error: "), proc.stderr
    assert str(names) in lines[0], lines[0]
    told = lines[0].split(str(names), 1)[1]  # after the path, which holds the test's name
    assert says in told and "rerun the stage that wrote it" in told and "not in the graph" not in told, lines[0]


@pytest.mark.parametrize("command, name, part, says", [
    ("graph", "graph.sqlite", 3, "damaged"), ("similar", "graph.sqlite", 3, "damaged"),
    ("similar", "vectors.faiss", 2, "damaged (cut short)")])
def test_a_truncated_store_file_is_a_one_line_error_naming_it(dedup_out, command, name, part, says):
    """Each was an internal error: SQLite's DatabaseError, faiss's C++ RuntimeError."""
    damaged = _generation(dedup_out) / name
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size // part)
    _assert_one_line_error([command, "A", "--data", dedup_out], names=damaged, says=says)


def test_graph_questions_read_no_vector_index(dedup_out):
    """`graph`, `cluster` and `sources` ask the graph only; they read the faiss index all the same (1.5 GB
    for a million vectors) and stopped on a damaged one. The index is now read at its first use."""
    index = _generation(dedup_out) / "vectors.faiss"
    with open(index, "r+b") as f:
        f.truncate(index.stat().st_size // 2)
    graph = json.loads(run("graph", "A", "--data", dedup_out, "--json").stdout)
    assert graph["doc_id"] == "A" and graph["duplicated_by"] == ["B"] and "vector" not in graph
    clusters = json.loads(run("cluster", "B", "--data", dedup_out, "--json").stdout)
    assert [m["doc_id"] for m in clusters["clusters"]["c1"]] == ["A", "B"]
    assert "repo-a" in run("sources", "--data", dedup_out).stdout
    _assert_one_line_error(["similar", "A", "--data", dedup_out], names=index, says="damaged (cut short)")


def test_damage_inside_the_graph_file_is_found_when_it_opens(dedup_out):
    """A page overwritten in place copies into memory without complaint, and the store opened; the
    first query to read that table (here `clusters_of`, from memberships) met SQLite's "malformed"."""
    graph = _generation(dedup_out) / "graph.sqlite"
    db = sqlite3.connect(f"{graph.as_uri()}?mode=ro", uri=True)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'memberships'").fetchone()[0]
    db.close()
    with open(graph, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"X" * page_size)
    _assert_one_line_error(["graph", "A", "--data", dedup_out], names=graph, says="damaged")


def test_an_empty_graph_file_is_an_error_not_an_empty_graph(dedup_out):
    graph = _generation(dedup_out) / "graph.sqlite"
    graph.write_bytes(b"")
    for command in ("graph", "similar"):
        _assert_one_line_error([command, "A", "--data", dedup_out], names=graph, says="empty")


def test_a_sqlite_database_that_is_not_a_graph_is_an_error(dedup_out):
    """Well-formed, but no store wrote it (no format recorded): read on, it was an empty graph too."""
    graph = _generation(dedup_out) / "graph.sqlite"
    graph.unlink()
    db = sqlite3.connect(graph)
    db.execute("CREATE TABLE notes (text TEXT)")
    db.commit()
    db.close()
    _assert_one_line_error(["graph", "A", "--data", dedup_out], names=graph, says="not a vector store graph")


def test_an_index_of_another_generation_is_an_error(dedup_out):
    """A well-formed index that does not match the graph (fewer rows than it names)."""
    import faiss

    index = _generation(dedup_out) / "vectors.faiss"
    smaller = faiss.IndexFlatIP(4)
    smaller.add(np.eye(4, dtype=np.float32)[:1])
    faiss.write_index(smaller, str(index))
    _assert_one_line_error(["similar", "A", "--data", dedup_out], names=index, says="holds 1 vectors")


@pytest.mark.parametrize("status", ["bogus", ""])
def test_query_rejects_a_status_no_document_can_have(dedup_out, status):
    """`--status bogus` printed an empty table with rc 0, and `--status ""` searched unfiltered.
    Checked before the encoder loads: no model is needed to be told."""
    proc = run("query", "some text", "--data", dedup_out, "--status", status, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"assay: error: --status {status!r}: not a document status; "
                                        f"use one of {VALID_STATUSES}"], proc.stderr


@pytest.mark.parametrize("text", ["", "  \n\t"])
def test_query_refuses_an_empty_text(dedup_out, text):
    """An empty text was embedded all the same, and its "nearest documents" printed (a probe, 2026-12-07)."""
    proc = run("query", text, "--data", dedup_out, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "assay: error: query: TEXT is empty; give the words to search for"], proc.stderr


def test_sources_lists_each_source_with_its_document_count(dedup_out):
    """`assay sources` said "only `assay sources --overlap` is available", though its help lists sources."""
    listed = json.loads(run("sources", "--data", dedup_out, "--json").stdout)
    assert listed == [{"source": "repo-a", "documents": 2}, {"source": "repo-b", "documents": 1}]
    table = run("sources", "--data", dedup_out).stdout
    assert _column(table, "source") == "repo-arepo-b" and _column(table, "documents") == "21", table
    overlap = json.loads(run("sources", "--overlap", "--data", dedup_out, "--json").stdout)
    assert overlap == [{"source_a": "repo-a", "source_b": "repo-b", "shared_clusters": 1}]


def test_local_source_counts_follow_the_documents(tmp_path):
    """Counted from the documents: a source whose documents moved away is not listed with 0,
    and a document without a source is in none."""
    from assay.vectors.local import LocalVectorStore

    with LocalVectorStore(tmp_path / "vectors") as store:
        store.upsert_documents([DocumentRecord("x", source="old"), DocumentRecord("y", source="b"),
                                DocumentRecord("z", source="a"), DocumentRecord("w")])
        store.upsert_documents([DocumentRecord("x", source="a")])
        assert store.sources() == ["a", "b", "old"]  # the Source nodes stay
        assert store.source_counts() == [("a", 2), ("b", 1)]
