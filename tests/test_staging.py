"""A commit killed by SIGKILL at any point is finished by the rerun, and no reader ever sees half a dataset.

`assay.staging.commit` moves every staged file into the dataset it builds beside OUT
(`.OUT.staging/dataset/`) with one rename each, writes the manifest there, publishes that folder
at OUT in one step (`assay.shards.publish_directory`) and removes the staging folder.
tests/test_crash_resume.py kills whole stages by watching their folders, which cannot land inside
the commit (milliseconds long). Here a child process runs the commit with `os.replace`,
`os.rename`, the folder exchange or the staging removal wrapped to SIGKILL itself at a chosen
call, for every call in turn, and a rerun does what a stage's rerun does (`prepare`, then `commit`
unless the dataset is complete). Checked after each kill: OUT holds nothing (a first run) or the
previous dataset whole (an --overwrite run), never some parts of the new one; the readers' entry
points (`require_dataset`, `open_version`) refuse a first run's unpublished set in one line; after
the rerun, OUT equals an uninterrupted commit's, file by file and byte by byte, with no staging
folder left.
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
from assay.shards import MANIFEST, require_dataset, staging_dir
from assay.staging import UnitWriter, commit, prepare
from assay.versions import open_version

FINGERPRINT = "test-fingerprint"
UNITS = ["unit-a", "unit-b", "unit-c"]

# The child: commit with the n-th call of `what` killing the process right after it (os.replace,
# os.rename, the exchange) or instead of it (the staging folder's removal). With "no-exchange" the
# filesystem is taken to lack renameat2's exchange, so publishing takes its two-rename path.
CHILD = """
import os, shutil, signal, sys
import assay.shards as shards
import assay.staging as staging

what, n, overwrite = sys.argv[2], int(sys.argv[3]), sys.argv[6] == "1"
calls = 0
kind = what.removeprefix("no-exchange:")
if what.startswith("no-exchange:"):
    shards._exchange = lambda a, b: False
real = {"replace": os.replace, "rename": os.rename, "rmtree": shutil.rmtree, "exchange": shards._exchange}[kind]

def wrapped(*args, **kwargs):
    global calls
    calls += 1
    if kind == "rmtree" and calls == n:
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)  # a call that raises (the rename onto a previous dataset) is not killed after
    if kind != "rmtree" and calls == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return out

if kind == "exchange":
    shards._exchange = wrapped
elif kind == "rmtree":
    staging.shutil.rmtree = wrapped
else:
    setattr(os, kind, wrapped)
staging.prepare(sys.argv[1], sys.argv[5], overwrite=overwrite)
staging.commit(sys.argv[1], sys.argv[4].split(","), {"fingerprint": sys.argv[5], "stage": "test"})
print(calls)
"""


def _stage(out: Path, fingerprint: str = FINGERPRINT, *, overwrite: bool = False) -> None:
    """Three finished units, each with several document and decision shards (tiny target size)."""
    assert prepare(out, fingerprint, overwrite=overwrite) is False
    for u, unit in enumerate(UNITS):
        writer = UnitWriter(out, unit, DOCUMENT_SCHEMA, target_bytes=1)
        for i in range(2 + u):
            ident = f"{fingerprint}-{unit}-{i}"
            writer.docs.write(pa.table({"id": [ident], "text": [f"text of {ident} " * 20], "kind": ["text"],
                                        "lang": ["en"], "source": ["tests"], "path": [ident], "meta": ["{}"]}))
            writer.write_decisions(pa.RecordBatch.from_pylist(
                [{"id": ident, "stage": "test", "kept": True, "reason": None, "scores": None, "detail": None}],
                schema=writer.decisions.schema))
        writer.finish(bytes_in=0, seconds=0.0)


def _previous_dataset(out: Path) -> dict[str, str]:
    """A finished dataset of other inputs at `out`, which an --overwrite run replaces; its files."""
    _stage(out, "previous-fingerprint")
    commit(out, UNITS, {"fingerprint": "previous-fingerprint", "stage": "test"})
    return _contents(out)


def _commit_in_child(out: Path, what: str, n: int, overwrite: bool) -> tuple[int, str]:
    """The child's return code and, when it ran to the end, how many calls of `what` it made."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(out), what, str(n), ",".join(UNITS), FINGERPRINT,
                           "1" if overwrite else "0"], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.strip()


def _rerun(out: Path) -> None:
    """What a stage's rerun does (flows/static.py and the others): prepare, then commit unless complete."""
    if not prepare(out, FINGERPRINT, overwrite=True):
        commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})


def _contents(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _readers_refuse(out: Path) -> None:
    """Before a first run publishes, a stage's readers refuse the dataset, naming why."""
    for read in (require_dataset, open_version):
        with pytest.raises(AssayError, match="incomplete: a stage is still writing it"):
            read(out)


def _readers_read_every_part(out: Path, prefix: str) -> None:
    require_dataset(out)
    version = open_version(out)
    assert len(version.shards) == 2 + 3 + 4
    ids = [i for shard in sorted(out.glob("part-*.parquet")) for i in pq.read_table(shard).column("id").to_pylist()]
    assert len(ids) == 2 + 3 + 4 and all(i.startswith(prefix) for i in ids), ids


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """An uninterrupted commit's files."""
    out = tmp_path_factory.mktemp("staging") / "reference"
    _stage(out)
    manifest = commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})
    assert len(manifest["shards"]) == 2 + 3 + 4
    assert not staging_dir(out).exists()
    assert (out / "decisions").is_dir()
    return _contents(out)


# Every call the commit makes of each kind, in turn. "rename" is the publishing rename (over a
# previous dataset it fails, and the exchange follows); with no exchange, the previous dataset is
# first renamed aside.
KINDS = ["replace", "rename", "exchange", "rmtree", "no-exchange:rename"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["first-run", "overwrite"])
def test_a_commit_killed_anywhere_is_finished_by_the_rerun_and_never_half_published(reference, tmp_path, overwrite):
    want = reference
    kills: dict[str, int] = {}
    for kind in KINDS:
        out = tmp_path / f"{kind.replace(':', '-')}-whole"
        previous = _previous_dataset(out) if overwrite else None
        _stage(out, overwrite=overwrite)
        rc, calls = _commit_in_child(out, kind, 0, overwrite)  # n = 0: no kill, count the calls
        assert rc == 0 and _contents(out) == want, (kind, rc)
        kills[kind] = 0
        for n in range(1, int(calls) + 1):
            out = tmp_path / f"{kind.replace(':', '-')}-{n}"
            previous = _previous_dataset(out) if overwrite else None
            _stage(out, overwrite=overwrite)
            rc, _ = _commit_in_child(out, kind, n, overwrite)
            if rc == 0:  # the n-th call raised (and was handled) instead of returning
                assert _contents(out) == want, (kind, n)
                continue
            assert rc == -signal.SIGKILL, (kind, n, rc)
            kills[kind] += 1
            # OUT is the previous dataset, whole, or the new one, whole, or (a first run, or the
            # two-rename path's instant) absent: never some of each.
            if out.exists():
                assert _contents(out) in (want, previous), (kind, n)
                _readers_read_every_part(out, "previous" if _contents(out) == previous else FINGERPRINT)
            else:
                assert not overwrite or kind == "no-exchange:rename", (kind, n)
                _readers_refuse(out)
            _rerun(out)
            assert _contents(out) == want, (kind, n)
            assert not staging_dir(out).exists(), (kind, n)
            _readers_read_every_part(out, FINGERPRINT)
    # prepare's marker (written atomically: assay.installation's record), 18 part renames and the
    # manifest's; the publishing rename (over a previous dataset it fails,
    # and without the exchange two renames follow); the exchange, only over a previous dataset;
    # the removals (the staging folder's, and the previous dataset's).
    assert kills == {"replace": 20, "rename": 0 if overwrite else 1, "exchange": 1 if overwrite else 0,
                     "rmtree": 2 if overwrite else 1, "no-exchange:rename": 2 if overwrite else 1}, kills


def test_a_symlinked_output_is_replaced_where_it_points(reference, tmp_path):
    """OUT may be a symlink to a folder on another disk: the staging folder goes beside the folder
    it points to (the same filesystem, so the publishing rename is possible), the new version
    replaces that folder, and the symlink stays."""
    real = tmp_path / "disk" / "static"
    real.parent.mkdir()
    out = tmp_path / "static"
    _previous_dataset(real)
    out.symlink_to(real, target_is_directory=True)
    _stage(out, overwrite=True)
    assert staging_dir(out) == real.parent / ".static.staging"
    commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})
    assert out.is_symlink() and _contents(real) == reference
    assert not staging_dir(out).exists()
    _readers_read_every_part(out, FINGERPRINT)


def test_a_version_replaced_while_it_is_read_stops_the_reader(reference, tmp_path):
    """A run reading a dataset while a stage rerun publishes a new version over it (same part names)
    reads the part it has open to its end, then stops at the next part, naming it, rather than
    train on parts of two versions; opened again, the dataset reads as the new version."""
    out = tmp_path / "static"
    _previous_dataset(out)
    batches = open_version(out).iter_batches()
    first = next(batches)
    assert first.column("id")[0].as_py().startswith("previous")
    _stage(out, overwrite=True)
    commit(out, UNITS, {"fingerprint": FINGERPRINT, "stage": "test"})
    with pytest.raises(AssayError, match=r"part-00001.parquet: replaced since this run opened"):
        list(batches)
    _readers_read_every_part(out, FINGERPRINT)


def test_an_out_that_is_a_file_is_refused_in_one_wording_by_every_command_that_writes_a_folder(tmp_path):
    """Five places checked "OUT exists and is not a folder" each in its own words (the report's said
    only "exists and is not a directory"); one check now says it, and names the option to change."""
    import os

    from assay.config import TrainParams
    from assay.report_html import ReportInputs, require_report_out
    from assay.staging import DATASET_FORMAT, own_output, require_outside
    from corpus import write_documents
    from training.export import _check_out
    from training.trainer import train

    data = write_documents(tmp_path / "data", [("a.txt", "a document")])
    nothing = tmp_path / "nothing"
    afile = tmp_path / "afile"
    afile.write_text("the user's file\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    checks = {
        "dataset": lambda out: own_output(out, DATASET_FORMAT, "an Assay dataset"),
        "stage": lambda out: prepare(out, FINGERPRINT, overwrite=True, inputs=[data]),
        "model": lambda out: require_outside(out, [data]),
        "export": lambda out: _check_out(tmp_path / "run", out, True),
        "train": lambda out: train(open_version(data), out, TrainParams(device="cpu"), overwrite=True, progress=False),
        "report": lambda out: require_report_out(ReportInputs(*[nothing] * 9, repo=tmp_path), out),
    }
    for name, check in checks.items():
        for out in (afile, fifo):
            with pytest.raises(AssayError) as refused:
                check(out)
            assert str(refused.value) == f"{out}: is a file, not a directory; choose another --out", name
    assert afile.read_text() == "the user's file\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "afile", "data", "fifo"]
