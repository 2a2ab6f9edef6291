"""Run by tests/test_parallel_pp.py (under torchrun for pp, plainly for the reference): a few
training steps of a tiny decoder on rows of unequal length, pipelined or in one process.

Writes (from rank 0) the step losses, step 1's gradients, the final parameters, the per-document
losses (and with ``norms``, gradient norms) of every step and the pipeline's per-step plans, all
gathered from the stages.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from training.data import TokenRows, batch_rows, make_batch
from training.model import ModelArgs, Transformer
from training.parallel.distributed import init_distributed, run_rank, shutdown
from training.trainer import forward_backward

SEQ = 32


def rows(n: int = 48, seed: int = 0, docs: int | None = None) -> TokenRows:
    """A length mix: a few full rows and many short ones, one document per row, or (``docs``)
    row r in document r % docs, so that a batch holds several rows of each."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.25, SEQ + 1, rng.integers(3, 10, n)).astype(np.int32)
    tokens = np.zeros((n, SEQ + 1), dtype=np.int32)
    for r, length in enumerate(lengths):
        tokens[r, :length] = rng.integers(1, 64, length)
    doc = np.arange(n) if docs is None else np.arange(n) % docs
    return TokenRows(tokens, lengths, doc, [f"doc{d}" for d in range(int(doc.max()) + 1)], 0)


def main(config: str, out: str) -> None:
    cfg = json.loads(config)
    world = init_distributed()
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, dim=32, n_layers=cfg.get("layers", 4), n_heads=2, ffn_hidden=64,
                     max_seq_len=SEQ, **cfg.get("model", {}))
    model = Transformer(args)
    model.init_weights(seed=0)
    data = rows(docs=cfg.get("docs"))
    norms = "ghost" if cfg.get("norms") else "off"
    pipe = None
    if world.distributed:
        from torch.distributed.device_mesh import init_device_mesh

        from training.parallel.pipeline import Pipeline

        mesh = init_device_mesh("cpu", (world.world_size,), mesh_dim_names=("pp",))
        pipe = Pipeline(model, mesh["pp"].get_group(), cfg["schedule"], cfg["microbatches"], cfg["dynamic"],
                        torch.device("cpu"), SEQ)
        if cfg.get("prime"):
            # Synthetic measurements (time and bytes proportional to positions) before step 1, so that
            # step 1 already runs a re-planned batch whatever this machine's timings; later steps
            # plan from what the stages measure.
            from training.parallel.microbatch import Sample

            pipe.scheduler.observe([Sample(s, m, w, 1e-6 * m * w, 2e-6 * m * w, 1e3 * m * w)
                                    for s in range(pipe.n_stages) for m, w in [(1, 16), (2, 32), (4, 32)]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, doc_losses, doc_norms, plans, grads = [], {}, {}, [], {}
    for step in range(cfg["steps"]):
        batch = make_batch(data, batch_rows(len(data), cfg["batch"], step, 0))
        if pipe is None:
            loss, doc_loss, doc_norm, doc_tokens = forward_backward(model, batch, norms)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        else:
            loss, doc_loss, doc_norm, doc_tokens = pipe.step(batch, grad_norms=norms)
            norm = pipe.clip_grad_norm(1.0)
            plans.append(list(pipe.last.plan))
        if pipe is None or pipe.has_last:
            doc_losses.update({f"{step}:{d}": float(v) for d, v in zip(batch.doc_ids, doc_loss)})
        if doc_norm is not None:  # under pp on every rank: rank 0's are written
            doc_norms.update({f"{step}:{d}": float(v) for d, v in zip(batch.doc_ids, doc_norm)})
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        losses.append((float(loss), norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    if world.distributed:
        parts = [None] * world.world_size
        dist.all_gather_object(parts, (grads, state, doc_losses))
        grads = {k: v for g, _, _ in parts for k, v in g.items()}
        state = {k: v for _, s, _ in parts for k, v in s.items()}
        doc_losses = {k: v for _, _, d in parts for k, v in d.items()}
    if world.is_main:
        torch.save({"losses": losses, "grads": grads, "params": state, "doc_losses": doc_losses,
                    "doc_norms": doc_norms, "plans": plans}, out)
    shutdown()


if __name__ == "__main__":
    run_rank(lambda: main(*sys.argv[1:]))
