"""Run under torchrun by tests/test_parallel.py: one training step's gradients in a parallel mode.

Builds the tiny model exactly as the trainer does, applies the mode's parallelism,
runs step 1's forward and backward on this rank's share of the batch and writes the
full gradients (DTensors gathered) from rank 0, to be compared with one process.
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
from training.parallel.distributed import init_distributed, shutdown
from training.parallel.setup import Parallel
from training.tokenizer import load_tokenizer
from training.trainer import _rows, build_model, forward_backward


def main(data: str, run: str, params_file: str, overrides: str, out: str) -> None:
    params = load_params(params_file).train
    params = dataclasses.replace(params, parallel=dataclasses.replace(params.parallel, **json.loads(overrides)))
    world = init_distributed()
    par = Parallel.setup(params, world)
    tokenizer = load_tokenizer(run)
    rows, _ = _rows(open_version(data), tokenizer, params, Path(out).parent)  # rows cached beside the output
    torch.manual_seed(params.seed)
    model = build_model(params, tokenizer.get_vocab_size(), torch.device("cpu"))
    par.apply(model, torch.device("cpu"))
    whole = make_batch(rows, batch_rows(len(rows), params.batch_size, 0, params.seed))
    local = par.local_batch(whole)
    norms = params.telemetry.grad_norms if local.has_documents else "off"  # as the trainer does
    loss, *_ = forward_backward(model, local.batch, norms, local.loss_scale)
    loss = par.global_loss(loss, local.batch.n_tokens, local.global_tokens)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    if world.is_main:
        torch.save({"loss": float(loss), "grads": grads}, out)
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
