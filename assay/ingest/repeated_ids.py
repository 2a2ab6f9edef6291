"""One id, one document, across the files of an ingest run.

Every later stage keys on the id (decisions, `assay why`, the vector store),
so two documents under one id would blur both stories. Ids made from a
locator never repeat, but a record's own id (`--id-field`) can: within a
file, the reader's `Sink` quarantines the later record as it goes; across
files, which are ingested in parallel, only the finished units can tell.
:func:`quarantine_repeated_ids` runs between the units and the commit: the
first unit, in the order of the SOURCE arguments, keeps the id, and each
later document that repeats it is moved from its unit's documents to its
quarantine, as `invalid:duplicate_id`, raw row and all.

Finding them costs one read of the id column, hashed to 64 bits in numpy; only
ids whose hash is in two units are compared as text, and only the units that
hold a repeat are rewritten.

A kill at any point loses nothing: a unit's repeats are written first, under
fixed names, merged with what an earlier attempt wrote there; then its shards
are rewritten without them, each in one rename; its `done.json`, written last,
lists the repeats files and is the sign that the unit is settled.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.schema import DECISION_SCHEMA, INVALID_DUPLICATE_ID, QUARANTINE_SCHEMA
from assay.shards import COMPRESSION, atomic_write_bytes, atomic_write_json, staging_dir
from assay.staging import DECISIONS, DOCS, DONE, QUARANTINE, UnitResult

STAGE = "ingest"
#: The files a settled unit's repeats are written to, beside its own.
REPEATS = {QUARANTINE: "quarantine-repeats.parquet", DECISIONS: "decisions-repeats.parquet"}


def quarantine_repeated_ids(out_dir: str | os.PathLike, results: Sequence[UnitResult]) -> list[UnitResult]:
    """Move each document whose id an earlier unit's document holds to its unit's quarantine.

    `results`: every finished unit's, in commit order; returns them as they now stand.
    """
    if len(results) < 2:
        return list(results)  # one unit: its Sink has seen every id
    folder = staging_dir(out_dir)
    holders = _first_holders(folder, results)
    # Usually there are none: one read of the id column, nothing written. A unit with a repeats
    # file is one that a killed attempt began to settle, whose repeats its shards no longer show.
    return [_settle(folder / result.unit, index, result, holders)
            if holders or (folder / result.unit / REPEATS[QUARANTINE]).exists() else result
            for index, result in enumerate(results)]


#: An odd multiplier (FNV-1's prime) for the polynomial hash below.
_PRIME = np.uint64(0x100000001B3)


def _hashes(ids: pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash of each id, over Arrow's buffers in numpy: sum of byte * PRIME^position,
    modulo 2^64, mixed with the length. Equal ids hash alike; two ids that share a hash are
    only candidates, compared as text later. (Python's `hash` per id cost 12% of ingesting
    a million short JSON lines; this costs a few numpy passes over the id bytes.)"""
    out = [np.zeros(0, np.uint64)]
    for chunk in ids.chunks:
        chunk = chunk.cast(pa.large_string())  # one offset width to read
        n = len(chunk)
        offsets = np.frombuffer(chunk.buffers()[1], np.int64, count=n + 1, offset=chunk.offset * 8)
        data = np.frombuffer(chunk.buffers()[2], np.uint8)[offsets[0]:offsets[-1]].astype(np.uint64)
        offsets = offsets - offsets[0]
        lengths = np.diff(offsets)
        powers = np.cumprod(np.full(max(int(lengths.max(initial=0)), 1), _PRIME, np.uint64))  # wraps mod 2^64
        terms = data * powers[np.arange(len(data)) - np.repeat(offsets[:-1], lengths)]
        sums = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
        out.append((sums[offsets[1:]] - sums[offsets[:-1]]) ^ lengths.astype(np.uint64))
    return np.concatenate(out)


def _first_holders(folder: Path, results: Sequence[UnitResult]) -> dict[str, tuple[int, str]]:
    """For each id that documents of two units hold: (the first unit's index, its document's path)."""
    hashes, owners = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
    for index, result in enumerate(results):
        for name in result.files.get(DOCS, []):
            hashes.append(_hashes(pq.read_table(folder / result.unit / name, columns=["id"]).column("id")))
            owners.append(np.full(len(hashes[-1]), index))
    every, owner = np.concatenate(hashes), np.concatenate(owners)
    order = np.argsort(every, kind="stable")  # a radix sort; the units stay in order within a hash
    every, owner = every[order], owner[order]
    # Within a unit an id is unique (the Sink saw to it), so a hash twice in a row is one id in
    # two units, or two ids that share a hash; comparing the text below tells which.
    shared = np.unique(every[1:][(every[1:] == every[:-1]) & (owner[1:] != owner[:-1])])
    if not len(shared):
        return {}
    first: dict[str, tuple[int, str]] = {}
    repeated: set[str] = set()
    for index, result in enumerate(results):
        for name in result.files.get(DOCS, []):
            table = pq.read_table(folder / result.unit / name, columns=["id", "path"])
            table = table.filter(pa.array(np.isin(_hashes(table.column("id")), shared)))
            for doc_id, path in zip(table.column("id").to_pylist(), table.column("path").to_pylist()):
                if first.setdefault(doc_id, (index, path))[0] != index:
                    repeated.add(doc_id)
    return {doc_id: first[doc_id] for doc_id in repeated}


def _settle(unit_dir: Path, index: int, result: UnitResult, holders: dict[str, tuple[int, str]]) -> UnitResult:
    """Quarantine the documents of unit `index` whose id an earlier unit holds."""
    moving_docs = []  # (shard name, its table, which rows repeat an earlier unit's id)
    for name in result.files.get(DOCS, []) if holders else []:
        ids = pq.read_table(unit_dir / name, columns=["id"]).column("id").to_pylist()
        moving = pa.array([holders.get(doc_id, (index, ""))[0] < index for doc_id in ids], pa.bool_())
        if pc.any(moving).as_py():
            moving_docs.append((name, pq.read_table(unit_dir / name), moving))
    settled = REPEATS[QUARANTINE] in result.files.get(QUARANTINE, [])
    if settled:
        if moving_docs:  # its done.json is written after its shards: this cannot be
            raise RuntimeError(f"{unit_dir}: documents repeat earlier ids after the unit was settled")
        return result
    if not moving_docs and not (unit_dir / REPEATS[QUARANTINE]).exists():
        return result
    # 1. The repeats, with what a killed attempt had moved already.
    found = [_quarantine_rows(table.filter(moving), holders) for _, table, moving in moving_docs]
    earlier = _read_or_empty(unit_dir / REPEATS[QUARANTINE], QUARANTINE_SCHEMA)
    if found:  # an attempt killed before rewriting a shard wrote some of these already
        again = pa.concat_arrays([rows.column("id").combine_chunks() for rows in found])
        earlier = earlier.filter(pc.invert(pc.is_in(earlier.column("id"), value_set=again)))
    quarantine = pa.concat_tables([earlier, *found])
    _replace(unit_dir / REPEATS[QUARANTINE], quarantine)
    _replace(unit_dir / REPEATS[DECISIONS], _decision_rows(quarantine))
    # 2. The unit's shards without them: its documents, and their `kept` decisions.
    for name, table, moving in moving_docs:
        _replace(unit_dir / name, table.filter(pc.invert(moving)))
    moved = quarantine.column("id")
    for name in result.files.get(DECISIONS, []):
        table = pq.read_table(unit_dir / name)
        stale = pc.and_(table.column("kept"), pc.is_in(table.column("id"), value_set=moved))
        if pc.any(stale).as_py():
            _replace(unit_dir / name, table.filter(pc.invert(stale)))
    # 3. Its done.json, last.
    counts = Counter(result.counts)
    counts["documents"] -= quarantine.num_rows
    counts["quarantined"] += quarantine.num_rows
    counts[INVALID_DUPLICATE_ID] += quarantine.num_rows
    for raw in quarantine.column("raw").to_pylist():
        counts[f"kind:{json.loads(raw)['kind']}"] -= 1
    files = {stream: list(names) for stream, names in result.files.items()}
    for stream, name in REPEATS.items():
        files.setdefault(stream, []).append(name)
    settled_result = UnitResult(
        unit=result.unit, files=files, counts={key: n for key, n in counts.items() if n},
        bytes_in=result.bytes_in, bytes_out=sum((unit_dir / name).stat().st_size for name in files.get(DOCS, [])),
        seconds=result.seconds, skipped=result.skipped,
    )
    atomic_write_json(unit_dir / DONE, settled_result.to_json())
    return settled_result


def _quarantine_rows(documents: pa.Table, holders: dict[str, tuple[int, str]]) -> pa.Table:
    rows = documents.to_pylist()
    details, raws = [], []
    for row in rows:
        first_path = holders[row["id"]][1]
        details.append(f"{row['path']}: id {row['id']!r} is also the id of {first_path}, ingested from an "
                       "earlier SOURCE, which keeps it")
        raws.append(json.dumps({**row, "meta": json.loads(row["meta"])}, ensure_ascii=False).encode("utf-8"))
    return pa.table({
        "id": documents.column("id"), "source": documents.column("source"), "path": documents.column("path"),
        "reason": [INVALID_DUPLICATE_ID] * len(rows), "detail": details, "raw": raws,
    }, schema=QUARANTINE_SCHEMA)


def _decision_rows(quarantine: pa.Table) -> pa.Table:
    n = quarantine.num_rows
    return pa.table({
        "id": quarantine.column("id"), "stage": [STAGE] * n, "kept": [False] * n,
        "reason": quarantine.column("reason"), "scores": pa.nulls(n, DECISION_SCHEMA.field("scores").type),
        "detail": quarantine.column("detail"),
    }, schema=DECISION_SCHEMA)


def _read_or_empty(path: Path, schema: pa.Schema) -> pa.Table:
    return pq.read_table(path, schema=schema) if path.exists() else schema.empty_table()


def _replace(path: Path, table: pa.Table) -> None:
    """Write `table` over `path` in one rename: a reader, or a rerun, finds the old file or the new one."""
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression=COMPRESSION)
    atomic_write_bytes(path, buffer.getvalue().to_pybytes())
