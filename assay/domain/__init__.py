"""Tier 3's domain model: a small causal LM trained on reference code, and the perplexity screen it gives.

`train` (`assay domain train`, the DVC stage `domain-model`) and
`perplexity` (per-document perplexity under any Hugging Face causal LM).
"""
