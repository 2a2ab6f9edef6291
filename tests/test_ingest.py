"""Ingest, end to end through the real Prefect flow (under prefect_test_harness)."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.errors import AssayError
from assay.lineage import find_document, why
from assay.schema import document_id
from assay.shards import iter_batches, read_manifest
from corpus import LATIN1_TEXT, write_jsonl_gz

pytestmark = pytest.mark.usefixtures("prefect_harness")


def ingest(sources, out, **kwargs):
    from flows.ingest import ingest_flow

    return ingest_flow([str(s) for s in sources], str(out), **kwargs)


def documents(out) -> list[dict]:
    return [row for batch in iter_batches(out) for row in batch.to_pylist()]


def decisions(out) -> list[dict]:
    return pq.read_table(Path(out) / "decisions").to_pylist()


def quarantine(out) -> dict[str, dict]:
    folder = Path(out) / "quarantine"
    if not folder.exists():
        return {}
    return {row["path"]: row for row in pq.read_table(folder).to_pylist()}


def test_bad_input_is_quarantined_and_no_good_record_is_lost(bad_corpus, tmp_path):
    out = tmp_path / "raw"
    manifest = ingest([bad_corpus["tree"], bad_corpus["jsonl"]], out)

    docs = {d["path"]: d for d in documents(out)}
    assert set(docs) == {"src/app.py", "src/main.rs", "docs/guide.md", "latin1.txt",
                         "records.jsonl:1", "records.jsonl:3", "pkg/f.py"}
    assert docs["latin1.txt"]["text"] == LATIN1_TEXT
    assert json.loads(docs["latin1.txt"]["meta"])["encoding"] in ("cp1252", "latin_1", "iso8859_15")
    assert (docs["src/app.py"]["kind"], docs["src/app.py"]["lang"]) == ("code", "python")
    assert (docs["src/main.rs"]["kind"], docs["src/main.rs"]["lang"]) == ("code", "rust")
    assert docs["docs/guide.md"]["kind"] == "text"

    bad = quarantine(out)
    assert {path: row["reason"] for path, row in bad.items()} == {
        "image.png": "invalid:binary",
        "empty.txt": "invalid:empty",
        "blank.txt": "invalid:empty",
        "huge.txt": "invalid:too_large",
        "records.jsonl:2": "invalid:json",
        "records.jsonl:4": "invalid:json",
        "records.jsonl:7": "invalid:empty",
        "records.jsonl:8": "invalid:record",
    }
    assert "line 2" in bad["records.jsonl:2"]["detail"] and "line 4" in bad["records.jsonl:4"]["detail"]
    # Nothing lost: raw bytes are kept, except for what is too large to copy.
    assert bad["image.png"]["raw"].startswith(b"\x89PNG")
    assert bad["records.jsonl:4"]["raw"] == b"this line is not JSON at all\n"
    assert bad["huge.txt"]["raw"] is None and "bytes > ingest.max_bytes" in bad["huge.txt"]["detail"]

    # Every input record has exactly one decision: kept or dropped with its reason.
    rows = decisions(out)
    assert len(rows) == len(docs) + len(bad) == len({r["id"] for r in rows})
    assert all(r["stage"] == "ingest" for r in rows)
    assert sum(r["kept"] for r in rows) == len(docs)
    assert all((r["reason"] is None) == r["kept"] for r in rows)

    counts = manifest["counts"]
    assert counts["documents"] == 7 and counts["quarantined"] == 8 and counts["input_records"] == 15
    assert counts["by_reason"] == {"invalid:binary": 1, "invalid:empty": 3, "invalid:json": 2,
                                   "invalid:record": 1, "invalid:too_large": 1}
    assert counts["skipped"]["blank_lines"] == 1
    assert read_manifest(out)["counts"] == counts


def test_jsonl_fields_fill_columns_and_meta(bad_corpus, tmp_path):
    out = tmp_path / "raw"
    ingest([bad_corpus["jsonl"]], out)
    docs = {d["path"]: d for d in documents(out)}
    assert docs["records.jsonl:1"]["id"] == "r1"
    assert docs["records.jsonl:3"]["id"] == document_id("records.jsonl", "line:3")
    assert json.loads(docs["records.jsonl:3"]["meta"]) == {"topic": "ids"}
    f = docs["pkg/f.py"]
    assert (f["kind"], f["lang"], f["source"]) == ("code", "python", "records.jsonl")
    assert json.loads(f["meta"]) == {"stars": 3}


def test_jsonl_gz_and_custom_fields(tmp_path):
    path = write_jsonl_gz(tmp_path / "data.jsonl.gz", [
        {"doc": "alpha", "body": "The first body of text, which is long enough.", "source": "web", "lang": "en"},
        {"doc": "beta", "body": "fn main() { let x = 1; }\n", "kind": "code", "lang": "rust"},
    ])
    out = tmp_path / "raw"
    ingest([path], out, text_field="body", id_field="doc")
    docs = {d["id"]: d for d in documents(out)}
    assert docs["alpha"]["source"] == "web" and docs["alpha"]["kind"] == "text"
    assert (docs["beta"]["kind"], docs["beta"]["lang"]) == ("code", "rust")


def test_parquet_is_checked_by_batch(tmp_path):
    table = pa.table({
        "content": ["A fine document with several words in it.", "", None, "x" * 2000, "nul\x00byte", "import os\n"],
        "uid": ["a", "b", "c", "d", "e", None],
        "path": ["a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "tool.py"],
        "stars": [1, 2, 3, 4, 5, 6],
    })
    pq.write_table(table, tmp_path / "in.parquet")
    params = tmp_path / "params.yaml"
    params.write_text("ingest:\n  max_bytes: 1000\nio:\n  batch_rows: 4\n")
    out = tmp_path / "raw"
    manifest = ingest([tmp_path / "in.parquet"], out, text_field="content", id_field="uid", params_file=str(params))
    docs = {d["path"]: d for d in documents(out)}
    assert set(docs) == {"a.txt", "tool.py"}
    assert docs["a.txt"]["id"] == "a" and json.loads(docs["a.txt"]["meta"]) == {"stars": 1}
    assert docs["tool.py"]["id"] == document_id("in.parquet", "row:5")
    assert (docs["tool.py"]["kind"], docs["tool.py"]["lang"]) == ("code", "python")
    assert {p: r["reason"] for p, r in quarantine(out).items()} == {
        "b.txt": "invalid:empty", "c.txt": "invalid:record", "d.txt": "invalid:too_large", "e.txt": "invalid:binary"}
    assert manifest["counts"]["input_records"] == 6


def test_parquet_without_the_text_field_is_a_clear_error(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in.parquet")
    with pytest.raises(AssayError, match="no text field 'text'.*body"):
        ingest([tmp_path / "in.parquet"], tmp_path / "raw")


def test_hugging_face_save_to_disk_and_load_dataset(tmp_path):
    import datasets

    records = {"text": ["First document of the dataset.", "Second one, a little longer than the first."], "label": [0, 1]}
    datasets.Dataset.from_dict(records).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in records["text"]) + "\n")

    out = tmp_path / "raw"
    ingest([f"hf:{tmp_path / 'saved'}", f"hf:{tmp_path / 'files'}:train"], out)
    docs = documents(out)
    assert len(docs) == 4
    assert {d["source"] for d in docs} == {"hf:saved", "hf:files"}
    assert sorted(json.loads(d["meta"]).get("label", -1) for d in docs) == [-1, -1, 0, 1]


def test_directory_walk_skips_and_symlinks(tmp_path):
    root = tmp_path / "repo"
    for folder in ("pkg", ".git", "node_modules/x", "__pycache__", ".venv/lib"):
        (root / folder).mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / ".git" / "config").write_text("[core]\n")
    (root / "node_modules" / "x" / "index.js").write_text("module.exports = 1;\n")
    (root / "__pycache__" / "m.pyc").write_bytes(b"\x00\x01")
    (root / ".venv" / "lib" / "site.py").write_text("y = 2\n")
    outside = tmp_path / "secret.txt"
    outside.write_text("outside the root\n")
    (root / "link-out.txt").symlink_to(outside)
    (root / "link-in.py").symlink_to(root / "pkg" / "mod.py")
    (root / "broken.txt").symlink_to(tmp_path / "missing")
    out = tmp_path / "raw"
    manifest = ingest([root], out)
    assert sorted(d["path"] for d in documents(out)) == ["link-in.py", "pkg/mod.py"]
    assert {p: r["reason"] for p, r in quarantine(out).items()} == {"broken.txt": "invalid:io"}
    assert manifest["counts"]["skipped"]["symlink_outside_root"] == 1
    assert manifest["counts"]["skipped"]["skipped_dir"] == 4


def test_ids_are_stable_across_runs_and_locations(bad_corpus, tmp_path):
    first = ingest([bad_corpus["tree"]], tmp_path / "one")
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(bad_corpus["tree"], moved)
    ingest([moved], tmp_path / "two")
    ids_one = sorted(r["id"] for r in decisions(tmp_path / "one"))
    ids_two = sorted(r["id"] for r in decisions(tmp_path / "two"))
    assert ids_one == ids_two and len(ids_one) == first["counts"]["input_records"]
    assert document_id("corpus", "src/app.py") in ids_one


def test_rerun_is_a_no_op_and_other_inputs_need_overwrite(bad_corpus, tmp_path):
    out = tmp_path / "raw"
    first = ingest([bad_corpus["tree"]], out)
    again = ingest([bad_corpus["tree"]], out)
    assert again["created_at"] == first["created_at"]
    with pytest.raises(AssayError, match="--overwrite"):
        ingest([bad_corpus["jsonl"]], out)
    replaced = ingest([bad_corpus["jsonl"]], out, overwrite=True)
    assert replaced["sources"] == [str(bad_corpus["jsonl"])]


def test_refuses_to_write_into_a_folder_that_is_not_a_dataset(bad_corpus, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious\n")
    with pytest.raises(AssayError, match="not an Assay dataset"):
        ingest([bad_corpus["tree"]], tmp_path / "mine")


def test_a_killed_run_resumes_from_finished_tasks(bad_corpus, tmp_path):
    """Finish the run, then fake a crash after the first task by rebuilding its staging state."""
    from assay.config import load_params
    from assay.ingest import fingerprint, options_from_params
    from assay.ingest.plan import plan
    from assay.ingest.readers import ingest_unit
    from assay.staging import STAGING_DIR, prepare

    params_file = tmp_path / "params.yaml"
    params_file.write_text("ingest:\n  unit_bytes: 1\n")  # one task per file
    params = load_params(params_file)
    options = options_from_params(params)
    sources = [str(bad_corpus["tree"])]
    units = plan(sources, options)
    assert len(units) > 3
    out = tmp_path / "raw"
    # A run that died after two tasks, leaving a half-written third.
    prepare(out, fingerprint(units, options, params))
    for i in range(2):
        ingest_unit(i, units[i], str(out), options)
    half = out / STAGING_DIR / "00002-half"
    half.mkdir()
    (half / ".docs-00000.parquet.tmp-1").write_bytes(b"PAR1 partial")

    manifest = ingest(sources, out, params_file=str(params_file))
    assert manifest["counts"]["units_resumed"] == 2
    assert not (out / STAGING_DIR).exists()
    clean = ingest(sources, tmp_path / "clean", params_file=str(params_file))
    assert sorted(d["id"] for d in documents(out)) == sorted(d["id"] for d in documents(tmp_path / "clean"))
    assert manifest["counts"]["documents"] == clean["counts"]["documents"]


def test_missing_and_unknown_sources_are_errors(tmp_path):
    with pytest.raises(AssayError, match="nope: no such file or directory"):
        ingest([tmp_path / "nope"], tmp_path / "raw")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(AssayError, match="data.csv: unknown format"):
        ingest([tmp_path / "data.csv"], tmp_path / "raw")


def test_show_and_why(bad_corpus, tmp_path):
    out = tmp_path / "raw"
    ingest([bad_corpus["tree"]], out)
    good, bad = document_id("corpus", "src/app.py"), document_id("corpus", "image.png")
    assert find_document(out, good)["text"].startswith("def add")
    shown = find_document(out, bad)
    assert shown["status"] == "quarantined" and shown["reason"] == "invalid:binary"
    story = why(bad, [out])
    assert [(s["stage"], s["kept"], s["reason"]) for s in story] == [("ingest", False, "invalid:binary")]
    assert find_document(out, "no-such-id") is None
