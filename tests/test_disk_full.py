"""A full disk mid-run: one clear line, nothing half-written published, and the rerun resumes.

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

import pyarrow.parquet as pq
import pytest

ASSAY = str(Path(sys.executable).parent / "assay")

# Runs in the namespace: the disk fills during the first run, has room for the second.
_SCRIPT = """
set -u
mount -t tmpfs -o size=1m tmpfs "$DISK"
"$ASSAY" ingest "$@" --out "$DISK/raw" 2>"$LOGS/full.err" >"$LOGS/full.out"; echo $? >"$LOGS/full.rc"
ls -A "$DISK" >"$LOGS/full.ls"
mount -o remount,size=16m "$DISK"
"$ASSAY" ingest "$@" --out "$DISK/raw" 2>"$LOGS/rerun.err" >"$LOGS/rerun.out"; echo $? >"$LOGS/rerun.rc"
cp -a "$DISK/raw" "$LOGS/resumed"
"""


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def _texts(out: Path) -> dict[str, str]:
    docs = {}
    for part in sorted(out.glob("part-*.parquet")):
        table = pq.read_table(part, columns=["id", "text"])
        docs.update(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    return docs


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
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "ASSAY": ASSAY,
           "DISK": str(tmp_path / "disk"), "LOGS": str(tmp_path)}
    (tmp_path / "disk").mkdir()
    straight = subprocess.run([ASSAY, "ingest", *sources, "--out", str(tmp_path / "straight")], env=env,
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    subprocess.run(["unshare", "--mount", "--map-root-user", "bash", "-c", _SCRIPT, "disk-full", *sources],
                   env=env, check=True, timeout=1200)

    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("assay: error: the disk is full (No space left on device") and last.endswith(
        "free space and rerun the same command; nothing half-written was published, and a stage resumes the units "
        "it finished"), last
    assert "internal error" not in err
    assert (tmp_path / "full.ls").read_text().split() == [".raw.staging"]  # staged work only: no dataset published

    assert (tmp_path / "rerun.rc").read_text().strip() == "0", (tmp_path / "rerun.err").read_text()[-3000:]
    resumed = tmp_path / "resumed"
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["counts"]["units_resumed"] >= 1  # the units finished before the disk filled were kept
    assert not list(resumed.rglob(".*.tmp*")) and not (tmp_path / "resumed" / ".raw.staging").exists()
    assert _texts(resumed) == _texts(tmp_path / "straight") and len(_texts(resumed)) == 1800
