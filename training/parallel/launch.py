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

__all__ = ["LOCAL_GRACE_S", "Launch", "launch"]

#: How long local_launch gives a stopped rank to exit on SIGTERM before SIGKILL. Defined here, not
#: there, so that this module knows it without importing torch (local_launch does).
LOCAL_GRACE_S = 10.0
_STOP_MARGIN_S = 5.0  # for the launcher's own exit once its ranks are gone


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

    def stop_grace_s(self) -> float:
        """How long the launcher may take to stop its ranks on SIGTERM before it is SIGKILLed:
        its own grace for the ranks plus a margin for its own exit."""
        if self.rdzv_endpoint is None:
            return LOCAL_GRACE_S + _STOP_MARGIN_S
        try:  # torchrun's --shutdown-timeout, which we do not pass; 30 s unless the environment says
            grace = float(self.environment().get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        except ValueError:
            grace = 30.0
        return grace + _STOP_MARGIN_S


def launch(spec: Launch, worker_args: list[str]) -> int:
    """Run the launcher in the foreground, its output streamed; returns its exit code.

    When anything interrupts the wait (Ctrl-C, or the exception Prefect raises on SIGTERM),
    the launcher is asked to stop its ranks before the exception goes on.
    """
    proc = subprocess.Popen(spec.command(worker_args), env=spec.environment())
    try:
        return proc.wait()
    except BaseException:
        # Not subprocess.run: its cleanup SIGKILLs the launcher at once, and a launcher killed so
        # never stops its ranks, which then went on training (and writing checkpoints) under PID 1.
        _stop_launcher(proc, spec.stop_grace_s())
        raise


def _stop_launcher(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (both launchers stop every rank on it), then SIGKILL after `grace_s`."""
    try:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    finally:  # a second Ctrl-C while waiting lands here too: it means now
        if proc.poll() is None:
            proc.kill()
            proc.wait()
