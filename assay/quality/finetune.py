"""`assay quality train --finetune`: train the whole encoder with the head.

Slow on a CPU (every step is a forward and backward pass of the encoder), so
it is an option, not the default. The head starts from the logistic fit, so
fine-tuning begins from a good classifier and only refines it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from assay.encoder import Encoder, mean_pool
from assay.quality.head import LinearHead

BATCH = 16


def finetune_encoder(
    encoder: Encoder, head: LinearHead, texts: list[str], labels: np.ndarray, *, epochs: int, lr: float, seed: int
) -> tuple[Encoder, LinearHead]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    encoder.to_fp32()
    model = encoder.model
    model.train()
    head.train()
    ids = encoder.tokenize(texts)
    targets = torch.from_numpy(labels.astype(np.float32))
    pos = float(targets.sum())
    pos_weight = torch.tensor((len(targets) - pos) / max(pos, 1.0))
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=lr, weight_decay=0.01)
    for _ in range(epochs):
        order = rng.permutation(len(ids))
        for start in range(0, len(order), BATCH):
            index = order[start : start + BATCH]
            batch = encoder.tokenizer.pad({"input_ids": [ids[i] for i in index]}, return_tensors="pt")
            batch = {k: v.to(encoder.device) for k, v in batch.items()}
            pooled = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
            loss = loss_fn(head(pooled.cpu()), targets[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    head.eval()
    return encoder, head
