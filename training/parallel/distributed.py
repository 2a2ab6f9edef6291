"""Start and stop the process group of a launched run (torchrun, or ``local_launch`` with its environment).

The backend string ``cpu:gloo,cuda:nccl`` lets CPU-side collectives (object broadcasts,
the loss all-reduce of a CPU tensor) use gloo while GPU tensors use NCCL. A CPU-only
build has no NCCL, and asking for it fails at init, so it is named only where it exists.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

__all__ = ["Distributed", "backend_string", "init_distributed", "leave", "run_rank", "shutdown"]


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only (file system work: wiping a run, saving a tokenizer) and give
        every rank its result; an exception on rank 0 is raised on every rank, so none hangs."""
        if not self.distributed:
            return fn()
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # re-raised below, on every rank
                box[0] = ("error", exc)
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank (a picklable value: a name, a hash)."""
        if not self.distributed:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over all ranks (a new tensor; the input is untouched)."""
        if not self.distributed:
            return value
        total = value.detach().clone()
        dist.all_reduce(total)
        return total


def launched_as_a_rank() -> bool:
    """True under torchrun or local_launch (both set torchrun's environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_string() -> str:
    if dist.is_nccl_available() and torch.cuda.is_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_distributed() -> Distributed:
    """Join the group the launcher set up (env://); a plain process is rank 0 of 1 with no group."""
    if not launched_as_a_rank():
        return Distributed(0, 1, 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend_string(), **_attempt_store())
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank)


def _attempt_store() -> dict[str, Any]:
    """A key space of its own for each elastic attempt.

    torchrun's agent hosts one store for the whole job, and ``local_launch`` does the same.
    Measured here (torch 2.13, gloo): a group restarted after a rank died often hung in its
    first collective or was refused a connection, its ranks reading addresses the previous
    attempt had published under the same keys. Prefixing the keys with the attempt number
    made every restart form (3 of 3 toy runs, where the plain init hung).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"assay/attempt-{attempt}/", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def shutdown() -> None:
    """Destroy the process group, then collect the garbage that may still hold it (DDP's reducer
    sits in reference cycles), so that its gloo threads end now where nothing else keeps it."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def leave(code: int = 0) -> NoReturn:
    """End a rank's process without tearing down the interpreter.

    A gloo group still alive when the interpreter finalizes can abort a rank that has finished
    and written everything: a gloo thread drops the last reference to a tensor, takes the GIL of
    an interpreter being torn down, and the C++ runtime ends the process ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489), so the launcher reports the
    run failed. ``destroy_process_group`` does not end every group here. Wherever DTensor was
    used (FSDP, TP), a ``DeviceMesh`` held by DTensor's cached sharding specs keeps its group in
    ``_pg_registry`` to the end: in 2-rank FSDP and TP runs, gloo's three threads outlived
    ``destroy_process_group`` and ``gc.collect()`` (measured 2026-12-04, torch 2.13). Ranks that keep
    their group to the end (tests/parallel/teardown_probe.py, 5 ranks under torchrun) aborted in 8
    of 10 launches on a plain exit and in 0 of 10 through this function.

    So: destroy the group, run the ``atexit`` handlers (logging's flush among them), flush
    stdout and stderr, and end with ``os._exit``, which skips finalization. A rank's files are
    closed before this (writes are atomic), so nothing is lost. Call it after the rank's last
    collective on every rank: a rank that leaves while a peer still waits on it breaks that peer,
    as any exit would.
    """
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_rank(main: Callable[[], int | None]) -> NoReturn:
    """Run a launched rank's ``main`` and end its process through :func:`leave`, with the exit
    code a plain ``sys.exit(main())`` would give: ``main``'s result, a ``SystemExit``'s code
    (argparse's usage errors), or 1 and the traceback for an exception."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # printed, and the rank ends with 1, as an uncaught exception would
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
        code = 1
    leave(code)
