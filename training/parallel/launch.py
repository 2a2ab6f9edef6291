"""``assay train --nproc N``: the command that runs the trainer on N ranks.

One machine: ``training.parallel.local_launch``, which keeps every socket on 127.0.0.1
(``torchrun --standalone``'s stores listen on every interface). Several: torchrun with
the usual rendezvous flags (``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``), run on
every node. Each rank
gets one CPU thread unless OMP_NUM_THREADS is set: N ranks of the default (all
cores each) on a 2-core machine thrash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

__all__ = ["Launch", "launch"]


@dataclass
class Launch:
    nproc: int
    nnodes: str = "1"  # "2" or "MIN:MAX" for elastic membership
    rdzv_endpoint: str | None = None  # host:port; None = standalone (one machine)
    rdzv_id: str = "assay"
    max_restarts: int = 0
    #: Overrides of params.yaml's train.parallel (dp_replicate, dp_shard, …, zero1).
    parallel: dict = field(default_factory=dict)

    def command(self, worker_args: list[str]) -> list[str]:
        rank = ["-m", "training.parallel.worker", "--parallel", json.dumps(self.parallel), *worker_args]
        if self.rdzv_endpoint is None:
            if self.nnodes != "1":
                raise ValueError("--nnodes > 1 needs --rdzv-endpoint host:port (the same on every node)")
            return [sys.executable, "-m", "training.parallel.local_launch", f"--nproc={self.nproc}",
                    f"--max-restarts={self.max_restarts}", "--", *rank]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc}",
                f"--max-restarts={self.max_restarts}", f"--nnodes={self.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}", *rank]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env


def launch(spec: Launch, worker_args: list[str]) -> int:
    """Run the launcher in the foreground, its output streamed; returns its exit code."""
    return subprocess.run(spec.command(worker_args), env=spec.environment(), check=False).returncode
