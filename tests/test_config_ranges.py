"""params.yaml values out of range fail on loading, with one line that names the key."""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase

import pytest
import yaml

from assay.config import Params, load_params, params_from_dict
from assay.config_ranges import RANGES
from assay.errors import AssayError


def _numeric_keys(obj, prefix: str = "") -> dict[str, object]:
    found = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found.update(_numeric_keys(value, key + "."))
        else:
            found[key] = value
    return found


def test_every_pattern_names_a_real_setting_and_the_defaults_are_in_range():
    keys = _numeric_keys(Params())
    for pattern in RANGES:
        assert any(fnmatchcase(k, pattern) for k in keys), f"{pattern} matches no setting"
    params_from_dict({})  # the defaults load
    load_params("params.yaml")  # and so does the project's file


@pytest.mark.parametrize("data,key", [
    ({"train": {"steps": -5}}, "train.steps"),
    ({"train": {"holdout": 1.5}}, "train.holdout"),
    ({"static": {"threshold": 1.5}}, "static.threshold"),
    ({"static": {"heuristics": {"gopher_quality": {"min_alpha_words_ratio": 2.0}}}},
     "static.heuristics.gopher_quality.min_alpha_words_ratio"),
    ({"dedup": {"minhash": {"bands": 0}}}, "dedup.minhash.bands"),
    ({"io": {"batch_rows": 0}}, "io.batch_rows"),
    ({"train": {"parallel": {"dp_shard": 0}}}, "train.parallel.dp_shard"),
    ({"dynamic": {"loss_high_z": -1.0}}, "dynamic.loss_high_z"),
    ({"train": {"vocab_size": 100}}, "train.vocab_size"),  # was the tokenizer's raw ValueError, mid-run
    ({"domain": {"train": {"vocab_size": 100}}}, "domain.train.vocab_size"),  # was ignored (257 made)
])
def test_a_value_out_of_range_is_one_line_naming_the_key(tmp_path, data, key):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AssayError) as caught:
        load_params(path)
    message = str(caught.value)
    assert message.startswith(f"params: {key} = ") and "\n" not in message, message


def test_null_still_switches_a_rule_off():
    params = params_from_dict({"static": {"heuristics": {"gopher_quality": {"min_alpha_words_ratio": None}}}})
    assert params.static.heuristics.gopher_quality.min_alpha_words_ratio is None


GOPHER = "static.heuristics.gopher_quality"


@pytest.mark.parametrize("data,line", [
    ({"static": {"heuristics": {"gopher_quality": {"min_doc_words": 200, "max_doc_words": 100}}}},
     f"params: {GOPHER}.min_doc_words = 200 should be at most {GOPHER}.max_doc_words = 100"),
    ({"ingest": {"fallback_encodings": ["cp1252", "latin_9x"]}},
     "params: ingest.fallback_encodings[1] = 'latin_9x' is not an encoding Python knows"),
    ({"train": {"model": {"attention": "flash"}}}, "params: train.model.attention = 'flash' should be one of dense, sparse"),
    ({"vectors": {"backend": "milvus"}}, "params: vectors.backend = 'milvus' should be one of local, weaviate"),
    ({"train": {"device": "gpu"}}, "params: train.device = 'gpu' should be auto or a torch device (cpu, cuda, cuda:1, mps, ...)"),
    ({"score": {"device": "gpu"}}, "params: score.device = 'gpu' should be auto or a torch device (cpu, cuda, cuda:1, mps, ...)"),
    ({"static": {"encoder": {"device": "cuda0"}}},
     "params: static.encoder.device = 'cuda0' should be auto or a torch device (cpu, cuda, cuda:1, mps, ...)"),
    ({"domain": {"model": {"device": "GPU"}}},
     "params: domain.model.device = 'GPU' should be auto or a torch device (cpu, cuda, cuda:1, mps, ...)"),
    ({"ingest": {"fallback_encodings": ["rot13"]}}, "params: ingest.fallback_encodings[0] = 'rot13' is not a text encoding"),
    ({"static": {"heuristics": {"gopher_quality": {"min_avg_word_length": 12, "max_avg_word_length": 10}}}},
     f"params: {GOPHER}.min_avg_word_length = 12.0 should be at most {GOPHER}.max_avg_word_length = 10.0"),
    ({"domain": {"rules": {"config_min_chars": 6000}}},
     "params: domain.rules.config_min_chars = 6000 should be at most domain.rules.config_max_chars = 5000"),
    ({"domain": {"model": {"min_perplexity": 2.0e9}}},
     "params: domain.model.min_perplexity = 2000000000.0 should be at most domain.model.max_perplexity = 1000000000.0"),
])
def test_a_value_its_stage_would_refuse_or_ignore_is_one_line_on_loading(tmp_path, data, line):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AssayError) as caught:
        load_params(path)
    assert str(caught.value) == line


@pytest.mark.parametrize("model, message", [
    ({"dim": 33, "n_heads": 2}, r"train.model.dim = 33 should be a multiple of train.model.n_heads = 2"),
    ({"dim": 34, "n_heads": 2}, r"train.model.dim / train.model.n_heads = 17 should be even"),
    ({"ffn": "moe", "n_experts": 4, "moe_topk": 5}, r"train.model.moe_topk = 5 should be at most train.model.n_experts = 4"),
])
def test_a_model_shape_the_model_refuses_is_refused_on_loading_naming_the_keys(model, message):
    """They were `assay: internal error: ValueError` once training had started (a probe, 2026-12-07)."""
    from assay.config import params_from_dict
    from assay.errors import AssayError

    with pytest.raises(AssayError, match=message):
        params_from_dict({"train": {"model": model}})
