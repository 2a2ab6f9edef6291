"""Spawned by tests/test_parallel_ep.py: expert parallel with copies of each expert (ep < dp), the
copies FSDP-sharded over ``ep_replicate`` (``expert_parallel.shard_experts``).

Four ranks, ep 2: ranks 0 and 1 hold every expert once between them, ranks 2 and 3 the same
experts again (ranks 1 and 3 hold experts 2 and 3). Every rank builds the same MoE (float64)
and the same token pool. Only rank 0's tokens reach expert 3, so rank 1 runs it on rows from
rank 0 while its copy on rank 3 gets none from its own ep group; no token reaches expert 2
(its selection bias is -10). One process's forward and backward of all four ranks' tokens is
the reference. The copies' reduce-scatter needs the same experts to hold a gradient on both:
rank 3 runs expert 3 on no rows. Checked: every rank's output, every gradient (gathered from
its shards) against the reference's, expert 2's None on both copies, and that each rank keeps
a quarter of the experts' parameters.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel.moe_fsdp_routing import DIM, ONE_RANK, SILENT, Layer, loss_weights, reference_moe
from training.moe import MoE
from training.parallel.distributed import leave
from training.parallel.expert_parallel import apply_expert_parallel, plain_expert_parameters, shard_experts

WORLD, EP = 4, 2


def _tokens(moe: MoE) -> list[torch.Tensor]:
    """Rank 0's tokens (4 of them routed to ONE_RANK) and ranks 1-3's (none routed to it)."""
    pool = torch.randn(400, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        chosen, _, _ = moe.route(pool)
    reaches = (chosen == ONE_RANK).any(1)
    assert not (chosen == SILENT).any()
    rest = pool[~reaches]
    return [torch.cat([pool[reaches][:4], rest[:4]]), rest[4:10], rest[10:15], rest[15:22]]


def check(rank: int, world: int, port: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A broken join leaves one copy waiting in a reduce-scatter its peer never starts: fail in a
    # minute, not gloo's default half hour.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        reference = reference_moe()
        parts = _tokens(reference)
        weights = loss_weights(parts)
        (reference(torch.cat(parts)) * torch.cat(weights)).sum().backward()

        model = Layer(copy.deepcopy(reference))
        ep_mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("ep_replicate", "ep"))
        apply_expert_parallel(model, ep_mesh, dp=world)
        shard_experts(model, MixedPrecisionPolicy(), dp=world)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
                    ignored_params=set(plain_expert_parameters(model)) or None)
        out = model(parts[rank])
        # FSDP averages over the ranks; the reference sums: scale each rank's loss by world.
        ((out * weights[rank]).sum() * world).backward()

        torch.testing.assert_close(out, reference(parts[rank]).detach(), rtol=0, atol=1e-12)
        expected = dict(reference.named_parameters())
        mine = 0  # this rank's share of its experts' parameters
        for name, p in model.moe.named_parameters():
            ref = expected[name]
            if name.startswith("experts."):
                mine += p.to_local().numel()
            if ref.grad is None:
                assert p.grad is None, name
                assert name.startswith(f"experts.{SILENT}."), name
            else:
                torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=0, atol=1e-12, msg=name)
        experts_total = sum(p.numel() for n, p in reference.named_parameters() if n.startswith("experts."))
        assert mine == experts_total // world, (mine, experts_total)
        with open(f"{result_file}.{rank}", "w") as handle:
            handle.write("ok\n")
    finally:
        dist.destroy_process_group()
    leave()  # the group outlives destroy_process_group where DTensor ran: see leave()
