"""Dynamic sparse attention vs dense causal SDPA: forward + backward time on CPU.

    python bench/attention.py [--sizes 4096,8192,16384,20480] [--heads 4] [--dim 64]
                              [--window 512] [--block 64] [--topk 8] [--threads 2] [--reps 1]

Both run in the same process, fp32, B=1, on the same q, k, v; the time is one
forward plus ``out.backward(g)`` for a random ``g`` (best of ``--reps`` after one warm-up at
the smallest size). "keys/query" is the sparse method's attended keys per query
(at most window + topk * block) against the dense mean (N + 1) / 2. Timings
drift by about 20% on shared machines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.attention import dense_causal_attention, dynamic_sparse_attention


def _time(fn, q, k, v, reps: int) -> float:
    # A dense random output gradient: ``out.sum().backward()`` would feed a stride-0
    # gradient, which sends CPU bmm to a slow path and distorts the comparison.
    grad = torch.randn_like(q)
    best = float("inf")
    for _ in range(reps):
        for t in (q, k, v):
            t.grad = None
        t0 = time.perf_counter()
        fn(q, k, v).backward(grad)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,8192,16384,20480")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    sparse = lambda q, k, v: dynamic_sparse_attention(
        q, k, v, window=args.window, block=args.block, topk=args.topk
    )

    def qkv(n: int):
        g = torch.Generator().manual_seed(n)
        return [
            torch.randn(1, args.heads, n, args.dim, generator=g, requires_grad=True)
            for _ in range(3)
        ]

    warm = qkv(min(sizes))
    _time(sparse, *warm, 1)
    _time(dense_causal_attention, *warm, 1)

    print(
        f"B=1 H={args.heads} D={args.dim} fp32, window={args.window} block={args.block} "
        f"topk={args.topk}, threads={args.threads}, fwd+bwd seconds (best of {args.reps})\n"
    )
    print(
        "| N | sparse s | dense SDPA s | speed-up | keys/query sparse | keys/query dense |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        q, k, v = qkv(n)
        ts = _time(sparse, q, k, v, args.reps)
        td = _time(dense_causal_attention, q, k, v, args.reps)
        kq = min(n, args.window + args.topk * args.block)
        print(
            f"| {n} | {ts:.2f} | {td:.2f} | {td / ts:.2f}x | <= {kq} | {(n + 1) / 2:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
