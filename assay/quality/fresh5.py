"""Fresh set 5: a fifth labelled set for tier 1, of files no earlier set and no training source read.

Fresh set 4 (`assay.quality.fresh4`) was unseen until tier1e's run; it is
seen now (tier1f designed its change on it and the earlier sets). tier1f's
change adds junk kinds to the demo pool, which the quality head takes its
negatives from (`assay.ingest.demo.EXTRA_POOL_KINDS`); this set was drawn,
and its manifest written, before that change was made and before any score
was computed on its files, from places that none of the earlier sets, the
demo pool (its new kinds included), the reference set or the demo's code
side reads: the wheels of the local package mirror (/opt/pypi, projects
that no Python installation here has), the Rust standard library's rustdoc
pages, the Perl modules' POD, gsutil's help texts, and other kinds of
machine data. It is only reported on, never tuned on.

**Labels come from provenance only**, written in code here and into the
manifest (`tests/data/tier1_fresh5_manifest.tsv`: locator, kind, label, the
rule that set it, length, blake2b of the text) before any score was
computed on these files:

good prose, when at least `assay.quality.pool.MIN_GOOD_CHARS` characters
long (shorter texts of a good kind are not taken):
- `fresh5-wheel-description`: the long description (METADATA body) of the
  mirror's wheels (/opt/pypi/files, /opt/pypi-more/files), one wheel per
  project, for projects that no Python root of the earlier sets has (the
  venv, the system's dist-packages, pyenv's site-packages);
- `fresh5-wheel-doc`: README*, *.md and *.rst files inside those wheels
  (outside *.dist-info);
- `fresh5-rust-std-doc`: the module pages (`index.html`) of the Rust
  standard library's API documentation (std, core, alloc, proc_macro, test;
  rustup's stable toolchain), their `<main>` text without code listings
  (`assay.quality.fresh4.main_text`; fresh set 4 read the books and guides);
- `fresh5-perl-module-pod`: the POD documentation inside the Perl modules
  of /usr/share/perl5 (`*.pm`; the POD blocks only, not the code; fresh set
  3 read `*.pod` files);
- `fresh5-gsutil-help`: gsutil's help texts (the `_DETAILED_HELP_TEXT`
  string of its commands and additional help topics);

junk (machine data, configuration, indexes), at any length:
- `fresh5-wheel-data`: data files inside those wheels (`*.csv`, `*.tsv`,
  `*.json`, `*.dat`, outside *.dist-info);
- `fresh5-iso-codes`: the iso-codes JSON tables (/usr/share/iso-codes/json);
- `fresh5-glib-schema`: GSettings schemas (/usr/share/glib-2.0/schemas, XML);
- `fresh5-dbus`: D-Bus service, policy and interface files (/usr/share/dbus-1);
- `fresh5-pg-timezoneset`: PostgreSQL's time zone abbreviation sets;
- `fresh5-apt-template`: python-apt's distribution templates;
- `fresh5-npm-cache-index`: npm's cache index entries (~/.npm/_cacache/index-v5);
- `fresh5-git-template`: git's repository templates (hook samples, exclude, description);
- `fresh5-x11-xlc-locale`: X11's XLC_LOCALE tables (fresh set 3 read the Compose files beside them).

Nothing about a file's content decides its label; content only decides
whether a file is read (binary, empty or over `MAX_BYTES` files are skipped;
a text seen before, or one equal to a candidate of the earlier sets or a
row of fresh sets 2's, 3's or 4's manifests, is taken once or not at all).
Per kind at most `PER_KIND` documents, sampled with a fixed seed from sorted
candidate lists (`fresh3.sample_kinds`).
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from assay.quality import fresh2, fresh3, fresh4
from assay.quality.fresh import MAX_BYTES, python_roots
from assay.quality.fresh2 import _file_candidates, _files, _read_bytes, other_site_packages
from assay.quality.pool import GOOD, JUNK

#: Label of each kind (set by provenance, before any score was seen).
FRESH5_LABELS: dict[str, int] = {
    "fresh5-wheel-description": GOOD,
    "fresh5-wheel-doc": GOOD,
    "fresh5-rust-std-doc": GOOD,
    "fresh5-perl-module-pod": GOOD,
    "fresh5-gsutil-help": GOOD,
    "fresh5-wheel-data": JUNK,
    "fresh5-iso-codes": JUNK,
    "fresh5-glib-schema": JUNK,
    "fresh5-dbus": JUNK,
    "fresh5-pg-timezoneset": JUNK,
    "fresh5-apt-template": JUNK,
    "fresh5-npm-cache-index": JUNK,
    "fresh5-git-template": JUNK,
    "fresh5-x11-xlc-locale": JUNK,
}
#: Why each kind has its label (written into the manifest).
RULES: dict[str, str] = {
    "fresh5-wheel-description": "good: a mirror wheel's long description (METADATA body), >= 1000 chars",
    "fresh5-wheel-doc": "good: README/*.md/*.rst inside a mirror wheel, >= 1000 chars",
    "fresh5-rust-std-doc": "good: a Rust standard library module page (rustdoc main text), >= 1000 chars",
    "fresh5-perl-module-pod": "good: the POD documentation of a Perl module (/usr/share/perl5), >= 1000 chars",
    "fresh5-gsutil-help": "good: a gsutil command / help topic text, >= 1000 chars",
    "fresh5-wheel-data": "junk: a data file inside a mirror wheel (csv, tsv, json, dat)",
    "fresh5-iso-codes": "junk: an iso-codes JSON table",
    "fresh5-glib-schema": "junk: a GSettings schema (XML)",
    "fresh5-dbus": "junk: a D-Bus service / policy / interface file",
    "fresh5-pg-timezoneset": "junk: a PostgreSQL time zone abbreviation set",
    "fresh5-apt-template": "junk: a python-apt distribution template",
    "fresh5-npm-cache-index": "junk: an npm cache index entry",
    "fresh5-git-template": "junk: a git repository template file",
    "fresh5-x11-xlc-locale": "junk: an X11 XLC_LOCALE table",
}
PER_KIND = 40
SEED = 20261205
#: The manifest in the repository: the set's documents and labels, written before any score.
MANIFEST = Path(__file__).resolve().parents[2] / "tests" / "data" / "tier1_fresh5_manifest.tsv"

#: Folders fresh set 5 reads (the disjointness test checks the demo's extra pool kinds stay out of them).
ROOTS: tuple[str, ...] = (
    "/opt/pypi/files", "/opt/pypi-more/files", str(fresh4._RUST_HTML), "/usr/share/perl5",
    "/usr/lib/google-cloud-sdk/platform/gsutil/gslib", "/usr/share/iso-codes/json", "/usr/share/glib-2.0/schemas",
    "/usr/share/dbus-1", "/usr/share/postgresql", "/usr/share/python-apt/templates", "/root/.npm/_cacache/index-v5",
    "/usr/share/git-core/templates", "/usr/share/X11/locale",
)
_MIRRORS = (Path("/opt/pypi/files"), Path("/opt/pypi-more/files"))
_RUST_CRATES = ("std", "core", "alloc", "proc_macro", "test")
_GSUTIL = Path("/usr/lib/google-cloud-sdk/platform/gsutil/gslib")
_DOC_SUFFIXES = (".md", ".rst")
_DATA_SUFFIXES = (".csv", ".tsv", ".json", ".dat")
_HELP_TEXT = re.compile(r"_DETAILED_HELP_TEXT\s*=\s*\(?\s*[rRuU]?(\"\"\"|''')(.*?)\1", re.DOTALL)
#: A POD block: from a command paragraph (`=head1`, `=pod`, ...) to `=cut` or the end of the file.
_POD = re.compile(r"^=(?!cut\b)[a-zA-Z].*?(?=^=cut\b|\Z)", re.DOTALL | re.MULTILINE)


def _project(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()


def new_wheels() -> list[Path]:
    """One wheel per project of the mirror (the last in sorted order), for projects that no Python root of
    the earlier sets has (the venv and dist-packages: the pool, fresh set 1; pyenv's: fresh set 2)."""
    known = {_project(p.name) for root in [*python_roots(), *other_site_packages()] for p in root.glob("*.dist-info")}
    out: dict[str, Path] = {}
    for path in _files(p for mirror in _MIRRORS if mirror.is_dir() for p in mirror.glob("*.whl")):
        name = _project(path.name)
        if name not in known:
            out[name] = path  # sorted: a later version replaces an earlier one
    return sorted(out.values())


def _wheel_member(path: Path, member: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as whl:
            data = whl.read(member)
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    if b"\0" in data[:4096]:
        return None
    text = data.decode("utf-8", errors="replace")
    return text if text.strip() else None


def _wheel_members(match: Callable[[str], bool]) -> list[tuple[str, Callable[[], str | None]]]:
    out = []
    for path in new_wheels():
        try:
            with zipfile.ZipFile(path) as whl:
                infos = whl.infolist()
        except (OSError, zipfile.BadZipFile):
            continue
        for info in infos:
            name = info.filename
            if info.is_dir() or not 0 < info.file_size <= MAX_BYTES or ".dist-info/" in name or ".data/" in name:
                continue
            if match(name.rsplit("/", 1)[-1]):
                out.append((f"{path}#{name}", lambda p=path, m=name: _wheel_member(p, m)))
    return out


def _wheel_descriptions() -> list[tuple[str, Callable[[], str | None]]]:
    out = []
    for path in new_wheels():
        try:
            with zipfile.ZipFile(path) as whl:
                names = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        except (OSError, zipfile.BadZipFile):
            continue
        if names:
            out.append((f"{path}#{names[0]}#body", lambda p=path, m=names[0]: _metadata_body(p, m)))
    return out


def _metadata_body(path: Path, member: str) -> str | None:
    text = _wheel_member(path, member)
    if text is None:
        return None
    pieces = text.replace("\r\n", "\n").split("\n\n", 1)
    return pieces[1] if len(pieces) > 1 and pieces[1].strip() else None


def _rust_modules() -> list[tuple[str, Callable[[], str | None]]]:
    paths = [p for crate in _RUST_CRATES for p in fresh4._glob(fresh4._RUST_HTML / crate, "**/index.html")]
    return [(str(p), lambda p=p: fresh4._html_main(p)) for p in paths]


def pod_text(source: str) -> str | None:
    """The POD blocks of a Perl module (its documentation), joined; None when it has none."""
    blocks = [m.group(0).strip() for m in _POD.finditer(source)]
    text = "\n\n".join(b for b in blocks if b)
    return text + "\n" if text else None


def _perl_pods() -> list[tuple[str, Callable[[], str | None]]]:
    paths = fresh4._glob(Path("/usr/share/perl5"), "**/*.pm")
    return [(f"{p}#pod", lambda p=p: _pod(p)) for p in paths]


def _pod(path: Path) -> str | None:
    text = _read_bytes(path)
    return pod_text(text) if text is not None else None


def help_text(source: str) -> str | None:
    """The `_DETAILED_HELP_TEXT` string of a gsutil module; None when it has none."""
    match = _HELP_TEXT.search(source)
    return match.group(2).strip() + "\n" if match and match.group(2).strip() else None


def _gsutil_helps() -> list[tuple[str, Callable[[], str | None]]]:
    paths = fresh4._glob(_GSUTIL, "addlhelp/*.py", "commands/*.py")
    return [(f"{p}#help", lambda p=p: _help(p)) for p in paths]


def _help(path: Path) -> str | None:
    text = _read_bytes(path)
    return help_text(text) if text is not None else None


#: Each kind and its candidates: (locator, reader). Listed lazily, kind by kind.
KINDS: dict[str, Callable[[], list[tuple[str, Callable[[], str | None]]]]] = {
    "fresh5-wheel-description": _wheel_descriptions,
    "fresh5-wheel-doc": lambda: _wheel_members(lambda n: n.startswith("README") or n.lower().endswith(_DOC_SUFFIXES)),
    "fresh5-rust-std-doc": _rust_modules,
    "fresh5-perl-module-pod": _perl_pods,
    "fresh5-gsutil-help": _gsutil_helps,
    "fresh5-wheel-data": lambda: _wheel_members(lambda n: n.lower().endswith(_DATA_SUFFIXES)),
    "fresh5-iso-codes": lambda: _file_candidates(fresh4._glob(Path("/usr/share/iso-codes/json"), "*.json")),
    "fresh5-glib-schema": lambda: _file_candidates(fresh4._glob(Path("/usr/share/glib-2.0/schemas"), "*.xml")),
    "fresh5-dbus": lambda: _file_candidates(fresh4._glob(Path("/usr/share/dbus-1"), "**/*")),
    "fresh5-pg-timezoneset": lambda: _file_candidates(fresh4._glob(Path("/usr/share/postgresql"), "*/timezonesets/*")),
    "fresh5-apt-template": lambda: _file_candidates(fresh4._glob(Path("/usr/share/python-apt/templates"), "*")),
    "fresh5-npm-cache-index": lambda: _file_candidates(fresh4._glob(Path("/root/.npm/_cacache/index-v5"), "**/*")),
    "fresh5-git-template": lambda: _file_candidates(fresh4._glob(Path("/usr/share/git-core/templates"), "**/*")),
    "fresh5-x11-xlc-locale": lambda: _file_candidates(fresh4._glob(Path("/usr/share/X11/locale"), "*/XLC_LOCALE")),
}


def earlier() -> tuple[set[bytes], set[str]]:
    """Digests of every candidate of the pool's and fresh set 1's lists and of fresh sets 2's, 3's and 4's
    manifest rows, and those manifests' locators."""
    digests, locators = fresh4.earlier()
    rows = fresh4.read_manifest()
    return digests | {bytes.fromhex(r["blake2b"]) for r in rows}, locators | {r["locator"] for r in rows}


def iter_fresh5(per_kind: int = PER_KIND, seed: int = SEED) -> Iterator[fresh2.Fresh2Doc]:
    """The set's documents, kind by kind (see the module docstring)."""
    seen, locators = earlier()
    return fresh3.sample_kinds(KINDS, FRESH5_LABELS, seen, locators, per_kind, seed)


def write_manifest(path: str | Path = MANIFEST, per_kind: int = PER_KIND, seed: int = SEED) -> list[fresh2.Fresh2Doc]:
    """Write the manifest (locator, kind, label, rule, chars, blake2b of the text); returns the documents."""
    docs = list(iter_fresh5(per_kind, seed))
    fresh2.write_labels(path, docs, RULES)
    return docs


def read_manifest(path: str | Path = MANIFEST) -> list[dict[str, str]]:
    return fresh2.read_manifest(path)


def read_fresh5(path: str | Path = MANIFEST) -> tuple[dict[str, list], np.ndarray, dict[str, int]]:
    """The manifest's documents as `measure_tier1`'s columns, their labels from the manifest, and how many
    rows could not be read back identically on this machine (by kind)."""
    return fresh2.read_documents(read_manifest(path), KINDS)


if __name__ == "__main__":
    docs = write_manifest()
    print(f"{len(docs)} documents written to {MANIFEST}")
