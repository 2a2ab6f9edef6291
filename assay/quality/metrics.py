"""Held-out evaluation of a probability score: AUC, precision/recall, calibration."""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    labels = np.asarray(labels, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, counts)
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def precision_recall(labels: np.ndarray, scores: np.ndarray, threshold: float) -> dict[str, float]:
    labels = np.asarray(labels, dtype=bool)
    predicted = np.asarray(scores) >= threshold
    tp = int((predicted & labels).sum())
    fp = int((predicted & ~labels).sum())
    fn = int((~predicted & labels).sum())
    return {
        "threshold": threshold,
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / (tp + fn) if tp + fn else float("nan"),
        "accuracy": float((predicted == labels).mean()) if len(labels) else float("nan"),
    }


def calibration_table(labels: np.ndarray, scores: np.ndarray, bins: int = 10) -> list[dict[str, float]]:
    """Per score bin: how many, mean predicted probability, observed positive rate."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(scores, edges[1:-1]), 0, bins - 1)
    rows = []
    for b in range(bins):
        mask = which == b
        n = int(mask.sum())
        rows.append({
            "low": float(edges[b]),
            "high": float(edges[b + 1]),
            "count": n,
            "mean_predicted": float(scores[mask].mean()) if n else float("nan"),
            "observed_positive": float(labels[mask].mean()) if n else float("nan"),
        })
    return rows


def expected_calibration_error(table: list[dict[str, float]]) -> float:
    total = sum(r["count"] for r in table)
    if not total:
        return float("nan")
    return float(sum(r["count"] * abs(r["mean_predicted"] - r["observed_positive"]) for r in table if r["count"]) / total)
