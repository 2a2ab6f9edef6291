"""Per-token perplexity of documents under a causal LM, over a bounded window.

Any Hugging Face causal LM directory or name works (`domain.model.model`):
the GPT-2-architecture model trained here by `assay domain train`, or a real
code model on a bigger machine. Batches are sorted by length to cut padding.
"""

from __future__ import annotations

import hashlib
import json
from pickle import UnpicklingError  # the error type only: torch.load(weights_only=True) refusing a file
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.config import DomainModelParams
from assay.devices import pick_device
from assay.encoder import length_sorted_batches
from assay.errors import AssayError

#: Written by `assay domain train` beside the model: what it was trained on,
#: and the perplexity distribution of its held-out reference code.
REPORT = "assay_domain_model.json"
CHARS_PER_TOKEN_BOUND = 16
#: Perplexities remembered per process (by content hash).
CACHE_SIZE = 200_000


def missing_model_error(model: str) -> AssayError:
    return AssayError(
        f"domain model {model!r} not found; make it with `assay domain train --data data/static --out {model}` "
        "(or `dvc repro domain-model`), or set domain.model.model to a Hugging Face causal LM"
    )


class PerplexityScorer:
    """Loads the model once; `perplexity` is thread-safe (model calls are serialised)."""

    def __init__(self, params: DomainModelParams):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.params = params
        local = Path(params.model)
        if not local.exists() and (params.model.startswith((".", "/")) or "models/" in params.model):
            raise missing_model_error(params.model)
        self.device = pick_device(params.device)
        try:
            # trust_remote_code=False: never a model directory's own code (assay/encoder.py says why).
            self.tokenizer = AutoTokenizer.from_pretrained(params.model, trust_remote_code=False)
            self.model = AutoModelForCausalLM.from_pretrained(params.model, trust_remote_code=False).to(self.device).eval()
        except OSError:
            raise missing_model_error(params.model) from None
        except (ValueError, UnpicklingError) as exc:  # custom code, or weights that are not tensors
            raise AssayError(f"domain model {params.model!r}: cannot load ({str(exc).splitlines()[0]})") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        limit = getattr(self.model.config, "n_positions", None) or getattr(self.model.config, "max_position_embeddings", params.window)
        self.window = min(params.window, limit)
        self.report: dict[str, Any] = json.loads((local / REPORT).read_text()) if (local / REPORT).is_file() else {}
        self._lock = threading.Lock()
        self._cache: dict[bytes, float] = {}

    @property
    def languages(self) -> list[str] | None:
        """Languages the model was trained on (None: unknown, screen everything)."""
        return self.report.get("languages")

    def screens(self, lang: str | None) -> bool:
        known = self.languages
        return known is None or lang in known

    def perplexity(self, texts: list[str]) -> np.ndarray:
        """Per-token perplexity of each text's first window; NaN for texts under two tokens.

        Results are remembered by content, so the stage's band sample and its
        tasks never score the same document twice.
        """
        out = np.full(len(texts), np.nan)
        clipped = [t[: self.window * CHARS_PER_TOKEN_BOUND] for t in texts]
        keys = [hashlib.blake2b(c.encode("utf-8", "surrogatepass"), digest_size=16).digest() for c in clipped]
        todo = []
        for i, key in enumerate(keys):
            if key in self._cache:
                out[i] = self._cache[key]
            else:
                todo.append(i)
        if todo:
            out[todo] = self._compute([clipped[i] for i in todo])
            with self._lock:
                if len(self._cache) > CACHE_SIZE:
                    self._cache.clear()
                self._cache.update((keys[i], out[i]) for i in todo)
        return out

    def _compute(self, clipped: list[str]) -> np.ndarray:
        out = np.full(len(clipped), np.nan)
        ids = self.tokenizer(clipped, truncation=True, max_length=self.window)["input_ids"]
        with self._lock, torch.inference_mode():
            for batch_rows in length_sorted_batches(ids, self.params.batch_size):
                index = [i for i in batch_rows if len(ids[i]) > 1]
                if not index:
                    continue
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in index]}, return_tensors="pt")
                out[index] = sequence_perplexity(self.model, batch["input_ids"].to(self.device),
                                                 batch["attention_mask"].to(self.device)).cpu().numpy()
        return out


def sequence_perplexity(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """exp(mean next-token NLL) per sequence, padding excluded."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    targets = input_ids[:, 1:]
    mask = attention_mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return torch.exp((nll * mask).sum(1) / mask.sum(1).clamp(min=1.0))


def estimate_band(scorer: PerplexityScorer, texts: list[str], percentiles: list[float] | None) -> tuple[float, float] | None:
    """The perplexity band: `percentiles` of the perplexities of `texts` (a sample of the corpus)."""
    if percentiles is None or not texts:
        return None
    values = scorer.perplexity(texts)
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    low, high = np.percentile(values, percentiles)
    return float(low), float(high)
