"""Ingest, end to end through the real Prefect flow (under prefect_test_harness)."""

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.errors import AssayError
from assay.lineage import find_document, why
from assay.schema import document_id
from assay.shards import iter_batches, read_manifest
from corpus import LATIN1_TEXT, write_jsonl_gz

#: Tests that run the Prefect flow; the reader tests below call the reader directly.
needs_flow = pytest.mark.usefixtures("prefect_harness")


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


@needs_flow
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


@needs_flow
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


@needs_flow
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


@needs_flow
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


@needs_flow
def test_parquet_without_the_text_field_is_a_clear_error(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in.parquet")
    with pytest.raises(AssayError, match="no text field 'text'.*body"):
        ingest([tmp_path / "in.parquet"], tmp_path / "raw")


@needs_flow
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


@needs_flow
def test_an_hf_source_that_cannot_be_loaded_is_refused_before_anything_is_staged(tmp_path):
    """`hf:EMPTY_DIR` failed only inside the ingest task, after `.OUT.staging/` was made, and left it
    behind. The source is now loaded at plan time (as a Parquet file's columns are read there), with
    the reader's own error."""
    import datasets

    from assay.ingest.hf import load_hf_dataset
    from assay.shards import staging_dir

    (tmp_path / "empty").mkdir()
    datasets.Dataset.from_dict({"body": ["no text column"]}).save_to_disk(str(tmp_path / "notext"))
    out = tmp_path / "raw"
    for source in ("empty", "notext"):
        with pytest.raises(AssayError) as expected:
            load_hf_dataset(str(tmp_path / source), None, "text")
        with pytest.raises(AssayError) as raised:
            ingest([f"hf:{tmp_path / source}"], out)
        assert str(raised.value) == str(expected.value), source
        assert not staging_dir(out).exists() and not out.exists(), source


@needs_flow
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
    assert sorted(d["path"] for d in documents(out)) == ["pkg/mod.py"]
    assert {p: r["reason"] for p, r in quarantine(out).items()} == {"broken.txt": "invalid:io"}
    assert manifest["counts"]["skipped"] == {"symlink_outside_root": 1, "symlink_file_inside_root": 1, "skipped_dir": 4}


def test_a_directory_of_record_files_is_planned_as_files_with_a_note_on_reading_their_records(tmp_path, capsys):
    """A folder of .jsonl.gz shards (what datatrove's readers take) is a tree of documents to Assay: each shard
    would be one document, or quarantined as binary. The plan says so and how to read the records instead."""
    from assay.config import Params
    from assay.ingest import options_from_params
    from assay.ingest.plan import plan

    options = options_from_params(Params())
    shards = tmp_path / "shards"
    (shards / "more").mkdir(parents=True)
    write_jsonl_gz(shards / "a.jsonl.gz", [{"text": "one"}])
    (shards / "more" / "b.parquet").write_bytes(b"PAR1")
    (shards / "notes.txt").write_text("plain\n")
    units = plan([str(shards)], options)
    assert sorted(f.locator for u in units for f in u.files) == ["a.jsonl.gz", "more/b.parquet", "notes.txt"]
    note = capsys.readouterr().out
    assert note == (f"note: {shards} holds 2 JSONL or Parquet file(s) ({shards}/a.jsonl.gz, ...). A directory's files "
                    "are read whole, one document each (a compressed or Parquet one is quarantined as binary); to read "
                    f"their records, name the files as SOURCEs: assay ingest {shards}/*.jsonl.gz ... --out OUT\n")
    (shards / "a.jsonl.gz").unlink()
    plan([str(shards)], options)
    assert f"holds 1 JSONL or Parquet file(s) ({shards}/more/b.parquet). " in capsys.readouterr().out
    (shards / "more" / "b.parquet").unlink()
    plan([str(shards)], options)
    assert capsys.readouterr().out == ""  # a tree of documents: nothing to say


@needs_flow
def test_a_symlinked_file_inside_the_root_is_read_once_under_its_own_path(tmp_path):
    """A link to a file inside the ingested root was read through the link as well, so the same
    content came in twice under two ids (and a link into a skipped dir got round `skip_dirs`). Like
    a symlinked directory, it is counted and not read: what it leads to is read under its own path."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "node_modules").mkdir()
    (root / "docs" / "guide.md").write_text("A guide, written once, linked twice.\n")
    (root / "node_modules" / "dep.js").write_text("module.exports = 2;\n")
    (root / "README.md").symlink_to("docs/guide.md")                 # relative, inside
    (root / "docs" / "index.md").symlink_to(root / "docs" / "guide.md")  # absolute, inside
    (root / "chain.md").symlink_to("README.md")                      # a link to a link to a file inside
    (root / "dep.js").symlink_to("node_modules/dep.js")              # into a skipped dir
    manifest = ingest([root], tmp_path / "raw")
    docs = documents(tmp_path / "raw")
    assert [d["path"] for d in docs] == ["docs/guide.md"]
    assert manifest["counts"]["documents"] == 1 and not quarantine(tmp_path / "raw")
    assert manifest["counts"]["skipped"] == {"symlink_file_inside_root": 4, "skipped_dir": 1}


@needs_flow
def test_a_fifo_is_quarantined_unread_and_a_name_that_is_not_utf8_is_kept(tmp_path):
    """A FIFO would block its reader for ever (seen: ingest hung, deaf to SIGTERM); a file name with
    bytes that are not UTF-8 stopped the whole run (its id could not be encoded). Neither may."""
    import os

    root = tmp_path / "src"
    root.mkdir()
    (root / "ok.txt").write_text("a plain text file\n")
    os.mkfifo(root / "pipe")
    odd = os.path.join(os.fsencode(root), b"caf\xe9.txt")  # Latin-1 bytes in a name: not UTF-8
    with open(odd, "wb") as handle:
        handle.write(b"text under an odd name\n")
    out = tmp_path / "raw"
    # Should a reader open the FIFO again (the regression), open its other end so that the reader
    # sees an empty file and the test fails, rather than hangs: a non-blocking open for writing
    # succeeds only while someone has it open for reading.
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(0.2):
            try:
                os.close(os.open(root / "pipe", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # ENXIO: no reader, as it should be

    threading.Thread(target=unblock, daemon=True).start()
    try:
        manifest = ingest([root], out)
    finally:
        done.set()
    texts = {d["path"]: d["text"] for d in documents(out)}
    assert texts == {"ok.txt": "a plain text file\n", "caf\\xe9.txt": "text under an odd name\n"}
    assert quarantine(out)["pipe"]["reason"] == "invalid:io"
    assert "not a regular file (FIFO)" in quarantine(out)["pipe"]["detail"]
    assert manifest["counts"]["input_records"] == 3


def test_rendered_entries_that_are_not_files_are_read_and_files_are_checked(tmp_path):
    """A pydoc topic is rendered by name, with no file behind it: the regular-file check must not
    touch it (a first version stat()ed the name and quarantined all 79 of the demo's topics)."""
    from pydoc_data.topics import topics

    from assay.ingest.plan import FileEntry
    from assay.ingest.readers import read_entry

    topic = sorted(topics)[0]
    assert read_entry(FileEntry(topic, "pydoc-topics", topic, render="pydoc"), 10**7) == topics[topic].encode()
    assert read_entry(FileEntry(topic, "pydoc-topics", topic, render="pydoc"), 3) == len(topics[topic].encode())
    plain = tmp_path / "plain.txt"
    plain.write_text("hello\n")
    assert read_entry(FileEntry(str(plain), "s", "plain.txt"), 100) == b"hello\n"
    with pytest.raises(OSError, match="not a regular file \\(directory\\)"):
        read_entry(FileEntry(str(tmp_path), "s", "dir"), 100)


@needs_flow
def test_an_out_that_overlaps_an_input_or_is_a_file_is_refused_before_any_work(bad_corpus, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(bad_corpus["tree"], tree)
    before = sorted(p.relative_to(tree) for p in tree.rglob("*"))
    for out, says in ((tree, "is the input"), (tree / "sub" / "raw", "lies inside the input"),
                      (tmp_path, "holds the input")):
        with pytest.raises(AssayError, match=says):
            ingest([tree], out, overwrite=True)
    assert sorted(p.relative_to(tree) for p in tree.rglob("*")) == before  # nothing written into it
    a_file = tmp_path / "afile"
    a_file.write_text("x\n")
    with pytest.raises(AssayError, match="is a file, not a directory"):
        ingest([tree], a_file)
    assert a_file.read_text() == "x\n" and not (tmp_path / ".afile.staging").exists()


@needs_flow
def test_overwrite_never_replaces_a_folder_whose_manifest_is_not_ours(bad_corpus, tmp_path):
    webapp = tmp_path / "webapp"
    (webapp / "src").mkdir(parents=True)
    (webapp / "manifest.json").write_text('{"name": "my-web-app"}')
    (webapp / "src" / "index.js").write_text("x\n")
    with pytest.raises(AssayError, match="not an Assay dataset"):
        ingest([bad_corpus["tree"]], webapp, overwrite=True)
    assert (webapp / "src" / "index.js").read_text() == "x\n"


def test_sources_whose_records_would_share_ids_are_refused_up_front(tmp_path):
    """Two directories of one name holding one file name, or one SOURCE twice, gave two documents one
    id (dedup then failed: a document "cannot be a duplicate of itself")."""
    from assay.config import Params
    from assay.ingest import options_from_params
    from assay.ingest.plan import plan

    options = options_from_params(Params())
    for parent in ("a", "b"):
        (tmp_path / parent / "corpus").mkdir(parents=True)
        (tmp_path / parent / "corpus" / f"only-{parent}.txt").write_text(f"{parent}\n")
    a, b = str(tmp_path / "a" / "corpus"), str(tmp_path / "b" / "corpus")
    assert len(plan([a, b], options)) >= 1  # one name, no shared file: the ids differ
    (tmp_path / "a" / "corpus" / "readme.txt").write_text("one\n")
    (tmp_path / "b" / "corpus" / "readme.txt").write_text("two\n")
    with pytest.raises(AssayError, match="both source 'corpus' and both hold readme.txt"):
        plan([a, b], options)
    with pytest.raises(AssayError, match="given twice"):
        plan([a, a + "/"], options)
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for folder in ("x", "y"):
        (tmp_path / folder / "data.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(AssayError, match="both source 'data.jsonl'"):
        plan([str(tmp_path / "x" / "data.jsonl"), str(tmp_path / "y" / "data.jsonl")], options)


@needs_flow
def test_ids_are_stable_across_runs_and_locations(bad_corpus, tmp_path):
    first = ingest([bad_corpus["tree"]], tmp_path / "one")
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(bad_corpus["tree"], moved)
    ingest([moved], tmp_path / "two")
    ids_one = sorted(r["id"] for r in decisions(tmp_path / "one"))
    ids_two = sorted(r["id"] for r in decisions(tmp_path / "two"))
    assert ids_one == ids_two and len(ids_one) == first["counts"]["input_records"]
    assert document_id("corpus", "src/app.py") in ids_one


@needs_flow
def test_rerun_is_a_no_op_and_other_inputs_need_overwrite(bad_corpus, tmp_path):
    out = tmp_path / "raw"
    first = ingest([bad_corpus["tree"]], out)
    again = ingest([bad_corpus["tree"]], out)
    assert again["created_at"] == first["created_at"]
    with pytest.raises(AssayError, match="--overwrite"):
        ingest([bad_corpus["jsonl"]], out)
    replaced = ingest([bad_corpus["jsonl"]], out, overwrite=True)
    assert replaced["sources"] == [str(bad_corpus["jsonl"])]


@needs_flow
def test_refuses_to_write_into_a_folder_that_is_not_a_dataset(bad_corpus, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious\n")
    with pytest.raises(AssayError, match="not an Assay dataset"):
        ingest([bad_corpus["tree"]], tmp_path / "mine")


@needs_flow
def test_a_killed_run_resumes_from_finished_tasks(bad_corpus, tmp_path):
    """Finish the run, then fake a crash after the first task by rebuilding its staging state."""
    from assay.config import load_params
    from assay.ingest import fingerprint, options_from_params
    from assay.ingest.plan import plan
    from assay.ingest.readers import ingest_unit
    from assay.shards import staging_dir
    from assay.staging import prepare

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
    half = staging_dir(out) / "00002-half"
    half.mkdir()
    (half / ".docs-00000.parquet.tmp-1").write_bytes(b"PAR1 partial")

    manifest = ingest(sources, out, params_file=str(params_file))
    assert manifest["counts"]["units_resumed"] == 2
    assert not staging_dir(out).exists()
    clean = ingest(sources, tmp_path / "clean", params_file=str(params_file))
    assert sorted(d["id"] for d in documents(out)) == sorted(d["id"] for d in documents(tmp_path / "clean"))
    assert manifest["counts"]["documents"] == clean["counts"]["documents"]


@needs_flow
def test_missing_and_unknown_sources_are_errors(tmp_path):
    with pytest.raises(AssayError, match="nope: no such file or directory"):
        ingest([tmp_path / "nope"], tmp_path / "raw")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(AssayError, match="data.csv: unknown format"):
        ingest([tmp_path / "data.csv"], tmp_path / "raw")


@needs_flow
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


# --- JSON lines: Arrow blocks against the line-by-line reference ----------------------------

MAX_BYTES = 1000  # small, so that too-large texts and too-long lines are cheap to write


def dirty_lines() -> list[bytes]:
    """One line of every kind the JSONL reader must judge; (comment) what `parse_line` makes of it."""
    dumps = lambda record: json.dumps(record).encode()  # noqa: E731
    return [
        dumps({"id": "a1", "text": "A plain record with a few words.", "url": "https://example.org/a"}),
        dumps({"text": "No id: one from the source and line.", "score": 1}),  # meta int
        dumps({"text": "A float score.", "score": 2.5}),  # same field, float: Arrow makes the column double
        dumps({"text": "An integer written as a float.", "score": 3.0}),
        dumps({"id": 7, "text": "An integer id.", "tags": ["x", "y"], "nested": {"a": [1, None, {"b": 2}]}}),
        dumps({"id": 1.5, "text": "A float id: str() of a float."}),
        dumps({"id": True, "text": "A bool id."}),
        dumps({"id": "", "text": "An empty id falls back."}),
        dumps({"id": None, "text": "A null id falls back.", "x": None}),  # explicit null goes to meta
        dumps({"text": "Null inside meta.", "meta": {"a": 1, "b": {"c": None}}}),
        dumps({"text": "Meta merged.", "meta": {"stars": 3, "lic": "mit"}, "path": "pkg/mod.py"}),
        dumps({"text": "Meta clashes with a field.", "meta": {"x": 1}, "x": 2}),
        dumps({"text": "Meta is a string.", "meta": "just a string"}),
        dumps({"text": "Dates stay strings.", "date": "2020-01-01", "when": {"t": "2021-02-03T04:05:06Z"}}),
        dumps({"text": "Empty source goes to meta.", "source": "", "kind": 5, "lang": None}),
        dumps({"text": "fn main() {}\n", "kind": "code", "lang": "rust", "source": "elsewhere"}),
        dumps({"text": "#!/bin/sh\necho hi\n", "path": ""}),
        dumps({"text": "Unicode: café, 東京, emoji \U0001F600, NBSP\u00a0here."}, ),
        json.dumps({"text": "Not ASCII-escaped: café 東京."}, ensure_ascii=False).encode(),
        dumps({"text": "A NUL \u0000 inside the text."}),  # invalid:binary
        dumps({"text": "An escaped backslash before u0000: \\u0000 is text."}),
        b'{"text": "A lone surrogate \\ud800 here."}',  # invalid:encoding
        b'{"text": "A surrogate pair \\ud83d\\ude00 is fine."}',
        b'{"text": "NaN in meta", "v": NaN}',
        b'{"text": "-NaN is not JSON", "v": -NaN}',  # invalid:json (Arrow reads it)
        b'{"text": "Infinity", "v": Infinity, "w": -Infinity}',
        b'{"text": "Too big for a double", "v": 1e400}',
        b'{"text": "A big integer", "v": 1180591620717411303424}',
        b'{"text": "two objects"}{"text": "on one line"}',  # invalid:json
        b'{"text": "duplicate key", "k": 1, "k": 2}',  # Python keeps the last
        b'\xef\xbb\xbf{"text": "A byte-order mark starts this line."}',
        b'   {"text": "Leading spaces."}',
        b"",  # blank
        b"  \t ",  # blank
        b"\x0c",  # blank (bytes.strip removes form feed)
        "\u00a0\u3000".encode(),  # only Unicode whitespace: invalid:empty
        b"[1, 2, 3]",  # invalid:record
        b'"a string"',
        b"42",
        b"null",
        b'{"text": "missing the closing brace"',  # invalid:json
        b"this line is not JSON at all",
        "Caf\u00e9 cr\u00e8me: latin-1 bytes, no JSON".encode("latin-1"),  # invalid:json after decoding
        '{"text": "caf\u00e9 in latin-1, valid JSON"}'.encode("latin-1"),  # a document, meta.encoding
        b"\x89PNG\r\x1a\x00\x00\x00\rIHDR" + bytes(range(1, 9)) * 4,  # invalid:binary
        b'{"text": "DEL bytes \x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f"}',  # invalid:binary (>10% control)
        b'{"text": "one DEL \x7f is fine, though"}',
        b'{"text": "a raw\ttab in a string"}',  # invalid:json (strict)
        b'{"text": "ctrl \x01 in a string"}',  # invalid:json
        b'{"body": "no text field"}',  # invalid:record
        b'{"text": 5}',  # invalid:record, a number
        b'{"text": ["a list"]}',
        b'{"text": {"an": "object"}}',
        b'{"text": null}',  # invalid:record, missing
        b'{"text": ""}',  # invalid:empty
        '{"text": " \\u3000\\n\\t\\u001c "}'.encode(),  # invalid:empty (Unicode whitespace)
        dumps({"text": "x" * (MAX_BYTES + 1)}),  # invalid:too_large (the text)
        dumps({"text": "é" * (MAX_BYTES // 2 + 1)}),  # too large in UTF-8 bytes, not characters
        dumps({"text": "y" * 70_000}),  # longer than the line limit: too_large, not loaded
        b'{"text": "CRLF line ending"}\r',
        b'{"text": "empty key and object", "": 1, "o": {}, "l": [], "ln": [null]}',
        b'{"\\u0074ext": "An escaped key name is still the text field."}',
        b'{"text": "deep", "d": [[{"a": [1.5, 2]}], []]}',
        b'{"text": "list of objects with a missing key", "d": [{"a": 1}, {"b": 2}]}',
    ]


def write_dirty(path: Path, repeat: int = 3) -> Path:
    """The dirty lines, repeated with good lines between them so that blocks split them differently."""
    out = []
    for copy in range(repeat):
        for i, line in enumerate(dirty_lines()):
            out.append(line)
            for j in range(copy + i % 3):
                record = {"id": f"g{copy}-{i}-{j}", "text": f"Good line {j} after {i}, copy {copy}."}
                if (i + j) % 4 == 0:
                    record["id"] = copy * 1000 + i * 10 + j  # ids change type between blocks
                if (i + j) % 5 == 0:
                    record["extra"] = {"n": j, "f": j + 0.5} if j % 2 else f"s{j}"  # and other fields too
                out.append(json.dumps(record).encode())
    path.write_bytes(b"\n".join(out) + b"\n")
    return path


def read_dataset(out: Path) -> dict:
    from assay.shards import iter_batches

    def rows(folder: Path) -> list[dict]:
        return pq.read_table(folder).to_pylist() if folder.exists() else []

    return {
        "documents": [row for batch in iter_batches(out) for row in batch.to_pylist()],
        # In line order, but for repeated ids: the line reader quarantines one when its documents
        # are flushed, the block reader when its block is; either way the same records.
        "quarantine": sorted(rows(Path(out) / "quarantine"), key=lambda r: r["reason"] == "invalid:duplicate_id"),
        "decisions": sorted(rows(Path(out) / "decisions"), key=lambda r: (r["id"], r["kept"])),
    }


def run_reader(path: Path, out: Path, parser: str, **options) -> tuple[dict, dict]:
    """Ingest one JSONL file with the chosen parser, without Prefect; (dataset, unit counts)."""
    import dataclasses

    from assay.config import params_from_dict
    from assay.ingest import fingerprint, manifest_for, options_from_params
    from assay.ingest.plan import plan, unit_key
    from assay.ingest.readers import ingest_unit
    from assay.ingest.repeated_ids import quarantine_repeated_ids
    from assay.staging import commit, prepare

    params = params_from_dict({"ingest": {"max_bytes": MAX_BYTES}})
    opts = dataclasses.replace(options_from_params(params), jsonl_parser=parser, **options)
    units = plan([str(path)], opts)
    prepare(out, fingerprint(units, opts, params), overwrite=True)
    results = quarantine_repeated_ids(out, [ingest_unit(i, u, str(out), opts) for i, u in enumerate(units)])
    commit(out, [unit_key(i, u) for i, u in enumerate(units)], manifest_for([str(path)], units, opts, params, results, 1.0))
    counts: dict = {}
    for result in results:
        for key, n in result.counts.items():
            counts[key] = counts.get(key, 0) + n
    return read_dataset(out), counts


def without_parser_counts(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if not k.startswith("jsonl_lines_")}


@pytest.mark.parametrize("block_bytes", [300, 4096, 4 * 2**20])
def test_arrow_blocks_give_what_the_line_reader_gives(tmp_path, block_bytes):
    path = write_dirty(tmp_path / "dirty.jsonl")
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines")
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=block_bytes)
    assert fast["documents"] == reference["documents"]  # same rows, same order, same meta
    assert fast["quarantine"] == reference["quarantine"]
    assert fast["decisions"] == reference["decisions"]
    assert without_parser_counts(counts) == without_parser_counts(ref_counts)
    if block_bytes > 4096:  # Python reads fewer lines than there are dirty ones (tiny blocks give up sooner)
        assert counts["jsonl_lines_python"] < 3 * len(dirty_lines()) < counts["jsonl_lines_arrow"]


def test_jsonl_gz_and_a_truncated_gz_read_alike(tmp_path):
    import gzip

    data = write_dirty(tmp_path / "dirty.jsonl", repeat=2).read_bytes()
    whole = gzip.compress(data)
    (tmp_path / "whole.jsonl.gz").write_bytes(whole)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) * 2 // 3])
    for name in ("whole.jsonl.gz", "cut.jsonl.gz"):
        reference, ref_counts = run_reader(tmp_path / name, tmp_path / f"lines-{name}", "lines")
        fast, counts = run_reader(tmp_path / name, tmp_path / f"arrow-{name}", "arrow", jsonl_block_bytes=2048)
        assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert any(r["reason"] == "invalid:io" and "reading stopped" in r["detail"] for r in fast["quarantine"])
    plain, _ = run_reader(tmp_path / "dirty.jsonl", tmp_path / "plain", "arrow")
    whole_gz, _ = run_reader(tmp_path / "whole.jsonl.gz", tmp_path / "gz", "arrow")
    assert [d["text"] for d in whole_gz["documents"]] == [d["text"] for d in plain["documents"]]


def test_each_bad_line_is_quarantined_alone_with_its_number(tmp_path):
    lines = dirty_lines()
    path = tmp_path / "once.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    data, counts = run_reader(path, tmp_path / "out", "arrow")
    number = {line: i + 1 for i, line in reversed(list(enumerate(lines)))}
    bad = {int(r["path"].rsplit(":", 1)[1]): r for r in data["quarantine"]}

    def reason(line: bytes) -> str:
        return bad[number[line]]["reason"]

    expected = {
        b'{"text": "A lone surrogate \\ud800 here."}': "invalid:encoding",
        b'{"text": "-NaN is not JSON", "v": -NaN}': "invalid:json",
        b'{"text": "two objects"}{"text": "on one line"}': "invalid:json",
        b"[1, 2, 3]": "invalid:record", b'"a string"': "invalid:record", b"42": "invalid:record", b"null": "invalid:record",
        b'{"text": "missing the closing brace"': "invalid:json", b"this line is not JSON at all": "invalid:json",
        b'{"text": "a raw\ttab in a string"}': "invalid:json", b'{"text": "ctrl \x01 in a string"}': "invalid:json",
        b'{"body": "no text field"}': "invalid:record", b'{"text": 5}': "invalid:record",
        b'{"text": null}': "invalid:record", b'{"text": ""}': "invalid:empty",
        "\u00a0\u3000".encode(): "invalid:empty",
        b'{"text": "DEL bytes \x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f"}': "invalid:binary",
        b'{"text": "Too big for a double", "v": 1e400}': None,  # Python reads inf: kept
    }
    for line, want in expected.items():
        if want is None:
            assert number[line] not in bad
        else:
            assert reason(line) == want, line
            assert bad[number[line]]["raw"].rstrip(b"\n") == line  # the raw bytes, to fix and re-ingest
            assert f"line {number[line]}" in bad[number[line]]["detail"]
    too_long = bad[number[json.dumps({"text": "y" * 70_000}).encode()]]
    assert too_long["reason"] == "invalid:too_large" and too_long["raw"] is None
    assert bad[number[json.dumps({"text": "x" * (MAX_BYTES + 1)}).encode()]]["reason"] == "invalid:too_large"
    assert "text contains NUL" in bad[number[json.dumps({"text": "A NUL \u0000 inside the text."}).encode()]]["detail"]
    assert counts["blank_lines"] == 3
    assert len(bad) == counts["quarantined"] and len(data["documents"]) + len(bad) + 3 == len(lines)

    docs = {d["path"]: d for d in data["documents"]}
    meta = {int(p.rsplit(":", 1)[1]): json.loads(d["meta"]) for p, d in docs.items() if ":" in p}
    assert meta[2] == {"score": 1} and meta[3] == {"score": 2.5} and meta[4] == {"score": 3.0}
    assert json.dumps(meta[4]) == '{"score": 3.0}' and json.dumps(meta[2]) == '{"score": 1}'
    assert meta[9] == {"x": None} and meta[10] == {"a": 1, "b": {"c": None}}
    assert meta[12] == {"x": 2} and meta[14] == {"date": "2020-01-01", "when": {"t": "2021-02-03T04:05:06Z"}}
    assert meta[15] == {"source": "", "kind": 5, "lang": None}
    assert docs["pkg/mod.py"]["lang"] == "python" and json.loads(docs["pkg/mod.py"]["meta"]) == {"stars": 3, "lic": "mit"}
    by_text = {d["text"]: d for d in data["documents"]}
    assert by_text["An integer id."]["id"] == "7" and by_text["A float id: str() of a float."]["id"] == "1.5"
    assert by_text["A bool id."]["id"] == "True"
    assert json.loads(by_text["caf\u00e9 in latin-1, valid JSON"]["meta"])["encoding"] in ("cp1252", "latin_1", "iso8859_15")
    assert by_text["An escaped key name is still the text field."]


def test_clean_input_never_falls_back_to_python(tmp_path):
    records = [{"id": f"d{i}", "text": f"Document {i} with some words.", "path": f"f{i}.py" if i % 3 else f"f{i}.md",
                "url": f"https://example.org/{i}", "meta": {"stars": i}} for i in range(2000)]
    for i in range(0, 2000, 7):
        del records[i]["url"]  # fields vary between lines
    path = tmp_path / "clean.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=16384)
    reference, _ = run_reader(path, tmp_path / "lines", "lines")
    assert fast == reference
    assert counts["jsonl_lines_python"] == 0 and counts["jsonl_lines_arrow"] == 2000


def test_the_manifest_summary_says_how_jsonl_lines_were_parsed():
    from assay.ingest import summarize
    from assay.staging import UnitResult

    units = [UnitResult("a", counts={"documents": 5, "jsonl_lines_arrow": 4, "jsonl_lines_python": 1}),
             UnitResult("b", counts={"documents": 3, "jsonl_lines_arrow": 3})]
    assert summarize(units)["jsonl_lines"] == {"arrow": 7, "python": 1}
    assert "jsonl_lines" not in summarize([UnitResult("c", counts={"documents": 2})])


def test_an_unknown_jsonl_parser_is_a_clear_error():
    from assay.ingest.plan import IngestOptions

    with pytest.raises(AssayError, match="jsonl_parser must be one of arrow, lines"):
        IngestOptions(jsonl_parser="simdjson")


def test_the_whitespace_set_is_pythons():
    from assay.ingest.jsonl import PY_WHITESPACE

    assert set(PY_WHITESPACE) == {chr(c) for c in range(0x110000) if chr(c).isspace()}


EDGE_FILES = {
    "empty": b"",
    "only-blank": b"\n\n  \n",
    "one-long-line-without-newline": b'{"text": "' + b"z" * 70_000 + b'"}',
    "long-line-in-the-middle": b'{"text": "a"}\n{"text": "' + b"z" * 200_000 + b'"}\n{"text": "b"}',
    "no-final-newline": b'{"text": "a"}\n{"text": "b"}',
    "crlf-and-blank": b'{"text": "a"}\r\n\r\n{"text": "b"}\r\n',
    "only-bad": b"x\ny\nz\n",
    "null-everywhere": b'{"text": "a", "x": null}\n{"text": "b", "x": null}\n',
    "empty-objects": b'{}\n{}\n{"text": "a"}\n',
}


@pytest.mark.parametrize("name", sorted(EDGE_FILES))
@pytest.mark.parametrize("fields", [{}, {"text_field": "x", "id_field": "text"}])
def test_edge_files_read_alike(tmp_path, name, fields):
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(EDGE_FILES[name])
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=1000, **fields)
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines", **fields)
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)


def test_an_error_while_preparing_a_block_reaches_the_reader_and_nothing_is_committed(tmp_path, monkeypatch):
    import assay.ingest.jsonl as jsonl

    path = tmp_path / "clean.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i}."}) + "\n" for i in range(3000)))
    prepare = jsonl._Block.prepare

    def failing(block):
        if block.first > 1500:
            raise RuntimeError("a bug while preparing")
        return prepare(block)

    monkeypatch.setattr(jsonl._Block, "prepare", failing)
    with pytest.raises(RuntimeError, match="a bug while preparing"):
        run_reader(path, tmp_path / "out", "arrow", jsonl_block_bytes=4096)
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_many_bad_lines_in_one_block_cost_a_few_reparses(tmp_path, monkeypatch):
    import pyarrow.json as pa_json

    import assay.ingest.jsonl as jsonl

    lines = []
    for i in range(6000):
        lines.append(json.dumps({"id": f"d{i}", "text": f"Short document number {i}."}))
        if i % 50 == 49:
            lines.append('{"id": "bad", "text": "missing the closing brace"')
    path = tmp_path / "short-lines.jsonl"
    path.write_text("\n".join(lines) + "\n")
    parsed = []
    read_json = pa_json.read_json

    def measuring(source, **kwargs):
        parsed.append(source.size())
        return read_json(source, **kwargs)

    monkeypatch.setattr(jsonl.pa_json, "read_json", measuring)
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=4 * 2**20)  # one block
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines")
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert counts["jsonl_lines_python"] == 120 and counts["quarantined"] == 120
    # 120 bad lines, each retrying the rest of the block, would parse it about 60 times.
    assert sum(parsed) < 15 * path.stat().st_size


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_any_number_of_worker_threads_gives_what_the_line_reader_gives(tmp_path, threads):
    path = write_dirty(tmp_path / "dirty.jsonl")
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines")
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=1024, jsonl_threads=threads)
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)


def test_auto_threads_go_to_a_file_only_where_a_core_would_idle():
    from assay.ingest import AUTO_JSONL_THREADS, jsonl_threads_for_run

    assert jsonl_threads_for_run("auto", units=1, max_workers=2, cores=2) == AUTO_JSONL_THREADS
    assert jsonl_threads_for_run("auto", units=2, max_workers=2, cores=2) == 0  # every core has a file
    assert jsonl_threads_for_run("auto", units=1, max_workers=1, cores=2) == 0  # one task at a time asked for
    assert jsonl_threads_for_run("auto", units=1, max_workers=4, cores=1) == 0  # one core
    assert jsonl_threads_for_run(3, units=50, max_workers=2, cores=2) == 3  # a number is taken as it is


@needs_flow
def test_the_flow_gives_one_big_file_worker_threads_and_resumes_whatever_their_number(tmp_path, monkeypatch):
    import assay.ingest

    monkeypatch.setattr(assay.ingest, "available_cores", lambda: 2)  # what CI's 2-core machine reports
    path = write_dirty(tmp_path / "dirty.jsonl")
    reference, _ = run_reader(path, tmp_path / "lines", "lines")
    params = tmp_path / "params.yaml"
    params.write_text(f"ingest:\n  max_bytes: {MAX_BYTES}\n  jsonl_block_bytes: 1024\nflow:\n  max_workers: 2\n")
    out = tmp_path / "out"
    manifest = ingest([path], out, params_file=str(params))
    assert manifest["params"]["ingest"]["jsonl_threads"] == 2
    assert read_dataset(out) == reference

    # Threads change when the work is done, not what is written: the run is up to date.
    params.write_text(f"ingest:\n  max_bytes: {MAX_BYTES}\n  jsonl_block_bytes: 1024\n  jsonl_threads: 0\n"
                      "flow:\n  max_workers: 2\n")
    assert ingest([path], out, params_file=str(params))["created_at"] == manifest["created_at"]

    # Two files on two workers keep both cores busy: none.
    second = tmp_path / "second.jsonl"
    second.write_text('{"id": "s", "text": "A second file."}\n')
    params.write_text(f"ingest:\n  max_bytes: {MAX_BYTES}\nflow:\n  max_workers: 2\n")
    assert ingest([path, second], tmp_path / "two", params_file=str(params))["params"]["ingest"]["jsonl_threads"] == 0


@pytest.mark.parametrize("value, message", [
    ("many", "ingest.jsonl_threads = 'many' should be auto or a number of threads"),
    (-1, r"ingest.jsonl_threads = -1 should be in \[0, inf\]"),
    (True, "ingest.jsonl_threads = True should be"),
    (1.5, "ingest.jsonl_threads = 1.5 should be"),
])
def test_a_jsonl_threads_setting_that_is_neither_auto_nor_a_count_names_the_key(value, message):
    from assay.config import params_from_dict

    with pytest.raises(AssayError, match=message):
        params_from_dict({"ingest": {"jsonl_threads": value}})
    with pytest.raises(AssayError, match="ingest.jsonl_parser = 'fast' should be one of arrow, lines"):
        params_from_dict({"ingest": {"jsonl_parser": "fast"}})


def test_a_negative_thread_count_is_a_clear_error():
    from assay.ingest.plan import IngestOptions

    with pytest.raises(AssayError, match="jsonl_threads must be 0 or more"):
        IngestOptions(jsonl_threads=-1)


def _random_json_value(rng, depth: int):
    """Strings full of the bytes that decide nesting: quotes, backslash runs, brackets, non-ASCII."""
    roll = rng.random()
    if depth > 7 or roll < 0.35:
        return rng.choice(['x"y', "a\\", '\\"[{', "}]", "[[[", "plain", 'q\\\\"', "\\\\\\", 1, None, 2.5, "é[ü",
                           True, '"', "{\\}"])
    if roll < 0.65:
        return [_random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "b[", 'c"', "d\\", "{"]): _random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_nesting_depths_equal_the_depth_of_the_parsed_value():
    import random

    import numpy as np

    from assay.ingest.jsonl import _depth, nesting_depths

    rng = random.Random(7)
    lines = [json.dumps({"text": _random_json_value(rng, 1), "m": _random_json_value(rng, 1)},
                        ensure_ascii=rng.random() < 0.5).encode() + b"\n" for _ in range(3000)]
    lines += [b'{"text": "' + b"\\\\" * k + b'", "d": [[1]]}\n' for k in range(6)]  # even runs end the string
    lines += [b'{"text": "a\\"]]]\\\\", "d": {"e": [{}]}}\n', b'{"text": "[{" , "d": [[[["\\\\\\""]]]]}\n']
    data = b"".join(lines)
    ends = np.cumsum([len(x) for x in lines])
    starts = ends - [len(x) for x in lines]
    want = np.array([_depth(json.loads(x)) for x in lines])
    assert want.max() >= 8 and len(set(want.tolist())) >= 6  # the sample is varied
    a = np.frombuffer(data, np.uint8)
    assert nesting_depths(a, starts, ends).tolist() == want.tolist()
    for size in (500, 40, 1):  # subsets of the lines, as a block asks: one pass over the span, or line by line
        some = np.array(sorted(rng.sample(range(len(lines)), size)))
        assert nesting_depths(a, starts[some], ends[some]).tolist() == want[some].tolist()


def test_brackets_inside_strings_do_not_send_a_line_to_python(tmp_path):
    code = "int main(void) { int a[3] = {1, 2, 3}; if (a[0]) { return a[1]; } }\n" * 60  # 300+ brackets
    records = [{"id": f"c{i}", "text": code, "path": f"src/m{i}.c"} for i in range(20)]
    records.insert(5, {"id": "deep", "text": "x", "d": json.loads("[" * 300 + "]" * 300)})
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", max_bytes=100_000)
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines", max_bytes=100_000)
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert counts["quarantined"] == 1  # the line nested 301 deep, by Python, as before
    assert counts["jsonl_lines_python"] == 1 and counts["jsonl_lines_arrow"] == 20


def test_a_line_without_nesting_bytes_has_depth_zero_whatever_follows():
    import numpy as np

    from assay.ingest.jsonl import nesting_depths

    lines = [b"plain\n", b'{"a": [{}]}\n', b"no events\n", b"\n", b"[[[\n"]
    data = b"".join(lines)
    ends = np.cumsum([len(x) for x in lines])
    starts = ends - [len(x) for x in lines]
    assert nesting_depths(np.frombuffer(data, np.uint8), starts, ends).tolist() == [0, 3, 0, 0, 3]


def test_only_lines_with_more_brackets_than_arrow_may_nest_get_their_depth_in_numpy(tmp_path, monkeypatch):
    """Up to ARROW_MAX_DEPTH brackets a line goes to Arrow, whose table type bounds its depth;
    only a line with more is measured first. A line nested between MAX_JSON_DEPTH and
    ARROW_MAX_DEPTH is found in the type and quarantined by Python; its neighbours stay with Arrow."""
    import assay.ingest.jsonl as jsonl
    from assay.ingest.jsonl import ARROW_MAX_DEPTH, MAX_JSON_DEPTH

    measured = []
    nesting_depths = jsonl.nesting_depths

    def spy(data, starts, ends, *rest):
        measured.append(len(starts))
        return nesting_depths(data, starts, ends, *rest)

    monkeypatch.setattr(jsonl, "nesting_depths", spy)
    code = "f(a[1]) { x[2] = {3}; }\n" * 100  # 400 opening brackets in a string
    assert MAX_JSON_DEPTH < code.count("[") + code.count("{") < ARROW_MAX_DEPTH
    records = [{"id": f"c{i}", "text": code, "path": f"m{i}.c"} for i in range(10)]
    records.append({"id": "many", "text": "{[" * ARROW_MAX_DEPTH})  # more brackets than Arrow may nest
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", max_bytes=100_000)
    reference, _ = run_reader(path, tmp_path / "lines", "lines", max_bytes=100_000)
    assert fast == reference and counts["jsonl_lines_arrow"] == 11
    assert measured == [1]  # the line over ARROW_MAX_DEPTH, alone

    measured.clear()
    records.insert(3, {"id": "deep", "text": "x", "d": json.loads("[" * 600 + "]" * 600)})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fast, counts = run_reader(path, tmp_path / "arrow2", "arrow", max_bytes=100_000)
    reference, ref_counts = run_reader(path, tmp_path / "lines2", "lines", max_bytes=100_000)
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert [q["path"] for q in fast["quarantine"]] == ["code.jsonl:4"]
    assert "nested deeper than" in fast["quarantine"][0]["detail"]
    assert counts["jsonl_lines_python"] == 1 and counts["jsonl_lines_arrow"] == 11
    assert measured == [1, 11]  # the line over ARROW_MAX_DEPTH; then the suspects of the table that nests too deep


def test_the_type_of_a_parsed_table_bounds_the_depth_of_its_rows():
    import random

    import pyarrow.json as pa_json

    from assay.ingest.jsonl import _depth, _row_depth

    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        record = {"text": "x", "m": _random_json_value(rng, 1), "n": _random_json_value(rng, 1)}
        try:
            table = pa_json.read_json(pa.BufferReader(json.dumps(record).encode() + b"\n"))
        except pa.ArrowInvalid:  # a list of mixed types: Python's to judge
            continue
        assert _row_depth(table.schema) == _depth(record)
        checked += 1
    assert checked > 200
    deep = json.dumps({"text": "x", "d": json.loads("[" * 900 + "]" * 900)}).encode() + b"\n"
    assert _row_depth(pa_json.read_json(pa.BufferReader(deep)).schema) == 901  # no recursion in Python


def test_blocks_are_read_into_the_buffers_of_written_blocks(tmp_path, monkeypatch):
    import assay.ingest.jsonl as jsonl

    reused = []
    recycle = jsonl._Block.recycle

    def spy(block):
        buffer = recycle(block)
        reused.append(buffer is not None)
        return buffer

    monkeypatch.setattr(jsonl._Block, "recycle", spy)
    path = write_dirty(tmp_path / "dirty.jsonl", repeat=3)
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow", jsonl_block_bytes=4096)
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines")
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert len(reused) > 10 and all(reused)


def test_a_read_buffer_that_something_still_holds_is_not_reused():
    import numpy as np

    from assay.ingest.jsonl import _Block
    from assay.ingest.plan import IngestOptions, Unit

    unit, options = Unit(kind="jsonl", source="s", path="a.jsonl"), IngestOptions()

    def block() -> _Block:
        return _Block(memoryview(bytearray(b'{"text": "a"}\n{"text": "b"}\n')), 1, unit, options, "a.jsonl", 1000)

    free = block()
    assert isinstance(free.recycle(), bytearray)
    viewed = block()
    view = np.frombuffer(viewed.data, np.uint8)
    assert viewed.recycle() is None and view.tobytes().startswith(b'{"text"')  # the view stays valid
    kept = block()
    other = kept.data.obj
    assert kept.recycle() is None and other.startswith(b'{"text"')


def test_a_missing_field_sends_a_line_to_python_only_if_it_holds_a_json_null_member(tmp_path):
    records = [{"id": f"d{i}", "text": f"if (p == null) return null; /* {i} */"} for i in range(30)]
    records[3]["extra"] = 1  # the others lack it: nulls in Arrow's column, which Python leaves out
    records[7]["extra"] = None  # a JSON null, which Python keeps
    records[12]["meta"] = {"a": None, "b": 2}
    records[13]["meta"] = {"b": 3}
    path = tmp_path / "nulls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fast, counts = run_reader(path, tmp_path / "arrow", "arrow")
    reference, ref_counts = run_reader(path, tmp_path / "lines", "lines")
    assert fast == reference and without_parser_counts(counts) == without_parser_counts(ref_counts)
    assert json.loads(fast["documents"][7]["meta"]) == {"extra": None}
    assert json.loads(fast["documents"][12]["meta"]) == {"a": None, "b": 2}
    assert counts["jsonl_lines_python"] == 2  # lines 8 and 13, not every text that says "null"


@pytest.mark.parametrize("lines", [0, 1, 2, 255, 256, 257, 600])
def test_line_ends_are_numpy_s_newlines_whether_find_or_numpy_finds_them(lines):
    import numpy as np

    from assay.ingest.jsonl import FIND_LINES, Scratch, _line_ends

    assert FIND_LINES == 256  # the parameters straddle it
    body = b"".join(b'{"text": "' + b"x" * (i % 7) + b'"}\n' for i in range(lines))
    for tail in (b"", b'{"text": "no newline"}'):
        data = body + tail
        want = (np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + 1).tolist()
        for buffer in (bytearray(data + b"\nnot in the view\n"), data + b"\nnot in the view\n"):
            view = memoryview(buffer)[:len(data)]  # a block is a view of the start of a longer buffer
            assert _line_ends(view).tolist() == want
            assert _line_ends(view, Scratch()).tolist() == want


@pytest.mark.parametrize("parser,block_bytes", [("lines", None), ("arrow", 64), ("arrow", 4 * 2**20)])
def test_a_records_own_id_given_twice_in_a_file_is_quarantined_and_the_first_keeps_it(tmp_path, parser, block_bytes):
    """Every later stage keys on the id; two documents under one id blurred both stories (`why`, decisions)."""
    lines = [{"id": "x", "text": "The first record called x."}, {"id": "y", "text": "Another record."},
             {"id": "x", "text": "A second record called x."}, {"id": 7, "text": "Seven as a number."},
             {"id": "7", "text": "Seven as text is the same id."}, {"text": "No id of its own."},
             {"text": "No id either: ids from line numbers never repeat."}]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = {} if block_bytes is None else {"jsonl_block_bytes": block_bytes}
    dataset, counts = run_reader(path, tmp_path / "out", parser, **options)
    ids = [doc["id"] for doc in dataset["documents"]]
    assert len(ids) == len(set(ids)) == 5
    assert [d["text"] for d in dataset["documents"][:3]] == [
        "The first record called x.", "Another record.", "Seven as a number."]
    bad = dataset["quarantine"]
    assert [(b["id"], b["reason"], b["path"]) for b in bad] == [
        ("x", "invalid:duplicate_id", "ids.jsonl:3"), ("7", "invalid:duplicate_id", "ids.jsonl:5")]
    assert bad[0]["detail"].startswith("line 3: id 'x' is an earlier record's")
    assert json.loads(bad[0]["raw"])["text"] == "A second record called x."  # nothing is lost
    assert counts["invalid:duplicate_id"] == 2 and counts["documents"] == 5
    dropped = [d for d in dataset["decisions"] if not d["kept"]]
    assert [(d["id"], d["reason"]) for d in dropped] == [("7", "invalid:duplicate_id"), ("x", "invalid:duplicate_id")]


def test_parquet_fields_of_other_types_go_to_meta_and_odd_ids_are_text(tmp_path):
    """A Parquet `id` of lists, structs or bytes, or a `path`/`source`/`kind` column that is not text,
    lost the rest of the file as one invalid:io record (Arrow cannot cast them to text); a JSON line
    with such values keeps them, in meta, and its id is Python's `str`."""
    texts = ["First document text.", "Second document text.", "Third document text."]
    for name, ids in {"list": pa.array([[1], [2], [1]]), "struct": pa.array([{"a": 1}, {"a": 2}, None]),
                      "bytes": pa.array([b"a", b"\xff", b"c"]), "float": pa.array([1.5, 2.0, None])}.items():
        table = pa.table({"text": texts, "id": ids, "path": [1, 2, 3], "source": [["s"], None, ["t"]],
                          "kind": pa.array([{"k": 1}, {"k": 2}, {"k": 3}]), "lang": ["en", None, "fr"]})
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path)
        dataset, counts = run_reader(path, tmp_path / f"out-{name}", "arrow")
        docs, bad = dataset["documents"], dataset["quarantine"]
        assert "invalid:io" not in counts, (name, bad)
        if name == "list":  # [1] twice: the third record's id repeats the first's
            assert [d["id"] for d in docs] == ["[1]", "[2]"]
            assert [(b["reason"], b["detail"]) for b in bad] == [
                ("invalid:duplicate_id", "list.parquet:2: id '[1]' is an earlier record's in this file, which keeps it")]
        else:
            assert len(docs) == 3 and not bad
        assert [d["path"] for d in docs] == [f"{name}.parquet:{i}" for i in range(len(docs))]
        assert {d["source"] for d in docs} == {f"{name}.parquet"}
        assert [d["lang"] for d in docs][:1] == ["en"]
        meta = json.loads(docs[0]["meta"])
        assert meta == {"path": 1, "source": ["s"], "kind": {"k": 1}}
        assert json.loads(docs[1]["meta"]) == {"path": 2, "kind": {"k": 2}}  # a null is no value
    by_name = {n: [d["id"] for d in read_dataset(tmp_path / f"out-{n}")["documents"]] for n in ("struct", "bytes", "float")}
    assert by_name["struct"][:2] == ["{'a': 1}", "{'a': 2}"]
    assert by_name["bytes"] == ["b'a'", "b'\\xff'", "b'c'"]
    assert by_name["float"] == ["1.5", "2.0", document_id("float.parquet", "row:2")]  # a null id falls back


def _ids_files(folder: Path) -> list[Path]:
    """Three files whose own ids overlap: b repeats two of a's, c one of a's and one of b's new ones."""
    folder.mkdir()
    lines = {"a.jsonl": [("1", "One from a."), ("2", "Two from a."), ("3", "Three from a.")],
             "b.jsonl": [("3", "Three again, from b."), ("4", "Four from b."), ("1", "One again, from b.")]}
    for name, records in lines.items():
        (folder / name).write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in records))
    pq.write_table(pa.table({"id": [2, 4, 5], "text": ["Two again, in c.", "Four again, in c.", "Five from c."]}),
                   folder / "c.parquet")
    return [folder / "a.jsonl", folder / "b.jsonl", folder / "c.parquet"]


def _ingest_plain(paths: list[Path], out: Path) -> dict:
    """The flow's steps without Prefect: plan, every unit, the repeated ids, the commit."""
    from assay.config import Params
    from assay.ingest import fingerprint, manifest_for, options_from_params
    from assay.ingest.plan import plan, unit_key
    from assay.ingest.readers import ingest_unit
    from assay.ingest.repeated_ids import quarantine_repeated_ids
    from assay.staging import commit, prepare

    params, sources = Params(), [str(p) for p in paths]
    options = options_from_params(params)
    units = plan(sources, options)
    prepare(out, fingerprint(units, options, params), overwrite=True)
    results = quarantine_repeated_ids(out, [ingest_unit(i, u, str(out), options) for i, u in enumerate(units)])
    return commit(out, [unit_key(i, u) for i, u in enumerate(units)],
                  manifest_for(sources, units, options, params, results, 1.0))


@needs_flow
def test_an_id_two_files_give_stays_with_the_first_file_and_the_later_record_is_quarantined(tmp_path):
    """Files are ingested in parallel, and each checked its own ids only: a.jsonl and b.jsonl
    holding id "3" each made two documents "3", which every later stage keys on."""
    manifest = ingest(_ids_files(tmp_path / "in"), tmp_path / "raw")
    docs = {d["id"]: d["text"] for d in documents(tmp_path / "raw")}
    assert docs == {"1": "One from a.", "2": "Two from a.", "3": "Three from a.", "4": "Four from b.", "5": "Five from c."}
    bad = quarantine(tmp_path / "raw")
    assert {path: (row["id"], row["reason"]) for path, row in bad.items()} == {
        "b.jsonl:1": ("3", "invalid:duplicate_id"), "b.jsonl:3": ("1", "invalid:duplicate_id"),
        "c.parquet:0": ("2", "invalid:duplicate_id"), "c.parquet:1": ("4", "invalid:duplicate_id")}
    assert bad["c.parquet:1"]["detail"] == ("c.parquet:1: id '4' is also the id of b.jsonl:2, ingested from an "
                                            "earlier SOURCE, which keeps it")
    assert json.loads(bad["b.jsonl:1"]["raw"])["text"] == "Three again, from b."  # nothing is lost
    kept = [d["id"] for d in decisions(tmp_path / "raw") if d["kept"]]
    assert sorted(kept) == ["1", "2", "3", "4", "5"]  # one story per id
    counts = manifest["counts"]
    assert (counts["documents"], counts["quarantined"], counts["by_reason"]) == (5, 4, {"invalid:duplicate_id": 4})
    assert sum(counts["by_kind"].values()) == 5
    assert read_manifest(tmp_path / "raw")["counts"] == counts


def test_a_kill_while_repeated_ids_are_moved_loses_nothing_on_the_rerun(tmp_path, monkeypatch):
    import assay.ingest.repeated_ids as repeated_ids

    paths = _ids_files(tmp_path / "in")
    reference = _ingest_plain(paths, tmp_path / "whole")
    expected = read_dataset(tmp_path / "whole")
    writers = {name: getattr(repeated_ids, name) for name in ("_replace", "atomic_write_json")}
    kill_at = 0
    while True:
        kill_at += 1
        calls = []

        def dying(write):
            def write_or_die(path, data):
                calls.append(path)
                if len(calls) == kill_at:
                    raise KeyboardInterrupt  # as a kill would, between two whole files
                write(path, data)
            return write_or_die

        out = tmp_path / f"killed-{kill_at}"
        for name, write in writers.items():
            monkeypatch.setattr(repeated_ids, name, dying(write))
        try:
            _ingest_plain(paths, out)
            finished = True
        except KeyboardInterrupt:
            finished = False
        for name, write in writers.items():
            monkeypatch.setattr(repeated_ids, name, write)
        if finished:
            break
        manifest = _ingest_plain(paths, out)  # the rerun
        assert read_dataset(out) == expected, f"killed at write {kill_at}"
        assert manifest["counts"] == {**reference["counts"], "units_resumed": 3}
    assert kill_at == 11  # killed at each of the 10 writes that settle two units (4 files and a done.json each)


def test_ids_that_only_share_a_hash_are_not_repeats(tmp_path, monkeypatch):
    import numpy as np

    import assay.ingest.repeated_ids as repeated_ids

    paths = _ids_files(tmp_path / "in")
    _ingest_plain(paths, tmp_path / "hashed")
    monkeypatch.setattr(repeated_ids, "_hashes", lambda ids: np.zeros(len(ids), np.uint64))  # every id collides
    _ingest_plain(paths, tmp_path / "colliding")
    assert read_dataset(tmp_path / "colliding") == read_dataset(tmp_path / "hashed")
    assert len(read_dataset(tmp_path / "hashed")["quarantine"]) == 4


def test_the_id_hash_reads_arrows_buffers_as_python_reads_the_strings():
    from assay.ingest.repeated_ids import _hashes

    ids = ["abc", "x", "abc", "é" * 50, "ab", "c", "abc" * 40, "b", "a"]
    chunks = pa.chunked_array([pa.array(ids[:4]), pa.array(["skipped"] + ids[4:]).slice(1), pa.array(ids[:0], pa.string())])
    hashes = _hashes(chunks).tolist()
    assert len(hashes) == len(ids)
    assert [hashes.index(h) for h in hashes] == [ids.index(i) for i in ids]  # equal exactly where the ids are


@needs_flow
def test_symlinked_directories_are_skipped_and_counted_never_walked_twice_nor_in_a_loop(tmp_path):
    """A symlinked directory vanished silently: os.walk does not descend into it, and the walk neither
    counted it nor said so. One leading out of the root is now counted as a file link leading out is;
    one inside the root is counted and not walked (its files are ingested under their own paths, so
    walking it would give each a second id, and a link to an ancestor would never end); a broken one
    is a broken link, quarantined. A root holding nothing but such links still reports them."""
    root = tmp_path / "repo"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "deep.txt").write_text("a text file deep in the tree\n")
    (root / "node_modules").mkdir()
    (root / "node_modules" / "index.js").write_text("module.exports = 1;\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("outside the root\n")
    (root / "out").symlink_to(elsewhere)                  # leaves the root
    (root / "rel-out").symlink_to("../elsewhere")         # leaves it by a relative link
    (root / "up").symlink_to(tmp_path)                    # an ancestor of the root
    (root / "pkg" / "sub" / "loop").symlink_to(root)      # the root itself: a walk that never ends
    (root / "pkg-again").symlink_to("pkg")                # inside: pkg's files a second time
    (root / "vendored").symlink_to(root / "node_modules")  # inside, into a skipped dir
    (root / "gone").symlink_to(tmp_path / "missing-dir")  # broken
    out = tmp_path / "raw"
    manifest = ingest([root], out)
    assert sorted(d["path"] for d in documents(out)) == ["pkg/mod.py", "pkg/sub/deep.txt"]
    assert {p: r["reason"] for p, r in quarantine(out).items()} == {"gone": "invalid:io"}
    assert manifest["counts"]["skipped"] == {"symlink_outside_root": 3, "symlink_dir_inside_root": 3,
                                             "skipped_dir": 1}

    only_links = tmp_path / "links"
    only_links.mkdir()
    (only_links / "data").symlink_to(elsewhere)
    manifest = ingest([only_links], tmp_path / "raw-links")
    assert manifest["counts"]["documents"] == manifest["counts"]["input_records"] == 0
    assert manifest["counts"]["skipped"] == {"symlink_outside_root": 1}


def test_a_symlinked_directory_is_counted_at_planning(tmp_path):
    from assay.ingest.plan import IngestOptions, plan, walk_directory

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f.txt").write_text("text\n")
    (root / "a" / "back").symlink_to("..")
    (root / "b").symlink_to(tmp_path)
    entries, skipped = walk_directory(root, "root", ())
    assert [e.locator for e in entries] == ["a/f.txt"]
    assert skipped == {"symlink_outside_root": 1, "symlink_dir_inside_root": 1, "symlink_file_inside_root": 0,
                       "skipped_dir": 0}
    (root / "a" / "f.txt").unlink()
    units = plan([str(root)], IngestOptions())
    assert [(u.files, u.skipped) for u in units] == [((), skipped)]


def test_an_empty_source_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    """Path("") is ".": `assay ingest "$SRC" --out ...` with SRC unset ingested every file of the cwd."""
    from assay.ingest.plan import IngestOptions, plan
    from flows.ingest import run_ingest

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a document\n")
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    monkeypatch.chdir(tmp_path)
    for spec in ("", "  ", "\t"):
        with pytest.raises(AssayError, match=re.escape(f"SOURCE is empty: {spec!r} ")):
            plan([spec], IngestOptions())
        # Refused before Prefect starts (no prefect_harness here), like a missing SOURCE.
        with pytest.raises(AssayError, match="SOURCE is empty"):
            run_ingest(["corpus", spec], str(tmp_path / "raw"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "notes.txt"]


# ------------------------------------------------------------ man pages, and a command stopped politely


def _fake_man(tmp_path: Path, monkeypatch, body: str) -> None:
    """Put a shell script named `man` first on PATH, where _render_man looks it up."""
    folder = tmp_path / "fake-bin"
    folder.mkdir(exist_ok=True)
    script = folder / "man"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def _man_unit(tmp_path: Path):
    from assay.ingest.plan import FileEntry, Unit

    page = tmp_path / "page.1"
    page.write_text(".TH PAGE 1\n")
    return Unit("files", "man", files=(FileEntry(str(page), "man", "man1/page.1", render="man"),))


def test_man_runs_in_a_session_of_its_own_so_the_commands_signals_do_not_reach_it(tmp_path, monkeypatch):
    """Ctrl-C, `timeout` and systemd signal the whole process group: man, there, died with the command
    and its death was stored as the page's verdict (invalid:io), which the rerun then kept."""
    from assay.ingest.readers import read_entry

    _fake_man(tmp_path, monkeypatch, "cat /proc/$$/stat")
    entry = _man_unit(tmp_path).files[0]
    stat = read_entry(entry, 10**6).decode()
    pid, rest = stat.split(" ", 1)
    session = int(rest.rsplit(")", 1)[1].split()[3])  # fields after the name: state ppid pgrp session
    assert session != os.getsid(0)
    assert session == int(pid)  # man leads its own session (and so its own process group)


def test_a_man_killed_by_a_signal_fails_the_unit_and_the_rerun_renders_the_page(tmp_path, monkeypatch):
    from assay.ingest.plan import IngestOptions, unit_key
    from assay.ingest.readers import RenderStopped, ingest_unit
    from assay.staging import finished_unit

    unit, out = _man_unit(tmp_path), str(tmp_path / "raw")
    _fake_man(tmp_path, monkeypatch, "kill -TERM $$")
    with pytest.raises(RenderStopped, match=r"man was killed by SIGTERM while rendering .*page\.1.*rerun to resume"):
        ingest_unit(0, unit, out, IngestOptions())
    assert finished_unit(out, unit_key(0, unit)) is None  # no verdict was kept: the unit is not done

    _fake_man(tmp_path, monkeypatch, "echo 'PAGE(1)  the rendered page'")
    result = ingest_unit(0, unit, out, IngestOptions())
    assert not result.skipped and result.counts.get("documents") == 1 and "invalid:io" not in result.counts


def test_a_man_that_times_out_fails_the_unit_and_leaves_no_process(tmp_path, monkeypatch):
    """A loaded machine can hit the timeout: that is no property of the file, so no verdict either."""
    import psutil

    from assay.ingest import readers
    from assay.ingest.plan import IngestOptions, unit_key
    from assay.staging import finished_unit

    unit, out, child = _man_unit(tmp_path), str(tmp_path / "raw"), tmp_path / "child.pid"
    # The sleep is man's child, as groff is: the kill must take man's whole process group.
    _fake_man(tmp_path, monkeypatch, f"sleep 60 & echo $! > {child}; wait")
    monkeypatch.setattr(readers, "MAN_TIMEOUT_S", 1)
    with pytest.raises(readers.RenderStopped, match=r"did not render .*page\.1 within 1 s.*rerun to resume"):
        readers.ingest_unit(0, unit, out, IngestOptions())
    assert finished_unit(out, unit_key(0, unit)) is None
    pid = int(child.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "man's child outlived the timeout"
        time.sleep(0.05)


def test_a_page_man_rejects_is_still_the_files_invalid_io_verdict(tmp_path, monkeypatch):
    from assay.ingest.plan import IngestOptions, unit_key
    from assay.ingest.readers import ingest_unit
    from assay.staging import QUARANTINE, finished_unit, staging_dir

    unit, out = _man_unit(tmp_path), str(tmp_path / "raw")
    _fake_man(tmp_path, monkeypatch, "echo 'man: cannot parse page.1' >&2; exit 1")
    result = ingest_unit(0, unit, out, IngestOptions())
    assert result.counts["invalid:io"] == 1 and finished_unit(out, unit_key(0, unit)) is not None
    folder = staging_dir(out) / unit_key(0, unit)
    [row] = pa.concat_tables([pq.read_table(folder / name) for name in result.files[QUARANTINE]]).to_pylist()
    assert (row["path"], row["reason"]) == ("man1/page.1", "invalid:io")
    assert row["detail"] == "OSError: man exited 1: man: cannot parse page.1"
