"""Tier 1 end to end: a real head trained here, the real encoder, the Prefect flow."""

import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from assay.errors import AssayError
from assay.lineage import why
from assay.shards import MANIFEST, iter_batches

pytestmark = pytest.mark.usefixtures("prefect_harness")

GARBAGE = "buy now buy now buy now click here\n" * 40


@pytest.fixture(scope="module")
def tier1(tmp_path_factory, prefect_harness):
    """Two sources (curated reference prose, and web-like text with junk) plus code; head; static output."""
    from pydoc_data.topics import topics

    from flows.ingest import ingest_flow
    from flows.quality import quality_train_flow
    from flows.static import static_flow

    root = tmp_path_factory.mktemp("tier1")
    reference, web = root / "reference", root / "web"
    reference.mkdir()
    web.mkdir()
    for name in sorted(topics)[:40]:
        (reference / f"{name}.txt").write_text(topics[name])
    site = Path(sysconfig.get_paths()["purelib"])
    for i, meta in enumerate(sorted(site.glob("*.dist-info/METADATA"))[:40]):
        (web / f"pkg{i}.txt").write_text(meta.read_text(errors="replace"))
    (web / "junk.txt").write_text(GARBAGE)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "textwrap.py", "colorsys.py"):
        (web / Path(name).name).write_text((stdlib / name).read_text())

    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["quality"]["reference_sources"] = ["reference"]
    params["quality"]["negatives_share"] = 1.0  # few documents: every non-reference one may be a negative
    params["static"]["source_rules"] = {"reference": ["gopher_repetition", "gopher_quality"]}
    # No labelled pool here, so the head is not calibrated: its raw probability is cut where the
    # raw words head was cut before calibration (params.yaml's threshold is a calibrated probability).
    params["static"]["threshold"] = 0.44
    params["static"]["head"] = str(root / "head")
    params["io"]["batch_rows"] = 32
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))

    raw = root / "raw"
    ingest_flow([str(reference), str(web)], str(raw), params_file=str(params_file))
    report = quality_train_flow(str(raw), str(root / "head"), params_file=str(params_file))
    manifest = static_flow(str(raw), str(root / "static"), params_file=str(params_file))
    return {"root": root, "raw": raw, "out": root / "static", "params": params_file, "manifest": manifest, "report": report}


def _rows(folder):
    return pq.read_table(folder).to_pylist()


def test_head_report(tier1):
    report = tier1["report"]
    assert report["head"]["auc"] > 0.9
    assert {"precision", "recall"} <= set(report["head"]["at_threshold"])
    assert sum(r["count"] for r in report["head"]["calibration"]) == report["training"]["held_out"]
    # No labelled dev part here: the head is calibrated on its own held-out split instead.
    assert report["calibration"]["fitted_on"].startswith("the head's held-out split")


def test_every_input_row_has_one_decision(tier1):
    raw_ids = {i for b in iter_batches(tier1["raw"], columns=["id"]) for i in b.column("id").to_pylist()}
    decisions = _rows(tier1["out"] / "decisions")
    assert sorted(d["id"] for d in decisions) == sorted(raw_ids)
    kept = {d["id"] for d in decisions if d["kept"]}
    docs = {r["id"]: r for b in iter_batches(tier1["out"]) for r in b.to_pylist()}
    assert set(docs) == kept
    counts = tier1["manifest"]["counts"]
    assert counts["input"] == len(raw_ids) and counts["kept"] == len(kept)
    assert counts["dropped"] == sum(counts["by_reason"].values()) == len(raw_ids) - len(kept)


def _threshold(tier1) -> float:
    return yaml.safe_load(tier1["params"].read_text())["static"]["threshold"]


def test_cascade_reasons_and_scores(tier1):
    threshold = _threshold(tier1)
    decisions = {d["id"]: d for d in _rows(tier1["out"] / "decisions")}
    raw = {r["path"]: r for b in iter_batches(tier1["raw"]) for r in b.to_pylist()}
    junk = decisions[raw["junk.txt"]["id"]]
    assert not junk["kept"] and junk["reason"].startswith("gopher_repetition:")
    scores = dict(junk["scores"])
    assert "quality" not in scores  # the model never saw it: a cascade
    dropped_by_model = [d for d in decisions.values() if d["reason"] == "quality:below_threshold"]
    for d in dropped_by_model:
        assert dict(d["scores"])["quality"] < threshold
    code = decisions[raw["textwrap.py"]["id"]]
    assert code["kept"] and "quality" not in dict(code["scores"] or [])


def test_quality_column_and_code_pass_through(tier1):
    threshold = _threshold(tier1)
    docs = [r for b in iter_batches(tier1["out"]) for r in b.to_pylist()]
    for doc in docs:
        if doc["kind"] == "text":
            assert doc["quality"] >= threshold
        else:
            assert doc["quality"] is None
    assert {d["path"] for d in docs if d["kind"] == "code"} == {"encoder.py", "textwrap.py", "colorsys.py"}
    # The reference is judged by the Gopher rules only (static.source_rules), and most of it scores high.
    assert sum(d["source"] == "reference" for d in docs) >= 30


def test_source_rules_judge_every_text_document(tier1):
    """No source is exempt: every text document has heuristic scores, the reference only its chosen filters'."""
    raw = {r["id"]: r for b in iter_batches(tier1["raw"]) for r in b.to_pylist()}
    for d in _rows(tier1["out"] / "decisions"):
        doc = raw[d["id"]]
        if doc["kind"] != "text":
            continue
        scores = dict(d["scores"])
        assert "gopher_quality:alpha_words_frac" in scores and "gopher_repetition:dup_line_frac" in scores
        assert ("c4:sentences" in scores) == (doc["source"] != "reference"), doc["path"]


def test_embeddings_are_computed_once_for_every_survivor(tier1):
    from assay.config import load_params
    from assay.encoder import shared_encoder

    decisions = _rows(tier1["out"] / "decisions")
    survivors = {d["id"] for d in decisions if d["kept"] or d["reason"] == "quality:below_threshold"}
    table = pq.read_table(tier1["out"] / "embeddings")
    assert sorted(table.column("id").to_pylist()) == sorted(survivors)
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    texts = {r["id"]: r["text"] for b in iter_batches(tier1["raw"]) for r in b.to_pylist()}
    ids = table.column("id").to_pylist()[:3]
    fresh = shared_encoder(load_params(tier1["params"]).static.encoder).encode([texts[i] for i in ids])
    assert np.allclose(fresh, vectors[:3], atol=2e-3)


def test_why_tells_the_story_across_stages(tier1):
    raw = {r["path"]: r for b in iter_batches(tier1["raw"]) for r in b.to_pylist()}
    story = why(raw["junk.txt"]["id"], [tier1["out"], tier1["raw"]])
    assert [(s["stage"], s["kept"]) for s in story] == [("ingest", True), ("static", False)]
    assert story[1]["scores"]["gopher_repetition:dup_line_frac"] > 0.3


def test_rerun_is_a_no_op_and_a_killed_run_resumes(tier1):
    from assay.config import load_params
    from assay.stages.shard_stage import plan_shards, stage_fingerprint
    from assay.stages.static import static_unit
    from assay.staging import prepare
    from flows.static import static_flow

    again = static_flow(str(tier1["raw"]), str(tier1["out"]), params_file=str(tier1["params"]))
    assert again["created_at"] == tier1["manifest"]["created_at"]

    out = tier1["root"] / "static-resumed"
    params = load_params(tier1["params"])
    units = plan_shards(tier1["raw"])
    # A run that died after its first shard: same fingerprint, one unit done.
    import dataclasses

    assert len(units) > 1
    section = {"static": dataclasses.asdict(params.static), "io": dataclasses.asdict(params.io)}
    prepare(out, stage_fingerprint(units, section, [params.static.head]))
    static_unit(units[0].index, units[0].shard, str(out), params, units[0].key)
    resumed = static_flow(str(tier1["raw"]), str(out), params_file=str(tier1["params"]))
    assert resumed["counts"]["units_resumed"] == 1
    assert resumed["counts"]["kept"] == tier1["manifest"]["counts"]["kept"]


def test_a_stage_never_writes_over_its_own_input_nor_reads_a_dataset_missing_a_shard(tier1, tmp_path):
    """With --overwrite, --in == --out replaced the raw dataset by its static output (its decisions and
    quarantine lost); and a dataset with a shard deleted was read as if whole (fewer documents, no word)."""
    from flows.static import static_flow

    raw = shutil.copytree(tier1["raw"], tmp_path / "raw")
    before = sorted((p.name, p.stat().st_size) for p in raw.rglob("*"))
    with pytest.raises(AssayError, match="is the input"):
        static_flow(str(raw), str(raw), overwrite=True, params_file=str(tier1["params"]))
    assert sorted((p.name, p.stat().st_size) for p in raw.rglob("*")) == before
    shards = sorted(raw.glob("part-*.parquet"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(AssayError, match=rf"1 of the {len(shards)} shards its manifest.json lists are missing "
                                         rf"\({shards[1].name}\)"):
        static_flow(str(raw), str(tmp_path / "static"), params_file=str(tier1["params"]))
    assert not (tmp_path / "static").exists()


def test_missing_head_fails_fast_naming_the_command(tier1, tmp_path):
    from flows.static import static_flow

    params = yaml.safe_load(tier1["params"].read_text())
    params["static"]["head"] = str(tmp_path / "no-head")
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(params))
    with pytest.raises(AssayError, match="assay quality train"):
        static_flow(str(tier1["raw"]), str(tmp_path / "out"), params_file=str(bad))


def test_a_shard_replaced_after_planning_is_refused_by_its_task_and_at_the_commit(tier1, tmp_path):
    from assay.config import load_params
    from assay.stages.shard_stage import plan_shards, require_unchanged
    from assay.stages.static import static_unit
    from republish import republish

    source = shutil.copytree(tier1["raw"], tmp_path / "raw")
    units = plan_shards(source)
    require_unchanged(source, units)  # nothing changed: no complaint
    republish(source, tmp_path)
    params = load_params(tier1["params"])
    with pytest.raises(AssayError, match=r"part-00000.parquet: replaced since this stage planned its run"):
        static_unit(units[0].index, units[0].shard, str(tmp_path / "out"), params, units[0].key)
    with pytest.raises(AssayError, match=r"raw: changed during this run \(part-00000.parquet"):
        require_unchanged(source, units)


def test_a_shard_edited_in_place_keeping_its_size_and_mtime_is_still_a_changed_shard(tier1, tmp_path):
    """An edit that rewrites bytes in place and sets the mtime back (os.utime, `touch -d`,
    `rsync -t`) keeps the name, size and mtime; the ctime it cannot keep names the change."""
    from assay.config import load_params
    from assay.stages.shard_stage import plan_shards, require_unchanged, stage_fingerprint
    from assay.stages.static import static_unit

    source = shutil.copytree(tier1["raw"], tmp_path / "raw")
    time.sleep(0.05)  # the edit's ctime past the copy's, where the kernel stamps files by its tick (1-10 ms)
    units = plan_shards(source)
    shard = Path(units[0].shard)
    before = shard.stat()
    original = shard.read_bytes()
    at = original.rfind(b"parquet-cpp-arrow")  # the footer's created_by: the file stays a valid shard
    assert at > 0
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(b"P")
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert shard.read_bytes() != original and pq.read_table(shard).num_rows > 0

    params = load_params(tier1["params"])
    with pytest.raises(AssayError, match=r"part-00000.parquet: replaced since this stage planned its run"):
        static_unit(units[0].index, units[0].shard, str(tmp_path / "out"), params, units[0].key)
    with pytest.raises(AssayError, match=r"raw: changed during this run \(part-00000.parquet"):
        require_unchanged(source, units)
    # A later run does not take its output, or a killed run's staged units, as made from these bytes.
    assert stage_fingerprint(plan_shards(source), {}) != stage_fingerprint(units, {})


def test_an_input_republished_after_every_task_read_it_is_not_published(tier1, tmp_path, monkeypatch):
    """The flow's own check: each task read the version it planned on, then the input changed
    before the commit. The output would record the new input's fingerprint over the old one's
    judgments; the run stops, and the previous output stays as it was."""
    import flows.static
    from assay.stages.static import static_unit
    from republish import RepublishAfter

    source = shutil.copytree(tier1["raw"], tmp_path / "raw")
    out = shutil.copytree(tier1["out"], tmp_path / "static")  # a previous output, which must survive
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "of-other-inputs"}))
    before = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    upstream = RepublishAfter(source, tmp_path, len(list(source.glob("part-*.parquet"))))

    monkeypatch.setattr(flows.static, "static_shard_task", upstream.task_of(static_unit, "static-shard"))
    with pytest.raises(AssayError, match=r"changed during this run \(part-00000.parquet"):
        flows.static.static_flow(str(source), str(out), overwrite=True, params_file=str(tier1["params"]))
    assert upstream.finished == upstream.n
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == before


def test_a_stage_output_that_kept_nothing_feeds_the_next_stage(tier1, tmp_path):
    """A dataset whose stage kept no document (its manifest lists no shard) was refused by the next
    stage as "has no part-*.parquet shards", the message for a damaged dataset; it is an input like
    any other: nothing to judge, an empty dataset out, and the chain goes on to its report."""
    from flows.dedup import dedup_flow
    from flows.ingest import ingest_flow
    from flows.static import static_flow

    (tmp_path / "bad.jsonl").write_text('{"text": ""}\n{"text": "   "}\n{"body": "no text"}\n')
    raw = tmp_path / "raw"
    assert ingest_flow([str(tmp_path / "bad.jsonl")], str(raw))["counts"]["documents"] == 0
    previous = raw
    for name, stage in (("static", static_flow), ("dedup", dedup_flow)):  # domain: tests/test_domain.py
        manifest = stage(str(previous), str(tmp_path / name), params_file=str(tier1["params"]))
        assert manifest["shards"] == [] and manifest["counts"]["units"] == 0, (name, manifest)
        assert read_manifest_of(tmp_path / name)["stage"] == name
        previous = tmp_path / name
    # A folder with neither shards nor a manifest is still no dataset.
    (tmp_path / "nothing").mkdir()
    with pytest.raises(AssayError, match="not an Assay dataset"):
        static_flow(str(tmp_path / "nothing"), str(tmp_path / "out"), params_file=str(tier1["params"]))


def read_manifest_of(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())
