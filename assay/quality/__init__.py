"""Tier 1's confidence score: a head on the shared encoder, or a full classifier.

`head` (the logistic head and its files), `metrics` (AUC, precision/recall,
calibration), `train` (`assay quality train`: the reference recipe or a
labelled file, optionally fine-tuning the encoder) and `scorer` (documents →
`quality` in [0, 1], for the static stage).
"""
