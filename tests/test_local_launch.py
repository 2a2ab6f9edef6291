"""training.parallel.local_launch: one machine's ranks as one group, restarted together, stopped together.

Real processes and a real gloo group (2 ranks, a few seconds each). The launcher's sockets are
checked in tests/test_security.py; its use by `assay train` in tests/test_parallel.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

PROBE = Path(__file__).parent / "parallel" / "launch_probe.py"
ROOT = Path(__file__).resolve().parents[1]


def _launch(out: Path, *args: str, mode: str = "") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("GLOO_SOCKET_IFNAME", None)
    cmd = [sys.executable, "-m", "training.parallel.local_launch", "--nproc", "2", *args, "--", str(PROBE), str(out)]
    return subprocess.Popen(cmd + ([mode] if mode else []), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _reports(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def test_the_ranks_get_torchruns_environment_and_form_one_group(tmp_path):
    proc = _launch(tmp_path)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    reports = _reports(tmp_path)
    assert set(reports) == {"rank-0-attempt-0", "rank-1-attempt-0"}
    for rank in (0, 1):
        r = reports[f"rank-{rank}-attempt-0"]
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert r["MASTER_ADDR"] == "127.0.0.1" and r["GLOO_SOCKET_IFNAME"] == "lo"
        assert r["sum"] == 3.0  # 1 + 2: the all-reduce ran over both ranks
    assert reports["rank-0-attempt-0"]["TORCHELASTIC_RUN_ID"] == reports["rank-1-attempt-0"]["TORCHELASTIC_RUN_ID"]


def test_a_failed_rank_restarts_the_whole_group_until_restarts_run_out(tmp_path):
    again, once = tmp_path / "again", tmp_path / "once"
    again.mkdir(), once.mkdir()
    restarted = _launch(again, "--max-restarts", "1", mode="fail-once")
    output = restarted.communicate(timeout=300)[0]
    assert restarted.returncode == 0, output
    assert "restarting the group (1 of 1)" in output
    # Attempt 1 formed a new group on the same store (its keys prefixed by the attempt) and finished.
    assert {"rank-0-attempt-1", "rank-1-attempt-1"} <= set(_reports(again))
    assert all(r["sum"] == 3.0 for r in _reports(again).values())

    final = _launch(once, mode="fail-once")
    output = final.communicate(timeout=300)[0]
    assert final.returncode == 3, output  # the failed rank's code, not a generic one
    assert "no restarts left" in output
    assert not any(name.endswith("attempt-1") for name in _reports(once))


def test_sigterm_stops_every_rank(tmp_path):
    proc = _launch(tmp_path, mode="hang")
    deadline = time.monotonic() + 120
    while len(_reports(tmp_path)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    ranks = [r["pid"] for r in _reports(tmp_path).values()]
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert not [pid for pid in ranks if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_help_explains_and_a_missing_command_is_refused():
    done = subprocess.run([sys.executable, "-m", "training.parallel.local_launch", "--help"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0 and "127.0.0.1" in done.stdout and "--max-restarts" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "training.parallel.local_launch", "--nproc", "2"],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and "give the rank's command after --" in missing.stderr
    none = subprocess.run([sys.executable, "-m", "training.parallel.local_launch", "--nproc", "0", "--", "x.py"],
                          capture_output=True, text=True, cwd=ROOT)
    assert none.returncode == 2 and "--nproc must be at least 1" in none.stderr and "Traceback" not in none.stderr


# ------------------------------------------------------------ how a rank ends
TEARDOWN = Path(__file__).parent / "parallel" / "teardown_probe.py"


def _teardown(out: Path, holder: str, nproc: int) -> dict[str, dict]:
    """Launch tests/parallel/teardown_probe.py with torchrun, as the parallel tests launch their ranks. On a
    plain exit, its ranks aborted far more often under torchrun than under local_launch (in 8 and in 1 of 10
    launches of 5 ranks)."""
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(TEARDOWN), str(out), holder], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "terminate called" not in done.stdout + done.stderr
    return {p.stem: json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def test_shutdown_ends_a_group_that_only_garbage_holds(tmp_path):
    """DDP's reducer keeps the group in reference cycles: shutdown() collects them, so gloo's threads end
    while the interpreter is whole (without its gc.collect(), 3 threads per rank remain)."""
    reports = _teardown(tmp_path / "run", "cycle", nproc=2)
    assert len(reports) == 2
    assert all(r["before"] > 0 and r["after"] == 0 for r in reports.values()), reports


def test_ranks_whose_group_outlives_shutdown_end_cleanly(tmp_path):
    """Under FSDP and TP, DTensor's cached DeviceMesh keeps the group to the end. On a plain exit, gloo's
    thread can drop the last collective's tensors while the interpreter tears down, and the rank aborts
    ("terminate called without an active exception"): 8 of 10 launches of this probe's 5 ranks did,
    0 of 10 through leave(). Three launches: with the plain exit, all three passing had a chance of about 1 in 100."""
    for attempt in range(3):
        _teardown(tmp_path / f"attempt-{attempt}", "global", nproc=5)


@pytest.mark.parametrize("body,code,says", [
    ("print('result', end=''); atexit.register(lambda: print('handler ran', file=sys.stderr))", 0,
     ["result", "handler ran"]),
    ("return 3", 3, []),
    ("raise ValueError('boom')", 1, ["Traceback", "ValueError: boom"]),
    ("sys.exit('stopped: a reason')", 1, ["stopped: a reason"]),
], ids=["flushes-and-runs-atexit", "returned-code", "exception", "exit-message"])
def test_run_rank_ends_the_process_as_a_plain_exit_would(body, code, says):
    script = f"import atexit, sys\nfrom training.parallel.distributed import run_rank\n\ndef main():\n    {body}\n\nrun_rank(main)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == code, done.stderr
    for text in says:
        assert text in done.stdout + done.stderr


# ------------------------------------------------------------ stopped from outside, politely or not
SLEEPER = """\
import os, signal, sys, time
from pathlib import Path
if sys.argv[2:] == ["ignore-term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1], f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def _sleeper(tmp_path: Path) -> Path:
    """A rank that only writes its pid and sleeps: no group, so the tests are about processes alone."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return script


def _rank_pids(out: Path, nproc: int, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 120
    while len(pids := sorted(out.glob("rank-*.pid"))) < nproc:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return [int(p.read_text()) for p in pids]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after `seconds` (none, as soon as they are all gone)."""
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


def _start(cmd: list[str]) -> subprocess.Popen:
    # A session of its own: the cleanup below can then kill whatever the code under test left behind.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


#: `assay train`'s side: launch() in a process whose SIGTERM handler raises, as Prefect's does; it reports
#: the launcher's exit status once the exception has come out of launch().
LAUNCHING = """\
import json, signal, subprocess, sys
from training.parallel.launch import Launch, launch

launched = []
class Recording(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        launched.append(self)
subprocess.Popen = Recording

class Sleepers(Launch):
    def command(self, worker_args):
        return [sys.executable, "-m", "training.parallel.local_launch", "--nproc=2", "--", *worker_args]

class Terminated(Exception):
    pass

def terminated(signum, frame):
    raise Terminated()

signal.signal(signal.SIGTERM, terminated)
try:
    launch(Sleepers(nproc=2), sys.argv[1:])
except Terminated:
    print(json.dumps({"launcher": launched[0].returncode}), flush=True)
    sys.exit(0)
sys.exit("launch() returned without the exception")
"""


def test_an_exception_in_the_waiting_cli_stops_the_launcher_politely_and_so_every_rank(tmp_path):
    """SIGTERM to `assay train` raised inside subprocess.run, which SIGKILLed the launcher: it never
    stopped its ranks, and they went on training (and writing checkpoints) under PID 1."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start([sys.executable, "-c", LAUNCHING, str(_sleeper(tmp_path)), str(out)])
    try:
        ranks = _rank_pids(out, 2, proc)
        proc.send_signal(signal.SIGTERM)  # to `assay train` alone, as `kill PID` sends it
        output = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, output
        # The launcher ended by its own SIGTERM path (128 + 15), not by SIGKILL (-9).
        assert json.loads(output.strip().splitlines()[-1]) == {"launcher": 128 + signal.SIGTERM}, output
        assert not _gone_within(ranks, 20)
    finally:
        _kill_group(proc)


def test_the_ranks_of_a_launcher_killed_by_sigkill_get_sigterm(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start([sys.executable, "-m", "training.parallel.local_launch", "--nproc=2", "--",
                   str(_sleeper(tmp_path)), str(out)])
    try:
        ranks = _rank_pids(out, 2, proc)
        proc.kill()
        proc.wait(timeout=10)
        assert not _gone_within(ranks, 5)
    finally:
        _kill_group(proc)


def test_a_second_signal_does_not_cut_the_stopping_of_the_ranks_short(tmp_path):
    """Ctrl-C sends SIGINT to the launcher and to `assay train`, which then sends SIGTERM: that second
    signal, raised inside the launcher's _stop, made it return with the ranks still running. Here the
    ranks ignore SIGTERM, so only the SIGKILL after the grace ends them."""
    from training.parallel.local_launch import _GRACE_S

    out = tmp_path / "out"
    out.mkdir()
    proc = _start([sys.executable, "-m", "training.parallel.local_launch", "--nproc=2", "--",
                   str(_sleeper(tmp_path)), str(out), "ignore-term"])
    try:
        ranks = _rank_pids(out, 2, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=_GRACE_S + 20)[0]
        assert proc.returncode == 128 + signal.SIGINT, output  # the first signal's
        assert not _gone_within(ranks, 2)
    finally:
        _kill_group(proc)
