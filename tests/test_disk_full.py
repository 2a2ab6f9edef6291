"""A full disk mid-run (a stage, training): one clear line, nothing half-written published, and the rerun resumes.

The output lies on a 1 MiB tmpfs, mounted in a private mount namespace (`unshare`), so the test needs no
root and leaves nothing mounted; where unprivileged namespaces are off it skips. The disk then grows
(a remount, as a user frees space) and the same command runs again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from assay.shards import iter_batches

ASSAY = str(Path(sys.executable).parent / "assay")

# Runs in the namespace: the disk fills during the first run, has room for the second.
_SCRIPT = """
set -u
mount -t tmpfs -o size=1m tmpfs "$DISK"
"$ASSAY" "$@" --out "$DISK/$NAME" 2>"$LOGS/full.err" >"$LOGS/full.out"; echo $? >"$LOGS/full.rc"
ls -A "$DISK" >"$LOGS/full.ls"
mount -o remount,size=32m "$DISK"
"$ASSAY" "$@" --out "$DISK/$NAME" 2>"$LOGS/rerun.err" >"$LOGS/rerun.out"; echo $? >"$LOGS/rerun.rc"
cp -a "$DISK/$NAME" "$LOGS/resumed"
"""

FULL = ("free space and rerun the same command; nothing half-written was published, and a stage resumes the units it "
        "finished (a training run, its last checkpoint)")


def _fill_then_grow(tmp_path: Path, name: str, args: list[str]) -> None:
    """`assay ARGS --out DISK/NAME` on a 1 MiB disk, then again once it has 32 MiB; logs and the output in tmp_path."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "ASSAY": ASSAY, "NAME": name,
           "DISK": str(tmp_path / "disk"), "LOGS": str(tmp_path)}
    (tmp_path / "disk").mkdir()
    subprocess.run(["unshare", "--mount", "--map-root-user", "bash", "-c", _SCRIPT, "disk-full", *args],
                   env=env, check=True, timeout=1200)
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("assay: error: the disk is full (No space left on device") and last.endswith(FULL), last
    assert "internal error" not in err and "Traceback" not in err and "ERROR" not in err, err[-3000:]
    assert (tmp_path / "rerun.rc").read_text().strip() == "0", (tmp_path / "rerun.err").read_text()[-3000:]


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def _texts(out: Path) -> dict[str, str]:
    return {row["id"]: row["text"] for batch in iter_batches(out, columns=["id", "text"]) for row in batch.to_pylist()}


@pytest.mark.slow  # three CLI runs, 20 s
@pytest.mark.skipif(not _namespaces_work(), reason="no private mount namespace here (unshare --mount --map-root-user)")
def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes_to_the_same_dataset(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    # Six files of ~580 KB of words that compress to ~280 KB: the 1 MiB disk holds three units' shards.
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    sources = []
    for f in range(6):
        path = tmp_path / f"f{f}.jsonl"
        path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=300)) + "."}) + "\n"
                                for _ in range(300)))
        sources.append(str(path))
    straight = subprocess.run([ASSAY, "ingest", *sources, "--out", str(tmp_path / "straight")],
                              env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    _fill_then_grow(tmp_path, "raw", ["ingest", *sources])
    assert (tmp_path / "full.ls").read_text().split() == [".raw.staging"]  # staged work only: no dataset published
    resumed = tmp_path / "resumed"
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["counts"]["units_resumed"] >= 1  # the units finished before the disk filled were kept
    assert not list(resumed.rglob(".*.tmp*")) and not (tmp_path / "resumed" / ".raw.staging").exists()
    assert _texts(resumed) == _texts(tmp_path / "straight") and len(_texts(resumed)) == 1800


@pytest.mark.slow  # three training runs, 30 s
@pytest.mark.skipif(not _namespaces_work(), reason="no private mount namespace here (unshare --mount --map-root-user)")
def test_a_disk_full_at_the_first_checkpoint_is_one_line_and_the_same_command_trains_the_same_run(tmp_path,
                                                                                                 prefect_harness):
    """The model's first checkpoint (~1.5 MB: 2 layers of 64, with Adam's moments) does not fit the 1 MiB disk:
    torch's zip writer failed with "unexpected pos N vs M" inside DCP's CheckpointException, a BaseException
    that passed every handler (a raw traceback). Then the same command started over only with --overwrite."""
    import yaml
    from prefect.settings import PREFECT_API_URL

    from corpus import stdlib_documents, write_documents

    # 3 modules: their token rows (~300 KB) fit the disk beside the tokenizer; the checkpoint does not.
    data = write_documents(tmp_path / "data", stdlib_documents(3), source="stdlib")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": {
        "model": {"dim": 64, "n_layers": 2, "n_heads": 2, "ffn_hidden": 128}, "vocab_size": 320, "seq_len": 32,
        "batch_size": 4, "steps": 6, "checkpoint_every": 3, "device": "cpu"}}))
    args = ["--params", str(params), "train", "--data", str(data)]
    straight = subprocess.run([ASSAY, *args, "--out", str(tmp_path / "straight")], capture_output=True, text=True,
                              env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    _fill_then_grow(tmp_path, "run", args)
    assert "writing " + str(tmp_path / "disk/run/checkpoints/step-00000003.tmp-save") in (tmp_path / "full.err").read_text()
    rerun = (tmp_path / "rerun.out").read_text() + (tmp_path / "rerun.err").read_text()
    assert "holds a run stopped before its first checkpoint: nothing to resume; starting over" in rerun
    history = lambda run: (run / "history.jsonl").read_text().splitlines()  # noqa: E731
    assert history(tmp_path / "resumed") == history(tmp_path / "straight") and len(history(tmp_path / "straight")) == 6
