"""FP8 (DeepSeek-V3 fine-grained) Linear: quantisation error, forward/backward, conversion, dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training import fp8
from training.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Float8Linear,
    convert_to_float8,
    default_skip,
    dequantize_blocks,
    dequantize_tiles,
    float8_module_names,
    quantize_blocks,
    quantize_tiles,
)
from training.model import ModelArgs, Transformer

torch.set_num_threads(min(2, torch.get_num_threads()))

# e4m3: 3 mantissa bits, so normal values v (|v| >= 2^-6) lie on a grid of spacing 2^(e-3) with
# 2^e <= |v|, and rounding to nearest errs by at most half of it: 2^-4 |v|.  Below 2^-6 the grid
# is the subnormal one, spacing 2^-9, error <= 2^-10.  Dequantising multiplies by the tile scale
# s, hence |x_hat - x| <= 2^-4 |x| + 2^-10 s.  FP32_SLACK covers the rounding of x / s and q * s.
REL_BOUND = 2.0**-4
SUBNORMAL_BOUND = 2.0**-10
FP32_SLACK = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tile_scales_per_element(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def small_args(**kw) -> ModelArgs:
    base = {"vocab_size": 64, "dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden": 256,
            "max_seq_len": 64}
    base.update(kw)
    return ModelArgs(**base)


# ----------------------------------------------------------------------------- quantisation
def outlier_data(gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(32, 512, generator=gen)
    x[0, :BLOCK] *= 1e5  # one tile of huge activations, as on an outlier token/channel
    return x


@pytest.mark.parametrize("kind", ["normal", "outlier"])
def test_tile_quantisation_error_within_derived_bound(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=gen) if kind == "normal" else outlier_data(gen)
    q, scale = quantize_tiles(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    x_hat = dequantize_tiles(q, scale, x.shape[1])
    s = tile_scales_per_element(scale, x.shape[1])
    err = (x_hat - x).abs()
    bound = (REL_BOUND + FP32_SLACK) * x.abs() + SUBNORMAL_BOUND * s
    assert (err <= bound).all(), (err / bound).max()
    # Each tile's largest element maps onto the top of the e4m3 range, hence is kept exactly.
    tiles = F.pad(x, (0, -x.shape[1] % BLOCK)).view(x.shape[0], -1, BLOCK)
    torch.testing.assert_close(scale, tiles.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    # ... and it really quantises: normal-range errors come close to the bound.
    normal = x.abs() >= 2.0**-6 * s
    assert (err[normal] / x.abs()[normal]).max() > REL_BOUND / 2


def test_per_tile_scaling_beats_per_tensor_on_outliers():
    x = outlier_data(torch.Generator().manual_seed(1))
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[0, :BLOCK] = False  # judge the elements that merely share a tensor with the outliers

    q, scale = quantize_tiles(x)
    per_tile = dequantize_tiles(q, scale, x.shape[1])
    s = x.abs().max() / FP8_MAX
    per_tensor = (x / s).to(FP8_DTYPE).float() * s

    err_tile = rel_err(per_tile[rest], x[rest])
    err_tensor = rel_err(per_tensor[rest], x[rest])
    assert err_tile < REL_BOUND
    # One scale for the whole tensor pushes ordinary values into e4m3's subnormals / zero.
    assert err_tensor > 0.25 and err_tensor > 10 * err_tile, (err_tensor, err_tile)


def test_partial_tiles_and_blocks():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 200, generator=gen)
    q, scale = quantize_tiles(x)
    assert q.shape == (5, 256) and scale.shape == (5, 2)
    assert (q[:, 200:].float() == 0).all()  # padding adds nothing to the GEMM
    torch.testing.assert_close(scale[:, 1], x[:, 128:].abs().amax(-1) / FP8_MAX, rtol=0, atol=0)

    w = torch.randn(72, 200, generator=gen)
    wq, wscale = quantize_blocks(w)
    assert wq.shape == (128, 256) and wscale.shape == (1, 2)
    torch.testing.assert_close(wscale[0, 1], w[:, 128:].abs().amax() / FP8_MAX, rtol=0, atol=0)
    w_hat = dequantize_blocks(wq, wscale, w.shape)
    assert w_hat.shape == w.shape
    assert ((w_hat - w).abs() <= (REL_BOUND + FP32_SLACK) * w.abs() + SUBNORMAL_BOUND * wscale.max()).all()


def test_all_zero_tile_is_finite():
    x = torch.zeros(3, 130)
    x[1, 129] = 2.0
    q, scale = quantize_tiles(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    x_hat = dequantize_tiles(q, scale, 130)
    assert torch.equal(x_hat, x)  # zeros stay zero, 2.0 is its tile's amax: exact
    wq, ws = quantize_blocks(torch.zeros(20, 20))
    assert torch.equal(dequantize_blocks(wq, ws, (20, 20)), torch.zeros(20, 20))


# ------------------------------------------------------------------------- forward/backward
@pytest.mark.parametrize(
    "shape_in, k, n, bias",
    [((256, 512), 512, 512, False), ((2, 19, 200), 200, 72, True)],
    ids=["256x512x512", "partial-200x72"],
)
def test_forward_close_to_fp32_and_exactly_the_scheme(shape_in, k, n, bias):
    torch.manual_seed(3)
    lin = nn.Linear(k, n, bias=bias)
    f8 = Float8Linear.from_linear(lin)
    x = torch.randn(shape_in)
    y, y_ref = f8(x), lin(x)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    err = rel_err(y, y_ref)
    assert 1e-3 < err < 5e-2, err
    # Exactly dequant(1x128 tiles of x) @ dequant(128x128 blocks of W).T (+ b), up to fp32 order.
    x2d = x.reshape(-1, k)
    expect = dequantize_tiles(*quantize_tiles(x2d), k) @ dequantize_blocks(
        *quantize_blocks(lin.weight), lin.weight.shape).t()
    if bias:
        expect = expect + lin.bias
    torch.testing.assert_close(y.reshape(-1, n), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_backward_is_high_precision_and_equals_linear(bias):
    torch.manual_seed(4)
    lin = nn.Linear(200, 72, bias=bias)
    f8 = Float8Linear(200, 72, bias=bias)
    f8.load_state_dict(lin.state_dict())
    x = torch.randn(3, 17, 200)
    x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_y = torch.randn(3, 17, 72)
    lin(x_ref).backward(grad_y)
    f8(x_f8).backward(grad_y)
    torch.testing.assert_close(x_f8.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f8.weight.grad, lin.weight.grad, rtol=1e-5, atol=1e-6)
    if bias:
        torch.testing.assert_close(f8.bias.grad, lin.bias.grad, rtol=1e-5, atol=1e-6)
    assert f8.weight.dtype == f8.weight.grad.dtype == torch.float32


def test_autocast_bf16_matches_linear_dtypes():
    torch.manual_seed(5)
    lin = nn.Linear(256, 128)
    f8 = Float8Linear(256, 128)
    f8.load_state_dict(lin.state_dict())
    for in_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8, 256, dtype=in_dtype)
        xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ref, y = lin(xr), f8(xf)
            assert y.dtype == y_ref.dtype == torch.bfloat16
            assert rel_err(y, y_ref) < 5e-2
            y_ref.float().sum().backward()
            y.float().sum().backward()
        assert xf.grad.dtype == in_dtype
        torch.testing.assert_close(xf.grad, xr.grad, rtol=2e-2, atol=1e-2)
        assert f8.weight.grad.dtype == torch.float32
        torch.testing.assert_close(f8.weight.grad, lin.weight.grad, rtol=2e-2, atol=1e-2)
        lin.zero_grad(), f8.zero_grad()


# ---------------------------------------------------------------------------------- dispatch
def test_cpu_dispatch_uses_emulation_never_scaled_mm(monkeypatch):
    assert not fp8._use_scaled_mm(torch.empty(2))
    assert not fp8._use_scaled_mm(torch.empty(2, device="meta"))

    def fail(*a, **kw):
        raise AssertionError("torch._scaled_mm called on CPU")

    monkeypatch.setattr(torch, "_scaled_mm", fail)
    y = Float8Linear(64, 32)(torch.randn(4, 64))
    assert torch.isfinite(y).all()


def test_scaled_mm_chunk_loop_matches_emulation_on_cpu_kernel():
    # The CUDA path's chunking, padding and rescaling, checked with the (slow) CPU FP8 GEMM.
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(20, 200, generator=gen), torch.randn(72, 200, generator=gen)
    y = fp8._matmul_scaled_mm(x, w)
    assert y.shape == (20, 72)
    torch.testing.assert_close(y, fp8._matmul_emulated(x, w), rtol=1e-5, atol=1e-4)


def _fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_cuda(), reason="needs a CUDA GPU with compute capability >= 8.9 (FP8 tensor cores)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_scaled_mm_matches_emulation(dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, 1000, device="cuda", generator=gen).to(dtype)
    w = torch.randn(200, 1000, device="cuda", generator=gen)
    assert fp8._use_scaled_mm(x)
    y = fp8.fp8_matmul(x, w)
    assert y.dtype == torch.float32 and y.shape == (300, 200)
    assert rel_err(y, fp8._matmul_emulated(x, w)) < 1e-2
    assert rel_err(y, x.float() @ w.t()) < 5e-2

    lin = nn.Linear(1000, 200, device="cuda")
    f8 = Float8Linear.from_linear(lin)
    xg = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = f8(xg)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert xg.grad.dtype == dtype and lin.weight.grad.dtype == torch.float32


# -------------------------------------------------------------------------------- conversion
DENSE_FP8 = [f"layers.{i}.{m}" for i in range(2) for m in
             ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
              "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def test_convert_dense_transformer_keeps_params_and_keys():
    model = build(small_args())
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    assert convert_to_float8(model) is model
    assert float8_module_names(model) == DENSE_FP8
    assert type(model.output) is nn.Linear  # head stays high precision
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())  # same Parameter objects
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_convert_moe_skips_router_converts_experts():
    model = build(small_args(ffn="moe", n_experts=4, moe_topk=2, moe_hidden=64))
    convert_to_float8(model)
    names = float8_module_names(model)
    assert "layers.0.feed_forward.experts.3.w2" in names
    assert not any("router" in n for n in names)
    assert type(model.layers["0"].feed_forward.router) is nn.Linear
    logits = model(torch.randint(0, 64, (2, 16)))
    assert torch.isfinite(logits).all()


def test_skip_rules():
    seq = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    convert_to_float8(seq)
    assert float8_module_names(seq) == ["1", "2"]  # in_features 8 < 16 skipped
    assert default_skip("layers.0.feed_forward.router", nn.Linear(64, 4))
    seq = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_float8(seq, skip=lambda name, lin: name == "0")  # replaces the default
    assert float8_module_names(seq) == ["1"]
    assert isinstance(convert_to_float8(nn.Linear(32, 32)), Float8Linear)


def test_meta_conversion_and_cross_precision_checkpoints():
    args = small_args()
    with torch.device("meta"):
        meta_model = Transformer(args)
    convert_to_float8(meta_model)
    assert float8_module_names(meta_model) == DENSE_FP8
    meta_model.to_empty(device="cpu")
    meta_model.init_weights(seed=0)

    late = convert_to_float8(build(args, seed=0))
    plain = build(args, seed=0)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(meta_model(tokens), late(tokens), rtol=0, atol=0)

    # fp32 checkpoint -> fp8 model and back, strict.
    other = convert_to_float8(build(args, seed=1))
    other.load_state_dict(plain.state_dict())
    torch.testing.assert_close(other(tokens), late(tokens), rtol=0, atol=0)
    plain2 = build(args, seed=1)
    plain2.load_state_dict(late.state_dict())
    torch.testing.assert_close(plain2(tokens), plain(tokens), rtol=0, atol=0)
    err = rel_err(late(tokens), plain(tokens))
    assert 0 < err < 5e-2, err


def test_fp8_training_reduces_loss_like_fp32():
    args = small_args()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(9))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    losses = {}
    for name in ("fp32", "fp8"):
        model = build(args, seed=0)
        if name == "fp8":
            convert_to_float8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        hist = []
        for _ in range(8):
            loss = F.cross_entropy(model(inp).reshape(-1, 64), tgt.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            hist.append(loss.item())
        losses[name] = hist
        if name == "fp8":
            assert all(p.dtype == torch.float32 for p in model.parameters())
            state = opt.state[model.layers["0"].attention.wq.weight]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    fp8_hist, fp32_hist = losses["fp8"], losses["fp32"]
    assert fp8_hist[-1] < fp8_hist[0] - 0.5, fp8_hist
    assert abs(fp8_hist[-1] - fp32_hist[-1]) < 0.1 * fp32_hist[-1], (fp8_hist, fp32_hist)
