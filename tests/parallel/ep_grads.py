"""Run under torchrun by tests/test_parallel_ep.py: step 1's gradients under expert parallel.

As tests/parallel/grad_worker.py, but every rank writes its own file: under ep a rank holds
only its experts, so the whole gradient is the union of the ranks' (FSDP shards gathered), and
the per-document gradient norms are the union of the ranks' documents'.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from assay.config import load_params
from assay.versions import open_version
from training.data import batch_rows, make_batch
from training.parallel.distributed import init_distributed, run_rank, shutdown
from training.parallel.setup import Parallel
from training.tokenizer import load_tokenizer
from training.trainer import _rows, build_model, forward_backward


def main(data: str, run: str, params_file: str, overrides: str, out: str) -> None:
    params = load_params(params_file).train
    params = dataclasses.replace(params, parallel=dataclasses.replace(params.parallel, **json.loads(overrides)))
    world = init_distributed()
    par = Parallel.setup(params, world)
    tokenizer = load_tokenizer(run)
    rows, _ = _rows(open_version(data), tokenizer, params, Path(f"{out}.rows-{world.rank}"))  # a cache per rank
    torch.manual_seed(params.seed)
    model = build_model(params, tokenizer.get_vocab_size(), torch.device("cpu"))
    par.apply(model, torch.device("cpu"))
    whole = make_batch(rows, batch_rows(len(rows), params.batch_size, 0, params.seed))
    local = par.local_batch(whole)
    norms = par.telemetry_grad_norms(params.telemetry.grad_norms, local.has_documents)
    loss, _, doc_norms, _ = forward_backward(model, local.batch, norms, local.loss_scale)
    loss = par.global_loss(loss, local.batch.n_tokens, local.global_tokens)
    par.sum_moe_loads(model, local.has_documents)
    grad_norm = par.clip_grad_norm(model, float("inf"))
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    loads = [m.tokens_per_expert.clone() for m in model.moe_layers()]
    # Per-document gradient norms of this rank's documents (ghost norms; under ep the experts'
    # part is computed on the ranks holding them).
    doc_norms = dict(zip(local.batch.doc_ids, doc_norms.tolist())) if local.has_documents else {}
    # The experts' part alone (everything else frozen): in this small model it is a small share of
    # a document's norm, so the whole norm's tolerance would hardly see it go wrong.
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name)
    _, _, expert_norms, _ = forward_backward(model, local.batch, norms, local.loss_scale)
    expert_norms = dict(zip(local.batch.doc_ids, expert_norms.tolist())) if local.has_documents else {}
    torch.save({"loss": float(loss), "grads": grads, "grad_norm": grad_norm, "loads": loads,
                "doc_norms": doc_norms, "expert_norms": expert_norms}, f"{out}.{world.rank}")
    shutdown()


if __name__ == "__main__":
    run_rank(lambda: main(*sys.argv[1:]))
