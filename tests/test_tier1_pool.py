"""Tier 1 on the demo corpus's labelled pool: real files of this machine, labels by provenance.

The pool and its labels are `assay.ingest.demo` and `assay.quality.pool`
(labels written down before any score was seen). These tests read a small
seeded sample of the pool straight from disk (the same files `assay ingest
demo` reads), so they run in seconds; the full measurement is
`bench/tier1_pool.py` (BENCHMARKS.md).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from assay.config import DemoParams, HeuristicsParams, Params
from assay.ingest.decode import decode
from assay.ingest.demo import POOL_SOURCES, pool_entries
from assay.ingest.readers import read_entry
from assay.quality.pool import (
    DEV,
    GOOD,
    JUNK,
    MEASURED,
    MIN_GOOD_CHARS,
    POOL_LABELS,
    UNLABELLED,
    in_negatives_part,
    keep_rates,
    pool_labels,
    pool_parts,
)
from filters.gopher import GopherQualityFilter
from filters.heuristics import apply_chain, build_heuristics

SAMPLE = DemoParams(seed=1, package_metadata=60, package_records=30, entry_points=20, doc_readmes=60, doc_news=40,
                    doc_changelogs=10, debian_changelogs=30, doc_copyright=10, dpkg_manifests=30, logs=10)


@pytest.fixture(scope="module")
def pool():
    docs = {"text": [], "source": [], "path": []}
    for entry in pool_entries(SAMPLE, random.Random(SAMPLE.seed)):
        data = read_entry(entry, 10_000_000)
        if isinstance(data, int):
            continue
        text = decode(data, fallback_encodings=["cp1252"], min_confidence=0.9).text
        if text and text.strip():
            docs["text"].append(text)
            docs["source"].append(entry.source)
            docs["path"].append(entry.locator)
    docs["label"] = pool_labels(docs["source"], [len(t) for t in docs["text"]])
    good, junk = (docs["label"] == GOOD).sum(), (docs["label"] == JUNK).sum()
    if good < 40 or junk < 40:
        pytest.skip(f"this machine lacks the pool's files ({good} good, {junk} junk documents)")
    return docs


def batch(docs) -> pa.RecordBatch:
    return pa.record_batch({"text": pa.array(docs["text"], pa.large_string()),
                            "kind": pa.array(["text"] * len(docs["text"]))})


def test_labels_are_by_provenance_only():
    assert set(POOL_LABELS) == set(POOL_SOURCES)
    labels = pool_labels(["doc-readme", "doc-readme", "pypi-record", "doc-copyright", "man"],
                         [MIN_GOOD_CHARS, MIN_GOOD_CHARS - 1, 10, 5000, 5000])
    assert labels.tolist() == [GOOD, UNLABELLED, JUNK, UNLABELLED, UNLABELLED]  # the reference is not in the pool


def test_negatives_part_is_a_stable_share_of_ids():
    ids = [f"doc{i}" for i in range(4000)]
    part = in_negatives_part(ids, 0.3, seed=0)
    assert abs(part.mean() - 0.3) < 0.03
    assert (in_negatives_part(ids, 0.3, seed=0) == part).all()
    assert not (in_negatives_part(ids, 0.3, seed=1) == part).all()
    assert in_negatives_part(ids, 0.0, 0).sum() == 0 and in_negatives_part(ids, 1.0, 0).all()
    with pytest.raises(ValueError):
        in_negatives_part(ids, 1.5, 0)


def test_pool_parts_follow_the_shares():
    ids = [f"doc{i}" for i in range(4000)]
    parts = pool_parts(ids, 0.3, 0.2, seed=0)
    assert abs((parts == "negatives").mean() - 0.3) < 0.03 and abs((parts == DEV).mean() - 0.2) < 0.03
    assert ((parts == "negatives") == in_negatives_part(ids, 0.3, 0)).all()  # the same cut as training's
    with pytest.raises(ValueError):
        pool_parts(ids, 0.8, 0.3, 0)


def test_keep_rates_by_hand():
    labels = np.array([GOOD, GOOD, JUNK, JUNK, JUNK, UNLABELLED])
    kept = np.array([True, False, True, False, False, True])
    r = keep_rates(labels, kept)
    assert r["good_kept"] == 0.5 and r["junk_dropped"] == pytest.approx(2 / 3) and r["precision"] == 0.5


def test_gopher_quality_with_the_papers_words_keeps_real_prose_and_drops_junk(pool):
    """The issue's measurement: datatrove's word definition dropped most good prose by alpha_words_frac."""
    labels = pool["label"]
    paper = keep_rates(labels, GopherQualityFilter(words="paper").apply(batch(pool)).keep)
    datatrove_result = GopherQualityFilter(words="datatrove").apply(batch(pool))
    datatrove = keep_rates(labels, datatrove_result.keep)
    assert paper["good_kept"] >= 0.8 and paper["junk_dropped"] >= 0.9, paper
    assert datatrove["good_kept"] < 0.5, datatrove
    lost = [r for r, lab in zip(datatrove_result.reason, labels) if lab == GOOD and r]
    assert lost.count("gopher_quality:alpha_words_frac") > len(lost) / 2


def test_heuristic_chain_with_the_papers_words_keeps_more_prose(pool):
    """The full FineWeb-order chain: paper words keep far more good prose, junk is still dropped."""
    labels = pool["label"]
    paper = keep_rates(labels, apply_chain(build_heuristics(HeuristicsParams(words="paper")), batch(pool)).keep)
    datatrove = keep_rates(labels, apply_chain(build_heuristics(HeuristicsParams(words="datatrove")), batch(pool)).keep)
    assert paper["junk_dropped"] >= 0.9, paper
    assert paper["good_kept"] >= datatrove["good_kept"] + 0.2, (paper, datatrove)


def test_training_negatives_never_come_from_the_measured_part(tmp_path):
    """The head's negatives come only from the negatives share; read_pool measures exactly the rest."""
    from assay.quality.pool import read_pool
    from assay.quality.train import reference_examples

    sources = ["man"] * 100 + ["doc-readme"] * 100 + ["pypi-record"] * 100
    ids = _write_raw(tmp_path / "raw", sources, "Document {i} says something.")
    params = Params()
    params.quality.reference_sources = ["man"]
    params.quality.negatives_per_positive = 10.0  # take every negative allowed
    examples = reference_examples(tmp_path / "raw", params)
    negatives = {i for i, label in zip(examples.ids, examples.labels) if not label}
    part = set(np.array(ids)[in_negatives_part(ids, params.quality.negatives_share, params.quality.seed)])
    pool_ids = set(ids[100:])
    assert negatives == part & pool_ids and 30 < len(negatives) < 90
    parts = dict(zip(ids, pool_parts(ids, params.quality.negatives_share, params.quality.dev_share,
                                     params.quality.seed)))
    measured = set(read_pool(tmp_path / "raw", params)["id"])
    dev = set(read_pool(tmp_path / "raw", params, part=DEV)["id"])
    # Neither the negatives' part nor the dev part is measured; the reference is in no part.
    assert measured == {i for i in pool_ids if parts[i] == MEASURED} and not measured & (part | dev)
    assert dev == {i for i in pool_ids if parts[i] == DEV} and len(dev) > 5 and len(measured) > 60


def test_tier1_on_a_labelled_sample_meets_its_targets(pool, tmp_path):
    """GPT-3's recipe as `assay quality train` runs it: the reference set trains the head against
    negatives from one part of the pool, the head is Platt-calibrated on the dev part, and the measured
    part is judged with params.yaml's settings. Targets: >= 80% of good prose kept, >= 90% of junk
    dropped, the head's ROC AUC >= 0.95 on every labelled document (not only the heuristics' survivors).
    Measured here: 90.6% kept, 98.8% dropped, AUC 0.998 (with the markup step, the records rule and the
    markup-stripped words head); before them 77.6% kept (the published chain with the raw head: about 35%)."""
    from pydoc_data.topics import topics

    from assay.ingest.demo import man_pages
    from assay.ingest.plan import FileEntry
    from assay.quality.pool import measure_tier1
    from assay.quality.scorer import HeadScorer
    from assay.quality.train import Examples, train_head

    params = Params()
    q = params.quality
    reference = [topics[name] for name in sorted(topics)]
    for path in man_pages()[::40][:40]:
        try:
            reference.append(read_entry(FileEntry(str(path), "man", path.name, render="man"), 10_000_000).decode())
        except OSError:
            continue
    ids = [f"{s}:{p}" for s, p in zip(pool["source"], pool["path"])]
    parts = pool_parts(ids, q.negatives_share, q.dev_share, q.seed)
    negatives = [t for t, part in zip(pool["text"], parts) if part == "negatives"]
    dev = (parts == DEV) & (pool["label"] != UNLABELLED)
    examples = Examples(reference + negatives, np.array([True] * len(reference) + [False] * len(negatives)),
                        [f"row:{i}" for i in range(len(reference) + len(negatives))],
                        calibration=Examples([t for t, d in zip(pool["text"], dev) if d], pool["label"][dev] == GOOD,
                                             [i for i, d in zip(ids, dev) if d]))
    report = train_head(examples, params, tmp_path / "head", recipe="reference")
    assert report["calibration"]["method"] == "platt", report["calibration"]
    params.static.head = str(tmp_path / "head")
    measured = {name: [v for v, part in zip(pool[name], parts) if part == MEASURED] for name in ("text", "source", "path")}
    measured["id"], measured["kind"] = [f"m{i}" for i in range(len(measured["text"]))], ["text"] * len(measured["text"])
    result = measure_tier1(measured, params, None, HeadScorer(tmp_path / "head"))
    assert result["heuristics"]["good"] >= 40 and result["heuristics"]["junk"] >= 60, result["heuristics"]
    assert result["head"]["auc"] >= 0.95, result["head"]
    assert result["tier1"]["good_kept"] >= 0.8 and result["tier1"]["junk_dropped"] >= 0.9, result["tier1"]
    assert result["heuristics"]["good_kept"] >= 0.8, result["heuristics"]


def source_batch(docs) -> pa.RecordBatch:
    return pa.record_batch({"text": pa.array(docs["text"], pa.large_string()),
                            "kind": pa.array(["text"] * len(docs["text"])), "source": pa.array(docs["source"])})


def test_the_default_rules_keep_real_prose_and_drop_junk(pool):
    """params.yaml's choice (made on the dev part): plain-text files are judged by the Gopher rules,
    since C4's and FineWeb's line rules were designed for web extractions. The sample is drawn from this
    installation's files, so the figures move with it: where the default was chosen, the published chain
    kept 38% of the good prose (reflowing wrapped paragraphs: 42%) and the default 86%; on 2026-12-03, after
    installing Debian's chromium (which `.ci/run` does), 63%, 67% and 93% (134 good, 176 junk documents)."""
    from assay.config import ReflowParams
    from filters.heuristics import apply_by_source

    labels, static = pool["label"], Params().static
    new = keep_rates(labels, apply_by_source(build_heuristics(static.heuristics), source_batch(pool),
                                             static.source_rules).keep)
    assert new["good_kept"] >= 0.8 and new["junk_dropped"] >= 0.9, new
    published = HeuristicsParams(reflow=ReflowParams(enabled=False))
    old = keep_rates(labels, apply_chain(build_heuristics(published), batch(pool)).keep)
    reflowed = keep_rates(labels, apply_chain(build_heuristics(static.heuristics), batch(pool)).keep)
    # The gap was 0.44 and then 0.25 (above); 0.15 still fails a default that is the published chain.
    assert old["good_kept"] < reflowed["good_kept"] < new["good_kept"] - 0.15, (old, reflowed, new)
    assert reflowed["junk_dropped"] >= 0.9


def test_calibration_examples_come_only_from_the_labelled_dev_part(tmp_path):
    from assay.quality.train import reference_examples
    from assay.schema import DOCUMENT_SCHEMA
    from assay.shards import ShardWriter, write_manifest

    n = 400
    sources = ["man"] * 100 + ["doc-readme"] * 100 + ["pypi-record"] * 100 + ["doc-copyright"] * 100
    ids = [f"doc-{i}" for i in range(n)]
    texts = [f"Document {i} says something. " * 40 for i in range(n)]  # long enough to be labelled good
    table = pa.table({"id": ids, "text": texts, "kind": ["text"] * n, "lang": ["en"] * n, "source": sources,
                      "path": [f"d{i}" for i in range(n)], "meta": ["{}"] * n})
    with ShardWriter(tmp_path / "raw", DOCUMENT_SCHEMA) as writer:
        writer.write(table)
    write_manifest(tmp_path / "raw", {"documents": n})
    params = Params()
    params.quality.reference_sources = ["man"]
    q = params.quality
    examples = reference_examples(tmp_path / "raw", params)
    parts = dict(zip(ids, pool_parts(ids, q.negatives_share, q.dev_share, q.seed)))
    source = dict(zip(ids, sources))
    expected = {i for i in ids[100:300] if parts[i] == DEV}  # labelled pool documents of the dev part
    cal = examples.calibration
    assert set(cal.ids) == expected and len(expected) > 20
    assert all(label == (source[i] == "doc-readme") for i, label in zip(cal.ids, cal.labels))
    assert not set(cal.ids) & set(examples.ids)  # never a training example
    q.dev_share = 0.0
    assert reference_examples(tmp_path / "raw", params).calibration is None


# --- the fresh set ----------------------------------------------------------------------


def test_fresh_labels_are_by_provenance_only():
    from assay.quality.fresh import FILE_KINDS, FRESH_LABELS, fresh_labels
    from filters.heuristics import rules_for

    assert set(FRESH_LABELS) == set(FILE_KINDS) | {"fresh-dpkg-status"}
    assert not set(FRESH_LABELS) & set(POOL_SOURCES) and not set(FRESH_LABELS) & set(POOL_LABELS)
    # The labeller sees a document's kind and length, nothing else: the same kinds, whatever the text.
    kinds = sorted(FRESH_LABELS)
    labels = fresh_labels(kinds + kinds + ["man"], [MIN_GOOD_CHARS] * len(kinds) + [10] * len(kinds) + [5000])
    assert labels[:len(kinds)].tolist() == [FRESH_LABELS[k] for k in kinds]
    assert labels[len(kinds):-1].tolist() == [JUNK if FRESH_LABELS[k] == JUNK else UNLABELLED for k in kinds]
    assert labels[-1] == UNLABELLED
    # Its kinds are plain-text files, judged by the rules params.yaml gives such files.
    static = Params().static
    assert all(rules_for(k, static.source_rules) == ["gopher_repetition", "gopher_quality", "records"] for k in kinds)


def test_the_fresh_set_reads_no_file_of_the_pool():
    from assay.ingest.demo import dist_info_files, doc_files, dpkg_manifests, log_files, metadata_files
    from assay.quality.fresh import fresh_labels, read_fresh

    fresh = read_fresh(per_kind=6)
    if len(set(fresh["source"])) < 5:
        pytest.skip(f"this machine lacks most of the fresh set's files ({sorted(set(fresh['source']))})")
    assert fresh == read_fresh(per_kind=6)  # deterministic
    assert len(set(fresh["id"])) == len(fresh["id"]) and set(fresh["kind"]) == {"text"}
    pool_files = {str(p) for p in metadata_files() + dist_info_files("RECORD") + dist_info_files("entry_points.txt")
                  + doc_files(lambda name: True) + dpkg_manifests() + log_files()}
    assert not pool_files & set(fresh["path"])
    labels = fresh_labels(fresh["source"], [len(t) for t in fresh["text"]])
    assert (labels == GOOD).any() and (labels == JUNK).any()


# --- fresh set 2 --------------------------------------------------------------------------


def _skip_where_files_are_missing(n: int, docs: dict, labels, missing: dict, manifest_rows: int,
                                  good: int, junk: int) -> None:
    """A fresh set is read from files of this machine: where some are absent (``missing``, by kind)
    and the set falls below 90% of its manifest or below its per-label size, it is not the set that
    was measured, so its test skips and says what is absent. With nothing absent the size checks
    stay the test's to fail."""
    short = (labels == GOOD).sum() < good or (labels == JUNK).sum() < junk
    if missing and (len(docs["id"]) < 0.9 * manifest_rows or short):
        pytest.skip(f"this machine lacks fresh set {n}'s files ({missing})")


def test_fresh2_labels_are_by_provenance_only_and_the_manifest_says_so():
    """The committed manifest (written before any score) labels each document by its kind and, for
    good kinds, the length floor: nothing else about the text."""
    from assay.quality.fresh import FRESH_LABELS
    from assay.quality.fresh2 import FRESH2_LABELS, KINDS, MANIFEST, RULES, label_of, read_manifest
    from filters.heuristics import rules_for

    assert set(FRESH2_LABELS) == set(KINDS) == set(RULES)
    assert not set(FRESH2_LABELS) & (set(POOL_LABELS) | set(FRESH_LABELS) | set(POOL_SOURCES))
    for kind, label in FRESH2_LABELS.items():
        assert label_of(kind, "x" * MIN_GOOD_CHARS) == label
        assert label_of(kind, "x") == (JUNK if label == JUNK else UNLABELLED)
    rows = read_manifest(MANIFEST)
    assert len(rows) >= 300 and len({r["locator"] for r in rows}) == len(rows)
    names = {GOOD: "good", JUNK: "junk", UNLABELLED: "unlabelled"}
    for row in rows:
        assert row["label"] == names[label_of(row["kind"], "x" * int(row["chars"]))], row
        assert row["rule"] == (RULES[row["kind"]] if row["label"] != "unlabelled" else
                               "unlabelled: good kind under 1000 chars")
    labels = [r["label"] for r in rows]
    assert labels.count("good") >= 100 and labels.count("junk") >= 100
    static = Params().static
    assert all(rules_for(k, static.source_rules) == ["gopher_repetition", "gopher_quality", "records"]
               for k in FRESH2_LABELS)


def test_fresh2_reads_no_file_of_the_earlier_sets():
    from assay.ingest.demo import dist_info_files, doc_files, dpkg_manifests, log_files, metadata_files
    from assay.quality.fresh import FILE_KINDS, python_roots
    from assay.quality.fresh2 import _project, new_dist_infos, read_fresh2, read_manifest

    rows = read_manifest()
    docs, labels, missing = read_fresh2()
    _skip_where_files_are_missing(2, docs, labels, missing, len(rows), good=100, junk=100)
    earlier = {str(p) for p in metadata_files() + dist_info_files("RECORD") + dist_info_files("entry_points.txt")
               + doc_files(lambda name: True) + dpkg_manifests() + log_files()}
    for lister in FILE_KINDS.values():
        earlier |= {str(p) for p in lister()}
    paths = {locator.split("#", 1)[0] for locator in docs["path"]}
    assert not paths & earlier
    # Wheels: only projects that no root of the pool or the first fresh set has.
    seen = {_project(p) for root in python_roots() for p in root.glob("*.dist-info")}
    assert not {_project(p) for p in new_dist_infos()} & seen
    assert len(set(docs["text"])) == len(docs["text"])  # each text once
    assert (labels == GOOD).sum() >= 100 and (labels == JUNK).sum() >= 100


# --- fresh set 3 --------------------------------------------------------------------------


def _check_fresh_manifest(rows: list[dict], labels_by_kind: dict, *, good: int, junk: int, good_kinds: int,
                          junk_kinds: int, rules: dict | None = None) -> None:
    """What every fresh set's manifest must hold: 300+ documents, each locator and text once, enough good and
    junk documents and kinds, and every kind judged by the plain-text files' rules; with `rules` (kind -> the
    reading rule), each row labelled by its kind alone and read by its kind's rule, good texts over the floor."""
    from filters.heuristics import rules_for

    if rules is not None:
        names = {GOOD: "good", JUNK: "junk"}
        for row in rows:
            assert row["label"] == names[labels_by_kind[row["kind"]]] and row["rule"] == rules[row["kind"]]
            if row["label"] == "good":
                assert int(row["chars"]) >= MIN_GOOD_CHARS

    assert len(rows) >= 300 and len({r["locator"] for r in rows}) == len(rows)
    assert len({r["blake2b"] for r in rows}) == len(rows)  # each text once
    labels = [r["label"] for r in rows]
    assert labels.count("good") >= good and labels.count("junk") >= junk
    assert len({r["kind"] for r in rows if r["label"] == "good"}) >= good_kinds
    assert len({r["kind"] for r in rows if r["label"] == "junk"}) >= junk_kinds
    static = Params().static
    assert all(rules_for(k, static.source_rules) == ["gopher_repetition", "gopher_quality", "records"]
               for k in labels_by_kind)


def test_fresh3_labels_are_by_provenance_only_and_the_manifest_says_so():
    """The committed manifest (written before any score) labels each document by its kind alone (good
    kinds take only texts over the length floor); nothing else about the text."""
    from assay.quality.fresh import FRESH_LABELS
    from assay.quality.fresh2 import FRESH2_LABELS
    from assay.quality.fresh3 import FRESH3_LABELS, KINDS, MANIFEST, RULES, label_of, read_manifest

    assert set(FRESH3_LABELS) == set(KINDS) == set(RULES)
    assert not set(FRESH3_LABELS) & (set(POOL_LABELS) | set(FRESH_LABELS) | set(FRESH2_LABELS) | set(POOL_SOURCES))
    rows = read_manifest(MANIFEST)
    names = {GOOD: "good", JUNK: "junk", UNLABELLED: "unlabelled"}
    for row in rows:
        assert row["label"] == names[FRESH3_LABELS[row["kind"]]] == names[label_of(row["kind"], "x" * int(row["chars"]))]
        assert row["rule"] == RULES[row["kind"]]
    _check_fresh_manifest(rows, FRESH3_LABELS, good=100, junk=200, good_kinds=4, junk_kinds=6)


def test_fresh3_is_disjoint_from_the_earlier_sets():
    """No locator or text of fresh set 2's manifest, no file of the pool's or fresh set 1's candidate
    lists or of the demo's code side, nothing under the venv (an optional extra cannot change the set)."""
    import sys

    from assay.ingest.demo import (
        dist_info_files,
        doc_files,
        dpkg_manifests,
        log_files,
        metadata_files,
        package_roots,
        stdlib_files,
    )
    from assay.quality import fresh2
    from assay.quality.fresh import FILE_KINDS
    from assay.quality.fresh3 import read_fresh3, read_manifest

    rows = read_manifest()
    earlier2 = fresh2.read_manifest()
    assert not {r["locator"] for r in rows} & {r["locator"] for r in earlier2}
    assert not {r["blake2b"] for r in rows} & {r["blake2b"] for r in earlier2}
    roots = {sys.prefix} | {str(p) for p in package_roots()}
    assert not [r["locator"] for r in rows if any(r["locator"].startswith(root + "/") for root in roots)]
    docs, labels, missing = read_fresh3()
    _skip_where_files_are_missing(3, docs, labels, missing, len(rows), good=100, junk=200)
    earlier = {str(p) for p in metadata_files() + dist_info_files("RECORD") + dist_info_files("entry_points.txt")
               + doc_files(lambda name: True) + dpkg_manifests() + log_files()}
    earlier |= {str(p) for p in stdlib_files()}
    for lister in FILE_KINDS.values():
        earlier |= {str(p) for p in lister()}
    paths = {locator.split("#", 1)[0] for locator in docs["path"]}
    assert not paths & earlier
    assert len(set(docs["text"])) == len(docs["text"])
    assert (labels == GOOD).sum() >= 100 and (labels == JUNK).sum() >= 200


# --- fresh set 4 --------------------------------------------------------------------------


def test_fresh4_labels_are_by_provenance_only_and_the_manifest_says_so():
    """The committed manifest (written before tier1e's change and before any score) labels each document
    by its kind alone (good kinds take only texts over the length floor)."""
    from assay.quality.fresh import FRESH_LABELS
    from assay.quality.fresh2 import FRESH2_LABELS
    from assay.quality.fresh3 import FRESH3_LABELS
    from assay.quality.fresh4 import FRESH4_LABELS, KINDS, MANIFEST, RULES, read_manifest

    assert set(FRESH4_LABELS) == set(KINDS) == set(RULES)
    earlier = set(POOL_LABELS) | set(FRESH_LABELS) | set(FRESH2_LABELS) | set(FRESH3_LABELS) | set(POOL_SOURCES)
    assert not set(FRESH4_LABELS) & earlier
    rows = read_manifest(MANIFEST)
    _check_fresh_manifest(rows, FRESH4_LABELS, good=150, junk=250, good_kinds=5, junk_kinds=8, rules=RULES)


def test_fresh4_is_disjoint_from_the_earlier_sets():
    """No locator or text of fresh set 2's or 3's manifests, no file of the pool's or fresh set 1's
    candidate lists or of the demo's code side or reference set (man pages), nothing under the venv."""
    import sys

    from assay.ingest.demo import (
        dist_info_files,
        doc_files,
        dpkg_manifests,
        log_files,
        man_pages,
        metadata_files,
        package_roots,
        stdlib_files,
    )
    from assay.quality import fresh2, fresh3
    from assay.quality.fresh import FILE_KINDS
    from assay.quality.fresh4 import read_fresh4, read_manifest

    rows = read_manifest()
    for earlier_rows in (fresh2.read_manifest(), fresh3.read_manifest()):
        assert not {r["locator"] for r in rows} & {r["locator"] for r in earlier_rows}
        assert not {r["blake2b"] for r in rows} & {r["blake2b"] for r in earlier_rows}
    roots = {sys.prefix} | {str(p) for p in package_roots()}
    assert not [r["locator"] for r in rows if any(r["locator"].startswith(root + "/") for root in roots)]
    docs, labels, missing = read_fresh4()
    _skip_where_files_are_missing(4, docs, labels, missing, len(rows), good=150, junk=250)
    earlier = {str(p) for p in metadata_files() + dist_info_files("RECORD") + dist_info_files("entry_points.txt")
               + doc_files(lambda name: True) + dpkg_manifests() + log_files() + man_pages()}
    earlier |= {str(p) for p in stdlib_files()}
    for lister in FILE_KINDS.values():
        earlier |= {str(p) for p in lister()}
    paths = {locator.split("#", 1)[0] for locator in docs["path"]}
    assert not paths & earlier
    assert len(set(docs["text"])) == len(docs["text"])
    assert (labels == GOOD).sum() >= 150 and (labels == JUNK).sum() >= 250


def test_fresh4_reads_the_main_text_of_an_html_chapter():
    """The Rust books' reader keeps `<main>`'s prose and drops code listings, scripts and the navigation."""
    from assay.quality.fresh4 import main_text

    html = ("<html><head><style>p {}</style></head><body><nav>Chapter 1 Chapter 2</nav><main>"
            "<h1>Ownership</h1><p>Each value has an <em>owner</em>.</p><pre><code>let s = 1;</code></pre>"
            "<script>var x;</script><p>When the owner goes out of scope, the value is dropped &amp; freed.</p>"
            "</main><footer>Next</footer></body></html>")
    assert main_text(html) == ("Ownership\n\nEach value has an owner.\n\n"
                               "When the owner goes out of scope, the value is dropped & freed.\n")
    assert main_text("<html><body><p>no main</p></body></html>") is None


# --- tier1f: the pool's extra junk kinds, fresh set 5 ----------------------------------------


def test_extra_pool_kinds_are_junk_and_leave_the_rest_of_the_demo_sample_unchanged():
    """tier1f's extra kinds are labelled junk by provenance, judged like every plain-text source, and drawn
    with a generator of their own: the other kinds' files and the draws after them (the reference set's)
    are the same with or without them."""
    import dataclasses

    from assay.ingest.demo import EXTRA_POOL_KINDS, extra_files
    from filters.heuristics import rules_for

    assert EXTRA_POOL_KINDS and all(POOL_LABELS[source] == JUNK for source in EXTRA_POOL_KINDS)
    assert all(source in POOL_SOURCES for source in EXTRA_POOL_KINDS)
    static = Params().static
    assert all(rules_for(s, static.source_rules) == ["gopher_repetition", "gopher_quality", "records"]
               for s in EXTRA_POOL_KINDS)
    assert Params().demo.system_files == 0  # measured, not chosen (tier1f): the demo's pool is as before
    sample = dataclasses.replace(SAMPLE, system_files=40)
    with_extra, without = random.Random(SAMPLE.seed), random.Random(SAMPLE.seed)
    entries = pool_entries(sample, with_extra)
    plain = pool_entries(SAMPLE, without)
    assert [e for e in entries if e.source not in EXTRA_POOL_KINDS] == plain
    assert with_extra.random() == without.random()
    counts = {s: sum(e.source == s for e in entries) for s in EXTRA_POOL_KINDS}
    if sum(counts.values()) == 0:
        pytest.skip("this machine has none of the extra kinds' files")
    assert all(n == min(sample.system_files, len(extra_files(s))) for s, n in counts.items())


def test_reference_examples_can_leave_sources_out(tmp_path):
    """The bench rebuilds the head before tier1f from the same corpus as if it lacked the extra kinds:
    their documents are neither negatives nor calibration examples, and the rest is drawn as before."""
    from assay.quality.train import reference_examples
    from assay.schema import DOCUMENT_SCHEMA
    from assay.shards import ShardWriter, write_manifest

    def raw(path, sources):
        n = len(sources)
        table = pa.table({
            "id": [f"doc-{i}" for i in range(n)], "text": [f"Document {i} says something." * 40 for i in range(n)],
            "kind": ["text"] * n, "lang": ["en"] * n, "source": sources, "path": [f"d{i}" for i in range(n)],
            "meta": ["{}"] * n,
        })
        with ShardWriter(path, DOCUMENT_SCHEMA) as writer:
            writer.write(table)
        write_manifest(path, {"documents": n})
        return path

    sources = ["man"] * 100 + ["doc-readme"] * 100 + ["pypi-record"] * 100 + ["sys-ca-cert"] * 100
    params = Params()
    params.quality.reference_sources = ["man"]
    both = reference_examples(raw(tmp_path / "both", sources), params)
    assert "sys-ca-cert" in {sources[int(i.split("-")[1])] for i in both.ids}
    left_out = reference_examples(tmp_path / "both", params, exclude_sources=["sys-ca-cert"])
    alone = reference_examples(raw(tmp_path / "alone", sources[:300]), params)
    assert left_out.ids == alone.ids and (left_out.labels == alone.labels).all()
    assert left_out.calibration.ids == alone.calibration.ids
    assert not {sources[int(i.split("-")[1])] for i in left_out.ids + left_out.calibration.ids} & {"sys-ca-cert"}


def test_fresh5_labels_are_by_provenance_only_and_the_manifest_says_so():
    """The committed manifest (written before tier1f's change and before any score) labels each document
    by its kind alone (good kinds take only texts over the length floor)."""
    from assay.quality.fresh import FRESH_LABELS
    from assay.quality.fresh2 import FRESH2_LABELS
    from assay.quality.fresh3 import FRESH3_LABELS
    from assay.quality.fresh4 import FRESH4_LABELS
    from assay.quality.fresh5 import FRESH5_LABELS, KINDS, MANIFEST, RULES, read_manifest

    assert set(FRESH5_LABELS) == set(KINDS) == set(RULES)
    earlier = (set(POOL_LABELS) | set(FRESH_LABELS) | set(FRESH2_LABELS) | set(FRESH3_LABELS) | set(FRESH4_LABELS)
               | set(POOL_SOURCES))
    assert not set(FRESH5_LABELS) & earlier
    rows = read_manifest(MANIFEST)
    assert max(sum(r["kind"] == k for r in rows) for k in FRESH5_LABELS) <= 40
    _check_fresh_manifest(rows, FRESH5_LABELS, good=150, junk=250, good_kinds=5, junk_kinds=8, rules=RULES)


def test_fresh5_is_disjoint_from_the_earlier_sets_and_from_the_extra_pool_kinds():
    """No locator or text of fresh sets 2's, 3's or 4's manifests, no file of the pool's (its extra kinds
    included) or fresh set 1's candidate lists, of the demo's code side or of the man pages, nothing under the
    venv; and the extra pool kinds (the head's new negatives) read no folder of fresh set 5 and no file of
    fresh sets 1 to 4."""
    import sys

    from assay.ingest.demo import (
        EXTRA_POOL_KINDS,
        dist_info_files,
        doc_files,
        dpkg_manifests,
        extra_files,
        log_files,
        man_pages,
        metadata_files,
        package_roots,
        stdlib_files,
    )
    from assay.quality import fresh2, fresh3, fresh4
    from assay.quality.fresh import FILE_KINDS
    from assay.quality.fresh5 import ROOTS, read_fresh5, read_manifest

    extra = {str(p) for source in EXTRA_POOL_KINDS for p in extra_files(source)}
    # By construction: no folder an extra kind lists is inside one of fresh set 5's folders or holds one.
    def folder(root: str, pattern: str) -> str:  # the fixed folders of a glob pattern under root
        fixed = pattern.split("*", 1)[0]
        return root + "/" + fixed.rsplit("/", 1)[0] if "/" in fixed else root

    folders = {folder(root, pattern) for root, patterns in EXTRA_POOL_KINDS.values() for pattern in patterns}
    assert not [(a, b) for a in folders for b in ROOTS
                if (a + "/").startswith(b + "/") or (b + "/").startswith(a + "/")]
    assert not [p for p in extra if any(p.startswith(root + "/") for root in ROOTS)]
    rows = read_manifest()
    earlier_rows = fresh2.read_manifest() + fresh3.read_manifest() + fresh4.read_manifest()
    assert not {r["locator"] for r in rows} & {r["locator"] for r in earlier_rows}
    assert not {r["blake2b"] for r in rows} & {r["blake2b"] for r in earlier_rows}
    assert not extra & {r["locator"].split("#", 1)[0] for r in earlier_rows}
    roots = {sys.prefix} | {str(p) for p in package_roots()}
    assert not [r["locator"] for r in rows if any(r["locator"].startswith(root + "/") for root in roots)]
    earlier = {str(p) for p in metadata_files() + dist_info_files("RECORD") + dist_info_files("entry_points.txt")
               + doc_files(lambda name: True) + dpkg_manifests() + log_files() + man_pages()}
    earlier |= {str(p) for p in stdlib_files()}
    for lister in FILE_KINDS.values():
        earlier |= {str(p) for p in lister()}
    assert not extra & earlier
    docs, labels, missing = read_fresh5()
    _skip_where_files_are_missing(5, docs, labels, missing, len(rows), good=150, junk=250)
    paths = {locator.split("#", 1)[0] for locator in docs["path"]}
    assert not paths & (earlier | extra)
    assert len(set(docs["text"])) == len(docs["text"])
    assert (labels == GOOD).sum() >= 150 and (labels == JUNK).sum() >= 250


def test_fresh5_readers_take_the_documentation_only():
    """Perl modules give their POD blocks without the code; gsutil modules their help text."""
    from assay.quality.fresh5 import help_text, pod_text

    module = ("package Foo;\nuse strict;\n\n=head1 NAME\n\nFoo - does foo\n\n=cut\n\nsub foo { 1 }\n\n"
              "=head2 foo\n\nReturns one.\n\n=cut\n\n1;\n__END__\n\n=head1 AUTHOR\n\nSomeone\n")
    assert pod_text(module) == ("=head1 NAME\n\nFoo - does foo\n\n=head2 foo\n\nReturns one.\n\n"
                                "=head1 AUTHOR\n\nSomeone\n")
    assert pod_text("package Foo;\n1;\n") is None
    source = 'from x import y\n\n_DETAILED_HELP_TEXT = ("""\n<B>OVERVIEW</B>\n  Objects have metadata.\n""")\n'
    assert help_text(source) == "<B>OVERVIEW</B>\n  Objects have metadata.\n"
    assert help_text("x = 1\n") is None


def test_provenance_labels_make_the_pools_good_kinds_positives(tmp_path):
    """quality.provenance_labels: in the negatives part, good kinds are positives, unlabelled kinds are left
    out, junk kinds and sources the pool does not know are negatives; off, the whole part is negatives."""
    from assay.quality.train import reference_examples
    sources = (["man"] * 60 + ["doc-readme"] * 100 + ["pypi-record"] * 100 + ["doc-changelog"] * 100
               + ["web"] * 100)
    ids = _write_raw(tmp_path / "raw", sources, "Document {i} says something. " * 60)
    params = Params()
    params.quality.reference_sources = ["man"]
    params.quality.negatives_per_positive = 10.0  # every negative allowed
    part = dict(zip(ids, in_negatives_part(ids, params.quality.negatives_share, params.quality.seed)))
    source_of = dict(zip(ids, sources))

    def kinds(examples, label):
        return {source_of[i] for i, lab in zip(examples.ids, examples.labels) if lab == label}

    assert not params.quality.provenance_labels  # the default: GPT-3's recipe
    recipe = reference_examples(tmp_path / "raw", params)
    assert kinds(recipe, True) == {"man"} and kinds(recipe, False) == {"doc-readme", "pypi-record", "doc-changelog",
                                                                        "web"}
    params.quality.provenance_labels = True
    labelled = reference_examples(tmp_path / "raw", params)
    assert kinds(labelled, True) == {"man", "doc-readme"} and kinds(labelled, False) == {"pypi-record", "web"}
    pool_positives = {i for i, lab in zip(labelled.ids, labelled.labels) if lab and source_of[i] == "doc-readme"}
    assert pool_positives == {i for i in ids if source_of[i] == "doc-readme" and part[i]}
    assert labelled.calibration.ids == recipe.calibration.ids  # the dev part is read as before


def _write_raw(out: Path, sources: list[str], text: str) -> list[str]:
    """A raw dataset of one text document per source entry (`text` formatted with its index); returns the ids."""
    from assay.schema import DOCUMENT_SCHEMA
    from assay.shards import ShardWriter, write_manifest

    n = len(sources)
    ids = [f"doc-{i}" for i in range(n)]
    table = pa.table({
        "id": ids, "text": [text.format(i=i) for i in range(n)], "kind": ["text"] * n,
        "lang": ["en"] * n, "source": sources, "path": [f"d{i}" for i in range(n)], "meta": ["{}"] * n,
    })
    with ShardWriter(out, DOCUMENT_SCHEMA) as writer:
        writer.write(table)
    write_manifest(out, {"documents": n})
    return ids
