"""Pipeline parallel: the plain model split into stages, run by ``torch.distributed.pipelining``.

The split is torchtitan's manual one over the model's fixed names: a stage keeps the
blocks ``layers.{i}`` of its range (a ModuleDict, so names keep their index), the first
stage keeps ``tok_embeddings``, the last ``norm`` and ``output``; the rest are deleted or
set to None. The trainer's ``model`` is pruned in place to what this rank holds, so the
optimizer, checkpoints (DCP, by the unchanged fully qualified names: a pp run resumes on
one process and back) and MoE bias updates see exactly this rank's parameters. Each stage
is a shallow shell of the pruned model that shares its modules.

Schedules by name (``train.parallel.pp_schedule``): GPipe and 1F1B hold one stage per
rank; Interleaved1F1B, InterleavedZeroBubble (looped: rank r holds stages r, r + pp) and
ZBVZeroBubble, DualPipeV (a "V": rank r holds r and 2·pp - 1 - r) hold two.

Exactness. Rows are documents' rows of unequal length with a loss mask, so a micro-batch's
loss is its token-loss *sum* over the step's global token count, and the schedule does not
rescale gradients (``scale_grads=False``): their sum over micro-batches is the
single-process batch mean's gradient, whatever the micro-batches hold. Per-document loss
sums and token counts are added up on the last stage; per-document gradient norms
(training.grad_norms.MicroBatchNorms, hooked into each stage's forward) add their squares over
the stages. Stages are given their input and
output shapes (static metadata), so torch runs no shape-inference forward: that would
add phantom tokens to MoE routing counts.

DP × PP (torchtitan's): the mesh orders pp outermost, so each pp group is one dp coordinate;
every block and then each stage's module is wrapped over the dp sub-mesh (FSDP2 over dp_shard,
FSDP-style ``replicate`` over dp_replicate, HSDP over both), each dp rank pipelines its own documents' rows, and
each micro-batch's loss is dp × its token-loss sum over the whole step's token count (the
wrappers average over dp). All six schedules, static or dynamic micro-batches (the dp ranks of a
stage plan together), dense, sparse-attention and MoE models.

EP × PP: the dp ranks of each stage hold its MoE layers' experts, ep of them every expert once
(``ParallelDims.ep_mesh`` splits each stage's dp ranks); a micro-batch's MoE forward exchanges
routed tokens with the stage's ep ranks (all-to-all), which run the same schedule and so meet
at the same micro-batch. Experts are left out of the stage's FSDP; those with copies are FSDP-sharded
over them (``expert_parallel.shard_experts``). ``clip_grad_norm`` adds the experts' squares over
the ep ranks, then over the stages.

CP × PP: each cp rank of a stage holds ``width / cp`` positions of every row (zig-zag for ring
attention, contiguous for sparse attention, ``context_parallel``), so a training pass is that
wide and that is what stages send and receive; attention exchanges keys within the stage's cp
group. The cp ranks hold the same parameters, so they join the dp ranks in the wrappers (DDP
over cp, FSDP over dp_shard × cp) and a micro-batch's loss is dp·cp times its share. The loss,
MoE counts and per-document losses add over the stage's dp × cp ranks (``batch_group``; the
documents' over cp). Evaluation runs in eval mode, where cp's kernels take whole rows. Static
micro-batches only: a cp rank's positions are spread over the row, which the dynamic plans'
trimming to a row's start cannot describe.

TP × PP (torchtitan's): after the split, the tensor + sequence parallel plan is applied to the
pruned model over the tp sub-mesh (the mesh is ``pp, dp…, tp``: each pp group has one tp
coordinate, so a stage's P2P peers hold the same shards). The residual stream stays a plain
local tensor split along the sequence, so a stage sends and receives (rows, width / tp, dim);
the stages' static shapes say so. With FSDP too (FSDP × TP × PP) FSDP2 shards the tp shards
over dp_shard, as without pp. Static micro-batches only (their width is the whole row).

Micro-batches: each pass of a plan (training.parallel.microbatch) is one ``schedule.step``
of equal-shape micro-batches; a stage set (recv buffers of one size) is built per pass
shape and cached. Every stage times its forward and backward per micro-batch and counts
the bytes autograd saved for backward; the dynamic scheduler plans the next step from them.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from assay.errors import AssayError
from training.data import Batch
from training.grad_norms import MicroBatchNorms, token_losses
from training.moe import MoE
from training.parallel.microbatch import MicroBatchScheduler, Pass, Plan, Sample, static_plan

__all__ = ["SCHEDULES", "Pipeline", "StepStats", "check_pipeline_layout", "split_layers",
           "split_model", "stage_ids", "valid_microbatches"]

#: name -> (schedule class, stages per rank, stage placement). All six run on gloo with
#: torch 2.13 (tests/test_parallel_pp.py runs each at pp=2).
SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2, "v"),
    "DualPipeV": (ScheduleDualPipeV, 2, "v"),
}


def stage_ids(schedule: str, pp: int, rank: int) -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds under ``schedule``."""
    _, v, style = _schedule(schedule)
    if style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(v)]


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one (earlier stages
    take the extra: the last stage also runs the vocabulary projection)."""
    if n_layers < n_stages:
        raise AssayError(f"parallel: {n_stages} pipeline stages need at least {n_stages} layers, "
                         f"the model has {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def valid_microbatches(schedule: str, n_microbatches: int, pp: int) -> bool:
    """What torch's schedule constructors accept (checked there too, with their own message)."""
    _, v, _ = _schedule(schedule)
    if n_microbatches < 1:
        return False
    if schedule == "1F1B" or schedule == "DualPipeV":
        return n_microbatches >= pp * v
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        return n_microbatches % rounds == 0
    return True


def _schedule(name: str):
    if name not in SCHEDULES:
        raise AssayError(f"parallel: pp_schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


# ------------------------------------------------------------------ the split
def _prune(model: nn.Module, keep: list[int], first: bool, last: bool) -> None:
    """In place: keep only blocks ``keep`` and, where this rank holds them, the ends."""
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None


def _shell(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """A module that runs ``model``'s forward over one stage's part, sharing its modules."""
    shell = object.__new__(type(model))
    # Its own hook dicts and composable-API state: data parallelism wraps each shell apart
    # (its FSDP hooks must not fire on the model or on this rank's other stage).
    shell.__dict__ = {k: (copy.copy(v) if isinstance(v, (dict, set)) else v) for k, v in model.__dict__.items()}
    shell._modules = dict(model._modules)
    shell._parameters = dict(model._parameters)
    shell._buffers = dict(model._buffers)
    shell.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    shell.tok_embeddings = model.tok_embeddings if first else None
    shell.norm = model.norm if last else None
    shell.output = model.output if last else None
    return shell


def split_model(model: nn.Module, schedule: str, pp: int, rank: int) -> dict[int, nn.Module]:
    """Prune ``model`` in place to what rank ``rank`` of ``pp`` holds under ``schedule``; returns
    its stages (stage index -> module sharing the pruned model's parameters)."""
    n_stages = pp * _schedule(schedule)[1]
    ranges = split_layers(model.args.n_layers, n_stages)
    local = stage_ids(schedule, pp, rank)
    _prune(model, sorted(i for s in local for i in ranges[s]), 0 in local, n_stages - 1 in local)
    return {s: _shell(model, ranges[s], s == 0, s == n_stages - 1) for s in local}


# --------------------------------------------------------------- measurement
@dataclass
class _Live:
    """Bytes saved for backward and not yet released, on this rank (all its stages)."""

    now: float = 0.0
    peak: float = 0.0

    def add(self, nbytes: float) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The memory ``t`` holds. tp: a DTensor (and the async collective result inside one) is a
    wrapper without storage of its own; its innermost plain tensor holds the bytes."""
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t.untyped_storage()


def _held(model: nn.Module) -> set[int]:
    """The storages of the parameters and buffers this rank holds (DTensors: their local shards):
    what the activation meter does not count as saved bytes."""
    return {_storage(t).data_ptr() for t in [*model.parameters(), *model.buffers()]}


class _MeteredStage(PipelineStage):
    """A PipelineStage that times each micro-batch's forward and backward and counts the
    bytes autograd saves for its backward (parameters and buffers excluded)."""

    def __init__(self, *args, live: _Live, own: set[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.live, self.own = live, own
        self.forward_s: dict[int, float] = {}
        self.backward_s: dict[int, float] = {}
        self.saved: dict[int, float] = {}
        self.last_chunk = 0
        #: Per micro-batch of the current pass, which of its rows are fillers (only those with some).
        self.filler_rows: dict[int, torch.Tensor] = {}
        #: The step's per-document gradient norms (training.grad_norms.MicroBatchNorms), when measured.
        self.norms = None

    def reset_meter(self) -> None:
        self.forward_s, self.backward_s, self.saved = {}, {}, {}

    def counting(self, chunk: int):
        """Saved-tensor hooks adding what autograd saves to micro-batch ``chunk``'s bytes."""
        seen: set[int] = set()

        def pack(t: torch.Tensor):
            storage = _storage(t)
            ptr = storage.data_ptr()
            if ptr not in self.own and ptr not in seen:
                seen.add(ptr)
                if self.has_backward:
                    self.saved[chunk] = self.saved.get(chunk, 0.0) + storage.nbytes()
                    self.live.add(storage.nbytes())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        with self.counting(fwd_chunk_id), \
                (self.norms.forward_of(fwd_chunk_id) if self.norms is not None else contextlib.nullcontext()):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if fwd_chunk_id in self.filler_rows:
            _uncount_fillers(self.submod, self.filler_rows[fwd_chunk_id])
        self.forward_s[fwd_chunk_id] = time.perf_counter() - start
        self.last_chunk = fwd_chunk_id
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.backward_s[bwd_chunk_id] = self.backward_s.get(bwd_chunk_id, 0.0) + time.perf_counter() - start
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        if full:
            self.live.add(-self.saved.get(bwd_chunk_id, 0.0))
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.backward_s[bwd_chunk_id] = self.backward_s.get(bwd_chunk_id, 0.0) + time.perf_counter() - start
        self.live.add(-self.saved.get(bwd_chunk_id, 0.0))
        return out


def _keep_earlier_grads(earlier: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Put back the gradients earlier passes of the step left, where the pass just run dropped
    them: torch's schedules clear FSDP-managed gradients when they first run a stage set
    (``_post_metadata_inference_cleanup``, with static metadata too), so a pass whose shape is new
    would lose them (measured: step 1's gradients at 11-31% of their norm). FSDP adds a pass's
    reduced gradient into the one it finds in place, so a gradient that is still the same object
    already holds the sum."""
    for param, grad in earlier:
        if param.grad is not grad:
            if param.grad is not None:
                grad.add_(param.grad)
            param.grad = grad


def _filler_rows(p: Pass) -> dict[int, torch.Tensor]:
    """Micro-batch index -> which of its rows are fillers, for the micro-batches with some."""
    return {i: torch.tensor([r < 0 for r in mb]) for i, mb in enumerate(p.microbatches) if min(mb) < 0}


def _uncount_fillers(module: nn.Module, filler: torch.Tensor) -> None:
    """Take the filler rows' tokens back out of the routing counts of the MoE layers in
    ``module``, whose last forward was this micro-batch's: one process never sees those rows,
    and the balancing bias moves by the counts. ``filler``: (rows,) bool."""
    for moe in (m for m in module.modules() if isinstance(m, MoE)):
        token_ids, counts = moe.last_routing  # this rank's tokens, wherever their experts ran (ep)
        width = int(counts.sum()) // moe.topk // len(filler)
        is_filler = filler.to(token_ids.device).repeat_interleave(width)
        expert = torch.repeat_interleave(torch.arange(moe.n_experts, device=counts.device), counts)
        drop = torch.bincount(expert[is_filler[token_ids]], minlength=moe.n_experts)
        with torch.no_grad():
            moe.tokens_per_expert.sub_(drop.to(moe.tokens_per_expert.dtype))
        moe.last_tokens_per_expert = counts - drop


def _flat(mesh, names: list[str]):
    """The sub-mesh of ``names`` as one dimension. Flattening is idempotent in torch: the same name
    over the same ranks returns the mesh made before ("dp" is made with the world mesh)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("dp" if names == ["dp_replicate", "dp_shard"] else "_".join(names))


@dataclass
class StepStats:
    """One step, measured on every rank and gathered: what the benchmark and the scheduler read."""

    wall_s: float = 0.0  # the slowest rank's time in the pipeline passes
    busy_s: list[float] = field(default_factory=list)  # per rank: forward + backward + loss
    peak_activation_bytes: float = 0.0  # largest over ranks
    padded_tokens: int = 0  # computed positions, filler and padding included
    plan: tuple = ()  # pass shapes (M, m, width)

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks' pipeline time (mean over ranks)."""
        if not self.busy_s or self.wall_s <= 0:
            return 0.0
        return float(np.mean([1 - b / self.wall_s for b in self.busy_s]))


# ------------------------------------------------------------------ the runner
class Pipeline:
    """This rank's stages and the step that runs them; built by :meth:`Pipeline.build`."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, schedule: str, n_microbatches: int,
                 dynamic: bool, device: torch.device, seq_len: int, memory_cap_bytes: float | None = None,
                 cache_size: int = 16):
        cls, v, _ = _schedule(schedule)
        self.group, self.pp = group, dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.schedule_name, self.schedule_cls = schedule, cls
        self.n_stages = self.pp * v
        self.stage_rank = [0] * self.n_stages
        for r in range(self.pp):
            for s in stage_ids(schedule, self.pp, r):
                self.stage_rank[s] = r
        self.last_rank = self.stage_rank[-1]
        self.first_rank = self.stage_rank[0]
        self.local = stage_ids(schedule, self.pp, self.rank)
        args = model.args
        self.modules = split_model(model, schedule, self.pp, self.rank)
        self.model = model
        self.device, self.seq_len, self.dim, self.vocab = device, seq_len, args.dim, args.vocab_size
        # Trimmed widths drop columns that sparse attention's block layout (seq_len a multiple
        # of the block) assumes and that MoE's routing counts include in one process (padding
        # positions route too): only a dense model runs narrow passes. Filler rows suit every
        # model: rows never interact in attention (sparse included: its block selection is per
        # row), and their MoE routing counts are taken back out (_uncount_fillers).
        self.trim = args.attention == "dense" and args.ffn == "dense"
        if not valid_microbatches(schedule, n_microbatches, self.pp):
            raise AssayError(f"parallel: pp_schedule {schedule} cannot run {n_microbatches} micro-batches "
                             f"on pp={self.pp} (1F1B needs at least pp, DualPipeV 2·pp, the interleaved "
                             "ones a multiple of their rounds)")
        self.n_microbatches = n_microbatches
        self.dynamic = dynamic
        self.scheduler = MicroBatchScheduler(
            schedule, self.pp, self.stage_rank, seq_len, memory_cap=memory_cap_bytes, trim=self.trim,
            valid_microbatches=lambda m: valid_microbatches(schedule, m, self.pp))
        self.live = _Live()
        self.own = _held(model)
        self._cache: OrderedDict[tuple, tuple[list[_MeteredStage], object]] = OrderedDict()
        self._cache_size = cache_size
        self._dtypes: dict[bool, tuple[torch.dtype, torch.dtype]] = {}
        self.last: StepStats | None = None
        self._acc: dict[str, torch.Tensor] = {}
        # DP × PP (apply_data_parallel): dp ranks whose gradients the wrappers average, and the
        # group over which a stage's parameters are sharded (their squared norms add over it).
        self.dp, self.shard_group, self.dp_group = 1, None, None
        # ... and with cp too: the ranks of a stage that hold different tokens of the step (dp × cp),
        # whose loss sums add up and over which the wrappers average gradients (``replicas`` of them).
        self.batch_group, self.replicas = None, 1
        # CP × PP (apply_context_parallel): a training pass holds width / cp positions of each row,
        # the other positions are on the ranks of ``cp_group``.
        self.cp, self.width, self.cp_group = 1, seq_len, None
        # TP × PP (apply_tensor_parallel): the residual stream between stages is split along the
        # sequence over tp ranks (sequence parallel), so a stage boundary carries width / tp positions.
        self.tp = 1

    def apply_tensor_parallel(self, tp_mesh) -> None:
        """torchtitan's TP × PP: the tensor + sequence parallel plan applied to this rank's pruned
        model over the tp sub-mesh of its pp group (the stages share its modules, so they are
        sharded too). Between blocks the plan keeps the residual stream as plain local tensors of
        shape (rows, width / tp, dim) (``use_local_output``): that is what a stage sends and the
        next one receives. The first stage's embedding scatters into those sequence shards, the
        last stage's head gathers whole logits, so the loss sees what one process computes."""
        from training.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(self.model, tp_mesh)
        self.tp = tp_mesh.size()
        for s, module in self.modules.items():
            if s > 0:
                # The stage's input holds n = width / tp positions of each row, but its attention
                # all-gathers the whole row: the RoPE tables must cover positions 0 .. n·tp - 1.
                module.rope_positions = self._whole_row_positions
        self.own = _held(self.model)

    def _whole_row_positions(self, n: int) -> torch.Tensor:
        return torch.arange(n * self.tp, device=self.device)

    def apply_context_parallel(self, context) -> None:
        """CP × PP: each rank of a stage holds ``width / cp`` positions of every row (``context``'s
        layout: zig-zag for ring attention, contiguous for sparse), so that is what a stage sends
        and receives. The cp kernels are installed on the shared layers already
        (``context_parallel.context_parallel``); the stages take the model's RoPE positions, which
        are the shard's global positions in training and whole rows in evaluation."""
        self.cp, self.width, self.cp_group = context.cp, self.seq_len // context.cp, context.group
        for module in self.modules.values():
            module.rope_positions = self.model.rope_positions

    def apply_data_parallel(self, mesh, dims, precision: str) -> None:
        """torchtitan's DP × PP: every block and then each stage's module wrapped over the dp
        sub-mesh of this rank's pp group (FSDP2 over dp_shard, HSDP with dp_replicate too,
        FSDP-style ``replicate`` over dp_replicate alone); with cp, the cp ranks join them (they
        hold the same parameters and other positions of the same rows: torchtitan's
        ``dp_shard_cp``). Each stage module is its own root: torch's PipelineStage then skips the
        gradient reduction on all but the step's last backward and reduces once, after the
        schedule's last micro-batch."""
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard

        from training.parallel.data_parallel import join_experts_routed_in_group, mixed_precision_policy
        from training.parallel.expert_parallel import expert_parameters, plain_expert_parameters, shard_experts

        policy = mixed_precision_policy(precision)
        expert_parallel = bool(expert_parameters(self.model))
        # Expert-parallel experts differ from rank to rank: the stage's FSDP must leave them out (ep
        # needs dp_shard > 1, so they only ever meet fully_shard). Those with replicas are sharded
        # over them first, gathered for the step like the blocks.
        shard_experts(self.model, policy, dims.dp, reshard_after_forward=False)
        ignored = set(plain_expert_parameters(self.model)) or None
        if dims.fsdp:
            shard = _flat(mesh, ["dp_shard"] + ["cp"] * (dims.cp > 1))
            dp_mesh = mesh["dp_replicate", shard.mesh_dim_names[0]] if dims.ddp else shard
            self.shard_group = shard.get_group()
            # Parameters stay gathered from a micro-batch's forward to the step's last backward
            # (torchtitan's choice under pp: one all-gather per step, not per micro-batch). The
            # zero-bubble schedules need it: their weight pass takes the stage's parameters, and a
            # resharded stage hands it the shards, not the gathered tensors the graph used (losses
            # then differed from one process by 0.06-0.5%).
            wrap = lambda m: fully_shard(m, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False,  # noqa: E731
                                         ignored_params=ignored)
        else:
            copies = _flat(mesh, [n for n in ("dp_replicate", "cp") if getattr(dims, n) > 1])
            wrap = lambda m: replicate(m, mesh=copies, mp_policy=policy)  # noqa: E731
        for block in self.model.layers.values():
            wrap(block)
        for s in sorted(self.modules):
            wrap(self.modules[s])
        batch = [n for n in ("dp_replicate", "dp_shard", "cp") if getattr(dims, n) > 1]
        self.batch_group = _flat(mesh, batch).get_group()
        if not expert_parallel:  # the wrappers reduce the experts: a stage's ranks must hold the same ones
            join_experts_routed_in_group(self.model, self.batch_group)
        if dims.dp > 1:
            self.dp, self.dp_group = dims.dp, dims.dp_mesh(mesh).get_group()
        self.replicas = dims.dp * dims.cp
        # The shards this rank keeps; gathered parameters are new each step and count as saved bytes.
        self.own = _held(self.model)

    @classmethod
    def build(cls, model: nn.Module, mesh, params, device: torch.device) -> Pipeline:
        """From ``train`` params: the pp sub-mesh's group, schedule, micro-batches, scheduler."""
        p = params.parallel
        cap = None if p.pp_memory_cap_mb is None else p.pp_memory_cap_mb * 2**20
        return cls(model, mesh["pp"].get_group(), p.pp_schedule, p.pp_microbatches, p.pp_dynamic, device,
                   params.seq_len, cap)

    @property
    def has_last(self) -> bool:
        return self.rank == self.last_rank

    # ------------------------------------------------------------ stage sets
    def _activation_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(hidden, logits) dtypes under the current autocast, from one token through a
        throwaway copy-free probe: no_grad, MoE counters restored afterwards."""
        key = torch.is_autocast_enabled(self.device.type)
        if key not in self._dtypes:
            moes = self.model.moe_layers()
            saved = [(m.tokens_per_expert.clone(), m.last_tokens_per_expert) for m in moes]
            training = self.model.training
            # Eval mode: cp's kernels then run the probe's token alone on each rank (whole rows).
            self.model.eval()
            with torch.no_grad():
                first = self.modules.get(0)
                hidden = torch.float32
                if first is not None:
                    # tp positions: sequence parallel splits the probe's row over the tp ranks.
                    hidden = first(torch.zeros(1, self.tp, dtype=torch.long, device=self.device)).dtype
                hidden_box = torch.tensor([_DTYPES.index(hidden)], dtype=torch.long)
                dist.broadcast(hidden_box, src=dist.get_global_rank(self.group, self.first_rank), group=self.group)
                hidden = _DTYPES[int(hidden_box)]
                last = self.modules.get(self.n_stages - 1)
                logits = torch.float32
                if last is not None:
                    logits = last(torch.zeros(1, 1, self.dim, dtype=hidden, device=self.device)).dtype
                box = torch.tensor([_DTYPES.index(logits)], dtype=torch.long)
                dist.broadcast(box, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
                logits = _DTYPES[int(box)]
            self.model.train(training)
            for m, (tokens, last_tokens) in zip(moes, saved):
                m.tokens_per_expert.copy_(tokens)
                m.last_tokens_per_expert = last_tokens
            self._dtypes[key] = (hidden, logits)
        return self._dtypes[key]

    def _stages(self, n_mb: int, rows: int, width: int):
        key = (n_mb, rows, width, torch.is_autocast_enabled(self.device.type))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        hidden, logits = self._activation_dtypes()
        meta = torch.device("meta")
        stages = []
        part = width // self.tp  # sequence parallel: each tp rank holds this much of a row between stages
        for s in self.local:
            # Hidden states carry gradients between stages: their metadata says so, or the
            # receiving stage's buffer is no autograd leaf and sends no gradient back.
            inp = (torch.empty(rows, width, dtype=torch.long, device=meta) if s == 0
                   else torch.empty(rows, part, self.dim, dtype=hidden, device=meta, requires_grad=True))
            out = (torch.empty(rows, width, self.vocab, dtype=logits, device=meta, requires_grad=True)
                   if s == self.n_stages - 1
                   else torch.empty(rows, part, self.dim, dtype=hidden, device=meta, requires_grad=True))
            last = s == self.n_stages - 1
            stages.append(_MeteredStage(self.modules[s], s, self.n_stages, self.device, input_args=inp,
                                        output_args=out, output_grads=None if last else out,
                                        input_grads=None if s == 0 else inp, group=self.group,
                                        live=self.live, own=self.own))
        target = stages[0] if len(stages) == 1 else stages
        schedule = self.schedule_cls(target, n_mb, loss_fn=self._loss, scale_grads=False)
        self._cache[key] = (stages, schedule)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return self._cache[key]

    # ------------------------------------------------------------------ the step
    def _loss(self, logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        targets, mask, doc = packed.unbind(-1)
        mask = mask.bool()
        last = self._last_stage  # the loss runs right after its forward: its bytes are that micro-batch's
        with last.counting(last.last_chunk):
            token_loss = token_losses(logits, targets, mask)
        row_sum = token_loss.sum(1)
        self._acc["doc_sum"].index_add_(0, doc[:, 0], row_sum.detach().float())
        self._acc["doc_tokens"].index_add_(0, doc[:, 0], mask.sum(1))
        self._acc["loss_s"] += time.perf_counter() - start
        # fp16: the schedule's backward runs on this, so the loss scale is applied here.
        return row_sum.sum() / self._acc["global_tokens"] * self._acc["loss_scale"]

    def plan_for(self, batch: Batch) -> Plan:
        lengths = batch.loss_mask.sum(1).tolist()
        try:
            static = static_plan(len(lengths), self.n_microbatches, self.width)
        except ValueError as exc:
            raise AssayError(f"parallel: {exc}") from exc
        if not self.dynamic:
            return static
        if self.dp == 1:
            return self.scheduler.plan(lengths, baseline=static) or static
        # DP × PP: a stage's dp ranks run the same passes and micro-batch counts, or their
        # collectives would not pair up; every rank plans for all of them from the same
        # (world-gathered) observations, so they all choose alike.
        everyone: list = [None] * self.dp
        dist.all_gather_object(everyone, lengths, group=self.dp_group)
        baselines = [static_plan(len(rows), self.n_microbatches, self.width) for rows in everyone]
        plans = self.scheduler.plan_together(everyone, baselines)
        return static if plans is None else plans[dist.get_rank(self.dp_group)]

    def step(self, batch: Batch, global_tokens: int | None = None, loss_scale: float = 1.0, grad_norms: str = "off"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Forward and backward of ``batch`` over the pipeline; returns (its token-loss sum over
        ``global_tokens``, the step's target tokens over all dp ranks (default: ``batch``'s), on
        every rank of the pp group; per-document losses, gradient norms, tokens); the losses and
        tokens are this step's on the last stage's rank only (zeros elsewhere), the norms (with
        ``grad_norms="ghost"``; None when "off") on every rank of the pp group. The backward runs on
        the loss times ``loss_scale`` (fp16's dynamic loss scale; the returned loss is unscaled)."""
        if batch.tokens.shape[1] != self.width:  # cp: this rank's positions of each row
            raise AssayError(f"pipeline: batch width {batch.tokens.shape[1]} != {self.width} (seq_len {self.seq_len}, "
                             f"cp {self.cp})")
        n_docs = len(batch.doc_ids)
        global_tokens = max(int(batch.loss_mask.sum()) if global_tokens is None else global_tokens, 1)
        # The dp wrappers average gradients over the dp (× cp) ranks: each micro-batch's loss is
        # that many times its share (exact when it is a power of two).
        self._acc = {"doc_sum": torch.zeros(n_docs, device=self.device),
                     "doc_tokens": torch.zeros(n_docs, dtype=torch.long, device=self.device),
                     "global_tokens": float(global_tokens) / self.replicas, "loss_scale": loss_scale, "loss_s": 0.0}
        plan = self.plan_for(batch)
        norms = None
        if grad_norms == "ghost":
            layouts = [[torch.tensor(mb, dtype=torch.long) for mb in p.microbatches] for p in plan.passes]
            norms = MicroBatchNorms(self.model, batch.doc_index.to(self.device), n_docs, layouts,
                                    context=self.cp_group)
        try:
            return self._step(batch, plan, norms, loss_scale)
        finally:
            if norms is not None:
                norms.close()

    def _step(self, batch: Batch, plan: Plan, norms: MicroBatchNorms | None, loss_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        samples, walls, losses_all = [], [], []
        busy, padded = 0.0, 0
        self.live.now = self.live.peak = 0.0
        for p in plan.passes:
            stages, schedule = self._stages(*p.shape)
            self._last_stage = next((s for s in stages if s.stage_index == self.n_stages - 1), None)
            rows = torch.tensor([r for mb in p.microbatches for r in mb], device=batch.tokens.device)
            filler = rows < 0
            take = rows.clamp_min(0)
            tokens = batch.tokens[take, :p.width]
            mask = batch.loss_mask[take, :p.width] & ~filler[:, None]
            doc = batch.doc_index[take][:, None].expand(-1, p.width)
            packed = torch.stack([batch.targets[take, :p.width], mask.long(), doc], dim=-1)
            if norms is not None:
                norms.start_pass([torch.tensor(mb, dtype=torch.long) for mb in p.microbatches], p.width)
            for s in stages:
                s.reset_meter()
                s.filler_rows = _filler_rows(p)
                s.norms = norms
            self._acc["loss_s"] = 0.0
            losses: list[torch.Tensor] = []
            args = (tokens.to(self.device),) if 0 in self.local else ()
            target = packed.to(self.device) if self.has_last else None
            earlier = [(q, q.grad) for q in self.model.parameters() if q.grad is not None] if self.replicas > 1 else []
            start = time.perf_counter()
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
            walls.append(time.perf_counter() - start)
            for s in stages:  # a later use of these cached stages (another step, evaluation) sets its own
                s.norms = None
            _keep_earlier_grads(earlier)
            losses_all.extend(losses)
            padded += tokens.numel()
            # The loss runs on the last stage after its forward: the cost model counts it there.
            loss_per_mb = self._acc["loss_s"] / p.n_microbatches
            for s in stages:
                extra = loss_per_mb if s.stage_index == self.n_stages - 1 else 0.0
                for chunk, fwd in s.forward_s.items():
                    bwd = s.backward_s.get(chunk, 0.0)
                    samples.append(Sample(s.stage_index, p.rows, p.width, fwd + extra, bwd, s.saved.get(chunk, 0.0)))
                    busy += fwd + extra + bwd
        loss = (torch.stack(losses_all).sum().detach().float() / (self.replicas * loss_scale) if self.has_last
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        # Under DP × PP over every rank, so that all dp ranks' schedulers hold the same
        # observations (plan_for); a pass is recorded at its busiest rank's shape.
        group = self.group if self.dp == 1 else None
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (samples, walls, busy, self.live.peak, plan.passes), group=group)
        all_samples = [x for g in gathered for x in g[0]]
        pass_walls = [max(g[1][i] for g in gathered) for i in range(len(plan.passes))]
        peak = max(g[3] for g in gathered)
        busiest = [max((g[4][i] for g in gathered), key=lambda p: (p.rows * p.width, p.width))
                   for i in range(len(plan.passes))]
        self.scheduler.observe(all_samples, list(zip(busiest, pass_walls)), peak)
        self.last = StepStats(sum(pass_walls), [g[2] for g in gathered], peak, padded,
                              tuple(p.shape for p in plan.passes))
        doc_loss = self._acc["doc_sum"] / self._acc["doc_tokens"].clamp_min(1)
        return loss, doc_loss, self._document_norms(batch, norms, loss_scale), self._acc["doc_tokens"]

    def _document_norms(self, batch: Batch, norms: MicroBatchNorms | None, loss_scale: float) -> torch.Tensor | None:
        """Each document's gradient norm: the stages hold disjoint parameters, so the squares add
        over the pp group. A micro-batch's loss is its token-loss sum over ``global_tokens / replicas``
        (times the loss scale): the output gradients the hooks saw, rescaled to the document's mean
        (over its whole rows: with cp, the target tokens of every cp rank's positions)."""
        if norms is None:
            return None
        squares = norms.finish()
        dist.all_reduce(squares, group=self.group)
        doc_tokens = torch.zeros(len(batch.doc_ids), dtype=torch.long, device=self.device).index_add_(
            0, batch.doc_index.to(self.device), batch.loss_mask.to(self.device).sum(1))
        if self.cp_group is not None:
            dist.all_reduce(doc_tokens, group=self.cp_group)
        scale = self._acc["global_tokens"] / (loss_scale * doc_tokens.double())
        return (squares * scale**2).sqrt().masked_fill(doc_tokens == 0, float("nan"))

    # ------------------------------------------------------------------ the rest
    def clip_grad_norm(self, max_norm: float) -> float:
        """Stages hold disjoint parameters: the global norm is the root of their squares' sum
        (with FSDP, of their shards' too; replicas count once; ep: each expert once, on its rank)."""
        from training.parallel.expert_parallel import clip_grads_by_kind, expert_parameters, grad_norm_squared

        experts = expert_parameters(self.model)
        mine = {id(p) for p in experts}
        grads = [p.grad for p in self.model.parameters() if p.grad is not None and id(p) not in mine]
        squares = torch.zeros((), dtype=torch.float64)
        if self.tp > 1:
            # Some gradients are tp shards (their squares add over tp), others tp replicas (the
            # norms' weights: once): DTensor reduces each by its placements, over dp too.
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squares += norm.detach().double().pow(2).cpu()
        else:
            for g in grads:
                g = g.to_local() if hasattr(g, "to_local") else g
                squares += g.detach().double().pow(2).sum().cpu()
            if self.shard_group is not None:
                dist.all_reduce(squares, group=self.shard_group)
        if experts:  # the stage's experts are spread over its ep ranks: their squares add over ep
            squares += grad_norm_squared(self.model).double()
        dist.all_reduce(squares, group=self.group)
        total = squares.sqrt().to(torch.float32)
        with_grad = [p for p in self.model.parameters() if p.grad is not None]
        clip_grads_by_kind(with_grad, mine, max_norm, total.to(self.device))
        return float(total)

    def parameter_count(self) -> int:
        from training.parallel.expert_parallel import count_parameters

        count = torch.tensor([count_parameters(self.model)], dtype=torch.long)  # ep: each expert once
        dist.all_reduce(count, group=self.group)
        return int(count)

    def _forward_only(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The whole batch through the stages in order, activations sent point to point between
        ranks (every rank walks the stages in the same order); the logits on the last stage's rank."""
        hidden, _ = self._activation_dtypes()
        x = None
        for s in range(self.n_stages):
            if self.stage_rank[s] != self.rank:
                continue
            if s == 0:
                x = self.modules[0](tokens)
            else:
                if self.stage_rank[s - 1] != self.rank:
                    x = torch.empty(tokens.shape[0], tokens.shape[1] // self.tp, self.dim, dtype=hidden,
                                    device=self.device)
                    dist.recv(x, src=dist.get_global_rank(self.group, self.stage_rank[s - 1]), group=self.group)
                x = self.modules[s](x)
            if s + 1 < self.n_stages and self.stage_rank[s + 1] != self.rank:
                dist.send(x.contiguous(), dst=dist.get_global_rank(self.group, self.stage_rank[s + 1]), group=self.group)
        return x if self.has_last else None

    def evaluate(self, rows, params, device: torch.device) -> dict:
        """Held-out loss and accuracy through the pipeline's forward, as ``training.trainer.evaluate``
        computes them in one process (results on every rank), in eval mode as there: cp's kernels
        then run whole rows on every rank."""
        training = self.model.training
        self.model.eval()
        try:
            return self._evaluate(rows, params, device)
        finally:
            self.model.train(training)

    @torch.no_grad()
    def _evaluate(self, rows, params, device: torch.device) -> dict:
        from training.data import make_batch
        from training.precision import precision_context

        if len(rows) == 0:
            return {"val_loss": None, "val_accuracy": None, "val_tokens": 0}
        limit = len(rows) if params.eval_rows == 0 else min(len(rows), params.eval_rows)
        totals = torch.zeros(3, dtype=torch.float64)
        n_mb = self.n_stages if valid_microbatches(self.schedule_name, self.n_stages, self.pp) else self.pp
        for start in range(0, limit, params.batch_size):
            batch = make_batch(rows, np.arange(start, min(limit, start + params.batch_size)))
            p = static_plan(batch.tokens.shape[0], n_mb, self.seq_len).passes[0]
            idx = torch.tensor([r for mb in p.microbatches for r in mb])
            take, filler = idx.clamp_min(0), idx < 0
            mask = (batch.loss_mask[take] & ~filler[:, None]).to(device)
            targets = batch.targets[take].to(device)
            # Some schedules call the loss function in eval too: it gets a target, and scratch sums.
            packed = torch.stack([targets, mask.long(), batch.doc_index[take][:, None].expand_as(targets)], -1)
            self._acc = {"doc_sum": torch.zeros(len(batch.doc_ids), device=device),
                         "doc_tokens": torch.zeros(len(batch.doc_ids), dtype=torch.long, device=device),
                         "global_tokens": 1.0, "loss_scale": 1.0, "loss_s": 0.0}
            with precision_context(params.precision, device):
                if _schedule(self.schedule_name)[2] == "v":
                    # torch 2.13's V schedules run their backward actions in eval too ("can't
                    # steal_bwd_input if this stage doesn't have backward"): a plain forward instead.
                    out = self._forward_only(batch.tokens[take].to(device))
                else:
                    stages, schedule = self._stages(*p.shape)
                    for s in stages:
                        s.filler_rows = _filler_rows(p)
                        s.norms = None
                    self._last_stage = next((s for s in stages if s.stage_index == self.n_stages - 1), None)
                    out = schedule.eval(*((batch.tokens[take].to(device),) if 0 in self.local else ()),
                                        target=packed if self.has_last else None)
            if self.has_last:
                totals += torch.tensor([float(token_losses(out, targets, mask).sum()),
                                        float(((out.argmax(-1) == targets) & mask).sum()), float(mask.sum())],
                                       dtype=torch.float64)
        dist.broadcast(totals, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        loss_sum, correct, tokens = totals.tolist()
        return {"val_loss": loss_sum / tokens, "val_accuracy": correct / tokens, "val_tokens": int(tokens)}


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def check_pipeline_layout(dims, params) -> None:
    """What pp runs with today, refused clearly otherwise (before any process builds a stage)."""
    p = params.parallel
    if dims.cp > 1 and p.pp_dynamic:
        # The dynamic plans trim passes to a micro-batch's longest row, from the row's start; a cp
        # rank holds positions spread over the row (zig-zag), not its start.
        raise AssayError("parallel: pp_dynamic does not run with cp > 1; use the static micro-batches "
                         "(--pp-static)")
    if dims.tp > 1 and p.pp_dynamic:
        # The dynamic plans trim passes to the longest row of a micro-batch: any width, while
        # sequence parallel needs widths that split over the tp ranks.
        raise AssayError("parallel: pp_dynamic does not run with tp > 1; use the static micro-batches "
                         "(--pp-static)")
    _schedule(p.pp_schedule)
    n_stages = dims.pp * SCHEDULES[p.pp_schedule][1]
    split_layers(params.model.n_layers, n_stages)
    if not valid_microbatches(p.pp_schedule, p.pp_microbatches, dims.pp):
        raise AssayError(f"parallel: pp_schedule {p.pp_schedule} cannot run pp_microbatches={p.pp_microbatches} "
                         f"on pp={dims.pp} (1F1B needs at least pp, DualPipeV 2·pp, the interleaved ones a "
                         "multiple of their rounds)")
