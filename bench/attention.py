"""Dynamic sparse attention vs dense causal SDPA: forward + backward time on CPU.

    python bench/attention.py [--sizes 4096,8192,16384,20480] [--heads 4] [--dim 64]
                              [--window 512] [--block 64] [--topk 8] [--threads 2] [--reps 3]

Both run in the same process, fp32, B=1, on the same q, k, v; the time is one
forward plus ``out.backward(g)`` for a random ``g``. Per size the two methods
alternate (sparse, dense, sparse, dense, ...) and each reports its best of
``--reps``, so a burst of load from other processes hits both alike; timings
still drift by 20% or more on shared machines. Both use ``--threads`` CPU
threads (SDPA through OpenMP, the sparse kernel through its own worker threads).

"keys/query" is the sparse method's attended keys per query (at most
window + topk * block; it computes ``(ceil((window - 1) / block) + 1 + topk) * block``
scores per query, the ragged window edges masked) against the dense mean (N + 1) / 2.

Before the table, a sanity line: with window >= N the sparse method is exactly dense
causal attention, so its output and gradients must match SDPA to float rounding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.attention import dense_causal_attention, dynamic_sparse_attention


def _time(fn, q, k, v, grad) -> float:
    for t in (q, k, v):
        t.grad = None
    t0 = time.perf_counter()
    fn(q, k, v).backward(grad)
    return time.perf_counter() - t0


def _qkv(n: int, heads: int, dim: int):
    g = torch.Generator().manual_seed(n)
    q, k, v = (
        torch.randn(1, heads, n, dim, generator=g, requires_grad=True) for _ in range(3)
    )
    # A dense random output gradient: ``out.sum().backward()`` would feed a stride-0
    # gradient, which sends CPU bmm to a slow path and distorts the comparison.
    return q, k, v, torch.randn(1, heads, n, dim, generator=g)


def _dense_equivalence(args) -> str:
    n = 1000  # not a multiple of the block: the padding path too
    q, k, v, g = _qkv(n, args.heads, args.dim)
    out = dynamic_sparse_attention(q, k, v, window=n, block=args.block, topk=args.topk)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = dense_causal_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    d_out = (out - ref).abs().max().item()
    d_grad = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
    return (
        f"sanity: window >= N (N={n}) vs dense SDPA: max |d out| = {d_out:.1e}, "
        f"max |d grad| = {d_grad:.1e}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,8192,16384,20480")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    sparse = lambda q, k, v: dynamic_sparse_attention(
        q, k, v, window=args.window, block=args.block, topk=args.topk
    )

    print(_dense_equivalence(args))
    warm = _qkv(min(sizes), args.heads, args.dim)
    _time(sparse, *warm)
    _time(dense_causal_attention, *warm)

    print(
        f"\nB=1 H={args.heads} D={args.dim} fp32, window={args.window} block={args.block} "
        f"topk={args.topk}, threads={args.threads}, fwd+bwd seconds "
        f"(best of {args.reps}, interleaved)\n"
    )
    print(
        "| N | sparse s | dense SDPA s | speed-up | keys/query sparse | keys/query dense |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        q, k, v, g = _qkv(n, args.heads, args.dim)
        ts, td = float("inf"), float("inf")
        for _ in range(args.reps):
            ts = min(ts, _time(sparse, q, k, v, g))
            td = min(td, _time(dense_causal_attention, q, k, v, g))
        kq = min(n, args.window + args.topk * args.block)
        print(
            f"| {n} | {ts:.2f} | {td:.2f} | {td / ts:.2f}x | <= {kq} | {(n + 1) / 2:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
