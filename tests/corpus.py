"""Test corpora built from scratch: bad input of every kind, JSON lines."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

LATIN1_TEXT = "Café crème, naïve façade: le garçon était très content de la crème brûlée et du pâté."


def make_bad_corpus(root: Path) -> dict[str, Path]:
    """The issue's acceptance corpus: one good file of each kind, and every kind of bad input."""
    tree = root / "corpus"
    (tree / "src").mkdir(parents=True)
    (tree / "docs").mkdir()
    (tree / "src" / "app.py").write_text("def add(a, b):\n    return a + b\n")
    (tree / "src" / "main.rs").write_text('fn main() {\n    println!("hi");\n}\n')
    (tree / "docs" / "guide.md").write_text("# Guide\n\nThis is the guide to the tool, and it is short.\n")
    (tree / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    (tree / "latin1.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (tree / "empty.txt").write_bytes(b"")
    (tree / "blank.txt").write_bytes(b"  \n\t\n")
    with open(tree / "huge.txt", "wb") as handle:  # 50 MB, over the 10 MB default
        chunk = b"all work and no play makes jack a dull boy\n" * 1000
        while handle.tell() < 50 * 2**20:
            handle.write(chunk)
    jsonl = root / "records.jsonl"
    lines = [
        json.dumps({"id": "r1", "text": "The first record is fine and has some words in it."}),
        '{"id": "r2", "text": "missing the closing brace"',
        json.dumps({"text": "A record without an id gets one from its source and line.", "kind": "text", "topic": "ids"}),
        "this line is not JSON at all",
        json.dumps({"id": "r5", "text": "def f():\n    return 1\n", "path": "pkg/f.py", "meta": {"stars": 3}}),
        "",
        json.dumps({"id": "r6", "text": "   "}),
        json.dumps({"id": "r7", "body": "no text field"}),
    ]
    jsonl.write_text("\n".join(lines) + "\n")
    return {"tree": tree, "jsonl": jsonl}


def write_jsonl_gz(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def write_documents(directory: Path, docs: list[tuple[str, str]], source: str = "tests",
                    target_bytes: int | None = None) -> Path:
    """A dataset directory (DOCUMENT_SCHEMA shards) holding ``(locator, text)`` documents
    (with `target_bytes`, one shard for every batch of that many bytes)."""
    import pyarrow as pa

    from assay.schema import DOCUMENT_SCHEMA, document_id
    from assay.shards import ShardWriter

    columns = {
        "id": [document_id(source, loc) for loc, _ in docs],
        "text": [text for _, text in docs],
        "kind": ["text"] * len(docs),
        "lang": ["en"] * len(docs),
        "source": [source] * len(docs),
        "path": [loc for loc, _ in docs],
        "meta": ["{}"] * len(docs),
    }
    table = pa.Table.from_pydict(columns, schema=DOCUMENT_SCHEMA)
    with ShardWriter(directory, DOCUMENT_SCHEMA, **({"target_bytes": target_bytes} if target_bytes else {})) as writer:
        for batch in table.to_batches(max_chunksize=1 if target_bytes else None):
            writer.write(batch)
    return directory


def stdlib_documents(n: int, offset: int = 0) -> list[tuple[str, str]]:
    """Real text to train on: the first n (sorted) standard-library modules."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[offset:offset + n]
    return [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def tiny_pipeline_params(params_file: Path) -> dict:
    """The project's params.yaml shrunk so the whole `dvc repro` chain runs in minutes on 2 cores:
    a small demo corpus, a one-layer domain model and a one-layer decoder for 6 steps."""
    import yaml

    params = yaml.safe_load(Path(params_file).read_text())
    params["demo"].update(stdlib_files=25, package_files=15, package_metadata=10, man_pages=6, pydoc_topics=8,
                          package_records=10, entry_points=5, doc_readmes=10, doc_news=5, doc_changelogs=5,
                          debian_changelogs=5, doc_copyright=5, dpkg_manifests=10, logs=3)
    params["domain"]["train"].update(n_layer=1, n_head=2, n_embd=32, context=64, steps=20, vocab_size=1000)
    params["domain"]["model"]["window"] = 64
    params["train"].update(vocab_size=300, seq_len=32, batch_size=4, steps=6, checkpoint_every=3, eval_rows=16,
                           warmup_steps=2)
    params["train"]["model"].update(dim=32, n_layers=1, n_heads=2, ffn_hidden=64)
    return params

