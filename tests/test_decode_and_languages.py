import pytest

from assay.ingest.decode import decode, is_binary
from assay.languages import LANGUAGES, classify, language_from_path, language_from_shebang

from corpus import LATIN1_TEXT

OPTS = dict(fallback_encodings=["cp1252", "latin_1", "iso8859_15"], min_confidence=0.9)


def test_utf8_and_bom():
    assert decode("héllo wörld".encode(), **OPTS).text == "héllo wörld"
    assert decode(b"\xef\xbb\xbfhi there", **OPTS).text == "hi there"


def test_latin1_is_decoded_when_the_detector_is_confident():
    result = decode(LATIN1_TEXT.encode("latin-1"), **OPTS)
    assert result.text == LATIN1_TEXT
    assert result.encoding in OPTS["fallback_encodings"]


def test_cp1252_punctuation():
    text = "He said “quoted” words — and left… It was the end of the story, and we knew it."
    assert decode(text.encode("cp1252"), **OPTS).text == text


def test_other_encodings_are_quarantined_not_guessed():
    result = decode("Привет, как дела? Это текст в кодировке KOI8-R.".encode("koi8_r"), **OPTS)
    assert result.text is None and result.reason == "invalid:encoding"
    assert "not UTF-8" in result.detail


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "invalid:empty"),
        (b"  \n\t \r\n", "invalid:empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "invalid:binary"),
        (bytes(range(1, 32)) * 10, "invalid:binary"),
    ],
)
def test_bad_bytes(data, reason):
    assert decode(data, **OPTS).reason == reason


def test_man_page_control_characters_are_text():
    assert not is_binary(b"N\x08NA\x08AM\x08ME\x08E\n\x1b[1mbold\x1b[0m text\n")


@pytest.mark.parametrize(
    "path,lang",
    [
        ("a/b.py", "python"), ("x.pyi", "python"), ("m.js", "javascript"), ("t.tsx", "typescript"),
        ("Main.java", "java"), ("a.c", "c"), ("a.hpp", "c++"), ("p.cs", "c#"), ("g.go", "go"),
        ("r.rs", "rust"), ("r.rb", "ruby"), ("i.php", "php"), ("s.swift", "swift"), ("k.kt", "kotlin"),
        ("s.scala", "scala"), ("run.sh", "shell"), ("x.pl", "perl"), ("x.lua", "lua"), ("x.R", "r"),
        ("x.jl", "julia"), ("x.hs", "haskell"), ("x.ml", "ocaml"), ("x.ex", "elixir"), ("x.erl", "erlang"),
        ("x.clj", "clojure"), ("x.dart", "dart"), ("x.sql", "sql"), ("x.html", "html"), ("x.css", "css"),
        ("x.json", "json"), ("x.yaml", "yaml"), ("x.toml", "toml"), ("x.xml", "xml"), ("x.tex", "tex"),
        ("Makefile", "makefile"), ("sub/Dockerfile", "dockerfile"), ("CMakeLists.txt", "cmake"),
        ("x.f90", "fortran"), ("x.zig", "zig"), ("x.ps1", "powershell"),
        ("README.md", None), ("notes.txt", None), ("LICENSE", None),
    ],
)
def test_language_from_path(path, lang):
    assert language_from_path(path) == lang


def test_at_least_thirty_languages():
    assert len(LANGUAGES) >= 30


@pytest.mark.parametrize(
    "line,lang",
    [("#!/usr/bin/env python3", "python"), ("#!/bin/bash", "shell"), ("#! /usr/bin/perl -w", "perl"),
     ("#!/usr/bin/env node", "javascript"), ("# not a shebang", None), ("#!/usr/bin/python3.11", "python")],
)
def test_shebang(line, lang):
    assert language_from_shebang(line) == lang


def test_classify_by_content():
    assert classify("#!/bin/sh\necho hi\n", "bin/tool") == ("code", "shell")
    code = "int main() {\n  int x = 1;\n  return x;\n}\n"
    assert classify(code)[0] == "code"
    prose = "The quick brown fox jumps over the lazy dog. It is a sentence that is in English and it has words."
    assert classify(prose) == ("text", "en")
    assert classify(prose, "notes.txt") == ("text", "en")


def _real_and_awkward_paths() -> list[str]:
    """Paths of real files on this machine, and names that trip string handling."""
    import os
    import sys
    import sysconfig

    paths = []
    for root in (sysconfig.get_paths()["stdlib"], "/usr/share/doc", "/etc", "/usr/bin", os.path.dirname(sys.executable)):
        for dirpath, _dirs, names in os.walk(root):
            paths += [os.path.join(dirpath, name) for name in names]
            if len(paths) > 20_000:
                break
    awkward = [
        "", "Makefile", "MAKEFILE", "b\\Makefile", "C:\\src\\main.C", "a/Dockerfile.dev", "dockerfile.", "x.", ".bashrc",
        "dir.d/noext", "dir/.hidden.py", "x.S", "x.s", "Y.PY", "t.MD", "man/ls.1", "notes.TXT", "a/b/CMakeLists.txt",
        "MAKEFİLE", "naïve.py", "ﬁle.md", "\u212a.py", "x.\u212aS", "doc/RE\u0130ADME.MD", "line\nbreak.py",
        "weird/.", "a/b/", "..", "x..py", "archive.tar.gz", "módulo.RS", "日本語/テスト.go",
    ]
    return paths + awkward


def test_vectorised_path_lookups_agree_with_the_per_path_functions():
    import pyarrow as pa

    from assay.languages import is_text_path, languages_from_paths, text_paths

    paths = _real_and_awkward_paths()
    array = pa.array(paths, pa.string())
    assert languages_from_paths(array).to_pylist() == [language_from_path(p) if p else None for p in paths]
    assert text_paths(array).tolist() == [is_text_path(p) for p in paths]
    assert languages_from_paths(pa.array(["a.py", None], pa.string())).to_pylist() == ["python", None]


def test_a_batch_is_classified_as_each_document_alone():
    """Rows decided by name, shebang and content, mixed in one batch, keep their own answers."""
    import pyarrow as pa

    from assay.languages import classify_batch

    prose = "The quick brown fox jumps over the lazy dog. It is a sentence that is in English and it has words."
    code = "int main() {\n  int x = 1;\n  return x;\n}\n"
    docs = [
        (prose, "README"), (code, "main"), ("#!/usr/bin/env python3\nprint(1)\n", "tool"), (prose, "a.py"),
        (code, "notes.txt"), ("#!/bin/sh\necho hi\n", "script.md"), ("#!/no/such/thing\nx\n", ""), ("ok", "Makefile"),
        (prose * 100, "doc.rst"), ("zzz qqq www eee rrr ttt", ""), (code, "C:\\x\\y.MD"), ("", "empty"),
        ("The caf\u00e9 is on the corner and it is open to all of the town.", ""),  # not ASCII
        ("\x1f".join(prose.split()), ""),  # ASCII, but only \x1f between words: Python's whitespace all the same
        ("\u00a0".join(prose.split()), ""),  # no-break spaces
    ]
    texts = pa.array([t for t, _ in docs], pa.large_string())
    paths = pa.array([p for _, p in docs], pa.string())
    kinds, langs = classify_batch(texts, paths)
    assert list(zip(kinds.to_pylist(), langs.to_pylist())) == [classify(t, p) for t, p in docs]
    for order in (list(reversed(range(len(docs)))), [i for i in range(len(docs)) if i % 2] + [i for i in range(len(docs)) if not i % 2]):
        k, l = classify_batch(texts.take(pa.array(order)), paths.take(pa.array(order)))
        assert list(zip(k.to_pylist(), l.to_pylist())) == [classify(*docs[i]) for i in order]
    assert list(zip(kinds.to_pylist(), langs.to_pylist()))[:4] == [
        ("text", "en"), ("code", "und"), ("code", "python"), ("code", "python")]
    assert langs.to_pylist()[-3:] == ["en", "en", "en"]
