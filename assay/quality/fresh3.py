"""Fresh set 3: a third labelled set for tier 1, of files no earlier set read.

Fresh set 2 (`assay.quality.fresh2`) was unseen until its first score; its
misses (systemd units and locale files, records that open with an English
comment block) then motivated a change of the records rule, so it is seen
now, like the pool and the first fresh set. This set is read from places
none of them reads: Perl's POD documentation, Python 2.7's standard library
(pyenv's, a version no venv here runs), pyenv's and rustup's own
documentation, IDLE's text files, and other kinds of machine records and
tables (pyenv's build definitions, Maven POMs, /etc configuration files,
glibc charmaps, X11 Compose tables, PostgreSQL's extension control files
and text-search data, groff font descriptions, polkit action files). It was
only reported on until tier1d's run; since then it is seen: tier1e chose the
head's shape features' scale and penalty on it and the other seen sets
(fresh set 4, `assay.quality.fresh4`, is the unseen one).

**Labels come from provenance only**, written in code here and into the
manifest (`tests/data/tier1_fresh3_manifest.tsv`: locator, kind, label, the
rule that set it, length, blake2b of the text) before any score was
computed on these files:

good prose, when at least `assay.quality.pool.MIN_GOOD_CHARS` characters
long (shorter ones are left unlabelled, as in the pool):
- `fresh3-perl-pod`: Perl documentation files (`*.pod` under /usr/share/perl
  and /usr/share/perl5);
- `fresh3-py2-docstring`: the module docstring of each module of Python
  2.7's standard library (pyenv's 2.7, not its site-packages);
- `fresh3-pyenv-doc`: README* and *.md files of pyenv and its plugins (not
  `versions/`, not the `.github` issue/PR forms);
- `fresh3-idle-doc`: IDLE's text files (`idlelib/*.txt`) of pyenv's Pythons
  (one of them the interpreter the venv was made from: the demo's code side
  reads only its `*.py` files);
- `fresh3-rust-doc`: README.md files of rustup's toolchains' `share/doc`;

junk (machine-written records, configuration and tables), at any length:
- `fresh3-python-build-def`: pyenv's python-build definitions;
- `fresh3-maven-pom`: Maven POM files in the local repository (~/.m2);
- `fresh3-etc-conf`: `*.conf` files in /etc and its direct subfolders;
- `fresh3-charmap`: glibc character maps (/usr/share/i18n/charmaps);
- `fresh3-x11-compose`: X11 Compose tables (/usr/share/X11/locale/*/Compose);
- `fresh3-pg-control`: PostgreSQL extension control files;
- `fresh3-pg-tsearch`: PostgreSQL text-search data (stop word lists,
  dictionaries, affix and synonym files);
- `fresh3-groff-font`: groff font description files;
- `fresh3-polkit-action`: polkit action definitions (XML).

The kinds were chosen after fresh set 2's misses were known and while the
records rule was being changed, so some junk kinds are of the shapes that
rule targets (charmaps are close kin of locale files; /etc configuration
files and groff fonts open with comment blocks); others were included
because no rule targets them (POMs and polkit files are XML with English
text, stop word lists are plain words, build definitions are shell).

Nothing about a file's content decides its label; a good kind's texts under
the length floor are not taken (they would be unlabelled); content only
decides whether a file is read (binary, empty or
over `MAX_BYTES` files are skipped; a text seen before, or one equal to a
candidate of the earlier sets, or one in fresh set 2's manifest, is taken
once or not at all). Nothing is read from the venv, so installing an
optional extra does not change the set. Per kind at most `PER_KIND`
documents, sampled with a fixed seed from sorted candidate lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from assay.quality import fresh2
from assay.quality.fresh2 import _digest, _file_candidates, _files, _read_bytes
from assay.quality.pool import GOOD, JUNK, MIN_GOOD_CHARS, UNLABELLED

#: Label of each kind (set by provenance, before any score was seen).
FRESH3_LABELS: dict[str, int] = {
    "fresh3-perl-pod": GOOD,
    "fresh3-py2-docstring": GOOD,
    "fresh3-pyenv-doc": GOOD,
    "fresh3-idle-doc": GOOD,
    "fresh3-rust-doc": GOOD,
    "fresh3-python-build-def": JUNK,
    "fresh3-maven-pom": JUNK,
    "fresh3-etc-conf": JUNK,
    "fresh3-charmap": JUNK,
    "fresh3-x11-compose": JUNK,
    "fresh3-pg-control": JUNK,
    "fresh3-pg-tsearch": JUNK,
    "fresh3-groff-font": JUNK,
    "fresh3-polkit-action": JUNK,
}
#: Why each kind has its label (written into the manifest).
RULES: dict[str, str] = {
    "fresh3-perl-pod": "good: a Perl POD documentation file, >= 1000 chars",
    "fresh3-py2-docstring": "good: a Python 2.7 standard library module's docstring, >= 1000 chars",
    "fresh3-pyenv-doc": "good: a README/*.md file of pyenv or its plugins, >= 1000 chars",
    "fresh3-idle-doc": "good: an IDLE text file (idlelib/*.txt), >= 1000 chars",
    "fresh3-rust-doc": "good: a README.md of a rustup toolchain's share/doc, >= 1000 chars",
    "fresh3-python-build-def": "junk: a pyenv python-build definition",
    "fresh3-maven-pom": "junk: a Maven POM (XML)",
    "fresh3-etc-conf": "junk: a configuration file (/etc/*.conf, /etc/*/*.conf)",
    "fresh3-charmap": "junk: a glibc character map",
    "fresh3-x11-compose": "junk: an X11 Compose table",
    "fresh3-pg-control": "junk: a PostgreSQL extension control file",
    "fresh3-pg-tsearch": "junk: PostgreSQL text-search data (stop words, dictionary, affixes)",
    "fresh3-groff-font": "junk: a groff font description",
    "fresh3-polkit-action": "junk: a polkit action definition (XML)",
}
PER_KIND = 40
SEED = 20261203
#: The manifest in the repository: the set's documents and labels, written before any score.
MANIFEST = Path(__file__).resolve().parents[2] / "tests" / "data" / "tier1_fresh3_manifest.tsv"

_PYENV = Path("/root/.pyenv")
_PY2_LIB = _PYENV / "versions" / "2.7.18" / "lib" / "python2.7"
#: A module docstring: comments and blank lines, then a (raw/unicode) triple-quoted string.
_DOCSTRING = re.compile(r'\A(?:[ \t]*(?:#[^\n]*)?\n)*[ \t]*[rRuU]{0,2}("""|\'\'\')(.*?)\1', re.DOTALL)


def _glob(root: Path, pattern: str) -> list[Path]:
    return _files(root.glob(pattern)) if root.is_dir() else []


def _py2_docstrings() -> list[tuple[str, Callable[[], str | None]]]:
    paths = [p for p in _glob(_PY2_LIB, "**/*.py") if "site-packages" not in p.relative_to(_PY2_LIB).parts]
    return [(f"{p}#docstring", lambda p=p: _docstring(p)) for p in paths]


def _docstring(path: Path) -> str | None:
    text = _read_bytes(path)
    match = _DOCSTRING.match(text) if text is not None else None
    return match.group(2).strip() + "\n" if match and match.group(2).strip() else None


def _pyenv_docs() -> list[Path]:
    if not _PYENV.is_dir():
        return []
    found = []
    for path in _PYENV.rglob("*"):
        parts = path.relative_to(_PYENV).parts
        if parts[0] in ("versions", ".github", "cache", "sources", "shims") or ".github" in parts:
            continue
        if path.name.startswith("README") or path.name.endswith(".md"):
            found.append(path)
    return _files(found)


def _pg(pattern: str) -> list[Path]:
    return _glob(Path("/usr/share/postgresql"), pattern)


#: Each kind and its candidates: (locator, reader). Listed lazily, kind by kind.
KINDS: dict[str, Callable[[], list[tuple[str, Callable[[], str | None]]]]] = {
    "fresh3-perl-pod": lambda: _file_candidates(_glob(Path("/usr/share/perl"), "**/*.pod")
                                                + _glob(Path("/usr/share/perl5"), "**/*.pod")),
    "fresh3-py2-docstring": _py2_docstrings,
    "fresh3-pyenv-doc": lambda: _file_candidates(_pyenv_docs()),
    "fresh3-idle-doc": lambda: _file_candidates(_glob(_PYENV / "versions", "*/lib/python*/idlelib/*.txt")),
    "fresh3-rust-doc": lambda: _file_candidates(_glob(Path("/root/.rustup/toolchains"), "*/share/doc/*/README.md")),
    "fresh3-python-build-def": lambda: _file_candidates(_glob(_PYENV / "plugins/python-build/share/python-build", "*")),
    "fresh3-maven-pom": lambda: _file_candidates(_glob(Path("/root/.m2/repository"), "**/*.pom")),
    "fresh3-etc-conf": lambda: _file_candidates(_glob(Path("/etc"), "*.conf") + _glob(Path("/etc"), "*/*.conf")),
    "fresh3-charmap": lambda: _file_candidates(_glob(Path("/usr/share/i18n/charmaps"), "*")),
    "fresh3-x11-compose": lambda: _file_candidates(_glob(Path("/usr/share/X11/locale"), "*/Compose")),
    "fresh3-pg-control": lambda: _file_candidates(_pg("*/extension/*.control")),
    "fresh3-pg-tsearch": lambda: _file_candidates(_pg("*/tsearch_data/*")),
    "fresh3-groff-font": lambda: _file_candidates(_glob(Path("/usr/share/groff"), "*/font/dev*/*")),
    "fresh3-polkit-action": lambda: _file_candidates(_glob(Path("/usr/share/polkit-1/actions"), "*.policy")),
}


def earlier() -> tuple[set[bytes], set[str]]:
    """Digests of every candidate of the pool's and fresh set 1's lists and of fresh set 2's manifest rows,
    and fresh set 2's locators."""
    digests = fresh2.earlier_digests()
    rows = fresh2.read_manifest()
    digests |= {bytes.fromhex(r["blake2b"]) for r in rows}
    return digests, {r["locator"] for r in rows}


def label_of(kind: str, text: str) -> int:
    label = FRESH3_LABELS[kind]
    return UNLABELLED if label == GOOD and len(text) < MIN_GOOD_CHARS else label


def iter_fresh3(per_kind: int = PER_KIND, seed: int = SEED) -> Iterator[fresh2.Fresh2Doc]:
    """The set's documents, kind by kind (see the module docstring)."""
    seen, locators = earlier()
    return sample_kinds(KINDS, FRESH3_LABELS, seen, locators, per_kind, seed)


def sample_kinds(kinds: dict[str, Callable[[], list[tuple[str, Callable[[], str | None]]]]],
                 labels: dict[str, int], seen: set[bytes], locators: set[str], per_kind: int,
                 seed: int) -> Iterator[fresh2.Fresh2Doc]:
    """Up to `per_kind` documents of each kind, sampled with `seed` from its sorted candidates: not a
    locator of `locators`, not a text whose digest is in `seen` (which grows), and for a good kind not a
    text under the length floor. Fresh sets 3 and 4 are drawn with it."""
    import random

    rng = random.Random(seed)
    for kind, lister in kinds.items():
        candidates = sorted((c for c in lister() if c[0] not in locators), key=lambda c: c[0])
        order = rng.sample(range(len(candidates)), len(candidates))
        taken = 0
        for i in order:
            if taken >= per_kind:
                break
            locator, read = candidates[i]
            text = read()
            # A good kind's text under the length floor would be unlabelled: it is not taken, so that
            # the kind's quota is spent on labelled documents (most of Python 2.7's docstrings are short).
            if text is None or (labels[kind] == GOOD and len(text) < MIN_GOOD_CHARS):
                continue
            digest = _digest(text)
            if digest in seen:
                continue
            seen.add(digest)
            taken += 1
            yield fresh2.Fresh2Doc(locator, kind, labels[kind], text)


def write_manifest(path: str | Path = MANIFEST, per_kind: int = PER_KIND, seed: int = SEED) -> list[fresh2.Fresh2Doc]:
    """Write the manifest (locator, kind, label, rule, chars, blake2b of the text); returns the documents."""
    docs = list(iter_fresh3(per_kind, seed))
    fresh2.write_labels(path, docs, RULES)
    return docs


def read_manifest(path: str | Path = MANIFEST) -> list[dict[str, str]]:
    return fresh2.read_manifest(path)


def read_fresh3(path: str | Path = MANIFEST) -> tuple[dict[str, list], np.ndarray, dict[str, int]]:
    """The manifest's documents as `measure_tier1`'s columns, their labels from the manifest, and how many
    rows could not be read back identically on this machine (by kind)."""
    return fresh2.read_documents(read_manifest(path), KINDS)


if __name__ == "__main__":
    docs = write_manifest()
    print(f"{len(docs)} documents written to {MANIFEST}")
