"""Dynamic sparse causal attention (NSA / DSA style) with a hand-written, chunked backward.

Each query attends to

(a) a local causal window: the ``window`` keys ending at itself,
    positions ``(i - window, i]``;
(b) ``topk`` key blocks (``block`` consecutive keys each) that lie entirely
    before the local window of every query of its query block, chosen by a
    cheap content score: the dot product of a summary of the query block with
    each key block's mean (the "compressed block keys"). Block 0 is always
    chosen when it is a candidate (attention sink). The selection is an index
    computation and carries no gradient; the attention over the selected keys does.

The selection is causal. Query block ``j`` (positions ``j * block ..``) ranks key blocks
with its *first* query, the one at ``j * block`` (:func:`query_summaries`), and every
member uses that ranking. Every member sits at or after ``j * block``, so nothing it
attends to depends on a later query. Ranking with the mean of the block's own queries,
as this module once did, let position ``i`` see through its keys the query at ``i + 1``,
which in a language model is made from the target of ``i``: the label leaked into the
forward pass, and decoding one token at a time could not reproduce the training-time
outputs. With the causal rule a prefix selects exactly as the whole sequence does, so
decoding (recomputing the prefix, or :func:`decode_step` from cached keys, values and
block-first queries) gives the full forward's outputs. Among causal summaries (the first
query, the mean of the ``block`` queries ending at it, the previous block's mean) and
per-query ranking, the choice was measured (BENCHMARKS.md, "Attention"); per-query
ranking would give each query its own key set and so break the block table below.

Queries are processed in blocks of ``block`` queries that share one selection.
For query block ``j`` the local part is the ``W`` key blocks ending at ``j``
(``W = ceil((window - 1) / block) + 1``), masked per query to the exact window;
the candidate blocks are ``b <= j - W``, which end before the first query's
window starts, so a selected key can never also be a local key (no double
counting).

So every query block attends to a short list of ``topk + W`` key blocks, its
*block table*, under a fixed additive mask. ``_BlockTableAttention`` computes
that the way FlashAttention does: the forward keeps only its output, the
backward recomputes the probabilities chunk by chunk. A chunk is a few query
blocks whose scores fit in a core's cache: its keys and values are gathered
with one ``index_select`` and their gradients returned with one ``index_add_``.
Plain autograd over bmm + softmax + bmm instead saved the gathered keys, the
scores and the probabilities for the whole sequence and was memory bound.

On CPU the chunks are spread over ``torch.get_num_threads()`` Python threads
that each run single-threaded torch ops (torch releases the GIL inside them).
Many small ops each split over all cores pay a fork/join barrier apiece, and on
a busy machine every barrier waits for the slowest core; independent chunks
pulled from a shared queue do not. The cost is linear in ``N`` for fixed
``window``, ``block`` and ``topk``; no ``N x N`` matrix is built (except the
block score matrix ``nQB x nKB`` of the selection, ``N^2 / block^2``, small).

``N`` need not be a multiple of ``block``: the sequence is zero-padded
internally; padded keys sit after every real query, so causality hides them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

__all__ = [
    "decode_step",
    "dense_causal_attention",
    "dynamic_sparse_attention",
    "query_summaries",
    "rank_key_blocks",
    "select_blocks",
]

# Score elements per chunk. On CPU one chunk's scores (2 MiB in fp32) stay in a core's
# L2 through the softmax and its gradient; accelerators want few, large launches.
_CPU_CHUNK_SCORES = 1 << 19
_ACCEL_CHUNK_SCORES = 1 << 24


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Plain causal softmax attention via torch SDPA; q, k, v are (B, H, N, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _local_blocks(window: int, block: int, n_blocks: int) -> int:
    """Key blocks needed to cover the window of every query in a query block."""
    return min(n_blocks, (window - 1 + block - 1) // block + 1)


def query_summaries(q: torch.Tensor, block: int) -> torch.Tensor:
    """The causal summary of every query block: its first query, (B, H, nb, D).

    Every member of block ``j`` sits at ``j * block`` or later, so none of them selects
    with a query from its future; and a prefix of the sequence has the same summaries
    as the whole sequence, so it selects exactly as the whole sequence does.
    """
    return q[:, :, ::block].contiguous()


@torch.no_grad()
def rank_key_blocks(
    summary: torch.Tensor, k: torch.Tensor, *, window: int, block: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``topk`` candidate key blocks per query block by ``summary @ key-block mean``.

    ``summary`` is (B, H, nb, D), one vector per query block; ``k`` is (B, H, N, D).
    Returns ``(idx, valid)`` as :func:`select_blocks` does.
    """
    B, H, N, D = k.shape
    nb = (N + block - 1) // block
    if summary.shape != (B, H, nb, D):
        raise ValueError(f"summary must be {(B, H, nb, D)}, got {tuple(summary.shape)}")
    pad = nb * block - N
    # Key-block mean over real keys only. Only the last block can be short, and it is
    # never a candidate (candidates end before their query block starts).
    counts = torch.full((nb, 1), float(block), dtype=k.dtype, device=k.device)
    counts[-1] = block - pad
    kb = (F.pad(k, (0, 0, 0, pad)) if pad else k).view(B, H, nb, block, D)
    k_mean = kb.sum(3) / counts
    scores = summary @ k_mean.transpose(-1, -2) / math.sqrt(D)  # (B, H, nQB, nKB)
    w = _local_blocks(window, block, nb)
    j = torch.arange(nb, device=k.device)
    cand = j[None, :] <= (j[:, None] - w)  # (nQB, nKB): block before every window
    scores = scores.masked_fill(~cand, float("-inf"))
    sink = cand.clone()
    sink[:, 1:] = False
    scores = scores.masked_fill(sink, float("inf"))
    kk = min(topk, nb)
    top, idx = scores.topk(kk, dim=-1)
    valid = top > float("-inf")
    return idx, valid


@torch.no_grad()
def select_blocks(
    q: torch.Tensor, k: torch.Tensor, *, window: int, block: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query block attends to beyond its local window.

    Returns ``(idx, valid)``, both (B, H, nQB, kk) with ``kk = min(topk, nKB)``:
    ``idx`` are key-block indices, ``valid`` says whether the slot is a real
    candidate (entirely before the local window of the whole query block).
    Query block ``j`` ranks with :func:`query_summaries` (queries at or before its
    first position only), so the selection is causal.
    """
    return rank_key_blocks(
        query_summaries(q, block), k, window=window, block=block, topk=topk
    )


def _score_bias(
    rows: torch.Tensor, *, window: int, block: int, w: int, kk: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask (0 or -inf) of query blocks ``rows``: (len(rows), block, L).

    Its L = (kk + w) * block keys are laid out as in the block table: ``kk`` selected
    blocks, then the ``w`` local blocks ``j - w + 1 .. j``. Selected slot ``s`` is real
    iff ``s`` is below the number of candidates ``j - w + 1`` (topk puts non-candidates
    last); a local key must exist (block >= 0) and lie in the query's causal window.
    """
    dev = rows.device
    n = rows.numel()
    n_cand = (rows - w + 1).clamp(min=0, max=kk)
    sel_ok = torch.arange(kk, device=dev)[None, :] < n_cand[:, None]  # (n, kk)
    sel_ok = sel_ok[:, None, :, None].expand(n, block, kk, block)
    # Local keys: query offset a in its block, key offset c in the w-block span.
    a = torch.arange(block, device=dev)[None, :, None]
    c = torch.arange(w * block, device=dev)[None, None, :]
    dist = (w - 1) * block + a - c  # query position minus key position
    exists = (rows[:, None, None] - (w - 1)) * block + c >= 0
    loc_ok = exists & (dist >= 0) & (dist < window)  # (n, block, w * block)
    ok = torch.cat([sel_ok.reshape(n, block, kk * block), loc_ok], dim=-1)
    bias = torch.zeros(ok.shape, dtype=dtype, device=dev)
    return bias.masked_fill_(~ok, float("-inf"))


def _masked_column_runs(bias: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal [start, stop) column ranges of a (1, block, L) bias that mask anything."""
    masked = (bias[0] != 0).any(0).tolist()
    runs: list[tuple[int, int]] = []
    for col, m in enumerate(masked):
        if m and runs and runs[-1][1] == col:
            runs[-1] = (runs[-1][0], col + 1)
        elif m:
            runs.append((col, col + 1))
    return runs


class _Mask:
    """The additive score mask of every query block, stored compactly.

    Query blocks ``0 .. len(head) - 1`` (front padding, missing candidates) get their own
    slice of ``head``; every later block shares ``rest`` (1, block, L), which only masks
    the ragged edges of the window, so it is added on those column runs alone.
    """

    def __init__(self, head: torch.Tensor, rest: torch.Tensor):
        self.head, self.rest = head, rest
        self.rest_runs = _masked_column_runs(rest)

    def add_(self, scores: torch.Tensor, js: slice) -> None:
        """Mask ``scores`` (groups, query blocks ``js``, block, L) in place."""
        if js.start < self.head.shape[0]:
            scores.add_(self.head[js])
        else:
            for a, b in self.rest_runs:
                scores[..., a:b] += self.rest[..., a:b]


Chunk = tuple[slice, slice]  # (group slice, query-block slice)


def _chunks(groups: int, nb: int, blocks_per_chunk: int) -> list[list[Chunk]]:
    """Chunks covering the (groups, nb) grid of query blocks, one list per group slice:
    chunks in different lists read and write disjoint key rows."""
    nj = min(nb, blocks_per_chunk)
    ng = max(1, blocks_per_chunk // nb)  # short sequences: several heads per chunk
    return [
        [
            (slice(g0, min(groups, g0 + ng)), slice(j0, min(nb, j0 + nj)))
            for j0 in range(0, nb, nj)
        ]
        for g0 in range(0, groups, ng)
    ]


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _run_parallel(work: Callable, items: list, device_type: str) -> None:
    """Call ``work(item)`` for every item, on up to ``torch.get_num_threads()`` threads.

    On CPU, with more than one thread and item, each thread pulls the next item when it
    is done with one, so a thread the OS preempts just does fewer items. Torch runs
    single-threaded meanwhile: the setting is process-wide, and restored afterwards.
    Grad mode and autocast are thread-local: the work runs with both off in every thread.
    """

    def loop(queue: Iterator, lock: threading.Lock) -> None:
        with torch.no_grad(), _no_autocast(device_type):
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                work(item)

    with _SINGLE_THREADED_TORCH:
        threads = _SINGLE_THREADED_TORCH.saved or torch.get_num_threads()
    workers = min(threads, len(items)) if device_type == "cpu" else 1
    if workers <= 1:
        loop(iter(items), threading.Lock())
        return
    with _SINGLE_THREADED_TORCH.held():
        queue, lock = iter(items), threading.Lock()
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(loop, queue, lock) for _ in range(workers)]:
                f.result()


class _TorchThreads:
    """Torch's thread count is process-wide: calls that overlap (two Python threads each
    running sparse attention) share one saved value, set 1 on the first entry and restored
    on the last exit, so an overlapping call can neither read the 1 as the user's setting
    nor restore it too early."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self.saved: int | None = None

    def __enter__(self) -> _TorchThreads:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self.saved = torch.get_num_threads()
                torch.set_num_threads(1)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    torch.set_num_threads(self.saved)
                    self.saved = None


_SINGLE_THREADED_TORCH = _TorchThreads()


def _gather(q, k, v, rows, chunk: Chunk):
    """One chunk: its queries (C, block, D), keys and values (C, L, D), and the flat
    key-block rows those came from (where their gradients go back to)."""
    G, nb, block, D = q.shape
    gs, js = chunk
    r = rows[gs, js].reshape(-1)
    q_c = q[gs, js].reshape(-1, block, D)
    k_c = k.view(G * nb, block * D).index_select(0, r).view(q_c.shape[0], -1, D)
    v_c = v.view(G * nb, block * D).index_select(0, r).view(q_c.shape[0], -1, D)
    return q_c, k_c, v_c, r


def _scores(q_c, k_c, mask: _Mask, chunk: Chunk) -> torch.Tensor:
    """Masked scores (C, block, L) of one chunk."""
    gs, js = chunk
    s = torch.bmm(q_c, k_c.mT)
    mask.add_(s.view(gs.stop - gs.start, js.stop - js.start, *s.shape[1:]), js)
    return s


class _BlockTableAttention(torch.autograd.Function):
    """Softmax attention of each query block over the key blocks its table lists.

    ``q, k, v`` are (G, nb, block, D) with G = batch * heads; ``rows`` (G, nb, S) holds,
    per query block, the rows of ``k.view(G * nb, block * D)`` it attends to (table plus
    group offset), and ``mask`` its additive mask over those L = S * block keys.
    """

    @staticmethod
    def forward(ctx, q, k, v, rows, mask, scale, blocks_per_chunk):
        G, nb = q.shape[:2]
        q = q * scale  # folded in once: d(scores)/dk is then simply this q
        out = torch.empty_like(q)

        def work(chunk: Chunk) -> None:
            q_c, k_c, v_c, _ = _gather(q, k, v, rows, chunk)
            p = torch.softmax(_scores(q_c, k_c, mask, chunk), dim=-1)
            torch.bmm(p, v_c, out=out[chunk].view(q_c.shape))

        # Chunks write disjoint rows of out: any order, any thread.
        chunks = [c for row in _chunks(G, nb, blocks_per_chunk) for c in row]
        _run_parallel(work, chunks, q.device.type)
        ctx.save_for_backward(q, k, v, rows, out)
        ctx.mask, ctx.scale, ctx.blocks_per_chunk = mask, scale, blocks_per_chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, rows, out = ctx.saved_tensors
        G, nb, block, D = q.shape
        d_out = d_out.contiguous()
        # Key gradients sum over many query blocks (block 0 over all of them): accumulate
        # them, and the softmax row sums, in at least fp32.
        acc = torch.promote_types(k.dtype, torch.float32)
        # Softmax Jacobian: dS = P * (dP - delta), delta = rowsum(dP * P) = rowsum(dO * O).
        delta = (d_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)
        dq = torch.empty_like(q)
        dk = torch.zeros(G * nb, block * D, dtype=acc, device=k.device)
        dv = torch.zeros_like(dk)

        def work(chunks: list[Chunk]) -> None:
            for chunk in chunks:
                q_c, k_c, v_c, r = _gather(q, k, v, rows, chunk)
                do = d_out[chunk].view(q_c.shape)
                p = torch.softmax(_scores(q_c, k_c, ctx.mask, chunk), dim=-1)
                dv.index_add_(0, r, torch.bmm(p.mT, do).view(r.numel(), -1).to(acc))
                ds = torch.bmm(do, v_c.mT)
                ds.sub_(delta[chunk].view(-1, block, 1)).mul_(p)
                torch.bmm(ds, k_c, out=dq[chunk].view(q_c.shape))
                # q is pre-scaled, so this already is d(loss)/dk.
                dk.index_add_(0, r, torch.bmm(ds.mT, q_c).view(r.numel(), -1).to(acc))

        # One work item per group slice: items never add to the same key rows (no races),
        # and each row sums its terms in a fixed order (bitwise reproducible gradients).
        _run_parallel(work, _chunks(G, nb, ctx.blocks_per_chunk), q.device.type)
        dk, dv = dk.to(k.dtype).view_as(k), dv.to(v.dtype).view_as(v)
        return dq.mul_(ctx.scale), dk, dv, None, None, None, None


def _check_arguments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, block: int, topk: int
) -> None:
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(
            f"q, k, v must share a (B, H, N, D) shape, got {q.shape}, {k.shape}, {v.shape}"
        )
    if window < 1 or block < 1 or topk < 0:
        raise ValueError("window and block must be >= 1 and topk >= 0")


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
    _check_arguments(q, k, v, window=window, block=block, topk=topk)
    dev, kind = q.device, q.device.type
    # Like SDPA, compute in the autocast dtype when autocast is on; the kernel itself runs
    # with autocast off, so it keeps the dtypes chosen here.
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        dt = torch.get_autocast_dtype(kind)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    B, H, N, D = q.shape
    G = B * H
    nb = (N + block - 1) // block
    pad = nb * block - N
    w = _local_blocks(window, block, nb)
    kk = min(topk, nb) if nb > w else 0  # no candidates at all when w covers everything

    # Block table: kk selected blocks, then the w local blocks j - w + 1 .. j (clamped
    # at 0; the mask hides those slots).
    j = torch.arange(nb, device=dev)
    local = (j[:, None] - (w - 1) + torch.arange(w, device=dev)).clamp(min=0)
    table = local.expand(G, nb, w)
    if kk:
        idx, _ = select_blocks(
            q.detach(), k.detach(), window=window, block=block, topk=kk
        )
        table = torch.cat([idx.reshape(G, nb, kk), table], dim=-1)
    rows = table + torch.arange(G, device=dev)[:, None, None] * nb

    chunk_scores = _CPU_CHUNK_SCORES if kind == "cpu" else _ACCEL_CHUNK_SCORES
    blocks_per_chunk = max(1, chunk_scores // (block * (kk + w) * block))
    # Only the first w - 1 + kk query blocks see front padding or missing candidates;
    # round up to whole chunks so that a chunk needs just one of the two masks.
    height = min(nb, blocks_per_chunk)
    n_head = min(nb, -(-(w - 1 + kk) // height) * height)
    bias = functools.partial(
        _score_bias, window=window, block=block, w=w, kk=kk, dtype=q.dtype
    )
    mask = _Mask(bias(j[:n_head]), bias(torch.tensor([w - 1 + kk], device=dev)))

    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    q, k, v = (t.reshape(G, nb, block, D).contiguous() for t in (q, k, v))
    out = _BlockTableAttention.apply(
        q, k, v, rows, mask, 1.0 / math.sqrt(D), blocks_per_chunk
    )
    return out.reshape(B, H, nb * block, D)[:, :, :N]


def decode_step(
    queries: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    block: int,
    topk: int,
) -> torch.Tensor:
    """Attention output of the newest position alone, from a cache: (B, H, 1, D).

    ``k`` and ``v`` (B, H, n, D) hold every key and value through the newest position
    ``i = n - 1``; ``queries`` (B, H, n, D) the queries, the newest last. Of the earlier
    queries only block ``i // block``'s first one is read (:func:`query_summaries`), so
    a cache may keep just that one. Equals
    ``dynamic_sparse_attention(queries, k, v, ...)[:, :, -1:]`` up to float rounding,
    at the cost of ``window + topk * block`` keys rather than a sequence.
    """
    _check_arguments(queries, k, v, window=window, block=block, topk=topk)
    B, H, n, D = k.shape
    dev = k.device
    i = n - 1
    j = i // block
    w = _local_blocks(window, block, j + 1)
    n_cand = j - w + 1  # blocks 0 .. j - w end before the window of the block's first query
    positions = torch.arange(max(0, i - window + 1), i + 1, device=dev).expand(B, H, -1)
    if n_cand > 0 and topk > 0:
        # The same arithmetic as query_summaries and rank_key_blocks, for one row.
        summary = queries[:, :, j * block]
        k_mean = k[:, :, : n_cand * block].reshape(B, H, n_cand, block, D).sum(3) / block
        scores = (summary[:, :, None] @ k_mean.mT)[:, :, 0] / math.sqrt(D)
        scores[..., 0] = float("inf")  # the sink
        idx = scores.topk(min(topk, n_cand), dim=-1).indices  # (B, H, kk)
        chosen = (idx[..., None] * block + torch.arange(block, device=dev)).flatten(2)
        positions = torch.cat([chosen, positions], dim=-1)
    index = positions[..., None].expand(-1, -1, -1, D)
    keys, values = k.gather(2, index), v.gather(2, index)
    att = torch.softmax(queries[:, :, -1:] @ keys.mT / math.sqrt(D), dim=-1)
    return att @ values
