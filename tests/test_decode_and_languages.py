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
