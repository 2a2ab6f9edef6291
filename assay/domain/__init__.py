"""Tier 3's domain model: a small causal LM trained on reference code, and the perplexity screen it gives.

`train` (`assay domain train`, the DVC stage `domain-model`),
`perplexity` (per-document perplexity under any Hugging Face causal LM),
`labelled` (a set of real code labelled generated or hand-written by
provenance) and `evaluate` (tier 3's precision and recall on that set).
"""
