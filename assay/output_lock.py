"""One writer per output: a second run into the same OUT fails at once instead of breaking the first.

Two runs into one OUT share its staging folder (`assay.shards.staging_dir`). The second
deletes the unit the first is half-way through in order to start it over, and both then
commit. Measured with two `assay ingest demo --out X` four seconds apart, the second ended in
an internal `FileNotFoundError` on a part the first had moved. Two trainings into one run
folder would interleave their checkpoints. A Prefect UI run triggered twice, or a CLI run
beside a `dvc repro`, is all it takes.

So a run holds an exclusive `flock(2)` on ``.NAME.lock``, beside OUT's real path as its
staging folder is, for as long as it writes. The kernel drops the lock when its holder exits
or dies (kill -9 included), so a crashed run never blocks the next one, and nothing needs to
be cleaned by hand. The file names its holder, for the error the second run prints.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from assay.errors import AssayError

LOCK_SUFFIX = ".lock"


def lock_path(out: str | os.PathLike) -> Path:
    """``.NAME.lock`` beside `out`'s real path: two names of one folder (a symlink) share a lock."""
    path = Path(os.path.realpath(out))
    return path.parent / f".{path.name}{LOCK_SUFFIX}"


@contextmanager
def exclusive_output(out: str | os.PathLike) -> Iterator[Path]:
    """Hold `out`'s lock for the block; an AssayError naming the holder if another run holds it.

    A run that fails or is refused before it writes leaves no folder it made: OUT, and the
    parents its lock file needed, are removed again while they are empty (an OUT refused for
    lying inside an input must not leave a folder in that input).
    """
    path = lock_path(out)
    made = _missing_folders(Path(os.path.realpath(out)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, out)
    except BaseException as exc:
        _remove_empty(made)
        if isinstance(exc, OSError):  # a read-only folder, a full disk: say which file could not be made
            raise AssayError(f"{out}: cannot create its lock file {path} ({exc.strerror or exc})") from None
        raise
    try:
        yield path
    finally:
        # Removed while still held: a run that opened the file just before sees, once it gets
        # the lock, that the name no longer leads to it, and starts over (see _acquire).
        with suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
        _remove_empty(made)


def _missing_folders(out: Path) -> list[Path]:
    """`out` and each parent of it that does not exist yet, deepest first: what making `out` creates."""
    missing = []
    for folder in (out, *out.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders`, deepest first, while each is empty; rmdir(2) refuses one that is not, so
    nothing written is lost, and that folder keeps its parents."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue  # never made: the run stopped before it
        except OSError:
            return


def _acquire(path: Path, out: str | os.PathLike) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # a run refused just now removed the folder it had made
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise AssayError(f"{out}: another run is writing it ({holder}); wait for it to finish, "
                             "or choose another --out") from None
        if _names(path, fd):
            _write_holder(fd)
            return fd
        os.close(fd)  # its holder released and removed it between our open and our lock: take the new one


def _names(path: Path, fd: int) -> bool:
    """Does `path` still lead to the open file `fd`?"""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _write_holder(fd: int) -> None:
    # No command line: its arguments may carry a URL's credentials.
    text = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode("utf-8", errors="replace"), 0)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 1000, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "its holder has just started"
