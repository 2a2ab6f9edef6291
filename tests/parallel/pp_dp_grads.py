"""Run under torchrun by tests/test_parallel_pp.py: step 1's gradients under DP, TP, EP or CP × PP.

Builds the tiny model exactly as the trainer does, applies the layout (pipeline stages, each
tensor-parallel over its tp sub-mesh and wrapped over its dp sub-mesh), runs step 1 through the
pipeline on this dp rank's rows and writes, from rank 0, the global loss and every parameter's
full gradient (FSDP and tp shards gathered, stages gathered over pp), to be compared with one
process (tests/parallel/grad_worker.py "{}").
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from grad_worker import full_grads, step_one  # the same directory: torchrun runs this file as a script
from training.parallel.distributed import run_rank, shutdown


def main(data: str, run: str, params_file: str, overrides: str, out: str, prime: str = "") -> None:
    _, world, par, model, local = step_one(data, run, params_file, overrides, out)
    assert par.pipelined and (par.dims.dp > 1 or par.dims.tp > 1 or par.dims.cp > 1), par.describe()
    if prime == "prime":
        # Synthetic measurements (time and bytes proportional to positions) before step 1, so that
        # the dynamic scheduler re-plans step 1 whatever this machine's timings (as pp_worker.py).
        from training.parallel.microbatch import Sample

        pipe = par.pipeline
        pipe.scheduler.observe([Sample(s, m, w, 1e-6 * m * w, 2e-6 * m * w, 1e3 * m * w)
                                for s in range(pipe.n_stages) for m, w in [(1, 16), (2, 32), (4, 32)]])
    plan = par.pipeline.plan_for(local.batch)
    # Filler rows this rank's plan adds to fill whole micro-batches (the test asserts some ran).
    fillers = sum(r < 0 for p in plan.passes for mb in p.microbatches for r in mb)
    loss, *_ = par.pipeline.step(local.batch, local.global_tokens)
    loss = par.global_loss(loss, local.batch.n_tokens, local.global_tokens)
    # As the trainer's step does next (max_norm inf: nothing scaled); under ep it first sums each
    # expert's gradient over the ranks holding a copy of it.
    par.clip_grad_norm(model, float("inf"))
    grads = full_grads(model)  # over this stage's dp ranks
    parts = [None] * world.world_size
    dist.all_gather_object(parts, (grads, fillers, [p.shape for p in plan.passes]))
    if world.is_main:
        torch.save({"loss": float(loss), "grads": {k: v for g, _, _ in parts for k, v in g.items()},
                    "fillers": sum(f for _, f, _ in parts), "plans": [shapes for _, _, shapes in parts]}, out)
    shutdown()


if __name__ == "__main__":
    run_rank(lambda: main(*sys.argv[1:]))
