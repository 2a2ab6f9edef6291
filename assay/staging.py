"""Resumable stage output: each task writes a staged unit, then one commit publishes the dataset.

A stage splits its input into units (files, groups of files, shards) and
runs one task per unit. A task writes its documents, decisions and
quarantined records under ``.OUT.staging/<unit>/`` (beside OUT:
:func:`assay.shards.staging_dir`) and, last of all, a ``done.json``. A unit
with ``done.json`` is finished and is never redone, so rerunning a killed
stage resumes where it stopped.

When every unit is done, :func:`commit` renames the staged files into the
dataset's ``part-NNNNN.parquet`` sequence, in unit order, inside
``.OUT.staging/dataset/``, writes the manifest there, and publishes that folder
at OUT in one step (:func:`assay.shards.publish_directory`). Renames are atomic
and the part numbers are computed from the ``done.json`` files, so a commit
killed halfway is finished by the next run, and OUT holds the previous dataset,
or none, until the new one is whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from assay.errors import AssayError
from assay.installation import differences, installation

from assay.schema import DECISION_SCHEMA, QUARANTINE_SCHEMA
from assay.shards import (
    DECISIONS_DIR,
    MANIFEST,
    QUARANTINE_DIR,
    ShardWriter,
    atomic_write_json,
    json_object,
    publish_directory,
    remove_temporaries,
    shard_name,
    staging_dir,
    write_manifest,
)

DONE = "done.json"
#: The staging folder's entries besides the units: the dataset as the commit builds it (stages
#: may write into it first, e.g. dedup's local vector index), a previous dataset set aside while
#: publishing, and the fingerprint of the inputs the staged units belong to with the installation
#: that made them (a JSON object; :func:`prepare`).
BUILT, SET_ASIDE, FINGERPRINT = "dataset", "previous", "fingerprint"


def _staged_name(prefix: str):
    return lambda i: f"{prefix}-{i:05d}.parquet"


#: The streams every stage writes; a stage may add its own (e.g. embeddings).
DOCS, DECISIONS, QUARANTINE = "docs", DECISIONS_DIR, QUARANTINE_DIR


@dataclass
class UnitResult:
    """What one finished unit produced; small, so Prefect can pass it around."""

    unit: str
    files: dict[str, list[str]] = field(default_factory=dict)  # stream → staged file names
    counts: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    skipped: bool = False  # finished by an earlier run

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "skipped"}


class UnitWriter:
    """Collects one unit's outputs (documents, decisions, quarantine, extras) in its staging folder."""

    def __init__(self, out_dir: str | os.PathLike, unit: str, doc_schema: pa.Schema, *, target_bytes: int,
                 extra: dict[str, pa.Schema] | None = None):
        self.unit = unit
        self.path = staging_dir(out_dir) / unit
        if self.path.exists():  # a killed earlier attempt: start the unit over
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        schemas = {DOCS: doc_schema, DECISIONS: DECISION_SCHEMA, QUARANTINE: QUARANTINE_SCHEMA, **(extra or {})}
        self.streams = {
            name: ShardWriter(self.path, schema, target_bytes=target_bytes, name_for=_staged_name(name))
            for name, schema in schemas.items()
        }
        self.counts: Counter[str] = Counter()

    @property
    def docs(self) -> ShardWriter:
        return self.streams[DOCS]

    @property
    def decisions(self) -> ShardWriter:
        return self.streams[DECISIONS]

    @property
    def quarantine(self) -> ShardWriter:
        return self.streams[QUARANTINE]

    def write_decisions(self, decisions: pa.RecordBatch) -> None:
        """Write one batch of a judging stage's decisions and count them: ``input``, ``kept`` and
        ``drop:<reason>`` per reason, the counts every stage's manifest and summary report."""
        self.decisions.write(decisions)
        self.counts["input"] += decisions.num_rows
        self.counts["kept"] += int(pc.sum(decisions.column("kept")).as_py() or 0)
        reasons = pc.drop_null(decisions.column("reason"))
        for entry in pc.value_counts(pc.filter(reasons, pc.not_equal(reasons, ""))).to_pylist():
            self.counts[f"drop:{entry['values']}"] += entry["counts"]

    def finish(self, *, bytes_in: int, seconds: float) -> UnitResult:
        shards = {name: writer.close() for name, writer in self.streams.items()}
        result = UnitResult(
            unit=self.unit,
            files={name: [s.name for s in infos] for name, infos in shards.items()},
            counts=dict(self.counts),
            bytes_in=bytes_in,
            bytes_out=sum(s.bytes for s in shards[DOCS]),
            seconds=seconds,
        )
        atomic_write_json(self.path / DONE, result.to_json())
        return result

    def abort(self) -> None:
        for writer in self.streams.values():
            writer.abort()


def finished_unit(out_dir: str | os.PathLike, unit: str) -> UnitResult | None:
    """The result of a unit finished by an earlier run, or None."""
    done = staging_dir(out_dir) / unit / DONE
    if not done.is_file():
        return None
    data = json.loads(done.read_text())
    return UnitResult(**data, skipped=True)


def building(out_dir: str | os.PathLike) -> Path:
    """The folder a stage's commit turns into `out_dir`; a stage writes there what is not a unit's."""
    return staging_dir(out_dir) / BUILT


DATASET_FORMAT = "assay-dataset/1"


def own_output(out: Path, fmt: str, what: str) -> dict | None:
    """The manifest of `out` when it is an output of ours of format `fmt`; None when `out` is absent or
    an empty folder. Anything else is never written into: a file, a folder of another tool's files, or
    one whose manifest is not ours (not JSON, not UTF-8, not an object, another format) is an error."""
    require_folder_or_absent(out)
    manifest = out / MANIFEST
    if manifest.is_file():
        found = json_object(manifest)
        if found is None or found.get("format") != fmt:
            raise AssayError(f"{out}: its {MANIFEST} is not {what}'s; choose another --out")
        return found
    if out.is_dir() and any(out.iterdir()):
        raise AssayError(f"{out}: exists and is not {what}; choose another --out")
    return None


def require_folder_or_absent(path: Path, remedy: str = "choose another --out") -> None:
    """Refuse a `path` that exists and is not a folder (a file, a FIFO, a link to either), before any
    work: every output is a folder written into, or made, at `path`, and a file there is the user's,
    which a command must neither write over nor fail on halfway with a raw NotADirectoryError.
    `remedy` says what to change (default: the --out). A link to a folder is one; a link to nothing
    does not exist here and passes: :func:`require_not_dangling` refuses it where it matters."""
    if path.exists() and not path.is_dir():
        raise AssayError(f"{path}: is a file, not a directory; {remedy}")


def require_outside(out: Path, inputs: Sequence[str | os.PathLike]) -> None:
    """Refuse an `out` that is a file, or is, holds or lies inside one of the run's `inputs`."""
    require_folder_or_absent(out)
    for source in inputs:
        overlap = overlaps(out, Path(source))
        if overlap:
            raise AssayError(f"{out}: {overlap} the input {source}; choose an --out outside every input")


def require_not_dangling(out: Path) -> None:
    """A symbolic link to nothing is neither a folder to write into nor a name free to take."""
    if out.is_symlink() and not out.exists():
        raise AssayError(f"{out}: is a symbolic link to nothing ({os.readlink(out)}); create what it names, "
                         "or choose another --out")


def require_model_out(out: Path, inputs: Sequence[str | os.PathLike], what: str, ours: Callable[[Path], bool]) -> None:
    """Refuse, before any training, a model's `out` that saving would break or destroy: a file, an
    input (or a folder holding one, or inside one), or a folder holding anything but an earlier
    model of this kind (`ours(out)`), which saving replaces whole."""
    require_not_dangling(out)
    require_outside(out, inputs)
    if out.is_dir() and any(out.iterdir()) and not ours(out):
        raise AssayError(f"{out}: holds something other than {what}, which saving would replace; "
                         "choose another --out")


def prepare(out_dir: str | os.PathLike, fingerprint: str, *, overwrite: bool = False,
            inputs: Sequence[str | os.PathLike] = ()) -> bool:
    """Get `out_dir`'s staging folder ready for a run; returns True when `out_dir` is already complete.

    - a finished dataset with the same fingerprint (inputs + params) is kept;
    - a finished dataset of other inputs is replaced only with `overwrite`, so that a typo in
      --out cannot wipe a dataset, and it stays readable until its successor is published;
    - a folder that is not an Assay dataset (no manifest of ours: another tool's manifest.json
      is not one) is never replaced, nor is a file;
    - an `out_dir` that is one of the run's `inputs`, holds one or lies inside one is refused:
      publishing would replace the input, or a rerun would read its own output;
    - a staging folder left by a killed run of the same inputs is resumed, when the same code
      and packages made it (:mod:`assay.installation`); else the run starts over and says why;
    - a finished dataset of the same inputs made by another installation is kept with a note,
      and rebuilt with `overwrite` (``dvc repro -f`` passes it).
    """
    out = Path(out_dir)
    require_outside(out, inputs)  # first: "is the input" says more than "is not a dataset"
    found = own_output(out, DATASET_FORMAT, "an Assay dataset")
    staging = staging_dir(out)
    if found is not None:
        if found.get("fingerprint") == fingerprint:
            if keep_finished(out, found, overwrite):
                shutil.rmtree(staging, ignore_errors=True)  # a commit killed after publishing leaves it
                return True
        elif not overwrite:
            raise AssayError(
                f"{out}: holds a finished dataset made from other inputs or params; "
                "pass --overwrite to replace it"
            )
    start_staging(out, staging / FINGERPRINT, fingerprint)
    return False


def keep_finished(out: Path, manifest: dict[str, Any], overwrite: bool) -> bool:
    """Whether to keep `out`, finished from this run's very inputs and params (its `manifest`):
    yes, unless another installation made it and the run asks for `overwrite`; a kept dataset of
    another installation gets a note that names what differs."""
    changed = differences(manifest.get("installation"), installation())
    if changed and overwrite:
        print(f"{out}: rebuilding it (--overwrite): another installation made it ({'; '.join(changed)})")
        return False
    if changed:
        print(f"note: {out} is up to date with its inputs and params, but another installation "
              f"made it ({'; '.join(changed)}); pass --overwrite to rebuild it")
    return True


def start_staging(out: Path, marker: Path, fingerprint: str) -> None:
    """Ready `out`'s staging folder, the parent of `marker`, for a run of `fingerprint`: what a
    stopped run staged there is kept for resuming when its marker names the same fingerprint and
    installation, and removed otherwise. Then `marker` names this run's."""
    staging = marker.parent
    if staging.exists():
        earlier = json_object(marker)  # None for a marker of Assay before installations were recorded
        if earlier is None or earlier.get("fingerprint") != fingerprint:
            shutil.rmtree(staging)  # staged units of other inputs cannot be resumed
        elif changed := differences(earlier.get("installation"), installation()):
            # One dataset of two programs' verdicts would pass for one program's.
            print(f"{out}: not resuming the stopped run's staged work, which another installation made "
                  f"({'; '.join(changed)}); starting over")
            shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, {"fingerprint": fingerprint, "installation": installation()})
    remove_temporaries(staging)


def staged_installation(marker: Path) -> dict[str, Any]:
    """The installation that made the staged work `marker` describes (all of it: :func:`start_staging`
    starts over on any other), as the marker recorded it."""
    earlier = json_object(marker) or {}
    return earlier.get("installation") or installation()


def overlaps(out: Path, source: Path) -> str | None:
    """How `out` overlaps the input `source` (compared resolved), or None."""
    if not source.exists():
        return None  # a keyword such as `demo`, or a URL: not a local path
    out, source = out.resolve(), source.resolve()
    if out == source:
        return "is"
    if source.is_relative_to(out):
        return "holds"
    if out.is_relative_to(source) and source.is_dir():
        return "lies inside"
    return None


def commit(out_dir: str | os.PathLike, units: Sequence[str], manifest: dict[str, Any]) -> dict[str, Any]:
    """Move every staged unit into the built dataset, in `units` order, write its manifest, then
    publish it at `out_dir`.

    Documents become ``part-NNNNN.parquet``; every other stream goes to a
    folder of its name (``decisions/``, ``quarantine/``, ``embeddings/``…).
    Returns the manifest with the `shards` list filled in.
    """
    out = Path(out_dir)
    staging = staging_dir(out)
    built = building(out)
    counters: Counter[str] = Counter()
    shards = []
    streams: dict[str, list[str]] = {}  # decisions/, quarantine/...: listed as shards are, for readers to check
    for unit in units:
        result = finished_unit(out, unit)
        if result is None:
            raise RuntimeError(f"unit {unit} is not finished; cannot commit")
        for stream, names in result.files.items():
            folder = built if stream == DOCS else built / stream
            for name in names:
                dest = folder / shard_name(counters[stream])
                counters[stream] += 1
                src = staging / unit / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.exists():
                    os.replace(src, dest)
                elif not dest.exists():
                    raise RuntimeError(f"staged file {src} vanished before commit")
                if stream == DOCS:
                    shards.append(dest.name)
                else:
                    streams.setdefault(stream, []).append(dest.name)
    built.mkdir(parents=True, exist_ok=True)  # a stage whose units all came out empty
    # The format is what prepare trusts.
    manifest = {"format": DATASET_FORMAT, **manifest, "installation": staged_installation(staging / FINGERPRINT),
                "shards": shards, "streams": streams}
    write_manifest(built, manifest)
    publish_directory(built, out, staging / SET_ASIDE)
    shutil.rmtree(staging, ignore_errors=True)
    return manifest
