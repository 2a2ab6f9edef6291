import os
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.schema import DOCUMENT_SCHEMA
from assay.shards import (
    ShardWriter,
    atomic_write_json,
    count_rows,
    iter_batches,
    list_shards,
    read_manifest,
    remove_temporaries,
)


def _docs(n, start=0, size=100):
    return pa.table(
        {
            "id": [f"d{i}" for i in range(start, start + n)],
            "text": ["x" * size] * n,
            "kind": ["text"] * n,
            "lang": ["en"] * n,
            "source": ["s"] * n,
            "path": [str(i) for i in range(start, start + n)],
            "meta": ["{}"] * n,
        },
        schema=DOCUMENT_SCHEMA,
    )


def test_writer_rolls_shards_by_size_and_reads_back_in_order(tmp_path):
    with ShardWriter(tmp_path, DOCUMENT_SCHEMA, target_bytes=200_000) as writer:
        for start in range(0, 5000, 500):
            writer.write(_docs(500, start, size=200))
    shards = list_shards(tmp_path)
    assert len(shards) > 1
    assert [s.name for s in shards] == [f"part-{i:05d}.parquet" for i in range(len(shards))]
    assert all(pq.ParquetFile(s).metadata.row_group(0).column(1).compression == "ZSTD" for s in shards)
    ids = [i for b in iter_batches(tmp_path, columns=["id"], batch_size=333) for i in b.column("id").to_pylist()]
    assert ids == [f"d{i}" for i in range(5000)]
    assert count_rows(tmp_path) == 5000


def test_streaming_read_yields_bounded_batches(tmp_path):
    with ShardWriter(tmp_path, DOCUMENT_SCHEMA) as writer:
        writer.write(_docs(3000))
    sizes = [b.num_rows for b in iter_batches(tmp_path, batch_size=256)]
    assert max(sizes) <= 256 and sum(sizes) == 3000


def test_filter_ids(tmp_path):
    with ShardWriter(tmp_path, DOCUMENT_SCHEMA) as writer:
        writer.write(_docs(100))
    found = [b.column("path").to_pylist() for b in iter_batches(tmp_path, filter_ids=["d7", "d42", "nope"])]
    assert sum(found, []) == ["7", "42"]


def test_aborted_writer_leaves_no_shard(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, DOCUMENT_SCHEMA) as writer:
            writer.write(_docs(5000))
            raise RuntimeError("boom")
    assert list_shards(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_killed_writer_leaves_no_partial_shard(tmp_path):
    """SIGKILL a real writer process mid-shard: only whole shards are visible."""
    script = textwrap.dedent(
        f"""
        import sys, time, pyarrow as pa
        sys.path.insert(0, {str(os.getcwd())!r})
        from assay.shards import ShardWriter
        from assay.schema import DOCUMENT_SCHEMA
        w = ShardWriter({str(tmp_path)!r}, DOCUMENT_SCHEMA, target_bytes=3_000_000)
        i = 0
        while True:
            n = 2048
            w.write(pa.table({{"id": [f"d{{j}}" for j in range(i, i+n)], "text": ["y" * 500] * n,
                "kind": ["text"] * n, "lang": ["en"] * n, "source": ["s"] * n,
                "path": [""] * n, "meta": ["{{}}"] * n}}, schema=DOCUMENT_SCHEMA))
            i += n
            if i >= 7 * n and i % (3 * n) == n:  # two shards closed, a third open
                print("ready", flush=True)
                time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"  # some shards closed, one open
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden, "the open shard should exist only under a temporary name"
    shards = list_shards(tmp_path)
    assert shards
    for shard in shards:  # every visible shard is whole and readable
        assert pq.read_table(shard).num_rows > 0
    assert remove_temporaries(tmp_path) == len(hidden)
    assert sorted(tmp_path.iterdir()) == shards


def test_manifest_is_written_atomically(tmp_path):
    atomic_write_json(tmp_path / "manifest.json", {"a": 1})
    assert read_manifest(tmp_path) == {"a": 1}
    assert oct((tmp_path / "manifest.json").stat().st_mode & 0o777) != oct(0o600)
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_text_is_written_without_a_dictionary_and_other_columns_keep_theirs(tmp_path):
    from assay.schema import DECISION_SCHEMA

    docs = _docs(3000, size=2000)
    with ShardWriter(tmp_path / "docs", DOCUMENT_SCHEMA) as writer:
        writer.write(docs)
    decisions = pa.table({"id": ["a", "b"], "stage": ["s", "s"], "kept": [True, False], "reason": [None, "r"],
                          "scores": [[("x", 1.0)], None], "detail": [None, "d"]}, schema=DECISION_SCHEMA)
    with ShardWriter(tmp_path / "decisions", DECISION_SCHEMA) as writer:
        writer.write(decisions)
    for folder, plain in (("docs", {"text"}), ("decisions", set())):
        shard = list_shards(tmp_path / folder)[0]
        meta = pq.ParquetFile(shard).metadata
        for g in range(meta.num_row_groups):
            for i in range(meta.num_columns):
                column = meta.row_group(g).column(i)
                if column.physical_type != "BOOLEAN":  # Parquet has no dictionary for booleans
                    assert column.has_dictionary_page == (column.path_in_schema not in plain), column.path_in_schema
    assert pq.read_table(list_shards(tmp_path / "docs")[0]).equals(docs)
    assert pq.read_table(list_shards(tmp_path / "decisions")[0]).equals(decisions)
