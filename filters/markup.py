"""Lightweight markup to text, before the heuristics judge a plain-text file (ours).

The Gopher, C4 and FineWeb rules were set on the text of web pages after an
extractor (trafilatura, jusText, WET extraction) had removed the markup:
links are their anchor text, images are gone, code blocks are gone. A README
or a wheel's long description in Markdown or reStructuredText reaches us
with its markup in place, so the rules judge the markup: a badge row
`[![PyPI](https://img.shields.io/...)](https://pypi.org/...)` is one "word"
of 80 characters without a space (Gopher's mean word length), a heading's
`===` underline or a table's `|` cells are words without a letter (Gopher's
alpha-words rule), `#` headings count against the `#` ratio.

`markup_to_text` does for these formats what the extractor did for HTML,
with regular expressions over the whole Arrow column (RE2, no Python loop
per document):

- removed: HTML comments and tags (their content is kept), Markdown
  comment lines (`[//]: # (...)`), fenced code blocks, images and badges,
  link reference definitions, reST image/figure/raw/code/include/toctree
  directive blocks and substitution definitions, link targets
  (`.. _name: url`), literal blocks after `::`, substitution references
  (`|name|`), heading under- and overlines, table rules and cell bars,
  Markdown heading marks and emphasis marks (a `#` line is a heading only
  when alone: a run of two or more consecutive `#` lines is comments of a
  configuration file or script and keeps its `#`, so Gopher's `#` ratio
  still sees it; ours, tier1e);
- replaced by their text: Markdown links `[text](url)` and `[text][ref]`,
  reST links ``text <url>`_`, roles `:role:`text``, inline literals.

Plain prose has none of these constructs and passes unchanged (tested). The
result is used only to compute the heuristics' scores; the document's text
is never changed.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

#: reST directives whose whole block (the directive line and its indented body) is not prose.
_REST_BLOCK_DIRECTIVES = (
    "image", "figure", "raw", "code", "code-block", "sourcecode", "literalinclude", "include",
    "highlight", "toctree", "contents", "autoclass", "autofunction", "automodule", "automethod",
    "autodata", "doctest", "testcode", "testoutput", "csv-table", "list-table", "math", "graphviz",
)
#: Characters that make reST section under/overlines (and Markdown setext underlines).
_ADORNMENT = "=-~^\"'`#*+_.:<>"
#: A line of one adornment character repeated (RE2 has no backreferences: one branch per character).
_ADORNMENT_LINE = "|".join(("\\" + c if c in "^-*+.|" else c) + "{3,}" for c in _ADORNMENT)

#: Stands in for the `#` of a comment line while the heading rules run (a private-use character).
_HIDDEN_HASH = "\ue000"
#: Comment runs (ours; tier1e, after fresh set 3): the first pass hides the `#` of both lines of each
#: pair of consecutive `#` lines, taken from the top of a run (lines 1-2, 3-4, ...); the second hides
#: the last line of a run of odd length, which follows a hidden one. RE2 has no look-around, so a run
#: cannot be matched line by line in one pass. A single `# Title` line stays a heading.
COMMENT_RUN_PROTECT: tuple[tuple[str, str], ...] = (
    (r"(?m)^([ \t]*)#([^\n]*\n[ \t]*)#", "\\1" + _HIDDEN_HASH + "\\2" + _HIDDEN_HASH),
    (r"(?m)^([ \t]*)" + _HIDDEN_HASH + r"([^\n]*\n[ \t]*)#", "\\1" + _HIDDEN_HASH + "\\2" + _HIDDEN_HASH),
)
#: Gives the comment lines their `#` back after the heading rules.
COMMENT_RUN_RESTORE: tuple[str, str] = (_HIDDEN_HASH, "#")
#: The steps that keep comment runs as text; `RULES` without them is the markup step before tier1e
#: (bench/tier1_pool.py measures both).
COMMENT_RUN_RULES: tuple[tuple[str, str], ...] = (*COMMENT_RUN_PROTECT, COMMENT_RUN_RESTORE)

#: (pattern, replacement) in the order applied. Patterns are RE2.
RULES: tuple[tuple[str, str], ...] = (
    # HTML comments (also Markdown's), then Markdown comment lines `[//]: # (...)`.
    (r"(?s)<!--.*?-->", ""),
    (r"(?m)^[ \t]*\[//\]:[^\n]*$", ""),
    # Fenced code blocks (``` or ~~~).
    (r"(?ms)^[ \t]*```.*?^[ \t]*```[^\n]*$", ""),
    (r"(?ms)^[ \t]*~~~.*?^[ \t]*~~~[^\n]*$", ""),
    # reST: directive blocks that are not prose, substitution definitions, link targets: the
    # line and every indented line after it.
    (r"(?m)^[ \t]*\.\. (?:\|[^|\n]+\|[ \t]+)?(?:" + "|".join(_REST_BLOCK_DIRECTIVES)
     + r")::[^\n]*(?:\n[ \t]+[^\n]*|\n[ \t]*(?:\n[ \t]+[^\n]*))*", ""),
    (r"(?m)^[ \t]*\.\. \|[^|\n]+\|[^\n]*(?:\n[ \t]+[^\n]*)*", ""),
    (r"(?m)^[ \t]*\.\. _[^\n]*:[^\n]*(?:\n[ \t]+[^\n]*)*", ""),
    # Other directives (note, warning, ...): keep the body, drop the marker line.
    (r"(?m)^[ \t]*\.\. [A-Za-z][\w:-]*::[^\n]*$", ""),
    # reST literal blocks: an indented block after a paragraph ending in "::".
    (r"::[ \t]*\n(?:[ \t]*\n)+(?:[ \t]+[^\n]*\n|[ \t]*\n)*", ":\n\n"),
    # Markdown link reference definitions `[ref]: url "title"`.
    (r"(?m)^[ \t]{0,3}\[[^\]\n]+\]:[ \t]*\S+[^\n]*$", ""),
    # Images (badges included), then links by their text.
    (r"!\[[^\]\n]*\]\([^)\n]*\)", ""),
    (r"!\[[^\]\n]*\]\[[^\]\n]*\]", ""),
    (r"\[([^\]\n]*)\]\((?:[^()\n]|\([^)\n]*\))*\)", "\\1"),
    (r"\[([^\]\n]+)\]\[[^\]\n]*\]", "\\1"),
    (r"<(?:https?|ftp|mailto):[^>\s]+>", ""),
    # reST: `text <url>`_ and `text`_ links, :role:`text`, ``literal``, |substitution| references.
    (r"`([^`<\n]*?)[ \t]*<[^>`\n]+>`__?", "\\1"),
    (r":[A-Za-z][\w:.-]*:`~?([^`\n]+)`", "\\1"),
    (r"`([^`\n]+)`__?", "\\1"),
    (r"``([^`\n]+)``", "\\1"),
    (r"(^|[\s(])\|[A-Za-z0-9](?:[^|\n]{0,60}[^|\s])?\|_{0,2}", "\\1"),
    # HTML tags (their text stays).
    (r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?>", ""),
    # Heading under/overlines, horizontal rules, Markdown and reST table rules.
    (r"(?m)^[ \t]*(?:" + _ADORNMENT_LINE + r")[ \t]*$", ""),
    (r"(?m)^[ \t]*\|?(?:[ \t]*:?-{3,}:?[ \t]*\|)+[ \t]*(?::?-{3,}:?)?[ \t]*$", ""),
    (r"(?m)^[ \t]*\+(?:[-=]+\+)+[ \t]*$", ""),
    # Table cell bars.
    (r"(?m)^[ \t]*\|[ \t]?", ""),
    (r"(?m)[ \t]*\|[ \t]*$", ""),
    (r"[ \t]\|[ \t]", "  "),
    # A run of two or more consecutive lines starting with `#` is comments (a configuration file's, a
    # script's), not Markdown headings: their `#` is hidden from the heading rule (COMMENT_RUN_RULES).
    *COMMENT_RUN_PROTECT,
    # Markdown ATX heading marks and emphasis marks.
    (r"(?m)^[ \t]{0,3}#{1,6}[ \t]+", ""),
    (r"(?m)[ \t]+#+[ \t]*$", ""),
    COMMENT_RUN_RESTORE,
    (r"\*\*|__", ""),
)


def markup_to_text(texts: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The texts with Markdown/reST/HTML markup taken out (see the module docstring); same length, same nulls."""
    out = texts
    for pattern, replacement in RULES:
        out = pc.replace_substring_regex(out, pattern=pattern, replacement=replacement)
    return out


__all__ = ["markup_to_text", "RULES"]
