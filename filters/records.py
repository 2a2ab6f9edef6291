"""Key-value records: a document that is mostly header fields is a record, not prose (ours).

Machine files are often records of `Key: value` fields: RFC 822 / 5322
message headers, Debian's control format (deb822: dpkg's status database,
`.dsc`, `.changes`, DEP-5 copyright headers), a wheel's METADATA header,
pkg-config files; or `key = value` settings (INI, `.desktop`, os-release,
entry points). A field's value may be folded onto the following indented
lines (RFC 822, section 3.1.1), and deb822 puts a whole English paragraph
there (a package's `Description`). Such a record can pass every Gopher rule:
enough words, stop words and letters, little repetition.

No published web-text filter has this rule; it follows the shape of
Gopher's line-ratio rules (Rae et al. 2021: a document with more than 90% of
its lines starting with a bullet is dropped), with the line class taken
from the formats' grammars rather than from bullets:

- `field_lines_frac`: the share of the non-blank lines that belong to a
  field: a line starting at the margin with a one-token key followed by `:`
  (not `://`) or `=` (`Package: tar`, `Requires-Dist: x`, `Name[de]=...`,
  `prefix=/usr`), an INI section line (`[Desktop Entry]`), or an indented
  line continuing such a field (folding: directly after a field line or
  another continuation, no blank line between).

With `value_lines` (on by default), a field may also be written the way
whitespace-separated configuration and table formats write it (glibc locale
and charmap sources, Apache/ssh-style `Keyword value`, Compose-like tables):
a key at the margin (a one-token name or a `<symbol>`), blanks, then one or
more value tokens none of which is a plain word: a quoted string, a
`<symbol>` run, a number, or a path / escape (`/usr/lib`, `$libdir`, `/x41`),
separated by blanks, `;` or `,`, maybe followed by a comment (`copy "en_GB"`,
`mon_grouping 3;3`, `comment_char %`, `<U00C4> "<U0041><U0308>" % A umlaut`). A line whose value has a plain word (`Chapter 3 covers`,
`See the manual`) is prose, not a field.

With `skip_comments` (on by default), comment lines (first non-blank
characters `#`, `;`, `%` or `//`: shell, INI, TeX/locale and C++ comments)
are left out of the share, numerator and denominator: a comment is neither
a field nor prose of the document, and a record that opens with a licence
block in comments (systemd units, locale files) is still a record. A
document with only comment and blank lines has no share (NaN: kept by this
rule). Markdown `#` headings are comment lines to this rule; they only
matter to it in a document that also has field lines.

A document whose `field_lines_frac` is above `max_field_lines_frac` is
dropped (`records:field_lines_frac`). Prose has a few such lines ("Note:
...", "Usage:") among many others; a record is nearly all of them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.config import RecordsParams
from filters.base import FilterResult
from filters.text_units import above, batch_text, bool_array, ratio, verdicts

#: A field line: a key at the margin, then ":" (not "://": a URL is not a key) or "=".
FIELD_RE = r"^[A-Za-z][A-Za-z0-9_.\-/]*(?:\[[^\]\n]*\])?(?::(?:[^/]|/[^/]|/?$)|:$|[ \t]*=)"
#: An INI section line.
SECTION_RE = r"^\[[^\]\n]+\][ \t]*$"
#: A folded continuation line: indented, not blank.
CONTINUATION_RE = r"^[ \t]+\S"
#: A value token that is not a word: a quoted string, a run of <symbols>, a number, a path or escape.
_VALUE = r"""(?:"[^"\n]*"|'[^'\n]*'|(?:<[^<>\s]+>)+|[-+]?[0-9][0-9A-Za-z.:_/+-]*|[/\\$~%@][^\s;,]*)"""
#: A whitespace-separated field: a key (a name or a <symbol>) at the margin, then only non-word values
#: (a trailing `/` or `\` continues the value on the next line, as in locale sources; a trailing comment
#: after blanks is allowed).
VALUE_LINE_RE = (r"^(?:[A-Za-z_][A-Za-z0-9_.\-]*|<[^<>\s]+>)[ \t]+" + _VALUE
                 + r"(?:[ \t;,]+" + _VALUE + r")*[ \t;,]*[/\\]?[ \t]*(?:[ \t](?:#|%|//).*)?$")
#: A comment line: `#`, `;`, `%` or `//` first (shell/INI/TeX and locale/C++ comments).
COMMENT_RE = r"^[ \t]*(?:#|;|%|//)"


def field_lines(lines: pa.Array, row: np.ndarray, value_lines: bool = False) -> np.ndarray:
    """Per line (all rows' lines in order, `row` their document): does it belong to a key-value field?
    `value_lines`: whitespace-separated `key value` lines with non-word values count as fields too."""
    n = len(lines)
    if n == 0:
        return np.zeros(0, dtype=bool)
    starts = bool_array(pc.match_substring_regex(lines, FIELD_RE)) | bool_array(pc.match_substring_regex(lines, SECTION_RE))
    if value_lines:
        starts |= bool_array(pc.match_substring_regex(lines, VALUE_LINE_RE))
    continuation = bool_array(pc.match_substring_regex(lines, CONTINUATION_RE))
    # Each continuation line belongs to the nearest earlier line that is not a continuation (a blank
    # line is not one, so it ends the chain); the chain is a field when that line is a field line
    # of the same document.
    index = np.arange(n)
    anchor = np.maximum.accumulate(np.where(continuation, -1, index))
    valid = anchor >= 0
    anchor_ok = np.zeros(n, dtype=bool)
    anchor_ok[valid] = starts[anchor[valid]] & (row[anchor[valid]] == row[valid])
    return starts | (continuation & anchor_ok)


class RecordsFilter:
    """Drops documents that are mostly key-value fields (see the module docstring)."""

    name = "records"

    def __init__(self, params: RecordsParams | None = None) -> None:
        self.params = params or RecordsParams()

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        units = batch_text(batch)
        lines = units.lines
        p = self.params
        # Comments are out of the share: neither a field nor the document's prose (module docstring).
        counted = ~bool_array(pc.match_substring_regex(lines.values, r"^\s*$"))
        if p.skip_comments:
            counted &= ~bool_array(pc.match_substring_regex(lines.values, COMMENT_RE))
        fields = field_lines(lines.values, lines.row, p.value_lines) & counted
        frac = ratio(lines.sum(fields), lines.sum(counted))
        rules = [("field_lines_frac", above(frac, self.params.max_field_lines_frac))]
        return verdicts(self.name, units.n, rules, {"field_lines_frac": frac})


__all__ = ["RecordsFilter", "field_lines", "FIELD_RE", "VALUE_LINE_RE", "COMMENT_RE"]
