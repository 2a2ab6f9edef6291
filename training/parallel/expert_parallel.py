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
HSDP) exactly as without ep; experts are left out of the blocks' ``fully_shard``: they differ
from rank to rank. Experts with copies are ZeRO-3 sharded over their column instead
(:func:`shard_experts`, torchtitan's ``dp_mod_ep`` FSDP), so a rank holds ``1 / dp`` of the
experts' parameters, gradients and optimizer state, as FSDP gives the rest.

Gradients. Each dp rank backpropagates ``dp × its share`` of the batch loss (see
``batches.local_batch``) and FSDP divides by ``dp``. An expert's gradient is summed on its
rank from the tokens of every rank of its ep group through the all-to-all; without copies a
hook divides it by ``dp`` as it is accumulated, with copies their reduce-scatter sums it over
the column and divides by ``dp``: the single-process gradient either way. A copy whose ep group
routed no token to an expert that another copy's did runs it on no rows (a zero gradient), so
the copies' reduce-scatters match; one no copy routed to keeps ``grad None``, as in one
process. ``Parallel.clip_grad_norm`` adds the experts' squared norms over the ep ranks
(:func:`grad_norm_squared`) to the other parameters'.

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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from assay.errors import AssayError
from training.moe import MoE

__all__ = ["EPDispatch", "LocalExperts", "apply_expert_parallel", "clip_grads_by_kind", "count_parameters", "expert_parameters",
           "grad_norm_squared", "plain_expert_parameters", "shard_experts"]


class LocalExperts(nn.Module):
    """The experts one rank owns, registered under their global indices (``experts.{e}``).

    Called once per MoE forward on every rank, with each local expert's rows: FSDP's hooks on
    this module (:func:`shard_experts`) gather the experts' parameters for that call."""

    def __init__(self, experts: dict[int, nn.Module], n_experts: int, group: dist.ProcessGroup, ep: int,
                 replica_mesh: DeviceMesh | None = None):
        super().__init__()
        self.first = min(experts)
        self.n_local = len(experts)
        self.n_experts = n_experts
        self.group = group  # the ep ranks: every expert once
        self.ep = ep
        self.rank = dist.get_rank(group)  # within the ep group
        self.replica_mesh = replica_mesh  # the ranks holding these same experts (None: only this one)
        self.sharded = False  # FSDP-sharded over replica_mesh (shard_experts)
        for e, expert in sorted(experts.items()):
            self.add_module(str(e), expert)

    def forward(self, grouped: torch.Tensor, rows: list[int], run: list[bool]) -> torch.Tensor:
        """``grouped``: the rows of local expert ``j`` at ``sum(rows[:j]) : sum(rows[:j+1])``;
        expert ``j`` runs when ``run[j]`` (on no rows where ``rows[j]`` is 0: a zero gradient)."""
        outputs, start = [], 0
        for j, (n, go) in enumerate(zip(rows, run)):
            if go:  # an expert that does not run gets no gradient (None), as in one process
                outputs.append(self[self.first + j](grouped[start : start + n]))
            start += n
        # With no rows at all the (empty) input still carries the graph, so that this rank joins
        # the backward all-to-alls like every other rank.
        return torch.cat(outputs) if outputs else grouped

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
    rows = per_source.sum(0)
    moe.ep_dispatch = EPDispatch(source.index_select(0, regroup), rows)
    if experts.replica_mesh is not None and not experts.sharded:
        raise RuntimeError("expert parallel: experts with replicas must be FSDP-sharded over them (shard_experts)")
    # Copies reduce-scatter together: each runs the experts any copy has rows for (shard_experts).
    joined = rows if moe.experts_in_graph is None else moe.experts_in_graph(rows)
    y = experts(grouped, rows.tolist(), (joined > 0).tolist())
    back = torch.empty_like(y).index_copy_(0, regroup, y) if y.shape[0] else y
    returned = all_to_all_single_autograd(back, send_splits, recv_splits, group)

    returned = returned * sorted_gates.unsqueeze(-1).to(returned.dtype)
    out = torch.zeros_like(flat)
    out.index_add_(0, token_ids, returned.to(out.dtype))  # sorted by expert, as one process adds
    return out.reshape(shape)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dp: int) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over ``mesh["ep"]``; returns this rank's expert parameters.

    ``mesh``: ``(ep_replicate, ep)`` (``ParallelDims.ep_mesh``; a 1-D mesh is taken as ``ep``
    alone). ``dp``: the ranks the loss is averaged over (see the module docstring); an expert
    without replicas divides its gradient by it as it is accumulated. Experts with replicas
    (ep < dp) are then FSDP-sharded over them by the data-parallel wrapper (:func:`shard_experts`),
    whose reduce-scatter sums and divides."""
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    replica_mesh = mesh["ep_replicate"] if mesh.ndim > 1 and mesh["ep_replicate"].size() > 1 else None
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
                                   moe.n_experts, group, ep, replica_mesh)
        moe.forward = _ep_forward.__get__(moe)  # this instance only; the class is untouched
        for p in moe.experts.parameters():
            if replica_mesh is None:
                p.register_hook(lambda g, dp=dp: g / dp)
            params.add(p)
    return params


def shard_experts(model: nn.Module, policy: MixedPrecisionPolicy, dp: int, reshard_after_forward: bool = True) -> None:
    """ZeRO-3 for the experts: FSDP2 ``fully_shard`` each layer's local experts over the ranks
    holding the same ones (``ep_replicate``), before the blocks are wrapped (which then leave
    them out). Their gradients are summed over the replicas and divided by ``dp`` (the loss on
    every rank is scaled by dp: the module docstring), with plain sums on the wire (gloo has no
    pre-multiplied sum). The copies' reduce-scatters must carry the same tensors, so each MoE layer
    sums its local row counts over them (``join_experts_routed_in_group``, as FSDP without ep does
    over the world) and a copy runs on no rows an expert that only another copy's group routed to.
    Experts without replicas (ep == dp) stay plain tensors."""
    from training.parallel.data_parallel import join_experts_routed_in_group

    sharded = [local for local in _local_experts(model) if local.replica_mesh is not None]
    for local in sharded:
        fully_shard(local, mesh=local.replica_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        local.set_gradient_divide_factor(float(dp))
        local.set_force_sum_reduction_for_comms(True)
        local.sharded = True
    if sharded:  # every layer's copies are the same ranks: this rank's ep_replicate column
        join_experts_routed_in_group(model, sharded[0].replica_mesh.get_group())


def _local_experts(model: nn.Module) -> list[LocalExperts]:
    return [m for m in model.modules() if isinstance(m, LocalExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """This rank's expert parameters (empty unless :func:`apply_expert_parallel` ran)."""
    return [p for m in _local_experts(model) for p in m.parameters()]


def grad_norm_squared(model: nn.Module) -> torch.Tensor:
    """Squared 2-norm of all experts' gradients: each rank's own experts' (FSDP shards: summed
    over the replicas), summed over the ep group."""
    layers = _local_experts(model)
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # every replica: the same
        total = norm.float().cpu() ** 2
    dist.all_reduce(total, group=layers[0].group)
    return total


def clip_grads_by_kind(parameters: list[nn.Parameter], experts: set[int], max_norm: float,
                       total: torch.Tensor) -> None:
    """Clip to ``total`` in one call per kind of tensor: ``clip_grads_with_norm_`` takes one kind,
    and experts (ids in ``experts``) are plain tensors while the rest are DTensors under FSDP."""
    for part in ([p for p in parameters if id(p) in experts], [p for p in parameters if id(p) not in experts]):
        if part:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)


def plain_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """This rank's expert parameters that no FSDP manages (experts without replicas)."""
    return [p for m in _local_experts(model) if not m.sharded for p in m.parameters()]


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
