"""SOURCE arguments → units of work, one Prefect task each.

A unit is small and serialisable: it names what to read, never holds the
data. Planning only lists and stats files, so a typo in a SOURCE fails in a
second, before any task starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from assay.config import JSONL_PARSERS
from assay.errors import AssayError

HF_PREFIX = "hf:"
DEMO_SOURCE = "demo"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class FileEntry:
    """One file-like document: a real file, or a rendered one (man, pydoc)."""

    fs_path: str
    source: str
    locator: str
    # None (read bytes) | "man" | "pydoc" | "decompress" (.gz/.xz) | "message-headers" / "message-body"
    # (the two parts of an RFC 822-style file: a wheel's METADATA)
    render: str | None = None
    size: int = 0
    mtime_ns: int = 0


@dataclass(frozen=True)
class Unit:
    kind: str  # "files" | "jsonl" | "parquet" | "hf"
    source: str
    files: tuple[FileEntry, ...] = ()
    path: str = ""  # jsonl / parquet file, or the HF dataset path
    split: str | None = None
    size: int = 0
    mtime_ns: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # counted at plan time

    @property
    def signature(self) -> str:
        """Identity plus a cheap content fingerprint (sizes and mtimes)."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.blake2b(blob, digest_size=10).hexdigest()


@dataclass(frozen=True)
class IngestOptions:
    text_field: str = "text"
    id_field: str = "id"
    source_name: str | None = None
    max_bytes: int = 10_000_000
    shard_bytes: int = 128 * 2**20
    batch_rows: int = 1024
    unit_bytes: int = 16 * 2**20
    skip_dirs: tuple[str, ...] = (".git", "node_modules", "__pycache__", ".venv")
    fallback_encodings: tuple[str, ...] = ("cp1252", "latin_1", "iso8859_15")
    encoding_confidence: float = 0.9
    #: "arrow": blocks parsed by pyarrow.json, Python only on the lines it
    #: rejects or may read differently; "lines": every line in Python (the
    #: reference). Both give the same documents and quarantine.
    jsonl_parser: str = "arrow"
    #: Bytes of JSON lines per block (one Arrow call, one kind/lang batch).
    #: Every block costs a few dozen Arrow kernel calls: on 300 MB of
    #: bench/ingest.py's file, 4 MiB took 2.1 CPU s against 2.6-2.9 for 1 MiB
    #: (8 MiB: as 4), and with 1% bad lines 2.6-2.9 against 2.8-3.2.
    jsonl_block_bytes: int = 4 * 2**20
    #: Worker threads that parse, check and classify JSONL blocks while the
    #: reading thread writes the ones before; 0 does everything on the reading
    #: thread. Threads pay only where cores are free, and they cost CPU, so
    #: params.yaml's `auto` is resolved per run (`assay.ingest.jsonl_threads_for_run`).
    jsonl_threads: int = 0

    def __post_init__(self) -> None:
        if self.jsonl_parser not in JSONL_PARSERS:
            raise AssayError(f"ingest: jsonl_parser must be one of {', '.join(JSONL_PARSERS)}, not {self.jsonl_parser!r}")
        if self.jsonl_block_bytes < 1:
            raise AssayError(f"ingest: jsonl_block_bytes must be positive, not {self.jsonl_block_bytes}")
        if self.jsonl_threads < 0:
            raise AssayError(f"ingest: jsonl_threads must be 0 or more, not {self.jsonl_threads}")


def unit_key(index: int, unit: Unit) -> str:
    """Staging folder name: ordered by position, tied to the unit's content."""
    return f"{index:05d}-{unit.signature}"


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return 0, 0


def group_files(entries: list[FileEntry], kind: str, source: str, unit_bytes: int) -> list[Unit]:
    """Pack file entries into units of about `unit_bytes` input each, in order."""
    units, current, size = [], [], 0
    for entry in entries:
        current.append(entry)
        size += max(entry.size, 4096)  # rendered entries have no size yet
        if size >= unit_bytes:
            units.append(Unit(kind=kind, source=source, files=tuple(current), size=size))
            current, size = [], 0
    if current:
        units.append(Unit(kind=kind, source=source, files=tuple(current), size=size))
    return units


def printable_name(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (which Python keeps as lone surrogates) are
    written as ``\\xNN``, so the name can be an id's locator and a Parquet string. Valid names are unchanged."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def walk_directory(root: Path, source: str, skip_dirs: tuple[str, ...]) -> tuple[list[FileEntry], dict[str, int]]:
    """Every file under `root`, sorted, without skipped dirs or escaping symlinks.

    A symlink is never followed, and is counted: one leading out of the root as
    `symlink_outside_root`; one inside it as `symlink_dir_inside_root` or
    `symlink_file_inside_root`, because what it leads to is walked under its own path already
    (or lies in a skipped dir, which a link must not get round), so reading it again would
    ingest the same content twice under a second id, and a link to an ancestor would never end.
    A broken link leads nowhere known: it is a file, quarantined.
    """
    real_root = root.resolve()
    entries: list[FileEntry] = []
    skipped = {"symlink_outside_root": 0, "symlink_dir_inside_root": 0, "symlink_file_inside_root": 0,
               "skipped_dir": 0}
    skip = set(skip_dirs)
    for folder, dirs, files in os.walk(root, followlinks=False):
        kept_dirs = []
        for name in sorted(dirs):
            if name in skip:
                skipped["skipped_dir"] += 1
                continue
            path = Path(folder, name)
            if path.is_symlink():  # os.walk lists a link to a directory among the dirs, and does not descend
                inside = Path(os.path.realpath(path)).is_relative_to(real_root)
                skipped["symlink_dir_inside_root" if inside else "symlink_outside_root"] += 1
                continue
            kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(files):
            path = Path(folder, name)
            if path.is_symlink():
                target = Path(os.path.realpath(path))
                if target.exists():
                    inside = target.is_relative_to(real_root)
                    skipped["symlink_file_inside_root" if inside else "symlink_outside_root"] += 1
                    continue
            size, mtime = _stat(path)
            locator = printable_name(path.relative_to(root).as_posix())
            entries.append(FileEntry(str(path), source, locator, size=size, mtime_ns=mtime))
    return entries, skipped


def record_files_note(spec: str, entries: list[FileEntry]) -> str | None:
    """A note for a directory SOURCE that holds JSONL or Parquet files, or None.

    A directory is read as a tree of documents, one per file, as a code repository is; a
    folder of `.jsonl.gz` shards (what datatrove's readers take) would then give each shard
    as one document, or quarantine it as binary. The walk stays as it is (a repository's
    `.jsonl` data file is one of its files); the user is told how to read the records."""
    found = [e.locator for e in entries if e.locator.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)]
    if not found:
        return None
    suffix = next(s for s in JSONL_SUFFIXES + PARQUET_SUFFIXES if found[0].lower().endswith(s))
    return (f"note: {spec} holds {len(found)} JSONL or Parquet file(s) ({Path(spec, found[0]).as_posix()}"
            f"{', ...' if len(found) > 1 else ''}). A directory's files are read whole, one document each (a compressed "
            "or Parquet one is quarantined as binary); to read their records, name the files as SOURCEs: "
            f"assay ingest {Path(spec, '*' + suffix).as_posix()} ... --out OUT")


def _source_name(spec: str, options: IngestOptions) -> str:
    if options.source_name:
        return options.source_name
    return printable_name(Path(spec.rstrip("/")).resolve().name or spec)


def _check_columns(names: list[str], where: str, options: IngestOptions) -> None:
    if options.text_field not in names:
        raise AssayError(
            f"{where}: no text field '{options.text_field}' (columns: {', '.join(names) or 'none'}); "
            "pass --text-field"
        )


def plan_hf(spec: str, options: IngestOptions) -> Unit:
    """The unit of one `hf:PATH[:split]` SOURCE, once the dataset is known to load.

    It is loaded here, as the reader will load it, so that one that cannot be (an empty folder, no
    such split, no text field) fails before the output's staging folder is made, like a Parquet
    file without its text field. `datasets` keeps what it loaded in its cache (a `save_to_disk`
    folder is memory-mapped), so the reader's second load is cheap.
    """
    from assay.ingest.hf import load_hf_dataset

    body = spec[len(HF_PREFIX):]
    path, _, split = body.partition(":") if not Path(body).exists() else (body, "", "")
    if not path:
        raise AssayError(f"{spec}: expected hf:PATH_OR_NAME[:split]")
    load_hf_dataset(path, split or None, options.text_field)
    local = Path(path)
    size, mtime = 0, 0
    if local.exists():
        for file in sorted(local.rglob("*")) if local.is_dir() else [local]:
            s, m = _stat(file)
            size, mtime = size + s, max(mtime, m)
    source = options.source_name or f"hf:{local.name if local.exists() else path}"
    return Unit(kind="hf", source=source, path=path, split=split or None, size=size, mtime_ns=mtime)


def check_source(spec: str, options: IngestOptions) -> None:
    """Fail fast on a SOURCE that cannot be read: empty, missing, or of unknown format."""
    if not spec.strip():
        # Path("") is ".": an unset shell variable (`assay ingest "$SRC"`) would ingest the whole cwd.
        raise AssayError(f"SOURCE is empty: {spec!r} (an unset shell variable?); name a directory, file, "
                         "hf:PATH or 'demo' (. for the current directory)")
    if spec == DEMO_SOURCE or spec.startswith(HF_PREFIX):
        return  # hf: is checked by loading it, in plan_hf; here as well would load it a third time
    path = Path(spec)
    if not path.exists():
        raise AssayError(f"{spec}: no such file or directory")
    if path.is_dir():
        return
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        try:
            names = pq.read_schema(path).names
        except Exception as exc:  # pyarrow raises several types for bad files
            raise AssayError(f"{spec}: not a readable Parquet file ({exc})") from None
        _check_columns(names, spec, options)
    elif not name.endswith(JSONL_SUFFIXES):
        raise AssayError(
            f"{spec}: unknown format (expected a directory, .jsonl[.gz], .parquet, hf:PATH or 'demo')"
        )


def plan(sources: list[str], options: IngestOptions, *, demo_params=None) -> list[Unit]:
    """Resolve SOURCE arguments into ordered units; unknown or missing sources are errors."""
    if not sources:
        raise AssayError("no SOURCE given")
    units: list[Unit] = []
    named: list[tuple[str, list[Unit]]] = []  # each path SOURCE and its units, to check their ids apart
    for spec in sources:
        if spec == DEMO_SOURCE:
            from assay.ingest.demo import plan_demo

            units.extend(plan_demo(demo_params, options))
            continue
        if spec.startswith(HF_PREFIX):
            units.append(plan_hf(spec, options))
            continue
        check_source(spec, options)
        path = Path(spec)
        source = _source_name(spec, options)
        if path.is_dir():
            entries, skipped = walk_directory(path, source, tuple(options.skip_dirs))
            if note := record_files_note(spec, entries):
                print(note)
            grouped = group_files(entries, "files", source, options.unit_bytes)
            if grouped:
                grouped[0] = Unit(**{**grouped[0].__dict__, "skipped": skipped})
            elif any(skipped.values()):  # nothing to read, but what was passed over is still counted
                grouped = [Unit(kind="files", source=source, skipped=skipped)]
            units.extend(grouped)
            named.append((spec, grouped))
            continue
        size, mtime = _stat(path)
        kind = "parquet" if path.name.lower().endswith(PARQUET_SUFFIXES) else "jsonl"
        units.append(Unit(kind=kind, source=source, path=str(path), size=size, mtime_ns=mtime))
        named.append((spec, units[-1:]))
    _check_ids_apart(named)
    return units


def _check_ids_apart(named: list[tuple[str, list[Unit]]]) -> None:
    """Refuse two SOURCEs whose records would get the same ids.

    An id is (source name, locator): a directory's files are located relative to it and a
    JSONL or Parquet file's records by its file name, and the source name is the last part of
    the path (or --source-name). So `a/corpus` and `b/corpus` holding a `readme.txt` each, or
    one SOURCE given twice, would give two documents one id, which every later stage keys on.
    """
    seen: dict[tuple[str, str], str] = {}
    resolved: dict[Path, str] = {}
    for spec, spec_units in named:
        first = resolved.setdefault(Path(spec).resolve(), spec)
        if first != spec:
            raise AssayError(f"{spec}: given twice (also as {first}); its records would be ingested twice under one id")
        for unit in spec_units:
            pairs = ([(f.source, f.locator) for f in unit.files] if unit.kind == "files"
                     else [(unit.source, Path(unit.path).name)])
            for source, locator in pairs:
                other = seen.setdefault((source, locator), spec)
                if other != spec:
                    raise AssayError(
                        f"{other} and {spec} are both source '{source}' and both hold {locator}: their records' "
                        "ids would collide; ingest them in separate runs with different --source-name, or "
                        "rename one directory")
