"""Checks for a repo where the project's own dvc.yaml has just run: a second `dvc repro` does
nothing, and changing one threshold of a middle stage reruns exactly that stage and what depends
on it. test_dvc_and_demo calls `check_reruns` after its full `dvc repro`, so the chain runs once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

DVC = str(Path(sys.executable).parent / "dvc")
#: The middle stage whose threshold changes, and the threshold: tier 2's high-loss cut-off
#: (a stage near the end, so the check reruns only dynamic → train-1 → report).
STAGE, SECTION, KEY, VALUE = "dynamic", ("dynamic",), "loss_high_z", 3.0


def _downstream(stages: dict, start: str) -> set[str]:
    """``start`` and every stage that depends on it through its outputs, from dvc.yaml's deps and outs."""

    def outs(stage: dict) -> list[str]:
        return [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", []) + stage.get("metrics", [])]

    def under(a: str, b: str) -> bool:  # a dep on a directory covers the files in it, and the other way round
        return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")

    found, frontier = {start}, [start]
    while frontier:
        produced = outs(stages[frontier.pop()])
        for name, stage in stages.items():
            if name not in found and any(under(d, o) for d in stage.get("deps", []) for o in produced):
                found.add(name)
                frontier.append(name)
    return found


def _run(cmd: list[str], cwd: Path, env: dict) -> str:
    # The whole chain, run once, takes minutes on a shared 2-core machine: a generous bound.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def _lock(repo: Path) -> dict:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


def check_reruns(repo: Path, env: dict) -> None:
    """After a finished `dvc repro` in ``repo``: nothing reruns, then one threshold reruns its downstream.

    A function, so that a test which has already run the whole chain can call it instead of running it again.
    """
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    assert STAGE in stages, f"dvc.yaml has no {STAGE} stage"
    lock = (repo / "dvc.lock").read_text()
    second = _run([DVC, "repro"], repo, env)
    assert _ran(second) == []
    assert (repo / "dvc.lock").read_text() == lock
    assert "up to date" in _run([DVC, "status"], repo, env)

    params = yaml.safe_load((repo / "params.yaml").read_text())
    section = params
    for key in SECTION:
        section = section[key]
    assert section[KEY] != VALUE
    section[KEY] = VALUE
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stale = re.findall(r"^(\S+):$", _run([DVC, "status"], repo, env), flags=re.M)
    assert stale == [STAGE]  # before it reruns, only the stage that reads the threshold is stale

    before = _lock(repo)
    third = _run([DVC, "repro"], repo, env)
    ran, after = _ran(third), _lock(repo)
    allowed = _downstream(stages, STAGE)
    assert ran[0] == STAGE and set(ran) <= allowed, (ran, allowed)
    for name in set(stages) - allowed:  # untouched, to the hash
        assert after[name] == before[name], name
    # The rerun's output differs (its manifest records the new params and times), so DVC must
    # rerun every stage that reads it, and theirs in turn: exactly the stage's downstream.
    assert [o["md5"] for o in after[STAGE]["outs"]] != [o["md5"] for o in before[STAGE]["outs"]]
    assert set(ran) == allowed, (ran, allowed)
    assert "up to date" in _run([DVC, "status"], repo, env)
