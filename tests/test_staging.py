"""A commit killed by SIGKILL between its renames, or after its manifest, is finished by the rerun.

`assay.staging.commit` moves every staged file into the dataset with one rename each, then writes
the manifest, then removes the staging area. tests/test_crash_resume.py kills whole stages by
watching their folders, which cannot land inside the commit (milliseconds long). Here a child
process runs the commit with `os.replace` (or the staging removal) wrapped to SIGKILL itself at a
chosen call, for every call in turn, and a rerun does what a stage's rerun does (`prepare`, then
`commit` unless the dataset is complete). Checked after each kill: every part a reader can list is
a whole shard, the manifest is absent until every part is in place, and the readers' entry points
(`require_dataset`, `open_version`) refuse the incomplete set; after the rerun, the folder equals an
uninterrupted commit's, file by file and byte by byte, with no staging area left.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.errors import AssayError
from assay.schema import DOCUMENT_SCHEMA
from assay.shards import MANIFEST, require_dataset
from assay.staging import STAGING_DIR, UnitWriter, commit, prepare
from assay.versions import open_version

FINGERPRINT = "test-fingerprint"
UNITS = ["unit-a", "unit-b", "unit-c"]

# The child: commit with the n-th call of `what` (os.replace, or the staging area's removal)
# killing the process right after (os.replace) or instead of (rmtree) doing its work.
CHILD = """
import os, shutil, signal, sys
import assay.staging as staging

what, n = sys.argv[2], int(sys.argv[3])
calls = 0
real = {"replace": os.replace, "rmtree": shutil.rmtree}[what]

def wrapped(*args, **kwargs):
    global calls
    calls += 1
    if what == "rmtree" and calls == n:
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)
    if what == "replace" and calls == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return out

if what == "replace":
    staging.os.replace = wrapped
else:
    staging.shutil.rmtree = wrapped
staging.commit(sys.argv[1], sys.argv[4].split(","), {"fingerprint": sys.argv[5], "stage": "test"})
"""


def _stage(out: Path) -> None:
    """Three finished units, each with several document and decision shards (tiny target size)."""
    assert prepare(out, FINGERPRINT) is False
    for u, unit in enumerate(UNITS):
        writer = UnitWriter(out, unit, DOCUMENT_SCHEMA, target_bytes=1)
        for i in range(2 + u):
            ident = f"{unit}-{i}"
            writer.docs.write(pa.table({"id": [ident], "text": [f"text of {ident} " * 20], "kind": ["text"],
                                        "lang": ["en"], "source": ["tests"], "path": [ident], "meta": ["{}"]}))
            writer.write_decisions(pa.RecordBatch.from_pylist(
                [{"id": ident, "stage": "test", "kept": True, "reason": None, "scores": None, "detail": None}],
                schema=writer.decisions.schema))
        writer.finish(bytes_in=0, seconds=0.0)


def _commit_in_child(out: Path, what: str, n: int) -> int:
    return subprocess.run([sys.executable, "-c", CHILD, str(out), what, str(n), ",".join(UNITS), FINGERPRINT],
                          capture_output=True, text=True, timeout=120).returncode


def _rerun(out: Path) -> None:
    """What a stage's rerun does (flows/static.py and the others): prepare, then commit unless complete."""
    if not prepare(out, FINGERPRINT):
        commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})


def _contents(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _readers_view_is_whole(out: Path) -> None:
    """Every listed part reads whole; the manifest, when present, names only parts that exist."""
    for part in sorted(out.rglob("part-*.parquet")):
        pq.read_table(part)
    if (out / MANIFEST).is_file():
        shards = json.loads((out / MANIFEST).read_text())["shards"]
        assert all((out / s).is_file() for s in shards)


def _readers_refuse(out: Path) -> None:
    """Until the manifest, a stage's readers refuse the folder, naming why, rather than read some parts."""
    for read in (require_dataset, open_version):
        with pytest.raises(AssayError, match="incomplete: a stage is still writing it"):
            read(out)


def _readers_read_every_part(out: Path) -> None:
    require_dataset(out)
    assert len(open_version(out).shards) == 2 + 3 + 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[str, str], int]:
    """An uninterrupted commit's files, and how many renames it made."""
    out = tmp_path_factory.mktemp("staging") / "reference"
    _stage(out)
    renames = sum(1 for _ in (out / STAGING_DIR).rglob("*-*.parquet"))
    manifest = commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})
    assert len(manifest["shards"]) == 2 + 3 + 4
    assert not (out / STAGING_DIR).exists()
    return _contents(out), renames


def test_a_commit_killed_after_any_rename_is_finished_by_the_rerun(reference, tmp_path):
    want, renames = reference
    assert renames == 2 * (2 + 3 + 4)  # document and decision shards (empty quarantine streams write none)
    for n in range(1, renames + 1):
        out = tmp_path / f"killed-{n}"
        _stage(out)
        assert _commit_in_child(out, "replace", n) == -signal.SIGKILL, n
        assert not (out / MANIFEST).exists(), n  # the set is incomplete until the manifest appears
        _readers_view_is_whole(out)
        _readers_refuse(out)
        _rerun(out)
        assert _contents(out) == want, n
        _readers_read_every_part(out)


def test_a_commit_killed_after_its_manifest_leaves_no_staging_area_behind(reference, tmp_path):
    """Killed between the manifest and the staging area's removal: the dataset is complete (the
    rerun's `prepare` says so), and the rerun still removes the leftover staging area, which would
    otherwise sit inside the dataset folder that DVC hashes."""
    want, _ = reference
    out = tmp_path / "killed"
    _stage(out)
    assert _commit_in_child(out, "rmtree", 1) == -signal.SIGKILL
    assert (out / MANIFEST).is_file() and (out / STAGING_DIR).is_dir()
    _readers_view_is_whole(out)
    _readers_read_every_part(out)  # every part is in place once the manifest is
    _rerun(out)
    assert _contents(out) == want
