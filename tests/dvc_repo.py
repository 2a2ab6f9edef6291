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


def dvc_repo(repo: Path) -> tuple[Path, dict, str]:
    """A new git + DVC repository: its path, an environment for commits in it, the dvc executable."""
    repo.mkdir()
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com")
    dvc = str(BIN / "dvc")
    run_ok(["git", "init", "-q"], repo, env)
    run_ok([dvc, "init", "-q"], repo, env)
    return repo, env, dvc
