"""Run under torchrun by tests/test_parallel_tp.py: per-document losses and ghost gradient norms of
a tensor-parallel model against the same model unsharded, in the same process.

Writes, from rank 0, a JSON list of {attention, method, loss, norm, ref_loss, ref_norm, grads_close}
for dense and sparse attention and both Linear norm algorithms.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from training.grad_norms import per_document_loss_and_grad_norm
from training.model import ModelArgs, Transformer
from training.parallel.distributed import run_rank
from training.parallel.tensor_parallel import apply_tensor_parallel


def main(out: str) -> None:
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    results = []
    for attention in ("dense", "sparse"):
        args = ModelArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=16,
                         attention=attention, sparse_window=4, sparse_block=4, sparse_topk=2)
        models = []
        for _ in range(2):
            m = Transformer(args)
            m.init_weights(seed=3)
            models.append(m)
        ref, sharded = models
        apply_tensor_parallel(sharded, mesh["tp"])
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 96, (5, 16), generator=gen)
        targets = torch.randint(0, 96, (5, 16), generator=gen)
        mask = torch.rand(5, 16, generator=gen) > 0.25
        doc_index = torch.tensor([0, 1, 1, 2, 1])  # document 1 spans three rows: cross-row terms
        for method in ("ghost", "materialise"):
            for m in models:
                m.zero_grad(set_to_none=True)
            got = per_document_loss_and_grad_norm(sharded, tokens, targets, mask, doc_index, 3, method=method,
                                                  loss_scale=2.0)
            want = per_document_loss_and_grad_norm(ref, tokens, targets, mask, doc_index, 3, method=method,
                                                   loss_scale=2.0)
            grads_close = all(
                torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
                for p, q in zip(sharded.parameters(), ref.parameters()))
            results.append({"attention": attention, "method": method, "loss": got.loss.tolist(),
                            "norm": got.grad_norm.tolist(), "ref_loss": want.loss.tolist(),
                            "ref_norm": want.grad_norm.tolist(), "grads_close": grads_close})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(lambda: main(sys.argv[1]))
