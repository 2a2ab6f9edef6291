"""Spawned by tests/test_parallel_ep.py: the expert-parallel MoE layer against one process.

Every rank builds the same MoE and the same token batch; one process's forward and backward
of the whole batch is the reference. Under ep, rank r routes only its own (uneven) slice of
the tokens and owns n_experts / ep experts; the outputs of its tokens, the gradients of its
tokens' inputs, the router's gradient (summed over ranks) and its experts' gradients must
equal the reference's.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from training.moe import MoE
from training.parallel.distributed import leave
from training.parallel.expert_parallel import apply_expert_parallel

DIM, HIDDEN, EXPERTS, TOPK = 8, 16, 4, 2
# Rows of the batch each rank routes: deliberately unequal.
SPLITS = (7, 17)


def check(rank: int, world: int, port: int, bias: list[float], result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        reference = MoE(DIM, HIDDEN, EXPERTS, TOPK)
        reference.init_weights(0.02, torch.Generator().manual_seed(1))
        with torch.no_grad():
            reference.expert_bias.copy_(torch.tensor(bias))
        x = torch.randn(sum(SPLITS), DIM, dtype=torch.float64)
        weight = torch.randn(sum(SPLITS), DIM, dtype=torch.float64)
        reference.double()
        moe = copy.deepcopy(reference)

        xr = x.clone().requires_grad_()
        out_ref = reference(xr)
        (out_ref * weight).sum().backward()

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        apply_expert_parallel(moe, mesh, dp=1)  # loss summed, not averaged, over ranks: no division
        lo = sum(SPLITS[:rank])
        mine = slice(lo, lo + SPLITS[rank])
        xe = x[mine].clone().requires_grad_()
        out = moe(xe)
        (out * weight[mine]).sum().backward()

        torch.testing.assert_close(out, out_ref[mine], rtol=0, atol=1e-12)
        torch.testing.assert_close(xe.grad, xr.grad[mine], rtol=0, atol=1e-12)
        router = moe.router.weight.grad.clone()
        dist.all_reduce(router)
        torch.testing.assert_close(router, reference.router.weight.grad, rtol=0, atol=1e-12)
        owned = [int(name.split(".")[1]) for name, _ in moe.named_parameters() if name.startswith("experts.")]
        assert sorted(set(owned)) == list(range(rank * 2, rank * 2 + 2)), owned
        for name, p in moe.experts.named_parameters(prefix="experts"):
            ref = dict(reference.named_parameters())[name]
            if ref.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, ref.grad, rtol=0, atol=1e-12, msg=name)
        # Loads: this rank's routing, summed over ranks, is the whole batch's.
        loads = moe.tokens_per_expert.clone()
        dist.all_reduce(loads)
        torch.testing.assert_close(loads, reference.tokens_per_expert)
        received = sum(1 for _, p in moe.experts.named_parameters() if p.grad is not None)
        with open(f"{result_file}.{rank}", "w") as handle:
            handle.write(f"ok {received}\n")
    finally:
        dist.destroy_process_group()
    leave()  # the group outlives destroy_process_group where DTensor ran: see leave()
