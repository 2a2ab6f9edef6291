"""Assay: versioned, filtered pre-training data, closed-loop with training."""

__version__ = "0.1.0"
