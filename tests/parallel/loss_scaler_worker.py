"""Two ranks, and an overflow in a gradient only rank 1 holds: what each rank's loss scaler does.

    torchrun --nproc-per-node 2 tests/parallel/loss_scaler_worker.py OUT.json [agreed|torch] [mixed|plain]

Each rank's optimizer holds a per-rank parameter (like an expert's: plain, different on every rank),
and with `mixed` also an FSDP-style parameter sharded over both ranks (a DTensor). Every gradient is
finite except one element of rank 1's own parameter. Rank 0 writes every rank's scale after the
update and whether its parameters moved (`training.parallel.loss_scaling.AgreedGradScaler`
against torch's `GradScaler`).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from training.parallel.distributed import run_rank
from training.parallel.loss_scaling import AgreedGradScaler


def main(out: str, which: str, kinds: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    own = torch.nn.Parameter(torch.ones(3))
    params = [own]
    if kinds == "mixed":
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        sharded.grad = distribute_tensor(torch.full((4, 2), 1024.0), mesh, [Shard(0)])
        params.append(sharded)
    grad = torch.full((3,), 1024.0)
    if rank == 1:
        grad[0] = float("inf")
    own.grad = grad
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    if which == "agreed":
        scaler = AgreedGradScaler("cpu", init_scale=1024.0, enabled=True)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=True)
    scaler.scale(torch.ones(()))  # creates the scale, as the trainer does before its first step
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(b.full_tensor() if hasattr(b, "full_tensor") else b,
                                p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach())
                for b, p in zip(before, params))
    mine = {"rank": rank, "scale": scaler.get_scale(), "stepped": moved}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(every, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(lambda: main(*sys.argv[1:4]))
