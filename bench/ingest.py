"""Ingest throughput on the demo corpus, side by side with the tools a user would otherwise pick.

    python bench/ingest.py [--repeat-jsonl 20]

1. `demo`: the demo corpus from this installation (files on disk, man pages
   rendered by `man`), through our reader without Prefect, and the same with
   the Prefect flow to show the orchestration overhead.
2. `jsonl`: the demo documents written to one JSONL file (repeated to a few
   hundred MB) and ingested to zstd Parquet shards by
   - ours (`assay.ingest.readers`, one task),
   - datatrove's JsonlReader → ParquetWriter,
   - Hugging Face `datasets.load_dataset("json")` + `to_parquet`.
Everything runs in one process, one after the other, single-threaded tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from assay.config import load_params  # noqa: E402
from assay.ingest import fingerprint, manifest_for, options_from_params  # noqa: E402
from assay.ingest.plan import plan, unit_key  # noqa: E402
from assay.ingest.readers import ingest_unit  # noqa: E402
from assay.shards import iter_batches  # noqa: E402
from assay.staging import commit, prepare  # noqa: E402


def run_plain(sources, out, params):
    options = options_from_params(params)
    started = time.perf_counter()
    units = plan(sources, options, demo_params=params.demo)
    prepare(out, fingerprint(units, options, params), overwrite=True)
    results = [ingest_unit(i, u, str(out), options) for i, u in enumerate(units)]
    manifest = manifest_for(sources, units, options, params, results, time.perf_counter() - started)
    commit(out, [unit_key(i, u) for i, u in enumerate(units)], manifest)
    return time.perf_counter() - started, manifest["counts"]


def row(name, seconds, docs, nbytes):
    return f"| {name} | {docs:,} | {nbytes / 2**20:,.1f} | {seconds:.2f} | {docs / seconds:,.0f} | {nbytes / 2**20 / seconds:,.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat-jsonl", type=int, default=20, help="copies of the demo documents in the JSONL file")
    parser.add_argument("--skip-flow", action="store_true", help="skip the Prefect flow run")
    args = parser.parse_args()
    params = load_params()
    work = Path(tempfile.mkdtemp(prefix="assay-bench-"))
    lines = ["| run | documents | MB in | seconds | docs/s | MB/s |", "|---|---:|---:|---:|---:|---:|"]
    try:
        seconds, counts = run_plain(["demo"], work / "demo", params)
        lines.append(row("demo corpus, assay reader (no Prefect)", seconds, counts["input_records"], counts["bytes_in"]))
        if not args.skip_flow:
            from flows.ingest import ingest_flow

            started = time.perf_counter()
            manifest = ingest_flow(["demo"], str(work / "demo-flow"))
            seconds = time.perf_counter() - started
            c = manifest["counts"]
            lines.append(row("demo corpus, assay Prefect flow (2 threads, incl. server start)", seconds, c["input_records"], c["bytes_in"]))

        # One JSONL file of the demo documents, repeated.
        jsonl = work / "docs.jsonl"
        docs = [r for b in iter_batches(work / "demo", columns=["id", "text", "source", "path"]) for r in b.to_pylist()]
        with open(jsonl, "w") as handle:
            for copy in range(args.repeat_jsonl):
                for doc in docs:
                    handle.write(json.dumps({**doc, "id": f"{doc['id']}-{copy}"}) + "\n")
        size, n = jsonl.stat().st_size, len(docs) * args.repeat_jsonl

        seconds, counts = run_plain([str(jsonl)], work / "jsonl-ours", params)
        assert counts["documents"] == n, counts
        lines.append(row("JSONL → Parquet, assay", seconds, n, size))

        try:
            from datatrove.pipeline.readers import JsonlReader
            from datatrove.pipeline.writers import ParquetWriter

            started = time.perf_counter()
            reader = JsonlReader(str(work), glob_pattern="docs.jsonl", text_key="text", id_key="id")
            writer = ParquetWriter(str(work / "jsonl-datatrove"), compression="zstd")
            seen = 0

            def counted(docs):
                nonlocal seen
                for doc in docs:
                    seen += 1
                    yield doc

            for _ in writer.run(counted(reader.run(None, rank=0, world_size=1)), rank=0, world_size=1):
                pass
            assert seen == n, f"datatrove read {seen} of {n} documents"
            lines.append(row("JSONL → Parquet, datatrove JsonlReader + ParquetWriter", time.perf_counter() - started, n, size))
        except ImportError:
            lines.append("| datatrove | not installed | | | | |")

        import datasets

        datasets.disable_progress_bars()
        started = time.perf_counter()
        ds = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(work / "hf-cache"))
        ds.to_parquet(str(work / "jsonl-hf.parquet"))  # its writer fixes the codec (snappy)
        lines.append(row("JSONL → Parquet, datasets.load_dataset('json') + to_parquet (snappy)", time.perf_counter() - started, n, size))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
