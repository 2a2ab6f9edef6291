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
from training.parallel.distributed import init_distributed, run_rank, shutdown
from training.parallel.setup import Parallel
from training.tokenizer import load_tokenizer
from training.trainer import _rows, build_model, forward_backward


def step_one(data: str, run: str, params_file: str, overrides: str, out: str):
    """The tiny model and step 1's local batch with the layout `overrides` applied, as the trainer builds them."""
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
    return params, world, par, model, par.local_batch(whole)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a DTensor's shards gathered: a collective over its mesh)."""
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def main(data: str, run: str, params_file: str, overrides: str, out: str) -> None:
    params, world, par, model, local = step_one(data, run, params_file, overrides, out)
    norms = params.telemetry.grad_norms if local.has_documents else "off"  # as the trainer does
    loss, *_ = forward_backward(model, local.batch, norms, local.loss_scale)
    loss = par.global_loss(loss, local.batch.n_tokens, local.global_tokens)
    grads = full_grads(model)
    if world.is_main:
        torch.save({"loss": float(loss), "grads": grads}, out)
    shutdown()

if __name__ == "__main__":
    run_rank(lambda: main(*sys.argv[1:]))
