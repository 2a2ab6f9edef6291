"""Start and stop the process group of a launched run (torchrun, or ``local_launch`` with its environment).

The backend string ``cpu:gloo,cuda:nccl`` lets CPU-side collectives (object broadcasts,
the loss all-reduce of a CPU tensor) use gloo while GPU tensors use NCCL. A CPU-only
build has no NCCL, and asking for it fails at init, so it is named only where it exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

__all__ = ["Distributed", "backend_string", "init_distributed", "shutdown"]


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
    if dist.is_initialized():
        dist.destroy_process_group()
