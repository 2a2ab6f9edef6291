"""The CLI through its installed entry point (`assay`), as a user runs it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from assay.schema import document_id

ASSAY = shutil.which("assay", path=str(Path(sys.executable).parent)) or "assay"


def run(*args, cwd=None, check=True):
    proc = subprocess.run([ASSAY, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"assay {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def test_help_explains_every_command():
    out = run("--help").stdout
    for command in ("ingest", "stats", "show", "why"):
        assert command in out
    ingest_help = run("ingest", "--help").stdout
    assert "--text-field" in ingest_help and "hf:PATH" in ingest_help and "quarantined" in ingest_help


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    from corpus import make_bad_corpus

    root = tmp_path_factory.mktemp("cli")
    corpus = make_bad_corpus(root)
    out = root / "raw"
    proc = run("ingest", corpus["tree"], corpus["jsonl"], "--out", out)
    return {"out": out, "stdout": proc.stdout, "root": root, "corpus": corpus}


def test_ingest_prints_the_summary(ingested):
    stdout = ingested["stdout"]
    for line in ("documents kept", "quarantined", "invalid:json", "invalid:too_large", "invalid:binary"):
        assert line in stdout


def test_stats_json(ingested):
    stats = json.loads(run("stats", ingested["out"], "--json").stdout)
    assert stats["documents"] == 7 and stats["quarantined"] == 8
    by_kind = {row["kind"]: row["documents"] for row in stats["by_kind"]}
    assert by_kind == {"code": 3, "text": 4}
    assert stats["tokens"] == round(stats["bytes"] / 4)
    assert "by source" in run("stats", ingested["out"]).stdout


def test_show_and_why_answer(ingested):
    out = ingested["out"]
    doc = json.loads(run("show", document_id("corpus", "src/app.py"), "--data", out, "--json").stdout)
    assert doc["text"].startswith("def add") and doc["lang"] == "python"
    story = json.loads(run("why", "r1", "--data", out, "--json").stdout)
    assert story[0]["kept"] is True and story[0]["stage"] == "ingest"
    bad = document_id("records.jsonl", "line:4")
    text = run("why", bad, "--data", out).stdout
    assert "invalid:json" in text and "dropped" in text


def test_errors_are_one_line_without_traceback(ingested, tmp_path):
    for args in (["ingest", tmp_path / "missing", "--out", tmp_path / "o"],
                 ["stats", tmp_path / "missing"],
                 ["show", "nope", "--data", ingested["out"]]):
        proc = run(*args, check=False)
        assert proc.returncode == 1
        assert proc.stderr.strip().startswith("assay: error:"), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    debug = run("--debug", "stats", tmp_path / "missing", check=False)
    assert "Traceback" in debug.stderr


def test_bad_params_file_is_a_clear_error(tmp_path):
    (tmp_path / "params.yaml").write_text("ingest:\n  max_bytez: 1\n")
    proc = run("ingest", tmp_path, "--out", tmp_path / "o", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "unknown key ingest.max_bytez" in proc.stderr
