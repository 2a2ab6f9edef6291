"""Per-document gradient norms (ghost norms) against a plain forward + backward.

    python bench/grad_norms.py [--dim 256] [--layers 4] [--ffn 688] [--batch 8] [--seq 256] [--reps 3]

The telemetry's price: ``per_document_loss_and_grad_norm`` (one forward, one
backward, every document's loss and gradient norm over all parameters) against
``cross_entropy(model(x)).backward()`` on the same model and batch. One intra-op
thread and CPU time (``process_time``), so that other jobs on a shared machine
inflate neither number; wall time is printed too. The two alternate, best of
``--reps``, so drifting background load hits both alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.grad_norms import per_document_loss_and_grad_norm  # noqa: E402
from training.model import ModelArgs, Transformer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      ffn_hidden=args.ffn, max_seq_len=args.seq)
    model = Transformer(margs)
    model.init_weights(0)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    mask = torch.ones(args.batch, args.seq, dtype=torch.bool)
    # Document 0 spans two rows, so the ghost path handles a multi-row document.
    doc_index = torch.tensor([0, *range(args.batch - 1)])
    n_docs = args.batch - 1

    def plain() -> None:
        F.cross_entropy(model(tokens).reshape(-1, args.vocab), targets.reshape(-1)).backward()

    def ghost() -> None:
        per_document_loss_and_grad_norm(model, tokens, targets, mask, doc_index, n_docs)

    cpu: dict[str, list[float]] = {"plain": [], "ghost": []}
    wall: dict[str, list[float]] = {"plain": [], "ghost": []}
    for f in (plain, ghost):
        f()  # warm-up
    for _ in range(args.reps):
        for name, f in (("plain", plain), ("ghost", ghost)):
            c0, w0 = time.process_time(), time.perf_counter()
            f()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    p_cpu, g_cpu = min(cpu["plain"]), min(cpu["ghost"])
    p_wall, g_wall = min(wall["plain"]), min(wall["ghost"])
    print(f"dim {args.dim}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, 1 thread")
    print("| run | CPU s | wall s |")
    print("|---|---:|---:|")
    print(f"| plain forward + backward | {p_cpu:.3f} | {p_wall:.3f} |")
    print(f"| per-document loss + gradient norm (ghost) | {g_cpu:.3f} | {g_wall:.3f} |")
    print(f"overhead: {g_cpu / p_cpu:.2f}x CPU time, {g_wall / p_wall:.2f}x wall")


if __name__ == "__main__":
    main()
