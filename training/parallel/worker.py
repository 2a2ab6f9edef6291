"""The process the launcher starts on every rank: ``python -m training.parallel.worker``.

The launcher is ``training.parallel.local_launch`` on one machine, torchrun across machines;
both give it torchrun's environment.

It trains exactly as ``assay train`` does in one process (``training.trainer.train``),
with params.yaml's ``train.parallel`` overridden by the launcher's flags. No Prefect
here: the launching process owns the flow run, and N ranks must not start N of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from training.checkpoint import latest_checkpoint
from training.parallel.distributed import init_distributed, run_rank
from training.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="training.parallel.worker")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rev")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--allow-data-change", action="store_true")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--device")
    parser.add_argument("--params-file")
    parser.add_argument("--parallel", default="{}", help="JSON overrides of train.parallel")
    args = parser.parse_args(argv)

    params = load_params(args.params_file).train
    overrides = json.loads(args.parallel)
    params = dataclasses.replace(params, parallel=dataclasses.replace(params.parallel, **overrides))
    if args.steps is not None:
        params = dataclasses.replace(params, steps=args.steps)
    world = init_distributed()
    resume, overwrite = args.resume, args.overwrite
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted:
        # The launcher restarted the group after a rank died: continue from the last checkpoint
        # (or start again if the first attempt died before writing one), with no person involved.
        resume = latest_checkpoint(args.out) is not None
        overwrite = not resume
        if world.is_main:
            print(f"elastic restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: "
                  + (f"resuming from {latest_checkpoint(args.out).name}" if resume else "no checkpoint yet, starting again"),
                  file=sys.stderr)
    first_step: list[float] = []

    def report_recovery(record: dict) -> None:
        # The recovery time of an elastic restart ends at its first finished step: say when.
        if restarted and world.is_main and not first_step:
            first_step.append(time.time())
            print(f"elastic restart: first step {record['step']} finished at {first_step[0]:.3f}", file=sys.stderr)

    try:
        version = open_version(args.data, args.rev)
        result = train(version, args.out, params, resume=resume, overwrite=overwrite,
                       allow_data_change=args.allow_data_change, device=args.device, on_step=report_recovery)
        # Every rank past its last collective before any leaves: a rank that ended while a peer
        # still waited on it would break that peer.
        world.barrier()
        if world.is_main:
            print(json.dumps({"steps": result.steps, "final_loss": result.metrics["final_loss"],
                              "parallel": result.metrics.get("parallel")}))
    except AssayError as exc:
        print(f"rank {world.rank}: error: {exc}", file=sys.stderr)
        return 2
    return 0  # run_rank destroys the group, on every path


if __name__ == "__main__":
    run_rank(main)  # not sys.exit: see leave() for the abort a plain exit risks
