"""Split one step's batch over the data-parallel ranks, never splitting a document.

The global batch of step ``s`` is the single-process one (``training.data.batch_rows``);
each dp rank takes whole documents of it, so that every document's loss and gradient
norm is computed on one rank, exactly as in a single process (per-document telemetry
stays exact). Documents go to ranks greedily, largest first, to the rank with the
fewest tokens so far: deterministic, and balanced to within one document.

A rank left without a document (fewer documents than ranks) runs one row of the
batch with an all-false loss mask: its loss and gradients are exactly zero, and it
still takes part in every collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training.data import Batch

__all__ = ["LocalBatch", "assign_documents", "local_batch"]


@dataclass
class LocalBatch:
    batch: Batch
    #: Multiply this rank's mean token loss by it before backward: DDP and FSDP average
    #: over the ``dp`` ranks, and ``dp × local_tokens / global_tokens`` makes that average
    #: the single-process batch mean.
    loss_scale: float
    global_tokens: int
    #: False for the placeholder row of a rank without documents (nothing to report).
    has_documents: bool


def assign_documents(doc_tokens: np.ndarray, dp: int) -> np.ndarray:
    """Rank (0 .. dp-1) of each document, given its target tokens in the batch."""
    load = np.zeros(dp, dtype=np.int64)
    owner = np.empty(len(doc_tokens), dtype=np.int64)
    for d in sorted(range(len(doc_tokens)), key=lambda i: (-int(doc_tokens[i]), i)):
        rank = int(np.argmin(load))  # argmin takes the lowest rank on ties
        owner[d] = rank
        load[rank] += int(doc_tokens[d])
    return owner


def local_batch(batch: Batch, rank: int, dp: int) -> LocalBatch:
    """This rank's rows of ``batch`` (documents renumbered 0.. in order)."""
    global_tokens = int(batch.loss_mask.sum())
    if dp == 1:
        return LocalBatch(batch, 1.0, global_tokens, True)
    n_docs = len(batch.doc_ids)
    doc_tokens = torch.zeros(n_docs, dtype=torch.long).index_add_(0, batch.doc_index, batch.loss_mask.sum(1))
    owner = assign_documents(doc_tokens.numpy(), dp)
    mine = np.flatnonzero(owner == rank)
    if len(mine) == 0:
        placeholder = Batch(batch.tokens[:1], batch.targets[:1], torch.zeros_like(batch.loss_mask[:1]),
                            torch.zeros(1, dtype=torch.long), [""])
        # Any positive scale: with no target token its loss, and so every gradient, is exactly 0.
        return LocalBatch(placeholder, 1.0, global_tokens, False)
    renumber = torch.full((n_docs,), -1, dtype=torch.long)
    renumber[torch.from_numpy(mine)] = torch.arange(len(mine))
    rows = torch.nonzero(renumber[batch.doc_index] >= 0).squeeze(1)
    local = Batch(batch.tokens[rows], batch.targets[rows], batch.loss_mask[rows],
                  renumber[batch.doc_index[rows]], [batch.doc_ids[d] for d in mine])
    scale = dp * int(local.loss_mask.sum()) / max(global_tokens, 1)
    return LocalBatch(local, scale, global_tokens, True)
