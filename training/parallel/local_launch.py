"""Run N ranks on this machine with nothing listening beyond 127.0.0.1.

``python -m training.parallel.local_launch --nproc N [--max-restarts R] -- -m MODULE ARGS...``

Why not ``torchrun --standalone``: its agent hosts two c10d stores (the rendezvous's and the
one it shares with the workers), and ``TCPStore`` binds every interface whatever host it is
given (measured here, torch 2.13: ``*:PORT`` with host ``127.0.0.1``, libuv or not). So one
machine's training run was reachable from the network, with no authentication. This
launcher binds the one store itself, on 127.0.0.1, and hands its socket to ``TCPStore``
(``master_listen_fd``). Several machines still use torchrun: they need the network.

The ranks see torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_USE_AGENT_STORE``…), so the worker and
``training.parallel.distributed`` run unchanged under either launcher. Restarts work as
torchrun's do: when a rank fails, the others are stopped and the whole group starts again,
up to ``--max-restarts`` times; the store lives across attempts, and each attempt keys its
entries by its number (``distributed._attempt_store``).

gloo and NCCL open sockets of their own between ranks; they are pinned to the loopback
interface (``GLOO_SOCKET_IFNAME=lo``, ``NCCL_SOCKET_IFNAME=lo``) unless already set.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from assay.parent_death import die_with_parent
from training.parallel.launch import LOCAL_GRACE_S

__all__ = ["LOOPBACK", "main", "rank_environment", "run_ranks"]

LOOPBACK = "127.0.0.1"
_GRACE_S = LOCAL_GRACE_S  # how long a stopped rank gets to exit on SIGTERM before SIGKILL


def rank_environment(base: Mapping[str, str], rank: int, nproc: int, port: int, attempt: int, max_restarts: int,
                     run_id: str) -> dict[str, str]:
    """The environment torchrun would give rank ``rank`` of a one-machine group."""
    env = dict(base)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True",
    })
    return env


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the launcher: stop the ranks and exit."""


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _attempt(command: list[str], nproc: int, port: int, attempt: int, max_restarts: int, run_id: str) -> int:
    """Start every rank; 0 when all finish cleanly, else a failed rank's exit code (the lowest
    rank's when several have failed by the time the launcher looks)."""
    # The signal follows the thread that forks, not the process: this one, the main thread, lives
    # as long as the launcher does.
    die_with_launcher = die_with_parent()
    procs = [subprocess.Popen(command, env=rank_environment(os.environ, rank, nproc, port, attempt,
                                                            max_restarts, run_id),
                              preexec_fn=die_with_launcher)
             for rank in range(nproc)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except BaseException:
        _stop(procs)
        raise


def run_ranks(command: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Run ``command`` as ranks 0..nproc-1 of one group, restarting the group on failure.

    Returns 0, or the exit code of a failed rank of the last attempt.
    """
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"need nproc >= 1 and max_restarts >= 0, got {nproc} and {max_restarts}")
    listener = socket.create_server((LOOPBACK, 0), backlog=max(128, nproc))
    port = listener.getsockname()[1]
    # The store lives in this process for the whole run, as torchrun's agent store does. It
    # takes the socket over (and closes it), hence detach().
    store = dist.TCPStore(LOOPBACK, port, None, True, timedelta(minutes=30), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    run_id = uuid.uuid4().hex[:12]

    stopping: list[int] = []

    def stopped(signum: int, _frame: object) -> None:
        # Only the first signal stops: Ctrl-C sends SIGINT to the launcher and to `assay train`,
        # which then sends SIGTERM, and a second _Stopped raised inside _stop would cut it short
        # (ranks neither waited for nor SIGKILLed).
        if not stopping:
            stopping.append(signum)
            raise _Stopped(signum)

    previous = {s: signal.signal(s, stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            code = _attempt(command, nproc, port, attempt, max_restarts, run_id)
            if code == 0:
                return 0
            if attempt < max_restarts:
                print(f"local_launch: a rank exited with {code}; restarting the group "
                      f"({attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
        print(f"local_launch: a rank exited with {code}; no restarts left", file=sys.stderr, flush=True)
        return code
    except _Stopped as exc:
        return 128 + int(exc.args[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        del store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.parallel.local_launch",
        description="Run N ranks of a torch.distributed program on this machine, every socket on 127.0.0.1. "
                    "Everything after -- is the Python command line of one rank "
                    "(e.g. -m training.parallel.worker ...).")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times to restart the whole group after a rank fails (default 0)")
    parser.add_argument("rank_args", nargs=argparse.REMAINDER, help="-- then the rank's Python arguments")
    args = parser.parse_args(argv)
    rank_args = args.rank_args[1:] if args.rank_args[:1] == ["--"] else args.rank_args
    if not rank_args:
        parser.error("give the rank's command after --, e.g. -- -m training.parallel.worker --data ...")
    if args.nproc < 1 or args.max_restarts < 0:
        parser.error(f"--nproc must be at least 1 and --max-restarts at least 0 "
                     f"(got {args.nproc}, {args.max_restarts})")
    return run_ranks([sys.executable, *rank_args], args.nproc, args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
