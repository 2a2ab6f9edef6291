"""What a file is: code or text, and which language.

Ingest uses the cheap signals here (extension, file name, shebang, a content
sniff). The domain tier refines `lang` later with real parsing; this table is
the one both share, so a language is named the same way everywhere.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.schema import KIND_CODE, KIND_TEXT, LANG_UNKNOWN

#: Extension (lower case, with the dot) → programming language.
CODE_EXTENSIONS: dict[str, str] = {
    ".py": "python", ".pyi": "python", ".pyw": "python", ".pyx": "cython", ".pxd": "cython",
    ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript", ".jsx": "javascript",
    ".ts": "typescript", ".tsx": "typescript", ".mts": "typescript", ".cts": "typescript",
    ".java": "java", ".kt": "kotlin", ".kts": "kotlin", ".scala": "scala", ".groovy": "groovy",
    ".gradle": "groovy", ".clj": "clojure", ".cljs": "clojure", ".cljc": "clojure",
    ".c": "c", ".h": "c", ".cc": "c++", ".cpp": "c++", ".cxx": "c++", ".hpp": "c++", ".hh": "c++",
    ".hxx": "c++", ".cu": "cuda", ".cuh": "cuda", ".cs": "c#", ".fs": "f#", ".fsx": "f#", ".vb": "visual basic",
    ".go": "go", ".rs": "rust", ".swift": "swift", ".m": "objective-c", ".mm": "objective-c",
    ".rb": "ruby", ".php": "php", ".pl": "perl", ".pm": "perl", ".lua": "lua", ".r": "r",
    ".jl": "julia", ".hs": "haskell", ".lhs": "haskell", ".ml": "ocaml", ".mli": "ocaml",
    ".ex": "elixir", ".exs": "elixir", ".erl": "erlang", ".hrl": "erlang", ".dart": "dart",
    ".zig": "zig", ".nim": "nim", ".d": "d", ".cr": "crystal", ".v": "verilog", ".sv": "systemverilog",
    ".vhd": "vhdl", ".vhdl": "vhdl", ".f": "fortran", ".f90": "fortran", ".f95": "fortran",
    ".for": "fortran", ".pas": "pascal", ".adb": "ada", ".ads": "ada", ".lisp": "common lisp",
    ".lsp": "common lisp", ".el": "emacs lisp", ".scm": "scheme", ".ss": "scheme", ".rkt": "racket",
    ".sh": "shell", ".bash": "shell", ".zsh": "shell", ".ksh": "shell", ".fish": "fish",
    ".ps1": "powershell", ".psm1": "powershell", ".bat": "batchfile", ".cmd": "batchfile",
    ".sql": "sql", ".html": "html", ".htm": "html", ".xhtml": "html", ".css": "css", ".scss": "scss",
    ".sass": "sass", ".less": "less", ".vue": "vue", ".svelte": "svelte",
    ".json": "json", ".jsonc": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml",
    ".xml": "xml", ".xsd": "xml", ".xsl": "xml", ".svg": "xml", ".ini": "ini", ".cfg": "ini",
    ".tex": "tex", ".sty": "tex", ".cls": "tex", ".bib": "bibtex",
    ".cmake": "cmake", ".mk": "makefile", ".mak": "makefile", ".dockerfile": "dockerfile",
    ".proto": "protocol buffer", ".graphql": "graphql", ".gql": "graphql", ".tf": "hcl", ".hcl": "hcl",
    ".vim": "vim script", ".asm": "assembly", ".s": "assembly", ".S": "assembly", ".awk": "awk",
    ".tcl": "tcl", ".sol": "solidity", ".hx": "haxe", ".elm": "elm", ".purs": "purescript",
    ".ipynb": "jupyter notebook",
}

#: Whole file names → programming language (checked before the extension).
CODE_FILENAMES: dict[str, str] = {
    "makefile": "makefile", "gnumakefile": "makefile", "dockerfile": "dockerfile",
    "containerfile": "dockerfile", "cmakelists.txt": "cmake", "rakefile": "ruby", "gemfile": "ruby",
    "jenkinsfile": "groovy", "vagrantfile": "ruby", "build.gradle": "groovy", "meson.build": "meson",
    "sconstruct": "python", "sconscript": "python", "justfile": "just",
}

#: Extensions of prose. Files with no extension are prose unless a shebang
#: or the content says otherwise.
TEXT_EXTENSIONS = {".txt", ".md", ".markdown", ".rst", ".adoc", ".asciidoc", ".org", ".text", ".rtf", ".1", ".man"}

#: Interpreter in a shebang → programming language.
SHEBANG_INTERPRETERS: dict[str, str] = {
    "python": "python", "python2": "python", "python3": "python", "pypy": "python", "pypy3": "python",
    "sh": "shell", "bash": "shell", "zsh": "shell", "ksh": "shell", "dash": "shell", "fish": "fish",
    "perl": "perl", "ruby": "ruby", "node": "javascript", "nodejs": "javascript", "deno": "typescript",
    "php": "php", "lua": "lua", "rscript": "r", "julia": "julia", "tclsh": "tcl", "wish": "tcl",
    "awk": "awk", "gawk": "awk", "make": "makefile", "pwsh": "powershell", "escript": "erlang",
}

LANGUAGES: frozenset[str] = frozenset(CODE_EXTENSIONS.values()) | frozenset(CODE_FILENAMES.values())

_SHEBANG = re.compile(r"^#!\s*(\S+)(?:\s+(\S+))?")
_VERSION_SUFFIX = re.compile(r"[\d.]+$")


def language_from_shebang(first_line: str) -> str | None:
    match = _SHEBANG.match(first_line)
    if not match:
        return None
    program = match.group(1).rsplit("/", 1)[-1]
    if program == "env" and match.group(2):
        program = match.group(2).rsplit("/", 1)[-1]
    program = program.lower()
    return SHEBANG_INTERPRETERS.get(program) or SHEBANG_INTERPRETERS.get(_VERSION_SUFFIX.sub("", program))


def language_from_path(path: str) -> str | None:
    """The programming language a path's name or extension implies, if any."""
    # Plain string operations: this runs once per document, and pathlib is slow.
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    lowered = name.lower()
    if lowered in CODE_FILENAMES:
        return CODE_FILENAMES[lowered]
    if lowered.startswith("dockerfile."):
        return "dockerfile"
    dot = name.rfind(".")
    if dot <= 0:
        return None
    suffix = name[dot:]
    return CODE_EXTENSIONS.get(suffix) or CODE_EXTENSIONS.get(suffix.lower())


def is_text_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return dot > 0 and name[dot:].lower() in TEXT_EXTENSIONS


# Lines that look like code in most C-family and scripting languages (RE2 syntax).
# Matched line by line; Arrow's regex counting restarts each search on the
# rest of the string, where `^` would match again, so no multi-line anchors.
_CODE_LINE = (
    r"(^\s*(def |class |import |from \S+ import |#include|function\b|var |let |const |public |private |"
    r"return\b|if\s*\(|for\s*\(|while\s*\(|})|[;{]\s*$)"
)
_ENGLISH_STOPWORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from they we "
    "say her she or an will my one all would there their what so up out if about who get which go me "
    "is are was were can"
).split()
_STOPWORD_SET = pa.array(_ENGLISH_STOPWORDS, pa.string())
_TEXT_EXTENSION_SET = pa.array(sorted(TEXT_EXTENSIONS), pa.string())
_PUNCTUATION = ".,;:!?\"'()[]{}<>*`"
#: The characters on which Arrow's UTF-8 word kernels and its ASCII ones part: whitespace
#: outside ASCII's six (\x1c-\x1f included; the same set as Python's `str.split`), and the two
#: that lower-case into ASCII ("İ" → "i", the Kelvin sign → "k"). A text without them gets the
#: same tokens from the ASCII kernels, which are about twice as fast.
NOT_ASCII_TOKENS = "[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\u0130\u212a]"

#: Characters of each document that the content sniffs look at.
SNIFF_CHARS = 4000
CODE_LINE_SHARE = 0.3
ENGLISH_STOPWORD_SHARE = 0.15


def languages_from_paths(paths: pa.Array) -> pa.Array:
    """`language_from_path` of every path (null where none), on Arrow columns.

    ASCII paths are looked up with vectorised string kernels; the rare
    non-ASCII path goes through `language_from_path`, because Python's and
    Arrow's lower-casing differ outside ASCII (Python maps "İ" to two characters).
    """
    paths = pc.fill_null(paths.cast(pa.string()), "")
    name = pc.replace_substring_regex(pc.replace_substring(paths, "\\", "/"), r"(?s)^.*/", "")
    lowered = pc.ascii_lower(name)
    found = _lookup(lowered, CODE_FILENAMES)
    found = pc.coalesce(found, pc.if_else(pc.starts_with(lowered, "dockerfile."), "dockerfile", None))
    # The last dot, not at the start of the name (`rfind` > 0).
    suffix = pc.struct_field(pc.extract_regex(name, r"(?s)^.+(?P<s>\.[^.]*)$"), "s")
    found = pc.coalesce(found, _lookup(suffix, CODE_EXTENSIONS), _lookup(pc.ascii_lower(suffix), CODE_EXTENSIONS))
    other = np.flatnonzero(~_np(pc.string_is_ascii(paths)))
    if len(other):
        values = found.to_pylist()
        for i, path in zip(other.tolist(), paths.take(pa.array(other)).to_pylist()):
            values[i] = language_from_path(path) if path else None
        found = pa.array(values, pa.string())
    return pc.if_else(pc.equal(paths, ""), pa.scalar(None, pa.string()), found)


def text_paths(paths: pa.Array) -> np.ndarray:
    """`is_text_path` of every path, vectorised as `languages_from_paths` is."""
    paths = pc.fill_null(paths.cast(pa.string()), "")
    name = pc.replace_substring_regex(paths, r"(?s)^.*/", "")
    suffix = pc.struct_field(pc.extract_regex(name, r"(?s)^.+(?P<s>\.[^.]*)$"), "s")
    found = _np(pc.fill_null(pc.is_in(pc.ascii_lower(suffix), value_set=_TEXT_EXTENSION_SET), False))
    for i in np.flatnonzero(~_np(pc.string_is_ascii(paths))).tolist():
        found[i] = is_text_path(paths[i].as_py())
    return found


def classify_batch(texts: pa.Array, paths: pa.Array | None = None, *, heads: bool = False) -> tuple[pa.Array, pa.Array]:
    """(kind, lang) for every document of a batch.

    `heads`: the texts are already cut to their first SNIFF_CHARS characters
    (all the sniffs look at), so they are not cut again.

    The name of the file decides first (extension, `Makefile`...), then a
    shebang, then two content sniffs computed with Arrow's vectorised
    regex counts over the first few KB: the share of code-shaped lines, and,
    for prose, the share of English function words ("en", else "und": a real
    language-ID model belongs to the static tier; ingest only needs a label
    that is never confidently wrong).
    """
    n = len(texts)
    if paths is None:
        paths = pa.array([""] * n, pa.string())
    by_path = languages_from_paths(paths)
    lang = _np(pc.fill_null(by_path, "")).astype(object)
    code = lang != ""
    todo = np.flatnonzero(~code)  # sniff only what the names did not settle
    if len(todo):
        take = pa.array(todo)
        head = texts.take(take) if len(todo) < n else texts
        if not heads:
            head = pc.utf8_slice_codeunits(head, 0, SNIFF_CHARS)
        for j in np.flatnonzero(_np(pc.fill_null(pc.starts_with(head, "#!"), False))).tolist():
            found = language_from_shebang(head[j].as_py().split("\n", 1)[0])
            if found is not None:
                code[todo[j]], lang[todo[j]] = True, found
        code_like, english = _sniff(head)
        code_like &= ~text_paths(paths.take(take) if len(todo) < n else paths)
        sniffed = ~code[todo]  # neither the name nor a shebang decided
        code[todo[sniffed & code_like]] = True
        lang[todo[sniffed & code_like]] = LANG_UNKNOWN
        text_rows = todo[sniffed & ~code_like]
        lang[text_rows] = np.where(english[sniffed & ~code_like], "en", LANG_UNKNOWN)
    kinds = pa.array(np.where(code, KIND_CODE, KIND_TEXT), pa.string())
    return kinds, pa.array(lang, pa.string())


def _sniff(head: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per head: (code-shaped lines are at least CODE_LINE_SHARE, English function words are common)."""
    n = len(head)
    split = pc.split_pattern(head, "\n")
    owner = _np(pc.list_parent_indices(split))
    line = pc.list_flatten(split)
    nonblank = _np(pc.not_equal(pc.utf8_trim_whitespace(line), ""))
    is_code = _np(pc.match_substring_regex(line, _CODE_LINE))
    # Counting the selected owners is about twice as fast as bincount's float weights.
    lines = np.maximum(np.bincount(owner[nonblank], minlength=n), 1)
    code_lines = np.bincount(owner[is_code & nonblank], minlength=n)
    # The ASCII kernels are about twice as fast and give the same tokens on
    # ASCII text, except that they do not split at \x1c-\x1f, which Python
    # and the UTF-8 split count as whitespace.
    is_ascii = _np(pc.fill_null(pc.string_is_ascii(head), True))
    ascii_rows = is_ascii.copy()
    if ascii_rows.any() and _any_byte_between(head, 0x1C, 0x1F):  # rare: a numpy scan of the buffer decides
        ascii_rows &= ~_np(pc.fill_null(pc.match_substring_regex(head, "[\\x1c-\\x1f]"), False))
    # Text that is not ASCII mostly lacks NOT_ASCII_TOKENS too: then the ASCII kernels serve.
    other = np.flatnonzero(~is_ascii)
    if len(other):
        part = head if len(other) == n else head.take(pa.array(other))
        ascii_rows[other] = ~_np(pc.fill_null(pc.match_substring_regex(part, NOT_ASCII_TOKENS), False))
    words, stops = np.zeros(n), np.zeros(n)
    for rows, ascii in ((np.flatnonzero(ascii_rows), True), (np.flatnonzero(~ascii_rows), False)):
        if len(rows):
            part = head if len(rows) == n else head.take(pa.array(rows))
            words[rows], stops[rows] = _word_counts(part, ascii)
    code_like = code_lines / lines >= CODE_LINE_SHARE
    english = (words >= 5) & (stops >= ENGLISH_STOPWORD_SHARE * np.maximum(words, 1))
    return code_like, english


def _word_counts(head: pa.Array, ascii: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per head: (whitespace-separated words, those that are English stopwords), lower-cased, punctuation trimmed."""
    # Whitespace split and punctuation trim: several times faster than a regex split.
    lower, split, trim = ((pc.ascii_lower, pc.ascii_split_whitespace, pc.ascii_trim) if ascii
                          else (pc.utf8_lower, pc.utf8_split_whitespace, pc.utf8_trim))
    tokens = split(lower(head))
    token_owner = _np(pc.list_parent_indices(tokens))
    token = trim(pc.list_flatten(tokens), characters=_PUNCTUATION)
    n = len(head)
    words = np.bincount(token_owner[_np(pc.not_equal(token, ""))], minlength=n)
    stops = np.bincount(token_owner[_np(pc.is_in(token, value_set=_STOPWORD_SET))], minlength=n)
    return words, stops


def _any_byte_between(strings: pa.Array, low: int, high: int) -> bool:
    """Does the value buffer hold a byte in [low, high]? It may hold bytes outside the
    array's own strings (a slice), so True only means "look closer"."""
    buffers = strings.buffers()
    values = buffers[2] if len(buffers) > 2 else None
    if values is None or not values.size:
        return False
    data = np.frombuffer(values, np.uint8)
    return bool(((data - np.uint8(low)) <= np.uint8(high - low)).any())


def _lookup(keys: pa.Array, table: dict[str, str]) -> pa.Array:
    index = pc.index_in(keys, value_set=pa.array(list(table), pa.string()))
    return pa.array(list(table.values()), pa.string()).take(index)


def _np(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def classify(text: str, path: str = "") -> tuple[str, str]:
    """(kind, lang) of one document; see `classify_batch`."""
    kinds, langs = classify_batch(pa.array([text], pa.large_string()), pa.array([path], pa.string()))
    return kinds[0].as_py(), langs[0].as_py()
