"""One writer per output (assay.output_lock): a second run into the same OUT is refused at once,
naming the run that holds it; the kernel frees the lock of a run that dies."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from assay import output_lock
from assay.errors import AssayError
from assay.output_lock import exclusive_output, lock_path
from assay.shards import staging_dir

pytestmark = pytest.mark.usefixtures("prefect_harness")

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    out = tmp_path / "out"
    with exclusive_output(out) as path:
        assert path == tmp_path / ".out.lock" and path.is_file()
        # flock locks belong to an open file, so a second open in this process is a second run.
        with pytest.raises(AssayError, match=rf"{out}: another run is writing it \(pid {os.getpid()} on .*\); "
                                             "wait for it to finish, or choose another --out"):
            with exclusive_output(out):
                pass
        assert path.is_file()  # the refused run leaves the holder's lock alone
    assert not path.exists()  # released and removed
    with exclusive_output(out):  # and free again
        pass


def test_two_names_of_one_folder_share_its_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert lock_path(tmp_path / "link") == lock_path(tmp_path / "real") == tmp_path / ".real.lock"
    with exclusive_output(tmp_path / "real"):
        with pytest.raises(AssayError, match="another run is writing it"):
            with exclusive_output(tmp_path / "link"):
                pass


def test_a_killed_holder_frees_the_lock(tmp_path):
    """kill -9 runs no cleanup: the lock file stays, but the kernel has dropped the lock on it."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom assay.output_lock import exclusive_output\n"
         "with exclusive_output(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AssayError, match=rf"pid {holder.pid} on "):
            with exclusive_output(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert lock_path(out).exists()
    with exclusive_output(out):
        pass


def test_a_lock_file_replaced_between_open_and_lock_is_not_trusted(tmp_path, monkeypatch):
    """A holder removes its lock file as it lets go. A run that opened the old file just before
    would get a lock on a file no longer named: the next run creates a new one and locks that, and
    the two would write together. The run must see that its file is gone and lock the new one."""
    out = tmp_path / "out"
    path = lock_path(out)
    real_flock = fcntl.flock
    replaced = []

    def flock_after_the_holder_let_go(fd, operation):
        if not replaced:  # between our open and our lock: the holder removes it, a third run makes a new one
            path.unlink()
            path.write_text("")
            replaced.append(True)
        return real_flock(fd, operation)

    monkeypatch.setattr(output_lock.fcntl, "flock", flock_after_the_holder_let_go)
    with exclusive_output(out):
        monkeypatch.setattr(output_lock.fcntl, "flock", real_flock)
        assert replaced
        with pytest.raises(AssayError, match="another run is writing it"):  # the named file is the one held
            with exclusive_output(out):
                pass


def test_folders_made_for_the_lock_are_removed_when_nothing_was_written(tmp_path):
    """A run refused or failed before it writes must not leave the folders it made: OUT, or
    those its lock needed, least of all inside an input (an OUT refused for lying there)."""
    source = tmp_path / "input"
    source.mkdir()
    with pytest.raises(AssayError, match="refused"):
        with exclusive_output(source / "a" / "b" / "out"):
            assert (source / "a" / "b").is_dir()
            raise AssayError("refused")
    assert list(source.iterdir()) == []
    with pytest.raises(AssayError, match="failed"):
        with exclusive_output(tmp_path / "made" / "out"):  # a run that made OUT, then failed before writing
            (tmp_path / "made" / "out").mkdir()
            raise AssayError("failed")
    assert not (tmp_path / "made").exists()
    (tmp_path / "mine").mkdir()
    with exclusive_output(tmp_path / "mine"):  # a folder the user made stays, empty or not
        pass
    with exclusive_output(tmp_path / "new" / "out"):
        (tmp_path / "new" / "out").mkdir()
        (tmp_path / "new" / "out" / "manifest.json").write_text("{}")
    assert (tmp_path / "new" / "out" / "manifest.json").is_file()  # what the run wrote stays


def test_an_unwritable_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AssayError, match=rf"{tmp_path / 'file' / 'out'}: cannot create its lock file"):
        with exclusive_output(tmp_path / "file" / "out"):
            pass


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    from flows.ingest import ingest_flow

    folder = tmp_path_factory.mktemp("raw")
    (folder / "one.jsonl").write_text('{"text": "A sentence of plain prose for the test."}\n')
    ingest_flow([str(folder / "one.jsonl")], str(folder / "raw"))
    return folder / "raw"


def _flows(raw: Path, tmp_path: Path) -> dict:
    """Each flow that writes an OUT, called with that OUT (inputs that would fail later are fine:
    the lock is taken before they are read)."""
    import flows.dedup, flows.domain, flows.domain_model, flows.dynamic, flows.ingest  # noqa: E401
    import flows.quality, flows.report, flows.score, flows.static, flows.train  # noqa: E401
    from training.export import export_run
    from test_dynamic import write_stage_inputs

    return {
        "ingest": lambda out: flows.ingest.ingest_flow([str(raw.parent / "one.jsonl")], out),
        "static": lambda out: flows.static.static_flow(str(raw), out),
        "domain": lambda out: flows.domain.domain_flow(str(raw), out),
        "dedup": lambda out: flows.dedup.dedup_flow(str(raw), out),
        "dynamic": lambda out: flows.dynamic.dynamic_flow(
            *(str(p) for p in (write_stage_inputs(tmp_path)[0], tmp_path / "scores", tmp_path / "run")), out),
        "score": lambda out: flows.score.score_flow(str(tmp_path / "no-run"), str(raw), out),
        "report": lambda out: flows.report.report_flow(out, raw=str(raw)),
        "quality head": lambda out: flows.quality.quality_train_flow(str(raw), out),
        "domain model": lambda out: flows.domain_model.domain_model_flow(str(raw), out),
        "train": lambda out: flows.train.train_flow(str(raw), out),
        "export": lambda out: export_run(tmp_path / "no-run", out),
    }


@pytest.mark.parametrize("stage", ["ingest", "static", "domain", "dedup", "dynamic", "score", "report",
                                   "quality head", "domain model", "train", "export"])
def test_a_flow_into_an_output_another_run_writes_stops_before_writing(raw, tmp_path, stage):
    """The flows take the lock before they write: measured before, a second `assay ingest` into
    the same OUT deleted the unit the first was writing, and ended in an internal error."""
    out = tmp_path / "out"
    run = _flows(raw, tmp_path)[stage]
    with exclusive_output(out):
        with pytest.raises(AssayError, match=f"{out}: another run is writing it"):
            run(str(out))
        assert not out.exists() and not staging_dir(out).exists()


@pytest.mark.slow
def test_a_second_cli_run_into_the_same_output_is_refused_and_the_first_is_untouched(tmp_path):
    """Real processes: a holder, the CLI refused with its pid in one line, then the CLI once it is gone."""
    from dvc_repo import git_env

    env = git_env(PREFECT_HOME=str(tmp_path / "prefect"))
    (tmp_path / "one.jsonl").write_text('{"text": "A sentence of plain prose for the test."}\n')
    out = tmp_path / "raw"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom assay.output_lock import exclusive_output\n"
         "with exclusive_output(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assay = str(Path(sys.executable).parent / "assay")
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        refused = subprocess.run([assay, "ingest", str(tmp_path / "one.jsonl"), "--out", str(out)], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"assay: error: {out}: another run is writing it (pid {holder.pid} on " in refused.stderr
        assert not out.exists() and not staging_dir(out).exists()
        print(f"refused in {time.monotonic() - started:.1f} s")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    done = subprocess.run([assay, "ingest", str(tmp_path / "one.jsonl"), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "manifest.json").is_file() and not lock_path(out).exists()


def test_the_demo_keyword_is_not_a_folder_the_lock_made(tmp_path, monkeypatch):
    """`assay ingest demo --out demo/raw`: the lock makes demo/ for its file, and the overlap check
    then took the keyword `demo` for that folder ("lies inside the input demo"). Found by
    tests/test_memory_bound.py in the clean-clone run."""
    from flows.ingest import ingest_flow

    params = tmp_path / "params.yaml"
    params.write_text("demo:\n" + "".join(f"  {key}: 1\n" for key in (
        "stdlib_files", "package_files", "package_metadata", "package_records", "entry_points", "doc_readmes",
        "doc_news", "doc_changelogs", "debian_changelogs", "doc_copyright")))
    monkeypatch.chdir(tmp_path)
    manifest = ingest_flow(["demo"], "demo/raw", params_file=str(params))
    assert manifest["shards"] and (tmp_path / "demo" / "raw" / "manifest.json").is_file()
