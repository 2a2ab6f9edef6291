"""Tensor + sequence parallelism (Megatron-LM's, in torchtitan's shape) over the ``tp`` mesh.

Inside a block the sequence is whole and the heads / hidden units are split:

- ``wq``, ``wk``, ``wv``, ``w1``, ``w3``: column-parallel (each rank holds ``1/tp`` of the
  output features, so of the heads: ``Attention`` reshapes with ``-1`` heads and so gets its
  local head count from the weight it holds);
- ``wo``, ``w2``: row-parallel, their partial sums reduce-scattered along the sequence.

Between blocks the residual stream is split along the sequence (sequence parallel): the
norms run on ``N/tp`` positions, ``attention``/``feed_forward`` all-gather their input
(``PrepareModuleInput``), the row-parallel outputs reduce-scatter back. The residual adds
run on plain local tensors (``use_local_output``). The embedding is row-parallel over the
vocabulary (a masked lookup, reduce-scattered into sequence shards); the output head is
column-parallel over the vocabulary and all-gathers its logits, so the loss and every
per-document statistic are computed on whole logits, the same on every tp rank.

Every tp rank of one data-parallel group sees the same rows (the batch is split over ``dp``
only). Per-document ghost gradient norms stay exact: ``training.grad_norms`` computes each
rank's share from the local shards and sums it over the tp group.

Under pp the same plan is applied to each rank's pruned model (the ends it does not hold are
skipped): a stage then sends and receives its tp rank's sequence shard of the residual stream
(``training.parallel.pipeline``).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from assay.errors import AssayError
from training.model import Transformer
from training.moe import MoE
from training.parallel.dims import ParallelDims

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "check_tensor_parallel_layout"]


def check_tensor_parallel_layout(dims: ParallelDims) -> None:
    """The data-parallel modes tp combines with: FSDP2 over dp_shard (and HSDP), as torchtitan."""
    if dims.tp > 1 and dims.ddp and not dims.fsdp:
        raise AssayError("parallel: tp with DDP (dp_replicate > 1, dp_shard 1) is not supported: composable "
                         "DDP takes 1-D meshes only; shard the data-parallel ranks instead (--dp-shard)")


def check_tensor_parallel(model: Transformer, tp: int) -> None:
    """Refuse models the plan cannot split evenly, before any collective runs. The trainer's
    sequences are ``max_seq_len`` long (``train.seq_len``), so that is what must split over tp."""
    args = model.args
    seq_len = args.max_seq_len
    problems = []
    if args.n_heads % tp:
        problems.append(f"n_heads {args.n_heads} is not divisible by tp={tp} (heads are split over tp ranks)")
    if args.ffn_hidden % tp:
        problems.append(f"ffn_hidden {args.ffn_hidden} is not divisible by tp={tp}")
    if seq_len % tp:
        problems.append(f"seq_len (train.seq_len) {seq_len} is not divisible by tp={tp} (sequence parallel splits the "
                        "residual stream along the sequence)")
    # Uneven shards would need padded collectives; an uneven vocabulary split hung in the output
    # head's all-gather here (torch 2.13, gloo), so it is refused rather than risked.
    if args.vocab_size % tp:
        problems.append(f"the vocabulary ({args.vocab_size} tokens) is not divisible by tp={tp} (the embedding "
                        "and output head are split over it); choose train.vocab_size so that the tokenizer's is")
    if any(isinstance(layer.feed_forward, MoE) for layer in model.layers.values()):
        problems.append("MoE feed-forward layers are not tensor-parallel here: shard experts with ep instead")
    if problems:
        raise AssayError("parallel: tp: " + "; ".join(problems))


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Shard ``model`` in place over ``tp_mesh`` (1-D); returns it. Sequences fed to it must have
    a length divisible by the tp size (the trainer's are all ``max_seq_len`` long)."""
    check_tensor_parallel(model, tp_mesh.size())
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Whole logits on every rank: the trainer's losses and telemetry need no vocab-parallel loss.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    # A pipeline stage's pruned model lacks the ends it does not hold (set to None).
    ends = {name: style for name, style in ends.items() if getattr(model, name) is not None}
    if ends:
        parallelize_module(model, tp_mesh, ends)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin): only x is sharded; the RoPE tables are plain and whole.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_gradient_like_parameter)
    return model


def _gradient_like_parameter(p: nn.Parameter) -> None:
    """DTensor's embedding backward leaves the whole table's gradient on every rank (Replicate), and
    the norms' weights get per-rank partial sums: lay each gradient out like its parameter as soon as
    it is accumulated, so that a rank keeps only its shard and partial sums are reduced once. (Under
    FSDP this hook is not reached: FSDP's own parameters replace these and it reshards gradients itself.)"""
    if p.grad is not None and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)

