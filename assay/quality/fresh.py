"""A fresh labelled set for tier 1: files of this machine that the demo pool never reads.

The demo pool's dev part chose tier 1's settings and its measured part has
been looked at (BENCHMARKS.md), so neither is unseen any more. This set is
read from other files, of kinds the pool's sampler (`assay.ingest.demo`)
never lists, and it is only ever reported on, never tuned on.

**Labels come from provenance only** (the kind of file, by its path),
written down here, in code, before any score of tier 1 was computed on
these files:

good prose (text people wrote to be read), when at least
`assay.quality.pool.MIN_GOOD_CHARS` characters long (shorter ones are
left unlabelled, as in the pool):
- `fresh-licence`: the licence texts of /usr/share/common-licenses;
- `fresh-licence-file`: LICENSE* / COPYING* files of installed wheels
  (`*.dist-info/`, `*.dist-info/licenses/`), one per distinct text;
- `fresh-cmake-doc`: CMake's reStructuredText manual (/usr/share/cmake-*/Help);
- `fresh-package-doc`: README*, *.md and *.rst files shipped inside Python
  packages (site-packages and dist-packages, outside *.dist-info / *.egg-info);
- `fresh-doc-nested`: README*, *.md, *.rst and *.txt files in subfolders
  of /usr/share/doc/<package>/ (the pool reads only the top folder);

junk (machine-written records, tables and manifests), at any length:
- `fresh-wheel-files`: a wheel's INSTALLER, WHEEL, top_level.txt, REQUESTED
  and direct_url.json;
- `fresh-egg-info`: SOURCES.txt, requires.txt, dependency_links.txt and
  top_level.txt of *.egg-info folders;
- `fresh-dpkg-control`: /var/lib/dpkg/info/*.symbols, *.shlibs, *.triggers, *.conffiles;
- `fresh-dpkg-status`: package stanzas of /var/lib/dpkg/status, one document each;
- `fresh-system-table`: /etc/services, /etc/protocols, /etc/mime.types,
  /usr/share/zoneinfo/*.tab, /usr/share/i18n/SUPPORTED, /usr/share/info/dir,
  and *.pem certificate bundles inside Python packages.

Nothing about a file's content decides its label except the length floor
for good prose; content only decides whether a file is read at all (binary,
empty or over `MAX_BYTES` files are skipped, and a text seen before is taken
once), whatever its kind. Files are sampled per kind with a fixed seed from sorted
candidate lists, so the set is the same on the same installation; a kind
this machine lacks is simply absent.
"""

from __future__ import annotations

import gzip
import hashlib
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from assay.quality.pool import GOOD, JUNK, labels_by_source

#: Label of each fresh kind (set by provenance, before any score was seen).
FRESH_LABELS: dict[str, int] = {
    "fresh-licence": GOOD,
    "fresh-licence-file": GOOD,
    "fresh-cmake-doc": GOOD,
    "fresh-package-doc": GOOD,
    "fresh-doc-nested": GOOD,
    "fresh-wheel-files": JUNK,
    "fresh-egg-info": JUNK,
    "fresh-dpkg-control": JUNK,
    "fresh-dpkg-status": JUNK,
    "fresh-system-table": JUNK,
}
#: Documents per kind at most (sampled with `SEED`).
PER_KIND = 60
SEED = 20261201
#: Files larger than this are skipped (a document is a whole file).
MAX_BYTES = 2_000_000

_DOC_SUFFIXES = (".md", ".rst")
_SKIP_DIRS = ("__pycache__",)


def fresh_labels(sources: list[str], lengths: list[int]) -> np.ndarray:
    """GOOD / JUNK / UNLABELLED per document, from its kind and (for good kinds) the length floor."""
    return labels_by_source(sources, lengths, FRESH_LABELS)


def python_roots() -> list[Path]:
    """site-packages of this interpreter and the system's dist-packages."""
    paths = sysconfig.get_paths()
    roots = {Path(paths["purelib"]), Path(paths["platlib"])}
    roots |= {p for p in Path("/usr/lib/python3").glob("dist-packages") if p.is_dir()}
    return sorted(r for r in roots if r.is_dir())


def _is_file(path: Path) -> bool:
    try:
        return path.is_file() and 0 < path.stat().st_size <= MAX_BYTES
    except OSError:
        return False


def _unique(paths: list[Path]) -> list[Path]:
    """One path per real file (symlinks resolved), sorted."""
    seen: dict[Path, Path] = {}
    for path in sorted(paths):
        if _is_file(path):
            seen.setdefault(path.resolve(), path)
    return sorted(seen.values())


def _in_metadata(path: Path, root: Path) -> bool:
    return path.relative_to(root).parts[0].endswith((".dist-info", ".egg-info"))


def _licences() -> list[Path]:
    root = Path("/usr/share/common-licenses")
    return _unique(list(root.iterdir())) if root.is_dir() else []


def _licence_files() -> list[Path]:
    found = []
    for root in python_roots():
        for folder in root.glob("*.dist-info"):
            for pattern in ("LICENSE*", "LICENCE*", "COPYING*", "licenses/**/LICENSE*", "licenses/**/LICENCE*",
                            "licenses/**/COPYING*"):
                found += folder.glob(pattern)
    return _unique(found)


def _cmake_docs() -> list[Path]:
    return _unique([p for root in Path("/usr/share").glob("cmake-*/Help") for p in root.rglob("*.rst")])


def _package_docs() -> list[Path]:
    found = []
    for root in python_roots():
        for path in root.rglob("*"):
            name = path.name
            if not (name.startswith("README") or name.lower().endswith(_DOC_SUFFIXES)):
                continue
            if _in_metadata(path, root) or any(part in _SKIP_DIRS for part in path.parts):
                continue
            found.append(path)
    return _unique(found)


def _nested_docs() -> list[Path]:
    root = Path("/usr/share/doc")
    if not root.is_dir():
        return []
    found = []
    for path in root.glob("*/*/**/*"):
        name = _plain(path.name)
        if name.startswith("README") or name.lower().endswith((*_DOC_SUFFIXES, ".txt")):
            found.append(path)
    return _unique(found)


def _wheel_files() -> list[Path]:
    names = ("INSTALLER", "WHEEL", "top_level.txt", "REQUESTED", "direct_url.json")
    return _unique([p for root in python_roots() for name in names for p in root.glob(f"*.dist-info/{name}")])


def _egg_info() -> list[Path]:
    names = ("SOURCES.txt", "requires.txt", "dependency_links.txt", "top_level.txt")
    return _unique([p for root in python_roots() for name in names for p in root.glob(f"*.egg-info/{name}")])


def _dpkg_control() -> list[Path]:
    root = Path("/var/lib/dpkg/info")
    if not root.is_dir():
        return []
    return _unique([p for p in root.iterdir() if p.suffix in (".symbols", ".shlibs", ".triggers", ".conffiles")])


def _system_tables() -> list[Path]:
    fixed = [Path(p) for p in ("/etc/services", "/etc/protocols", "/etc/mime.types", "/usr/share/i18n/SUPPORTED",
                               "/usr/share/info/dir")]
    fixed += Path("/usr/share/zoneinfo").glob("*.tab")
    fixed += [p for root in python_roots() for p in root.rglob("*.pem")]
    return _unique(fixed)


def _plain(name: str) -> str:
    return name[:-3] if name.endswith(".gz") else name


def _read(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\0" in data[:4096]:
        return None  # binary
    text = data.decode("utf-8", errors="replace")
    return text if text.strip() else None


def _dpkg_stanzas(path: Path = Path("/var/lib/dpkg/status")) -> list[tuple[str, str]]:
    """(locator, stanza) for each package stanza of the dpkg status file."""
    text = _read(path) if _is_file(path) or path.is_file() else None
    if text is None:
        return []
    out = []
    for stanza in text.split("\n\n"):
        first = stanza.strip().split("\n", 1)[0]
        if first.startswith("Package:"):
            out.append((f"dpkg-status/{first.split(':', 1)[1].strip()}", stanza.strip() + "\n"))
    return out


#: Each file kind and how its candidate files are listed (`fresh-dpkg-status` is stanzas of one file).
FILE_KINDS: dict[str, Callable[[], list[Path]]] = {
    "fresh-licence": _licences,
    "fresh-licence-file": _licence_files,
    "fresh-cmake-doc": _cmake_docs,
    "fresh-package-doc": _package_docs,
    "fresh-doc-nested": _nested_docs,
    "fresh-wheel-files": _wheel_files,
    "fresh-egg-info": _egg_info,
    "fresh-dpkg-control": _dpkg_control,
    "fresh-system-table": _system_tables,
}


@dataclass
class FreshDoc:
    id: str
    text: str
    source: str
    path: str


def _sample(rng: random.Random, items: list, k: int) -> list:
    return sorted(rng.sample(items, k)) if len(items) > k else list(items)


def iter_fresh(per_kind: int = PER_KIND, seed: int = SEED) -> Iterator[FreshDoc]:
    """The fresh set's documents (see the module docstring). Identical texts are kept once."""
    rng = random.Random(seed)
    seen: set[bytes] = set()

    def once(text: str) -> bool:
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in seen:
            return False
        seen.add(digest)
        return True

    for kind, lister in FILE_KINDS.items():
        # Sample more than needed: some files turn out binary, empty or duplicates.
        candidates = _sample(rng, lister(), per_kind * 2)
        taken = 0
        for path in candidates:
            if taken >= per_kind:
                break
            text = _read(path)
            if text is None or not once(text):
                continue
            taken += 1
            yield FreshDoc(f"{kind}:{path}", text, kind, str(path))
    for locator, text in _sample(rng, _dpkg_stanzas(), per_kind):
        if once(text):
            yield FreshDoc(f"fresh-dpkg-status:{locator}", text, "fresh-dpkg-status", locator)


def read_fresh(per_kind: int = PER_KIND, seed: int = SEED) -> dict[str, list]:
    """The fresh set as `measure_tier1`'s columns (id, text, source, kind, path), all text."""
    out: dict[str, list] = {"id": [], "text": [], "source": [], "kind": [], "path": []}
    for doc in iter_fresh(per_kind, seed):
        out["id"].append(doc.id)
        out["text"].append(doc.text)
        out["source"].append(doc.source)
        out["kind"].append("text")
        out["path"].append(doc.path)
    return out
