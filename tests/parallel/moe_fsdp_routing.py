"""Spawned by tests/test_parallel_ep.py: a MoE layer under FSDP2 when the ranks' tokens reach
different experts.

Every rank builds the same MoE (float64) and the same token pool. Rank 0's tokens reach expert
3; rank 1's never do; no token reaches expert 2 (its selection bias is -10, beyond any
sigmoid score). One process's forward and backward of both ranks' tokens is the reference.
FSDP2 reduce-scatters the gradients a block holds on each rank: without
``join_experts_routed_in_group`` rank 1 holds no gradient for expert 3 and the collective's
sizes differ (gloo aborts). With it, the gathered gradients equal the reference's, and expert
2's stay None on both, as in one process.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from training.moe import MoE
from training.parallel.data_parallel import join_experts_routed_in_group
from training.parallel.distributed import leave

DIM, HIDDEN, EXPERTS, TOPK = 8, 16, 4, 2
SILENT, ONE_RANK = 2, 3  # no token reaches expert 2; only rank 0's reach expert 3


class Layer(nn.Module):
    """The smallest model with ``moe_layers()``, the interface the parallel code reads."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def moe_layers(self) -> list[MoE]:
        return [self.moe]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _tokens(moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's 12 tokens (some routed to ONE_RANK) and rank 1's 9 (none routed to it)."""
    pool = torch.randn(400, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        chosen, _, _ = moe.route(pool)
    reaches = (chosen == ONE_RANK).any(1)
    assert not (chosen == SILENT).any()
    rank0 = torch.cat([pool[reaches][:4], pool[~reaches][:8]])
    return rank0, pool[~reaches][8:17]


def reference_moe() -> MoE:
    """The float64 MoE every rank builds alike; its selection bias keeps every token off SILENT."""
    reference = MoE(DIM, HIDDEN, EXPERTS, TOPK)
    reference.init_weights(0.5, torch.Generator().manual_seed(1))
    reference.double()
    with torch.no_grad():
        reference.expert_bias[SILENT] = -10.0
    return reference


def loss_weights(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed random weights for each rank's outputs: the loss is ``sum(out * weight)``."""
    return [torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3 + i))
            for i, p in enumerate(parts)]


def check(rank: int, world: int, port: int, join: bool, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reference = reference_moe()
        parts = _tokens(reference)
        weights = loss_weights(list(parts))
        model = Layer(copy.deepcopy(reference))

        out_ref = reference(torch.cat(parts))
        (out_ref * torch.cat(weights)).sum().backward()

        if join:
            join_experts_routed_in_group(model, None)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
        out = model(parts[rank])
        # FSDP averages over the ranks; the reference sums: scale each rank's loss by world.
        ((out * weights[rank]).sum() * world).backward()

        torch.testing.assert_close(out, reference(parts[rank]).detach(), rtol=0, atol=1e-12)
        expected = dict(reference.named_parameters())
        for name, p in model.moe.named_parameters():
            ref = expected[name]
            if ref.grad is None:
                assert p.grad is None, name
                assert name.startswith(f"experts.{SILENT}."), name
            else:
                torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=0, atol=1e-12, msg=name)
        with open(f"{result_file}.{rank}", "w") as handle:
            handle.write("ok\n")
    finally:
        dist.destroy_process_group()
    leave()  # the group outlives destroy_process_group where DTensor ran: see leave()
