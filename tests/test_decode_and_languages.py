import pytest

from assay.ingest.decode import decode, is_binary
from assay.languages import LANGUAGES, classify, language_from_path, language_from_shebang

from corpus import LATIN1_TEXT

OPTS = dict(fallback_encodings=["cp1252", "latin_1", "iso8859_15"], min_confidence=0.9)


def test_utf8_and_bom():
    assert decode("héllo wörld".encode(), **OPTS).text == "héllo wörld"
    assert decode(b"\xef\xbb\xbfhi there", **OPTS).text == "hi there"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_with_a_byte_order_mark_are_text_not_binary(encoding):
    """Half their bytes are NUL, so the binary check refused them before the mark was read."""
    text = "Notes saved by a Windows editor: héllo, wörld.\r\n"
    data = text.encode(encoding)
    if not encoding.endswith(("-le", "-be")):
        assert data[:2] in (b"\xff\xfe", b"\xfe\xff")  # Python's codec writes the mark
    else:
        data = ("\ufeff" + text).encode(encoding)
    result = decode(data, **OPTS)
    assert result.text == text and result.encoding == encoding[:6]
    # A mark before what is not that encoding, or before control bytes, is still refused.
    assert decode(b"\xff\xfe\x00\xd8a\x00", **OPTS).reason == "invalid:encoding"
    assert decode(b"\xff\xfe" + "\x01\x02\x03\x04".encode("utf-16-le") * 20, **OPTS).reason == "invalid:binary"
    assert decode(b"\xff\xfe" + " \n".encode("utf-16-le"), **OPTS).reason == "invalid:empty"


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


def test_heads_already_cut_are_classified_as_their_whole_texts():
    import pyarrow as pa
    import pyarrow.compute as pc

    from assay.languages import SNIFF_CHARS, classify_batch

    prose = "The quick brown fox jumps over the lazy dog, and it is in English. "
    code = "int main() {\n  int x = 1;\n  return x;\n}\n"
    texts = pa.array([prose * 200, code * 300, "caf\u00e9 " * 3000 + prose, "x", code * 300], pa.large_string())
    paths = pa.array(["", "", "", "", "main.c"], pa.string())
    heads = pc.utf8_slice_codeunits(texts, 0, SNIFF_CHARS)
    whole = classify_batch(texts, paths)
    cut = classify_batch(heads, paths, heads=True)
    assert [a.to_pylist() for a in cut] == [a.to_pylist() for a in whole]
    assert whole[0].to_pylist() == ["text", "code", "text", "text", "code"]


def test_text_without_the_characters_where_arrow_s_word_kernels_part_is_counted_with_the_ascii_ones():
    import random
    import re

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from assay.languages import ENGLISH_STOPWORD_SHARE, NOT_ASCII_TOKENS, _sniff, _word_counts

    # The set is exactly where Arrow's UTF-8 and ASCII kernels part, on every code point.
    points = [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    probe = pa.array(["a" + chr(c) + "b" for c in points], pa.large_string())
    splits = (pc.list_value_length(pc.utf8_split_whitespace(probe)).to_numpy()
              != pc.list_value_length(pc.ascii_split_whitespace(probe)).to_numpy())
    into_ascii = pc.string_is_ascii(pc.utf8_lower(probe)).to_numpy(zero_copy_only=False)
    parting = {c for c, split, lower in zip(points, splits, into_ascii) if split or (c >= 0x80 and lower)}
    assert parting == {c for c in points if re.fullmatch(NOT_ASCII_TOKENS, chr(c))}

    rng = random.Random(5)
    words = ["the", "\u0130n", "\u0130T", "of", "a", "zzz", "caf\u00e9", "na\u00efve", "\u212a", "THE", "to", "'the'", "it.", "{", "x;"]
    seps = [" ", "\n", "\t", "\u00a0", "\u2003", "\x1c", "\u3000", "\u0085", "\u2028"]
    texts = ["".join(rng.choice(words) + (rng.choice(seps) if rng.random() < 0.2 else " ")
                     for _ in range(rng.randint(1, 30))) for _ in range(3000)]
    heads = pa.array(texts, pa.large_string())
    clean = pa.array([t for t in texts if not re.search(NOT_ASCII_TOKENS, t)], pa.large_string())
    assert 100 < len(clean) < len(texts)
    for got, want in zip(_word_counts(clean, True), _word_counts(clean, False)):
        assert got.tolist() == want.tolist()
    words_utf8, stops_utf8 = _word_counts(heads, False)  # every row through the UTF-8 kernels
    english = (words_utf8 >= 5) & (stops_utf8 >= ENGLISH_STOPWORD_SHARE * np.maximum(words_utf8, 1))
    assert _sniff(heads)[1].tolist() == english.tolist()


@pytest.mark.parametrize("spelling", ["cp1252", "windows-1252", "CP1252", "Windows_1252", "latin-1", "ISO-8859-1"])
def test_a_fallback_encoding_is_matched_whatever_its_spelling(spelling):
    """The detector's candidates were compared by their exact names: `windows-1252` or `latin-1` in
    the params loaded, and legacy bytes were then quarantined as invalid:encoding."""
    text = LATIN1_TEXT if "1252" not in spelling else "He said “quoted” words — and left… It was café time, naïve."
    result = decode(text.encode(spelling), fallback_encodings=[spelling], min_confidence=0.5)
    assert result.text == text and result.encoding == spelling
