"""Dynamic loss scaling whose overflow verdict is the same on every rank.

`torch.amp.GradScaler` decides from the gradients it unscales on its own rank whether a step
overflowed, then skips the step and halves the scale, or counts towards growing it. That is a
world-wide verdict only when every rank holds the same gradients or torch reduces the check:
DDP's gradients are all-reduced, and FSDP's, TP's and CP's are DTensors, whose check torch
reduces over their mesh. Expert parallel's experts and each pipeline stage's parameters have
plain gradients that differ from rank to rank, so one rank could skip a step that another
takes and their scales would drift apart. Here the per-device "found inf" flags are summed over
the process group after unscaling, as torch's own `ShardedGradScaler` does for FSDP1, so the
skip and the next scale are decided once for all ranks.

The unscale itself is also done one kind of tensor at a time: under expert parallel an
optimizer holds plain expert gradients beside FSDP's DTensor gradients, and torch's fused
unscale (a foreach kernel) takes one kind per call; DTensors are grouped by mesh as well (an expert
with copies is sharded over them, the rest over dp).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _MultiDeviceReplicator
from torch.distributed.tensor import DTensor

__all__ = ["AgreedGradScaler"]


class AgreedGradScaler(torch.amp.GradScaler):
    """A `GradScaler` (same arguments) whose overflow check is summed over `group` (default: the world)."""

    def __init__(self, device: str, *, init_scale: float, enabled: bool, group: dist.ProcessGroup | None = None):
        super().__init__(device, init_scale=init_scale, enabled=enabled)
        self.group = group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        # (device, dtype, DTensor mesh or None) -> gradients: one foreach call per group. Sharded experts'
        # gradients live on their copies' mesh, the rest on dp's; the unscale took both in one call when
        # tried (fp16 ep test), but DTensor ops in general want one mesh per call.
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = param.grad  # dense: no model here has sparse gradients
                    mesh = grad.device_mesh if isinstance(grad, DTensor) else None
                    groups[(grad.device, grad.dtype, mesh)].append(grad)
            for (device, _, _), grads in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        found = per_device_found_inf._per_device_tensors
        for flag in found.values():
            dist.all_reduce(flag, group=self.group)  # > 0 on every rank when any rank overflowed
        return found
