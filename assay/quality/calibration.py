"""Platt scaling: the quality head's raw score mapped to a probability of good prose.

The head is trained on the reference task (reference set against pool
negatives) with a strong L2 penalty, so its raw probabilities rank well but
sit in a narrow band (about 0.40-0.49 on the demo pool) and mean nothing as
probabilities. Platt (1999) fits p = sigmoid(a * logit + b) by maximum
likelihood on labelled documents that were not used to train the head; here
those are the demo pool's dev part (`quality.dev_share`, labels by
provenance, `assay.quality.pool`), never the measured part. With Platt's
smoothed targets ((N+ + 1) / (N+ + 2) for positives, 1 / (N- + 2) for
negatives) the fit cannot reach 0 or 1 on separable data. The map is
strictly increasing when a > 0 (checked), so ranking and AUC are unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PLATT = "platt"


@dataclass(frozen=True)
class Platt:
    a: float
    b: float
    #: What it was fitted on: documents, positives.
    n: int
    positives: int

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """Probabilities in [0, 1] (float64) of raw logits."""
        z = self.a * np.asarray(logits, dtype=np.float64) + self.b
        return 0.5 * (1.0 + np.tanh(0.5 * z))  # the logistic function, without overflow

    def to_dict(self) -> dict[str, Any]:
        return {"method": PLATT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Platt":
        if data.get("method") != PLATT:
            raise ValueError(f"unknown calibration {data.get('method')!r} (expected {PLATT!r})")
        return cls(float(data["a"]), float(data["b"]), int(data["n"]), int(data["positives"]))


def fit_platt(logits: np.ndarray, labels: np.ndarray, max_iter: int = 100) -> Platt:
    """Platt scaling by Newton's method with backtracking (Lin, Lin and Weng 2007's stable form).

    Raises ValueError unless both classes are present and the fitted map is increasing
    (a score that ranks good prose lower than junk cannot be calibrated into one that ranks it higher).
    """
    f = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    if f.shape != y.shape or f.ndim != 1:
        raise ValueError("logits and labels must be 1-d and the same length")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"Platt scaling needs both classes ({n_pos} positive, {n_neg} negative)")
    t = np.where(y, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    a, b = 0.0, float(np.log((n_pos + 1.0) / (n_neg + 1.0)))  # the prior, where a = 0

    def loss(a: float, b: float) -> float:
        z = a * f + b
        # -[t log p + (1 - t) log(1 - p)] with p = sigmoid(z), written without overflow.
        return float(np.sum(np.logaddexp(0.0, z) - t * z))

    current = loss(a, b)
    for _ in range(max_iter):
        p = 0.5 * (1.0 + np.tanh(0.5 * (a * f + b)))
        d1, d2 = p - t, np.maximum(p * (1 - p), 1e-12)
        g = np.array([np.dot(f, d1), d1.sum()])
        h = np.array([[np.dot(f * f, d2) + 1e-12, np.dot(f, d2)], [np.dot(f, d2), d2.sum() + 1e-12]])
        if np.abs(g).max() < 1e-9:
            break
        step = np.linalg.solve(h, g)
        size = 1.0
        while size > 1e-10:
            na, nb = a - size * step[0], b - size * step[1]
            new = loss(na, nb)
            if new < current + 1e-4 * size * float(g @ -step):
                break
            size /= 2
        else:
            break
        a, b, current = na, nb, new
    if not a > 0:
        raise ValueError(f"Platt scaling gave a non-increasing map (a = {a:.4g}): the score does not rank the classes")
    return Platt(float(a), float(b), n_pos + n_neg, n_pos)
