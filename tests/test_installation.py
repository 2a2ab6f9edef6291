"""A dataset's manifest names the installation that made it, and a run never mixes two installations' work.

A killed stage leaves finished units staged beside its output, and the rerun resumes them
(assay.staging). When the code or the packages changed in between, the rerun starts over and
says what changed; a finished dataset of the same inputs is kept with a note, or rebuilt on
--overwrite. The end-to-end test makes the change for real: a run of a copy of Assay's sources
is SIGKILLed after its first finished unit, and the installed Assay reruns it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from assay.installation import CODE_PACKAGES, differences, installation, requirement_versions
from assay.schema import DOCUMENT_SCHEMA
from assay.shards import MANIFEST, staging_dir
from assay.staging import FINGERPRINT, UnitWriter, commit, finished_unit, prepare

ROOT = Path(__file__).resolve().parents[1]
ASSAY = str(Path(sys.executable).parent / "assay")


def _another_installation() -> dict:
    """This installation as an earlier one would have recorded it: older torch, other code."""
    other = installation()
    other["packages"]["torch"] = "2.12.0"
    other["code"] = "0" * 16
    return other


def _stage_one_unit(out: Path, fingerprint: str = "f") -> None:
    assert prepare(out, fingerprint) is False
    writer = UnitWriter(out, "unit-a", DOCUMENT_SCHEMA, target_bytes=1 << 20)
    writer.docs.write(pa.table({"id": ["a"], "text": ["some text"], "kind": ["text"], "lang": ["en"],
                                "source": ["tests"], "path": ["a"], "meta": ["{}"]}))
    writer.finish(bytes_in=0, seconds=0.0)


def _rewrite(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_the_record_names_the_code_python_and_every_required_package():
    record = installation()
    assert record["packages"]["torch"] == importlib.metadata.version("torch")
    assert record["packages"]["pyarrow"] == importlib.metadata.version("pyarrow")
    assert "pytest" not in record["packages"]  # an extra (dev): it makes no verdict
    assert set(requirement_versions()) == set(record["packages"])
    assert len(record["code"]) == 16 and record["python"] == ".".join(map(str, sys.version_info[:3]))
    assert differences(record, installation()) == []
    assert differences(record, _another_installation()) == [f"Assay's code {record['code']} -> {'0' * 16}",
                                                            f"torch {record['packages']['torch']} -> 2.12.0"]
    assert differences(None, record) == ["the earlier run recorded no installation"]


def test_staged_units_of_another_installation_are_not_resumed(tmp_path, capsys):
    out = tmp_path / "out"
    _stage_one_unit(out)
    assert prepare(out, "f") is False and finished_unit(out, "unit-a") is not None  # the same: resumed
    assert "not resuming" not in capsys.readouterr().out

    _rewrite(staging_dir(out) / FINGERPRINT, installation=_another_installation())
    assert prepare(out, "f") is False
    assert finished_unit(out, "unit-a") is None
    said = capsys.readouterr().out
    assert "not resuming the stopped run's staged work, which another installation made" in said
    assert f"torch 2.12.0 -> {importlib.metadata.version('torch')}" in said and "starting over" in said
    assert json.loads((staging_dir(out) / FINGERPRINT).read_text())["installation"] == installation()


def test_a_marker_written_before_installations_were_recorded_is_not_resumed(tmp_path):
    out = tmp_path / "out"
    _stage_one_unit(out)
    (staging_dir(out) / FINGERPRINT).write_text("f")  # how Assay wrote the marker before
    assert prepare(out, "f") is False and finished_unit(out, "unit-a") is None


def test_a_finished_dataset_of_another_installation_is_kept_with_a_note_and_rebuilt_on_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    _stage_one_unit(out)
    assert commit(out, ["unit-a"], {"fingerprint": "f", "stage": "test"})["installation"] == installation()
    assert prepare(out, "f") is True and prepare(out, "f", overwrite=True) is True  # same installation: kept
    assert capsys.readouterr().out == ""

    _rewrite(out / MANIFEST, installation=_another_installation())
    assert prepare(out, "f") is True
    assert "is up to date with its inputs and params, but another installation made it" in capsys.readouterr().out
    assert prepare(out, "f", overwrite=True) is False
    assert "rebuilding it (--overwrite): another installation made it" in capsys.readouterr().out
    assert (out / MANIFEST).is_file()  # readable until its successor is published


# The copy's one change: with PLANTED_KILL set, the process SIGKILLs itself once a unit is finished.
PLANTED = """
        atomic_write_json(self.path / DONE, result.to_json())
        if os.environ.get("PLANTED_KILL"):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _copy_with_a_planted_kill(dest: Path) -> Path:
    for package in CODE_PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    staging = dest / "assay" / "staging.py"
    text = staging.read_text()
    line = "        atomic_write_json(self.path / DONE, result.to_json())\n"
    assert text.count(line) == 1
    staging.write_text(text.replace(line, PLANTED.lstrip("\n")))
    return dest


def _ingest(source: Path, out: Path, params: Path, *, code: Path | None = None, kill: bool = False):
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if code:
        env["PYTHONPATH"] = str(code)  # ahead of the installed (editable) Assay
    if kill:
        env["PLANTED_KILL"] = "1"
    if PREFECT_API_URL.value():
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()  # the session's API, not a server per call
    return subprocess.run([ASSAY, "--params", str(params), "ingest", str(source), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)


def _texts(out: Path) -> list[str]:
    from assay.shards import iter_batches

    return sorted(t for batch in iter_batches(out, columns=["text"]) for t in batch.column("text").to_pylist())


@pytest.mark.slow  # four CLI runs, 30 s: make test-slow
def test_a_run_killed_under_other_code_is_started_over_by_the_installed_code(tmp_path, prefect_harness):
    source = tmp_path / "src"
    source.mkdir()
    for i in range(5):  # five files of ~2 KB, one unit each
        (source / f"doc{i}.txt").write_text(f"Document {i}. " + "Plain words make a plain document. " * 60)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["ingest"]["unit_bytes"] = 1000
    params["flow"]["max_workers"] = 1  # one unit at a time: the kill lands after the first
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    code = _copy_with_a_planted_kill(tmp_path / "code")
    out = tmp_path / "out"

    def killed_after_one_unit() -> None:
        run = _ingest(source, out, tmp_path / "params.yaml", code=code, kill=True)
        assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr[-2000:])
        assert len(list(staging_dir(out).glob("*/done.json"))) == 1

    # The control: the same code resumes its own unit, so the staged work is resumable at all.
    killed_after_one_unit()
    resumed = _ingest(source, out, tmp_path / "params.yaml", code=code)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["counts"]["units"] == 5 and manifest["counts"]["units_resumed"] == 1
    copy_code = manifest["installation"]["code"]
    assert copy_code != installation()["code"]
    expected = _texts(out)
    assert len(expected) == 5

    # The change: the installed Assay will not resume what the copy staged.
    shutil.rmtree(out)
    killed_after_one_unit()
    rerun = _ingest(source, out, tmp_path / "params.yaml")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    said = rerun.stdout + rerun.stderr
    assert "not resuming the stopped run's staged work, which another installation made" in said, said[-2000:]
    assert f"Assay's code {copy_code} -> {installation()['code']}" in said
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["counts"]["units_resumed"] == 0 and manifest["installation"] == installation()
    assert _texts(out) == expected

    # A finished dataset is kept by a rerun of other code, with a note; --overwrite rebuilds it.
    again = _ingest(source, out, tmp_path / "params.yaml", code=code)
    assert again.returncode == 0 and "another installation made it" in again.stdout + again.stderr
    assert json.loads((out / MANIFEST).read_text())["installation"]["code"] == installation()["code"]
