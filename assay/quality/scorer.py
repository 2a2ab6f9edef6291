"""Documents → `quality` in [0, 1], for the static stage.

Two kinds of model, chosen in params.yaml:
- `static.head` (default): the logistic head, on hashed word counts of the
  text or on the shared encoder's embedding (which the stage computes
  anyway), as it was trained (`quality.features`);
- `static.model`: a full `AutoModelForSequenceClassification` (for example a
  FineWeb-Edu-style regression classifier), whose output `static.score` maps
  to [0, 1].
"""

from __future__ import annotations

from pickle import UnpicklingError  # the error type only: torch.load(weights_only=True) refusing a file
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from assay.config import FEATURES_WORDS, EncoderParams, ScoreParams, StaticParams
from assay.devices import pick_device
from assay.encoder import CHARS_PER_TOKEN_BOUND, length_sorted_batches, use_bf16
from assay.errors import AssayError
from assay.quality.calibration import Platt
from assay.quality.features import head_features, reusable_filters
from assay.quality.head import FINETUNED_ENCODER, load_head
from filters.base import Filter


class Scorer(Protocol):
    name: str

    def reusable(self, filters: Sequence[Filter]) -> list[str]:
        """The names of the heuristic `filters` whose scores `score(known=)` can use instead of recomputing."""
        ...

    def score(self, texts: list[str], embeddings: np.ndarray,
              known: Mapping[str, np.ndarray] | None = None) -> np.ndarray: ...


class HeadScorer:
    """The head's probability, Platt-calibrated when the head carries a calibration
    (`calibrated=False`: the raw probability, for comparisons)."""

    def __init__(self, directory: str | Path, calibrated: bool = True):
        self.head, self.config = load_head(directory)
        self.calibration = Platt.from_dict(self.config.calibration) if calibrated and self.config.calibration else None
        self.name = f"head:{directory}"

    @property
    def needs_embeddings(self) -> bool:
        return self.config.features != FEATURES_WORDS

    def reusable(self, filters: Sequence[Filter]) -> list[str]:
        # Only the shape features read heuristics' statistics.
        return reusable_filters(filters, self.config.markup) if self.config.shape else []

    def score(self, texts: list[str], embeddings: np.ndarray,
              known: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """`known`: the scores of `reusable` filters for these texts, by score name (see `shape_features`)."""
        c = self.config
        features = (head_features(texts, c.dim - len(c.shape), c.markup, c.shape, c.shape_scale, known)
                    if c.features == FEATURES_WORDS else embeddings)
        logits = self.head.logits(features)
        if self.calibration is not None:
            return self.calibration(logits)
        return 1.0 / (1.0 + np.exp(-logits))


def map_scores(logits: torch.Tensor, params: ScoreParams) -> np.ndarray:
    logits = logits.float()
    if params.mode == "softmax":
        if logits.shape[-1] < 2:
            raise AssayError("static.score.mode=softmax needs a model with two or more labels")
        return torch.softmax(logits, dim=-1)[:, params.positive_index].numpy().astype(np.float64)
    if params.mode == "sigmoid":
        return torch.sigmoid(logits[:, 0]).numpy().astype(np.float64)
    if params.mode == "regression":
        span = params.high - params.low
        if span <= 0:
            raise AssayError("static.score: high must be greater than low")
        return ((logits[:, 0] - params.low) / span).clamp(0, 1).numpy().astype(np.float64)
    raise AssayError(f"params: static.score.mode = {params.mode!r}; expected softmax, sigmoid or regression")


class SequenceClassifierScorer:
    """A full classifier, run with the same length-sorted batching as the encoder."""

    def __init__(self, model: str, score: ScoreParams, encoder: EncoderParams):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.params = score
        self.batch_size = encoder.batch_size
        self.device = pick_device(encoder.device)
        try:
            # trust_remote_code=False: never a model directory's own code (assay/encoder.py says why).
            self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
            self.model = (AutoModelForSequenceClassification.from_pretrained(model, trust_remote_code=False)
                          .to(self.device).eval())
        except (OSError, ValueError, UnpicklingError) as exc:  # ValueError: no tokenizer, or custom code
            raise AssayError(f"static.model {model!r}: cannot load ({str(exc).splitlines()[0]})") from None
        self.max_length = min(encoder.max_length, getattr(self.model.config, "max_position_embeddings", 512))
        self.bf16 = use_bf16(encoder.precision, self.device)
        self.name = f"classifier:{model}"
        self._lock = threading.Lock()

    def reusable(self, filters: Sequence[Filter]) -> list[str]:
        return []

    def score(self, texts: list[str], embeddings: np.ndarray,
              known: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        out = np.zeros(len(texts), dtype=np.float64)
        if not texts:
            return out
        clipped = [t[: self.max_length * CHARS_PER_TOKEN_BOUND] for t in texts]
        ids = self.tokenizer(clipped, truncation=True, max_length=self.max_length)["input_ids"]
        with self._lock, torch.inference_mode():
            for index in length_sorted_batches(ids, self.batch_size):
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in index]}, return_tensors="pt")
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    logits = self.model(**batch).logits
                out[index] = map_scores(logits.cpu(), self.params)
        return out


def encoder_for(params: StaticParams) -> EncoderParams:
    """The encoder the stage must use: a fine-tuned head brings its own.

    A head trained on another encoder than `static.encoder` would score
    vectors from a space it never saw, so that is an error, not a warning.
    """
    if params.model:
        return params.encoder
    head_dir = Path(params.head)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        load_head(head_dir)  # raises the error that names the command to run
    import json

    config = json.loads(config_path.read_text())
    if config.get("features") == FEATURES_WORDS:
        return params.encoder  # the head reads words; the encoder only makes the stored embeddings
    trained = config["encoder"]
    if trained["model"] == FINETUNED_ENCODER:
        return EncoderParams(**{**params.encoder.__dict__, "model": str(head_dir / FINETUNED_ENCODER),
                                "max_length": trained["max_length"]})
    if trained["model"] != params.encoder.model or trained["max_length"] != params.encoder.max_length:
        raise AssayError(
            f"{head_dir}: the head was trained on encoder {trained['model']!r} (max_length {trained['max_length']}) "
            f"but static.encoder is {params.encoder.model!r} (max_length {params.encoder.max_length}); "
            "retrain it with `assay quality train`"
        )
    return params.encoder


def build_scorer(params: StaticParams) -> Scorer:
    if params.model:
        return SequenceClassifierScorer(params.model, params.score, params.encoder)
    return HeadScorer(params.head)
