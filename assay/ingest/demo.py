"""The demo corpus: real files every installation of Assay already has.

Code:
- Python source from the standard library and from installed packages.

Text, as two separate sets (the GPT-3 recipe: a reference set trains the
quality head, a different, unfiltered pool is what gets filtered):
- the reference set, curated technical prose: the Python reference topics
  from `pydoc_data` and man pages rendered with `man` (where it exists);
- the pool, everything else: files of software installed here, good prose
  and machine junk mixed as they come. Each kind is its own source (the
  labels, set by provenance before any score was seen, are in
  `assay.quality.pool`):
  - `pypi-description`: the long description of a wheel's METADATA (its body);
  - `pypi-metadata`: the header block of the same METADATA files;
  - `pypi-record`, `pypi-entry-points`: `*.dist-info/RECORD` and `entry_points.txt`;
  - `doc-readme`, `doc-news`: README and NEWS files under /usr/share/doc;
  - `doc-changelog`, `debian-changelog`: upstream `changelog.gz`, and `changelog.Debian.gz`;
  - `doc-copyright`: /usr/share/doc/*/copyright;
  - `dpkg-manifest`: /var/lib/dpkg/info/*.list and *.md5sums (install manifests);
  - `logs`: text files under /var/log;
  - optionally, `EXTRA_POOL_KINDS` (tier1f): machine data of other shapes,
    up to `demo.system_files` of each (default 0: none), so that the head's
    negatives are not only package records and logs: CA certificates (PEM),
    source-highlight's language definitions, fontconfig's configuration
    (XML), udev rules, systemd's tmpfiles/sysusers/sysctl/modprobe fragments,
    autoconf macros (m4) and Tcl's message catalogues. They are drawn with
    their own random generator, so the rest of the corpus is the same sample
    as without them. Measured with 40 and 150 of each, they did not raise the
    head's lowest AUC over the seen labelled sets (BENCHMARKS.md, tier 1).
  Compressed files (.gz, .xz) are decompressed at ingest. A kind this
  machine lacks is simply absent.

The sample is drawn with `demo.seed`, from sorted candidate lists, so the
same seed on the same installation always gives the same corpus.
"""

from __future__ import annotations

import random
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

from assay.config import DemoParams
from assay.ingest.plan import FileEntry, IngestOptions, Unit, group_files

SOURCE_STDLIB = "python-stdlib"
SOURCE_METADATA = "pypi-metadata"
SOURCE_DESCRIPTION = "pypi-description"
SOURCE_RECORD = "pypi-record"
SOURCE_ENTRY_POINTS = "pypi-entry-points"
SOURCE_README = "doc-readme"
SOURCE_NEWS = "doc-news"
SOURCE_CHANGELOG = "doc-changelog"
SOURCE_DEBIAN_CHANGELOG = "debian-changelog"
SOURCE_COPYRIGHT = "doc-copyright"
SOURCE_DPKG = "dpkg-manifest"
SOURCE_LOGS = "logs"
SOURCE_PYDOC = "pydoc-topics"
SOURCE_MAN = "man"
#: Sources of curated reference prose (the positives of tier 1's head; not part of the pool).
REFERENCE_SOURCES = (SOURCE_PYDOC, SOURCE_MAN)

#: tier1f: more junk kinds for the pool (each a source of its own; labels in `assay.quality.pool`), listed
#: from folders of system packages that no labelled set of tier 1 reads (`assay.quality.fresh*`; the
#: disjointness tests check it): source -> (root, glob patterns under it).
EXTRA_POOL_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sys-ca-cert": ("/usr/share/ca-certificates", ("**/*.crt",)),
    "sys-source-highlight": ("/usr/share/source-highlight", ("*",)),
    "sys-fontconfig": ("/usr/share/fontconfig", ("**/*",)),
    "sys-udev-rules": ("/usr/lib/udev/rules.d", ("*.rules",)),
    "sys-conf-fragment": ("/usr/lib", ("tmpfiles.d/*", "sysusers.d/*", "sysctl.d/*", "modprobe.d/*", "binfmt.d/*",
                                       "modules-load.d/*", "environment.d/*")),
    "sys-m4": ("/usr/share/aclocal", ("*.m4",)),
    "sys-tcl-msgs": ("/usr/share/tcltk", ("*/msgs/**/*.msg",)),
}
#: The pool's text sources.
POOL_SOURCES = (SOURCE_DESCRIPTION, SOURCE_METADATA, SOURCE_RECORD, SOURCE_ENTRY_POINTS, SOURCE_README,
                SOURCE_NEWS, SOURCE_CHANGELOG, SOURCE_DEBIAN_CHANGELOG, SOURCE_COPYRIGHT, SOURCE_DPKG, SOURCE_LOGS,
                *EXTRA_POOL_KINDS)
_COMPRESSED = (".gz", ".xz")
#: Markup and binaries are not prose or text junk of the kinds above.
_DOC_SKIP_SUFFIXES = (".html", ".htm", ".css", ".png", ".jpg", ".gif", ".svg", ".pdf", ".js")

MAN_PAGES_PER_UNIT = 64
_MAN_SECTIONS = ("man1", "man5", "man7", "man8")
_SKIP_PARTS = {"__pycache__", "site-packages", "dist-packages", "idlelib", "turtledemo"}


def _sample(rng: random.Random, items: list, k: int) -> list:
    return sorted(rng.sample(items, k)) if len(items) > k else items


def _entry(path: Path, source: str, locator: str, render: str | None = None) -> FileEntry:
    st = path.stat()
    return FileEntry(str(path), source, locator, render=render, size=st.st_size, mtime_ns=st.st_mtime_ns)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts))


def package_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def package_files() -> list[tuple[Path, Path]]:
    files = []
    for root in package_roots():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts or rel.parts[0].endswith((".dist-info", ".egg-info")):
                continue
            files.append((root, path))
    return sorted(files)


def metadata_files() -> list[Path]:
    return sorted(p for root in package_roots() for p in root.glob("*.dist-info/METADATA"))


def dist_info_files(name: str) -> list[Path]:
    return sorted(p for root in package_roots() for p in root.glob(f"*.dist-info/{name}"))


def doc_files(match: Callable[[str], bool], root: Path = Path("/usr/share/doc")) -> list[Path]:
    """Files directly in /usr/share/doc/<package>/ whose name satisfies `match`.

    Package directories are often symlinks to another package's: each real
    file is listed once.
    """
    if not root.is_dir():
        return []
    seen: dict[Path, Path] = {}
    for folder in sorted(root.iterdir()):
        try:
            files = sorted(folder.iterdir()) if folder.is_dir() else []
        except OSError:
            continue
        for path in files:
            name = path.name
            if not match(name) or name.lower().endswith(_DOC_SKIP_SUFFIXES):
                continue
            try:
                if path.is_file():
                    seen.setdefault(path.resolve(), path)
            except OSError:
                continue
    return sorted(seen.values())


def _plain(name: str) -> str:
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return name


def dpkg_manifests(root: Path = Path("/var/lib/dpkg/info")) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.suffix in (".list", ".md5sums") and p.is_file())


def log_files(root: Path = Path("/var/log")) -> list[Path]:
    """Readable, non-empty text logs (binary ones such as wtmp are left out)."""
    found = []
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_size == 0:
                continue
            with open(path, "rb") as handle:
                head = handle.read(4096)
        except OSError:
            continue
        if path.suffix in _COMPRESSED or b"\0" not in head:
            found.append(path)
    return found


def extra_files(source: str) -> list[Path]:
    """The candidate files of one of `EXTRA_POOL_KINDS` (regular, non-empty, each real file once)."""
    root, patterns = EXTRA_POOL_KINDS[source]
    base = Path(root)
    if not base.is_dir():
        return []
    seen: dict[Path, Path] = {}
    for path in sorted(p for pattern in patterns for p in base.glob(pattern)):
        try:
            if path.is_file() and path.stat().st_size > 0:
                seen.setdefault(path.resolve(), path)
        except OSError:
            continue
    return sorted(seen.values())


def extra_pool_entries(params: DemoParams) -> list[FileEntry]:
    """Up to `params.system_files` files of each of `EXTRA_POOL_KINDS`, sampled with a generator of their own
    (seeded from `params.seed`), so that adding them leaves the rest of the corpus's sample unchanged."""
    rng = random.Random(f"{params.seed}:extra-pool-kinds")
    entries = []
    for source in EXTRA_POOL_KINDS:
        chosen = _sample(rng, extra_files(source), params.system_files)
        entries += [_entry(p, source, p.as_posix().lstrip("/")) for p in chosen]
    return entries


def _text_entry(path: Path, source: str, locator: str) -> FileEntry:
    """A file of the pool; compressed ones are decompressed (sized at 4x for unit planning)."""
    st = path.stat()
    compressed = path.name.endswith(_COMPRESSED)
    return FileEntry(str(path), source, _plain(locator) if compressed else locator,
                     render="decompress" if compressed else None,
                     size=st.st_size * (4 if compressed else 1), mtime_ns=st.st_mtime_ns)


def pool_entries(params: DemoParams, rng: random.Random) -> list[FileEntry]:
    """The text pool's files, sampled per kind (see the module docstring)."""
    entries: list[FileEntry] = []
    for path in _sample(rng, metadata_files(), params.package_metadata):
        st = path.stat()
        for source, render in ((SOURCE_METADATA, "message-headers"), (SOURCE_DESCRIPTION, "message-body")):
            entries.append(FileEntry(str(path), source, f"{path.parent.name}/METADATA", render=render,
                                     size=st.st_size, mtime_ns=st.st_mtime_ns))
    for source, name, count in ((SOURCE_RECORD, "RECORD", params.package_records),
                                (SOURCE_ENTRY_POINTS, "entry_points.txt", params.entry_points)):
        entries += [_entry(p, source, f"{p.parent.name}/{name}") for p in _sample(rng, dist_info_files(name), count)]
    doc_kinds = (
        (SOURCE_README, lambda n: n.startswith("README"), params.doc_readmes),
        (SOURCE_NEWS, lambda n: n.startswith("NEWS"), params.doc_news),
        (SOURCE_CHANGELOG, lambda n: _plain(n) == "changelog", params.doc_changelogs),
        (SOURCE_DEBIAN_CHANGELOG, lambda n: _plain(n).startswith("changelog.Debian"), params.debian_changelogs),
        (SOURCE_COPYRIGHT, lambda n: n == "copyright", params.doc_copyright),
    )
    doc_root = Path("/usr/share/doc")
    for source, match, count in doc_kinds:
        entries += [_text_entry(p, source, p.relative_to(doc_root).as_posix())
                    for p in _sample(rng, doc_files(match, doc_root), count)]
    entries += [_entry(p, SOURCE_DPKG, f"dpkg/{p.name}") for p in _sample(rng, dpkg_manifests(), params.dpkg_manifests)]
    log_root = Path("/var/log")
    entries += [_text_entry(p, SOURCE_LOGS, p.relative_to(log_root).as_posix())
                for p in _sample(rng, log_files(log_root), params.logs)]
    return entries + extra_pool_entries(params)


def man_pages(root: Path = Path("/usr/share/man")) -> list[Path]:
    if shutil.which("man") is None or not root.is_dir():
        return []
    return sorted(p for section in _MAN_SECTIONS for p in (root / section).glob("*") if p.is_file())


def plan_demo(params: DemoParams | None, options: IngestOptions) -> list[Unit]:
    params = params or DemoParams()
    rng = random.Random(params.seed)
    units: list[Unit] = []

    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    stdlib = [_entry(p, SOURCE_STDLIB, p.relative_to(stdlib_root).as_posix())
              for p in _sample(rng, stdlib_files(), params.stdlib_files)]
    units += group_files(stdlib, "files", SOURCE_STDLIB, options.unit_bytes)

    packages = []
    for root, path in _sample(rng, package_files(), params.package_files):
        rel = path.relative_to(root)
        top = rel.parts[0].removesuffix(".py")
        packages.append(_entry(path, f"site-packages/{top}", rel.as_posix()))
    units += group_files(packages, "files", "site-packages", options.unit_bytes)

    pool = pool_entries(params, rng)
    units += group_files(pool, "files", "pool", options.unit_bytes)

    from pydoc_data.topics import topics

    chosen = _sample(rng, sorted(topics), params.pydoc_topics)
    pydoc = [FileEntry(name, SOURCE_PYDOC, name, render="pydoc", size=len(topics[name])) for name in chosen]
    units += group_files(pydoc, "files", SOURCE_PYDOC, options.unit_bytes)

    man_root = Path("/usr/share/man")
    # Rendered man pages are about 4x their gzip size; size units by that.
    man = [FileEntry(str(p), SOURCE_MAN, p.relative_to(man_root).as_posix(), render="man",
                     size=p.stat().st_size * 4, mtime_ns=p.stat().st_mtime_ns)
           for p in _sample(rng, man_pages(man_root), params.man_pages)]
    # Rendering costs a subprocess per page (~60 ms), not bytes: a fixed
    # number of pages per task spreads it over the workers.
    for start in range(0, len(man), MAN_PAGES_PER_UNIT):
        chunk = tuple(man[start:start + MAN_PAGES_PER_UNIT])
        units.append(Unit(kind="files", source=SOURCE_MAN, files=chunk, size=sum(e.size for e in chunk)))
    return units
