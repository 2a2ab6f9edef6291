"""Fresh set 4: a fourth labelled set for tier 1, of files no earlier set read.

Fresh set 3 (`assay.quality.fresh3`) was unseen until its first score; its
misses (the head alone keeps most charmaps, /etc configuration files, polkit
XML and X11 Compose tables; the markup step reads `#` comment lines as
Markdown headings) then motivated the tier1e change (the head's features and
the markup step), so it is seen now, like the pool and fresh sets 1 and 2.
This set was drawn, and its manifest written, before that change was made
and before any score was computed on its files; it was unseen until
tier1e's run, and tier1f chose its settings on it (fresh set 5,
`assay.quality.fresh5`, is the unseen one since). It is read from places none
of the earlier sets, the demo pool or the reference set reads: the Rust
toolchain's HTML books and generated rustdoc indexes (rustup's stable
toolchain), the JDKs under /usr/lib/jvm, the Google Cloud SDK
(/usr/lib/google-cloud-sdk, not a Python root of the earlier sets), CMake's
module sources, X11's keyboard descriptions, the shared MIME database,
ALSA's configuration, Tcl's encodings and Perl's Unicode tables.

**Labels come from provenance only**, written in code here and into the
manifest (`tests/data/tier1_fresh4_manifest.tsv`: locator, kind, label, the
rule that set it, length, blake2b of the text) before any score was
computed on these files:

good prose, when at least `assay.quality.pool.MIN_GOOD_CHARS` characters
long (shorter texts of a good kind are not taken):
- `fresh4-rust-book`: chapters of The Rust Programming Language, the Rust
  Reference and the Rustonomicon (mdBook HTML of rustup's stable toolchain);
- `fresh4-rust-guide`: chapters of the Cargo, rustc, rustdoc, Edition,
  Embedded and Style guides (same);
  for both, the reader takes the text of the page's `<main>` element
  without its `<pre>` code listings, `<script>` and `<style>` (what an
  extractor gives; the markup step drops fenced code in Markdown alike);
- `fresh4-jdk-legal`: the third-party notices and licence texts of the JDKs
  (`/usr/lib/jvm/*/legal/**/*.md`);
- `fresh4-gcloud-doc`: README* and *.md files of the Google Cloud SDK and
  the libraries it vendors (not its bundled Python);
- `fresh4-cmake-module-doc`: the reStructuredText documentation block
  (`#[[.rst: ... ]]`) of each CMake module (`/usr/share/cmake-*/Modules`;
  fresh set 1 read CMake's Help tree, whose module pages only point here);

junk (machine-written or machine-read tables, configuration, schemas and
indexes), at any length:
- `fresh4-xkb`: X11 keyboard descriptions (`/usr/share/X11/xkb`: symbols,
  keycodes, geometry, compat, types);
- `fresh4-mime-type`: the shared MIME database's per-type XML files
  (`/usr/share/mime/<media>/*.xml`);
- `fresh4-alsa-conf`: ALSA configuration files (`/usr/share/alsa/**/*.conf`);
- `fresh4-tcl-encoding`: Tcl's encoding tables (`*.enc`);
- `fresh4-gcloud-yaml`: the Cloud SDK's command and API schema YAML;
- `fresh4-botocore-json`: botocore's service models, paginators, waiters and
  endpoint rule sets (JSON) vendored in the Cloud SDK;
- `fresh4-rustdoc-js`: rustdoc's generated implementor indexes
  (`trait.impl/**/*.js`, `type.impl/**/*.js`);
- `fresh4-perl-unicore`: Perl's Unicode data tables (`unicore/**/*.txt`,
  `*.pl`);
- `fresh4-jdk-properties`: the JDKs' `*.properties` configuration files.

Nothing about a file's content decides its label; content only decides
whether a file is read (binary, empty or over `MAX_BYTES` files are skipped;
a text seen before, or one equal to a candidate of the earlier sets or a
row of fresh set 2's or 3's manifests, is taken once or not at all). Per
kind at most `PER_KIND` documents, sampled with a fixed seed from sorted
candidate lists (`fresh3.sample_kinds`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from assay.quality import fresh2, fresh3
from assay.quality.fresh2 import _file_candidates, _files, _read_bytes
from assay.quality.pool import GOOD, JUNK

#: Label of each kind (set by provenance, before any score was seen).
FRESH4_LABELS: dict[str, int] = {
    "fresh4-rust-book": GOOD,
    "fresh4-rust-guide": GOOD,
    "fresh4-jdk-legal": GOOD,
    "fresh4-gcloud-doc": GOOD,
    "fresh4-cmake-module-doc": GOOD,
    "fresh4-xkb": JUNK,
    "fresh4-mime-type": JUNK,
    "fresh4-alsa-conf": JUNK,
    "fresh4-tcl-encoding": JUNK,
    "fresh4-gcloud-yaml": JUNK,
    "fresh4-botocore-json": JUNK,
    "fresh4-rustdoc-js": JUNK,
    "fresh4-perl-unicore": JUNK,
    "fresh4-jdk-properties": JUNK,
}
#: Why each kind has its label (written into the manifest).
RULES: dict[str, str] = {
    "fresh4-rust-book": "good: a chapter of the Rust book, reference or nomicon (HTML main text), >= 1000 chars",
    "fresh4-rust-guide": "good: a chapter of a Rust guide (cargo, rustc, rustdoc, edition, embedded, style), "
                         ">= 1000 chars",
    "fresh4-jdk-legal": "good: a JDK third-party notice / licence text (legal/*.md), >= 1000 chars",
    "fresh4-gcloud-doc": "good: a README/*.md file of the Google Cloud SDK, >= 1000 chars",
    "fresh4-cmake-module-doc": "good: a CMake module's reStructuredText documentation block, >= 1000 chars",
    "fresh4-xkb": "junk: an X11 keyboard description (xkb)",
    "fresh4-mime-type": "junk: a shared MIME database type file (XML)",
    "fresh4-alsa-conf": "junk: an ALSA configuration file",
    "fresh4-tcl-encoding": "junk: a Tcl encoding table",
    "fresh4-gcloud-yaml": "junk: a Cloud SDK command/schema YAML file",
    "fresh4-botocore-json": "junk: a botocore service model / paginator / waiter / rule set (JSON)",
    "fresh4-rustdoc-js": "junk: a rustdoc-generated implementor index (JS)",
    "fresh4-perl-unicore": "junk: a Perl Unicode data table",
    "fresh4-jdk-properties": "junk: a JDK .properties configuration file",
}
PER_KIND = 40
SEED = 20261204
#: The manifest in the repository: the set's documents and labels, written before any score.
MANIFEST = Path(__file__).resolve().parents[2] / "tests" / "data" / "tier1_fresh4_manifest.tsv"

_RUST_HTML = Path("/root/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html")
_RUST_BOOKS = ("book", "reference", "nomicon")
_RUST_GUIDES = ("cargo", "rustc", "rustdoc", "edition-guide", "embedded-book", "style-guide")
#: mdBook pages that are not chapters: the whole book on one page, the table of contents, the 404 page.
_NOT_CHAPTERS = ("print.html", "toc.html", "404.html")
_GCLOUD = Path("/usr/lib/google-cloud-sdk")
_JVM = Path("/usr/lib/jvm")
#: A CMake bracket comment holding the module's reST documentation.
_CMAKE_DOC = re.compile(r"^#\[(=*)\[\.rst:\n(.*?)\n#?\]\1\]", re.DOTALL | re.MULTILINE)


def _glob(root: Path, *patterns: str) -> list[Path]:
    return _files(p for pattern in patterns for p in root.glob(pattern)) if root.is_dir() else []


class _MainText(HTMLParser):
    """The text of an HTML page's `<main>` element, without code listings, scripts and styles."""

    _SKIP = {"pre", "script", "style"}
    _BLOCK = {"p", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "table", "tr", "dt", "dd", "br",
              "section", "ul", "ol"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth_main = 0
        self.skip = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "main":
            self.depth_main += 1
        elif tag in self._SKIP:
            self.skip += 1
        if self.depth_main and tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "main":
            self.depth_main = max(0, self.depth_main - 1)
        elif tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        if self.depth_main and tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.depth_main and not self.skip:
            self.parts.append(data)


def main_text(html: str) -> str | None:
    """`<main>`'s text (see `_MainText`), blank-line runs folded; None when the page has none."""
    parser = _MainText()
    parser.feed(html)
    lines = [line.strip() for line in "".join(parser.parts).splitlines()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return text + "\n" if text else None


def _html_candidates(books: tuple[str, ...]) -> list[tuple[str, Callable[[], str | None]]]:
    paths = [p for book in books for p in _glob(_RUST_HTML / book, "**/*.html") if p.name not in _NOT_CHAPTERS]
    return [(str(p), lambda p=p: _html_main(p)) for p in paths]


def _html_main(path: Path) -> str | None:
    html = _read_bytes(path)
    return main_text(html) if html is not None else None


def _cmake_docs() -> list[tuple[str, Callable[[], str | None]]]:
    paths = [p for root in sorted(Path("/usr/share").glob("cmake-*/Modules")) for p in _glob(root, "*.cmake")]
    return [(f"{p}#rst", lambda p=p: _cmake_doc(p)) for p in paths]


def _cmake_doc(path: Path) -> str | None:
    text = _read_bytes(path)
    match = _CMAKE_DOC.search(text) if text is not None else None
    return match.group(2).strip() + "\n" if match and match.group(2).strip() else None


def _gcloud_docs() -> list[Path]:
    if not _GCLOUD.is_dir():
        return []
    found = [p for p in _GCLOUD.rglob("*") if p.name.startswith("README") or p.name.endswith(".md")]
    return _files(p for p in found if "bundledpythonunix" not in p.parts)


#: Each kind and its candidates: (locator, reader). Listed lazily, kind by kind.
KINDS: dict[str, Callable[[], list[tuple[str, Callable[[], str | None]]]]] = {
    "fresh4-rust-book": lambda: _html_candidates(_RUST_BOOKS),
    "fresh4-rust-guide": lambda: _html_candidates(_RUST_GUIDES),
    "fresh4-jdk-legal": lambda: _file_candidates(_glob(_JVM, "*/legal/**/*.md")),
    "fresh4-gcloud-doc": lambda: _file_candidates(_gcloud_docs()),
    "fresh4-cmake-module-doc": _cmake_docs,
    "fresh4-xkb": lambda: _file_candidates(_glob(Path("/usr/share/X11/xkb"), "symbols/**/*", "keycodes/**/*",
                                                 "geometry/**/*", "compat/**/*", "types/**/*")),
    "fresh4-mime-type": lambda: _file_candidates([p for p in _glob(Path("/usr/share/mime"), "*/*.xml")
                                                  if p.parent.name != "packages"]),
    "fresh4-alsa-conf": lambda: _file_candidates(_glob(Path("/usr/share/alsa"), "**/*.conf")),
    "fresh4-tcl-encoding": lambda: _file_candidates(_glob(Path("/usr/share/tcltk"), "*/encoding/*.enc")),
    "fresh4-gcloud-yaml": lambda: _file_candidates(_glob(_GCLOUD / "lib", "googlecloudsdk/**/*.yaml",
                                                         "surface/**/*.yaml")),
    "fresh4-botocore-json": lambda: _file_candidates(_glob(_GCLOUD / "lib/third_party/botocore/data", "**/*.json")),
    "fresh4-rustdoc-js": lambda: _file_candidates(_glob(_RUST_HTML, "trait.impl/**/*.js", "type.impl/**/*.js")),
    "fresh4-perl-unicore": lambda: _file_candidates(_glob(Path("/usr/share/perl"), "*/unicore/**/*.txt",
                                                          "*/unicore/**/*.pl")),
    "fresh4-jdk-properties": lambda: _file_candidates(_glob(_JVM, "*/conf/**/*.properties", "*/lib/*.properties")),
}


def earlier() -> tuple[set[bytes], set[str]]:
    """Digests of every candidate of the pool's and fresh set 1's lists and of fresh sets 2's and 3's
    manifest rows, and those manifests' locators."""
    digests, locators = fresh3.earlier()
    rows = fresh3.read_manifest()
    return digests | {bytes.fromhex(r["blake2b"]) for r in rows}, locators | {r["locator"] for r in rows}


def iter_fresh4(per_kind: int = PER_KIND, seed: int = SEED) -> Iterator[fresh2.Fresh2Doc]:
    """The set's documents, kind by kind (see the module docstring)."""
    seen, locators = earlier()
    return fresh3.sample_kinds(KINDS, FRESH4_LABELS, seen, locators, per_kind, seed)


def write_manifest(path: str | Path = MANIFEST, per_kind: int = PER_KIND, seed: int = SEED) -> list[fresh2.Fresh2Doc]:
    """Write the manifest (locator, kind, label, rule, chars, blake2b of the text); returns the documents."""
    docs = list(iter_fresh4(per_kind, seed))
    fresh2.write_labels(path, docs, RULES)
    return docs


def read_manifest(path: str | Path = MANIFEST) -> list[dict[str, str]]:
    return fresh2.read_manifest(path)


def read_fresh4(path: str | Path = MANIFEST) -> tuple[dict[str, list], np.ndarray, dict[str, int]]:
    """The manifest's documents as `measure_tier1`'s columns, their labels from the manifest, and how many
    rows could not be read back identically on this machine (by kind)."""
    return fresh2.read_documents(read_manifest(path), KINDS)


if __name__ == "__main__":
    docs = write_manifest()
    print(f"{len(docs)} documents written to {MANIFEST}")
