"""The demo corpus, and a real `dvc repro` of the ingest stage in a temporary git repo."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from assay.config import DemoParams
from assay.ingest.demo import REFERENCE_SOURCES, SOURCE_METADATA, SOURCE_STDLIB, plan_demo
from assay.ingest.plan import IngestOptions
from corpus import tiny_pipeline_params
from dvc_repo import dvc_repo as new_dvc_repo
from dvc_reruns import check_reruns

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _entries(units):
    return [(e.source, e.locator) for u in units for e in u.files]


def test_demo_is_deterministic_for_a_seed_and_has_every_part():
    params = DemoParams(stdlib_files=30, package_files=30, package_metadata=20, man_pages=10, pydoc_topics=10)
    first = _entries(plan_demo(params, IngestOptions()))
    assert first == _entries(plan_demo(params, IngestOptions()))
    other = _entries(plan_demo(DemoParams(**{**params.__dict__, "seed": 1}), IngestOptions()))
    assert other != first
    sources = {s for s, _ in first}
    assert {SOURCE_STDLIB, SOURCE_METADATA, "pydoc-topics"} <= sources
    assert any(s.startswith("site-packages/") for s in sources)
    if shutil.which("man"):
        assert "man" in sources
    assert set(REFERENCE_SOURCES) & sources


def _run(cmd, cwd, env):
    # The whole loop (two trainings, the scoring pass) takes minutes on a busy 2-core machine.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def dvc_repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    params = tiny_pipeline_params(ROOT / "params.yaml")
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _, env, _ = new_dvc_repo(repo, remote=tmp_path / "remote")
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "pipeline"], repo, env)
    return repo, env


@pytest.mark.slow
def test_dvc_repro_runs_the_pipeline_and_versions_it(dvc_repo):
    repo, env = dvc_repo
    dvc = str(BIN / "dvc")
    _run([dvc, "repro"], repo, env)
    manifest = json.loads((repo / "data/raw/manifest.json").read_text())
    assert manifest["stage"] == "ingest" and manifest["counts"]["documents"] > 30
    assert list((repo / "data/raw").glob("part-*.parquet"))
    head = json.loads((repo / "models/quality/config.json").read_text())
    assert head["metrics"]["auc"] > 0.5
    static = json.loads((repo / "data/static/manifest.json").read_text())
    assert static["stage"] == "static" and static["counts"]["input"] == manifest["counts"]["documents"]
    assert list((repo / "data/static/embeddings").glob("part-*.parquet"))
    assert (repo / "models/domain/model.safetensors").is_file()
    domain = json.loads((repo / "data/domain/manifest.json").read_text())
    assert domain["stage"] == "domain" and domain["rule_clean_share"]["code_in"] > 0
    dedup = json.loads((repo / "data/dedup/manifest.json").read_text())
    assert dedup["stage"] == "dedup" and dedup["dedup"]["input"] == domain["counts"]["kept"]
    assert dedup["graph"]["documents"] == dedup["dedup"]["input"]
    metrics = json.loads((repo / "runs/round-0/metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["data"]["data_hash"].endswith(".dir")
    assert list((repo / "runs/round-0/telemetry").glob("part-*.parquet"))
    # The loop: scores of every document, the curated version, round 1 on it, the report.
    scores = json.loads((repo / "runs/round-0/scores/manifest.json").read_text())
    curated = json.loads((repo / "data/curated/manifest.json").read_text())
    assert curated["stage"] == "dynamic" and curated["counts"]["input"] == dedup["dedup"]["kept"]
    round1 = json.loads((repo / "runs/round-1/metrics.json").read_text())
    assert round1["steps"] == 6 and round1["data"]["data_hash"] != metrics["data"]["data_hash"]
    assert (repo / "reports/index.html").stat().st_size > 100_000
    assert scores and "final_loss" in _run([dvc, "metrics", "show"], repo, env)
    assert "up to date" in _run([dvc, "status"], repo, env)

    _run(["git", "add", "dvc.lock", "data/.gitignore", "models/.gitignore", "runs"], repo, env)
    _run(["git", "commit", "-qm", "data v1"], repo, env)
    _run([dvc, "push", "-q"], repo, env)

    # A changed knob makes exactly the stages that read it stale.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["static"]["threshold"] = 0.6
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = _run([dvc, "status"], repo, env)
    assert "static:" in status and "quality-head:" in status and "ingest:" not in status
    assert "domain-model:" not in status  # a downstream stage is stale only through changed deps
    _run(["git", "checkout", "params.yaml"], repo, env)

    # The version can be restored from the remote alone.
    shutil.rmtree(repo / "data")
    shutil.rmtree(repo / "models")
    shutil.rmtree(repo / "runs/round-0/checkpoints")
    shutil.rmtree(repo / ".dvc/cache")
    _run([dvc, "pull", "-q"], repo, env)
    assert json.loads((repo / "data/raw/manifest.json").read_text()) == manifest
    assert json.loads((repo / "data/static/manifest.json").read_text()) == static
    assert json.loads((repo / "data/domain/manifest.json").read_text()) == domain
    assert json.loads((repo / "data/dedup/manifest.json").read_text()) == dedup
    assert (repo / "runs/round-0/checkpoints/latest").exists()
    assert "up to date" in _run([dvc, "status"], repo, env)

    # Nothing changed: nothing reruns; one threshold: exactly its stage and what depends on it.
    check_reruns(repo, env)
