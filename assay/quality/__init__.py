"""Tier 1's confidence score: a head on hashed words or on the shared encoder, or a full classifier.

`features` (hashed word counts and the shape features), `head` (the logistic head and its files),
`metrics` (AUC, precision/recall, calibration), `train` (`assay quality
train`: the reference recipe or a labelled file, optionally fine-tuning the
encoder), `calibration` (Platt scaling of the head on the pool's dev part),
`scorer` (documents → `quality` in [0, 1], for the static stage), `pool`
(the demo's labelled pool: labels by provenance, the negatives/dev/measured
split, tier 1's measurement), `fresh`, `fresh2`, `fresh3`, `fresh4` and
`fresh5` (five more labelled sets of other files of the machine, for
reporting only; fresh2's to fresh5's labels are committed manifests written
before their first score).
"""
