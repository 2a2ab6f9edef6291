"""The allowed range of each numeric setting in params.yaml.

`assay.config` checks types; this table says which values make sense, so that
`train: {steps: -5}` or `static: {threshold: 1.5}` fails on loading with one line that
names the key, instead of deep inside a stage. Keys are dotted paths; `*` matches
within one part (fnmatch). A test checks that every pattern still names a real key.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from assay.errors import AssayError

__all__ = ["RANGES", "check_range"]

AT_LEAST_1 = (1, None)
COUNT = (0, None)
SHARE = (0.0, 1.0)

#: pattern -> (lowest, highest), either end None for open. Inclusive.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "io.shard_bytes": AT_LEAST_1,
    "io.batch_rows": AT_LEAST_1,
    "io.batch_bytes": AT_LEAST_1,
    "ingest.max_bytes": AT_LEAST_1,
    "ingest.unit_bytes": AT_LEAST_1,
    "ingest.encoding_confidence": SHARE,
    "ingest.jsonl_block_bytes": AT_LEAST_1,
    "ingest.jsonl_threads": COUNT,
    "demo.*": COUNT,
    "static.heuristics.*.*_ratio": SHARE,
    "static.heuristics.*.*_frac": SHARE,
    "static.heuristics.*.*_thr": SHARE,
    "static.heuristics.*.min_*": COUNT,
    "static.heuristics.*.max_*": COUNT,
    "static.threshold": SHARE,
    "static.encoder.max_length": AT_LEAST_1,
    "static.encoder.batch_size": AT_LEAST_1,
    "quality.negatives_share": SHARE,
    "quality.dev_share": SHARE,
    "quality.holdout": SHARE,
    "quality.hash_dim": AT_LEAST_1,
    "domain.max_parse_error_ratio": SHARE,
    "domain.rules.*_fraction": SHARE,
    "domain.model.window": AT_LEAST_1,
    "domain.model.batch_size": AT_LEAST_1,
    "domain.train.steps": AT_LEAST_1,
    "domain.train.vocab_size": (257, None),  # the 256 byte tokens and EOS: below, 257 are made anyway
    "domain.train.n_layer": AT_LEAST_1,
    "domain.train.n_head": AT_LEAST_1,
    "domain.train.n_embd": AT_LEAST_1,
    "domain.train.context": AT_LEAST_1,
    "domain.train.batch_size": AT_LEAST_1,
    "domain.train.lr": (0.0, None),
    "domain.train.holdout": SHARE,
    "dedup.minhash.ngram": AT_LEAST_1,
    "dedup.minhash.bands": AT_LEAST_1,
    "dedup.minhash.rows": AT_LEAST_1,
    "dedup.minhash.threshold": SHARE,
    "dedup.semantic.eps": SHARE,
    "dedup.semantic.docs_per_cluster": AT_LEAST_1,
    "dedup.semantic.max_flat_clusters": AT_LEAST_1,
    "dedup.semantic.partitions": AT_LEAST_1,
    "dedup.semantic.kmeans_iterations": AT_LEAST_1,
    "quality.negatives_per_positive": (0.0, None),
    "vectors.batch_size": AT_LEAST_1,
    "train.model.dim": AT_LEAST_1,
    "train.model.n_layers": AT_LEAST_1,
    "train.model.n_heads": AT_LEAST_1,
    "train.model.ffn_hidden": AT_LEAST_1,
    "train.model.sparse_*": AT_LEAST_1,
    "train.model.n_experts": AT_LEAST_1,
    "train.model.moe_topk": AT_LEAST_1,
    "train.model.rope_theta": (1.0, None),
    "train.tokenizer_chars": AT_LEAST_1,
    "train.telemetry.spike_window": AT_LEAST_1,
    "train.telemetry.spike_min_history": AT_LEAST_1,
    "train.vocab_size": (260, None),  # the 256 byte tokens and the specials: the tokenizer refuses fewer
    "train.seq_len": AT_LEAST_1,
    "train.batch_size": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.lr": (0.0, None),
    "train.min_lr_ratio": SHARE,
    "train.warmup_steps": COUNT,
    "train.weight_decay": (0.0, None),
    "train.grad_clip": (0.0, None),
    "train.holdout": SHARE,
    "train.eval_rows": COUNT,
    "train.checkpoint_every": AT_LEAST_1,
    "train.parallel.dp_replicate": AT_LEAST_1,
    "train.parallel.dp_shard": (-1, None),  # -1: whatever the world size leaves over
    "train.parallel.tp": AT_LEAST_1,
    "train.parallel.pp": AT_LEAST_1,
    "train.parallel.cp": AT_LEAST_1,
    "train.parallel.ep": AT_LEAST_1,
    "flow.max_workers": AT_LEAST_1,
    "dynamic.*_z": (0.0, None),
    "dynamic.min_stratum_docs": AT_LEAST_1,
    "dynamic.repeat_draws": AT_LEAST_1,
    "score.max_rows": AT_LEAST_1,
    "score.batch_tokens": AT_LEAST_1,
    "score.part_docs": AT_LEAST_1,
}


def check_range(key: str, value: Any) -> None:
    """Raise AssayError naming `key` when its number is outside the range its pattern allows."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value != value:  # NaN: every comparison with it is false, so a threshold of NaN cuts nothing
        raise AssayError(f"params: {key} = nan is not a number")
    for pattern, (low, high) in RANGES.items():
        if not fnmatchcase(key, pattern):
            continue
        if key == "train.parallel.dp_shard" and value == 0:
            raise AssayError("params: train.parallel.dp_shard = 0 should be -1 or at least 1")
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise AssayError(f"params: {key} = {value!r} should be in {span}")
        return
