"""Hostile input, generated: ingest and every filter take whatever hypothesis throws at them.

The requirements (issue 13, section 2): no crash, every record accounted for, and each
error names its record. The hand-picked dirty lines in test_ingest.py say what each kind
of bad line becomes; here hypothesis mixes them with random bytes, deep nesting, huge
lines, NUL, lone surrogates, BOMs, CRLF and legacy encodings, in random orders, and both
JSONL parsers (Python's line by line and Arrow's blocks) must agree record for record.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from assay.schema import DOCUMENT_SCHEMA
from test_ingest import MAX_BYTES, dirty_lines, run_reader

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


# ------------------------------------------------------------------------- lines
def _record(text: str, **extra) -> bytes:
    return json.dumps({"text": text, **extra}).encode()


def _nested(depth: int) -> bytes:
    return ('{"text": "deep", "d": ' + "[" * depth + "1" + "]" * depth + "}").encode()


hostile_text = st.one_of(
    st.text(max_size=200),  # any code point but surrogates
    st.text(alphabet=st.characters(categories=["Zs", "Cc", "Cf", "Zl", "Zp"]), max_size=50),  # whitespace and controls
    st.text(alphabet=st.characters(categories=["Po", "Ps", "Pe", "Sm", "So"]), max_size=50),  # only punctuation/symbols
    st.builds(lambda c, n: c * n, st.characters(), st.integers(1, 3 * MAX_BYTES)),  # one character, many times
)

line = st.one_of(
    hostile_text.map(_record),  # a record with hostile text
    hostile_text.map(lambda t: json.dumps({"text": t}, ensure_ascii=False).encode()),  # raw UTF-8 in the line
    hostile_text.map(lambda t: b"\xef\xbb\xbf" + _record(t)),  # a byte-order mark
    hostile_text.map(lambda t: _record(t) + b"\r"),  # CRLF
    st.text(alphabet="abcé ", min_size=1, max_size=40).map(  # a legacy encoding
        lambda t: json.dumps({"text": t}, ensure_ascii=False).encode("latin-1")),
    st.integers(0xD800, 0xDFFF).map(lambda c: b'{"text": "lone \\u%04x"}' % c),  # a lone surrogate escape
    st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")),  # random bytes (the reader splits on \n)
    st.integers(1, 3000).map(_nested),  # deeply nested JSON
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                 lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),  # any JSON value, text field or not
    st.sampled_from(dirty_lines()),  # every hand-picked kind
)


@FUZZ
@given(lines=st.lists(line, min_size=1, max_size=40))
def test_any_jsonl_is_accounted_for_line_by_line_and_both_parsers_agree(tmp_path_factory, lines):
    root = tmp_path_factory.mktemp("fuzz")
    path = root / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    reference, ref_counts = run_reader(path, root / "lines", "lines")
    fast, counts = run_reader(path, root / "arrow", "arrow", jsonl_block_bytes=512)

    # Every line is a document, a quarantined record or a blank line: nothing vanishes.
    n_docs, n_bad = len(reference["documents"]), len(reference["quarantine"])
    assert n_docs + n_bad + ref_counts.get("blank_lines", 0) == len(lines)
    # Each quarantined record names its line, in its locator and in its message.
    for bad in reference["quarantine"]:
        number = int(bad["path"].rsplit(":", 1)[1])
        assert 1 <= number <= len(lines)
        assert f"line {number}" in bad["detail"], bad
        assert bad["reason"].startswith("invalid:")
    # Whatever was kept is valid UTF-8 text with no NUL, as the document schema promises.
    for doc in reference["documents"]:
        assert "\x00" not in doc["text"] and doc["text"].strip()
        doc["text"].encode("utf-8")
    # The fast parser changes nothing a reader can see.
    assert fast["documents"] == reference["documents"]
    assert fast["quarantine"] == reference["quarantine"]
    assert fast["decisions"] == reference["decisions"]


@FUZZ
@given(files=st.lists(st.binary(max_size=2000), min_size=1, max_size=12))
def test_any_bytes_in_a_directory_are_a_document_or_a_quarantined_file(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("tree")
    tree = root / "in"
    tree.mkdir()
    for i, data in enumerate(files):
        (tree / f"f{i:02d}.txt").write_bytes(data)
    dataset, counts = run_reader(tree, root / "out", "lines")
    kept = {Path(d["path"]).name for d in dataset["documents"]}
    quarantined = {Path(q["path"]).name for q in dataset["quarantine"]}
    assert not kept & quarantined
    assert kept | quarantined == {f"f{i:02d}.txt" for i in range(len(files))}
    for q in dataset["quarantine"]:
        assert q["reason"].startswith("invalid:") and q["detail"]


# ----------------------------------------------------------------------- filters
def _every_script_sample() -> str:
    """One letter of every script Unicode assigns a name to, found through the names."""
    scripts: dict[str, str] = {}
    for cp in range(0x80, 0x30000):
        ch = chr(cp)
        if unicodedata.category(ch) not in ("Lo", "Lu", "Ll"):
            continue
        name = unicodedata.name(ch, "")
        script = name.split(" ")[0]
        scripts.setdefault(script, ch)
    return " ".join(scripts.values())


EDGE_TEXTS = [
    "",
    "x" * 200_000,  # one huge word
    " \n\t\u3000\u00a0 " * 50,  # only whitespace
    "!?.,;:—…" * 500,  # only punctuation
    "a" * (10 * 2**20),  # 10 MB of one character
    _every_script_sample(),
    "\ufeff" + "line\r\n" * 100,
    "\x00\x01\x02" * 10,
    "word " * 20_000,
    "\n" * 10_000,
]


def _batch(texts: list[str], kind: str, lang: str) -> pa.RecordBatch:
    n = len(texts)
    columns = {
        "id": [f"d{i}" for i in range(n)], "text": texts, "kind": [kind] * n, "lang": [lang] * n,
        "source": ["fuzz"] * n, "path": [f"f{i}.{'py' if kind == 'code' else 'txt'}" for i in range(n)],
    }
    arrays = [pa.array(columns[f.name], f.type) if f.name in columns else pa.nulls(n, f.type)
              for f in DOCUMENT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=DOCUMENT_SCHEMA)


def _check(result, n: int, prefix: str) -> None:
    assert len(result.keep) == n and len(result.reason) == n
    for keep, reason in zip(result.keep.tolist(), result.reason):
        assert keep == (reason is None)
        assert reason is None or reason.startswith(prefix + ":")
    for name, values in result.scores.items():
        assert len(values) == n, name


def _text_filters():
    from filters.heuristics import build_heuristics

    return build_heuristics()


def _code_filters():
    from filters.code_rules import CodeRulesFilter
    from filters.code_syntax import SyntaxFilter

    return [CodeRulesFilter(), SyntaxFilter()]


@pytest.mark.parametrize("kind,lang,filters", [("text", "en", _text_filters), ("code", "python", _code_filters),
                                               ("code", "javascript", _code_filters)])
def test_every_filter_takes_the_edge_texts(kind, lang, filters):
    batch = _batch(EDGE_TEXTS, kind, lang)
    for f in filters():
        _check(f.apply(batch), batch.num_rows, f.name)


@FUZZ
@given(texts=st.lists(hostile_text, min_size=1, max_size=20))
def test_every_filter_takes_any_text(texts):
    for kind, lang, filters in (("text", "en", _text_filters), ("code", "python", _code_filters)):
        batch = _batch(texts, kind, lang)
        for f in filters():
            _check(f.apply(batch), batch.num_rows, f.name)


@FUZZ
@given(texts=st.lists(hostile_text, min_size=1, max_size=20))
def test_dedup_keys_take_any_text(texts):
    from filters.exact_dedup import normalize_code, normalize_text
    from filters.minhash import shingles, signatures_from_shingles

    array = pa.array(texts, pa.string())
    assert len(normalize_text(array)) == len(texts)
    assert len(normalize_code(array)) == len(texts)
    hashes, offsets = shingles(array)
    signatures = signatures_from_shingles(hashes, offsets)
    assert len(signatures) == len(texts)
    assert np.all(np.isfinite(signatures.astype(np.float64)))


def test_edge_texts_through_dedup_keys():
    from filters.minhash import shingles, signatures_from_shingles

    hashes, offsets = shingles(pa.array(EDGE_TEXTS, pa.string()))
    assert len(signatures_from_shingles(hashes, offsets)) == len(EDGE_TEXTS)


@pytest.mark.parametrize("parser", ["lines", "arrow"])
def test_json_nested_past_the_limit_is_quarantined_not_a_crash(tmp_path, parser):
    from assay.ingest.jsonl import MAX_JSON_DEPTH

    path = tmp_path / "deep.jsonl"
    lines = [_nested(MAX_JSON_DEPTH - 2), _nested(MAX_JSON_DEPTH + 5), _nested(5000), _record("fine"),
             b'{"text": "brackets in a string are not depth", "s": "' + b"[" * 500 + b'"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    dataset, _ = run_reader(path, tmp_path / "out", parser)
    bad = {int(q["path"].rsplit(":", 1)[1]): q for q in dataset["quarantine"]}
    assert sorted(bad) == [2, 3]
    assert all(q["reason"] == "invalid:json" and "nested deeper than" in q["detail"] for q in bad.values())
    assert len(dataset["documents"]) == 3


# ------------------------------------------------- damaged shards as a stage's input
def _damaged_dataset(root: Path, damage: str) -> Path:
    """A two-shard dataset whose second shard is damaged in one way."""
    import pyarrow.parquet as pq

    from corpus import write_documents

    folder = write_documents(root / "data", [(f"d{i}.txt", f"document number {i} " * 20) for i in range(6)])
    shards = sorted(folder.glob("part-*.parquet"))
    second = folder / "part-00001.parquet"
    if len(shards) < 2:
        second.write_bytes(shards[0].read_bytes())
    if damage == "footer":
        data = second.read_bytes()
        second.write_bytes(data[: len(data) - 12])  # the footer's length and magic are gone
    elif damage == "schema":
        pq.write_table(pa.table({"id": ["x"], "text": [5]}), second)  # text is a number
    elif damage == "missing":
        pq.write_table(pa.table({"id": ["x"], "body": ["no text column"]}), second)
    return folder


@pytest.mark.parametrize("damage,message", [("footer", "not a readable Parquet shard"),
                                            ("schema", "column 'text' is int64"),
                                            ("missing", "no column 'text'")])
def test_a_damaged_input_shard_is_an_error_that_names_it(tmp_path, damage, message):
    from assay.config import DedupParams
    from assay.errors import AssayError
    from assay.shards import iter_batches
    from assay.stages.dedup import scan_shard
    from assay.versions import open_version

    folder = _damaged_dataset(tmp_path, damage)
    shard = str(folder / "part-00001.parquet")
    with pytest.raises(AssayError, match=f"part-00001.parquet.*{message}"):
        for _ in open_version(folder).iter_batches(columns=["id", "text"]):  # what training reads
            pass
    with pytest.raises(AssayError, match=f"part-00001.parquet.*{message}"):
        scan_shard(shard, DedupParams(), 64)  # what dedup reads
    if damage == "footer":  # iter_batches is schema-free (it also reads decisions and telemetry)
        with pytest.raises(AssayError, match="part-00001.parquet.*not a readable Parquet shard"):
            list(iter_batches(folder))


def test_training_on_a_damaged_shard_stops_with_the_shards_name(tmp_path):
    from assay.config import params_from_dict
    from assay.errors import AssayError
    from assay.versions import open_version
    from training.trainer import train

    folder = _damaged_dataset(tmp_path, "schema")
    params = params_from_dict({"train": {"model": {"dim": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32},
                                         "vocab_size": 300, "seq_len": 16, "batch_size": 2, "steps": 1,
                                         "device": "cpu"}}).train
    with pytest.raises(AssayError, match="part-00001.parquet: column 'text' is int64"):
        train(open_version(folder), tmp_path / "run", params)


def test_a_gzip_bomb_streams_in_bounded_memory(tmp_path):
    """512 MiB of one unbroken line in 0.5 MB of .jsonl.gz: quarantined as too long, and the
    reader's peak memory stays far below the decompressed size (measured, in a child process)."""
    import subprocess
    import sys
    import zlib

    bomb = tmp_path / "bomb.jsonl.gz"
    pack = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(bomb, "wb") as handle:
        handle.write(pack.compress(b'{"text": "before the bomb"}\n'))
        chunk = b"a" * (1 << 24)
        for _ in range(32):
            handle.write(pack.compress(chunk))
        handle.write(pack.compress(b'\n{"text": "after the bomb"}\n') + pack.flush())
    script = (
        "import json, sys; from pathlib import Path\n"
        "from test_ingest import run_reader\n"
        f"data, counts = run_reader(Path({str(bomb)!r}), Path({str(tmp_path / 'out')!r}), 'arrow')\n"
        # VmHWM, not ru_maxrss: Linux carries the parent's peak into ru_maxrss across exec.
        "hwm_kb = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(json.dumps({'docs': [d['text'] for d in data['documents']],\n"
        "                  'bad': [(q['path'], q['reason']) for q in data['quarantine']],\n"
        "                  'peak_mb': hwm_kb / 1024}))\n"
    )
    tests = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=tests, env={**os.environ, "PYTHONPATH": tests})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["docs"] == ["before the bomb", "after the bomb"]
    assert result["bad"] == [["bomb.jsonl.gz:2", "invalid:too_large"]]
    assert result["peak_mb"] < 400, result  # the decompressed line alone is 512 MiB


def test_a_wrong_path_is_named_for_what_it_is(tmp_path):
    """A file given where a dataset goes was "no such dataset directory" (stats, show, why) or "is not
    a directory" for a missing one (train --data); a directory given as --labels was "no such labels
    file". Each now says what the path is."""
    from assay.errors import AssayError
    from assay.quality.train import labelled_examples
    from assay.shards import require_dataset
    from assay.versions import open_version

    (tmp_path / "f.txt").write_text("text\n")
    for check in (require_dataset, open_version):
        with pytest.raises(AssayError, match="f.txt: a file, not a dataset directory"):
            check(tmp_path / "f.txt")
        with pytest.raises(AssayError, match="nope: no such dataset directory"):
            check(tmp_path / "nope")
    with pytest.raises(AssayError, match="a directory, not a labels file"):
        labelled_examples(tmp_path, None)
