"""Context parallel: the sequence of every row sharded over the ``cp`` ranks.

Two attention kernels, one per ``model.attention``:

- dense: :mod:`training.parallel.ring_attention`, keys and values round a ring, the
  sequence laid out zig-zag so that every rank has the same share of the causal triangle;
- sparse: :func:`sharded_sparse_attention`, the dynamic sparse attention of
  :mod:`training.attention` with the sequence in contiguous shards. Its cost per query is
  at most ``window + topk·block`` keys (less only in the first blocks of a sequence, which
  have fewer candidates), so contiguous shards are balanced without zig-zag, and a query's
  local window lies on its own rank or the ones just before it.

Sharded sparse attention, per rank (``n = N/cp`` queries, a whole number of blocks):

1. selection: every rank means its own key blocks (``n/block`` vectors per head) and
   all-gathers those summaries, never the keys; each local query block ranks the candidate
   blocks with its first query exactly as :func:`training.attention.rank_key_blocks` does;
2. one exchange (``all_to_all_single`` with uneven splits) fetches the key/value blocks a
   rank needs and does not hold: the halo (the ``W - 1`` blocks before its shard that its
   first query blocks' local windows reach into) and the selected blocks, each distinct
   (head, block) once; the backward returns their gradients to the owners the same way;
3. attention over each query block's table (selected blocks, then its local blocks) under
   the single-process op's mask, chunked as the single-process kernel is (the forward keeps
   only its output; the backward recomputes the probabilities).

So a rank gathers ``N/block`` summary vectors per head and fetches at most
``window + topk·block`` keys per query block it holds, each distinct block once: at most
``halo + topk·N/cp`` keys, and never more than the keys before its shard. It never gathers all
``N`` keys. (Measured with random inputs, which spread the selection widest: the last of 4
ranks at N = 16384, block 64, topk 4 fetched 6816 keys per head of the 12288 before it.)

Model integration goes through two parallelism-agnostic hooks of :mod:`training.model`
(``Attention.kernel`` and ``Transformer.rope_positions``): in training mode the layers
attend over the sharded sequence with the tokens' global positions; in eval mode every rank
runs whole rows, as a single process does. Each dp rank takes its documents
(``batches.local_batch``), each of its cp ranks a share of every row's positions (targets and
loss mask split the same way). Gradients are averaged over dp × cp ranks together (DDP or
FSDP2 over the flattened mesh, :func:`apply_context_parallel`), so each rank scales its loss
by ``dp × cp × local target tokens / global target tokens``; the batch loss and the
per-document losses are sums over the ranks (:meth:`ContextParallel.document_stats`), written
by cp rank 0. Ghost gradient norms add each document's per-layer parts over the cp ranks
before squaring (``training.grad_norms``): its norm is not a sum of per-rank norms.
Under pp, :func:`context_parallel` installs the kernels on the stages' layers and
``training.parallel.pipeline`` wraps each stage over dp × cp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from assay.errors import AssayError
from training.attention import _check_arguments, _local_blocks, _no_autocast, _score_bias, dynamic_sparse_attention
from training.data import Batch
from training.parallel.batches import LocalBatch, local_batch
from training.parallel.ring_attention import ring_attention, zigzag_positions

# Score elements per chunk of query blocks: 2 MiB of fp32 scores stay in a core's L2 through
# the softmax and its gradient (the single-process kernel's choice, training.attention).
_CHUNK_SCORES = 1 << 19

__all__ = ["ContextParallel", "apply_context_parallel", "context_parallel", "contiguous_positions",
           "sharded_sparse_attention"]


def contiguous_positions(n: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (N/cp,) of rank ``rank``'s contiguous shard of a length-``n`` sequence."""
    if n % cp:
        raise ValueError(f"the sequence length {n} is not a multiple of cp = {cp}")
    m = n // cp
    return torch.arange(rank * m, (rank + 1) * m, device=device)


# ------------------------------------------------------------ fetching key blocks
class _FetchRows(torch.autograd.Function):
    """Rows of other ranks' tables: forward sends the rows each rank asked for, backward
    sends their gradients back and adds them to the owner's rows."""

    @staticmethod
    def forward(ctx, table, wanted_counts, asked_rows, asked_counts, group):
        # ``asked_rows``: rows of my table that others asked for, grouped by asking rank.
        fetched = table.new_empty(sum(wanted_counts), table.shape[1])
        dist.all_to_all_single(fetched, table.index_select(0, asked_rows).contiguous(), wanted_counts,
                               asked_counts, group=group)
        ctx.save_for_backward(asked_rows)
        ctx.rows, ctx.wanted_counts, ctx.asked_counts, ctx.group = table.shape[0], wanted_counts, asked_counts, group
        return fetched

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_fetched):
        (asked_rows,) = ctx.saved_tensors
        d_sent = d_fetched.new_empty(len(asked_rows), d_fetched.shape[1])
        dist.all_to_all_single(d_sent, d_fetched.contiguous(), ctx.asked_counts, ctx.wanted_counts, group=ctx.group)
        d_table = d_fetched.new_zeros(ctx.rows, d_fetched.shape[1])
        d_table.index_add_(0, asked_rows, d_sent)
        return d_table, None, None, None, None


def _exchange_requests(owner: torch.Tensor, rows: torch.Tensor, cp: int,
                       group) -> tuple[list[int], torch.Tensor, list[int]]:
    """``rows`` (sorted by ``owner``) are wanted from ``owner``; returns (counts I want from each
    rank, the rows of my table others want, grouped by asking rank, how many each asks)."""
    wanted = torch.bincount(owner, minlength=cp)
    asked = torch.empty_like(wanted)
    dist.all_to_all_single(asked, wanted, group=group)
    wanted_counts, asked_counts = wanted.tolist(), asked.tolist()
    asked_rows = rows.new_empty(sum(asked_counts))
    dist.all_to_all_single(asked_rows, rows.contiguous(), asked_counts, wanted_counts, group=group)
    return wanted_counts, asked_rows, asked_counts


# ------------------------------------------------------- sharded sparse attention
def sharded_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, block: int,
                             topk: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of :func:`training.attention.dynamic_sparse_attention` of the whole sequence.

    ``q, k, v`` are (B, H, N/cp, D), rank r of ``group`` holding positions ``r·N/cp ..`` (contiguous
    shards); ``N/cp`` must be a multiple of ``block``. Forward and backward equal the
    single-process op's (float rounding aside).
    """
    _check_arguments(q, k, v, window=window, block=block, topk=topk)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dynamic_sparse_attention(q, k, v, window=window, block=block, topk=topk)
    kind = q.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        dt = torch.get_autocast_dtype(kind)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, n, D = q.shape
    if n % block:
        raise ValueError(f"sharded sparse attention needs whole blocks per rank: N/cp = {n} is not a "
                         f"multiple of block = {block}")
    G, nbl = B * H, n // block
    nb = nbl * cp
    dev = q.device
    first = rank * nbl  # global index of my first block
    w = _local_blocks(window, block, nb)
    kk = min(topk, nb) if nb > w else 0
    jg = torch.arange(first, first + nbl, device=dev)

    # Block table in global block ids: kk selected blocks, then the w local blocks j-w+1 .. j.
    local = jg[:, None] - (w - 1) + torch.arange(w, device=dev)
    table = local.expand(G, nbl, w)
    used = (local >= 0).expand(G, nbl, w)  # slots the mask leaves open somewhere
    if kk:
        with torch.no_grad():
            # Key-block means as rank_key_blocks computes them (all blocks are whole here).
            means = k.detach().reshape(B, H, nbl, block, D).sum(3) / float(block)
            parts = [torch.empty_like(means) for _ in range(cp)]
            dist.all_gather(parts, means.contiguous(), group=group)
            k_mean = torch.cat(parts, dim=2)  # (B, H, nb, D)
            summary = q.detach()[:, :, ::block]
            scores = summary @ k_mean.transpose(-1, -2) / math.sqrt(D)  # (B, H, nbl, nb)
            cand = torch.arange(nb, device=dev)[None, :] <= (jg[:, None] - w)
            scores = scores.masked_fill(~cand, float("-inf"))
            sink = cand.clone()
            sink[:, 1:] = False
            scores = scores.masked_fill(sink, float("inf"))
            idx = scores.topk(kk, dim=-1).indices.reshape(G, nbl, kk)
        n_cand = (jg - w + 1).clamp(min=0, max=kk)
        sel_used = (torch.arange(kk, device=dev)[None, :] < n_cand[:, None]).expand(G, nbl, kk)
        table = torch.cat([idx, table], dim=-1)
        used = torch.cat([sel_used, used], dim=-1)
    S = table.shape[-1]
    # Unused slots point at the query block itself (a local row): the mask hides them.
    table = torch.where(used, table, jg[None, :, None].expand_as(table))

    # Rows of the key/value table: mine first (g * nbl + local block), then the fetched ones.
    group_of = torch.arange(G, device=dev)[:, None, None].expand_as(table)
    remote = (table < first) | (table >= first + nbl)
    keys = torch.unique(table[remote] * G + group_of[remote])  # sorted by block, so by owner
    blocks, groups = keys // G, keys % G
    owner = blocks // nbl
    wanted_counts, asked_rows, asked_counts = _exchange_requests(owner, groups * nbl + blocks % nbl, cp, group)
    rows = group_of * nbl + (table - first)
    if keys.numel():
        rows = torch.where(remote, G * nbl + torch.searchsorted(keys, table * G + group_of), rows)

    mine = torch.cat([k.reshape(G * nbl, block * D), v.reshape(G * nbl, block * D)], dim=1)
    fetched = _FetchRows.apply(mine, wanted_counts, asked_rows, asked_counts, group)
    k_table, v_table = torch.cat([mine, fetched]).split(block * D, dim=1)
    bias = _score_bias(jg, window=window, block=block, w=w, kk=kk, dtype=q.dtype)  # (nbl, block, S·block)
    out = _TableAttention.apply(q.reshape(G * nbl, block, D), k_table, v_table, rows.reshape(G * nbl, S), bias,
                                1.0 / math.sqrt(D))
    return out.reshape(B, H, n, D)


class _TableAttention(torch.autograd.Function):
    """Softmax attention of each query block over the rows of a key/value table its ``rows`` list.

    ``q`` (M, block, D) holds the M = groups × local query blocks, ``k_table, v_table``
    (R, block·D) the key/value blocks (this rank's, then the fetched ones), ``rows`` (M, S)
    each query block's table rows and ``bias`` (nbl, block, S·block) the additive mask of local
    query block ``m % nbl``. As ``training.attention._BlockTableAttention``: chunks of query
    blocks sized to stay in cache, the forward keeps only its output, the backward recomputes
    the probabilities and returns key/value gradients with ``index_add_``.
    """

    @staticmethod
    def _chunk(q, k_table, v_table, rows, bias, sl):
        n, block, D = q[sl].shape
        r = rows[sl].reshape(-1)
        k_c = k_table.index_select(0, r).view(n, -1, D)
        v_c = v_table.index_select(0, r).view(n, -1, D)
        which = torch.arange(sl.start, sl.stop, device=q.device) % bias.shape[0]
        p = torch.softmax(torch.baddbmm(bias[which], q[sl], k_c.mT), dim=-1)
        return r, k_c, v_c, p

    @staticmethod
    def _slices(q, rows):
        per_chunk = max(1, _CHUNK_SCORES // (q.shape[1] * rows.shape[1] * q.shape[1]))
        return [slice(i, min(q.shape[0], i + per_chunk)) for i in range(0, q.shape[0], per_chunk)]

    @staticmethod
    def forward(ctx, q, k_table, v_table, rows, bias, scale):
        q = q * scale  # folded in once: d(scores)/dk is then simply this q
        out = torch.empty_like(q)
        # Inputs are in the autocast dtype already (as the single-process kernel, which also runs
        # with autocast off, so that its softmax does not switch to fp32 under it).
        with torch.no_grad(), _no_autocast(q.device.type):
            for sl in _TableAttention._slices(q, rows):
                _, _, v_c, p = _TableAttention._chunk(q, k_table, v_table, rows, bias, sl)
                torch.bmm(p, v_c, out=out[sl])
        ctx.save_for_backward(q, k_table, v_table, rows, bias, out)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k_table, v_table, rows, bias, out = ctx.saved_tensors
        d_out = d_out.contiguous()
        acc = torch.promote_types(k_table.dtype, torch.float32)  # sums over many query blocks
        delta = (d_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)
        dq = torch.empty_like(q)
        dk = torch.zeros(k_table.shape, dtype=acc, device=k_table.device)
        dv = torch.zeros_like(dk)
        for sl in _TableAttention._slices(q, rows):
            r, k_c, v_c, p = _TableAttention._chunk(q, k_table, v_table, rows, bias, sl)
            do = d_out[sl]
            dv.index_add_(0, r, torch.bmm(p.mT, do).reshape(r.numel(), -1).to(acc))
            ds = torch.bmm(do, v_c.mT).sub_(delta[sl]).mul_(p)
            torch.bmm(ds, k_c, out=dq[sl])
            dk.index_add_(0, r, torch.bmm(ds.mT, q[sl]).reshape(r.numel(), -1).to(acc))
        return dq.mul_(ctx.scale), dk.to(k_table.dtype), dv.to(v_table.dtype), None, None, None


# ------------------------------------------------------------- model integration
@dataclass
class ContextParallel:
    group: dist.ProcessGroup
    cp: int
    rank: int
    layout: str  # "zigzag" (dense attention) | "contiguous" (sparse)
    dp: int = 1  # data-parallel ranks, and this rank's place among them
    dp_rank: int = 0

    def positions(self, n_local: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of the ``n_local`` tokens this rank holds of each row."""
        fn = zigzag_positions if self.layout == "zigzag" else contiguous_positions
        return fn(n_local * self.cp, self.cp, self.rank, device)

    def local_batch(self, whole: Batch) -> LocalBatch:
        """This dp rank's documents (``batches.local_batch``), of each row this rank's positions; the
        loss scaled so that the gradient mean over dp × cp ranks is the single-process gradient."""
        part = local_batch(whole, self.dp_rank, self.dp)
        rows = part.batch
        n = rows.tokens.shape[1]
        if n % self.cp:
            raise AssayError(f"context parallel: the sequence length {n} is not a multiple of cp = {self.cp}")
        pos = self.positions(n // self.cp, rows.tokens.device)
        mine = Batch(rows.tokens[:, pos], rows.targets[:, pos], rows.loss_mask[:, pos], rows.doc_index, rows.doc_ids)
        scale = self.dp * self.cp * mine.n_tokens / max(part.global_tokens, 1)
        return LocalBatch(mine, scale, part.global_tokens, part.has_documents)

    def document_stats(self, doc_loss: torch.Tensor, doc_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-document mean losses and target tokens over the whole rows (summed over cp)."""
        stacked = torch.stack([doc_loss.detach().double() * doc_tokens.double(), doc_tokens.double()])
        dist.all_reduce(stacked, group=self.group)
        return (stacked[0] / stacked[1].clamp_min(1)).to(doc_loss.dtype), stacked[1].to(doc_tokens.dtype)

    def install(self, model: nn.Module) -> None:
        """Point the model's attention and RoPE hooks at the sharded sequence (training mode only)."""

        def rope_positions(n: int) -> torch.Tensor:
            device = model.rope_cos.device
            return self.positions(n, device) if model.training else torch.arange(n, device=device)

        model.rope_positions = rope_positions
        for layer in model.layers.values():
            layer.attention.kernel = self._kernel(layer.attention)

    def _kernel(self, attention: nn.Module) -> Callable:
        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            sparse = attention.kind == "sparse"
            if not attention.training:  # evaluation runs whole rows on every rank
                if sparse:
                    return dynamic_sparse_attention(q, k, v, window=attention.sparse_window,
                                                    block=attention.sparse_block, topk=attention.sparse_topk)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if sparse:
                return sharded_sparse_attention(q, k, v, window=attention.sparse_window,
                                                block=attention.sparse_block, topk=attention.sparse_topk,
                                                group=self.group)
            return ring_attention(q, k, v, group=self.group)

        return kernel


def context_parallel(model: nn.Module, mesh, dims, seq_len: int) -> ContextParallel:
    """Install the cp kernels on ``model`` (its layers' attention and its RoPE positions); returns
    what the trainer asks of cp. Under pp ``model`` is this rank's pruned part, and
    ``training.parallel.pipeline`` then wraps its stages over dp × cp."""
    cp_mesh = mesh["cp"]
    cp = cp_mesh.size()
    sparse = model.args.attention == "sparse"
    if sparse and seq_len % (cp * model.args.sparse_block):
        raise AssayError(f"parallel: sparse attention under cp needs seq_len ({seq_len}) to be a multiple of "
                         f"cp × sparse_block = {cp * model.args.sparse_block}")
    if not sparse and seq_len % (2 * cp):
        raise AssayError(f"parallel: ring attention needs seq_len ({seq_len}) to be a multiple of 2·cp = {2 * cp}")
    # The attention's own groups (one per cp group of the mesh, created collectively): its
    # point-to-point traffic never interleaves with the gradient reductions.
    names = list(mesh.mesh_dim_names)
    every = mesh.mesh.movedim(names.index("cp"), -1).reshape(-1, cp).tolist()
    group, _ = dist.new_subgroups_by_enumeration(every)
    dp_rank = dims.dp_mesh(mesh).get_local_rank() if dims.dp > 1 else 0
    context = ContextParallel(group, cp, cp_mesh.get_local_rank(), "contiguous" if sparse else "zigzag",
                              dims.dp, dp_rank)
    context.install(model)
    return context


def apply_context_parallel(model: nn.Module, mesh, dims, precision: str, seq_len: int) -> ContextParallel:
    """Install the cp kernels on ``model`` (:func:`context_parallel`), then data parallelism over dp × cp.

    The cp ranks of one dp rank hold the same parameters and see different positions of the
    same rows, so their gradients are reduced together with the dp ranks' (torchtitan's
    ``dp_shard_cp``): FSDP2 over the flattened ``dp_shard × cp`` mesh (2-D with dp_replicate:
    HSDP), DDP over ``dp_replicate × cp``, or DDP over cp alone.
    """
    from training.parallel.data_parallel import apply_ddp, apply_fsdp

    context = context_parallel(model, mesh, dims, seq_len)
    if dims.fsdp:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        apply_fsdp(model, mesh["dp_replicate", "dp_shard_cp"] if dims.ddp else mesh["dp_shard_cp"], precision)
    elif dims.ddp:
        mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp")
        apply_ddp(model, mesh["dp_replicate_cp"])
    else:
        apply_ddp(model, mesh["cp"])
    return context
