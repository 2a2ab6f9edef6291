"""What made a dataset: Assay's code and the packages it ran on, recorded in every manifest.

A stage resumes a killed run from its staged units (:mod:`assay.staging`), and those units hold
verdicts. If the code or the packages changed in between (a bug fixed in a filter, a
``pip install -U`` of torch or transformers), resuming would publish one dataset made of two
programs' verdicts under one manifest. So the staging marker carries this record, and a run whose
record differs starts over and says what changed.

A finished dataset is judged by its inputs and params alone (its fingerprint), as DVC judges a
stage by its deps and params: a new installation does not rebuild it by itself. It is rebuilt
when the run asks to (``--overwrite``, which ``dvc repro -f`` passes), and kept with a note
otherwise; its manifest says which installation made it either way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import platform
import re
from functools import lru_cache
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import assay

#: The packages whose code makes the verdicts: their sources are hashed, not their version strings,
#: since an editable install or a local edit keeps the version and changes the code.
CODE_PACKAGES = ("assay", "filters", "flows", "training")
DISTRIBUTION = "assay"


def code_digest(packages: tuple[str, ...] = CODE_PACKAGES) -> str:
    """A hash of the Python sources of `packages`, by path relative to each package and content."""
    digest = hashlib.blake2b(digest_size=8)
    for name in packages:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for file in sorted(Path(root).rglob("*.py")):
                digest.update(f"{name}/{file.relative_to(root).as_posix()}\0".encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()


def requirement_versions(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """The installed version of every package `distribution` requires (extras left out), by name;
    ``"missing"`` for one that is not installed. Empty when `distribution` itself is not installed
    (sources run from a checkout on PYTHONPATH): the code digest still names the code."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    versions = {}
    for requirement in requirements:
        if "extra ==" in requirement.replace('"', "").replace("'", ""):
            continue  # an optional extra: dev tools, engines; they make no verdict
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return dict(sorted(versions.items()))


@lru_cache(maxsize=1)
def _current() -> tuple[tuple[str, Any], ...]:
    record = {
        "assay": assay.__version__,
        "code": code_digest(),
        "python": platform.python_version(),
        "packages": requirement_versions(),
    }
    return tuple(record.items())


def installation() -> dict[str, Any]:
    """This process's installation: Assay's version and code digest, Python's version, and the
    version of each package Assay requires. Computed once per process (the code a process runs
    does not change under it, whatever happens to the files)."""
    return {key: dict(value) if isinstance(value, dict) else value for key, value in _current()}


def differences(before: dict[str, Any] | None, after: dict[str, Any]) -> list[str]:
    """What changed from `before` to `after`, one short phrase each ("torch 2.12.0 -> 2.13.0");
    a missing `before` (made before installations were recorded) is one phrase too."""
    if not isinstance(before, dict):
        return ["the earlier run recorded no installation"]
    changes = []
    for key in ("assay", "code", "python"):
        if before.get(key) != after.get(key):
            label = "Assay's code" if key == "code" else key.capitalize() if key == "python" else "Assay"
            changes.append(f"{label} {before.get(key)} -> {after.get(key)}")
    old, new = before.get("packages") or {}, after.get("packages") or {}
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            changes.append(f"{name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}")
    return changes


def describe(record: dict[str, Any], packages: Sequence[str]) -> str:
    """A record in one line for people: "Assay 0.1.0 (code ...), Python 3.11.7", then each of
    `packages` the record holds, in that order ("torch 2.13.0+cpu")."""
    versions = record.get("packages") or {}
    return (f"Assay {record.get('assay')} (code {record.get('code')}), Python {record.get('python')}"
            + "".join(f", {name} {versions[name]}" for name in packages if name in versions))
