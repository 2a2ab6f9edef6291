"""Expert parallelism: each ``ep`` rank keeps ``n_experts / ep`` experts of every MoE layer.

Applied to the plain model after it is built (and initialised as one process would), before
FSDP. For every :class:`training.moe.MoE` layer this module

- drops the experts other ranks own (the kept ones keep their names, ``experts.{e}``, so
  checkpoints are the single process's: DCP writes each expert from its owner rank and a
  run resumes on another layout or in one process);
- replaces the layer's ``forward`` (an instance attribute: the class and the model file stay
  parallelism-free) with route → dispatch → experts → combine:

  1. route this rank's tokens (router and ``expert_bias`` are on every rank);
  2. all-to-all the per-expert counts, so every rank knows how many rows it will receive
     from each rank for each of its experts;
  3. ``all_to_all_single_autograd`` the routed rows, sorted by expert, with uneven splits;
  4. run each local expert on its rows (grouped by expert across source ranks);
  5. the same all-to-all in reverse brings the outputs home; gating and the ``index_add_``
     into the output happen on the token's own rank, in the single process's order.

Where experts live (``ParallelDims.ep_mesh``): the dp ranks are split into a 2-D mesh
``(ep_replicate, ep)``; the ``ep`` ranks of a row hold every expert once, and the
``ep_replicate`` ranks of a column hold the same experts (``dp / ep`` copies; 1 when
``ep == dp_shard`` without dp_replicate). The other parameters stay data parallel (FSDP /
HSDP) exactly as without ep; experts are left out of ``fully_shard`` (``ignored_params``):
they differ from rank to rank.

Gradients. Each dp rank backpropagates ``dp × its share`` of the batch loss (see
``batches.local_batch``) and FSDP divides by ``dp``. An expert's gradient is summed on its
rank from the tokens of every rank of its ep group through the all-to-all, so a hook divides
it by ``dp`` as it is accumulated, and :func:`reduce_expert_grads` sums it over the
replicas: the single-process gradient. ``Parallel.clip_grad_norm`` calls that reduction
first (it runs once after every backward), then adds the experts' squared norms over the
ep ranks (:func:`grad_norm_squared`) to the FSDP parameters'.

Balancing stays exact: ``tokens_per_expert`` counts this rank's routing for all experts
(global indices); ``Parallel.sum_moe_loads`` all-reduces it over the world before
``update_bias``, which is then the same on every rank.

Layouts: ep divides dp_shard (``ParallelDims``), with FSDP or HSDP, and under pp the dp ranks
of each pipeline stage hold its layers' experts (``training.parallel.pipeline``); tp and cp
together with ep are refused.

Per-document ghost gradient norms stay exact: an expert's gradient for a document is built
from that document's tokens routed to it, which are all on the expert's rank, so that rank
computes the document's squared norm for the expert and ``training.grad_norms`` sends it home
(an all-reduce over the ep group). For that the forward also sends, with each routed row, where
it came from (:class:`EPDispatch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from assay.errors import AssayError
from training.moe import MoE

__all__ = ["EPDispatch", "LocalExperts", "apply_expert_parallel", "clip_grads_by_kind", "count_parameters", "expert_parameters",
           "grad_norm_squared", "reduce_expert_grads"]


class LocalExperts(nn.Module):
    """The experts one rank owns, registered under their global indices (``experts.{e}``)."""

    def __init__(self, experts: dict[int, nn.Module], n_experts: int, group: dist.ProcessGroup, ep: int,
                 replica_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.first = min(experts)
        self.n_local = len(experts)
        self.n_experts = n_experts
        self.group = group  # the ep ranks: every expert once
        self.ep = ep
        self.rank = dist.get_rank(group)  # within the ep group
        self.replica_group = replica_group  # the ranks holding these same experts (None: only this one)
        for e, expert in sorted(experts.items()):
            self.add_module(str(e), expert)

    def __getitem__(self, e: int) -> nn.Module:
        return self._modules[str(e)]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return self.n_local


@dataclass
class EPDispatch:
    """Which tokens this rank's experts got in the most recent forward, for ``training.grad_norms``:
    local expert ``j`` ran on rows ``sum(counts[:j]) : sum(counts[:j + 1])`` of its input, and
    ``source[i] = (ep rank, flat position b * N + n)`` is where row ``i`` of those came from."""

    source: torch.Tensor  # (rows, 2) long, grouped by local expert like the experts' input
    counts: torch.Tensor  # (n_local,) long


def _ep_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    experts: LocalExperts = moe.experts
    ep, n_local, group = experts.ep, experts.n_local, experts.group
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    topk_idx, gates, _ = moe.route(flat)

    counts = torch.bincount(topk_idx.reshape(-1), minlength=moe.n_experts)
    with torch.no_grad():
        moe.tokens_per_expert.add_(counts.to(moe.tokens_per_expert.dtype))
    moe.last_tokens_per_expert = counts.detach()
    # last_dispatch maps expert rows to this rank's tokens; here experts see other ranks' tokens
    # too, so there is none, and ep_dispatch (below) says where each row came from instead.
    moe.last_dispatch = None

    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    token_ids = torch.div(order, moe.topk, rounding_mode="floor")
    sorted_gates = gates.reshape(-1).index_select(0, order)
    moe.last_routing = (token_ids, counts)

    # recv_counts[s * n_local + j]: rows rank s sends to my local expert j.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    per_source = recv_counts.view(ep, n_local)
    recv_splits = per_source.sum(1).tolist()

    received = all_to_all_single_autograd(flat.index_select(0, token_ids), recv_splits, send_splits, group)
    # Received rows come by source rank, then expert; regroup them by expert (stable: source order).
    local_expert = torch.arange(n_local, device=flat.device).repeat(ep).repeat_interleave(per_source.reshape(-1))
    regroup = torch.argsort(local_expert, stable=True)
    grouped = received.index_select(0, regroup)
    # Where each received row came from, for ghost norms. Sent whether or not they run (a few
    # int64 per row), so no rank ever skips a collective its peers run.
    origin = torch.stack([torch.full_like(token_ids, experts.rank), token_ids], 1)
    source = origin.new_empty(received.shape[0], 2)
    dist.all_to_all_single(source, origin, recv_splits, send_splits, group=group)
    moe.ep_dispatch = EPDispatch(source.index_select(0, regroup), per_source.sum(0))
    outputs, start = [], 0
    for j, n in enumerate(per_source.sum(0).tolist()):
        if n:  # an expert without tokens gets no gradient (None), as in one process
            outputs.append(experts[experts.first + j](grouped[start : start + n]))
        start += n
    # With no rows at all the (empty) input still carries the graph, so that this rank joins
    # the backward all-to-alls like every other rank.
    y = torch.cat(outputs) if outputs else grouped
    back = torch.empty_like(y).index_copy_(0, regroup, y) if y.shape[0] else y
    returned = all_to_all_single_autograd(back, send_splits, recv_splits, group)

    returned = returned * sorted_gates.unsqueeze(-1).to(returned.dtype)
    out = torch.zeros_like(flat)
    out.index_add_(0, token_ids, returned.to(out.dtype))  # sorted by expert, as one process adds
    return out.reshape(shape)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dp: int) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over ``mesh["ep"]``; returns this rank's expert parameters.

    ``mesh``: ``(ep_replicate, ep)`` (``ParallelDims.ep_mesh``; a 1-D mesh is taken as ``ep``
    alone). ``dp``: the ranks the loss is averaged over (see the module docstring); expert
    gradients are divided by it as they are accumulated."""
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    replica_group = mesh["ep_replicate"].get_group() if mesh.ndim > 1 and mesh["ep_replicate"].size() > 1 else None
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise AssayError("parallel: ep > 1 needs an MoE model (train.model.ffn: moe)")
    params: set[nn.Parameter] = set()
    for moe in moes:
        if moe.n_experts % ep:
            raise AssayError(f"parallel: ep={ep} must divide n_experts={moe.n_experts} "
                             "(every rank owns the same number of experts)")
        n_local = moe.n_experts // ep
        first = rank * n_local
        moe.experts = LocalExperts({e: moe.experts[e] for e in range(first, first + n_local)},
                                   moe.n_experts, group, ep, replica_group)
        moe.forward = _ep_forward.__get__(moe)  # this instance only; the class is untouched
        for p in moe.experts.parameters():
            p.register_hook(lambda g, dp=dp: g / dp)
            params.add(p)
    return params


def _local_experts(model: nn.Module) -> list[LocalExperts]:
    return [m for m in model.modules() if isinstance(m, LocalExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """This rank's expert parameters (empty unless :func:`apply_expert_parallel` ran)."""
    return [p for m in _local_experts(model) for p in m.parameters()]


def reduce_expert_grads(model: nn.Module) -> None:
    """Sum the expert gradients over the ranks holding the same experts (``ep_replicate``), as
    DDP would (the hook already divided by dp). An expert no replica routed a token to keeps
    ``grad None`` (AdamW skips it, as in one process); one routed on some replicas only gets
    zeros on the others before the sum."""
    layers = [m for m in _local_experts(model) if m.replica_group is not None]
    if not layers:
        return
    group = layers[0].replica_group
    params = [p for m in layers for p in m.parameters()]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(has, group=group)
    params = [p for p, h in zip(params, has.tolist()) if h]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def grad_norm_squared(model: nn.Module) -> torch.Tensor:
    """Squared 2-norm of all experts' gradients (after :func:`reduce_expert_grads`): each rank's
    own experts', summed over the ep group."""
    layers = _local_experts(model)
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    if grads:
        total = torch.nn.utils.get_total_norm(grads, 2.0).float().cpu() ** 2
    dist.all_reduce(total, group=layers[0].group)
    return total


def clip_grads_by_kind(parameters: list[nn.Parameter], experts: set[int], max_norm: float,
                       total: torch.Tensor) -> None:
    """Clip to ``total`` in one call per kind of tensor: ``clip_grads_with_norm_`` takes one kind,
    and experts (ids in ``experts``) are plain tensors while the rest are DTensors under FSDP."""
    for part in ([p for p in parameters if id(p) in experts], [p for p in parameters if id(p) not in experts]):
        if part:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)


def count_parameters(model: nn.Module) -> int:
    """The whole model's parameter count: FSDP's DTensors count globally, experts once per expert."""
    experts = expert_parameters(model)
    mine = {id(p) for p in experts}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in mine)
    if not experts:
        return rest
    local = torch.tensor(sum(p.numel() for p in experts), dtype=torch.int64)
    dist.all_reduce(local, group=_local_experts(model)[0].group)
    return rest + int(local)
