"""Two runs at once (issue 13, section 5): they either work side by side or the second
one is refused at once with a clear message; nothing is corrupted either way."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from assay.shards import iter_batches
from dvc_repo import dvc_repo, git_env

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env(tmp_path: Path) -> dict:
    return git_env(PREFECT_HOME=str(tmp_path / "prefect"))


def _contents(dataset: Path) -> list[str]:
    """The dataset's documents by content hash, in order (ids and texts)."""
    return [hashlib.blake2b(f"{row['id']}\0{row['text']}".encode(), digest_size=12).hexdigest()
            for batch in iter_batches(dataset) for row in batch.to_pylist()]


def _tree(root: Path, name: str, n: int) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"{name}-{i:03d}.txt").write_text(f"Document {i} of {name}, with a few words of its own.\n" * 3)
    (folder / "bad.bin").write_bytes(bytes(range(256)) * 8)
    return folder


@pytest.mark.slow
def test_two_ingest_runs_into_different_outputs_do_not_interfere(tmp_path):
    """Each CLI run starts its own Prefect server and stages into its own output."""
    env = _env(tmp_path)
    a, b = _tree(tmp_path, "a", 120), _tree(tmp_path, "b", 80)
    assay = str(BIN / "assay")
    together = [subprocess.Popen([assay, "ingest", str(src), "--out", str(tmp_path / f"together-{src.name}")],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for src in (a, b)]
    for proc in together:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    for src in (a, b):
        alone = subprocess.run([assay, "ingest", str(src), "--out", str(tmp_path / f"alone-{src.name}")],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
        assert _contents(tmp_path / f"together-{src.name}") == _contents(tmp_path / f"alone-{src.name}")
    assert len(_contents(tmp_path / "together-a")) == 120 and len(_contents(tmp_path / "together-b")) == 80


@pytest.mark.slow
def test_a_second_dvc_repro_in_the_same_repo_is_refused_at_once(tmp_path):
    """DVC's repository lock: the second `dvc repro` fails fast and names the lock, and the
    first finishes with its outputs whole and recorded."""
    env = _env(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    # A real stage that takes a while and writes its output the way ours do (temp, then rename).
    (repo / "dvc.yaml").write_text(
        "stages:\n"
        "  slow:\n"
        "    cmd: python -c \"import os, time; time.sleep(12); open('out.tmp', 'w').write('done'); "
        "os.replace('out.tmp', 'out.txt')\"\n"
        "    outs:\n"
        "      - out.txt\n")
    dvc_repo(repo)
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "stage"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    first = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=repo, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lock = repo / ".dvc" / "tmp" / "lock"
    deadline = time.time() + 60
    while time.time() < deadline and first.poll() is None:  # wait until the first holds the lock
        if (repo / ".dvc" / "tmp" / "rwlock").exists() and lock.exists():
            break
        time.sleep(0.2)
    time.sleep(1.0)
    started = time.time()
    second = subprocess.run([str(BIN / "dvc"), "repro"], cwd=repo, env=env, capture_output=True, text=True,
                            timeout=120)
    waited = time.time() - started
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-2000:]
    assert second.returncode != 0
    assert "lock" in (second.stdout + second.stderr).lower(), second.stdout + second.stderr
    assert waited < 11, f"the second run waited {waited:.1f} s instead of failing fast"
    assert (repo / "out.txt").read_text() == "done"
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=repo, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout.lower(), status.stdout
