"""Markup to text before the heuristics and the words head, and the key-value records rule (ours).

Both are differences from the papers and datatrove (ARCHITECTURE.md, tier 1);
datatrove-compatible mode switches them off (tests/test_heuristics_datatrove.py).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from assay.config import HeuristicsParams, MarkupParams, Params, RecordsParams, load_params
from assay.errors import AssayError
from filters.heuristics import FILTER_NAMES, apply_by_source, apply_chain, build_heuristics
from filters.markup import markup_to_text
from filters.records import RecordsFilter

PROSE = textwrap.fill(
    "The library reads a configuration file, checks every value against the schema that the "
    "application declared, and reports each mistake with the line where it was made. It was written "
    "because the tools that existed at the time either stopped at the first error or gave messages "
    "that did not say which file was wrong. Since then it has been used in a number of projects, and "
    "the interface has stayed the same, so that code written for the first release still works with "
    "this one. The documentation describes the format, the options of the command line tool and the "
    "functions that other programs can call.", 76)
#: A README's one paragraph of prose under its badges (60 words).
PARAGRAPH = textwrap.fill(" ".join(PROSE.split()[:60]), 76)

#: The head of a real wheel's long description (reST, as on PyPI: badges, directives, links).
REST_README = """frobnicate
==========

|PyPI| |Status| |Python Version| |License|

|Tests| |Codecov| |pre-commit| |Black|

.. |PyPI| image:: https://img.shields.io/pypi/v/frobnicate.svg
   :target: https://pypi.org/project/frobnicate/
   :alt: PyPI
.. |Status| image:: https://img.shields.io/pypi/status/frobnicate.svg
   :target: https://pypi.org/project/frobnicate/
   :alt: Status
.. |Python Version| image:: https://img.shields.io/pypi/pyversions/frobnicate
   :target: https://pypi.org/project/frobnicate
   :alt: Python Version
.. |License| image:: https://img.shields.io/pypi/l/frobnicate
   :target: https://opensource.org/licenses/Apache-2.0
   :alt: License
.. |Tests| image:: https://github.com/example/frobnicate/workflows/Tests/badge.svg
   :target: https://github.com/example/frobnicate/actions?workflow=Tests
   :alt: Tests
.. |Codecov| image:: https://codecov.io/gh/example/frobnicate/branch/main/graph/badge.svg
   :target: https://app.codecov.io/gh/example/frobnicate
   :alt: Codecov
.. |pre-commit| image:: https://img.shields.io/badge/pre--commit-enabled-brightgreen?logo=pre-commit
   :target: https://github.com/pre-commit/pre-commit
   :alt: pre-commit
.. |Black| image:: https://img.shields.io/badge/code%20style-black-000000.svg
   :target: https://github.com/psf/black
   :alt: Black

Features
--------

""" + PARAGRAPH + """

See `the documentation <https://frobnicate.readthedocs.io/en/latest/usage.html>`_ and
:func:`~frobnicate.core.check` for the details.

Example::

    >>> from frobnicate import check
    >>> check("settings.toml")
"""

#: The head of a real Markdown long description: a badge row, a heading, a table.
MARKDOWN_README = """# frobnicate

[![PyPi](https://img.shields.io/pypi/v/frobnicate.svg)](https://pypi.python.org/pypi/frobnicate/)
[![PyPI - Status](https://img.shields.io/pypi/status/frobnicate)](https://pypi.python.org/pypi/frobnicate/)
[![PyPI - Downloads](https://img.shields.io/pypi/dm/frobnicate)](https://pypi.python.org/pypi/frobnicate/)
[![Python Versions](https://img.shields.io/pypi/pyversions/frobnicate.svg)](https://github.com/example/frobnicate)
[![License](https://img.shields.io/github/license/example/frobnicate.svg)](https://github.com/example/frobnicate)
![Build Status](https://github.com/example/frobnicate/actions/workflows/test-suite.yml/badge.svg)

## What is it?

""" + PARAGRAPH + """

| Option | Meaning |
| --- | --- |
| `--all` | check every file |

```python
from frobnicate import check
check("settings.toml")
```

Read the [documentation](https://example.org/docs) for more.
"""

#: A package stanza of /var/lib/dpkg/status (deb822): fields, and a folded English Description.
DPKG_STANZA = """Package: tar
Essential: yes
Status: install ok installed
Priority: required
Section: utils
Installed-Size: 3152
Maintainer: Janos Lenart <ocsi@debian.org>
Architecture: amd64
Multi-Arch: foreign
Version: 1.34+dfsg-1.2+deb12u1
Replaces: cpio (<< 2.4.2-39)
Pre-Depends: libacl1 (>= 2.2.23), libc6 (>= 2.34), libselinux1 (>= 3.1~)
Suggests: bzip2, ncompress, xz-utils, tar-scripts, tar-doc
Breaks: dpkg-dev (<< 1.14.26)
Conflicts: cpio (<= 2.4.2-38)
Description: GNU version of the tar archiving utility
 Tar is a program for packaging a set of files as a single archive in tar
 format.  The function it performs is conceptually similar to cpio, and to
 things like PKZIP in the DOS world.  It is heavily used by the Debian package
 management system, and is useful for performing system backups and exchanging
 sets of files with others. The archives it writes can be read on other systems
 as well, and the program can read the archives those systems write.
Homepage: https://www.gnu.org/software/tar/
"""


def batch(*texts: str) -> pa.RecordBatch:
    return pa.record_batch({"text": pa.array(list(texts), pa.large_string()), "kind": pa.array(["text"] * len(texts))})


# --- markup to text -----------------------------------------------------------------------------


def test_markup_to_text_takes_out_badges_directives_links_and_code_but_keeps_the_prose():
    rest, md = markup_to_text(pa.array([REST_README, MARKDOWN_README])).to_pylist()
    for plain in (rest, md):
        assert "shields.io" not in plain and "https://" not in plain and "|PyPI|" not in plain
        assert PARAGRAPH in plain  # the prose itself is untouched
        assert "check(" not in plain  # code samples (literal blocks, fenced code) are not prose
        assert "===" not in plain and "---" not in plain
    assert "See the documentation and frobnicate.core.check for the details." in " ".join(rest.split())
    assert "Read the documentation for more." in md and "What is it?" in md and "#" not in md
    assert "Option  Meaning" in md and "--all  check every file" in md.replace("`", "")


def test_plain_prose_and_nulls_pass_through_unchanged():
    texts = [PROSE, "Note: the file is read twice.\nUsage: frob FILE\n", None, "", "a|b and c|d, 3 * 4 = 12 (a cell bar is a bar between spaces)"]
    out = markup_to_text(pa.array(texts, pa.string()))
    assert out.to_pylist() == texts
    chunked = markup_to_text(pa.chunked_array([pa.array(texts[:2]), pa.array(texts[2:])]))
    assert chunked.to_pylist() == texts


def test_badge_laden_descriptions_fail_gopher_as_they_are_and_pass_without_markup():
    """The pool's package descriptions were dropped for their markup (mean word length, `#`)."""
    b = batch(REST_README, MARKDOWN_README, PROSE)
    published = HeuristicsParams(markup=MarkupParams(enabled=False))
    rules = ["gopher_repetition", "gopher_quality"]
    old = apply_chain([f for f in build_heuristics(published) if f.name in rules], b)
    new = apply_chain([f for f in build_heuristics(HeuristicsParams()) if f.name in rules], b)
    assert old.reason[:2] == ["gopher_quality:mean_word_length"] * 2, old.reason
    assert new.keep.all(), new.reason
    # Plain prose gets the same scores either way.
    for key, values in new.scores.items():
        assert values[2] == pytest.approx(old.scores[key][2], nan_ok=True), key


#: A configuration file as /etc ships them: a licence/comment block, settings, a commented-out example.
CONFIG_WITH_COMMENTS = """# /etc/frob.conf: configuration of the frob daemon
#
# Each setting is a key and a value. Lines that start with a hash are comments
# and are ignored; the defaults are shown commented out below.
#
# See frob.conf(5) for the meaning of every setting.

listen = 127.0.0.1:8080
workers = 4
# timeout = 30
# retries = 3
log_level = info
"""


def test_a_run_of_hash_lines_is_comments_not_markdown_headings():
    """The markup step read every line-initial `# ` as a Markdown heading mark and took it out, so a
    configuration file's comment block reached Gopher's `#` ratio as plain English (tier1d, fresh set 3's
    /etc files: 95% dropped before the markup step, 57.5% after). Two or more consecutive `#` lines are
    comments now and keep their `#`; a heading alone on its line still loses its mark."""
    config, md, runs = markup_to_text(pa.array([
        CONFIG_WITH_COMMENTS, "# Title\n\nText.\n\n## Usage\nRun it.\n",
        "#a\n#b\n#c\ntext\n# d\n#e\n#f\n#g\n#h\n"])).to_pylist()
    assert config == CONFIG_WITH_COMMENTS  # every comment line kept, with its `#`
    assert md == "Title\n\nText.\n\nUsage\nRun it.\n"
    assert runs == "#a\n#b\n#c\ntext\n# d\n#e\n#f\n#g\n#h\n"  # odd and even runs, indices 3 and 5
    assert "\ue000" not in config + md + runs
    # Gopher's `#` ratio now sees the comments as the published rule (no markup step) does.
    b = batch(CONFIG_WITH_COMMENTS)
    published = [f for f in build_heuristics(HeuristicsParams(markup=MarkupParams(enabled=False)))
                 if f.name == "gopher_quality"][0]
    ours = [f for f in build_heuristics(HeuristicsParams()) if f.name == "gopher_quality"][0]
    ratio = ours.apply(b).scores["gopher_quality:hash_word_ratio"][0]
    assert ratio == pytest.approx(published.apply(b).scores["gopher_quality:hash_word_ratio"][0]) and ratio > 0.1


def test_hashed_words_with_markup_count_the_words_of_the_plain_text():
    from assay.quality.features import hashed_words

    plain = markup_to_text(pa.array([MARKDOWN_README])).to_pylist()
    a = hashed_words([MARKDOWN_README], 1024, markup=True).to_dense()
    b = hashed_words(plain, 1024).to_dense()
    raw = hashed_words([MARKDOWN_README], 1024).to_dense()
    assert np.allclose(a.numpy(), b.numpy()) and not np.allclose(a.numpy(), raw.numpy())


def test_a_head_trained_with_markup_scores_with_markup_and_old_heads_read_raw_text(tmp_path):
    from assay.quality.head import load_head
    from assay.quality.scorer import HeadScorer
    from assay.quality.train import Examples, train_head

    params = Params()
    params.quality.hash_dim = 4096
    params.quality.calibration = None
    params.quality.shape = False  # the words alone here; heads with shape features: tests/test_quality.py
    texts = [PROSE + f" Example {i}." for i in range(20)] + [DPKG_STANZA.replace("tar", f"p{i}") for i in range(20)]
    labels = np.array([1] * 20 + [0] * 20)
    train_head(Examples(texts, labels, [str(i) for i in range(40)]), params, tmp_path / "head", recipe="labels")
    assert load_head(tmp_path / "head")[1].markup is True
    scorer = HeadScorer(tmp_path / "head")
    from assay.quality.features import hashed_words

    expect = 1 / (1 + np.exp(-scorer.head.logits(hashed_words([MARKDOWN_README], 4096, markup=True))))
    assert scorer.score([MARKDOWN_README], None) == pytest.approx(expect)
    # A head saved before `markup` existed has no such key: it reads raw words.
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    del config["markup"]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    old = HeadScorer(tmp_path / "head")
    expect_raw = 1 / (1 + np.exp(-old.head.logits(hashed_words([MARKDOWN_README], 4096))))
    assert old.config.markup is False and old.score([MARKDOWN_README], None) == pytest.approx(expect_raw)


# --- key-value records --------------------------------------------------------------------------


def test_records_drop_deb822_stanzas_and_key_value_files_but_keep_prose_with_a_few_fields():
    pkgconfig = "prefix=/usr\nlibdir=${prefix}/lib\n\nName: zlib\nDescription: zlib compression library\nVersion: 1.2.13\n\nLibs: -L${libdir} -lz\nCflags: -I${includedir}\n"
    unit = "[Unit]\nDescription=Daily apt download activities\n\n[Timer]\nOnCalendar=*-*-* 6,18:00\nRandomizedDelaySec=12h\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n"
    readme = ("Frobnicator\n===========\n\nUsage:\n    frob --all FILE\n\nNote: " + PROSE + "\n\nHomepage: https://example.org/\n"
              "https://example.org/docs\n")
    result = RecordsFilter().apply(batch(DPKG_STANZA, pkgconfig, unit, readme, PROSE))
    frac = result.scores["records:field_lines_frac"]
    assert frac[:3].tolist() == [1.0, 1.0, 1.0]
    assert frac[3] < 0.3 and frac[4] == 0.0
    assert result.keep.tolist() == [False, False, False, True, True]
    assert result.reason[0] == "records:field_lines_frac"


def test_a_deb822_stanza_passes_gopher_and_is_dropped_by_the_records_rule():
    """What let dpkg status stanzas through tier 1: an English Description folded into the record."""
    b = batch(DPKG_STANZA)
    gopher = [f for f in build_heuristics(HeuristicsParams()) if f.name.startswith("gopher_")]
    assert apply_chain(gopher, b).keep.tolist() == [True]
    source_rules = Params().static.source_rules
    b = pa.record_batch({"text": b.column("text"), "kind": b.column("kind"), "source": pa.array(["fresh-dpkg-status"])})
    result = apply_by_source(build_heuristics(HeuristicsParams()), b, source_rules)
    assert result.keep.tolist() == [False] and result.reason == ["records:field_lines_frac"]


def test_continuations_count_only_after_a_field_and_urls_are_not_keys():
    from filters.records import field_lines

    lines = ["Key: value", " folded", "\tfolded too", "", "   not folded: after a blank line",
             "http://example.org/x", "Name[de]=Datei", "[Section]", "a sentence: with a colon", "x = 1"]
    row = np.zeros(len(lines), dtype=np.int64)
    assert field_lines(pa.array(lines), row).tolist() == [True, True, True, False, False, False, True, True, False, True]
    # A continuation never belongs to a field of the previous document.
    assert field_lines(pa.array(["Key: v", " more"]), np.array([0, 1])).tolist() == [True, False]


def test_records_is_a_switch_with_a_nullable_threshold(tmp_path):
    assert "records" in FILTER_NAMES
    names = [f.name for f in build_heuristics(HeuristicsParams())]
    assert names == ["gopher_repetition", "gopher_quality", "records", "c4", "fineweb_quality"]
    off = HeuristicsParams(records=RecordsParams(enabled=False))
    assert "records" not in [f.name for f in build_heuristics(off)]
    null = RecordsFilter(RecordsParams(max_field_lines_frac=None)).apply(batch(DPKG_STANZA))
    assert null.keep.tolist() == [True] and null.scores["records:field_lines_frac"][0] == 1.0
    with pytest.raises(AssayError, match="max_field_lines_frac"):
        RecordsParams(max_field_lines_frac=1.5)
    yaml = tmp_path / "params.yaml"
    yaml.write_text("static:\n  heuristics:\n    records:\n      max_field_lines_frac: null\n    markup:\n      enabled: false\n")
    p = load_params(yaml)
    assert p.static.heuristics.records.max_field_lines_frac is None and p.static.heuristics.markup.enabled is False
    # The per-source choice may name it; the default gives it to the plain-text file sources.
    assert all("records" in v for v in Params().static.source_rules.values())
    assert dataclasses.replace(Params().static, source_rules={"x": ["records"]}).source_rules == {"x": ["records"]}


#: A systemd unit as shipped (shape of /lib/systemd/system/*.service): an English licence comment block,
#: then the record. The comment's lines outnumber the fields.
SYSTEMD_UNIT = """#  SPDX-License-Identifier: LGPL-2.1-or-later
#
#  This file is part of systemd.
#
#  systemd is free software; you can redistribute it and/or modify it
#  under the terms of the GNU Lesser General Public License as published by
#  the Free Software Foundation; either version 2.1 of the License, or
#  (at your option) any later version.
#
#  You should have received a copy of the GNU Lesser General Public License
#  along with this program; if not, see the licence's own web page for details.

[Unit]
Description=Journal Service
Documentation=man:systemd-journald.service(8) man:journald.conf(5)
DefaultDependencies=no

[Service]
ExecStart=/lib/systemd/systemd-journald
Restart=always
"""

#: A glibc locale source (shape of /usr/share/i18n/locales/*): `%` comments in English, then `keyword value`
#: lines whose values are quoted strings, <symbols> and numbers, in LC_* blocks.
LOCALE_SOURCE = """comment_char %
escape_char /

% This file is part of the GNU C Library and contains locale data.
% The Free Software Foundation does not claim any copyright interest
% in the locale data contained in this file.  The foregoing does not
% affect the license of the GNU C Library as a whole.  It does not
% exempt you from the conditions of the license if your use would
% otherwise be governed by that license.

LC_IDENTIFICATION
title      "English locale for an example country"
source     "Example"
language   "English"
revision   "1.0"
date       "2000-06-29"
END LC_IDENTIFICATION

LC_MONETARY
int_curr_symbol         "XYZ "
currency_symbol         "<U0024>"
mon_decimal_point       "."
mon_grouping            3;3
int_frac_digits         2
p_cs_precedes           1
END LC_MONETARY

LC_TIME
abday   "<U0053><U0075><U006E>";"<U004D><U006F><U006E>";/
        "<U0054><U0075><U0065>";"<U0057><U0065><U0064>"
d_fmt   "<U0025><U0064>/<U0025><U006D>/<U0025><U0079>"
END LC_TIME
"""


def test_records_with_a_licence_comment_block_are_still_records():
    """Comment lines are neither fields nor the document's prose: out of the share, so a unit or a locale
    source that opens with an English licence block is dropped (the previous rule kept both: fresh set 2)."""
    result = RecordsFilter().apply(batch(SYSTEMD_UNIT, LOCALE_SOURCE))
    frac = result.scores["records:field_lines_frac"]
    assert frac[0] == 1.0 and frac[1] > 0.7  # the LC_* / END lines are not fields
    assert result.keep.tolist() == [False, False]
    assert result.reason == ["records:field_lines_frac"] * 2
    # Without the two line classes the share is the previous rule's: under 0.5, both kept.
    before = RecordsFilter(RecordsParams(skip_comments=False, value_lines=False)).apply(batch(SYSTEMD_UNIT, LOCALE_SOURCE))
    assert (before.scores["records:field_lines_frac"] < 0.5).all() and before.keep.tolist() == [True, True]
    # Each class alone: comments out catches the unit; the locale needs its value lines recognised too.
    comments = RecordsFilter(RecordsParams(value_lines=False)).apply(batch(SYSTEMD_UNIT, LOCALE_SOURCE))
    assert comments.keep.tolist() == [False, True]


def test_value_lines_are_fields_only_when_no_value_is_a_word():
    from filters.records import field_lines

    fields = ['copy "en_GB"', "mon_grouping 3;3", "comment_char %", '<U00C4> "<U0041><U0308>" % A umlaut',
              "libdir $prefix/lib", "timeout 30", "include \"translit_combining\";\"\""]
    prose = ["Chapter 3 covers the rest of the format.", "See the manual", "Version 2.0 was released in May",
             "Hello world", "Installation", '    indented "value"', 'He said "yes" to it', "word 3 words"]
    lines = fields + prose
    row = np.zeros(len(lines), dtype=np.int64)
    assert field_lines(pa.array(lines), row, value_lines=True).tolist() == [True] * len(fields) + [False] * len(prose)
    # Off (the default of the bare function, as before): none of these is a `Key: value` field.
    assert not field_lines(pa.array(lines), row).any()


def test_comment_lines_do_not_turn_prose_into_a_record():
    """Markdown headings and a commented example are comment lines to the rule: prose around them keeps
    a low share; a document of comments only has no share (NaN) and is kept by this rule."""
    markdown = ("# Frobnicate\n\n" + PROSE + "\n\n## Usage\n\n" + PROSE + "\n\n```\n# a comment in an example\n"
                "frob --all\n```\n\nLicense: MIT\n")
    comments_only = "# one\n# two\n; three\n% four\n// five\n"
    result = RecordsFilter().apply(batch(markdown, comments_only, PROSE))
    frac = result.scores["records:field_lines_frac"]
    assert frac[0] < 0.1 and np.isnan(frac[1]) and frac[2] == 0.0
    assert result.keep.tolist() == [True, True, True]


def test_records_line_classes_are_switches_in_params(tmp_path):
    assert RecordsParams().skip_comments is True and RecordsParams().value_lines is True
    yaml = tmp_path / "params.yaml"
    yaml.write_text("static:\n  heuristics:\n    records:\n      skip_comments: false\n      value_lines: false\n")
    r = load_params(yaml).static.heuristics.records
    assert r.skip_comments is False and r.value_lines is False
    assert load_params().static.heuristics.records == RecordsParams()  # params.yaml and config.py agree
