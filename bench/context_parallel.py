"""Context-parallel attention on CPU: ring attention and sharded sparse attention against one process.

    python bench/context_parallel.py [--lengths 1024,2048,4096] [--cp 2] [--reps 3]

For each sequence length, forward + backward of causal attention (B=1, H=4, D=64, fp32):

- one process: ``F.scaled_dot_product_attention(is_causal=True)`` and
  ``training.attention.dynamic_sparse_attention`` on the whole sequence;
- ``cp`` gloo ranks (torch.multiprocessing spawn): ``ring_attention`` on zig-zag shards and
  ``sharded_sparse_attention`` on contiguous shards, each rank's share of the same sequence.

Reported: the median wall time of ``--reps`` runs after a warm-up run (the slowest rank's), and the growth of
the peak resident memory of the process (``ru_maxrss``) over the run, largest rank. One
thread per process throughout. Peak RSS is coarse (the allocator keeps freed pages) but is
what the machine gives without a memory profiler.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.attention import dynamic_sparse_attention  # noqa: E402
from training.parallel.context_parallel import contiguous_positions, sharded_sparse_attention  # noqa: E402
from training.parallel.ring_attention import ring_attention, zigzag_shard  # noqa: E402

B, H, D = 1, 4, 64
SPARSE = {"window": 128, "block": 64, "topk": 4}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, D, generator=g) for _ in range(4)]


def _time(fn, q, k, v, d_out, reps: int, sync=lambda: None) -> list[float]:
    """Wall times of ``reps`` forward + backward runs, after one untimed warm-up run."""
    times = []
    for _ in range(reps + 1):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sync()
        t0 = time.perf_counter()
        fn(*leaves).backward(d_out)
        sync()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _single(kind: str, n: int, reps: int, box) -> None:
    torch.set_num_threads(1)
    q, k, v, d_out = _inputs(n)
    base = _peak_mib()
    if kind == "dense":
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        fn = lambda q, k, v: dynamic_sparse_attention(q, k, v, **SPARSE)  # noqa: E731
    times = _time(fn, q, k, v, d_out, reps)
    box.put((statistics.median(times), _peak_mib() - base))


def _rank(rank: int, world: int, store: str, kind: str, n: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    q, k, v, d_out = _inputs(n)
    if kind == "dense":
        shard = lambda t: zigzag_shard(t, world, rank, dim=2)  # noqa: E731
        fn = ring_attention
    else:
        pos = contiguous_positions(n, world, rank)
        shard = lambda t: t[:, :, pos].contiguous()  # noqa: E731
        fn = lambda q, k, v: sharded_sparse_attention(q, k, v, **SPARSE)  # noqa: E731
    q, k, v, d_out = (shard(t) for t in (q, k, v, d_out))
    del shard
    base = _peak_mib()
    times = _time(fn, q, k, v, d_out, reps, sync=dist.barrier)
    torch.save((times, _peak_mib() - base), f"{out}.{rank}")
    dist.destroy_process_group()


def _distributed(kind: str, n: int, cp: int, reps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_rank, args=(cp, os.path.join(tmp, "store"), kind, n, reps, out), nprocs=cp,
                           start_method="spawn")
        results = [torch.load(f"{out}.{r}") for r in range(cp)]
    slowest = [max(r[0][i] for r in results) for i in range(reps)]
    return statistics.median(slowest), max(r[1] for r in results)


def _one_process(kind: str, n: int, reps: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")  # a fresh process: its peak RSS is this run's alone
    box = ctx.Queue()
    proc = ctx.Process(target=_single, args=(kind, n, reps, box))
    proc.start()
    result = box.get()
    proc.join()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"B={B} H={H} D={D} fp32, forward+backward, 1 thread per process; sparse {SPARSE}; cp={args.cp}")
    print("| attention | N | one process s | cp ranks s (slowest) | ratio | one process peak RSS +MiB "
          "| cp rank peak RSS +MiB (largest) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("dense", "sparse"):
        for n in (int(x) for x in args.lengths.split(",")):
            one, one_mem = _one_process(kind, n, args.reps)
            dist_t, dist_mem = _distributed(kind, n, args.cp, args.reps)
            name = "ring (zig-zag)" if kind == "dense" else "sharded sparse"
            print(f"| {name} | {n} | {one:.3f} | {dist_t:.3f} | {dist_t / one:.2f} | {one_mem:.0f} | {dist_mem:.0f} |",
                  flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (the machine was shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
