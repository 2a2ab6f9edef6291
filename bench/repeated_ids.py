"""The cost of one id, one document: ingest's checks for ids repeated across files and within one.

    python bench/repeated_ids.py [--files 4] [--docs 250000] [--repeats 3]

Writes FILES JSONL files of DOCS short records each (60-byte texts: the worst
case, where the check is the largest share of ingest), ingests them unit by
unit without Prefect, then times `quarantine_repeated_ids` over the finished
units: our numpy hash of the id column, side by side with what a user would
write, a Python set of every id. With no repeats, neither writes anything; the
ratio to the tasks' time is what the check adds to an ingest. A second round
gives every tenth record of the later files an id of the first file, and times
the check that then moves those records to the quarantine.

Within a file, the reader's `Sink._first_of_each_id` checks each batch's ids
against the unit's earlier ones as it writes. Its time is taken inside the
task (the method wrapped with a CPU timer) for one JSONL file of unique ids at
three record sizes, and given as its share of the task's CPU time: no peer
checks this (datatrove and `datasets` keep both records), so the ingest itself
is what it is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pyarrow.parquet as pq  # noqa: E402

from assay.config import Params  # noqa: E402
from assay.ingest import fingerprint, options_from_params  # noqa: E402
from assay.ingest.plan import plan  # noqa: E402
from assay.ingest.readers import Sink, ingest_unit  # noqa: E402
from assay.ingest.repeated_ids import quarantine_repeated_ids  # noqa: E402
from assay.shards import staging_dir  # noqa: E402
from assay.staging import DOCS, prepare  # noqa: E402


def write_files(folder: Path, files: int, docs: int, repeat_every: int | None) -> list[str]:
    paths = []
    for f in range(files):
        path = folder / f"c{f}.jsonl"
        with open(path, "w") as handle:
            for i in range(docs):
                repeated = repeat_every and f > 0 and i % repeat_every == 0
                doc_id = f"doc-0-{i:08d}" if repeated else f"doc-{f}-{i:08d}"
                handle.write(json.dumps({"id": doc_id, "text": f"Document {i} of file {f} with a few words in it."}) + "\n")
        paths.append(str(path))
    return paths


def python_set(out: Path, results) -> int:
    """The peer: every id into one Python set, file by file; returns how many repeat."""
    seen: set[str] = set()
    repeats = 0
    for result in results:
        for name in result.files.get(DOCS, []):
            for doc_id in pq.read_table(staging_dir(out) / result.unit / name, columns=["id"]).column("id").to_pylist():
                repeats += doc_id in seen
                seen.add(doc_id)
    return repeats


def run(work: Path, files: int, docs: int, repeat_every: int | None, repeats: int) -> None:
    folder = work / ("repeating" if repeat_every else "unique")
    folder.mkdir()
    paths = write_files(folder, files, docs, repeat_every)
    params = Params()
    options = options_from_params(params)
    units = plan(paths, options)
    check, peer = [], []
    for _ in range(repeats):
        out = folder / "raw"
        prepare(out, fingerprint(units, options, params), overwrite=True)
        started = time.perf_counter()
        results = [ingest_unit(i, u, str(out), options) for i, u in enumerate(units)]
        tasks = time.perf_counter() - started
        started = time.perf_counter()
        moved = python_set(out, results)
        peer.append(time.perf_counter() - started)
        started = time.perf_counter()
        settled = quarantine_repeated_ids(out, results)
        check.append(time.perf_counter() - started)
        found = sum(r.counts.get("invalid:duplicate_id", 0) for r in settled)
        assert found == moved, (found, moved)
        (staging_dir(out) / "fingerprint").unlink()  # the next round starts over
    n = files * docs
    label = f"every 10th record of files 2-{files} repeats file 1's" if repeat_every else "no repeats"
    print(f"| {label} | {n:,} | {found:,} | {tasks:.2f} | {statistics.median(check):.3f} "
          f"({statistics.median(check) / tasks:.1%}) | {statistics.median(peer):.3f} |")


def within_a_file(work: Path, records: int, words: int, repeats: int) -> None:
    """One file of RECORDS unique ids with texts of WORDS x 3 words: the task's CPU time and the
    within-file check's share of it (medians of REPEATS)."""
    path = work / f"within-{words}.jsonl"
    with open(path, "w") as handle:
        for i in range(records):
            handle.write(json.dumps({"id": f"doc-{i}", "text": f"Record {i}: " + "plain English prose, " * words}) + "\n")
    spent = [0.0]
    check = Sink._first_of_each_id

    def timed(self, batch, where):
        started = time.process_time()
        try:
            return check(self, batch, where)
        finally:
            spent[0] += time.process_time() - started

    params = Params()
    options = options_from_params(params)
    units = plan([str(path)], options)
    rounds = []
    Sink._first_of_each_id = timed
    try:
        for _ in range(repeats):
            out = work / f"within-{words}-raw"
            prepare(out, fingerprint(units, options, params), overwrite=True)
            spent[0] = 0.0
            started = time.process_time()
            results = [ingest_unit(i, u, str(out), options) for i, u in enumerate(units)]
            rounds.append((time.process_time() - started, spent[0]))
            assert sum(r.counts["documents"] for r in results) == records
            (staging_dir(out) / "fingerprint").unlink()
    finally:
        Sink._first_of_each_id = check
    task, share = sorted(rounds)[len(rounds) // 2]
    print(f"| {records:,} | {path.stat().st_size / records:,.0f} | {task:.2f} | {share * 1000:.0f} ({share / task:.1%}) "
          f"| {share / records * 1e9:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--docs", type=int, default=250_000, help="records per file")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are printed")
    args = parser.parse_args()
    print("| corpus | documents | moved | tasks s | check s (of tasks) | Python set s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), args.files, args.docs, None, args.repeats)
        run(Path(tmp), args.files, args.docs, 10, args.repeats)
    print()
    print("| records (one file) | bytes a record | task CPU s | within-file check CPU ms (of the task) | ns a record |")
    print("|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for records, words in ((400_000, 3), (100_000, 50), (40_000, 200)):
            within_a_file(Path(tmp), records, words, args.repeats)


if __name__ == "__main__":
    main()
