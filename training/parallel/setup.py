"""One run's parallel layout, applied step by step by the trainer.

The trainer asks this object, at each point where a distributed run differs from a
single process: which rows are mine, what the global loss was, the global gradient
norm, how to checkpoint. On a single process every answer is the single-process
one, so ``training.trainer`` has one code path.
"""

from __future__ import annotations

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

    @classmethod
    def setup(cls, params: TrainParams, world: Distributed) -> Parallel:
        p = params.parallel
        if not world.distributed:
            return cls(world, ParallelDims(), False, params.precision)
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.ep, world_size=world.world_size)
        if p.zero1 and (dims.fsdp or not dims.ddp):
            raise AssayError("parallel: zero1 shards the optimizer over DDP ranks: it needs dp_replicate > 1 "
                             "and dp_shard 1 (FSDP already shards the optimizer state, as ZeRO-3)")
        return cls(world, dims, bool(p.zero1), params.precision)

    @property
    def on(self) -> bool:
        return self.world.distributed

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.world.world_size, **self.dims.sizes(), "ep": self.dims.ep, "zero1": self.zero1,
                "mode": self.mode}

    @property
    def mode(self) -> str:
        if not self.on:
            return "single"
        if self.dims.fsdp:
            return "hsdp" if self.dims.ddp else "fsdp"
        return "ddp+zero1" if self.zero1 else "ddp"

    # ------------------------------------------------------------- model and optimizer
    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        if not self.on:
            return model
        self.mesh = self.dims.build_mesh(device.type)
        return apply_data_parallel(model, self.dims, self.mesh, self.precision)

    def optimizer(self, groups: list[dict], lr: float, defaults: dict) -> torch.optim.Optimizer:
        if self.zero1:
            return zero1_optimizer(groups, self.dims.dp_mesh(self.mesh), lr=lr, **defaults)
        return torch.optim.AdamW(groups, lr=lr, **defaults)

    # -------------------------------------------------------------------- the step
    def local_batch(self, whole: Batch) -> LocalBatch:
        if not self.on:
            return LocalBatch(whole, 1.0, int(whole.loss_mask.sum()), True)
        dp_mesh = self.dims.dp_mesh(self.mesh)
        return local_batch(whole, dp_mesh.get_local_rank(), self.dims.dp)

    def global_loss(self, local_mean: torch.Tensor, local_tokens: int, global_tokens: int) -> torch.Tensor:
        """The single-process batch loss: token-loss sums added over ranks, over all tokens."""
        if not self.on:
            return local_mean
        return self.world.sum(local_mean.float() * local_tokens) / max(global_tokens, 1)

    def sum_moe_loads(self, model: nn.Module, has_documents: bool) -> None:
        """Aux-loss-free balancing sees the global batch's expert loads, as one process would."""
        if not self.on:
            return
        for moe in model.moe_layers():
            if not has_documents:  # the placeholder row is not part of the batch
                moe.tokens_per_expert.zero_()
            dist.all_reduce(moe.tokens_per_expert)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        if not self.on:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        parameters = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
        if isinstance(total, DTensor):  # FSDP: a partial norm per rank, reduced here
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return float(total)

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
