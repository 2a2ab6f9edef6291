"""Does a source file parse? Tree-sitter error ratios, and `ast` for Python.

`parse_error_ratio(text, lang)` parses a file with the tree-sitter grammar of
its language (from `tree_sitter_language_pack`, which bundles the compiled
grammars) and answers the fraction of the syntax tree's nodes that are
`ERROR` (text the grammar could not fit) or `MISSING` (a token the parser
had to invent, like an unclosed `}`): 0.0 for a clean parse, NaN when we
have no grammar for the language, when the file does not fit the time
budget, or when the grammar fails. Nodes *inside* an ERROR node are not
counted as errors themselves (the measure is the literal "ERROR or MISSING
nodes / all nodes"), so one early unrecoverable error in a long file gives a
small ratio; tree-sitter usually recovers after a few tokens, so in practice
the ratio tracks how many places of the file are broken.

Python is special: tree-sitter recovers from errors that CPython rejects
(and still knows Python 2's `print` statement), so `ast.parse` is the ground
truth both ways: in `SyntaxFilter` a file that CPython cannot compile counts
as broken whatever its tree-sitter ratio, and one it compiles as clean
(`code_syntax:python_ast_ok` records the verdict). Python 2 files are broken
by that definition.

Costs are bounded: only the first `MAX_PARSE_BYTES` bytes (1 MB, cut back
to the last line break) are parsed, a parse that runs longer than
`PARSE_TIMEOUT_S` is cancelled (NaN), and counting errors only descends into
subtrees that contain one, so a clean file costs one tree-sitter parse and
no Python-level tree walk. `ast.parse` runs only on files that fit in the
same byte budget (NaN above it). Parsers are cached per grammar *and per
thread* (tree-sitter parsers are not thread-safe), so a thread pool can run
`SyntaxFilter` on several batches at once.

`GRAMMARS` is the one map from Assay's language names (`assay.languages`)
to tree-sitter-language-pack's; `NO_GRAMMAR` lists the languages the pack has
no grammar for, and a test checks that every language of the table is in one
of the two.
"""

from __future__ import annotations

import ast
import math
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from assay.config import DomainParams
from assay.schema import KIND_CODE
from filters.base import FilterResult

#: Assay language name → tree-sitter-language-pack grammar.
GRAMMARS: dict[str, str] = {
    "python": "python", "javascript": "javascript", "typescript": "typescript", "java": "java",
    "kotlin": "kotlin", "scala": "scala", "groovy": "groovy", "clojure": "clojure",
    "c": "c", "c++": "cpp", "cuda": "cuda", "c#": "csharp", "f#": "fsharp", "go": "go", "rust": "rust",
    "swift": "swift", "objective-c": "objc", "ruby": "ruby", "php": "php", "perl": "perl", "lua": "lua",
    "r": "r", "julia": "julia", "haskell": "haskell", "ocaml": "ocaml", "elixir": "elixir",
    "erlang": "erlang", "dart": "dart", "zig": "zig", "nim": "nim", "d": "d",
    # tree-sitter-verilog is a SystemVerilog grammar (a superset of Verilog).
    "verilog": "verilog", "systemverilog": "verilog", "vhdl": "vhdl", "fortran": "fortran",
    "pascal": "pascal", "ada": "ada", "common lisp": "commonlisp", "emacs lisp": "elisp",
    "scheme": "scheme", "racket": "racket", "shell": "bash", "fish": "fish", "powershell": "powershell",
    "sql": "sql", "html": "html", "css": "css", "scss": "scss", "vue": "vue", "svelte": "svelte",
    "json": "json", "yaml": "yaml", "toml": "toml", "xml": "xml", "ini": "ini", "tex": "latex",
    "bibtex": "bibtex", "cmake": "cmake", "makefile": "make", "dockerfile": "dockerfile",
    "protocol buffer": "proto", "graphql": "graphql", "hcl": "hcl", "vim script": "vim",
    "assembly": "asm", "tcl": "tcl", "solidity": "solidity", "haxe": "haxe", "elm": "elm",
    "purescript": "purescript", "meson": "meson",
    # A notebook is a JSON document.
    "jupyter notebook": "json",
}

#: Extensions whose files need a different grammar than their language's.
EXTENSION_GRAMMARS: dict[str, str] = {".tsx": "tsx", ".mli": "ocaml_interface"}

#: Languages of `assay.languages` that tree-sitter-language-pack 0.13 has no grammar for.
NO_GRAMMAR: frozenset[str] = frozenset({
    "cython", "visual basic", "crystal", "batchfile", "sass", "less", "awk", "just",
})

#: Bytes of a file that are parsed at most (cut back to the last line break).
MAX_PARSE_BYTES = 1 << 20
#: A parse running longer than this (seconds of wall time) is cancelled.
PARSE_TIMEOUT_S = 5.0


def grammar_for(lang: str | None, path: str | None = None) -> str | None:
    """The tree-sitter grammar for an Assay language (and a path, for `.tsx` and the like)."""
    if lang is None:
        return None
    grammar = GRAMMARS.get(lang)
    if grammar is not None and path:
        dot = path.rfind(".")
        if dot > path.rfind("/"):
            grammar = EXTENSION_GRAMMARS.get(path[dot:].lower(), grammar)
    return grammar


# --- parsers ---------------------------------------------------------------------

_local = threading.local()
_broken_grammars: set[str] = set()


def _parser(grammar: str):
    """This thread's parser for `grammar` (None if the grammar cannot be loaded)."""
    cache = getattr(_local, "parsers", None)
    if cache is None:
        cache = _local.parsers = {}
    if grammar not in cache:
        if grammar in _broken_grammars:
            return None
        try:
            from tree_sitter_language_pack import get_parser

            cache[grammar] = get_parser(grammar)
        except Exception:  # noqa: BLE001 - a grammar the pack cannot load is a grammar we do not have
            _broken_grammars.add(grammar)
            return None
    return cache[grammar]


def clip(data: bytes, max_bytes: int = MAX_PARSE_BYTES) -> bytes:
    """The first `max_bytes` of `data`, cut back to a line break (or a character boundary)."""
    if len(data) <= max_bytes:
        return data
    head = data[:max_bytes]
    cut = head.rfind(b"\n")
    if cut > max_bytes // 2:
        return head[: cut + 1]
    # No usable line break: cut at a UTF-8 character boundary.
    end = max_bytes
    while end > 0 and (data[end] & 0xC0) == 0x80:
        end -= 1
    return data[:end]


@dataclass(frozen=True)
class ParseStats:
    nodes: int
    errors: int  # ERROR nodes
    missing: int  # MISSING nodes

    @property
    def ratio(self) -> float:
        return (self.errors + self.missing) / self.nodes if self.nodes else 0.0


def parse_stats(data: bytes, grammar: str, timeout_s: float = PARSE_TIMEOUT_S) -> ParseStats | None:
    """Node counts of `data` parsed with `grammar`; None without a grammar or on timeout."""
    parser = _parser(grammar)
    if parser is None:
        return None
    if not data:
        return ParseStats(0, 0, 0)
    deadline = time.monotonic() + timeout_s

    def progress(*_args) -> bool:  # True cancels the parse
        return time.monotonic() > deadline

    # The progress callback is only honoured when the source comes through a read callback.
    try:
        tree = parser.parse(lambda offset, _point: data[offset:offset + 65536], progress_callback=progress)
    except ValueError:  # cancelled: a cancelled parser resumes where it stopped unless reset
        parser.reset()
        return None
    if tree is None:
        parser.reset()
        return None
    root = tree.root_node
    nodes = root.descendant_count
    if not root.has_error:
        return ParseStats(nodes, 0, 0)
    errors = missing = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error:
            errors += 1
        elif node.is_missing:
            missing += 1
        stack.extend(child for child in node.children if child.has_error)
    return ParseStats(nodes, errors, missing)


def parse_error_ratio(text: str, lang: str | None, path: str | None = None,
                      max_bytes: int = MAX_PARSE_BYTES) -> float:
    """Share of ERROR/MISSING nodes in `text` parsed as `lang`; NaN without a grammar.

    Only the first `max_bytes` bytes are parsed. This is tree-sitter's view
    only; for Python see `python_ast_ok`.
    """
    grammar = grammar_for(lang, path)
    if grammar is None:
        return math.nan
    stats = parse_stats(clip(text.encode("utf-8", "surrogatepass"), max_bytes), grammar)
    return math.nan if stats is None else stats.ratio


_AST_LOCK = threading.Lock()


def python_ast_ok(text: str, max_bytes: int = MAX_PARSE_BYTES) -> float:
    """1.0 if CPython's parser accepts `text`, 0.0 if not, NaN above `max_bytes` (UTF-8)."""
    if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        return math.nan
    # One parse at a time: CPython 3.11's AST constructor is not thread-safe
    # ("AST constructor recursion depth mismatch" under concurrent ast.parse),
    # and stage tasks run on threads. `catch_warnings` is not thread-safe either.
    with _AST_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes and the like
        try:
            ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return 0.0
    return 1.0


# --- the filter ------------------------------------------------------------------


def _column(batch, name: str) -> list:
    column = batch.column(name)
    return column.to_pylist()


class SyntaxFilter:
    """Drop code that does not parse (tier 3).

    For every `kind == "code"` row with a grammar: `code_syntax:error_ratio`
    (see `parse_error_ratio`); for Python rows also `code_syntax:python_ast_ok`
    (1/0). A row is dropped with `code_syntax:parse_errors` when its ratio is
    above `DomainParams.max_parse_error_ratio`; for Python, CPython decides
    instead: a file `ast.parse` rejects is dropped even if tree-sitter
    recovers, and a file it accepts is kept with ratio 0.0 without a
    tree-sitter parse (tree-sitter-python lags the language: a valid file can
    show error nodes). Python files over the byte budget fall back to the
    tree-sitter ratio of their head. Rows without a grammar, over the time
    budget, or not code are kept unscored (NaN).
    """

    name = "code_syntax"

    def __init__(self, params: DomainParams | None = None, max_bytes: int = MAX_PARSE_BYTES) -> None:
        self.params = params or DomainParams()
        self.max_bytes = max_bytes

    def scores(self, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
        """(error_ratio, python_ast_ok) per row, NaN where not scored."""
        n = batch.num_rows
        ratio = np.full(n, np.nan)
        ast_ok = np.full(n, np.nan)
        kinds = _column(batch, "kind")
        langs = _column(batch, "lang")
        paths = _column(batch, "path") if "path" in batch.schema.names else [None] * n
        text = batch.column("text")
        for i in range(n):
            if kinds[i] != KIND_CODE:
                continue
            grammar = grammar_for(langs[i], paths[i])
            if grammar is None:
                continue
            value = text[i].as_py()
            if langs[i] == "python":
                ast_ok[i] = python_ast_ok(value, self.max_bytes)
                if ast_ok[i] == 1.0:  # CPython accepts it: no syntax error, whatever tree-sitter thinks
                    ratio[i] = 0.0
                    continue
            ratio[i] = parse_error_ratio(value, langs[i], paths[i], self.max_bytes)
        return ratio, ast_ok

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        ratio, ast_ok = self.scores(batch)
        # For Python, CPython's verdict decides where there is one (ratio is 0 when it accepts).
        broken = np.where(np.isnan(ast_ok), ratio > self.params.max_parse_error_ratio, ast_ok == 0.0)
        keep = ~broken
        label = f"{self.name}:parse_errors"
        reason = [None if k else label for k in keep.tolist()]
        return FilterResult(keep, reason, {
            f"{self.name}:error_ratio": ratio,
            f"{self.name}:python_ast_ok": ast_ok,
        })
