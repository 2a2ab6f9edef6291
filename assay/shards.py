"""Shard IO: a dataset is a directory of zstd Parquet shards plus a manifest.

Layout of a dataset directory::

    part-00000.parquet ...            documents (assay.schema.DOCUMENT_SCHEMA + score columns)
    decisions/part-00000.parquet ...  one row per input record (DECISION_SCHEMA)
    quarantine/part-00000.parquet ... raw bytes of bad input (QUARANTINE_SCHEMA)
    manifest.json                     counts, bytes, params, input fingerprints, timings

Every file is written under a temporary name and renamed into place, so a
reader sees a shard whole or not at all, and a killed writer leaves only
temporary files that the next run removes. A stage builds its whole dataset in
a staging folder beside it and publishes it with one rename
(:func:`publish_directory`), so a reader of the folder, Assay's or any other,
finds the previous dataset or the new one, never a mix. Readers stream record
batches and never hold a whole dataset in memory.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from assay.errors import AssayError

SHARD_PATTERN = re.compile(r"^part-(\d{5,})\.parquet$")
DECISIONS_DIR = "decisions"
QUARANTINE_DIR = "quarantine"
MANIFEST = "manifest.json"
#: A stage works in ``.NAME.staging`` beside its output NAME (:func:`staging_dir`) until it
#: publishes the finished dataset; while that folder exists and NAME has no manifest, the
#: stage is still writing, or was stopped before finishing.
STAGING_SUFFIX = ".staging"
COMPRESSION = "zstd"
TMP_MARKER = ".tmp-"

#: Rows buffered before a row group is written: large enough for good
#: compression, small enough that a reader's batch stays a few MB.
ROW_GROUP_ROWS = 2048
#: ... or these bytes, whichever comes first: 2,048 rows of large documents would be a whole shard,
#: held by the writer until written and read back by the next stage at once (bench/memory_bound.py).
ROW_GROUP_BYTES = 16 * 2**20
#: Columns of large values (documents' text, quarantined raw bytes) are written without a
#: dictionary. Parquet's writer hashes every value into one and gives up past its 1 MB page
#: limit, but it checks only after each 1,024 values, so a row group of long documents went
#: through the dictionary whole first. Without it, writing bench/ingest.py's 8,728 documents
#: took 0.57 CPU s against 0.70 (medians of 8 rounds), for files 2% larger. Every other
#: column keeps its dictionary.
PLAIN_COLUMNS = frozenset({"text", "raw"})
#: Version 2 data pages compress a column's values on their own; version 1 pages first copy
#: levels and values into one buffer. Writing bench/ingest.py's documents took 0.81 CPU s
#: against 0.91 (medians of 12 rounds), for files of the same size. Every reader of shards
#: here is pyarrow's, which reads both.
DATA_PAGE_VERSION = "2.0"


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _tmp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}{TMP_MARKER}{os.getpid()}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either absent, old, or whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARKER}", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the file is data, not a secret
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def staging_dir(directory: str | os.PathLike) -> Path:
    """Where a stage builds `directory` before publishing it: ``.NAME.staging`` beside it.

    Beside, not inside: the dataset folder must be replaced in one rename, and a folder cannot
    be swapped with one inside it. The same filesystem, so that rename is possible at all (beside
    where a symlinked `directory` points).
    """
    path = Path(os.path.realpath(directory))
    return path.parent / f".{path.name}{STAGING_SUFFIX}"


# renameat2(2)'s flag: swap two existing paths in one step (Linux 3.15+, on most local filesystems).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically; False where the platform or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_directory(built: str | os.PathLike, target: str | os.PathLike, set_aside: str | os.PathLike) -> None:
    """Put the finished folder `built` at `target` so that a reader lists the old folder or the
    new one, never some files of each.

    A missing or empty `target` is replaced by one rename; a previous dataset is swapped out in
    one step (renameat2's exchange) and then deleted. Where the filesystem cannot swap, the
    previous dataset is first moved to `set_aside` (inside the staging folder), so readers see
    no folder for an instant, still never a mix; a kill between the two renames leaves the new
    folder staged, and the rerun's commit publishes it.
    """
    built, target, set_aside = Path(built), Path(os.path.realpath(target)), Path(set_aside)
    try:
        os.rename(built, target)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(built, target):
        shutil.rmtree(built)  # now the previous dataset
        return
    shutil.rmtree(set_aside, ignore_errors=True)
    os.rename(target, set_aside)
    os.rename(built, target)
    shutil.rmtree(set_aside)


def remove_temporaries(directory: str | os.PathLike) -> int:
    """Delete leftovers of killed writers under `directory`; returns how many."""
    removed = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if TMP_MARKER in name and name.startswith("."):
                Path(root, name).unlink(missing_ok=True)
                removed += 1
    return removed


@dataclass(frozen=True)
class ShardInfo:
    name: str
    rows: int
    bytes: int


@functools.lru_cache(maxsize=64)
def dictionary_columns(schema: pa.Schema) -> bool | tuple[str, ...]:
    """`use_dictionary` for a schema: every leaf column but those of PLAIN_COLUMNS (True: all)."""
    if not PLAIN_COLUMNS & set(schema.names):
        return True
    buffer = io.BytesIO()  # the leaf paths ("scores.key_value.key") as the writer names them
    pq.write_table(schema.empty_table(), buffer)
    leaves = pq.ParquetFile(pa.BufferReader(buffer.getvalue())).schema
    return tuple(path for path in (leaves.column(i).path for i in range(len(leaves))) if path.split(".")[0] not in PLAIN_COLUMNS)


def _as_option(columns: bool | tuple[str, ...]) -> bool | list[str]:
    return columns if isinstance(columns, bool) else list(columns)


class ShardWriter:
    """Writes record batches to numbered Parquet shards of about `target_bytes`.

    A shard is written to a hidden temporary file and renamed when it is
    closed; until then no reader can see it. `name_for(index)` chooses file
    names, so staging areas can use their own prefix.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        schema: pa.Schema,
        *,
        target_bytes: int = 128 * 2**20,
        name_for=shard_name,
        first_index: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self.schema = schema
        self.target_bytes = target_bytes
        self._name_for = name_for
        self._index = first_index
        self._writer: pq.ParquetWriter | None = None
        self._tmp: Path | None = None
        self._final: Path | None = None
        self._buffer: list[pa.RecordBatch] = []
        self._buffered_rows = 0
        self._buffered_bytes = 0
        self._shard_rows = 0
        self._shard_bytes = 0  # uncompressed, which is what the target bounds
        self.shards: list[ShardInfo] = []

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        if data.num_rows == 0:
            return
        if data.schema != self.schema:
            data = data.select(self.schema.names).cast(self.schema)
        batches = data.to_batches() if isinstance(data, pa.Table) else [data]
        for batch in batches:
            self._buffer.append(batch)
            self._buffered_rows += batch.num_rows
            self._buffered_bytes += batch.nbytes
            self._shard_bytes += batch.nbytes
            if self._buffered_rows >= ROW_GROUP_ROWS or self._buffered_bytes >= ROW_GROUP_BYTES:
                self._flush()
            if self._shard_bytes >= self.target_bytes:
                self._close_shard()

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._final = self.directory / self._name_for(self._index)
            self._tmp = _tmp_path(self._final)
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression=COMPRESSION,
                                            use_dictionary=_as_option(dictionary_columns(self.schema)),
                                            data_page_version=DATA_PAGE_VERSION)
        table = pa.Table.from_batches(self._buffer, schema=self.schema)
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))
        self._shard_rows += table.num_rows
        self._buffer.clear()
        self._buffered_rows = 0
        self._buffered_bytes = 0

    def _close_shard(self) -> None:
        self._flush()
        if self._writer is None:
            return
        self._writer.close()
        os.replace(self._tmp, self._final)
        self.shards.append(ShardInfo(self._final.name, self._shard_rows, self._final.stat().st_size))
        self._writer = None
        self._index += 1
        self._shard_rows = 0
        self._shard_bytes = 0

    def close(self) -> list[ShardInfo]:
        self._close_shard()
        return self.shards

    def abort(self) -> None:
        """Drop the open shard; closed shards stay."""
        if self._writer is not None:
            self._writer.close()
            self._tmp.unlink(missing_ok=True)
            self._writer = None
        self._buffer.clear()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# --- reading -------------------------------------------------------------------


def list_shards(directory: str | os.PathLike) -> list[Path]:
    """The finished shards of a directory, in order; temporaries are invisible."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if SHARD_PATTERN.match(p.name))


def require_complete(directory: str | os.PathLike) -> None:
    """Refuse a dataset that a stage has begun and not yet published, naming why.

    A published dataset is whole (:func:`publish_directory`); a previous version stays readable
    while its successor is built. What is refused is a first run still under way, or stopped:
    no manifest here, and the stage's staging folder beside it.
    """
    directory = Path(directory)
    staging = staging_dir(directory)
    if not (directory / MANIFEST).is_file() and staging.is_dir():
        raise AssayError(f"{directory}: incomplete: a stage is still writing it, or was stopped before it "
                         f"finished (its work is in {staging}, and it has published nothing yet); wait for "
                         "it, or rerun that stage")


def require_dataset(directory: str | os.PathLike) -> Path:
    directory = Path(directory)
    require_complete(directory)
    if not directory.is_dir():
        raise AssayError(f"{directory}: " + ("a file, not a dataset directory" if directory.exists() else "no such dataset directory"))
    if not (directory / MANIFEST).is_file() and not list_shards(directory):
        raise AssayError(f"{directory}: not an Assay dataset (no {MANIFEST} and no part-*.parquet)")
    if (directory / MANIFEST).is_file():
        _require_listed(directory, read_manifest(directory).get("shards"), "shards")
    return directory


def stream_shards(directory: str | os.PathLike, stream: str) -> list[Path]:
    """The shards of a dataset's `stream` folder (``decisions/``, ``quarantine/``...), checked
    against the parts its manifest lists, where the manifest lists them (since 2026-12-07)."""
    directory = Path(directory)
    listed = None
    if (directory / MANIFEST).is_file():
        streams = read_manifest(directory).get("streams")
        if streams is not None:
            listed = streams.get(stream, [])  # listed streams are every stream the stage wrote
    _require_listed(directory / stream, listed, f"{stream}/ shards")
    return list_shards(directory / stream)


def _require_listed(folder: Path, listed: list[str] | None, what: str) -> None:
    """`folder` holds exactly the part files its manifest lists (None: it lists none, so any)."""
    if listed is None:
        return
    missing = [name for name in listed if not (folder / name).is_file()]
    if missing:  # reading on would silently judge, count, explain or train on part of the dataset
        raise AssayError(f"{folder}: {len(missing)} of the {len(listed)} {what} its {MANIFEST} lists are "
                         f"missing ({missing[0]}{' ...' if len(missing) > 1 else ''}); restore them or "
                         "rerun the stage that wrote it")
    known = set(listed)
    extra = [p.name for p in list_shards(folder) if p.name not in known]
    if extra:  # a copy or a leftover: read on, its rows would be counted (and their ids) twice
        raise AssayError(f"{folder}: {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} "
                         f"{'is' if len(extra) == 1 else 'are'} not among the {len(listed)} {what} its {MANIFEST} "
                         f"lists, so not part of this dataset; move {'it' if len(extra) == 1 else 'them'} away, or "
                         "rerun the stage that wrote it")


#: The columns that make a shard a document shard: every dataset's `part-*.parquet` has them
#: (assay.schema.DOCUMENT_SCHEMA); a stage's decisions/, quarantine/ or embeddings/ have `id`, never `text`.
DOCUMENT_KEY_COLUMNS = ("id", "text")


def require_documents(directory: str | os.PathLike, columns: Iterable[str] = ()) -> Path:
    """:func:`require_dataset`, and its shards are documents with `columns` (each of the right type).

    A folder of other Parquet (a stage's ``decisions/`` or ``embeddings/``) has ``part-*.parquet``
    too, so :func:`require_dataset` takes it: `assay stats` then failed inside pyarrow on a missing
    column, and `assay show` printed a decision row as a document. Only footers are read.
    """
    from assay.schema import DOCUMENT_SCHEMA

    directory = require_dataset(directory)
    wanted = list(dict.fromkeys((*DOCUMENT_KEY_COLUMNS, *columns)))
    for shard in list_shards(directory):
        names = open_shard(shard, shard).schema_arrow.names
        missing = [name for name in DOCUMENT_KEY_COLUMNS if name not in names]
        if missing:
            where = (f"; it looks like a stage's {directory.name}/ folder: give the dataset that holds it, "
                     f"{directory.parent}") if directory.name in (DECISIONS_DIR, QUARANTINE_DIR, "embeddings") else ""
            manifest = "" if (directory / MANIFEST).is_file() else f", and it has no {MANIFEST}"
            raise AssayError(f"{directory}: not a document dataset: {shard.name} has no "
                             f"{' or '.join(repr(m) for m in missing)} column (it has: {', '.join(names)}){manifest}"
                             f"{where}")
        open_shard(shard, shard, DOCUMENT_SCHEMA, wanted)
    return directory


def first_line(exc: BaseException) -> str:
    """An exception's message on one line: the CLI prints errors as one line, and pyarrow's
    (thrift's "Couldn't deserialize thrift: ...") can end in a newline or run on."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _same_family(a: pa.DataType, b: pa.DataType) -> bool:
    """string and large_string (binary and large_binary) hold the same values."""
    texts = (pa.string(), pa.large_string())
    blobs = (pa.binary(), pa.large_binary())
    return a == b or (a in texts and b in texts) or (a in blobs and b in blobs)


def open_shard(source: Any, label: str | os.PathLike, schema: pa.Schema | None = None,
               columns: Iterable[str] | None = None) -> pq.ParquetFile:
    """A shard opened for reading, or an error that names it.

    `source` is a path or an open file. A corrupt footer, or a column of `schema` that
    the shard lacks or holds with another type, means a damaged or foreign dataset: the
    user is told which shard and which column rather than shown pyarrow's traceback.
    Only the `columns` asked for are checked (all of `schema` when None).
    """
    try:
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as exc:
        raise AssayError(f"{label}: not a readable Parquet shard ({first_line(exc)})") from None
    if schema is not None:
        found = parquet.schema_arrow
        for name in (columns if columns is not None else schema.names):
            if name not in schema.names:
                continue
            want = schema.field(name).type
            if name not in found.names:
                raise AssayError(f"{label}: no column '{name}' (it has: {', '.join(found.names)})")
            if not _same_family(found.field(name).type, want):
                raise AssayError(f"{label}: column '{name}' is {found.field(name).type}, expected {want}")
    return parquet


def shard_batches(parquet: pq.ParquetFile, label: str | os.PathLike, *, columns: list[str] | None = None,
                  batch_size: int = 1024, max_bytes: int | None = None) -> Iterator[pa.RecordBatch]:
    """`parquet.iter_batches`, with a corrupt page reported as an error naming the shard.

    With `max_bytes`, a batch whose strings (text, ids, metadata) exceed it is
    yielded as consecutive slices of at most that many bytes (at least one row
    each): a stage's working memory grows with the bytes it judges at once, and
    `batch_size` rows of documents of up to `ingest.max_bytes` would be gigabytes.
    """
    try:
        for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
            yield from byte_slices(batch, max_bytes) if max_bytes else (batch,)
    except (pa.ArrowException, OSError) as exc:
        raise AssayError(f"{label}: corrupt Parquet data ({first_line(exc)})") from None


def read_shard(shard: str | os.PathLike, *, columns: list[str] | None = None, filters: Any = None) -> pa.Table:
    """`pq.read_table` of one shard, with damage (cut short, garbage pages or footer) reported as
    an error naming the shard, as `shard_batches` reports it, not as pyarrow's traceback."""
    try:
        return pq.read_table(shard, columns=columns, filters=filters)
    except (pa.ArrowException, OSError) as exc:
        raise AssayError(f"{shard}: corrupt Parquet data ({first_line(exc)})") from None


def byte_slices(batch: pa.RecordBatch, max_bytes: int) -> Iterator[pa.RecordBatch]:
    """Consecutive zero-copy slices of `batch`, each's string and binary values at most `max_bytes` (or one row)."""
    import numpy as np
    import pyarrow.compute as pc

    sizes = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or \
                pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            sizes += np.asarray(pc.fill_null(pc.binary_length(column), 0), dtype=np.int64)
    if int(sizes.sum()) <= max_bytes:
        yield batch
        return
    ends = np.cumsum(sizes)
    start = 0
    while start < batch.num_rows:
        before = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, before + max_bytes, side="right")), start + 1)
        yield batch.slice(start, stop - start)
        start = stop


def iter_batches(
    directory: str | os.PathLike,
    *,
    columns: list[str] | None = None,
    batch_size: int = 1024,
    filter_ids: Iterable[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Stream the record batches of every shard in `directory`, in shard order."""
    id_set = pa.array(sorted(set(filter_ids)), pa.string()) if filter_ids is not None else None
    for shard in list_shards(directory):
        for batch in shard_batches(open_shard(shard, shard), shard, batch_size=batch_size, columns=columns):
            if id_set is not None:
                import pyarrow.compute as pc

                batch = batch.filter(pc.is_in(batch.column("id"), value_set=id_set))
                if batch.num_rows == 0:
                    continue
            yield batch


def count_rows(directory: str | os.PathLike) -> int:
    return sum(open_shard(s, s).metadata.num_rows for s in list_shards(directory))


def json_object(path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when there is none to trust: absent, unreadable, not UTF-8,
    not JSON, or not an object. For asking whether a file is one of ours before writing over it."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return found if isinstance(found, dict) else None


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise AssayError(f"{directory}: no {MANIFEST}; the stage that writes it did not finish") from None
    except json.JSONDecodeError as exc:
        raise AssayError(f"{path}: corrupt manifest ({exc})") from None
    # Readers trust its shape (the shard lists above all): valid JSON of another shape is as corrupt.
    if not isinstance(manifest, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(manifest), "null")
        raise AssayError(f"{path}: corrupt manifest ({kind}, not a JSON object)")
    if not _names(manifest.get("shards", [])):
        raise AssayError(f"{path}: corrupt manifest (shards should be a list of file names)")
    streams = manifest.get("streams", {})
    if not (isinstance(streams, dict) and all(_names(names) for names in streams.values())):
        raise AssayError(f"{path}: corrupt manifest (streams should map a folder to a list of file names)")
    if not isinstance(manifest.get("counts", {}), dict):
        raise AssayError(f"{path}: corrupt manifest (counts should be an object)")
    return manifest


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def kept_nothing(dataset: str | os.PathLike) -> bool:
    """Whether `dataset` is a stage's whole output that holds no document: its manifest lists no shard.

    Such an output is the next stage's input like any other (it judges nothing and publishes an
    empty dataset in turn), and a reader that needs documents says so rather than "damaged".
    A folder without a manifest, or with one that cannot be read, is something else.
    """
    try:
        return read_manifest(dataset).get("shards") == []
    except (AssayError, OSError, AttributeError):
        return False


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(directory) / MANIFEST, manifest)
