"""Dedup end to end: exact, near, semantic, the graph and the queries, through the Prefect flow."""

import json
import shutil
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from assay.shards import iter_batches

pytestmark = pytest.mark.usefixtures("prefect_harness")

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ["textwrap.py", "colorsys.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py", "glob.py",
           "keyword.py", "getopt.py", "sched.py", "queue.py", "reprlib.py", "base64.py", "copy.py", "secrets.py"]


def _paraphrase(text: str) -> str:
    """Paraphrase-like: every 12th pair of words swapped. The meaning stays (cosine 0.98-0.99
    with all-MiniLM-L6-v2) while most word 5-grams change (MinHash Jaccard 0.2-0.4), so only
    the semantic step can find it."""
    lines = []
    for line in text.split("\n"):
        words = line.split(" ")
        for i in range(0, len(words) - 1, 12):
            words[i], words[i + 1] = words[i + 1], words[i]
        lines.append(" ".join(words))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def deduped(tmp_path_factory, prefect_harness):
    from pydoc_data.topics import topics

    from flows.dedup import dedup_flow
    from flows.ingest import ingest_flow

    root = tmp_path_factory.mktemp("dedup")
    a, b = root / "repo-a", root / "repo-b"
    a.mkdir()
    b.mkdir()
    for name in MODULES:
        shutil.copy(STDLIB / name, a / name)
    # repo-b vendors some of repo-a: one exact copy, one with trailing spaces, one lightly edited.
    (b / "textwrap.py").write_text((STDLIB / "textwrap.py").read_text())
    (b / "bisect.py").write_text("\n".join(l + "   " for l in (STDLIB / "bisect.py").read_text().splitlines()))
    heapq = (STDLIB / "heapq.py").read_text().splitlines()
    (b / "heapq.py").write_text("\n".join(heapq[:-20] + ["# vendored copy, trimmed"]))
    names = sorted(topics)[:12]
    for name in names:  # prose, and planted paraphrase-like duplicates of three of them
        (a / f"{name}.txt").write_text(topics[name])
    for name in names[3:6]:
        (b / f"{name}-copy.txt").write_text(_paraphrase(topics[name]))

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["dedup"]["semantic"]["docs_per_cluster"] = 10
    # NeMo's eps=0.01 targets near-verbatim copies; word-order paraphrases sit at 0.98-0.99.
    params["dedup"]["semantic"]["eps"] = 0.03
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    raw = root / "raw"
    ingest_flow([str(a), str(b)], str(raw), params_file=str(params_file))
    manifest = dedup_flow(str(raw), str(root / "dedup"), params_file=str(params_file))
    return {"root": root, "raw": raw, "out": root / "dedup", "params": params_file, "manifest": manifest}


def _decisions(out):
    return {d["id"]: d for d in pq.read_table(Path(out) / "decisions").to_pylist()}


def _raw(raw):
    return {(r["source"], r["path"]): r for b in iter_batches(raw) for r in b.to_pylist()}


def test_exact_near_and_semantic_duplicates_are_found(deduped):
    raw, decisions = _raw(deduped["raw"]), _decisions(deduped["out"])
    reason = lambda src, path: decisions[raw[(src, path)]["id"]]["reason"]  # noqa: E731
    # Of each pair, exactly one copy is dropped, and the other is kept.
    assert {reason("repo-a", "textwrap.py"), reason("repo-b", "textwrap.py")} == {None, "exact_dup"}
    assert {reason("repo-a", "bisect.py"), reason("repo-b", "bisect.py")} == {None, "exact_dup"}
    assert {reason("repo-a", "heapq.py"), reason("repo-b", "heapq.py")} == {None, "near_dup"}
    from pydoc_data.topics import topics

    for name in sorted(topics)[3:6]:
        pair = {reason("repo-a", f"{name}.txt"), reason("repo-b", f"{name}-copy.txt")}
        assert pair == {None, "semantic_dup"}, name
    counts = deduped["manifest"]["dedup"]
    assert counts["exact_dup"] == 2 and counts["near_dup"] == 1 and counts["semantic_dup"] == 3
    assert len(decisions) == len(raw)


def test_dropped_rows_name_the_kept_document(deduped):
    raw, decisions = _raw(deduped["raw"]), _decisions(deduped["out"])
    kept_ids = {i for b in iter_batches(deduped["out"], columns=["id"]) for i in b.column("id").to_pylist()}
    for d in decisions.values():
        if d["reason"]:
            target = d["detail"].removeprefix("duplicate of ")
            assert target in kept_ids
    docs = {r["id"]: r for b in iter_batches(deduped["out"]) for r in b.to_pylist()}
    heapq_a = raw[("repo-a", "heapq.py")]["id"]
    heapq_b = raw[("repo-b", "heapq.py")]["id"]
    kept = heapq_a if heapq_a in docs else heapq_b
    assert docs[kept]["cluster"] == kept  # the near cluster is named after its kept document


def test_small_batch_windows_give_the_same_output(deduped):
    """`io.batch_bytes` cuts dedup's scan and write batches into slices (bounded memory with huge
    documents); the verdicts and kept documents must not change with the window."""
    from flows.dedup import dedup_flow

    params = yaml.safe_load(deduped["params"].read_text())
    params["io"].update(batch_rows=7, batch_bytes=4096)  # most slices are a row or two
    small = deduped["root"] / "params-small-batches.yaml"
    small.write_text(yaml.safe_dump(params))
    out = deduped["root"] / "dedup-small-batches"
    dedup_flow(str(deduped["raw"]), str(out), params_file=str(small))
    assert _decisions(out) == _decisions(deduped["out"])
    docs = lambda folder: sorted((r["id"], r["text"], r["cluster"]) for b in iter_batches(folder)  # noqa: E731
                                 for r in b.to_pylist())
    assert docs(out) == docs(deduped["out"])


def test_the_graph_answers_queries(deduped):
    from assay.config import load_params
    from assay.vectors import open_store

    raw = _raw(deduped["raw"])
    params = load_params(deduped["params"])
    a_id, b_id = raw[("repo-a", "heapq.py")]["id"], raw[("repo-b", "heapq.py")]["id"]
    with open_store(params.vectors, deduped["out"]) as store:
        assert store.count() == len(raw)  # dropped documents stay, with their status
        dropped = store.get(b_id) if store.get(b_id).status != "kept" else store.get(a_id)
        assert dropped.status == "near_dup" and dropped.duplicate_of in (a_id, b_id)
        clusters = store.clusters_of(a_id)
        assert [c.kind for c in clusters] == ["near"]
        assert sorted(store.cluster_members(clusters[0].cluster_id)) == sorted([a_id, b_id])
        assert store.duplicates_of(dropped.duplicate_of) == [dropped.doc_id]
        assert ("repo-a", "repo-b") in {(x, y) for x, y, _ in store.source_overlap()}
        hits = store.near_id(a_id, 3)
        assert hits[0].doc_id == b_id and hits[0].score > 0.9
    # The report names the graph's cluster nodes by kind (it said "near-duplicate and semantic" of
    # a count that held exact ones too, found by a probe 2026-12-07).
    graph = deduped["manifest"]["graph"]
    assert sum(graph["clusters_by_kind"].values()) == graph["clusters"] and graph["clusters_by_kind"]["near"] >= 1
    assert set(graph["clusters_by_kind"]) <= {"exact", "near", "semantic"}


def test_rerun_updates_the_graph_in_place(deduped):
    from assay.config import load_params
    from assay.vectors import open_store
    from flows.dedup import dedup_flow

    again = dedup_flow(str(deduped["raw"]), str(deduped["root"] / "dedup"), overwrite=True,
                       params_file=str(deduped["params"]))
    assert again["created_at"] == deduped["manifest"]["created_at"]  # same inputs: nothing to do
    out2 = deduped["root"] / "dedup2"
    dedup_flow(str(deduped["raw"]), str(out2), params_file=str(deduped["params"]))
    dedup_flow(str(deduped["raw"]), str(out2), overwrite=True, params_file=str(deduped["root"] / "params.yaml"))
    with open_store(load_params(deduped["params"]).vectors, out2) as store:
        assert store.count() == len(_raw(deduped["raw"]))


def test_cli_queries_answer(deduped):
    import subprocess
    import sys

    assay = str(Path(sys.executable).parent / "assay")
    raw = _raw(deduped["raw"])
    doc = raw[("repo-a", "heapq.py")]["id"]
    run = lambda *args: json.loads(subprocess.run([assay, *args, "--data", str(deduped["out"]), "--json"],  # noqa: E731
                                                  capture_output=True, text=True, check=True).stdout)
    graph = run("graph", doc)
    assert graph["doc_id"] == doc and len(graph["clusters"]) == 1
    similar = run("similar", doc, "-k", "2")
    assert similar["exact"] is True and len(similar["hits"]) == 2
    cluster = run("cluster", doc)
    assert len(next(iter(cluster["clusters"].values()))) == 2
    overlap = run("sources", "--overlap")
    assert any({r["source_a"], r["source_b"]} == {"repo-a", "repo-b"} for r in overlap)
    found = run("query", "heap queue priority queue algorithm", "-k", "3")
    assert any(h["path"] == "heapq.py" for h in found["hits"])
    # A document its stage dropped: said so, with the command that explains it (it was "neither a
    # document nor quarantined" alone, found by a probe 2026-12-07).
    dropped = next(d for d in _decisions(deduped["out"]).values() if not d["kept"])
    proc = subprocess.run([assay, "show", dropped["id"], "--data", str(deduped["out"])], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"assay: error: {dropped['id']}: not in {deduped['out']}: its stage dropped it ({dropped['reason']}); "
        f"`assay why {dropped['id']} --data {deduped['out']}` shows the decision"), proc.stderr


def test_graph_queries_never_write_the_store_and_a_dataset_without_one_says_so(deduped, tmp_path):
    """Queries opened the store writable: with other params (`vectors.exact_max`) `assay graph` rebuilt
    and saved the DVC-tracked index (a new generation), and opening removed what looked like an
    unfinished save (a running dedup's). And a dataset with no store answered "0 nearest", rc 0."""
    import hashlib
    import subprocess
    import sys

    import yaml

    assay = str(Path(sys.executable).parent / "assay")
    data = shutil.copytree(deduped["out"], tmp_path / "dedup")
    unfinished = data / "vectors" / ".gen-000099.tmp-424242"
    unfinished.mkdir()
    params = yaml.safe_load(Path(deduped["params"]).read_text())
    params.setdefault("vectors", {})["exact_max"] = 1  # another index kind than the stored one
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))

    def snapshot() -> dict[str, str]:
        return {str(p.relative_to(data)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
                for p in sorted((data / "vectors").rglob("*"))}

    before = snapshot()
    doc = _raw(deduped["raw"])[("repo-a", "heapq.py")]["id"]
    for args in (["graph", doc], ["similar", doc, "-k", "2"], ["cluster", doc], ["sources", "--overlap"]):
        done = subprocess.run([assay, "--params", str(params_file), *args, "--data", str(data)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert snapshot() == before and unfinished.is_dir()
    bare = subprocess.run([assay, "sources", "--overlap", "--data", str(deduped["raw"])], capture_output=True,
                          text=True)
    assert bare.returncode == 1 and "holds no vector store" in bare.stderr
    # "--debug" after "--" is the text searched for, not the option: still a one-line error.
    words = subprocess.run([assay, "query", "-k", "1", "--data", str(tmp_path / "nosuch"), "--", "--debug"],
                           capture_output=True, text=True)
    assert words.returncode == 1 and "no such dataset" in words.stderr and "Traceback" not in words.stderr
    zero = subprocess.run([assay, "similar", doc, "-k", "0", "--data", str(data)], capture_output=True, text=True)
    assert zero.returncode == 2 and "'-k'" in zero.stderr


def test_a_write_whose_verdicts_do_not_match_its_shard_says_so(tmp_path):
    """A write task is sent its shard's verdicts row by row (`ShardVerdicts`); if the shard no longer has
    that many rows (changed during the run), it stops naming the shard, rather than write misaligned
    verdicts."""
    import numpy as np

    from assay.config import Params
    from assay.errors import AssayError
    from assay.stages.dedup import ShardVerdicts, write_shard
    from assay.stages.shard_stage import plan_shards
    from corpus import stdlib_documents, write_documents

    data = write_documents(tmp_path / "data", stdlib_documents(3), source="stdlib")
    unit = plan_shards(data)[0]
    short = ShardVerdicts([None, None], [None, None], [None, None], np.full(2, np.nan))
    with pytest.raises(AssayError, match=r"part-00000.parquet: 3 rows, but the reduce judged 2"):
        write_shard(0, unit.shard, str(tmp_path / "out"), Params(), unit.key, short)


def test_an_input_republished_during_the_run_reaches_neither_the_dataset_nor_the_graph(deduped, tmp_path, monkeypatch):
    """Every write task read the shard it planned on, then an upstream rerun published a new input
    version. The run stops before the graph upsert (which may go to a server), and the previous
    output, its graph included, stays as it was."""
    import flows.dedup
    from assay.errors import AssayError
    from assay.shards import MANIFEST
    from assay.stages.dedup import write_shard
    from republish import RepublishAfter

    source = shutil.copytree(deduped["raw"], tmp_path / "raw")
    out = shutil.copytree(deduped["out"], tmp_path / "dedup")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "of-other-inputs"}))
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    upstream = RepublishAfter(source, tmp_path, len(list(source.glob("part-*.parquet"))))

    monkeypatch.setattr(flows.dedup, "write_task", upstream.task_of(write_shard, "dedup-write"))
    with pytest.raises(AssayError, match=r"changed during this run \(part-00000.parquet"):
        flows.dedup.dedup_flow(str(source), str(out), overwrite=True, params_file=str(deduped["params"]))
    assert upstream.finished == upstream.n
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_signatures_staged_on_an_object_store_give_the_same_output_and_are_removed(deduped, monkeypatch):
    """`dedup.minhash.staging` puts the scans' signatures on an fsspec URL (an object store every
    worker reaches) instead of beside OUT. fsspec's `memory://` stands in for it here: a filesystem
    that is not the local disk, shared by the thread runner's tasks. The band tasks must read it as
    they read the local folder (same decisions, same documents), the run's folder must be its own,
    and nothing may be left on it after the commit."""
    import fsspec

    from assay.errors import AssayError
    from assay.stages.dedup import signatures_folder
    from flows.dedup import dedup_flow

    params = yaml.safe_load(deduped["params"].read_text())
    params["dedup"]["minhash"]["staging"] = "memory://assay-test/bucket"
    remote = deduped["root"] / "params-remote-signatures.yaml"
    remote.write_text(yaml.safe_dump(params))
    import assay.stages.dedup as stage

    seen, written = [], stage.write_signatures
    monkeypatch.setattr(stage, "write_signatures", lambda sigs, path, minhash: (seen.append(path),
                                                                               written(sigs, path, minhash))[1])
    out = deduped["root"] / "dedup-remote-signatures"
    dedup_flow(str(deduped["raw"]), str(out), params_file=str(remote))
    monkeypatch.undo()
    assert seen and all(p.startswith("memory://assay-test/bucket/dedup-signatures-") for p in seen)
    assert len({p.rsplit("/", 1)[0] for p in seen}) == 1  # one folder, the run's own
    memory = fsspec.filesystem("memory")
    assert not memory.exists("/assay-test/bucket") or memory.ls("/assay-test/bucket") == []
    assert _decisions(out) == _decisions(deduped["out"])
    docs = lambda folder: sorted((r["id"], r["text"], r["cluster"]) for b in iter_batches(folder)  # noqa: E731
                                 for r in b.to_pylist())
    assert docs(out) == docs(deduped["out"])
    # Two OUTs never share a folder; the same OUT and inputs find theirs again.
    assert signatures_folder("a", "s3://b/p", "f") != signatures_folder("b", "s3://b/p", "f")
    assert signatures_folder("a", "s3://b/p/", "f") == signatures_folder("a", "s3://b/p", "f")
    for bad, said in (("/local/path", "must be an fsspec URL"), ("nosuchproto://x", "nosuchproto"),
                      ("s3://key:secret@bucket/p", "password in the URL is refused")):
        params["dedup"]["minhash"]["staging"] = bad
        remote.write_text(yaml.safe_dump(params))
        with pytest.raises(AssayError, match=said):
            dedup_flow(str(deduped["raw"]), str(deduped["root"] / "never"), params_file=str(remote))
