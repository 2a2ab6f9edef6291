"""Ingest throughput on the demo corpus, side by side with the tools a user would otherwise pick.

    python bench/ingest.py [--repeat-jsonl 20] [--repeats 3] [--skip-flow]

1. `demo`: the demo corpus from this installation (files on disk, man pages
   rendered by `man`), through our reader without Prefect, and the same with
   the Prefect flow to show the orchestration overhead.
2. `jsonl`: the demo documents written to one JSONL file (repeated to a few
   hundred MB) and ingested to Parquet by
   - ours with Arrow blocks (the default) and with the line-by-line reference,
   - datatrove's JsonlReader → ParquetWriter (zstd),
   - Hugging Face `datasets.load_dataset("json")` + `to_parquet` (snappy),
   - and a floor: Arrow's JSON parser on the same 4 MiB blocks and our Parquet
     writer, with nothing else (no checks, ids, meta, kind/language, decisions).
   The tools take turns, `--repeats` rounds in a rotating order, and the
   median of each is reported with its ratio to `datasets`, in wall-clock
   seconds and in CPU seconds of the process (all threads): on a shared
   machine the wall clock depends on the neighbours, CPU time much less.
   What each side writes: ours, zstd Parquet document shards plus a
   decisions table (one row per input line), a quarantine table and a
   manifest, with every line checked (UTF-8, JSON, text present, non-empty,
   size, NUL) and kind and language detected; datatrove, zstd Parquet of its
   Document objects; `datasets`, its Arrow cache (uncompressed) and then one
   snappy Parquet file. All read the same file from disk.
3. `dirty`: the same file with one bad line in every 100 (malformed JSON,
   invalid UTF-8, NUL bytes, a non-object, a missing text field, an empty
   text), through every tool once: what each keeps and what it loses; the
   run fails unless both of our readers quarantine exactly the injected lines.
Everything runs in one process. Ours runs on the reading thread alone
(`jsonl_threads: 0`, what `auto` gives a run with a file for every core), and
with one and two worker threads that parse and check blocks while the reading
thread writes (`jsonl_threads: 2` is what `auto` gives a run of one file on
two or more cores, as here); `datasets` parses on Arrow's
thread pool; datatrove runs on one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
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
from assay.ingest.repeated_ids import quarantine_repeated_ids  # noqa: E402
from assay.shards import iter_batches  # noqa: E402
from assay.staging import commit, prepare  # noqa: E402


def run_plain(sources, out, params, **overrides):
    options = dataclasses.replace(options_from_params(params), **overrides)
    started = time.perf_counter()
    units = plan(sources, options, demo_params=params.demo)
    prepare(out, fingerprint(units, options, params), overwrite=True)
    results = quarantine_repeated_ids(out, [ingest_unit(i, u, str(out), options) for i, u in enumerate(units)])
    manifest = manifest_for(sources, units, options, params, results, time.perf_counter() - started)
    commit(out, [unit_key(i, u) for i, u in enumerate(units)], manifest)
    return time.perf_counter() - started, manifest["counts"]


def row(name, seconds, docs, nbytes, ratio=""):
    return (f"| {name} | {docs:,} | {nbytes / 2**20:,.1f} | {seconds:.2f} | {docs / seconds:,.0f} | "
            f"{nbytes / 2**20 / seconds:,.1f} | {ratio} |")


def assay_tool(parser, **overrides):
    def run(path, out, params):
        seconds, counts = run_plain([str(path)], out, params, jsonl_parser=parser, **overrides)
        return seconds, counts["documents"], f"{counts['quarantined']:,} quarantined, each with its line number and bytes"
    return run


def datatrove_tool(path, out, params):
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import ParquetWriter

    started = time.perf_counter()
    reader = JsonlReader(str(path.parent), glob_pattern=path.name, text_key="text", id_key="id")
    writer = ParquetWriter(str(out), compression="zstd")
    seen = 0

    def counted(docs):
        nonlocal seen
        for doc in docs:
            seen += 1
            yield doc

    for _ in writer.run(counted(reader.run(None, rank=0, world_size=1)), rank=0, world_size=1):
        pass
    return time.perf_counter() - started, seen, "bad lines skipped with a warning; the file ends at the first non-UTF-8 line"


def datasets_tool(path, out, params):
    import datasets

    datasets.disable_progress_bars()
    started = time.perf_counter()
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(out / "hf-cache"))
        ds.to_parquet(str(out / "hf.parquet"))  # its writer fixes the codec (snappy)
    except Exception as exc:  # what a user would see on dirty input
        return time.perf_counter() - started, 0, f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return time.perf_counter() - started, len(ds), ""


def floor_tool(path, out, params):
    """pyarrow.json on 4 MiB blocks and the same Parquet writer, and nothing else: no check, id,
    meta, kind or language, decisions or manifest. What our reader costs above this is its work."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    from assay.shards import ShardWriter

    schema = pa.schema([("id", pa.string()), ("text", pa.large_string()), ("source", pa.string()), ("path", pa.string())])
    parse_options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    started, seen, pending = time.perf_counter(), 0, b""
    try:
        with open(path, "rb") as handle, ShardWriter(out, schema) as writer:
            while True:
                chunk = handle.read(4 * 2**20)
                data = pending + chunk
                cut = data.rfind(b"\n") + 1 if chunk else len(data)
                if cut:
                    table = pa_json.read_json(pa.BufferReader(data[:cut]), parse_options=parse_options,
                                              read_options=pa_json.ReadOptions(use_threads=False, block_size=cut + 1))
                    writer.write(table)
                    seen += table.num_rows
                pending = data[cut:]
                if not chunk:
                    break
    except pa.ArrowInvalid as exc:
        return time.perf_counter() - started, 0, f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return time.perf_counter() - started, seen, ""


def tools():
    """The tools by name; their modules are imported here, so no timing includes an import."""
    found = {"assay, Arrow blocks, on the reading thread (jsonl_threads: 0)": assay_tool("arrow", jsonl_threads=0),
             "assay, Arrow blocks, 1 worker thread (jsonl_threads: 1)": assay_tool("arrow", jsonl_threads=1),
             "assay, Arrow blocks, 2 worker threads (jsonl_threads: 2, auto for one file)": assay_tool("arrow", jsonl_threads=2),
             "assay, line by line (reference)": assay_tool("lines"),
             "floor: pyarrow.json + assay's Parquet writer, nothing else": floor_tool}
    try:
        import datatrove.pipeline.readers  # noqa: F401
        import datatrove.pipeline.writers  # noqa: F401

        found["datatrove JsonlReader + ParquetWriter (zstd)"] = datatrove_tool
    except ImportError:
        pass
    import datasets  # noqa: F401

    found["datasets.load_dataset('json') + to_parquet (snappy)"] = datasets_tool
    return found


def breakdown(path, out, params) -> dict[str, float]:
    """CPU seconds inside Arrow's JSON parser, kind/lang detection and Parquet writing, in one assay run.

    Blocks are prepared on the reading thread (`jsonl_threads: 0`), so no two
    parts run at once and process CPU time can be split between them.
    """
    import pyarrow.json

    import assay.ingest.jsonl as jsonl
    import assay.shards as shards

    spent = {"JSON parsing (pyarrow.json)": 0.0, "kind/lang detection (assay.languages)": 0.0, "Parquet writing (zstd)": 0.0}

    def timed_call(fn, name):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.process_time() - start
        return wrapper

    names = list(spent)
    patches = [(pyarrow.json, "read_json", names[0]), (jsonl.languages, "classify_batch", names[1]),
               (shards.ShardWriter, "_flush", names[2])]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, timed_call(getattr(owner, attr), name))
        started = time.process_time()
        run_plain([str(path)], out, params, jsonl_parser="arrow", jsonl_threads=0)
        total = time.process_time() - started
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
    spent["the rest (reading, checks, nesting depth, meta, ids, decisions)"] = total - sum(spent.values())
    spent["total"] = total
    return spent


#: One bad line of each kind, cycled through every 100th line of the dirty file.
BAD_LINES = [
    b'{"id": "bad", "text": "missing the closing brace"',
    b'{"id": "bad", "text": "not UTF-8 \xff\xfe here"}',
    b"\x00\x01\x02 binary \x00 bytes",
    b"[1, 2, 3]",
    b'{"id": "bad", "body": "no text field"}',
    b'{"id": "bad", "text": "   "}',
]


#: The bad line that is not UTF-8 decodes as cp1252 with confidence, so
#: both of our readers keep it as a document with `meta.encoding`.
LEGACY_ENCODED = 1


def write_dirty(clean, dirty) -> dict[int, int]:
    """Write `clean` with a bad line after every 100th; returns {line number: index in BAD_LINES}."""
    written, bad = 0, {}
    with open(clean, "rb") as src, open(dirty, "wb") as out:
        for i, line in enumerate(src):
            out.write(line)
            written += 1
            if i % 100 == 99:
                kind = (i // 100) % len(BAD_LINES)
                written += 1
                # Each its own id: the kept cp1252 lines would otherwise repeat one id,
                # and ingest quarantines a repeated id (assay.ingest.repeated_ids).
                out.write(BAD_LINES[kind].replace(b'"id": "bad"', b'"id": "bad-%d"' % written) + b"\n")
                bad[written] = kind
    return bad


def quarantined_lines(out: Path) -> list[tuple[int, str]]:
    """(line number, reason) of every quarantined line of a one-file dataset, sorted."""
    rows = [r for b in iter_batches(out / "quarantine", columns=["path", "reason"]) for r in b.to_pylist()]
    return sorted((int(r["path"].rsplit(":", 1)[1]), r["reason"]) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat-jsonl", type=int, default=20, help="copies of the demo documents in the JSONL file")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the JSONL comparison")
    parser.add_argument("--skip-flow", action="store_true", help="skip the Prefect flow run")
    args = parser.parse_args()
    params = load_params()
    work = Path(tempfile.mkdtemp(prefix="assay-bench-"))
    header = ["| run | documents | MB in | seconds | docs/s | MB/s | vs datasets |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines = list(header)
    cpu_lines = ["", "The same runs in CPU seconds of the whole process (every thread), median of "
                 f"{args.repeats}:", "", "| run | CPU seconds | vs datasets |", "|---|---:|---:|"]
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

        runs = tools()
        times: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for round_ in range(args.repeats):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                out = work / f"out-{len(times[name])}-{names.index(name)}"
                cpu_started = time.process_time()
                seconds, seen, _ = runs[name](jsonl, out, params)
                cpu[name].append(time.process_time() - cpu_started)
                assert seen == n, f"{name} read {seen} of {n} documents"
                times[name].append(seconds)
                print(f"round {round_ + 1}: {name}: {seconds:.2f} s, {cpu[name][-1]:.2f} CPU s", file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)
        median = {name: statistics.median(t) for name, t in times.items()}
        cpu_median = {name: statistics.median(t) for name, t in cpu.items()}
        reference, cpu_reference = median[names[-1]], cpu_median[names[-1]]
        for name in names:
            spread = f"{min(times[name]):.2f}-{max(times[name]):.2f}"
            lines.append(row(f"JSONL → Parquet, {name} (median of {args.repeats}: {spread} s)", median[name], n, size,
                             f"{reference / median[name]:.2f}x"))
            cpu_spread = f"{min(cpu[name]):.2f}-{max(cpu[name]):.2f}"
            cpu_lines.append(f"| {name} | {cpu_median[name]:.2f} ({cpu_spread}) | {cpu_reference / cpu_median[name]:.2f}x |")
        lines += cpu_lines

        parts = breakdown(jsonl, work / "breakdown", params)
        lines += ["", "Where the Arrow reader's CPU time goes (one more run, on the reading thread "
                  "so that the parts add up): " + ", ".join(
                      f"{name} {seconds:.2f} s ({seconds / parts['total']:.0%})" for name, seconds in parts.items())]

        dirty = work / "dirty.jsonl"
        injected = write_dirty(jsonl, dirty)
        bad = len(injected)
        lines += ["", f"Dirty input: the same {n:,} documents with {bad:,} bad lines among them "
                  f"({dirty.stat().st_size / 2**20:,.1f} MB), one run each.", "",
                  "| reader | documents out | seconds | CPU seconds | what happens to the bad lines |",
                  "|---|---:|---:|---:|---|"]
        for name in names:
            cpu_started = time.process_time()
            seconds, seen, note = runs[name](dirty, work / f"dirty-{names.index(name)}", params)
            lines.append(f"| {name} | {seen:,} | {seconds:.2f} | {time.process_time() - cpu_started:.2f} | {note} |")
        expected = sorted(number for number, kind in injected.items() if kind != LEGACY_ENCODED)
        ours = [name for name in names if name.startswith("assay")]
        for name in ours:  # exactly the injected lines, each alone
            got = [number for number, _ in quarantined_lines(work / f"dirty-{names.index(name)}")]
            assert got == expected, f"{name}: quarantined lines differ from the injected bad lines"
        first = quarantined_lines(work / f"dirty-{names.index(ours[0])}")
        for name in ours[1:]:
            assert quarantined_lines(work / f"dirty-{names.index(name)}") == first, f"{name} quarantined differently"
        lines += ["", f"Every assay reader quarantined exactly the {len(expected):,} injected bad lines "
                  f"that are not text in any encoding (line numbers and reasons identical; the other "
                  f"{bad - len(expected):,} decode as cp1252 and are kept with `meta.encoding`)."]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
