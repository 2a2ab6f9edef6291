"""Run under torchrun by tests/test_parallel_pp.py: step 1's gradients under DP × PP.

Builds the tiny model exactly as the trainer does, applies the layout (pipeline stages, each
wrapped over its dp sub-mesh), runs step 1 through the pipeline on this dp rank's rows and writes,
from rank 0, the global loss and every parameter's full gradient (FSDP shards gathered over dp,
stages gathered over pp), to be compared with one process (tests/parallel/grad_worker.py "{}").
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from assay.config import load_params
from assay.versions import open_version
from training.data import batch_rows, make_batch
from training.parallel.distributed import init_distributed, shutdown
from training.parallel.setup import Parallel
from training.tokenizer import load_tokenizer
from training.trainer import _rows, build_model


def main(data: str, run: str, params_file: str, overrides: str, out: str) -> None:
    params = load_params(params_file).train
    params = dataclasses.replace(params, parallel=dataclasses.replace(params.parallel, **json.loads(overrides)))
    world = init_distributed()
    par = Parallel.setup(params, world)
    assert par.pipelined and par.dims.dp > 1, par.describe()
    tokenizer = load_tokenizer(run)
    rows, _ = _rows(open_version(data), tokenizer, params, Path(out).parent)  # rows cached beside the output
    torch.manual_seed(params.seed)
    model = build_model(params, tokenizer.get_vocab_size(), torch.device("cpu"))
    par.apply(model, torch.device("cpu"))
    whole = make_batch(rows, batch_rows(len(rows), params.batch_size, 0, params.seed))
    local = par.local_batch(whole)
    loss, *_ = par.pipeline.step(local.batch, local.global_tokens)
    loss = par.global_loss(loss, local.batch.n_tokens, local.global_tokens)
    grads = {}
    for name, p in model.named_parameters():  # full_tensor: collective over this stage's dp ranks
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    parts = [None] * world.world_size
    dist.all_gather_object(parts, grads)
    if world.is_main:
        torch.save({"loss": float(loss), "grads": {k: v for g in parts for k, v in g.items()}}, out)
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
