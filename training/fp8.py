"""FP8 mixed-precision training by module conversion (DeepSeek-V3 fine-grained scheme).

:func:`convert_to_float8` swaps eligible ``nn.Linear`` modules for :class:`Float8Linear`, whose
forward GEMM ``y = x @ W.T`` takes both operands in ``torch.float8_e4m3fn``::

    x (M, K): one scale per 1x128 tile   (each row, 128 consecutive elements along K)
    W (N, K): one scale per 128x128 block
    scale = amax(tile) / 448             (448 = largest finite e4m3 value)

Why this shape (DeepSeek-V3 technical report, §3.3.2 "Fine-Grained Quantization"):
e4m3 keeps 3 mantissa bits but only ~15 binades of normal range, so one scale per tensor lets a
single outlier push every other value toward the subnormal range, where the
relative error grows until values flush to zero.  Activations have such outliers per token and
per channel, so each 1x128 tile gets its own scale; weights are smoother, so 128x128
blocks suffice.  Scales are *online* (the amax of the current tensor), not delayed
from past steps, so a sudden outlier is never clipped.  Since the K dimension is cut into
128-wide groups, the GEMM can dequantise each group's partial sum and add it up in fp32,
which is also how DeepSeek-V3 works around the limited accumulation precision of FP8 tensor
cores ("Increasing Accumulation Precision", promotion to CUDA cores every 128 elements).

What is kept in high precision, and why:

* The backward pass.  ``grad_x = grad_y @ W`` and ``grad_W = grad_y.T @ x`` run in the forward's
  compute dtype (fp32, or bf16 under autocast -- exactly what ``nn.Linear`` would do) from the
  unquantised input that forward saved.  DeepSeek-V3 also runs these two GEMMs in FP8; keeping
  them high precision halves the speed-up but makes gradients identical to a plain Linear's
  given the same upstream gradient, which is easy to verify and cannot diverge.
* Master weights and optimizer state: the parameter stays fp32; only a transient fp8 copy is
  made inside forward.  ``Float8Linear`` subclasses ``nn.Linear`` with the same parameters, so
  state_dict keys are identical and checkpoints load across precisions.
* By default, the output head and MoE ``router`` (DeepSeek-V3 keeps the output head and gating
  modules in their original precision) and any Linear with ``in_features < 16``.

Execution:

* CUDA with compute capability >= 8.9: ``torch._scaled_mm`` once per 128-wide K chunk with unit
  tensor-wise scales and fp32 output, then each partial result is multiplied by its row scale
  times its column scale and added up in fp32.  This uses only the tensor-wise form of
  ``_scaled_mm`` (available in every release with FP8), avoiding block-scale layouts that vary
  between versions.  It is a correct reference path, not a tuned kernel: a single block-scaled
  GEMM (DeepGEMM, or ``_scaled_mm`` with 1x128/128x128 scales where supported) would be faster.
* Anywhere else (CPU, older GPUs, meta): quantise, dequantise back to fp32, matmul in fp32.
  The numbers match the FP8 GEMM up to fp32 summation order; the CPU FP8 GEMM is some
  2000x slower than fp32, so it is never used on CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "Float8Linear",
    "convert_to_float8",
    "default_skip",
    "dequantize_blocks",
    "dequantize_tiles",
    "float8_module_names",
    "fp8_matmul",
    "quantize_blocks",
    "quantize_tiles",
]

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = 128
MIN_IN_FEATURES = 16
# An all-zero tile still needs a finite, non-zero scale; any tile whose amax is below this
# quantises to values below FP8_MAX anyway, so the floor never clips real data.
_AMAX_FLOOR = 1e-12
# Leading matrix dimensions torch._scaled_mm accepts (cuBLASLt alignment).
_SCALED_MM_ALIGN = 16


# ------------------------------------------------------------------------------ quantisation
def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # fp32 rounding can land a hair above 448; some backends turn out-of-range casts into NaN.
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``x`` (M, K) with one scale per 1x128 tile.

    Returns ``(q, scale)``: ``q`` float8_e4m3fn (M, Kp) where Kp is K rounded up to a multiple of
    128 (zero padded, so the padding adds nothing to a GEMM), and ``scale`` fp32 (M, Kp // 128)
    with ``x ~= q * scale`` tile by tile.  The last tile of a row may be partial: its amax is
    taken over the real elements only, since the padding is zero.
    """
    m, k = x.shape
    tiles = F.pad(x.float(), (0, -k % BLOCK)).view(m, -1, BLOCK)
    scale = tiles.abs().amax(dim=-1).clamp_min(_AMAX_FLOOR) / FP8_MAX
    q = _to_fp8(tiles / scale.unsqueeze(-1))
    return q.view(m, -1), scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`quantize_tiles`: fp32 (M, k), padding dropped."""
    m = q.shape[0]
    return (q.float().view(m, -1, BLOCK) * scale.unsqueeze(-1)).view(m, -1)[:, :k]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight ``w`` (N, K) with one scale per 128x128 block.

    Returns ``(q, scale)``: ``q`` float8_e4m3fn (Np, Kp), both dimensions zero-padded up to a
    multiple of 128, and ``scale`` fp32 (Np // 128, Kp // 128).
    """
    n, k = w.shape
    wp = F.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    np_, kp = wp.shape
    blocks = wp.reshape(np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(_AMAX_FLOOR) / FP8_MAX
    q = _to_fp8(blocks / scale[:, None, :, None])
    return q.view(np_, kp), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: fp32 of ``shape`` (N, K), padding dropped."""
    np_, kp = q.shape
    blocks = q.float().view(np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK) * scale[:, None, :, None]
    n, k = shape
    return blocks.view(np_, kp)[:n, :k]


# ------------------------------------------------------------------------------------- GEMM
def _use_scaled_mm(t: torch.Tensor) -> bool:
    """True where the real FP8 GEMM exists: NVIDIA GPUs of compute capability 8.9 (Ada) or newer.

    ROCm reports device type ``cuda`` too, but its FP8 GEMM wants the ``fnuz`` formats.
    """
    return (
        t.device.type == "cuda"
        and torch.version.hip is None
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(t.device) >= (8, 9)
    )


def _matmul_emulated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ weight (N, K).T`` on the dequantised FP8 operands, in fp32."""
    xq, xs = quantize_tiles(x)
    wq, ws = quantize_blocks(weight)
    return dequantize_tiles(xq, xs, x.shape[1]) @ dequantize_blocks(wq, ws, weight.shape).t()


def _matmul_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same product as :func:`_matmul_emulated`, with FP8 tensor-core GEMMs, in fp32.

    One ``_scaled_mm`` per 128-wide K chunk: within a chunk every row of ``x`` has a single
    scale and every column of ``W.T`` has a single scale, so the chunk's product can be
    computed on raw fp8 values and rescaled afterwards by the outer product of the two.
    """
    m, n = x.shape[0], weight.shape[0]
    # Zero rows quantise to zero and are sliced off; they only satisfy alignment rules.
    x = F.pad(x, (0, 0, 0, -m % _SCALED_MM_ALIGN))
    xq, xs = quantize_tiles(x)  # (Mp, Kp), (Mp, Kt)
    wq, ws = quantize_blocks(weight)  # (Np, Kp), (Nt, Kt); Np, Kp multiples of 128
    mp, kp = xq.shape
    np_ = wq.shape[0]
    kt = kp // BLOCK
    # Chunk-major copies, so that each chunk is a contiguous row-major (Mp, 128) operand and a
    # contiguous (Np, 128) block whose transpose is the column-major operand cuBLASLt requires.
    x_chunks = xq.view(mp, kt, BLOCK).transpose(0, 1).contiguous()
    w_chunks = wq.view(np_, kt, BLOCK).transpose(0, 1).contiguous()
    w_col_scales = ws.repeat_interleave(BLOCK, dim=0)  # (Np, Kt): block scale of each column
    one = torch.ones((), device=x.device, dtype=torch.float32)
    acc = torch.zeros(mp, np_, device=x.device, dtype=torch.float32)
    for k in range(kt):
        part = torch._scaled_mm(
            x_chunks[k], w_chunks[k].t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
        # Dequantise the partial sum and accumulate in fp32 (DeepSeek-V3's promotion step).
        acc += part.mul_(xs[:, k : k + 1]).mul_(w_col_scales[:, k])
    return acc[:m, :n]


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ weight (N, K).T`` with 1x128-tile / 128x128-block FP8 operands; fp32 (M, N)."""
    if _use_scaled_mm(x):
        return _matmul_scaled_mm(x, weight)
    return _matmul_emulated(x, weight)


# ----------------------------------------------------------------------------------- autograd
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute in: the autocast dtype if autocast is on, else x's."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    # Autocast would otherwise recast the fp32 GEMMs below to bf16 (and does so in backward too
    # when backward runs on the thread that enabled it, as on CPU).
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


class _Float8LinearFunction(torch.autograd.Function):
    """FP8 forward, high-precision backward from the saved unquantised tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        compute_dtype = _compute_dtype(x)
        with _no_autocast(x.device.type):
            x2d = x.reshape(-1, x.shape[-1])
            y = fp8_matmul(x2d, weight)
            if bias is not None:
                y = y + bias.float()
        # Saved in the compute dtype, as autocast's nn.Linear would, so activation memory is the
        # same as the bf16 baseline's.
        ctx.save_for_backward(x2d.to(compute_dtype), weight)
        ctx.compute_dtype = compute_dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias = bias is not None
        return y.to(compute_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_y.device.type):
            g = grad_y.reshape(-1, grad_y.shape[-1]).to(dtype)
            if ctx.needs_input_grad[0]:
                grad_x = (g @ weight.to(dtype)).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = (g.t() @ x2d).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g.sum(dim=0).to(weight.dtype)
        return grad_x, grad_w, grad_b


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose forward GEMM runs in FP8 (see the module docstring).

    Parameters, their names and dtype (fp32 masters) are those of ``nn.Linear``.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s Parameter objects (nothing is copied or allocated,
        so this works on meta-device models and keeps optimizer references valid)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Float8LinearFunction.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=e4m3 (x 1x{BLOCK}, w {BLOCK}x{BLOCK})"


# --------------------------------------------------------------------------------- conversion
def default_skip(name: str, linear: nn.Linear) -> bool:
    """Keep in high precision: the output head, MoE routers, and very narrow inputs (K < 16),
    where an FP8 GEMM would save nothing and the alignment padding would dominate."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("output", "router") or linear.in_features < MIN_IN_FEATURES


def convert_to_float8(
    model: nn.Module, *, skip: Callable[[str, nn.Linear], bool] | None = None
) -> nn.Module:
    """Swap, in place, every plain ``nn.Linear`` not skipped for a :class:`Float8Linear`.

    ``skip(name, linear)`` returns True to leave a module alone; it replaces
    :func:`default_skip` (call that from your own to extend it).  Subclasses of ``nn.Linear``
    are never converted, since their forward may not be a plain GEMM.  The Parameter objects
    are reused, so this works before or after materialising a meta-device model, and an
    optimizer built earlier still points at the right tensors.  Returns ``model`` (or the new
    module when ``model`` is itself an eligible Linear); :func:`float8_module_names` lists
    what was converted.
    """
    skip = default_skip if skip is None else skip
    converted: list[str] = []
    kept: list[str] = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        if skip(name, module):
            kept.append(name)
            continue
        new = Float8Linear.from_linear(module)
        if not name:
            model = new
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        converted.append(name)
    logger.info(
        "FP8: converted %d Linear modules; kept %d in high precision: %s",
        len(converted), len(kept), kept,
    )
    return model


def float8_module_names(model: nn.Module) -> list[str]:
    """Names of the :class:`Float8Linear` modules in ``model``, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
