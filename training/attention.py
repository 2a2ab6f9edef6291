"""Dynamic sparse causal attention (NSA / DSA style) with a real CPU backward.

Each query attends to

(a) a local causal window: the ``window`` keys ending at itself,
    positions ``(i - window, i]``;
(b) ``topk`` key blocks (``block`` consecutive keys each) that lie entirely
    before the local window of every query of its query block, chosen by a
    cheap content score: the dot product of the query-block mean with each key
    block's mean (the "compressed block keys"). Block 0 is always chosen when it
    is a candidate (attention sink). The selection is an index computation and
    carries no gradient; the attention over the selected keys does.

Queries are processed in blocks of ``block`` queries that share one selection.
For query block ``j`` the local part is the ``W`` key blocks ending at ``j``
(``W = ceil((window - 1) / block) + 1``), masked per query to the exact window;
the candidate blocks are ``b <= j - W``, which end before the first query's
window starts, so a selected key can never also be a local key (no double
counting). Everything is unfold / index_select + batched matmuls on score tensors of
shape ``(B * H * nQB, block, (W + topk) * block)``: the cost is linear in ``N`` for fixed
``window``, ``block`` and ``topk``, and no ``N x N`` matrix is built (except for the
block score matrix ``nQB x nKB``, which is ``N^2 / block^2``, small).

``N`` need not be a multiple of ``block``: the sequence is zero-padded
internally; padded keys sit after every real query, so causality hides them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["dense_causal_attention", "dynamic_sparse_attention", "select_blocks"]


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Plain causal softmax attention via torch SDPA; q, k, v are (B, H, N, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _local_blocks(window: int, block: int, n_blocks: int) -> int:
    """Key blocks needed to cover the window of every query in a query block."""
    return min(n_blocks, (window - 1 + block - 1) // block + 1)


@torch.no_grad()
def select_blocks(
    q: torch.Tensor, k: torch.Tensor, *, window: int, block: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query block attends to beyond its local window.

    Returns ``(idx, valid)``, both (B, H, nQB, kk) with ``kk = min(topk, nKB)``:
    ``idx`` are key-block indices, ``valid`` says whether the slot is a real
    candidate (entirely before the local window of the whole query block).
    """
    B, H, N, D = q.shape
    nb = (N + block - 1) // block
    pad = nb * block - N
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad))
    # Query-block mean over real queries only; key-block mean over real keys only.
    counts = torch.full((nb,), float(block), dtype=q.dtype, device=q.device)
    counts[-1] = block - pad
    q_mean = q.view(B, H, nb, block, D).sum(3) / counts[:, None]
    k_mean = k.view(B, H, nb, block, D).sum(3) / counts[:, None]
    scores = q_mean @ k_mean.transpose(-1, -2) / math.sqrt(D)  # (B, H, nQB, nKB)
    w = _local_blocks(window, block, nb)
    j = torch.arange(nb, device=q.device)
    cand = j[None, :] <= (j[:, None] - w)  # (nQB, nKB): block before every window
    scores = scores.masked_fill(~cand, float("-inf"))
    sink = cand.clone()
    sink[:, 1:] = False
    scores = scores.masked_fill(sink, float("inf"))
    kk = min(topk, nb)
    top, idx = scores.topk(kk, dim=-1)
    valid = top > float("-inf")
    return idx, valid


def dynamic_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    block: int,
    topk: int,
) -> torch.Tensor:
    """Causal sliding-window + top-k block attention; q, k, v are (B, H, N, D)."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(
            f"q, k, v must share a (B, H, N, D) shape, got {q.shape}, {k.shape}, {v.shape}"
        )
    if window < 1 or block < 1 or topk < 0:
        raise ValueError("window and block must be >= 1 and topk >= 0")
    B, H, N, D = q.shape
    nb = (N + block - 1) // block
    pad = nb * block - N
    dev = q.device
    w = _local_blocks(window, block, nb)
    kk = min(topk, nb) if nb > w else 0  # no candidates at all when w covers everything

    idx = None
    if kk:
        idx, _ = select_blocks(
            q.detach(), k.detach(), window=window, block=block, topk=kk
        )

    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    qb = q.reshape(B * H, nb, block, D)

    # Local part: key blocks j-w+1 .. j of the front-padded keys, via one unfold (a
    # strided view with a single-op backward; fancy indexing's backward is far slower).
    def local(x: torch.Tensor) -> torch.Tensor:
        xp = F.pad(x, (0, 0, (w - 1) * block, 0)).view(B * H, nb + w - 1, block * D)
        win = xp.unfold(1, w, 1)  # (BH, nb, block*D, w), a strided view
        return win.transpose(2, 3).reshape(B * H, nb, w * block, D)

    k_loc, v_loc = local(k), local(v)
    jq = torch.arange(nb, device=dev)
    ar = torch.arange(block, device=dev)
    q_pos = jq[:, None] * block + ar  # (nQB, block)
    l_pos = (jq[:, None] - (w - 1)) * block + torch.arange(
        w * block, device=dev
    )  # (nQB, w*block)
    diff = q_pos[:, :, None] - l_pos[:, None, :]
    # l_pos < 0 are the front padding; they fall outside every window or are masked here.
    mask = (
        (l_pos[:, None, :] >= 0) & (diff >= 0) & (diff < window)
    )  # (nQB, block, w*block)

    if kk:
        # Selected part: the chosen blocks lie wholly before every local window of the
        # query block, so they are causal and disjoint from it. The number of valid slots
        # depends on the query block only (candidates are the same for every batch/head
        # and topk puts the -inf non-candidates last), so one mask serves all.
        n_valid = (jq - w + 1).clamp(min=0, max=kk)  # (nQB,)
        s_ok = torch.arange(kk, device=dev)[None, :] < n_valid[:, None]  # (nQB, kk)
        base = torch.arange(B * H, device=dev)[:, None, None] * nb
        flat = (idx.reshape(B * H, nb, kk) + base).reshape(-1)
        k_sel = (
            k.reshape(B * H * nb, block * D)
            .index_select(0, flat)
            .view(B * H, nb, kk * block, D)
        )
        v_sel = (
            v.reshape(B * H * nb, block * D)
            .index_select(0, flat)
            .view(B * H, nb, kk * block, D)
        )
        s_ok = (
            s_ok[:, None, :, None]
            .expand(nb, block, kk, block)
            .reshape(nb, block, kk * block)
        )
        keys = torch.cat([k_sel, k_loc], dim=2)
        vals = torch.cat([v_sel, v_loc], dim=2)
        mask = torch.cat([s_ok, mask], dim=2)
    else:
        keys, vals = k_loc, v_loc

    kc = keys.shape[2]
    scores = torch.bmm(
        (qb * (1.0 / math.sqrt(D))).reshape(B * H * nb, block, D),
        keys.reshape(B * H * nb, kc, D).transpose(1, 2),
    )
    # In place is safe: bmm's backward needs only its inputs. Every row keeps at least
    # its own key, so no row is fully masked.
    scores.view(B * H, nb, block, kc).masked_fill_(~mask, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), vals.reshape(B * H * nb, kc, D))
    return out.reshape(B, H, nb * block, D)[:, :, :N]
