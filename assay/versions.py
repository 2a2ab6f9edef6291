"""Read a dataset exactly as committed at a git revision, through DVC.

A dataset directory (``data/dedup``…) is a DVC out. At a rev, DVC knows its
content hash (the ``md5`` of the ``.dir`` object in ``dvc.lock``) and serves its
files from the cache or the remote, so training on ``--rev v3`` reads the bytes
that v3 committed, whatever the workspace holds now.

The hash is what a checkpoint records: a resume against other data is refused
(``--allow-data-change`` overrides). A directory that DVC does not track is
read from disk, and its "hash" is a digest of its manifest and every shard's
bytes, so a plain directory still trains, and any edit to it, even one that
keeps every size, still trips the check.

In the workspace (no rev) a tracked directory is read from disk too, and DVC's
hash is its identity only while DVC's status says the workspace holds what
``dvc.lock`` (or the ``.dvc`` file) records. A stage run outside ``dvc repro``
publishes new bytes there before anything records them; such a directory is
identified by its own digest, as an untracked one is, with ``modified`` set.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from assay.errors import AssayError
from assay.schema import DOCUMENT_SCHEMA
from assay.shards import MANIFEST, SHARD_PATTERN, kept_nothing, open_shard, read_manifest, require_complete, shard_batches

__all__ = ["DatasetVersion", "open_version"]


@dataclass
class DatasetVersion:
    """Where a dataset's bytes come from, and the identity a checkpoint records."""

    path: str  # as given by the user
    rev: str | None  # the rev asked for; None = the workspace
    commit: str | None  # the git commit that rev resolves to (None outside git)
    data_hash: str  # DVC's md5 of the directory, or a digest for untracked data
    tracked: bool  # True when data_hash is DVC's: the bytes read are the ones DVC recorded
    shards: list[str] = field(default_factory=list)
    modified: bool = False  # tracked by DVC, but the workspace holds other bytes than it recorded
    #: Whether `commit` records these bytes, so that `git checkout <commit> && dvc pull` gives them
    #: back: a rev's data, or the workspace's when its dvc.lock / .dvc record is the one git committed.
    #: False for untracked or modified data, and for a record `dvc repro` wrote after the last commit.
    at_commit: bool = False
    _fs: Any = field(default=None, repr=False)  # DVCFileSystem, or None for plain files
    _prefix: str = field(default="", repr=False)  # path of the dataset inside the repo
    # Files on disk: each part's (device, inode) when the version was opened and identified. A
    # stage rerun with --overwrite swaps the folder for a new version whose parts have the same names.
    _files: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def identity(self) -> dict:
        return {"path": self.path, "rev": self.rev, "commit": self.commit, "data_hash": self.data_hash,
                "tracked": self.tracked, "modified_since_dvc": self.modified, "commit_records_data": self.at_commit,
                "shards": len(self.shards)}

    def iter_batches(self, columns: list[str] | None = None, batch_rows: int = 1024) -> Iterator[pa.RecordBatch]:
        """Stream the documents' record batches, shard by shard, in name order."""
        for name in self.shards:
            label = f"{self.path}/{name}" + (f" (at {self.rev})" if self.rev else "")
            if self._fs is None:
                path = Path(self.path) / name
                source = open_shard(path, label, DOCUMENT_SCHEMA, columns)
                # Checked once the file is open (the reader keeps it open): what is read is then
                # the part that was hashed, or the run stops rather than train on two versions.
                if self._files and _file_id(path) != self._files.get(name):
                    raise AssayError(f"{label}: replaced since this run opened {self.path} (a stage rerun published "
                                     "a new version); rerun, or pin a version with --rev")
                yield from shard_batches(source, label, batch_size=batch_rows, columns=columns)
            else:
                with self._fs.open(f"{self._prefix}/{name}", "rb") as handle:
                    source = open_shard(handle, label, DOCUMENT_SCHEMA, columns)
                    yield from shard_batches(source, label, batch_size=batch_rows, columns=columns)


def _dvc_root(path: Path) -> Path | None:
    for parent in [path, *path.parents]:
        if (parent / ".dvc").is_dir():
            return parent
    return None


_HASH_CHUNK = 1 << 20


def _file_id(path: Path | int) -> tuple[int, int]:
    return _id_of(os.stat(path))


def _id_of(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _untracked_digest(directory: Path, shards: list[str]) -> tuple[str, dict[str, tuple[int, int]]]:
    """A stand-in for DVC's hash on a directory DVC does not track, and each part's file id.

    Contents, not sizes or mtimes: an edit that keeps a shard's size must still
    change the identity, and a copy of the same data must keep it. Reading every
    byte once is what DVC's own md5 costs too.
    """
    digest = hashlib.blake2b(digest_size=16)
    manifest = directory / MANIFEST
    if manifest.exists():
        digest.update(manifest.read_bytes())
    files = {}
    for name in shards:
        with open(directory / name, "rb") as handle:
            st = os.fstat(handle.fileno())
            files[name] = _id_of(st)  # the file hashed, not whatever the name means later
            digest.update(f"{name}\0{st.st_size}\0".encode())
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return "local-" + digest.hexdigest(), files


def content_digest(directory: str | os.PathLike) -> str:
    """The digest an untracked dataset is named by (``local-...``), of any dataset on disk, tracked or not:
    to compare a version named by its bytes with one DVC names by its md5."""
    directory = Path(directory)
    return _untracked_digest(directory, _shard_names([p.name for p in directory.iterdir()]))[0]


def _shard_names(names: list[str]) -> list[str]:
    return sorted(n for n in names if SHARD_PATTERN.match(n))


def open_version(path: str | os.PathLike, rev: str | None = None) -> DatasetVersion:
    """The dataset at ``path`` as of git ``rev`` (None: the workspace).

    Raises AssayError with the reason when the rev or the path does not exist
    there, or when a rev is asked for a directory DVC does not track.
    """
    given = str(path)
    absolute = Path(path).resolve()
    if rev is None:  # the workspace: a stage may be writing it now
        require_complete(absolute)
    root = _dvc_root(absolute if absolute.exists() else absolute.parent)
    if root is None:
        if rev is not None:
            raise AssayError(f"--rev {rev} needs a DVC repository, and {given} is not inside one")
        return _plain(given, absolute)

    from dvc.api import DVCFileSystem  # imported here: DVC costs about a second to import

    prefix = absolute.relative_to(root).as_posix()
    try:
        fs = DVCFileSystem(str(root), rev=rev)
    except Exception as exc:  # dvc raises scmrepo's RevError and friends
        raise AssayError(f"cannot open {root} at rev {rev!r}: {exc}") from None
    if not fs.exists(prefix):
        where = f"at rev {rev}" if rev else "in the workspace"
        raise AssayError(f"{given} does not exist {where}")
    info = fs.info(prefix)
    dvc_info = info.get("dvc_info") or {}
    commit = _commit(fs, rev)
    if not dvc_info.get("md5"):
        if rev is not None:
            raise AssayError(f"{given} is not tracked by DVC at rev {rev}; commit it with dvc first")
        return _plain(given, absolute, commit)
    if rev is None and absolute.is_dir():
        return _workspace(given, absolute, fs, prefix, dvc_info["md5"], commit)
    names = _shard_names([Path(p).name for p in fs.ls(prefix, detail=False)])
    if not names:
        raise AssayError(f"{given} holds no part-*.parquet shards" + (f" at rev {rev}" if rev else ""))
    return DatasetVersion(given, rev, commit, dvc_info["md5"], True, names, at_commit=commit is not None, _fs=fs,
                          _prefix=prefix)


def _commit(fs: Any, rev: str | None) -> str | None:
    try:
        scm = fs.repo.scm
        return scm.resolve_rev(rev or "HEAD")
    except Exception:  # no git, or no commit yet
        return None


def _no_shards(given: str, absolute: Path) -> AssayError:
    """The error for a folder without shards: a stage's output that kept nothing is not a damaged one."""
    if kept_nothing(absolute):
        stage = read_manifest(absolute).get("stage", "unknown")
        return AssayError(f"{given} holds no documents: its stage ({stage}) kept none "
                          "of its input; its decisions say why (`assay report`, `assay why`)")
    return AssayError(f"{given} holds no part-*.parquet shards")


def _plain(given: str, absolute: Path, commit: str | None = None, *, modified: bool = False) -> DatasetVersion:
    if not absolute.is_dir():
        raise AssayError(f"{given}: " + ("a file, not a dataset directory" if absolute.exists() else "no such dataset directory"))
    names = _shard_names(os.listdir(absolute))
    if not names:
        raise _no_shards(given, absolute)
    data_hash, files = _untracked_digest(absolute, names)
    return DatasetVersion(given, None, commit, data_hash, False, names, modified=modified, _files=files)


def _workspace(given: str, absolute: Path, fs: Any, prefix: str, md5: str, commit: str | None) -> DatasetVersion:
    """A DVC-tracked dataset as the workspace holds it, read from disk like an untracked one.

    DVC's filesystem reads a workspace file from disk, and would name it by the hash DVC
    recorded, whatever the file now holds. So DVC is asked first; its answer is about the files
    whose ids are taken before and after asking. Its status trusts hashes cached by inode, size
    and mtime, so each part's bytes are then checked against the md5 DVC recorded for it.
    """
    names = _shard_names(os.listdir(absolute))
    if not names:
        raise _no_shards(given, absolute)
    before = _file_ids(absolute, names)
    recorded, in_commit = _as_dvc_recorded(fs.repo, prefix)
    if not recorded:
        return _plain(given, absolute, commit, modified=True)
    if _shard_names(os.listdir(absolute)) != names or _file_ids(absolute, names) != before:
        raise AssayError(f"{given} was replaced while it was being opened (a stage published a new version); rerun")
    if not _bytes_as_recorded(fs, absolute, prefix, before, given):
        return _plain(given, absolute, commit, modified=True)
    return DatasetVersion(given, None, commit, md5, True, names, at_commit=in_commit and commit is not None,
                          _files=before)


def _bytes_as_recorded(fs: Any, absolute: Path, prefix: str, files: dict[str, tuple[int, int]], given: str) -> bool:
    """Whether each part holds the bytes whose md5 DVC recorded for it.

    An edit in place that keeps a file's inode, size and mtime (a flipped byte, the mtime set
    back) is "unchanged" to DVC's status, which would then name the new bytes by the old hash.
    Reading every byte once is what an untracked dataset's digest costs too.
    """
    for name, file_id in files.items():
        recorded = ((fs.info(f"{prefix}/{name}") or {}).get("dvc_info") or {}).get("md5")
        with open(absolute / name, "rb") as handle:
            if _id_of(os.fstat(handle.fileno())) != file_id:
                raise AssayError(f"{given} was replaced while it was being opened (a stage published a new "
                                 "version); rerun")
            if hashlib.file_digest(handle, "md5").hexdigest() != recorded:
                return False
    return True


def _file_ids(directory: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    return {name: _file_id(directory / name) for name in names}


def _as_dvc_recorded(repo: Any, prefix: str) -> tuple[bool, bool]:
    """Whether DVC's data status finds the workspace's `prefix` as dvc.lock or its .dvc file records it,
    and whether that record is the one git's HEAD holds (DVC's "committed" changes are those recorded
    since: `dvc repro` or `dvc add` without `git commit`).

    `repo` is the workspace's DVC repository, the one `open_version`'s filesystem already loaded.
    Its index (dvc.lock and the .dvc files) is cached from that load, so the status compares the
    workspace with the record the md5 came from, even if `dvc add` or `dvc repro` records a new
    version in between: the new bytes are found modified, never named by the old md5
    (tests/test_train.py pins this, should a DVC release reload the index here).
    """
    # A relative target is taken from the repository's root (an absolute one from the cwd).
    status = repo.data_status(targets=[prefix])

    def under(entry: str) -> bool:
        entry = entry.rstrip("/")
        return entry == prefix or entry.startswith(prefix + "/") or prefix.startswith(entry + "/")

    if any(under(e) for entries in status["uncommitted"].values() for e in entries):
        return False, False
    since_head = [e for es in status["committed"].values() for e in es]
    seen = [*status["unchanged"], *status["not_in_cache"], *since_head]
    # Not named at all: DVC did not judge it, so it is not taken as recorded.
    return any(under(e) for e in seen), not any(under(e) for e in since_head)
