"""Which programming language is a code file in? Names first, content as the referee.

Ingest labels a file from cheap signals (`assay.languages`: the file name,
the extension, a shebang when the name says nothing). Tier 3 refines that
label with real parsing, in the order of the evidence's strength:

1. A known whole file name (`Makefile`, `Dockerfile`, `CMakeLists.txt`...)
   decides (`assay.languages.CODE_FILENAMES`).
2. A shebang names the interpreter that runs the file, so it overrides the
   extension (a `.py` file starting `#!/bin/sh` is a shell script), except
   within a family where the two agree in substance (a `.ts` file run by
   `node`, a `.pyx` file run by `python`).
3. Otherwise the extension (`CODE_EXTENSIONS`), else the label ingest gave.

With `DomainParams.correct_lang` the content is then checked with the
tree-sitter grammars of `filters.code_syntax`, on the file's first
`SNIFF_BYTES` (cut at a line break):

* a JavaScript/TypeScript file that is one JSON value (it starts with `{` or
  `[` and the strict JSON grammar parses it without an error) is JSON: data
  under a code extension (tree-sitter-javascript happily parses a JSON
  object as an expression statement, so the parse ratio alone cannot tell);
* an *ambiguous* extension (`AMBIGUOUS_EXTENSIONS`: `.h` is C, C++ or
  Objective-C; `.d` is D or a make dependency file; `.ts` is TypeScript or a
  Qt translation in XML) stays with the table's default unless another
  candidate's *cue* occurs (`LANGUAGE_CUES`: `namespace x {`, `template
  <typename`, `std::`, `public:`... for C++; `@interface`, `#import` for
  Objective-C) and that candidate parses at least as well as the default
  and within `max_parse_error_ratio`; so a `.h` that uses classes,
  templates or namespaces becomes C++, and a macro-heavy C header (which
  tree-sitter-c handles worse than tree-sitter-cpp) stays C;
* a file whose language has *confusable* neighbours (`CONFUSABLE`: C that
  is really C++ or Objective-C, JavaScript that is really JSON or TypeScript) is
  relabelled when its claimed language has at least `MIN_DISAGREEMENT` error
  nodes and a neighbour whose cue occurs parses clearly better: at most
  half the error share, and within `max_parse_error_ratio`;
* a code file with no usable name or shebang (ingest's `und`) is tried with
  unmistakable openings (`<?php`, `<?xml`, `<!DOCTYPE html`), then with the
  strict grammars of `GENERIC_CANDIDATES`, and takes the best one that parses
  with at most `max_parse_error_ratio` errors. Permissive grammars (shell,
  Ruby, YAML, PHP's text mode) accept almost any text without an error and
  are left out, so a shell script with neither shebang nor extension stays
  unidentified.

Only `kind == "code"` rows are looked at; other rows keep their label.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from assay.config import DomainParams
from assay.languages import CODE_FILENAMES, LANGUAGES, language_from_path, language_from_shebang
from assay.schema import KIND_CODE
from filters.code_syntax import clip, grammar_for, parse_stats

#: Bytes of a file the content checks parse.
SNIFF_BYTES = 64 * 1024

#: Extension → the languages it may hold, the table's default first.
AMBIGUOUS_EXTENSIONS: dict[str, tuple[str, ...]] = {
    ".h": ("c", "c++", "objective-c"),
    ".d": ("d", "makefile"),
    ".ts": ("typescript", "xml"),
}

#: Language → languages its files are often really written in.
CONFUSABLE: dict[str, tuple[str, ...]] = {
    "c": ("c++", "objective-c"),
    "javascript": ("json", "typescript"),
}

#: Constructs that only the language has, written so that they rarely occur in
#: comments. A content check never picks a candidate whose cue is absent:
#: macro-heavy C (a macro call without `;`) confuses tree-sitter-c more than
#: tree-sitter-cpp, so parse errors alone would make many C headers "C++";
#: and tree-sitter-c accepts a bare `namespace x { }`, so a header whose only
#: C++ is that parses equally well both ways, and the cue decides.
LANGUAGE_CUES: dict[str, re.Pattern[str]] = {
    "c++": re.compile(r"\bnamespace(?:\s+[\w:]+)?\s*\{|\btemplate\s*<\s*(?:class|typename)\b|\bstd::\w|\busing\s+namespace\s"
                      r"|^\s*(?:public|private|protected)\s*:|^\s*class\s+\w+\s*[:{]|\bnullptr\b|\bconstexpr\b", re.M),
    "objective-c": re.compile(r"^\s*@(?:interface|implementation|protocol|end)\b|^\s*#\s*import\s*[<\"]", re.M),
    "typescript": re.compile(r"\binterface\s+\w+\s*\{|\btype\s+\w+\s*=|:\s*(?:string|number|boolean|any|void)\b"
                             r"|\b(?:public|private|readonly)\s+\w+\s*:|\bas\s+const\b"),
    "xml": re.compile(r"^\s*<"),
    "makefile": re.compile(r"^[^\s:#=][^:=\n]*:(?!=)", re.M),
}

#: The content checks relabel a file only if its claimed language has at least
#: this share of error nodes (a near-clean parse is not a disagreement).
MIN_DISAGREEMENT = 0.005

#: Languages a shebang does not override (the extension is more specific).
SHEBANG_FAMILIES: tuple[frozenset[str], ...] = (
    frozenset({"javascript", "typescript"}),
    frozenset({"python", "cython"}),
)

#: Strict grammars tried, in this order, on code with no name, extension or shebang.
GENERIC_CANDIDATES: tuple[str, ...] = ("json", "python", "go", "rust", "java", "c", "c++", "javascript")

#: Openings that name a language outright (checked on the stripped start of unnamed files).
_OPENINGS: tuple[tuple[str, str], ...] = (
    ("<?php", "php"), ("<?xml", "xml"), ("<!doctype html", "html"), ("<html", "html"),
)


def _column(batch, name: str, default=None) -> list:
    if name in batch.schema.names:
        return batch.column(name).to_pylist()
    return [default] * batch.num_rows


def _ratio(data: bytes, lang: str, path: str | None) -> float:
    grammar = grammar_for(lang, path)
    if grammar is None:
        return float("nan")
    stats = parse_stats(data, grammar)
    return float("nan") if stats is None else stats.ratio


def _best(data: bytes, candidates, path: str | None, text: str | None = None) -> tuple[str | None, float]:
    """The candidate parsing with the fewest error nodes (ties: the first); with `text`, cues must hold."""
    best, best_ratio = None, float("inf")
    for lang in candidates:
        if text is not None and lang in LANGUAGE_CUES and not LANGUAGE_CUES[lang].search(text):
            continue
        ratio = _ratio(data, lang, path)
        if ratio == ratio and ratio < best_ratio:  # not NaN, strictly better: ties stay with the first
            best, best_ratio = lang, ratio
    return best, best_ratio


def _clearly_better(claimed: float, ratio: float, params: DomainParams) -> bool:
    """A candidate beats the claimed language: half its error share at most, and within the drop threshold."""
    return claimed >= MIN_DISAGREEMENT and ratio <= 0.5 * claimed and ratio <= params.max_parse_error_ratio


def _extension(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


def _is_json_value(data: bytes) -> bool:
    start = data.lstrip()[:1]
    if start not in (b"{", b"["):
        return False
    stats = parse_stats(data, "json")
    return stats is not None and stats.nodes > 0 and stats.errors == 0 and stats.missing == 0


def identify(text: str, path: str | None, lang: str | None, params: DomainParams | None = None) -> str | None:
    """The language of one code file (see the module's docstring); `lang` is ingest's label."""
    params = params or DomainParams()
    path = path or ""
    name_lang = language_from_path(path) if path else None
    name = path.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if name_lang is not None and (name in CODE_FILENAMES or name.startswith("dockerfile")):
        return name_lang
    shebang = language_from_shebang(text[:256].split("\n", 1)[0]) if text.startswith("#!") else None
    ext = _extension(path)
    if shebang is not None and not any(shebang in f and name_lang in f for f in SHEBANG_FAMILIES):
        base = shebang
    elif name_lang is not None:
        base = name_lang
    elif lang in LANGUAGES:
        base = lang
    else:
        base = None
    if not params.correct_lang:
        return base if base is not None else lang

    data = clip(text.encode("utf-8", "surrogatepass"), SNIFF_BYTES)
    if base is None:
        head = text.lstrip()[:32].lower()
        for opening, opened in _OPENINGS:
            if head.startswith(opening):
                return opened
        best, ratio = _best(data, GENERIC_CANDIDATES, None)
        return best if best is not None and ratio <= params.max_parse_error_ratio else lang
    if base in ("javascript", "typescript") and _is_json_value(data):
        return "json"
    if shebang is None and ext in AMBIGUOUS_EXTENSIONS and base == name_lang:
        # An ambiguous extension: a candidate whose cue occurs wins if it parses at least as well.
        sniff = data.decode("utf-8", "replace")
        alternatives = tuple(c for c in AMBIGUOUS_EXTENSIONS[ext] if c != base)
        if any(LANGUAGE_CUES[c].search(sniff) for c in alternatives if c in LANGUAGE_CUES):
            claimed = _ratio(data, base, path)
            best, ratio = _best(data, alternatives, path, sniff)
            if best is not None and ratio <= params.max_parse_error_ratio and not ratio > claimed:
                return best
        return base
    if base in CONFUSABLE:
        claimed = _ratio(data, base, path)
        if claimed >= MIN_DISAGREEMENT:  # NaN compares False: no grammar, no evidence
            best, ratio = _best(data, CONFUSABLE[base], path, data.decode("utf-8", "replace"))
            if best is not None and _clearly_better(claimed, ratio, params):
                return best
    return base


def identify_languages(batch: pa.RecordBatch, params: DomainParams | None = None) -> tuple[list[str], np.ndarray]:
    """(lang, changed) for every row: the refined language and whether it differs from `lang`.

    Rows that are not code keep their `lang`. `batch` needs `text`, `kind`
    and `lang`; `path` is used when present.
    """
    params = params or DomainParams()
    n = batch.num_rows
    kinds = _column(batch, "kind")
    langs = _column(batch, "lang")
    paths = _column(batch, "path", "")
    text = batch.column("text")
    out: list[str] = list(langs)
    for i in range(n):
        if kinds[i] != KIND_CODE:
            continue
        found = identify(text[i].as_py(), paths[i], langs[i], params)
        if found is not None:
            out[i] = found
    changed = np.fromiter((a != b for a, b in zip(out, langs)), dtype=bool, count=n)
    return out, changed
