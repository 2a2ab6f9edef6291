"""Runs from the Prefect UI, for real: `assay ui` starts a server, `assay serve` serves the
deployments, and runs are created through the REST API exactly as the UI's Run button does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from ports import free_port
from test_dvc_and_demo import dvc_repo  # noqa: F401  (the temporary git + DVC repository with tiny params)

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = "assay-test"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _call(api: str, method: str, path: str, body: dict | None = None, tries: int = 5):
    request = urllib.request.Request(f"{api}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        # The server answers 503 while its SQLite database is busy (seen on a loaded 2-core machine).
        if exc.code != 503 or tries <= 1:
            raise
        time.sleep(1)
        return _call(api, method, path, body, tries - 1)


def _healthy(api: str) -> bool:
    try:
        return _call(api, "GET", "/health") is True
    except (urllib.error.URLError, OSError):
        return False


def _wait(what: str, check, timeout: float, procs: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode} while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _deployments(api: str) -> dict[str, dict]:
    found = _call(api, "POST", "/deployments/filter", {"deployments": {"name": {"any_": [DEPLOYMENT]}}})
    flows = {f["id"]: f["name"] for f in _call(api, "POST", "/flows/filter", {})}
    return {flows[d["flow_id"]]: d for d in found}


def _create(api: str, deployment: dict, parameters: dict) -> dict:
    """Create a flow run as the UI's Run button does."""
    return _call(api, "POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters})


def _finish(api: str, run: dict, procs, timeout: float = 150) -> dict:
    def final():
        state = _call(api, "GET", f"/flow_runs/{run['id']}")
        return state if state["state"]["type"] in FINAL else None

    return _wait(f"flow run {run['name']}", final, timeout, procs)


def _logs(api: str, run_id: str) -> str:
    rows = _call(api, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"})
    return "\n".join(r["message"] for r in rows)


def _start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    # Output to a file, not a pipe: nobody reads a pipe while the test waits, and a full one blocks the process.
    with log.open("w") as sink:
        return subprocess.Popen([str(BIN / "assay"), *args], env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen, log: Path, sig: int = signal.SIGINT, timeout: float = 30) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, log.read_text()


@pytest.mark.slow
def test_ui_serves_stage_and_pipeline_runs(dvc_repo, tmp_path):  # noqa: F811
    repo, env = dvc_repo
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_RUNNER_POLL_FREQUENCY="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    env.pop("PREFECT_API_URL", None)
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        ui = _start(["ui", "--port", str(port)], env, repo, tmp_path / "ui.log")
        procs.append(ui)
        _wait("the server's health check", lambda: _healthy(api), 150, procs)
        print(f"server healthy after {time.monotonic() - started:.1f} s")  # shown when the test fails: where time went
        assert _call(api.removesuffix("/api"), "GET", "/ui-settings")["api_url"] == api  # the UI talks to this port

        served_env = dict(env, PREFECT_API_URL=api)
        serve = _start(["serve", "--name", DEPLOYMENT, "--limit", "0"], served_env, repo, tmp_path / "serve.log")
        procs.append(serve)
        deployments = _wait("the deployments", lambda: (lambda d: d if {"pipeline", "ingest", "static", "train"} <= set(d)
                                                        else None)(_deployments(api)), 150, procs)
        print(f"deployments registered after {time.monotonic() - started:.1f} s")
        # Prefect builds the Run form from the flow's type hints: typed, with dvc.yaml's defaults.
        schema = deployments["pipeline"]["parameter_openapi_schema"]["properties"]
        assert schema["force"]["type"] == "boolean" and schema["commit"]["type"] == "boolean"
        assert deployments["static"]["parameters"] == {"input_dir": "data/raw", "out": "data/static", "overwrite": True}

        # Three runs at once (served without a limit), as three presses of Run would make them:
        # a stage deployment on a small dataset of its own, the pipeline limited to ingest, and a
        # pipeline run naming a stage that dvc.yaml lacks.
        source = tmp_path / "docs"
        source.mkdir()
        for i in range(3):
            (source / f"doc{i}.txt").write_text(f"Document number {i} has a few plain words in it.\n" * 3)
        out = tmp_path / "ingested"
        stage_run = _create(api, deployments["ingest"], {"sources": [str(source)], "out": str(out)})
        pipeline_run = _create(api, deployments["pipeline"], {"stages": ["ingest"], "commit": True})
        bad_run = _create(api, deployments["pipeline"], {"stages": ["nope"]})

        run = _finish(api, stage_run, procs)
        assert run["state"]["type"] == "COMPLETED", _logs(api, run["id"])
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["stage"] == "ingest" and manifest["counts"]["documents"] == 3
        print(f"stage run done after {time.monotonic() - started:.1f} s")

        # The pipeline: DVC runs the stage, its lock records it, and the commit keeps it.
        run = _finish(api, pipeline_run, procs)
        logs = _logs(api, run["id"])
        assert run["state"]["type"] == "COMPLETED", logs
        assert "Running stage 'ingest'" in logs  # DVC's own output, streamed into the run's log
        lock = yaml.safe_load((repo / "dvc.lock").read_text())
        assert list(lock["stages"]) == ["ingest"] and lock["stages"]["ingest"]["outs"][0]["path"] == "data/raw"
        assert (repo / "data/raw/manifest.json").is_file()
        head = subprocess.run(["git", "log", "-1", "--format=%s", "--name-only"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True).stdout
        assert head.startswith("pipeline: dvc repro ingest (ran ingest)") and "dvc.lock" in head
        status = subprocess.run([str(BIN / "dvc"), "status", "ingest"], cwd=repo, env=env, capture_output=True,
                                text=True, check=True).stdout
        assert "up to date" in status
        tasks = _call(api, "POST", "/task_runs/filter", {"task_runs": {"flow_run_id": {"any_": [run["id"]]}}})
        assert {t["name"] for t in tasks} >= {"dvc repro ingest", "git commit"}
        # The stage command ran its own flow against this server (not a temporary one): the UI shows it.
        ingest_runs = _call(api, "POST", "/flow_runs/filter", {"flows": {"name": {"any_": ["ingest"]}}})
        assert any(r["deployment_id"] is None and r["state"]["type"] == "COMPLETED" for r in ingest_runs)
        print(f"pipeline run done after {time.monotonic() - started:.1f} s")

        run = _finish(api, bad_run, procs)
        assert run["state"]["type"] == "FAILED"
        assert "unknown stage(s) nope; dvc.yaml has: ingest, quality-head" in _logs(api, run["id"])
        print(f"failing run done after {time.monotonic() - started:.1f} s")
        code, out_serve = _stop(serve, tmp_path / "serve.log", signal.SIGTERM)
        assert code == 0, out_serve
        code, out_ui = _stop(ui, tmp_path / "ui.log")
        assert code == 0, out_ui
        assert f"export PREFECT_API_URL={api}" in out_ui and "stopped" in out_ui
        assert not _healthy(api)  # Ctrl-C stopped the server too
    finally:
        # SIGTERM first: `assay ui` then stops its server, which runs in a session of its own.
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.mark.slow
def test_serve_without_a_server_says_what_to_do(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"))
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([str(BIN / "assay"), "serve"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "PREFECT_API_URL is not set: start a server with `assay ui`" in proc.stderr
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{free_port()}/api"
    proc = subprocess.run([str(BIN / "assay"), "serve"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "no Prefect server answers at PREFECT_API_URL=" in proc.stderr


@pytest.mark.slow
def test_pipeline_plan_follows_dvc_yaml_and_its_graph(tmp_path):
    from assay.errors import AssayError
    from flows.pipeline import plan, repo_root

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    subprocess.run([str(BIN / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "sub").mkdir()
    assert repo_root(tmp_path / "sub") == tmp_path.resolve()
    order = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert plan(tmp_path, None, single_item=False) == order
    # A chosen stage brings the stages upstream of it (each checked by DVC, and skipped when up to date), in order.
    assert plan(tmp_path, ["static"], single_item=False) == ["ingest", "quality-head", "static"]
    assert plan(tmp_path, ["dedup", "ingest"], single_item=True) == ["ingest", "dedup"]
    with pytest.raises(AssayError, match="unknown stage.s. nope; dvc.yaml has: ingest, quality-head"):
        plan(tmp_path, ["nope"], single_item=False)
