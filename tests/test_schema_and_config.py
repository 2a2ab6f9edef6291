import re
from pathlib import Path

import pytest
import yaml

from assay.config import TORCH_DEVICE_TYPES, TRAIN_ATTENTIONS, VECTOR_BACKENDS, Params, load_params, params_from_dict
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
    ({"static": {"heuristics": {"gopher_quality": {"min_doc_words": 101, "max_doc_words": 100}}}},
     "gopher_quality.min_doc_words = 101 should be at most static.heuristics.gopher_quality.max_doc_words = 100"),
    ({"ingest": {"fallback_encodings": ["utf-99"]}}, "ingest.fallback_encodings[0] = 'utf-99'"),
    ({"ingest": {"fallback_encodings": ["cp\x001252"]}}, "ingest.fallback_encodings[0]"),
    ({"train": {"model": {"attention": "Dense"}}}, "train.model.attention = 'Dense'"),
    ({"vectors": {"backend": "faiss"}}, "vectors.backend = 'faiss'"),
    ({"train": {"device": "cuda0"}}, "train.device = 'cuda0'"),
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


def test_word_count_bounds_may_meet_or_be_switched_off():
    for min_words, max_words in ((100, 100), (None, 10), (500, None)):
        gq = {"min_doc_words": min_words, "max_doc_words": max_words}
        params = params_from_dict({"static": {"heuristics": {"gopher_quality": gq}}})
        assert params.static.heuristics.gopher_quality.min_doc_words == min_words


# What the runtime check (assay.devices.pick_device: "auto", else torch.device(name)) takes and refuses.
DEVICES = ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:12", "cpu:0", "xpu", "xpu:1", "mps", "meta", "hpu",
           "gpu", "GPU", "CUDA", "Auto", "auto:0", "cuda0", "cuda:", "cuda:01", "cuda:-1", "cuda:0:1", "cuda: 0",
           " cuda", "cuda ", "cuda:1e3", "", "cpu,cuda"]


@pytest.mark.parametrize("name", DEVICES)
def test_train_device_takes_on_loading_what_pick_device_takes(name):
    torch = pytest.importorskip("torch")
    try:
        torch.device(name)
        runtime = True
    except RuntimeError:
        runtime = name == "auto"
    try:
        params_from_dict({"train": {"device": name}})
        loads = True
    except AssayError as exc:
        assert str(exc).startswith(f"params: train.device = {name!r} ") and "\n" not in str(exc)
        loads = False
    assert loads == runtime


def test_the_device_types_are_the_installed_torchs():
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError) as caught:
        torch.device("gpu")  # a type torch does not know: its message lists those it does
    listed = re.search(r"Expected one of (.+?) device type", str(caught.value))
    assert listed, caught.value
    assert set(TORCH_DEVICE_TYPES) == set(listed.group(1).split(", "))


def test_the_choices_are_the_ones_the_stages_take(tmp_path, monkeypatch):
    from assay.config import VectorParams
    from assay.vectors.base import open_store
    from training.model import ModelArgs

    for attention in TRAIN_ATTENTIONS:
        ModelArgs(attention=attention)
    with pytest.raises(ValueError):
        ModelArgs(attention="not-" + TRAIN_ATTENTIONS[0])
    monkeypatch.delenv("WEAVIATE_URL", raising=False)
    for backend in VECTOR_BACKENDS:  # each gets past open_store's choice (weaviate then lacks its address)
        try:
            open_store(VectorParams(backend=backend), tmp_path).close()
        except AssayError as exc:
            assert "must be one of local, weaviate" not in str(exc), exc
    with pytest.raises(AssayError, match="must be one of local, weaviate"):
        open_store(VectorParams(backend="not-" + VECTOR_BACKENDS[0]), tmp_path)


def test_only_known_encodings_load():
    params = params_from_dict({"ingest": {"fallback_encodings": ["cp1252", "latin_1", "iso8859_15", "cp1250"]}})
    assert params.ingest.fallback_encodings[-1] == "cp1250"
    assert params_from_dict({"ingest": {"fallback_encodings": []}}).ingest.fallback_encodings == []


@pytest.mark.parametrize("local_path", ["../../raw", "../vx", "vectors/../../x", "/tmp/shared-vectors", "", ".",
                                        "part-00000.parquet", "manifest.json", "decisions", "quarantine/v",
                                        "embeddings"])
def test_the_local_vector_store_must_live_inside_its_dataset(local_path, tmp_path):
    """Written into the staging copy but read from the published dataset, a path outside it landed in
    another dataset (the input), vanished with the staging folder, or was shared by two datasets; a
    name the dataset uses ended in IsADirectoryError or mixed the store into a stream."""
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"vectors": {"local_path": local_path}}), encoding="utf-8")
    with pytest.raises(AssayError, match=r"vectors\.local_path") as caught:
        load_params(params_file)
    assert "\n" not in str(caught.value) and "vectors" in str(caught.value).split("such as")[-1]


def test_a_local_vector_store_under_a_folder_of_the_dataset_opens_there(tmp_path, monkeypatch):
    from assay.config import VectorParams
    from assay.vectors.base import open_store

    monkeypatch.delenv("WEAVIATE_URL", raising=False)
    for local_path in ("vx", "./graph/vectors", "part-notes"):
        params = params_from_dict({"vectors": {"local_path": local_path}}).vectors
        with open_store(params, tmp_path / "data") as store:
            assert store.path == tmp_path / "data" / Path(local_path)
    with open_store(VectorParams(), tmp_path / "data") as store:
        assert store.path == tmp_path / "data" / "vectors"
