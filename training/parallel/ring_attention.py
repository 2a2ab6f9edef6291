"""Causal ring attention over the ``cp`` ranks, with zig-zag load balancing (CPU/gloo).

PyTorch's ``context_parallel`` has no CPU kernel, so this is the algorithm written out.
Every cp rank holds a slice of the sequence's queries, keys and values, (B, H, N/cp, D).
Keys and values travel round the ring (rank r sends to r + 1, receives from r - 1) with
point-to-point ``batch_isend_irecv``; the next block's transfer is posted before the
current block is computed, so the two overlap. Each rank merges the partial outputs of
the blocks it sees with their log-sum-exps (``o = Σ exp(lse_i - lse) o_i``, ``lse =
logaddexp(lse_i)``), so no rank ever holds an N x N score matrix or all the keys.

Zig-zag: a causal sequence cut into ``cp`` contiguous pieces gives the last rank ``cp``
times the work of the first (it attends to everything before it). Cut into ``2·cp``
chunks instead, rank ``r`` holding chunks ``r`` and ``2·cp - 1 - r``, every rank has the
same number of unmasked (query, key) pairs. A (query chunk, key chunk) pair is computed
in full when the key chunk is earlier, with the causal mask when it is the same chunk,
and skipped when it is later, so a rank does exactly its share of the triangle.

Backward (custom, as FlashAttention's): the forward keeps only q, k, v, the output and
its log-sum-exp. The ring runs again; each rank recomputes the probabilities of a block
from the saved (merged) lse, adds its dQ locally, and the block's dK and dV travel round
the ring with their K and V, arriving back at their owner after the last step.

Each block runs ATen's CPU flash-attention kernel and its backward
(``_scaled_dot_product_flash_attention_for_cpu``: tiled, it returns the log-sum-exp), in
fp32 whatever the input dtype, cast back at the end. A first version with the block's
scores written out as matmuls was about 3-5x slower than one process's SDPA and held an
(N/2cp)² score matrix per head (bench/context_parallel.py, notes/cp.md).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ring_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard"]


# ----------------------------------------------------------------- zig-zag layout
def _check_divisible(n: int, cp: int) -> int:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, not {cp}")
    if n % (2 * cp):
        raise ValueError(f"zig-zag context parallel needs the sequence length ({n}) to be a multiple "
                         f"of 2·cp = {2 * cp}")
    return n // (2 * cp)


def zigzag_positions(n: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (N/cp,) of the tokens rank ``rank`` holds: chunks ``rank`` and ``2·cp-1-rank``."""
    c = _check_divisible(n, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside 0..{cp - 1}")
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s zig-zag share of ``x`` along ``dim`` (a copy, contiguous)."""
    positions = zigzag_positions(x.shape[dim], cp, rank, x.device)
    return x.index_select(dim, positions)


def zigzag_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's share, ``parts[r]`` being rank r's (inverse of zigzag_shard)."""
    cp = len(parts)
    if cp == 0:
        raise ValueError("no parts to unshard")
    n = parts[0].shape[dim] * cp
    positions = torch.cat([zigzag_positions(n, cp, r, parts[0].device) for r in range(cp)])
    whole = torch.cat(parts, dim=dim)
    inverse = torch.empty_like(positions)
    inverse[positions] = torch.arange(n, device=positions.device)
    return whole.index_select(dim, inverse)


# --------------------------------------------------------------------- the ring
class _Ring:
    """Point-to-point transfers to the next rank of the cp group, from the previous one."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size

    def start(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list]:
        """Post ``send`` to the next rank and a receive of the same shape from the previous one.

        Transfers in flight together (keys and their gradients) get different tags: they have
        the same shape, and must not be matched to each other's receives."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: list) -> None:
        for req in requests:
            req.wait()


def _chunk_pairs(rank: int, source: int, cp: int):
    """(query half, key half, causal) for the blocks of rank ``rank``'s queries against rank
    ``source``'s keys that are not entirely in the future; halves are 0 (first chunk) or 1."""
    ids = lambda r: (r, 2 * cp - 1 - r)  # noqa: E731 - the two chunk ids of rank r
    for qi, qc in enumerate(ids(rank)):
        for ki, kc in enumerate(ids(source)):
            if kc < qc:
                yield qi, ki, False
            elif kc == qc:
                yield qi, ki, True


def _block_forward(q, k, v, causal: bool, scale: float):
    """Softmax attention of one (query chunk, key chunk) pair: (out, lse (..., L, 1)), fp32.

    ATen's CPU flash-attention kernel (tiled: no L x L score matrix; it returns the
    log-sum-exp the merge needs). ``causal`` only on the diagonal pair, whose chunks are
    aligned, so its top-left causal mask is the global one."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse.unsqueeze(-1)


def _block_backward(d_out, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one pair's share of the loss, given the *merged* output and lse of the
    query chunk: the kernel's P = exp(S - lse) and delta = rowsum(dO * O) are then the full
    softmax's, restricted to this key chunk (FlashAttention's backward, one block at a time)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q.contiguous(), k.contiguous(), v.contiguous(), out, lse.squeeze(-1).contiguous(), 0.0, causal,
        scale=scale)


def _merge(out, lse, block_out, block_lse):
    """Merge a block's partial output into the running one, in place of a softmax over both."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new) + block_out * torch.exp(block_lse - new), new


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    # The blocks run in fp32 by design: autocast would recast their matmuls.
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = t.shape[-2] // 2
    return t[..., :c, :], t[..., c:, :]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        with _no_autocast(q.device.type):
            return _RingAttention._forward(ctx, q, k, v, group, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        with _no_autocast(d_out.device.type):
            return _RingAttention._backward(ctx, d_out)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale):
        ring = _Ring(group)
        cp, rank = ring.size, ring.rank
        dtype = q.dtype
        q, k, v = (t.float().contiguous() for t in (q, k, v))
        qh = _halves(q)
        out = [torch.zeros_like(h) for h in qh]
        lse = [torch.full((*h.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device) for h in qh]
        kv = torch.stack([k, v])
        for step in range(cp):
            pending = None
            if step < cp - 1:  # the next block's keys travel while this one is computed
                nxt, pending = ring.start(kv)
            source = (rank - step) % cp
            kh, vh = _halves(kv[0]), _halves(kv[1])
            for qi, ki, causal in _chunk_pairs(rank, source, cp):
                o, l = _block_forward(qh[qi], kh[ki], vh[ki], causal, scale)
                out[qi], lse[qi] = _merge(out[qi], lse[qi], o, l)
            if pending is not None:
                ring.wait(pending)
                kv = nxt
        out, lse = torch.cat(out, dim=-2), torch.cat(lse, dim=-2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.dtype = group, scale, dtype
        return out.to(dtype)

    @staticmethod
    def _backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank, scale = ring.size, ring.rank, ctx.scale
        d_out = d_out.float().contiguous()
        qh, doh, outh, lseh = _halves(q), _halves(d_out), _halves(out), _halves(lse)
        doh, outh = [h.contiguous() for h in doh], [h.contiguous() for h in outh]
        dq = [torch.zeros_like(h) for h in qh]
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradients of the keys and values now held
        for step in range(cp):
            pending = None
            if step < cp - 1:
                nxt, pending = ring.start(kv)
            source = (rank - step) % cp
            kh, vh = _halves(kv[0]), _halves(kv[1])
            dkh, dvh = _halves(dkv[0]), _halves(dkv[1])
            for qi, ki, causal in _chunk_pairs(rank, source, cp):
                dq_, dk_, dv_ = _block_backward(doh[qi], qh[qi], kh[ki], vh[ki], outh[qi], lseh[qi], causal, scale)
                dq[qi].add_(dq_)
                dkh[ki].add_(dk_)
                dvh[ki].add_(dv_)
            # The gradients follow their keys: after the last step they travel once more,
            # from the rank before the owner to the owner.
            dkv, grad_requests = ring.start(dkv, tag=1)
            if pending is not None:
                ring.wait(pending)
                kv = nxt
            ring.wait(grad_requests)
        dq = torch.cat(dq, dim=-2).to(ctx.dtype)
        return dq, dkv[0].to(ctx.dtype), dkv[1].to(ctx.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag share of a sequence over the whole sequence.

    ``q, k, v`` are (B, H, N/cp, D): this rank's tokens in :func:`zigzag_shard` order, for the
    ranks of ``group`` (the default group when None). Returns this rank's share of
    ``F.scaled_dot_product_attention(Q, K, V, is_causal=True)`` of the whole sequence, with
    gradients to every rank's q, k and v.
    """
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must share a (B, H, N/cp, D) shape, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-2] % 2:
        raise ValueError(f"a zig-zag share holds two equal chunks: its length {q.shape[-2]} must be even")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _RingAttention.apply(q, k, v, group, scale)
