"""Dataset versions over git history: `assay versions`, `assay diff`, `assay release`.

A version is a git commit that changed the content hash of a ``data/`` output,
as recorded in ``dvc.lock`` (pipeline stages) or a ``*.dvc`` file (``dvc add``).
Everything about an old version is read at its rev through DVC's filesystem
(``dvc.api.DVCFileSystem``), which serves the bytes from the cache or the
remote: nothing is checked out, and the workspace is never touched.

What each output holds comes from the files every stage writes
(``assay.shards``): ``manifest.json`` for its counts, ``part-*.parquet`` for
its documents' ids, and ``decisions/`` for why a document was dropped.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from assay.errors import AssayError
from assay.shards import DECISIONS_DIR, MANIFEST, SHARD_PATTERN

__all__ = ["DataOut", "data_outs", "diff_versions", "list_versions", "release"]

DATA_PREFIX = "data/"
LOCK_FILE = "dvc.lock"
#: What `diff` says of a document that no stage of that rev dropped: it was not in the input at all.
NOT_IN_INPUT = "not in the input"
NEW_INPUT = "new input"


@dataclass(frozen=True)
class DataOut:
    """One DVC-tracked data directory at one rev."""

    stage: str  # the dvc.yaml stage that writes it, or the .dvc file that tracks it
    path: str  # relative to the repo root, posix
    md5: str | None  # DVC's hash of the directory (``….dir``); None when not yet committed


# --------------------------------------------------------------------- git
def _git(root: Path, *args: str, check: bool = True) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssayError("git is not installed") from None
    if check and proc.returncode != 0:
        raise AssayError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def repo_root(repo: str | Path) -> Path:
    """The git work tree holding ``repo``; it must be a DVC repository too."""
    path = Path(repo).resolve()
    if not path.exists():
        raise AssayError(f"{repo}: no such directory")
    if not path.is_dir():
        raise AssayError(f"{repo}: is a file; --repo names the repository's directory")
    proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssayError(f"{repo} is not inside a git repository (versions are git commits)")
    root = Path(proc.stdout.strip())
    if not (root / ".dvc").is_dir():
        raise AssayError(f"{root} is not a DVC repository (no .dvc/): run `dvc init`")
    return root


def resolve_rev(root: Path, rev: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"], cwd=root,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssayError(f"{rev}: no such git revision in {root}")
    return proc.stdout.strip()


def _tags_by_commit(root: Path) -> dict[str, list[str]]:
    # %(*objectname) is the commit an annotated tag points at; empty for a lightweight tag.
    out = _git(root, "for-each-ref", "refs/tags", "--format=%(objectname) %(*objectname) %(refname:short)")
    tags: dict[str, list[str]] = {}
    for line in out.splitlines():
        obj, peeled, name = line.split(" ", 2)
        tags.setdefault(peeled or obj, []).append(name)
    return tags


# ----------------------------------------------------------------- DVC files
def _out_md5(entry: dict) -> str | None:
    # dvc.lock and .dvc files both name a directory's hash `md5` (`hash: md5` names the algorithm).
    return entry.get("md5")


def _show(root: Path, rev: str, path: str) -> str | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def data_outs(root: Path, rev: str, prefix: str = DATA_PREFIX) -> list[DataOut]:
    """The data directories DVC tracks at ``rev``, in pipeline order (dvc.lock's), then ``*.dvc`` files."""
    outs: list[DataOut] = []
    lock = _show(root, rev, LOCK_FILE)
    if lock:
        try:
            stages = (yaml.safe_load(lock) or {}).get("stages", {})
        except yaml.YAMLError as exc:
            raise AssayError(f"{LOCK_FILE} at {rev} is not valid YAML: {exc}") from None
        for stage, entry in stages.items():
            for out in entry.get("outs", []) or []:
                if str(out.get("path", "")).startswith(prefix):
                    outs.append(DataOut(stage, out["path"].rstrip("/"), _out_md5(out)))
    listed = _git(root, "ls-tree", "-r", "--name-only", rev, "--", prefix)
    for dvc_file in sorted(p for p in listed.splitlines() if p.endswith(".dvc")):
        content = yaml.safe_load(_show(root, rev, dvc_file) or "") or {}
        base = Path(dvc_file).parent
        for out in content.get("outs", []) or []:
            outs.append(DataOut(dvc_file, (base / out["path"]).as_posix(), _out_md5(out)))
    return outs


def _open_fs(root: Path, rev: str):
    from dvc.api import DVCFileSystem  # imported here: DVC costs about a second to import

    try:
        return DVCFileSystem(str(root), rev=rev)
    except Exception as exc:  # scmrepo's RevError and friends
        raise AssayError(f"cannot open {root} at rev {rev}: {exc}") from None


def _unavailable(path: str, rev: str, exc: Exception) -> str:
    reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return (f"{path} at {rev[:10]} could not be read: is it neither in the DVC cache nor on the default "
            f"remote? ({reason}); `dvc pull` or `dvc remote add -d` first")


def document_count(fs, path: str, rev: str) -> int:
    """Documents in a dataset at a rev: its manifest's count (every stage's says ``kept``, ingest's
    ``documents``), else the row counts in its shards' Parquet footers (a directory added by hand)."""
    manifest = f"{path}/{MANIFEST}"
    if fs.exists(manifest):
        with fs.open(manifest, "r") as handle:
            recorded = json.load(handle)
        # Another shape (hand-edited): count the shards' rows instead, as for a directory without one.
        counts = recorded.get("counts", {}) if isinstance(recorded, dict) else {}
        counts = counts if isinstance(counts, dict) else {}
        for key in ("kept", "documents"):
            if isinstance(counts.get(key), int):
                return counts[key]
    total = 0
    for shard in _shards(fs, path, rev):
        with fs.open(shard, "rb") as handle:
            total += pq.ParquetFile(handle).metadata.num_rows
    return total


# ------------------------------------------------------------------ versions
@dataclass
class Version:
    commit: str
    date: str
    subject: str
    tags: list[str]
    changed: list[str]  # data paths whose hash differs from the previous version
    outputs: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def list_versions(repo: str | Path = ".", *, counts: bool = True) -> list[Version]:
    """Every commit (first-parent history of HEAD) that changed a ``data/`` output, newest first."""
    root = repo_root(repo)
    if subprocess.run(["git", "rev-parse", "-q", "--verify", "HEAD"], cwd=root, capture_output=True).returncode:
        return []
    log = _git(root, "log", "--first-parent", "--reverse", "--format=%H%x1f%ct%x1f%s", "HEAD", "--",
               LOCK_FILE, "*.dvc")
    versions: list[Version] = []
    previous: dict[str, str | None] = {}
    for line in log.splitlines():
        commit, stamp, subject = line.split("\x1f", 2)
        outs = data_outs(root, commit)
        current = {o.path: o.md5 for o in outs}
        changed = sorted(p for p in current.keys() | previous.keys() if current.get(p) != previous.get(p))
        previous = current
        # An out without a hash is a stage declared but never run at that commit: no data yet.
        if not changed or not any(o.md5 for o in outs):
            continue
        date = datetime.fromtimestamp(int(stamp), tz=timezone.utc).isoformat(timespec="seconds")
        versions.append(Version(commit, date, subject, [], changed,
                                [{"stage": o.stage, "path": o.path, "md5": o.md5, "documents": None} for o in outs]))
    _attach_tags(root, versions)
    if counts:
        _fill_counts(root, versions)
    versions.reverse()
    return versions


def version_grid(versions: list[Version]) -> tuple[list[str], list[list[dict | None]], list[str]]:
    """What `assay versions` and the report's lineage table both draw: the data outputs any version
    holds data for (the columns, first seen first); per version, each column's output, or None where
    that version holds no data there (no such output, or a stage declared but never run); and the
    errors met counting documents, each once."""
    with_data = [{o["path"]: o for o in version.outputs if o.get("md5")} for version in versions]
    paths = list(dict.fromkeys(path for outputs in with_data for path in outputs))
    grid = [[outputs.get(path) for path in paths] for outputs in with_data]
    errors = list(dict.fromkeys(o["error"] for row in grid for o in row if o is not None and o.get("error")))
    return paths, grid, errors


def _attach_tags(root: Path, versions: list[Version]) -> None:
    """A tag names the version its commit holds, so a release tagged on a later commit
    (a docs change after the data commit) still shows against its data."""
    by_signature = {}
    for version in versions:  # oldest first: a reverted-to signature maps to its newest version
        by_signature[_signature(version.outputs)] = version
    for commit, names in _tags_by_commit(root).items():
        signature = _signature([o.__dict__ for o in data_outs(root, commit)])
        if signature in by_signature:
            by_signature[signature].tags.extend(names)
    for version in versions:
        version.tags.sort()


def _signature(outputs: list[dict]) -> tuple:
    return tuple(sorted((o["path"], o["md5"]) for o in outputs if o["md5"]))


def _fill_counts(root: Path, versions: list[Version]) -> None:
    # A directory's manifest is fixed by its hash: read each (path, hash) once across revs.
    seen: dict[tuple[str, str | None], tuple[int | None, str | None]] = {}
    for version in versions:
        fs = None
        for out in version.outputs:
            key = (out["path"], out["md5"])
            if key not in seen:
                if out["md5"] is None:
                    seen[key] = (None, "not committed at this rev")
                else:
                    fs = fs or _open_fs(root, version.commit)
                    try:
                        seen[key] = (document_count(fs, out["path"], version.commit), None)
                    except Exception as exc:  # DVC reports a missing object under several types
                        seen[key] = (None, _unavailable(out["path"], version.commit, exc))
            out["documents"], error = seen[key]
            if error:
                out["error"] = error


# ---------------------------------------------------------------------- diff
def _pick_output(outs_a: list[DataOut], outs_b: list[DataOut], stage: str | None, rev_a: str,
                 rev_b: str) -> tuple[DataOut, DataOut]:
    by_path_a = {o.path: o for o in outs_a}
    if stage is None:
        for out in reversed(outs_b):
            if out.path in by_path_a and out.md5 and by_path_a[out.path].md5:
                return by_path_a[out.path], out
        raise AssayError(f"no data/ output is committed at both {rev_a} and {rev_b}")
    wanted = stage.rstrip("/")
    matches = [o for o in outs_b if wanted in (o.stage, o.path, o.path.removeprefix(DATA_PREFIX))]
    if not matches:
        known = ", ".join(f"{o.stage} ({o.path})" for o in outs_b) or "none"
        raise AssayError(f"--stage {stage}: no such data output at {rev_b}; known: {known}")
    if len(matches) > 1:
        raise AssayError(f"--stage {stage} writes {len(matches)} data outputs; name one: "
                         + ", ".join(o.path for o in matches))
    out_b = matches[0]
    out_a = by_path_a.get(out_b.path)
    if out_a is None or not out_a.md5:
        raise AssayError(f"{out_b.path} is not committed at {rev_a}")
    if not out_b.md5:
        raise AssayError(f"{out_b.path} is not committed at {rev_b}")
    return out_a, out_b


def _shards(fs, path: str, rev: str) -> list[str]:
    try:
        names = fs.ls(path, detail=False)
    except Exception as exc:
        raise AssayError(_unavailable(path, rev, exc)) from None
    return sorted(f"{path}/{Path(n).name}" for n in names if SHARD_PATTERN.match(Path(n).name))


def _read_ids(fs, path: str, rev: str) -> pa.Array:
    tables = []
    for shard in _shards(fs, path, rev):
        try:
            with fs.open(shard, "rb") as handle:
                tables.append(pq.read_table(handle, columns=["id"]))
        except Exception as exc:
            raise AssayError(_unavailable(shard, rev, exc)) from None
    if not tables:
        return pa.array([], pa.string())
    return pa.concat_tables(tables).column("id").combine_chunks()


_DECISION_COLUMNS = ["id", "stage", "reason", "detail", "kept"]
_DROP_COLUMNS = ["id", "stage", "reason", "detail"]


def _drops(fs, outs: list[DataOut], ids: pa.Array, rev: str) -> pa.Table:
    """Drop decisions about ``ids`` in every data output's decisions table at a rev, in pipeline order."""
    parts = []
    if len(ids) == 0:
        return pa.table({c: pa.array([], pa.string()) for c in _DROP_COLUMNS})
    value_set = pc.unique(ids)
    for out in outs:
        if not out.md5:
            continue
        folder = f"{out.path}/{DECISIONS_DIR}"
        if not fs.exists(folder):
            continue
        for shard in _shards(fs, folder, rev):
            try:
                with fs.open(shard, "rb") as handle:
                    for batch in pq.ParquetFile(handle).iter_batches(columns=_DECISION_COLUMNS):
                        mask = pc.and_(pc.invert(batch.column("kept")),
                                       pc.is_in(batch.column("id"), value_set=value_set))
                        table = pa.Table.from_batches([batch.filter(mask)]).select(_DROP_COLUMNS)
                        if table.num_rows:
                            parts.append(table.cast(pa.schema([(n, pa.string()) for n in _DROP_COLUMNS])))
            except Exception as exc:
                raise AssayError(_unavailable(shard, rev, exc)) from None
    if not parts:
        return pa.table({c: pa.array([], pa.string()) for c in _DROP_COLUMNS})
    return pa.concat_tables(parts)


def _explain(ids: pa.Array, drops: pa.Table, fallback: str) -> pa.Table:
    # index_in returns the first match, and drops are in pipeline order: the earliest stage that dropped it.
    index = pc.index_in(ids, value_set=drops.column("id"))
    reason = pc.take(drops.column("reason"), index)
    return pa.table({
        "id": ids,
        "reason": pc.fill_null(reason, fallback),
        "dropped_by": pc.take(drops.column("stage"), index),
        "detail": pc.take(drops.column("detail"), index),
    })


def _sorted(ids: pa.Array) -> pa.Array:
    return pc.take(ids, pc.sort_indices(ids)) if len(ids) else ids


def _counts(table: pa.Table) -> dict[str, int]:
    if table.num_rows == 0:
        return {}
    counted = pc.value_counts(table.column("reason")).to_pylist()
    return dict(sorted(((c["values"], c["counts"]) for c in counted), key=lambda kv: (-kv[1], kv[0])))


def diff_versions(repo: str | Path, rev_a: str, rev_b: str, *, stage: str | None = None,
                  limit: int = 20) -> dict[str, Any]:
    """Documents added to and removed from one stage's dataset between two revs, with the reasons.

    A removed document's reason is the drop recorded in ``rev_b``'s decisions
    (any stage of that rev, the earliest if several), else ``not in the input``.
    An added document's reason is why ``rev_a`` did not have it (its drop there),
    else ``new input``. ``limit`` bounds the rows listed (0: all); counts are always whole.
    """
    if limit < 0:
        raise AssayError("--limit must be >= 0")
    root = repo_root(repo)
    commit_a, commit_b = resolve_rev(root, rev_a), resolve_rev(root, rev_b)
    outs_a, outs_b = data_outs(root, commit_a), data_outs(root, commit_b)
    out_a, out_b = _pick_output(outs_a, outs_b, stage, rev_a, rev_b)
    fs_a, fs_b = _open_fs(root, commit_a), _open_fs(root, commit_b)
    ids_a, ids_b = _read_ids(fs_a, out_a.path, commit_a), _read_ids(fs_b, out_b.path, commit_b)
    added_ids = pc.filter(ids_b, pc.invert(pc.is_in(ids_b, value_set=ids_a)))
    removed_ids = pc.filter(ids_a, pc.invert(pc.is_in(ids_a, value_set=ids_b)))
    added_ids, removed_ids = _sorted(added_ids), _sorted(removed_ids)
    added = _explain(added_ids, _drops(fs_a, outs_a, added_ids, commit_a), NEW_INPUT)
    removed = _explain(removed_ids, _drops(fs_b, outs_b, removed_ids, commit_b), NOT_IN_INPUT)
    shown = removed.num_rows + added.num_rows if limit == 0 else limit
    rows = ([{"change": "removed", **r} for r in removed.slice(0, shown).to_pylist()]
            + [{"change": "added", **r} for r in added.slice(0, max(0, shown - removed.num_rows)).to_pylist()])
    return {
        "path": out_b.path, "stage": out_b.stage,
        "rev_a": rev_a, "commit_a": commit_a, "md5_a": out_a.md5, "documents_a": len(ids_a),
        "rev_b": rev_b, "commit_b": commit_b, "md5_b": out_b.md5, "documents_b": len(ids_b),
        "added": added.num_rows, "removed": removed.num_rows,
        "added_by_reason": _counts(added), "removed_by_reason": _counts(removed),
        "rows": rows, "rows_left_out": added.num_rows + removed.num_rows - len(rows),
    }


# -------------------------------------------------------------------- release
_TAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def release(repo: str | Path, name: str, message: str | None = None) -> dict[str, Any]:
    """Push HEAD's data to the default DVC remote, then tag HEAD (annotated) as ``name``.

    Refused, before anything is written, when the name is taken or malformed,
    tracked files are modified, ``dvc status`` is not clean, or no default
    remote is configured. The push comes first so that a tag never names a
    version whose data is not on the remote.
    """
    root = repo_root(repo)
    if not _TAG_NAME.match(name) or subprocess.run(["git", "check-ref-format", f"refs/tags/{name}"],
                                                   cwd=root).returncode:
        raise AssayError(f"{name!r} is not a valid git tag name")
    if subprocess.run(["git", "rev-parse", "-q", "--verify", f"refs/tags/{name}"], cwd=root,
                      capture_output=True).returncode == 0:
        raise AssayError(f"tag {name} already exists; choose another name")
    head = resolve_rev(root, "HEAD")
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    if dirty:
        listed = ", ".join(line[3:] for line in dirty[:5]) + (" …" if len(dirty) > 5 else "")
        raise AssayError(f"the workspace has uncommitted changes ({listed}); commit them first, "
                         "so that the tag names what you have")

    from dvc.repo import Repo

    with Repo(str(root)) as dvc_repo:
        remote = dvc_repo.config["core"].get("remote")
        remotes = dict(dvc_repo.config.get("remote", {}))
        if not remote:
            if remotes:
                raise AssayError(f"no default DVC remote (configured: {', '.join(remotes)}); "
                                 "`dvc remote default NAME` first")
            raise AssayError("no DVC remote is configured, so a release could not be pulled by anyone: "
                             "`dvc remote add -d NAME URL` (a directory, s3://, gs://, ssh://…) and commit .dvc/config")
        stale = dvc_repo.status()
        if stale:
            raise AssayError(f"`dvc status` is not clean ({', '.join(sorted(stale)[:5])}); "
                             "run `dvc repro` and commit dvc.lock first")
        try:
            pushed = dvc_repo.push(remote=remote)
        except Exception as exc:
            raise AssayError(f"dvc push to {remote} failed: {exc}") from None
    outs = [o for o in data_outs(root, head) if o.md5]
    body = message or f"Assay dataset release {name}"
    body += "\n\n" + "\n".join(f"{o.path} {o.md5} ({o.stage})" for o in outs)
    _git(root, "tag", "-a", name, "-m", body, head)
    return {"name": name, "commit": head, "remote": remote, "url": remotes.get(remote, {}).get("url"),
            "pushed": pushed, "outputs": [o.__dict__ for o in outs]}
