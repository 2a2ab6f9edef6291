"""Dynamic sparse attention vs dense causal SDPA: forward + backward time on CPU.

    python bench/attention.py [--sizes 4096,8192,16384,20480] [--heads 4] [--dim 64]
                              [--window 512] [--block 64] [--topk 8] [--threads 2] [--reps 3]
                              [--baseline OTHER_ATTENTION.py]
    python bench/attention.py --selection RUN_DIR --data DATASET [--rows 8]

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

``--baseline FILE`` times a second implementation of ``dynamic_sparse_attention`` in the
same interleaved loop, for instance an earlier revision
(``git show REV:training/attention.py > /tmp/old_attention.py``).

``--selection RUN_DIR`` measures selection rules instead of time, on a model that
``bench/train.py`` trained (its latest checkpoint) and the held-out rows of ``--data``.
For every layer, head and query that has candidate blocks, it computes the dense causal
softmax and reports the share of its probability mass that falls on the keys the sparse
method would attend to (window plus selected blocks), and the share of the mass outside
the window that the selected blocks recover. The rules differ only in the vector each
query block ranks key blocks with; "per query" ranks per query, as NSA and MoBA do.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.attention import (  # noqa: E402
    dense_causal_attention,
    dynamic_sparse_attention,
    query_summaries,
    rank_key_blocks,
)


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


def _load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dynamic_sparse_attention


# --- selection rules on a trained model ---------------------------------------------------

def _block_view(q: torch.Tensor, block: int) -> torch.Tensor:
    B, H, N, D = q.shape
    nb = (N + block - 1) // block
    return F.pad(q, (0, 0, 0, nb * block - N)).view(B, H, nb, block, D)


def _ending_at_first(block: int):
    """Mean of the ``block`` queries ending at each block's first, (j*block - block, j*block]."""

    def summary(q: torch.Tensor) -> torch.Tensor:
        qb = _block_view(q, block)
        tail = F.pad(qb[:, :, :-1, 1:].sum(3), (0, 0, 1, 0))
        counts = torch.full((qb.shape[2], 1), float(block))
        counts[0] = 1.0
        return (qb[:, :, :, 0] + tail) / counts

    return summary


def _rules(block: int) -> dict:
    """Query-block summaries to rank key blocks with; each maps q (B, H, N, D) to (B, H, nb, D)."""
    return {
        "own block mean (old, sees the future)": lambda q: _block_view(q, block).mean(3),
        "block first query (new)": lambda q: query_summaries(q, block),
        "mean of the block queries ending at the first": _ending_at_first(block),
        "previous block mean": lambda q: F.pad(_block_view(q, block)[:, :, :-1].mean(3), (0, 0, 1, 0)),
    }


def _allowed_from_blocks(idx, valid, n: int, window: int, block: int) -> torch.Tensor:
    """(B, H, N, N) keys each query sees: its window plus its query block's selection."""
    B, H, nb, _ = idx.shape
    chosen = torch.zeros(B, H, nb, nb, dtype=torch.int32)
    chosen.scatter_add_(-1, idx, valid.int())
    blk = torch.arange(n) // block
    selected = chosen[:, :, blk][:, :, :, blk] > 0
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return selected | ((j <= i) & (i - j < window))


def _per_query_allowed(q, k, window: int, block: int, topk: int) -> torch.Tensor:
    """Each query ranks the candidate blocks of its query block by q_i . key-block mean."""
    B, H, N, D = q.shape
    nb = (N + block - 1) // block
    k_mean = _block_view(k, block).sum(3) / block  # candidates are full blocks
    scores = q @ k_mean.transpose(-1, -2) / math.sqrt(D)  # (B, H, N, nb)
    w = -(-(window - 1) // block) + 1
    qb = torch.arange(N) // block
    cand = torch.arange(nb)[None, :] <= (qb[:, None] - w)
    scores = scores.masked_fill(~cand, float("-inf"))
    sink = cand.clone()
    sink[:, 1:] = False
    scores = scores.masked_fill(sink, float("inf"))
    top, idx = scores.topk(min(topk, nb), dim=-1)
    chosen = torch.zeros(B, H, N, nb, dtype=torch.bool)
    chosen.scatter_(-1, idx, top > float("-inf"))
    selected = chosen[..., torch.arange(N) // block]  # (B, H, N, N)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    return selected | ((j <= i) & (i - j < window))


def _selection(args) -> int:
    from assay.versions import open_version
    from training.checkpoint import SafeReader, latest_checkpoint, read_trainer_state
    from training.data import build_rows, is_holdout
    from training.model import ModelArgs, Transformer, apply_rope
    from training.tokenizer import load_tokenizer
    import torch.distributed.checkpoint as dcp

    run = Path(args.selection)
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise SystemExit(f"{run} has no checkpoint")
    state = read_trainer_state(ckpt)
    tokenizer = load_tokenizer(run)
    margs = ModelArgs(vocab_size=tokenizer.get_vocab_size(), max_seq_len=state["seq_len"],
                      **state["model_args"])
    model = Transformer(margs)
    model.init_weights(0)
    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process, no process group: as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=SafeReader(str(ckpt)))
    model.load_state_dict(weights["model"])
    model.eval()
    window, block, topk = args.window, args.block, args.topk

    # The held-out split as the trainer makes it (5% of documents by id), first full rows.
    version = open_version(args.data)
    held = ((i, t) for b in version.iter_batches(columns=["id", "text"])
            for i, t in zip(b.column("id").to_pylist(), b.column("text").to_pylist())
            if t and is_holdout(i, args.holdout))
    rows = build_rows(held, tokenizer, state["seq_len"])
    full = [r for r in range(len(rows)) if rows.lengths[r] == state["seq_len"] + 1][: args.rows]
    if not full:
        raise SystemExit(f"no full-length held-out rows in {args.data}")
    tokens = torch.as_tensor(rows.tokens[full][:, :-1]).long()

    captured: dict[str, list[torch.Tensor]] = {}
    inputs: list[torch.Tensor] = []
    hooks = [layer.attention.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
             for layer in model.layers.values()]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    n = tokens.shape[1]
    cos, sin = model.rope_cos[:n], model.rope_sin[:n]
    w = -(-(window - 1) // block) + 1
    # Only where a query block has more candidates than it may choose do the rules differ.
    has_cand = (torch.arange(n) // block) >= w + topk
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    in_window = (j <= i) & (i - j < window)
    with torch.no_grad():
        for layer, x in zip(model.layers.values(), inputs):
            att = layer.attention
            b = x.shape[0]
            q = apply_rope(att.wq(x).view(b, n, -1, att.head_dim), cos, sin).transpose(1, 2)
            k = apply_rope(att.wk(x).view(b, n, -1, att.head_dim), cos, sin).transpose(1, 2)
            d = q.shape[-1]
            p = torch.softmax((q @ k.mT / math.sqrt(d)).masked_fill(~(j <= i), float("-inf")), -1)
            outside = (p * ~in_window).sum(-1)  # (B, H, N)
            masks = {name: _allowed_from_blocks(*rank_key_blocks(rule(q), k, window=window,
                                                                  block=block, topk=topk),
                                                 n, window, block)
                     for name, rule in _rules(block).items()}
            masks["per query (NSA / MoBA style)"] = _per_query_allowed(q, k, window, block, topk)
            for name, allowed in masks.items():
                got = (p * allowed).sum(-1)
                rec = (got - (1 - outside)) / outside.clamp_min(1e-12)
                captured.setdefault(name, []).append(
                    torch.stack([got[..., has_cand].mean(), rec[..., has_cand].mean()]))
    print(f"run {run} (step {state['step']}, attention {state['model_args']['attention']}); "
          f"{len(full)} held-out rows x {n} tokens; window {window}, block {block}, top-{topk}; "
          f"queries whose block has more than top-{topk} candidates, all layers and heads\n")
    print("| query-block summary | dense mass on attended keys | of the mass outside the window, recovered |")
    print("|---|---:|---:|")
    for name, vals in captured.items():
        m = torch.stack(vals).mean(0)
        print(f"| {name} | {m[0]:.4f} | {m[1]:.4f} |")
    return 0


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
    ap.add_argument("--baseline", help="a file defining another dynamic_sparse_attention to time alongside")
    ap.add_argument("--selection", metavar="RUN_DIR", help="measure selection rules on this trained run")
    ap.add_argument("--data", help="--selection: the dataset the run trained on")
    ap.add_argument("--rows", type=int, default=8, help="--selection: held-out rows")
    ap.add_argument("--holdout", type=float, default=0.05, help="--selection: the run's held-out share")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.selection:
        if not args.data:
            ap.error("--selection needs --data")
        return _selection(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    sparse = lambda q, k, v: dynamic_sparse_attention(
        q, k, v, window=args.window, block=args.block, topk=args.topk
    )

    methods = {"sparse": sparse, "dense SDPA": dense_causal_attention}
    if args.baseline:
        other = _load_baseline(args.baseline)
        methods = {
            "sparse": sparse,
            "baseline sparse": lambda q, k, v: other(
                q, k, v, window=args.window, block=args.block, topk=args.topk
            ),
            "dense SDPA": dense_causal_attention,
        }

    print(_dense_equivalence(args))
    warm = _qkv(min(sizes), args.heads, args.dim)
    for fn in methods.values():
        _time(fn, *warm)

    print(
        f"\nB=1 H={args.heads} D={args.dim} fp32, window={args.window} block={args.block} "
        f"topk={args.topk}, threads={args.threads}, fwd+bwd seconds "
        f"(best of {args.reps}, interleaved)"
        + (f"; baseline: {args.baseline}" if args.baseline else "")
        + "\n"
    )
    names = list(methods)
    speedups = [m for m in names if m != "dense SDPA"]
    print(
        "| N | "
        + " | ".join(f"{m} s" for m in names)
        + " | "
        + " | ".join(f"speed-up {m}" for m in speedups)
        + " | keys/query sparse | keys/query dense |"
    )
    print("|---:" * (len(names) + len(speedups) + 3) + "|")
    for n in sizes:
        q, k, v, g = _qkv(n, args.heads, args.dim)
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.reps):
            for m, fn in methods.items():
                best[m] = min(best[m], _time(fn, q, k, v, g))
        kq = min(n, args.window + args.topk * args.block)
        td = best["dense SDPA"]
        print(
            f"| {n} | "
            + " | ".join(f"{best[m]:.2f}" for m in names)
            + " | "
            + " | ".join(f"{td / best[m]:.2f}x" for m in speedups)
            + f" | <= {kq} | {(n + 1) / 2:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
