"""Training precision: which dtype autocast runs in, and when the loss is scaled.

`train.precision` is one of:

- `fp32`: no autocast;
- `bf16`: autocast to bfloat16;
- `fp16`: autocast to float16, with dynamic loss scaling (`torch.amp.GradScaler`): fp16 has bf16's
  precision and more, but only 5 exponent bits, so small gradients underflow to zero unless the loss
  is multiplied up before the backward (Micikevicius et al. 2018, "Mixed Precision Training");
- `fp8`: the eligible Linears' forward GEMMs in float8 (`training.fp8`, DeepSeek-V3's fine-grained
  scaling) and everything else, the backward included, under bf16 autocast;
- `fp8_fp16`: the same with fp16 as the 16-bit dtype, hence with loss scaling too. The seeds' FP8
  recipe runs the backward in 16-bit; this offers fp16 for it beside bf16.

Master weights and optimizer state stay fp32 in every case; gradients are unscaled before clipping,
telemetry and the optimizer step, so what is logged and applied does not depend on the loss scale.
"""

from __future__ import annotations

import contextlib

import torch

from assay.config import TRAIN_PRECISIONS as PRECISIONS


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs in (None: no autocast)."""
    check_precision(precision)
    if precision in ("bf16", "fp8"):
        return torch.bfloat16
    if precision in ("fp16", "fp8_fp16"):
        return torch.float16
    return None


def uses_fp8(precision: str) -> bool:
    return check_precision(precision) in ("fp8", "fp8_fp16")


def scales_loss(precision: str) -> bool:
    """Whether the backward runs on a dynamically scaled loss (the fp16 precisions)."""
    return autocast_dtype(precision) is torch.float16


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast in `precision`'s 16-bit dtype; fp8's converted Linears run their GEMMs in float8 inside it."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def without_loss_scaling(precision: str) -> str:
    """The precision a pass with no loss scaler runs a `precision` run's model in (the scoring pass):
    fp16's gradients would underflow unscaled, so fp16 becomes fp32 and fp8_fp16 becomes fp8 (bf16)."""
    return {"fp16": "fp32", "fp8_fp16": "fp8"}.get(check_precision(precision), precision)


def loss_scaler(precision: str, device: torch.device, init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """torch's dynamic loss scaler, enabled for the fp16 precisions (disabled: every call is a no-op).

    From `init_scale`, it halves the scale and skips the step when a gradient is inf or NaN, and
    doubles it after 2,000 steps without one (torch's defaults)."""
    return torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=scales_loss(precision))
