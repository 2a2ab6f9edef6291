"""The `pipeline` flow: `dvc repro`, one Prefect task per stage, in dvc.yaml's order.

A run from the Prefect UI and `dvc repro` run the same stage commands, and
DVC's lock records what the UI run produced, because this flow *is* a
`dvc repro`: each task runs `dvc repro --single-item STAGE` in the repository,
so DVC decides whether the stage is stale, runs its `cmd`, and writes dvc.lock.
Each stage command runs its own flow against the same Prefect server
(PREFECT_API_URL is inherited), so the UI shows those runs too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from assay.errors import AssayError

_SKIPPED = re.compile(r"Stage '.*' didn't change, skipping")
_EDGE = re.compile(r'^"(.+)" -> "(.+)";$')


def _bin(name: str) -> str:
    # The venv's own tools first: `assay ui`/`assay serve` are often started as
    # .venv/bin/assay without an activated venv.
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if PREFECT_API_URL.value():  # from a Prefect profile rather than the environment
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    return env


def _dvc(args: list[str], repo: Path) -> str:
    proc = subprocess.run([_bin("dvc"), *args], cwd=repo, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssayError(f"dvc {' '.join(args)} failed in {repo}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above START (default: the working directory) holding dvc.yaml."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "dvc.yaml").is_file():
            return candidate
    raise AssayError(f"no dvc.yaml in {here} or above: run the pipeline from the repository "
                     "(start `assay serve` there)")


def stage_order(repo: Path) -> list[str]:
    """Stage names as DVC lists them: dvc.yaml's order, which is also a valid run order here."""
    return _dvc(["stage", "list", "--name-only"], repo).split()


def upstream_of(repo: Path, stages: list[str]) -> set[str]:
    """STAGES and every stage they depend on, through DVC's own graph (`dvc dag --dot`)."""
    parents: dict[str, set[str]] = {}
    for line in _dvc(["dag", "--dot"], repo).splitlines():
        match = _EDGE.match(line.strip())
        if match:
            parents.setdefault(match.group(2), set()).add(match.group(1))
    found, todo = set(stages), list(stages)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


def plan(repo: Path, stages: list[str] | None, single_item: bool) -> list[str]:
    """The stages to hand to DVC, in run order; unknown names are an error that lists the known ones."""
    order = stage_order(repo)
    if not stages:
        return order
    unknown = [s for s in stages if s not in order]
    if unknown:
        raise AssayError(f"unknown stage(s) {', '.join(unknown)}; dvc.yaml has: {', '.join(order)}")
    wanted = set(stages) if single_item else upstream_of(repo, stages)
    return [s for s in order if s in wanted]


@task(name="dvc-repro", task_run_name="dvc repro {stage}", cache_policy=NO_CACHE)
def repro_stage(stage: str, repo: str, force: bool = False) -> str:
    """Run one stage through DVC, streaming its output into this task's log; "ran" or "up to date"."""
    logger = get_run_logger()
    # --single-item: DVC must not recurse upstream, because the flow runs the
    # upstream stages itself, each as its own task, just before this one.
    command = [_bin("dvc"), "repro", "--single-item", *(["--force"] if force else []), stage]
    logger.info("$ dvc %s", " ".join(command[1:]))
    skipped = False
    # Its own process group, so that a cancelled or killed run stops DVC and the
    # stage command under it too, instead of leaving them holding DVC's lock.
    process = subprocess.Popen(command, cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
                               start_new_session=True)
    assert process.stdout is not None
    try:
        for line in process.stdout:
            line = line.rstrip()
            if line:
                logger.info(line)
                skipped = skipped or bool(_SKIPPED.search(line))
        process.wait()
    finally:
        if process.poll() is None:
            _stop_group(process)
    if process.returncode != 0:
        raise AssayError(f"dvc repro {stage} exited with code {process.returncode} (its output is in this task's log)")
    return "up to date" if skipped else "ran"


def _stop_group(process: subprocess.Popen, grace: float = 15.0) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _git(args: list[str], repo: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssayError(f"git {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def git_tracked_outputs(repo: Path) -> list[str]:
    """What a pipeline run changes that belongs in git: dvc.lock, the outputs
    DVC does not cache (metrics, the report) and the .gitignore files DVC writes."""
    paths = ["dvc.lock"]
    spec = yaml.safe_load((repo / "dvc.yaml").read_text()) or {}
    for stage in (spec.get("stages") or {}).values():
        for key in ("outs", "metrics", "plots"):
            for entry in (stage.get(key) or []) if isinstance(stage, dict) else []:
                if isinstance(entry, dict):
                    path, options = next(iter(entry.items()))
                    if isinstance(options, dict) and options.get("cache") is False:
                        paths.append(path)
    changed = _git(["status", "--porcelain", "--untracked-files=all"], repo).splitlines()
    paths += [line[3:] for line in changed if line[3:].endswith(".gitignore")]
    return [p for p in dict.fromkeys(paths) if (repo / p).exists()]


@task(name="git-commit", task_run_name="git commit", cache_policy=NO_CACHE)
def commit_lock(repo: str, message: str) -> str | None:
    """Commit dvc.lock and the git-tracked outputs; the new commit, or None when nothing changed."""
    root = Path(repo)
    paths = git_tracked_outputs(root)
    _git(["add", "--", *paths], root)
    if not _git(["diff", "--cached", "--name-only", "--", *paths], root).strip():
        get_run_logger().info("dvc.lock and the tracked outputs are unchanged: nothing to commit")
        return None
    # `commit -- PATHS` commits only these paths, whatever else the user has staged.
    _git(["commit", "-q", "-m", message, "--", *paths], root)
    sha = _git(["rev-parse", "HEAD"], root).strip()
    get_run_logger().info("committed %s: %s", sha[:10], ", ".join(paths))
    return sha


@flow(name="pipeline", log_prints=True)
def pipeline_flow(stages: list[str] | None = None, force: bool = False, single_item: bool = False,
                  commit: bool = False) -> dict:
    """Reproduce the DVC pipeline of the served repository, one task per stage.

    Args:
        stages: Stage names from dvc.yaml (ingest, static, dedup, train, ...); empty runs them all.
        force: Rerun the chosen stages even when DVC finds them up to date (`dvc repro --force`).
        single_item: Run only the chosen stages, not the stale stages upstream of them (`dvc repro --single-item`).
        commit: After a successful run, git-commit dvc.lock and the outputs git tracks (metrics, report).
    """
    repo = repo_root()
    chosen = set(stages or [])
    run = plan(repo, stages, single_item)
    print(f"repository {repo}: {' → '.join(run)}")
    results = {}
    for stage in run:
        # --force applies to the stages asked for, never to the upstream ones
        # pulled in only because they might be stale.
        results[stage] = repro_stage(stage, str(repo), force=force and (not chosen or stage in chosen))
    summary = {"repo": str(repo), "stages": results, "commit": None}
    if commit:
        ran = [s for s, r in results.items() if r == "ran"]
        message = f"pipeline: dvc repro {' '.join(run)}" + (f" (ran {', '.join(ran)})" if ran else " (nothing stale)")
        summary["commit"] = commit_lock(str(repo), message)
    print("; ".join(f"{s}: {r}" for s, r in results.items()))
    return summary
