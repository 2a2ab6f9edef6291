"""Dynamic sparse attention: shapes, causality, dense equivalence, padding, gradients, selection."""

from __future__ import annotations

import math

import pytest
import torch

from training.attention import (
    dense_causal_attention,
    dynamic_sparse_attention,
    select_blocks,
)


def _qkv(B=1, H=2, N=64, D=8, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, N, D, generator=g, dtype=dtype, requires_grad=grad)
        for _ in range(3)
    ]


def _reference(q, k, v, window, block, topk):
    """Per-query loop over the same key set, built from select_blocks; O(N^2), tests only."""
    B, H, N, D = q.shape
    idx, valid = select_blocks(q, k, window=window, block=block, topk=topk)
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                keys = set(range(max(0, i - window + 1), i + 1))
                for s in range(idx.shape[-1]):
                    if valid[b, h, i // block, s]:
                        blk = int(idx[b, h, i // block, s])
                        sel = set(range(blk * block, min(N, (blk + 1) * block)))
                        assert not (sel & keys), (
                            "selected block overlaps the local window"
                        )
                        keys |= sel
                ks = sorted(keys)
                att = torch.softmax(q[b, h, i] @ k[b, h, ks].T / math.sqrt(D), -1)
                out[b, h, i] = att @ v[b, h, ks]
    return out


@pytest.mark.parametrize("N", [64, 50])
def test_shape_and_matches_reference(N):
    q, k, v = _qkv(N=N)
    out = dynamic_sparse_attention(q, k, v, window=12, block=8, topk=2)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    ref = _reference(q, k, v, 12, 8, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,block", [(64, 8), (61, 8), (37, 16), (5, 8)])
def test_window_covering_sequence_equals_dense(N, block):
    q, k, v = _qkv(B=2, H=3, N=N, D=16)
    out = dynamic_sparse_attention(q, k, v, window=N, block=block, topk=3)
    torch.testing.assert_close(
        out, dense_causal_attention(q, k, v), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("N", [96, 90])
def test_causality(N):
    q, k, v = _qkv(N=N, D=8, seed=1)
    out = dynamic_sparse_attention(q, k, v, window=10, block=8, topk=3)
    i = 45
    k2, v2 = k.clone(), v.clone()
    k2[:, :, i + 1 :] = 100 * torch.randn_like(k2[:, :, i + 1 :])
    v2[:, :, i + 1 :] = 100 * torch.randn_like(v2[:, :, i + 1 :])
    out2 = dynamic_sparse_attention(q, k2, v2, window=10, block=8, topk=3)
    torch.testing.assert_close(out2[:, :, : i + 1], out[:, :, : i + 1], atol=0, rtol=0)


@pytest.mark.parametrize(
    "N,window,block,topk", [(16, 3, 4, 2), (15, 2, 4, 1), (16, 16, 4, 2)]
)
def test_gradcheck(N, window, block, topk):
    q, k, v = _qkv(B=1, H=2, N=N, D=4, dtype=torch.float64, seed=2, grad=True)
    fn = lambda q, k, v: dynamic_sparse_attention(
        q, k, v, window=window, block=block, topk=topk
    )
    # fast_mode checks random projections of the Jacobian (full mode takes ~1 min here).
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


def test_gradcheck_full_small():
    # Full Jacobian on a tiny case where every part is live: sink + selected block + window.
    q, k, v = _qkv(B=1, H=1, N=12, D=2, dtype=torch.float64, seed=4, grad=True)
    fn = lambda q, k, v: dynamic_sparse_attention(q, k, v, window=2, block=3, topk=2)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5)


def test_backward_float32_runs():
    q, k, v = _qkv(N=100, D=8, grad=True)
    dynamic_sparse_attention(
        q, k, v, window=16, block=8, topk=2
    ).square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_selection_is_content_dependent():
    torch.manual_seed(3)
    B, H, N, D, block = 1, 1, 256, 16, 16
    q = 0.01 * torch.randn(B, H, N, D)
    k = 0.01 * torch.randn(B, H, N, D)
    v = torch.zeros(B, H, N, D)
    direction = torch.zeros(D)
    direction[0] = 1.0
    target = 5  # a distant block (keys 80..95); the last query block is 15
    q[:, :, -block:] += 4 * direction
    k[:, :, target * block : (target + 1) * block] += 4 * direction
    v[:, :, target * block : (target + 1) * block, 1] = 1.0

    idx, valid = select_blocks(q, k, window=16, block=block, topk=2)
    chosen = set(idx[0, 0, -1][valid[0, 0, -1]].tolist())
    assert chosen == {0, target}  # the sink plus the aligned block

    out = dynamic_sparse_attention(q, k, v, window=16, block=block, topk=2)
    assert (
        out[0, 0, -1, 1] > 0.9
    )  # the last query's output is dominated by the target's values
    # Move the alignment to another block: the selection follows the content.
    k2 = k.clone()
    k2[:, :, target * block : (target + 1) * block] -= 4 * direction
    k2[:, :, 9 * block : 10 * block] += 4 * direction
    idx2, valid2 = select_blocks(q, k2, window=16, block=block, topk=2)
    assert set(idx2[0, 0, -1][valid2[0, 0, -1]].tolist()) == {0, 9}
    out2 = dynamic_sparse_attention(q, k2, v, window=16, block=block, topk=2)
    assert out2[0, 0, -1, 1].abs() < 1e-3


def test_bad_shapes_rejected():
    q, k, v = _qkv(N=8)
    with pytest.raises(ValueError):
        dynamic_sparse_attention(q, k[:, :, :4], v, window=4, block=4, topk=1)
