"""The quality head: logistic regression on a document's features.

Features (`HeadConfig.features`) are either the encoder's mean-pooled
embedding (the encoder was trained with mean pooling, so a head on the pooled
embedding fits better than `AutoModelForSequenceClassification`'s fresh head
on the pooler output) or hashed word counts (`assay.quality.features`, a
sparse input). Files under the head directory:

    head.safetensors   weight (1, dim), bias (1,)
    config.json        features, the encoder it expects, threshold, recipe, metrics, calibration
    encoder/           only after --finetune: the fine-tuned encoder
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from assay.errors import AssayError
from assay.shards import atomic_write_bytes, atomic_write_json

WEIGHTS = "head.safetensors"
CONFIG = "config.json"
FINETUNED_ENCODER = "encoder"


class LinearHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits, shape (n,), of dense or sparse (COO) features."""
        if features.is_sparse:
            return (torch.sparse.mm(features, self.linear.weight.t()) + self.linear.bias).squeeze(-1)
        return self.linear(features).squeeze(-1)

    def probabilities(self, features: np.ndarray | torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return torch.sigmoid(self(_as_tensor(features))).numpy()

    def logits(self, features: np.ndarray | torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return self(_as_tensor(features)).numpy().astype(np.float64)


def _as_tensor(features: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(features, torch.Tensor):
        return features
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))


@dataclass
class HeadConfig:
    encoder: dict[str, Any]  # EncoderParams as a dict; model may be FINETUNED_ENCODER
    dim: int
    threshold: float
    recipe: str
    finetuned: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    #: "embedding" (the encoder's vector, dim = its size) or "words" (hashed word counts, dim buckets).
    features: str = "embedding"
    #: Platt scaling of the logit (`assay.quality.calibration`), fitted on labelled documents the head
    #: was not trained on; None: the score is the head's raw probability.
    calibration: dict[str, Any] | None = None
    #: Words features only: the words are counted with the text's markup taken out (`quality.markup`).
    #: Heads saved before this existed read the raw text.
    markup: bool = False
    #: Words features only: the shape features appended after the word buckets (`SHAPE_FEATURES` names,
    #: in order; ours, `quality.shape`), each times `shape_scale`. Heads saved before these existed: none.
    shape: list[str] = field(default_factory=list)
    shape_scale: float = 1.0
    #: What trained the head (`assay.installation`): static's verdicts rest on it as on its own code.
    #: Heads saved before this existed: None.
    installation: dict[str, Any] | None = None


def fit_logistic(x: np.ndarray | torch.Tensor, y: np.ndarray, *, l2: float, max_iter: int = 300) -> LinearHead:
    """Full-batch L-BFGS on the logistic loss: deterministic and quick for ≤1e5 rows (x dense or sparse COO)."""
    torch.manual_seed(0)
    inputs = _as_tensor(x)
    targets = torch.from_numpy(np.asarray(y, dtype=np.float32))
    head = LinearHead(inputs.shape[1])
    nn.init.zeros_(head.linear.weight)
    nn.init.zeros_(head.linear.bias)
    # Balance the classes so the threshold means the same for any ratio.
    pos = float(targets.sum())
    weight = torch.where(targets > 0, len(targets) / (2 * max(pos, 1)), len(targets) / (2 * max(len(targets) - pos, 1)))
    loss_fn = nn.BCEWithLogitsLoss(weight=weight)
    optimizer = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(head(inputs), targets) + l2 * head.linear.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return head.eval()


def save_head(directory: str | Path, head: LinearHead, config: HeadConfig) -> None:
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": head.linear.weight.detach().contiguous(), "bias": head.linear.bias.detach().contiguous()}
    atomic_write_bytes(directory / WEIGHTS, save(tensors, metadata={"format": "pt"}))
    atomic_write_json(directory / CONFIG, asdict(config))


def load_head(directory: str | Path) -> tuple[LinearHead, HeadConfig]:
    """Load a head; never unpickles (safetensors and JSON only)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / WEIGHTS).is_file() or not (directory / CONFIG).is_file():
        raise AssayError(
            f"{directory}: no trained quality head; make it with `assay quality train --data data/raw` "
            "(or `dvc repro quality-head`)"
        )
    config = HeadConfig(**json.loads((directory / CONFIG).read_text()))
    try:
        tensors = load_file(directory / WEIGHTS)
    except Exception as exc:  # safetensors' own error type is not importable by a stable name
        raise AssayError(f"{directory / WEIGHTS}: not a safetensors file ({str(exc).splitlines()[0]})") from None
    head = LinearHead(config.dim)
    head.linear.weight.data.copy_(tensors["weight"])
    head.linear.bias.data.copy_(tensors["bias"])
    return head.eval(), config
