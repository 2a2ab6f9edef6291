"""Which accelerator to use, and whether it does bf16 well.

One place for the choice, so the encoder, the domain model and the trainer
agree: cuda > xpu > mps > cpu unless a device is named.
"""

from __future__ import annotations

import torch

from assay.errors import AssayError


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise AssayError(f"unknown device {name!r} ({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise AssayError(f"device {name!r} asked for, but CUDA is not available here")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def fast_bf16(device: torch.device) -> bool:
    """True where bf16 matmuls run in hardware (AMX / AVX512-BF16 on CPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False
