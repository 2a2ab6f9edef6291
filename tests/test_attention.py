"""Dynamic sparse attention: shapes, causality, dense equivalence, padding, gradients, selection."""

from __future__ import annotations

import math

import pytest
import torch

from training.attention import (
    decode_step,
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


@pytest.mark.parametrize("t", [700, 640, 703, 704])
def test_future_queries_keys_values_leave_the_past_unchanged(t):
    # The leak this guards against: query blocks once ranked key blocks with the mean of
    # all their queries, so at t=700 the outputs at 640..699 moved with q at 700..703.
    # Selection happens here (window + topk * block < N), at every block offset of t.
    N, window, block, topk = 1024, 64, 64, 2
    q, k, v = _qkv(B=2, H=4, N=N, D=16, seed=11)
    out = dynamic_sparse_attention(q, k, v, window=window, block=block, topk=topk)
    g = torch.Generator().manual_seed(12)
    for which in ("q", "qkv"):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for name, x in (("q", q2), ("k", k2), ("v", v2)):
            if name in which:
                x[:, :, t:] = 10 * torch.randn(x[:, :, t:].shape, generator=g)
        out2 = dynamic_sparse_attention(q2, k2, v2, window=window, block=block, topk=topk)
        torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], atol=0, rtol=0)
        assert not torch.equal(out2[:, :, t:], out[:, :, t:])


def test_selection_uses_no_query_after_the_block_start():
    # Each query block's selection may depend only on queries at or before its first
    # position (the earliest member): perturbing q anywhere later leaves it unchanged.
    N, window, block, topk = 512, 32, 32, 3
    q, k, _ = _qkv(B=1, H=4, N=N, D=16, seed=13)
    idx, valid = select_blocks(q, k, window=window, block=block, topk=topk)
    g = torch.Generator().manual_seed(14)
    for t in range(1, N, 23):
        q2 = q.clone()
        q2[:, :, t:] = 10 * torch.randn(q2[:, :, t:].shape, generator=g)
        idx2, valid2 = select_blocks(q2, k, window=window, block=block, topk=topk)
        keep = (t - 1) // block + 1  # blocks whose first position is < t
        assert torch.equal(valid2[:, :, :keep], valid[:, :, :keep])
        assert torch.equal(
            idx2[:, :, :keep][valid[:, :, :keep]], idx[:, :, :keep][valid[:, :, :keep]]
        )


def test_prefix_selects_and_attends_as_the_whole_sequence():
    # Decoding recomputes (or caches) a prefix: every output of a prefix must equal the
    # full sequence's output at the same position, for prefixes ending anywhere in a block.
    N, window, block, topk = 300, 24, 16, 3
    q, k, v = _qkv(B=1, H=3, N=N, D=8, seed=15)
    full = dynamic_sparse_attention(q, k, v, window=window, block=block, topk=topk)
    for n in (1, 15, 16, 17, 64, 100, 161, 250, 299):
        part = dynamic_sparse_attention(
            q[:, :, :n], k[:, :, :n], v[:, :, :n], window=window, block=block, topk=topk
        )
        torch.testing.assert_close(part, full[:, :, :n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window,block,topk", [(24, 16, 3), (16, 16, 2), (5, 4, 1), (40, 8, 0)])
def test_decode_step_from_a_cache_equals_the_full_forward(window, block, topk):
    # One token at a time, from cached queries, keys and values: the same outputs as the
    # whole sequence at once, at every position (so also at every block offset).
    N = 200
    q, k, v = _qkv(B=2, H=3, N=N, D=8, seed=16)
    full = dynamic_sparse_attention(q, k, v, window=window, block=block, topk=topk)
    for i in range(N):
        step = decode_step(
            q[:, :, : i + 1], k[:, :, : i + 1], v[:, :, : i + 1],
            window=window, block=block, topk=topk,
        )
        torch.testing.assert_close(step, full[:, :, i : i + 1], atol=1e-6, rtol=1e-6)


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


# --- The chunked kernel against a plain masked-softmax reference --------------------------


def _masked_dense(q, k, v, window, block, topk):
    """Dense attention under the N x N mask of the keys each query may see (the window plus
    its query block's selected blocks); autograd differentiates it. O(N^2), tests only."""
    B, H, N, D = q.shape
    idx, valid = select_blocks(q, k, window=window, block=block, topk=topk)
    nb = (N + block - 1) // block
    chosen = torch.zeros(B, H, nb, nb, dtype=torch.int32)
    chosen.scatter_add_(-1, idx, valid.int())  # invalid slots may repeat a real index
    blk = torch.arange(N) // block
    selected = chosen[:, :, blk][:, :, :, blk] > 0  # (B, H, N, N)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = selected | ((j <= i) & (i - j < window))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _set_chunk(monkeypatch, *, N, window, block, topk, blocks_per_chunk):
    """Make the CPU kernel work in chunks of ``blocks_per_chunk`` query blocks (more
    than a head has: several heads per chunk). Test sizes then still span many chunks,
    threads, and both masks (the early query blocks' own and the shared one)."""
    from training import attention

    nb = (N + block - 1) // block
    w = attention._local_blocks(window, block, nb)
    slots = w + (min(topk, nb) if nb > w else 0)
    scores = blocks_per_chunk * block * slots * block
    monkeypatch.setattr(attention, "_CPU_CHUNK_SCORES", scores)


@pytest.mark.parametrize(
    "B,H,N,D,window,block,topk",
    [
        (2, 3, 50, 8, 12, 8, 2),  # N not a multiple of block, B > 1 and H > 1
        (1, 2, 64, 8, 9, 8, 20),  # topk larger than the blocks there are
        (2, 2, 96, 16, 16, 16, 3),  # window a multiple of block
        (1, 1, 40, 4, 1, 4, 0),  # window 1, no selection: each query sees itself only
        (1, 2, 33, 8, 100, 8, 2),  # window covers everything
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("per_chunk", ["one block", "two heads"])
def test_matches_masked_dense_forward_and_backward(
    B, H, N, D, window, block, topk, threads, per_chunk, monkeypatch
):
    bpc = 1 if per_chunk == "one block" else 2 * ((N + block - 1) // block)
    _set_chunk(
        monkeypatch, N=N, window=window, block=block, topk=topk, blocks_per_chunk=bpc
    )
    q, k, v = _qkv(B=B, H=H, N=N, D=D, dtype=torch.float64, seed=5, grad=True)
    g = torch.randn(
        B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    )
    ref = _masked_dense(q, k, v, window, block, topk)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = dynamic_sparse_attention(q, k, v, window=window, block=block, topk=topk)
        grads = torch.autograd.grad(out, (q, k, v), g)
        assert torch.get_num_threads() == threads  # the kernel restores the setting
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("N,window,block,topk", [(30, 5, 4, 2), (16, 4, 4, 9)])
def test_gradcheck_chunked_multihead(N, window, block, topk, monkeypatch):
    _set_chunk(
        monkeypatch, N=N, window=window, block=block, topk=topk, blocks_per_chunk=1
    )
    q, k, v = _qkv(B=2, H=2, N=N, D=4, dtype=torch.float64, seed=7, grad=True)
    fn = lambda q, k, v: dynamic_sparse_attention(
        q, k, v, window=window, block=block, topk=topk
    )
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


def test_gradients_reproducible_across_runs(monkeypatch):
    # Threads pull work dynamically, but each head's key gradients are summed by one
    # thread in a fixed order, so repeated runs agree bit for bit.
    _set_chunk(monkeypatch, N=200, window=24, block=8, topk=3, blocks_per_chunk=2)
    q, k, v = _qkv(B=2, H=2, N=200, D=8, seed=8, grad=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(3):
            out = dynamic_sparse_attention(q, k, v, window=24, block=8, topk=3)
            runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


def test_non_contiguous_inputs():
    # The model passes q, k, v as (B, H, N, D) transposes of (B, N, H, D) projections.
    q, k, v = (t.transpose(1, 2) for t in _qkv(B=2, H=40, N=4, D=8, seed=9))
    assert not q.is_contiguous()
    out = dynamic_sparse_attention(q, k, v, window=6, block=8, topk=2)
    ref = dynamic_sparse_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), window=6, block=8, topk=2
    )
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_autocast_bfloat16_runs_and_tracks_float32():
    q, k, v = _qkv(B=1, H=2, N=96, D=16, seed=10, grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dynamic_sparse_attention(q, k, v, window=16, block=8, topk=2)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(
        t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()
        for t in (q, k, v)
    )
    ref = dynamic_sparse_attention(q, k, v, window=16, block=8, topk=2)
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


def test_two_python_threads_at_once_get_the_serial_results_and_the_thread_count_comes_back():
    """Torch's thread count is process-wide and the CPU path sets it to 1 while its own
    threads run: overlapping calls must not change results or leave the count changed."""
    from concurrent.futures import ThreadPoolExecutor

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that every call takes the threaded path here
    try:
        inputs = [_qkv(B=1, H=2, N=256, D=16, seed=s) for s in range(4)]
        expected = [dynamic_sparse_attention(*qkv, window=32, block=16, topk=2) for qkv in inputs]
        with ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                got = list(pool.map(lambda qkv: dynamic_sparse_attention(*qkv, window=32, block=16, topk=2), inputs))
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
