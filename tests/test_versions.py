"""Dataset versions in a real git + DVC repo: `assay versions`, `assay diff`, `assay release`.

The pipeline is two stages: the real `assay ingest` of a small tree, and a
length filter written as an ordinary user stage (a script that writes an Assay
dataset with decisions), so that a version's documents are dropped by two
stages for reasons that the diff must find in the right rev's decisions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from assay.errors import AssayError
from assay.history import NEW_INPUT, NOT_IN_INPUT, diff_versions, list_versions, release
from assay.schema import document_id
from dvc_repo import dvc_repo

BIN = Path(sys.executable).parent
DVC = str(BIN / "dvc")
ASSAY = str(BIN / "assay")

pytestmark = pytest.mark.slow

FILTER = '''
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import yaml

from assay.schema import DECISION_SCHEMA
from assay.shards import DECISIONS_DIR, ShardWriter, iter_batches, write_manifest

max_chars = yaml.safe_load(Path("filter.yaml").read_text())["max_chars"]
out = Path("data/short")
counts = {"input": 0, "kept": 0, "dropped": 0}
with ShardWriter(out, next(iter_batches("data/raw")).schema) as docs, \\
        ShardWriter(out / DECISIONS_DIR, DECISION_SCHEMA) as decisions:
    for batch in iter_batches("data/raw"):
        keep = pc.less_equal(pc.utf8_length(batch.column("text")), max_chars)
        docs.write(batch.filter(keep))
        n, kept = batch.num_rows, pc.sum(keep).as_py() or 0
        counts["input"] += n
        counts["kept"] += kept
        counts["dropped"] += n - kept
        decisions.write(pa.table({
            "id": batch.column("id"), "stage": ["short"] * n, "kept": keep,
            "reason": pc.if_else(keep, pa.scalar(None, pa.string()), "length:too_long"),
            "scores": [[("chars", float(len(t)))] for t in batch.column("text").to_pylist()],
            "detail": [None] * n}, schema=DECISION_SCHEMA))
write_manifest(out, {"stage": "short", "counts": counts})
'''

DVC_YAML = """stages:
  ingest:
    cmd: assay ingest corpus --out data/raw --overwrite
    deps: [corpus]
    outs:
      - data/raw
  short:
    cmd: python filter.py
    deps: [data/raw, filter.py]
    params:
      - filter.yaml:
          - max_chars
    outs:
      - data/short
"""


def _run(cmd, cwd, env, check=True):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _write_corpus(repo: Path, files: dict[str, str], max_chars: int) -> None:
    corpus = repo / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    corpus.mkdir()
    for name, text in files.items():
        (corpus / name).write_text(text)
    (repo / "filter.yaml").write_text(f"max_chars: {max_chars}\n")


WORDS = "the quick brown fox jumps over the lazy dog while the cat sleeps. "


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """A repo with two committed data versions (v1, v2) and a README-only commit after them."""
    tmp = tmp_path_factory.mktemp("versions")
    repo, env, _ = dvc_repo(tmp / "repo", remote=tmp / "remote")
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "filter.py").write_text(FILTER)
    _write_corpus(repo, {"a.txt": "alpha " + WORDS, "b.txt": "beta " + WORDS, "c.txt": "gamma " + WORDS * 5,
                         "e.txt": "   \n"}, max_chars=1000)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "pipeline"], repo, env)
    _run([DVC, "repro", "-q"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "data v1"], repo, env)
    _run(["git", "tag", "v1"], repo, env)
    # v2: b is gone from the input, a became empty (quarantined), d is new, e got text, c is now too long.
    _write_corpus(repo, {"a.txt": "", "c.txt": "gamma " + WORDS * 5, "d.txt": "delta " + WORDS,
                         "e.txt": "epsilon " + WORDS}, max_chars=200)
    _run([DVC, "repro", "-q"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "data v2"], repo, env)
    (repo / "README.md").write_text("notes\n")
    _run(["git", "add", "README.md"], repo, env)
    _run(["git", "commit", "-qm", "docs only"], repo, env)
    return repo, env


def test_versions_lists_each_data_commit_with_counts(two_versions):
    repo, env = two_versions
    versions = list_versions(repo)
    assert [v.subject for v in versions] == ["data v2", "data v1"]  # newest first; no README-only commit
    v2, v1 = versions
    assert v1.tags == ["v1"] and v2.tags == []
    assert {o["path"]: o["documents"] for o in v1.outputs} == {"data/raw": 3, "data/short": 3}
    assert {o["path"]: o["documents"] for o in v2.outputs} == {"data/raw": 3, "data/short": 2}
    assert v2.changed == ["data/raw", "data/short"]
    assert [o["stage"] for o in v2.outputs] == ["ingest", "short"]  # pipeline order

    cli = _run([ASSAY, "versions", "--repo", str(repo), "--json"], repo, env)
    assert [v["commit"] for v in json.loads(cli.stdout)] == [v2.commit, v1.commit]
    table = _run([ASSAY, "versions", "--repo", str(repo)], repo, env).stdout
    assert "data v1" in table and v1.commit[:8] in table and "v1" in table


def test_diff_names_added_and_removed_documents_with_their_reasons(two_versions):
    repo, env = two_versions
    a, b, c, d, e = (f"corpus/{x}.txt" for x in "abcde")
    result = diff_versions(repo, "v1", "HEAD")  # default: the last stage, data/short
    assert result["path"] == "data/short" and result["stage"] == "short"
    assert (result["documents_a"], result["documents_b"]) == (3, 2)
    rows = {r["id"]: r for r in result["rows"]}
    ids = {f"corpus/{x}.txt": document_id("corpus", f"{x}.txt") for x in "abcde"}
    assert {ids[a], ids[b], ids[c]} == {i for i, r in rows.items() if r["change"] == "removed"}
    assert {ids[d], ids[e]} == {i for i, r in rows.items() if r["change"] == "added"}
    assert rows[ids[a]]["reason"] == "invalid:empty" and rows[ids[a]]["dropped_by"] == "ingest"
    assert rows[ids[b]]["reason"] == NOT_IN_INPUT and rows[ids[b]]["dropped_by"] is None
    assert rows[ids[c]]["reason"] == "length:too_long" and rows[ids[c]]["dropped_by"] == "short"
    assert rows[ids[d]]["reason"] == NEW_INPUT
    assert rows[ids[e]]["reason"] == "invalid:empty"  # why v1 did not have it
    assert result["removed_by_reason"] == {"invalid:empty": 1, "length:too_long": 1, NOT_IN_INPUT: 1}
    assert result["added_by_reason"] == {"invalid:empty": 1, NEW_INPUT: 1}

    raw = diff_versions(repo, "v1", "HEAD", stage="ingest")
    assert (raw["path"], raw["removed"], raw["added"]) == ("data/raw", 2, 2)  # c stays in data/raw

    limited = diff_versions(repo, "v1", "HEAD", limit=2)
    assert len(limited["rows"]) == 2 and limited["rows_left_out"] == 3 and limited["removed"] == 3

    cli = json.loads(_run([ASSAY, "diff", "v1", "HEAD", "--repo", str(repo), "--json", "--limit", "0"],
                          repo, env).stdout)
    assert cli["removed_by_reason"] == result["removed_by_reason"] and len(cli["rows"]) == 5
    text = _run([ASSAY, "diff", "v1", "HEAD", "--repo", str(repo), "--limit", "1"], repo, env).stdout
    assert "length:too_long" in text and "4 more" in text
    assert "an added document's reason is why v1 did not have it" in " ".join(text.split())  # a wrapped caption
    # The note on added documents only where some are (a probe, 2026-12-07: it stood under "0 added").
    same = _run([ASSAY, "diff", "v1", "v1", "--repo", str(repo)], repo, env).stdout
    assert "0 removed, 0 added" in same and "an added document's reason" not in same

    # The workspace was not touched: data/ still holds v2, and git sees no change.
    assert _run(["git", "status", "--porcelain"], repo, env).stdout == ""


def test_diff_refuses_unknown_revs_and_stages(two_versions):
    repo, env = two_versions
    with pytest.raises(AssayError, match="no such git revision"):
        diff_versions(repo, "v1", "nope")
    with pytest.raises(AssayError, match="known: ingest"):
        diff_versions(repo, "v1", "HEAD", stage="dedup")
    with pytest.raises(AssayError, match="no data/ output is committed at both"):
        diff_versions(repo, "HEAD~3", "HEAD")  # the pipeline commit has no data yet
    proc = _run([ASSAY, "diff", "v1", "nope", "--repo", str(repo)], repo, env, check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("assay: error: nope: no such git revision")


def test_release_checks_then_pushes_and_tags(two_versions, tmp_path):
    repo, env = two_versions
    remote = repo.parent / "remote"
    (repo / "filter.yaml").write_text("max_chars: 5\n")
    with pytest.raises(AssayError, match="uncommitted changes .*filter.yaml"):
        release(repo, "r1")
    _run(["git", "checkout", "filter.yaml"], repo, env)
    shard = repo / "data/short/part-00000.parquet"
    shard.unlink()  # data/ is ignored by git, so only DVC can see this
    with pytest.raises(AssayError, match="dvc status. is not clean .*short"):
        release(repo, "r1")
    _run([DVC, "checkout", "-q"], repo, env)
    assert not remote.exists()

    out = json.loads(_run([ASSAY, "release", "r1", "-m", "first release", "--repo", str(repo), "--json"],
                          repo, env).stdout)
    head = _run(["git", "rev-parse", "HEAD"], repo, env).stdout.strip()
    assert out["commit"] == head and out["remote"] == "local" and out["pushed"] > 0
    assert _run(["git", "cat-file", "-t", "r1"], repo, env).stdout.strip() == "tag"  # annotated
    assert _run(["git", "rev-parse", "r1^{commit}"], repo, env).stdout.strip() == head
    body = _run(["git", "tag", "-l", "--format=%(contents)", "r1"], repo, env).stdout
    assert "first release" in body and "data/short" in body
    assert any(remote.rglob("*"))
    with pytest.raises(AssayError, match="already exists"):
        release(repo, "r1")
    assert list_versions(repo)[0].tags == ["r1"]

    # A fresh clone has no cache: the released version reads from the remote, v1 (never pushed) says so.
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    newest, oldest = list_versions(clone)
    assert {o["path"]: o["documents"] for o in newest.outputs} == {"data/raw": 3, "data/short": 2}
    assert all(o["documents"] is None and "dvc pull" in o["error"] for o in oldest.outputs)


def test_release_without_a_remote_says_how_to_add_one(tmp_path):
    repo, env, _ = dvc_repo(tmp_path / "bare")
    _run(["git", "commit", "-qm", "init"], repo, env)
    proc = _run([ASSAY, "release", "r1", "--repo", str(repo)], repo, env, check=False)
    assert proc.returncode == 1
    assert "no DVC remote is configured" in proc.stderr and "dvc remote add -d" in proc.stderr
    assert _run(["git", "tag"], repo, env).stdout == ""
    with pytest.raises(AssayError, match="not a valid git tag name"):
        release(repo, "bad name")


def test_versions_follow_dvc_add_files_too(tmp_path):
    """A directory tracked with `dvc add` (a .dvc file, no pipeline) is versioned the same way;
    without a manifest its documents are counted from the shards' Parquet footers."""
    from corpus import write_documents

    repo, env, _ = dvc_repo(tmp_path / "added")
    docs = [(f"doc{i}.txt", f"document number {i}") for i in range(5)]
    write_documents(repo / "data/hand", docs[:3])
    _run([DVC, "add", "-q", "data/hand"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "three"], repo, env)
    shutil.rmtree(repo / "data/hand")
    write_documents(repo / "data/hand", docs[1:])
    _run([DVC, "add", "-q", "data/hand"], repo, env)
    _run(["git", "commit", "-qam", "four"], repo, env)
    newest, oldest = list_versions(repo)
    assert (newest.subject, oldest.subject) == ("four", "three")
    assert newest.outputs == [{"stage": "data/hand.dvc", "path": "data/hand", "md5": newest.outputs[0]["md5"],
                               "documents": 4}]
    assert oldest.outputs[0]["documents"] == 3
    result = diff_versions(repo, "HEAD~1", "HEAD")
    assert (result["removed"], result["added"]) == (1, 2)
    assert result["removed_by_reason"] == {NOT_IN_INPUT: 1} and result["added_by_reason"] == {NEW_INPUT: 2}


def test_a_repo_that_is_a_file_or_missing_is_a_one_line_error(tmp_path):
    """`--repo README.md` was an internal NotADirectoryError (and took the whole report down)."""
    (tmp_path / "README.md").write_text("x\n")
    with pytest.raises(AssayError, match="README.md: is a file"):
        list_versions(repo=tmp_path / "README.md")
    with pytest.raises(AssayError, match="no such directory"):
        list_versions(repo=tmp_path / "nope")


@pytest.mark.parametrize("text", ["[]", '{"counts": ["lots"]}', '{"counts": {"documents": "many"}}'])
def test_a_hand_edited_manifest_counts_the_shards_rows(tmp_path, text):
    """`assay versions` counts a version's documents from its manifest; one of another shape was an
    internal AttributeError (a probe, 2026-12-07). The shards' footers answer instead."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.history import document_count

    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"]}), folder / "part-00000.parquet")
    (folder / "manifest.json").write_text(text)
    assert document_count(fsspec.filesystem("file"), str(folder), "HEAD") == 3
