"""A real git + DVC repository for tests, and a runner of its commands that fails the test with their stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def run_ok(args: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def git_env(**extra: str) -> dict:
    """The environment for commands in a test repository: this venv's `assay` and `dvc` first on
    PATH (stage commands find them there), and a git identity for its commits."""
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", GIT_AUTHOR_NAME="t",
                GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com",
                **extra)


def dvc_repo(repo: Path, remote: Path | None = None) -> tuple[Path, dict, str]:
    """A git + DVC repository at `repo` (made if missing), with `remote` as its default DVC remote
    if given: its path, an environment for commands in it, the dvc executable."""
    repo.mkdir(parents=True, exist_ok=True)
    env = git_env()
    dvc = str(BIN / "dvc")
    run_ok(["git", "init", "-q"], repo, env)
    run_ok([dvc, "init", "-q"], repo, env)
    if remote is not None:  # before the first data commit: `dvc push` skips commits made before it
        run_ok([dvc, "remote", "add", "-d", "local", str(remote)], repo, env)
    return repo, env, dvc
