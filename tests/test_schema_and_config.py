import re
from pathlib import Path

import pytest
import yaml

from assay.config import Params, load_params, params_from_dict
from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA, DOCUMENT_COLUMNS, document_id

ROOT = Path(__file__).resolve().parents[1]


def test_document_columns_are_the_contract():
    assert DOCUMENT_COLUMNS == ("id", "text", "kind", "lang", "source", "path", "meta")
    assert DECISION_SCHEMA.names[:5] == ["id", "stage", "kept", "reason", "scores"]


def test_ids_are_stable_across_runs_and_machines():
    # A fixed value: if this changes, every dataset's ids change with it.
    assert document_id("python-stdlib", "json/__init__.py") == document_id("python-stdlib", "json/__init__.py")
    assert document_id("src", "a/b.py") == "dc268bd76c6872a14fab17daf06d3c6f"
    assert document_id("src", "a/b.py") != document_id("src2", "a/b.py")
    assert document_id("ab", "c") != document_id("a", "bc")  # the separator matters


def test_params_yaml_matches_the_built_in_defaults():
    on_disk = load_params(ROOT / "params.yaml")
    assert on_disk == Params()


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(AssayError, match="ingest.max_byte"):
        params_from_dict({"ingest": {"max_byte": 5}})


def test_wrong_type_is_an_error():
    with pytest.raises(AssayError, match="ingest.max_bytes"):
        params_from_dict({"ingest": {"max_bytes": "ten"}})
    with pytest.raises(AssayError, match="should be an integer"):
        params_from_dict({"ingest": {"max_bytes": True}})


def test_partial_file_fills_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"demo": {"seed": 7}}))
    params = load_params(path)
    assert params.demo.seed == 7 and params.ingest.max_bytes == Params().ingest.max_bytes


def test_bad_yaml_is_a_one_line_error(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("ingest: [unclosed\n")
    with pytest.raises(AssayError, match="not valid YAML"):
        load_params(path)
    path.write_text("train:\n  steps: 3\n  lr: a: b\n")
    with pytest.raises(AssayError, match="not valid YAML at line 3, column 8"):
        load_params(path)


def test_a_params_path_that_is_not_a_text_file_says_so(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(AssayError, match="binary.yaml: not UTF-8 text"):
        load_params(binary)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(AssayError, match="dir.yaml: is a directory"):
        load_params(tmp_path / "dir.yaml")


@pytest.mark.parametrize("tree,key", [
    ({"ingest": {"encoding_confidence": float("nan")}}, "ingest.encoding_confidence = nan"),
    ({"dedup": {"minhash": {"scheme": "bogus"}}}, "dedup.minhash.scheme"),
    ({"dedup": {"semantic": {"kmeans_iterations": -3}}}, "dedup.semantic.kmeans_iterations"),
    ({"quality": {"negatives_per_positive": -1}}, "quality.negatives_per_positive"),
    ({"domain": {"train": {"n_layer": -1}}}, "domain.train.n_layer"),
    ({"train": {"model": {"rope_theta": -1}}}, "train.model.rope_theta"),
    ({"train": {"tokenizer_chars": 0}}, "train.tokenizer_chars"),
    ({"train": {"telemetry": {"spike_window": 0}}}, "train.telemetry.spike_window"),
    ({"dynamic": {"repeat_draws": -1}}, "dynamic.repeat_draws"),
])
def test_values_that_load_but_cannot_work_are_refused_naming_the_key(tree, key):
    with pytest.raises(AssayError, match=re.escape(key)):
        params_from_dict(tree)


def _keys(tree, prefix=""):
    keys = set()
    for key, value in tree.items():
        name = f"{prefix}{key}"
        keys.add(name)
        if isinstance(value, dict) and not all(isinstance(k, int) for k in value):
            keys |= _keys(value, name + ".")
    return keys


def test_params_yaml_names_every_knob():
    import dataclasses

    on_disk = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert _keys(on_disk) == _keys(dataclasses.asdict(Params()))
