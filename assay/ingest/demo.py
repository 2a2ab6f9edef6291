"""The demo corpus: real files every installation of Assay already has.

- Python source from the standard library and from installed packages (code);
- package descriptions from `*.dist-info/METADATA` (text of mixed quality);
- the Python reference topics from `pydoc_data` (curated technical prose);
- man pages rendered with `man`, where it exists (curated technical prose).

The sample is drawn with `demo.seed`, from sorted candidate lists, so the
same seed on the same installation always gives the same corpus. The curated
prose (reference topics, man pages) is what tier 1 uses as its positive
reference set.
"""

from __future__ import annotations

import random
import shutil
import sysconfig
from pathlib import Path

from assay.config import DemoParams
from assay.ingest.plan import FileEntry, IngestOptions, Unit, group_files

SOURCE_STDLIB = "python-stdlib"
SOURCE_METADATA = "pypi-metadata"
SOURCE_PYDOC = "pydoc-topics"
SOURCE_MAN = "man"
#: Sources of curated reference prose (the positives of tier 1's head).
REFERENCE_SOURCES = (SOURCE_PYDOC, SOURCE_MAN)

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

    metadata = [_entry(p, SOURCE_METADATA, f"{p.parent.name}/METADATA")
                for p in _sample(rng, metadata_files(), params.package_metadata)]
    units += group_files(metadata, "files", SOURCE_METADATA, options.unit_bytes)

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
