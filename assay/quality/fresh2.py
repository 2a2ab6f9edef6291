"""Fresh set 2: a second labelled set for tier 1, of files no earlier set read.

The demo pool's dev part chose tier 1's settings; its measured part and the
first fresh set (`assay.quality.fresh`) have been looked at since (their
numbers were seen before the markup and records rules were written), so
neither is unseen any more. This set is read from other places of the
machine: another Python installation (pyenv's interpreter, not the venv the
pool and the first fresh set read), other documentation trees (GNU info
manuals, Vim's help, npm's documentation), and other kinds of machine
records and tables. It is only reported on, never tuned on.

**Labels come from provenance only**, written in code here and into the
manifest (`tests/data/tier1_fresh2_manifest.tsv`: path or locator, kind,
label, the rule that set it) before any score was computed on these files:

good prose, when at least `assay.quality.pool.MIN_GOOD_CHARS` characters
long (shorter ones are left unlabelled, as in the pool):
- `fresh2-wheel-description`: the long description (METADATA body) of
  wheels installed in another interpreter's site-packages, for projects that
  neither the venv nor /usr/lib/python3/dist-packages has (so neither the
  pool nor the first fresh set could have read them);
- `fresh2-wheel-doc`: README*, *.md and *.rst files inside those projects'
  packages;
- `fresh2-info-node`: nodes of the GNU info manuals in /usr/share/info (one
  document per node; index nodes, the tag table and the `dir` file are not
  read: they are generated);
- `fresh2-vim-help`: Vim's help files (/usr/share/vim/vim*/doc/*.txt);
- `fresh2-npm-doc`: npm's documentation (Markdown) and the README files of
  the node modules under /usr/lib/node_modules;

junk (machine-written records, manifests and tables), at any length:
- `fresh2-apt-stanza`: package stanzas of apt's package lists
  (/var/lib/apt/lists/*_Packages*), for packages not installed (the first
  fresh set read the installed ones' dpkg status stanzas);
- `fresh2-debconf-templates`: /var/lib/dpkg/info/*.templates;
- `fresh2-doc-base`: /usr/share/doc-base registration records;
- `fresh2-pkgconfig`: pkg-config files (*.pc);
- `fresh2-systemd-unit`: systemd unit files (/lib/systemd/system);
- `fresh2-package-json`: package.json manifests under /usr/lib/node_modules;
- `fresh2-locale-def`: locale definitions (/usr/share/i18n/locales);
- `fresh2-wheel-metadata`: the header block of those wheels' METADATA.

Nothing about a file's content decides its label except the length floor for
good prose; content only decides whether a file is read (binary, empty or
over `MAX_BYTES` files are skipped; a text seen before, or one equal to a
file of the pool's or the first fresh set's candidate lists, is taken once
or not at all). Per kind at most `PER_KIND` documents, sampled with a fixed
seed from sorted candidate lists.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from assay.quality.fresh import MAX_BYTES, python_roots
from assay.quality.pool import GOOD, JUNK, MIN_GOOD_CHARS, UNLABELLED

#: Label of each kind (set by provenance, before any score was seen).
FRESH2_LABELS: dict[str, int] = {
    "fresh2-wheel-description": GOOD,
    "fresh2-wheel-doc": GOOD,
    "fresh2-info-node": GOOD,
    "fresh2-vim-help": GOOD,
    "fresh2-npm-doc": GOOD,
    "fresh2-apt-stanza": JUNK,
    "fresh2-debconf-templates": JUNK,
    "fresh2-doc-base": JUNK,
    "fresh2-pkgconfig": JUNK,
    "fresh2-systemd-unit": JUNK,
    "fresh2-package-json": JUNK,
    "fresh2-locale-def": JUNK,
    "fresh2-wheel-metadata": JUNK,
}
#: Why each kind has its label (written into the manifest).
RULES: dict[str, str] = {
    "fresh2-wheel-description": "good: a wheel's long description (METADATA body), >= 1000 chars",
    "fresh2-wheel-doc": "good: README/*.md/*.rst shipped in a wheel's package, >= 1000 chars",
    "fresh2-info-node": "good: a node of a GNU info manual (not an index node), >= 1000 chars",
    "fresh2-vim-help": "good: a Vim help file, >= 1000 chars",
    "fresh2-npm-doc": "good: npm documentation / a node module's README, >= 1000 chars",
    "fresh2-apt-stanza": "junk: a package stanza of apt's package lists (deb822 record)",
    "fresh2-debconf-templates": "junk: a debconf templates file (deb822 records)",
    "fresh2-doc-base": "junk: a doc-base registration record",
    "fresh2-pkgconfig": "junk: a pkg-config file",
    "fresh2-systemd-unit": "junk: a systemd unit file",
    "fresh2-package-json": "junk: an npm package.json manifest",
    "fresh2-locale-def": "junk: a glibc locale definition table",
    "fresh2-wheel-metadata": "junk: a wheel's METADATA header block",
}
PER_KIND = 40
SEED = 20261202
#: The manifest in the repository: the set's documents and labels, written before any score.
MANIFEST = Path(__file__).resolve().parents[2] / "tests" / "data" / "tier1_fresh2_manifest.tsv"

_DOC_SUFFIXES = (".md", ".rst")
_INFO_NODE = re.compile(r"^File: [^,\n]*,\s+Node: ([^,\n]*)", re.MULTILINE)


def _project(dist_info: Path) -> str:
    return re.sub(r"[-_.]+", "-", dist_info.name.split("-")[0]).lower()


def other_site_packages() -> list[Path]:
    """site-packages of pyenv's interpreters that are not one of `python_roots()` (the earlier sets' roots)."""
    known = {p.resolve() for p in python_roots()}
    found = [p for p in Path("/root/.pyenv/versions").glob("*/lib/python3*/site-packages") if p.is_dir()]
    return sorted(p for p in found if p.resolve() not in known)


def new_dist_infos() -> list[Path]:
    """dist-info folders of other interpreters for projects that no root of the earlier sets has."""
    seen = {_project(p) for root in python_roots() for p in root.glob("*.dist-info")}
    out: dict[str, Path] = {}
    for root in other_site_packages():
        for folder in sorted(root.glob("*.dist-info")):
            name = _project(folder)
            if name not in seen:
                out.setdefault(name, folder)
    return sorted(out.values())


def _ok(path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and 0 < path.stat().st_size <= MAX_BYTES
    except OSError:
        return False


def _files(paths) -> list[Path]:
    seen: dict[Path, Path] = {}
    for path in sorted(paths):
        if _ok(path):
            seen.setdefault(path.resolve(), path)
    return sorted(seen.values())


def _read_bytes(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        elif path.name.endswith(".lz4"):
            lz4 = shutil.which("lz4")
            if lz4 is None:
                return None
            data = subprocess.run([lz4, "-dc", str(path)], check=True, capture_output=True).stdout
    except (OSError, EOFError, gzip.BadGzipFile, subprocess.CalledProcessError):
        return None
    if b"\0" in data[:4096]:
        return None
    text = data.decode("utf-8", errors="replace")
    return text if text.strip() else None


# --- candidates: (locator, how to read it) per kind ---------------------------------------

def _metadata_parts(part: int) -> list[tuple[str, Callable[[], str | None]]]:
    out = []
    for folder in new_dist_infos():
        path = folder / "METADATA"
        if _ok(path):
            out.append((f"{path}#{'body' if part else 'header'}", lambda p=path, i=part: _metadata_part(p, i)))
    return out


def _metadata_part(path: Path, part: int) -> str | None:
    text = _read_bytes(path)
    if text is None:
        return None
    pieces = text.replace("\r\n", "\n").split("\n\n", 1)
    chosen = pieces[part] if len(pieces) > part else ""
    return chosen if chosen.strip() else None


def _file_candidates(paths: list[Path]) -> list[tuple[str, Callable[[], str | None]]]:
    return [(str(p), lambda p=p: _read_bytes(p)) for p in paths]


def _wheel_docs() -> list[Path]:
    found = []
    for folder in new_dist_infos():
        root = folder.parent
        record = folder / "RECORD"
        if not record.is_file():
            continue
        for line in record.read_text(errors="replace").splitlines():
            rel = line.split(",", 1)[0]
            name = rel.rsplit("/", 1)[-1]
            if rel.startswith(("..", "/")) or ".dist-info/" in rel or ".egg-info/" in rel:
                continue
            if name.startswith("README") or name.lower().endswith(_DOC_SUFFIXES):
                found.append(root / rel)
    return _files(found)


def _info_nodes() -> list[tuple[str, Callable[[], str | None]]]:
    out = []
    for path in _files(Path("/usr/share/info").glob("*.info*.gz")):
        text = _read_bytes(path)
        if text is None:
            continue
        for chunk in text.split("\x1f\n"):
            match = _INFO_NODE.search(chunk[:400])
            if match is None or "index" in match.group(1).lower():
                continue
            out.append((f"{path}#{match.group(1).strip()}", lambda c=chunk: c))
    return out


def _apt_stanzas() -> list[tuple[str, Callable[[], str | None]]]:
    installed = set()
    status = Path("/var/lib/dpkg/status")
    if status.is_file():
        installed = set(re.findall(r"^Package: (\S+)", status.read_text(errors="replace"), re.MULTILINE))
    out = []
    for path in sorted(Path("/var/lib/apt/lists").glob("*_Packages*")):
        text = _read_bytes(path)
        if text is None:
            continue
        for stanza in text.split("\n\n"):
            stanza = stanza.strip()
            match = re.match(r"Package: (\S+)", stanza)
            if match and match.group(1) not in installed:
                out.append((f"{path}#{match.group(1)}", lambda s=stanza: s + "\n"))
    return out


def _glob(root: str, pattern: str) -> list[Path]:
    base = Path(root)
    return _files(base.glob(pattern)) if base.is_dir() else []


def _node_files(match: Callable[[str], bool]) -> list[Path]:
    base = Path("/usr/lib/node_modules")
    return _files(p for p in base.rglob("*") if match(p.name)) if base.is_dir() else []


#: Each kind and its candidates: (locator, reader). Listed lazily, kind by kind.
KINDS: dict[str, Callable[[], list[tuple[str, Callable[[], str | None]]]]] = {
    "fresh2-wheel-description": lambda: _metadata_parts(1),
    "fresh2-wheel-doc": lambda: _file_candidates(_wheel_docs()),
    "fresh2-info-node": _info_nodes,
    "fresh2-vim-help": lambda: _file_candidates(_files(Path("/usr/share").glob("vim/vim*/doc/*.txt"))),
    "fresh2-npm-doc": lambda: _file_candidates(_files(
        list(Path("/usr/lib/node_modules").glob("*/docs/**/*.md")) + _node_files(lambda n: n.startswith("README")))),
    "fresh2-apt-stanza": _apt_stanzas,
    "fresh2-debconf-templates": lambda: _file_candidates(_glob("/var/lib/dpkg/info", "*.templates")),
    "fresh2-doc-base": lambda: _file_candidates(_glob("/usr/share/doc-base", "*")),
    "fresh2-pkgconfig": lambda: _file_candidates(_files(
        [p for d in ("/usr/lib/x86_64-linux-gnu/pkgconfig", "/usr/share/pkgconfig", "/usr/lib/pkgconfig")
         for p in Path(d).glob("*.pc")])),
    "fresh2-systemd-unit": lambda: _file_candidates(_glob("/lib/systemd/system", "*.*")),
    "fresh2-package-json": lambda: _file_candidates(_node_files(lambda n: n == "package.json")),
    "fresh2-locale-def": lambda: _file_candidates(_glob("/usr/share/i18n/locales", "*")),
    "fresh2-wheel-metadata": lambda: _metadata_parts(0),
}


def earlier_digests() -> set[bytes]:
    """Digests of every candidate text of the pool's file lists and the first fresh set's (not only the sampled ones)."""
    from assay.ingest import demo
    from assay.quality import fresh

    paths = list(demo.metadata_files())
    for name in ("RECORD", "entry_points.txt"):
        paths += demo.dist_info_files(name)
    paths += demo.doc_files(lambda n: True) + demo.dpkg_manifests()
    for lister in fresh.FILE_KINDS.values():
        paths += lister()
    out = set()
    for path in paths:
        text = fresh._read(Path(path)) if _ok(Path(path)) else None
        if text is not None:
            out.add(_digest(text))
            if Path(path).name == "METADATA":
                for part in text.replace("\r\n", "\n").split("\n\n", 1):
                    out.add(_digest(part))
    for _, stanza in fresh._dpkg_stanzas():
        out.add(_digest(stanza))
    return out


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.strip().encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class Fresh2Doc:
    locator: str
    kind: str
    label: int
    text: str


def label_of(kind: str, text: str) -> int:
    label = FRESH2_LABELS[kind]
    return UNLABELLED if label == GOOD and len(text) < MIN_GOOD_CHARS else label


def iter_fresh2(per_kind: int = PER_KIND, seed: int = SEED) -> Iterator[Fresh2Doc]:
    """The set's documents, kind by kind (see the module docstring)."""
    rng = random.Random(seed)
    seen = earlier_digests()
    for kind, lister in KINDS.items():
        candidates = sorted(lister(), key=lambda c: c[0])
        order = rng.sample(range(len(candidates)), len(candidates))
        taken = 0
        for i in order:
            if taken >= per_kind:
                break
            locator, read = candidates[i]
            text = read()
            if text is None:
                continue
            digest = _digest(text)
            if digest in seen:
                continue
            seen.add(digest)
            taken += 1
            yield Fresh2Doc(locator, kind, label_of(kind, text), text)


def write_manifest(path: str | Path = MANIFEST, per_kind: int = PER_KIND, seed: int = SEED) -> list[Fresh2Doc]:
    """Write the manifest (locator, kind, label, rule, chars, blake2b of the text); returns the documents."""
    docs = list(iter_fresh2(per_kind, seed))
    write_labels(path, docs, RULES)
    return docs


def write_labels(path: str | Path, docs: list[Fresh2Doc], rules: dict[str, str]) -> None:
    """One row per document: its locator, kind, label, the labelling rule of its kind, size and digest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        out = csv.writer(handle, delimiter="\t", lineterminator="\n")
        out.writerow(["locator", "kind", "label", "rule", "chars", "blake2b"])
        for d in docs:
            name = {GOOD: "good", JUNK: "junk", UNLABELLED: "unlabelled"}[d.label]
            rule = rules[d.kind] if d.label != UNLABELLED else "unlabelled: good kind under 1000 chars"
            out.writerow([d.locator, d.kind, name, rule, len(d.text), _digest(d.text).hex()])


def read_manifest(path: str | Path = MANIFEST) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def read_fresh2(path: str | Path = MANIFEST) -> tuple[dict[str, list], np.ndarray, dict[str, int]]:
    """The manifest's documents as `measure_tier1`'s columns, their labels from the manifest, and how many
    rows could not be read back identically on this machine (by kind)."""
    return read_documents(read_manifest(path), KINDS)


def read_documents(rows: list[dict[str, str]], kinds: dict) -> tuple[dict[str, list], np.ndarray, dict[str, int]]:
    """A manifest's rows read back through `kinds`' readers (see `read_fresh2`); fresh set 3 uses it too."""
    texts: dict[str, str] = {}
    by_kind: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    missing: dict[str, int] = {}
    for kind, kind_rows in by_kind.items():
        wanted = {r["locator"] for r in kind_rows}
        for locator, read in kinds[kind]():
            if locator in wanted:
                text = read()
                if text is not None:
                    texts[locator] = text
    out: dict[str, list] = {"id": [], "text": [], "source": [], "kind": [], "path": []}
    labels = []
    value = {"good": GOOD, "junk": JUNK, "unlabelled": UNLABELLED}
    for row in rows:
        text = texts.get(row["locator"])
        if text is None or _digest(text).hex() != row["blake2b"]:
            missing[row["kind"]] = missing.get(row["kind"], 0) + 1
            continue
        out["id"].append(f"{row['kind']}:{row['locator']}")
        out["text"].append(text)
        out["source"].append(row["kind"])
        out["kind"].append("text")
        out["path"].append(row["locator"])
        labels.append(value[row["label"]])
    return out, np.array(labels, dtype=np.int8), missing
