"""One run's parallel layout, applied step by step by the trainer.

The trainer asks this object, at each point where a distributed run differs from a
single process: which rows are mine, what the global loss was, the global gradient
norm, how to checkpoint. On a single process every answer is the single-process
one, so ``training.trainer`` has one code path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from assay.config import TrainParams
from assay.errors import AssayError
from training.checkpoint import load_checkpoint, save_checkpoint
from training.data import Batch
from training.parallel.batches import LocalBatch, local_batch
from training.parallel.data_parallel import apply_data_parallel, zero1_optimizer
from training.parallel.dims import ParallelDims
from training.parallel.distributed import Distributed
from training.precision import loss_scaler, scales_loss

__all__ = ["Parallel"]

PlainOptimizer = Callable[[], torch.optim.Optimizer]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass
class Parallel:
    world: Distributed
    dims: ParallelDims
    zero1: bool
    precision: str = "fp32"
    mesh: DeviceMesh | None = None
    #: pp: the train params the pipeline is built from (schedule, micro-batches, seq_len), and the pipeline.
    train: TrainParams | None = None
    pipeline: Any = None

    @classmethod
    def setup(cls, params: TrainParams, world: Distributed) -> Parallel:
        p = params.parallel
        if not world.distributed:
            return cls(world, ParallelDims(), False, params.precision)
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.ep, world_size=world.world_size)
        if p.zero1 and (dims.fsdp or not dims.ddp):
            raise AssayError("parallel: zero1 shards the optimizer over DDP ranks: it needs dp_replicate > 1 "
                             "and dp_shard 1 (FSDP already shards the optimizer state, as ZeRO-3)")
        if dims.tp > 1:
            from training.parallel.tensor_parallel import check_tensor_parallel_layout

            check_tensor_parallel_layout(dims)
        if dims.pp > 1:
            from training.parallel.pipeline import check_pipeline_layout

            check_pipeline_layout(dims, params)
        return cls(world, dims, bool(p.zero1), params.precision, train=params)

    @property
    def on(self) -> bool:
        return self.world.distributed

    @property
    def pipelined(self) -> bool:
        """pp: the trainer's step runs through ``self.pipeline`` (its own forward/backward path)."""
        return self.on and self.dims.pp > 1

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.world.world_size, **self.dims.sizes(), "ep": self.dims.ep, "zero1": self.zero1,
                "mode": self.mode}

    @property
    def mode(self) -> str:
        if not self.on:
            return "single"
        if self.pipelined:  # "pp", "fsdp+pp", "hsdp+pp", "ddp+pp", "tp+pp", "fsdp+tp+pp", "cp+pp", "fsdp+cp+pp", ...
            dp = ("hsdp" if self.dims.ddp else "fsdp") if self.dims.fsdp else ("ddp" if self.dims.ddp else "")
            return "+".join([dp] * bool(dp) + ["cp"] * (self.dims.cp > 1) + ["tp"] * (self.dims.tp > 1) + ["pp"])
        if self.dims.tp > 1:  # "tp", "fsdp+tp", "hsdp+tp"
            return "+".join(["hsdp" if self.dims.ddp else "fsdp"] * self.dims.fsdp + ["tp"])
        if self.dims.cp > 1:  # "cp", "ddp+cp", "fsdp+cp", "hsdp+cp"
            dp = ("hsdp" if self.dims.ddp else "fsdp") if self.dims.fsdp else ("ddp" if self.dims.ddp else "")
            return f"{dp}+cp" if dp else "cp"
        if self.dims.fsdp:
            return "hsdp" if self.dims.ddp else "fsdp"
        return "ddp+zero1" if self.zero1 else "ddp"

    # ------------------------------------------------------------- model and optimizer
    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        if not self.on:
            return model
        self.mesh = self.dims.build_mesh(device.type)
        # torchtitan's order: PP splits first, then TP, EP, CP, activation checkpointing, FSDP.
        # --- pipeline parallel (pp) ---
        if self.dims.pp > 1:  # prunes ``model`` in place to this rank's stages
            from training.parallel.pipeline import Pipeline

            self.pipeline = Pipeline.build(model, self.mesh, self.train, device)
        # --- tensor + sequence parallel (tp) ---
        if self.dims.tp > 1 and self.pipelined:  # the pruned model, and the stages' boundary shapes
            self.pipeline.apply_tensor_parallel(self.mesh["tp"])
        elif self.dims.tp > 1:
            from training.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, self.mesh["tp"])
        # --- expert parallel (ep) ---
        if self.dims.ep > 1:
            from training.parallel.expert_parallel import apply_expert_parallel

            apply_expert_parallel(model, self.dims.ep_mesh(self.mesh), self.dims.dp)
        # --- context parallel (cp) ---
        if self.dims.cp > 1 and self.pipelined:  # the stages' kernels; data parallelism below, per stage
            from training.parallel.context_parallel import context_parallel

            self.context = context_parallel(model, self.mesh, self.dims, model.args.max_seq_len)
            self.pipeline.apply_context_parallel(self.context)
        elif self.dims.cp > 1:
            from training.parallel.context_parallel import apply_context_parallel

            # It applies data parallelism too, over dp × cp: its cp ranks' gradients reduce with dp's.
            self.context = apply_context_parallel(model, self.mesh, self.dims, self.precision, model.args.max_seq_len)
            return model
        if self.pipelined:  # DP × PP: each stage's module wrapped over its dp (× cp) sub-mesh, not the pruned model
            if self.dims.dp * self.dims.cp > 1:
                self.pipeline.apply_data_parallel(self.mesh, self.dims, self.precision)
            return model
        return apply_data_parallel(model, self.dims, self.mesh, self.precision)

    def loss_scaler(self, precision: str, device: torch.device, init_scale: float) -> torch.amp.GradScaler:
        """The fp16 precisions' loss scaler (disabled otherwise). On several ranks its overflow verdict is
        agreed over the world: experts' and pipeline stages' gradients are plain per-rank tensors
        (``training.parallel.loss_scaling``)."""
        if not self.on:
            return loss_scaler(precision, device, init_scale)
        from training.parallel.loss_scaling import AgreedGradScaler

        return AgreedGradScaler(device.type, init_scale=init_scale, enabled=scales_loss(precision))

    def optimizer(self, groups: list[dict], lr: float, defaults: dict) -> torch.optim.Optimizer:
        if self.zero1:
            return zero1_optimizer(groups, self.dims.dp_mesh(self.mesh), lr=lr, **defaults)
        return torch.optim.AdamW(groups, lr=lr, **defaults)

    # -------------------------------------------------------------------- the step
    def local_batch(self, whole: Batch) -> LocalBatch:
        if not self.on:
            return LocalBatch(whole, 1.0, int(whole.loss_mask.sum()), True)
        if self.dims.cp > 1:  # this dp rank's documents, of each row this rank's positions
            return self.context.local_batch(whole)
        if self.pipelined and self.dims.dp == 1:  # every stage runs every row
            return LocalBatch(whole, 1.0, int(whole.loss_mask.sum()), True)
        if self.dims.dp == 1:  # e.g. tp alone: every rank takes the whole batch (and the mesh has no dp)
            return local_batch(whole, 0, 1)
        dp_mesh = self.dims.dp_mesh(self.mesh)
        return local_batch(whole, dp_mesh.get_local_rank(), self.dims.dp)

    def global_loss(self, local_mean: torch.Tensor, local_tokens: int, global_tokens: int) -> torch.Tensor:
        """The single-process batch loss: token-loss sums added over ranks, over all tokens."""
        if not self.on or self.pipelined:  # pp: the last stage's sum, broadcast already
            if self.on and self.pipeline.batch_group is not None:  # DP (× CP) × PP: the pp groups' sums add up
                total = local_mean.detach().float().clone()
                dist.all_reduce(total, group=self.pipeline.batch_group)
                return total
            return local_mean
        if self.dims.tp > 1:  # the tp ranks of a dp group hold the same rows: add over dp only
            total = local_mean.detach().float() * local_tokens
            if self.dims.dp > 1:
                dist.all_reduce(total, group=self.dims.dp_mesh(self.mesh).get_group())
            return total / max(global_tokens, 1)
        return self.world.sum(local_mean.float() * local_tokens) / max(global_tokens, 1)

    @property
    def writes_telemetry(self) -> bool:
        """Whether this rank records its documents' telemetry: with tp, the first rank of each
        tp group does (its ranks hold the same documents and the same, tp-summed, norms)."""
        first_of_tp = self.dims.tp == 1 or self.mesh["tp"].get_local_rank() == 0
        first_of_cp = self.dims.cp == 1 or self.context.rank == 0  # it holds the cp-summed losses
        if self.pipelined:  # the last stage computed the losses (with tp: its first tp rank writes them)
            return self.pipeline.has_last and first_of_tp and first_of_cp
        if self.on and not first_of_cp:  # cp: rank 0 writes the cp-summed losses
            return False
        return first_of_tp

    def document_losses(self, doc_loss: torch.Tensor, doc_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-document mean losses and target tokens of this rank's documents, over their whole rows."""
        if self.on and self.dims.cp > 1:  # each cp rank saw part of every row
            return self.context.document_stats(doc_loss, doc_tokens)
        return doc_loss, doc_tokens

    def sum_moe_loads(self, model: nn.Module, has_documents: bool) -> None:
        """Aux-loss-free balancing sees the global batch's expert loads, as one process would."""
        if not self.on or (self.pipelined and self.pipeline.batch_group is None):  # pp: each stage saw the whole batch
            return
        # DP (× CP) × PP: a stage's layers saw this rank's tokens; the stage's dp × cp ranks add theirs.
        group = self.pipeline.batch_group if self.pipelined else None
        for moe in model.moe_layers():
            if not has_documents:  # the placeholder row is not part of the batch
                moe.tokens_per_expert.zero_()
            dist.all_reduce(moe.tokens_per_expert, group=group)

    def stage_max(self, value: float | None) -> float | None:
        """A per-layer statistic's largest value over the whole model: under pp each rank's is
        over its own stages' layers (call on every rank; None: no value anywhere)."""
        if not self.on or not self.pipelined:
            return value
        box = torch.tensor([-math.inf if value is None else value], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.pipeline.group)
        return None if box.item() == -math.inf else box.item()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        if not self.on:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if self.pipelined:  # its stages' experts too (ep × pp)
            return self.pipeline.clip_grad_norm(max_norm)
        if self.dims.ep > 1:
            return self._clip_grad_norm_ep(model, max_norm)
        parameters = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
        if isinstance(total, DTensor):  # FSDP: a partial norm per rank, reduced here
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return float(total)

    def _clip_grad_norm_ep(self, model: nn.Module, max_norm: float) -> float:
        """Experts differ from ep rank to ep rank (their squares add over ep); they and the rest
        are FSDP shards (experts over their replicas, when they have any), whose norms DTensor reduces."""
        from training.parallel.expert_parallel import clip_grads_by_kind, expert_parameters, grad_norm_squared

        experts = {id(p) for p in expert_parameters(model)}
        parameters = [p for p in model.parameters() if p.grad is not None]
        rest = [p.grad for p in parameters if id(p) not in experts]
        squared = grad_norm_squared(model)
        if rest:
            norm = torch.nn.utils.get_total_norm(rest, 2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squared = squared + norm.float().cpu() ** 2
        total = squared.sqrt()
        clip_grads_by_kind(parameters, experts, max_norm, total)
        return float(total)

    def parameter_count(self, model: nn.Module) -> int:
        """The model's parameters (a DTensor's numel is global; ep: each expert once)."""
        if self.on and self.dims.ep > 1:
            from training.parallel.expert_parallel import count_parameters

            return count_parameters(model)
        return sum(p.numel() for p in model.parameters())

    @property
    def context_group(self) -> dist.ProcessGroup | None:
        """Without pp, the cp group whose ranks hold the other positions of this rank's rows."""
        return self.context.group if self.on and self.dims.cp > 1 and not self.pipelined else None

    def telemetry_grad_norms(self, setting: str, has_documents: bool = True) -> str:
        """The per-document gradient norm setting on a rank with documents or (``has_documents=False``)
        with the placeholder row. Every layout measures them exactly (training.grad_norms)."""
        if not self.on:
            return setting
        # Nothing of its own to attribute; but under ep its experts serve the group's documents,
        # and every rank of the group must join the norms' collectives.
        return setting if has_documents or self.dims.ep > 1 else "off"

    # ------------------------------------------------------------------ checkpoints
    def _plain_state(self, optimizer: torch.optim.Optimizer, plain: PlainOptimizer) -> torch.optim.Optimizer:
        """ZeRO-1 keeps each moment on one rank; DCP wants the whole optimizer on every rank of a
        replicated model, so the state is consolidated on rank 0 and broadcast into a plain AdamW."""
        optimizer.consolidate_state_dict(to=0)
        box = [optimizer.state_dict() if self.world.is_main else None]
        dist.broadcast_object_list(box, src=0)
        full = plain()
        full.load_state_dict(box[0])
        return full

    def save_checkpoint(self, out: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                        tensors: dict[str, torch.Tensor], identity: dict, plain: PlainOptimizer) -> Path:
        if self.zero1:
            optimizer = self._plain_state(optimizer, plain)
        return save_checkpoint(out, step, model, optimizer, tensors, identity)

    def load_checkpoint(self, checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        tensors: dict[str, torch.Tensor], plain: PlainOptimizer) -> dict:
        if not self.zero1:
            return load_checkpoint(checkpoint, model, optimizer, tensors)
        full = plain()
        state = load_checkpoint(checkpoint, model, full, tensors)
        optimizer.load_state_dict(full.state_dict())  # ZeRO keeps its own partition of it
        return state

    # ---------------------------------------------------------------------- memory
    def memory_per_rank(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state (largest over ranks)."""
        inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps the local AdamW
        found = {
            "parameters": _bytes(model.parameters()),
            "gradients": _bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": _bytes(v for state in inner.state.values() for v in state.values()),
        }
        if not self.on:
            return found
        values = torch.tensor(list(found.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {k: int(v) for k, v in zip(found, values.tolist())}
