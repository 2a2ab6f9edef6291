"""Words, lines, paragraphs and sentences of a whole record batch at once.

Two word definitions, because the tier-1 heuristics' sources disagree on
what a word is (is `don't` one word or two? is `"Hello,` one word or three?):

* the papers' (Gopher, Rae et al. 2021): whitespace-separated words,
  `BatchText.whitespace_words`, the default of the Gopher filters;
* datatrove's, the reference implementation FineWeb used: spaCy's blank
  English tokenizer, where every punctuation mark is a word of its own,
  `BatchText.words`. FineWeb's own rules were tuned with it, and the Gopher
  filters use it in datatrove-compatible mode.

This module reproduces spaCy's English tokenization rules closely, without
needing spaCy and without building a spaCy `Doc` per document:

* A text is cut into whitespace-separated *chunks* (`str.split()`; Arrow's
  `utf8_split_whitespace` uses the same Unicode definition of whitespace).
  spaCy tokenizes every chunk independently of its neighbours, so a chunk's
  tokens can be worked out once and cached: `WordSplitter` keeps a vocabulary
  of chunks seen so far, and a batch only pays for chunks it is the first to
  see (a few percent of all chunks once the cache is warm).
* A new chunk is split by `split_chunk`, our re-implementation of spaCy's
  algorithm (special cases, then prefixes and suffixes peeled off in turn,
  then URLs, then infixes, then the re-joining of special cases such as `):`
  or `c.` that punctuation splitting cut apart) with spaCy English's rules
  written out as predicates over characters.
* Everything per token (length, whether it has a letter, whether it is all
  punctuation) is a property of the vocabulary entry, computed once; per
  batch, tokens are integer ids in flat numpy arrays with per-row offsets.

Measured on the demo corpus (man pages, reference topics, package metadata,
stdlib files: 700k chunk occurrences), `split_chunk` gives spaCy's exact
tokens for every chunk; tests/test_heuristics_datatrove.py keeps measuring
it. Where it can still differ: spaCy's letter classes are approximated with
`str.isalpha`/`islower`/`isupper` and its symbol class with the Unicode
category So (spaCy's tables list fewer scripts and an older Unicode), so
text outside the common scripts may split slightly differently.

Lines and paragraphs are split with Arrow compute kernels over the whole
batch, in each of the flavours the reference filters use (`str.splitlines`,
`split("\\n")`, `re.split("\\n+")`, paragraphs on blank lines).
"""

from __future__ import annotations

import re
import threading
import unicodedata
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from filters.base import FilterResult

# --- character classes -----------------------------------------------------------

#: Python's `str.isspace()` characters (the same set Arrow's utf8 whitespace
#: kernels use), as an RE2 character-class body.
WS_CLASS = (
    r"\t\n\x{0b}\x{0c}\r\x{1c}-\x{1f} \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}"
    r"\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
)
#: The line boundaries of `str.splitlines()`, as an RE2 pattern.
LINE_BREAK_RE = r"\r\n|[\n\r\x{0b}\x{0c}\x{1c}\x{1d}\x{1e}\x{85}\x{2028}\x{2029}]"

#: Characters with the Unicode Sentence_Terminal property (datatrove's
#: TERMINAL_PUNCTUATION; spaCy's sentencizer uses all but a few recent ones).
TERMINAL_PUNCTUATION = frozenset(
    "!.?\u0589\u061d\u061e\u061f\u06d4\u0700\u0701\u0702\u07f9\u0837\u0839\u083d\u083e\u0964\u0965"
    "\u104a\u104b\u1362\u1367\u1368\u166e\u1735\u1736\u17d4\u17d5\u17d6\u17d9\u17da\u1803\u1809"
    "\u1944\u1945\u1aa8\u1aa9\u1aaa\u1aab\u1b5a\u1b5b\u1b5e\u1b5f\u1b7d\u1b7e\u1c3b\u1c3c\u1c7e"
    "\u1c7f\u203c\u203d\u2047\u2048\u2049\u2e2e\u2e3c\u2e53\u2e54\u3002\ua4ff\ua60e\ua60f\ua6f3"
    "\ua6f7\ua876\ua877\ua8ce\ua8cf\ua92f\ua9c8\ua9c9\uaa5d\uaa5e\uaa5f\uaaf0\uaaf1\uabeb\ufe52"
    "\ufe56\ufe57\uff01\uff0e\uff1f\uff61\U00010a56\U00010a57\U00010f55\U00010f56\U00010f57"
    "\U00010f58\U00010f59\U00010f86\U00010f87\U00010f88\U00010f89\U00011047\U00011048\U000110be"
    "\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd"
    "\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c"
    "\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf"
    "\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7\U00011641"
    "\U00011642\U0001173c\U0001173d\U0001173e\U00011944\U00011946\U00011a42\U00011a43\U00011a9b"
    "\U00011a9c\U00011c41\U00011c42\U00011ef7\U00011ef8\U00011f43\U00011f44\U00016a6e\U00016a6f"
    "\U00016af5\U00016b37\U00016b38\U00016b44\U00016e98\U0001bc9f\U0001da88"
)

#: Gopher's "symbol" characters: a word made only of these is not counted as
#: a word (datatrove's PUNCTUATION_SET: ASCII and CJK punctuation, a few
#: symbols, C0/C1 control characters and the sentence terminals).
GOPHER_SYMBOLS = frozenset(
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(map(chr, [*range(0, 9), 11, 12, *range(13, 32), *range(127, 160)]))
) | TERMINAL_PUNCTUATION
_GOPHER_SYMBOLS_STR = "".join(sorted(GOPHER_SYMBOLS))


def _is_icon(ch: str) -> bool:
    # spaCy's ICONS are the "other symbols" (So); there are none below U+00A6.
    return ch >= "\xa6" and unicodedata.category(ch) == "So"


def _is_lower(ch: str) -> bool:
    # spaCy's ALPHA_LOWER: lower-case letters plus letters of uncased scripts.
    return ch.islower() or (ch.isalpha() and not ch.isupper())


def _is_upper(ch: str) -> bool:
    return ch.isupper() or (ch.isalpha() and not ch.islower())


# --- spaCy English tokenization rules ------------------------------------------------

_DIGITS = frozenset("0123456789")
_PUNCT = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"
_CURRENCY = ["$", "£", "€", "¥", "฿", "US$", "C$", "A$", "₽", "﷼", *map(chr, range(0x20A0, 0x20C0))]
_UNITS = (
    "km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz "
    "m/s km/h kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K % км км² км³ м м² м³ дм дм² "
    "дм³ см см² см³ мм мм² мм³ нм кг г мг м/с км/ч кПа Па мбар Кб КБ кб Мб МБ мб Гб ГБ гб Тб ТБ "
    "тбكم كم² كم³ م م² م³ سم سم² سم³ مم مم² مم³ كم غرام جرام جم كغ ملغ كوب اكواب"
).split()
_PREFIX_CHARS = frozenset("§%=—–" + _PUNCT + _QUOTES + "".join(c for c in _CURRENCY if len(c) == 1))
_SUFFIX_CHARS = frozenset(_PUNCT + _QUOTES + "—–")
#: Characters after which a final "." is split off (spaCy: digits, lower-case
#: letters, `%²-+`, and the punctuation and quote classes as written).
_DOT_AFTER = frozenset("%²-+|(?:)" + _PUNCT + _QUOTES) | _DIGITS
_UNIT_LAST = frozenset(u[-1] for u in _CURRENCY + _UNITS)
_INFIX_CANDIDATE = re.compile("[.…+\\-*^,–—~:<>=/\u00a6-\U0010ffff]")
_HYPHENS = ("-", "–", "—", "--", "---", "——", "~")

_URL = re.compile(
    r"^(?:[\w+\-.]{2,}://)?"  # scheme
    r"(?:\S+(?::\S*)?@)?"  # user[:password]@
    r"(?:"
    r"(?!(?:10|127)(?:\.\d{1,3}){3})(?!(?:169\.254|192\.168)(?:\.\d{1,3}){2})"
    r"(?!172\.(?:1[6-9]|2\d|3[0-1])(?:\.\d{1,3}){2})"
    r"(?:[1-9]\d?|1\d\d|2[01]\d|22[0-3])(?:\.(?:1?\d{1,2}|2[0-4]\d|25[0-5])){2}"
    r"(?:\.(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4]))"  # a public IPv4 address
    r"|(?:(?:[A-Za-z0-9\u00a1-\uffff][A-Za-z0-9\u00a1-\uffff_-]{0,62})?[A-Za-z0-9\u00a1-\uffff]\.)+"
    r"([^\W\d_]{2,63})"  # host names and a TLD (lower-case: checked by _is_url)
    r")(?::\d{2,5})?(?:[/?#]\S*)?$"
)


def _is_url(s: str) -> bool:
    match = _URL.match(s)
    if match is None:
        return False
    tld = match.group(1)
    return tld is None or all(map(_is_lower, tld)) or _URL_ASCII_TLD.match(s) is not None


_URL_ASCII_TLD = re.compile(_URL.pattern.replace(r"([^\W\d_]{2,63})", "(?:[a-z]{2,63})"))


def _special_cases() -> dict[str, tuple[str, ...]]:
    """spaCy English's tokenizer exceptions, generated the way spaCy generates them."""
    exc: dict[str, tuple[str, ...]] = {}

    def add(*pieces: str) -> None:
        exc["".join(pieces)] = pieces

    def both_cases(word: str, *rest: str) -> None:
        add(word, *rest)
        add(word.title(), *rest)

    for orth in ("i", "I"):
        add(orth, "'m"), add(orth, "m"), add(orth, "'m", "a"), add(orth, "m", "a")
    for pron in ("i", "you", "he", "she", "it", "we", "they"):
        for tail in (("'ll",), ("ll",), ("'ll", "'ve"), ("ll", "ve"), ("'d",), ("d",), ("'d", "'ve"), ("d", "ve")):
            both_cases(pron, *tail)
    for pron in ("i", "you", "we", "they"):
        both_cases(pron, "'ve"), both_cases(pron, "ve")
    for pron in ("you", "we", "they"):
        both_cases(pron, "'re"), both_cases(pron, "re")
    for pron in ("he", "she", "it"):
        both_cases(pron, "'s"), both_cases(pron, "s")
    for word in ("who", "what", "when", "where", "why", "how", "there", "that", "this", "these", "those"):
        plural, singular = word in ("these", "those"), word in ("that", "this")
        tails = [("'ll",), ("ll",), ("'ll", "'ve"), ("ll", "ve"), ("'d",), ("d",), ("'d", "'ve"), ("d", "ve")]
        if not plural:
            tails += [("'s",), ("s",)]
        if not singular:
            tails += [("'re",), ("re",), ("'ve",), ("ve",)]
        for tail in tails:
            both_cases(word, *tail)
    for verb in ("ca", "could", "do", "does", "did", "had", "may", "might", "must", "need", "ought", "sha",
                 "should", "wo", "would"):
        for tail in (("n't",), ("nt",), ("n't", "'ve"), ("nt", "ve")):
            both_cases(verb, *tail)
    for verb in ("could", "might", "must", "should", "would"):
        both_cases(verb, "'ve"), both_cases(verb, "ve")
    for verb in ("ai", "are", "is", "was", "were", "have", "has", "dare"):
        both_cases(verb, "n't"), both_cases(verb, "nt")
    for word in ("doin", "goin", "nothin", "nuthin", "ol", "somethin"):
        both_cases(word), both_cases(word + "'")
    for word in ("em", "ll", "nuff"):
        add(word), add("'" + word)
    for hour in range(1, 13):
        for period in ("a.m.", "am", "p.m.", "pm"):
            add(str(hour), period)
    add("y'", "all"), add("y", "all"), add("how", "'d", "'y"), add("How", "'d", "'y")
    both_cases("not", "'ve"), both_cases("not", "ve"), both_cases("can", "not"), both_cases("gon", "na")
    both_cases("got", "ta"), both_cases("let", "'s"), add("c'm", "on"), add("C'm", "on")
    singles = (
        "'S 's \u2018S \u2018s and/or w/o 're 'Cause 'cause 'cos 'Cos 'coz 'Coz 'cuz 'Cuz 'bout ma'am Ma'am "
        "o'clock O'clock lovin' Lovin' lovin Lovin havin' Havin' havin Havin doin' Doin' doin Doin goin' "
        "Goin' goin Goin Mt. Ak. Ala. Apr. Ariz. Ark. Aug. Calif. Colo. Conn. Dec. Del. Feb. Fla. Ga. Ia. "
        "Id. Ill. Ind. Jan. Jul. Jun. Kan. Kans. Ky. La. Mar. Mass. Mich. Minn. Miss. N.C. N.D. N.H. N.J. "
        "N.M. N.Y. Neb. Nebr. Nev. Nov. Oct. Okla. Ore. Pa. S.C. Sep. Sept. Tenn. Va. Wash. Wis. 'd a.m. "
        "Adm. Bros. co. Co. Corp. D.C. Dr. e.g. E.g. E.G. Gen. Gov. i.e. I.e. I.E. Inc. Jr. Ltd. Md. "
        "Messrs. Mo. Mont. Mr. Mrs. Ms. p.m. Ph.D. Prof. Rep. Rev. Sen. St. vs. v.s."
    )
    for word in singles.split():
        add(word)
    for word in ("Ill", "ill", "Its", "its", "Hell", "hell", "Shell", "shell", "Shed", "shed", "were", "Were",
                 "Well", "well", "Whore", "whore"):
        exc.pop(word, None)
    base = [
        "'", '\\")', "<space>", "''", "C++", "\\t", "\\n", "\u2014",
        *(c + "." for c in "abcdefghijklmnopqrstuvwxyzäöü"),
        *r"""
        :) :-) :)) :-)) :))) :-))) (: (-: =) (= :] :-] [: [-: [= =] :o) (o: :} :-} 8) 8-) (-8 ;) ;-) (; (-;
        :( :-( :(( :-(( :((( :-((( ): )-: =( >:( :') :'-) :'( :'-( :/ :-/ =/ =| :| :-| ]= =[ :1 :P :-P :p
        :-p :O :-O :o :-o :0 :-0 :() >:o :* :-* :3 :-3 =3 :> :-> :X :-X :x :-x :D :-D ;D ;-D =D xD XD xDD
        XDD 8D 8-D ^_^ ^__^ ^___^ >.< >.> <.< ._. ;_; -_- -__- v.v V.V v_v V_V o_o o_O O_o O_O 0_o o_0 0_0
        o.O O.o O.O o.o 0.0 o.0 0.o @_@ <3 <33 <333 </3 (^_^) (-_-) (._.) (>_<) (*_*) (¬_¬) ಠ_ಠ ಠ︵ಠ
        (ಠ_ಠ) ¯\(ツ)/¯ (╯°□°）╯︵┻━┻ ><(((*> °C. °F. °K. °c. °f. °k.
        """.split(),
    ]
    for word in base:
        exc.setdefault(word, (word,))
    for key, pieces in list(exc.items()):  # typographic apostrophes too
        if "'" in key:
            exc.setdefault(key.replace("'", "\u2019"), tuple(p.replace("'", "\u2019") for p in pieces))
    return exc


SPECIAL_CASES = _special_cases()


#: Longest special case: longer strings need no lookup.
_MAX_SPECIAL = max(map(len, SPECIAL_CASES))
_UNIT_SET = frozenset(_CURRENCY + _UNITS)
_MAX_UNIT = max(map(len, _UNIT_SET))
#: URLs longer than this are not recognised as one token (spaCy's URL pattern
#: can take quadratic time on long strings; no real URL is this long).
_MAX_URL = 4096
_DOT_RUN = re.compile(r"\.+")


def _special_at(s: str, i: int, j: int, specials: dict) -> tuple[str, ...] | None:
    return specials.get(s[i:j]) if j - i <= _MAX_SPECIAL else None


def _prefix_len(s: str, i: int, j: int) -> int:
    """Length of spaCy's prefix match at the start of s[i:j] (j > i)."""
    c = s[i]
    if c == ".":
        if i + 1 < j and s[i + 1] == ".":
            return min(_DOT_RUN.match(s, i).end(), j) - i
        return 0
    if c == "+":
        return 0 if i + 1 < j and s[i + 1] in _DIGITS else 1
    if c in _PREFIX_CHARS:
        return 1
    if s.startswith("US$", i, j):
        return 3
    if s.startswith(("C$", "A$"), i, j):
        return 2
    return 1 if _is_icon(c) else 0


def _suffix_len(s: str, i: int, j: int) -> int:
    """Length of spaCy's suffix match at the end of s[i:j] (j > i): the leftmost-starting alternative wins."""
    n = j - i
    c = s[j - 1]
    start = j
    if c == ".":
        k = j - 1
        while k > i and s[k - 1] == ".":
            k -= 1
        if j - k >= 2:
            start = k
        elif n >= 2 and (s[j - 2] in _DOT_AFTER or _is_lower(s[j - 2])):
            start = j - 1
        elif n >= 3 and _is_upper(s[j - 2]) and _is_upper(s[j - 3]):
            start = j - 1
        elif n >= 3 and s[j - 3] == "°" and s[j - 2] in "FfCcKk":
            start = j - 1
    elif c in _SUFFIX_CHARS or _is_icon(c):
        start = j - 2 if n >= 2 and s[j - 2] == "…" and c == "…" else j - 1
    elif c == "+" and n >= 2 and s[j - 2] in _DIGITS:
        start = j - 1
    if n >= 2 and s[j - 2:j] in ("'s", "'S", "’s", "’S"):
        start = min(start, j - 2)
    if c in _UNIT_LAST and n >= 2:
        for k in range(min(_MAX_UNIT, n - 1), 0, -1):  # the longest unit after a digit
            if s[j - k - 1] in _DIGITS and s[j - k:j] in _UNIT_SET:
                start = min(start, j - k)
                break
    return j - start


def _infix_spans(s: str) -> list[tuple[int, int]]:
    """spaCy English's infixes, left to right, as (start, end) spans."""
    spans = []
    n = len(s)
    end = 0
    for found in _INFIX_CANDIDATE.finditer(s):
        i = found.start()
        if i < end:
            continue
        c = s[i]
        m = 0
        if c == ".":
            if i + 1 < n and s[i + 1] == ".":
                m = _DOT_RUN.match(s, i).end() - i
            elif 0 < i < n - 1 and (_is_lower(s[i - 1]) or s[i - 1] in _QUOTES) and (
                _is_upper(s[i + 1]) or s[i + 1] in _QUOTES
            ):
                m = 1
        elif c == "…" or _is_icon(c):
            m = 1
        elif i:
            prev = s[i - 1]
            nxt = s[i + 1] if i + 1 < n else ""
            if c in "+-*^" and prev in _DIGITS and nxt and (nxt in _DIGITS or nxt == "-"):
                m = 1
            elif c == "," and nxt and prev.isalpha() and nxt.isalpha():
                m = 1
            elif c in "-–—~" and (prev.isalpha() or prev in _DIGITS):
                for hyphen in _HYPHENS:
                    k = len(hyphen)
                    if s.startswith(hyphen, i) and i + k < n and s[i + k].isalpha():
                        m = k
                        break
            elif c in ":<>=/" and nxt and (prev.isalpha() or prev in _DIGITS) and nxt.isalpha():
                m = 1
        if m:
            spans.append((i, i + m))
            end = i + m
    return spans


def _split(chunk: str, specials: dict[str, tuple[str, ...]]) -> list[str]:
    """spaCy's affix loop, then URL or infix splitting of what is left.

    Works on indices into `chunk` (no repeated slicing), so that long
    chunks cost linear time.
    """
    special = _special_at(chunk, 0, len(chunk), specials)
    if special is not None:
        return list(special)
    if chunk.isalpha():
        return [chunk]
    prefixes: list[str] = []
    suffixes: list[str] = []
    i, j = 0, len(chunk)
    last = -1
    while i < j and j - i != last:
        if _special_at(chunk, i, j, specials) is not None:
            break
        last = j - i
        pre = _prefix_len(chunk, i, j)
        if pre and i + pre < j and _special_at(chunk, i + pre, j, specials) is not None:
            prefixes.append(chunk[i:i + pre])
            i += pre
            break
        suf = _suffix_len(chunk, i + pre, j) if j > i + pre else 0
        if suf and j - suf > i and _special_at(chunk, i, j - suf, specials) is not None:
            suffixes.append(chunk[j - suf:j])
            j -= suf
            break
        if pre and suf and pre + suf <= j - i:
            prefixes.append(chunk[i:i + pre])
            suffixes.append(chunk[j - suf:j])
            i, j = i + pre, j - suf
        elif pre:
            prefixes.append(chunk[i:i + pre])
            i += pre
        elif suf:
            suffixes.append(chunk[j - suf:j])
            j -= suf
    tokens = prefixes
    s = chunk[i:j]
    if s:
        special = _special_at(s, 0, len(s), specials)
        if special is not None:
            tokens.extend(special)
        elif "." in s and len(s) <= _MAX_URL and _is_url(s):
            tokens.append(s)
        else:
            start = 0
            for a, b in () if s.isalnum() else _infix_spans(s):
                if a == 0:
                    continue
                if a != start:
                    tokens.append(s[start:a])
                tokens.append(s[a:b])
                start = b
            if start < len(s):
                tokens.append(s[start:])
    tokens.extend(reversed(suffixes))
    return tokens


#: Special cases that contain punctuation spaCy splits off; spaCy re-joins
#: them after splitting (its "special matcher"), keyed by the joined text,
#: with the token sequence they are recognised as.
_REJOIN = {
    key: tuple(_split(key, {}))
    for key in SPECIAL_CASES
    if len(_split(key, {})) > 1
}
_REJOIN_BY_START: dict[tuple[str, str], list[tuple[str, ...]]] = {}
for _pattern in _REJOIN.values():
    _REJOIN_BY_START.setdefault(_pattern[:2], []).append(_pattern)


def _rejoin_specials(tokens: list[str]) -> list[str]:
    spans = []
    for i in range(len(tokens) - 1):
        patterns = _REJOIN_BY_START.get((tokens[i], tokens[i + 1]))
        if patterns:
            for pattern in patterns:
                j = i + len(pattern)
                if j <= len(tokens) and tuple(tokens[i:j]) == pattern:
                    spans.append((i, j))
    if not spans:
        return tokens
    # Longest first, then leftmost; a span is taken when its first and last
    # tokens are not yet covered (every span considered covers its tokens).
    spans.sort(key=lambda span: (span[0] - span[1], span[0]))
    seen: set[int] = set()
    chosen = {}
    for i, j in spans:
        if i not in seen and j - 1 not in seen:
            chosen[i] = j
        seen.update(range(i, j))
    out = []
    i = 0
    while i < len(tokens):
        j = chosen.get(i)
        if j is None:
            out.append(tokens[i])
            i += 1
        else:
            out.extend(SPECIAL_CASES["".join(tokens[i:j])])
            i = j
    return out


#: The commonest shape of chunk: a word with one bracket or quote before it
#: and/or one punctuation mark after it (the shortcut gives `_split`'s answer).
_SIMPLE = re.compile(r"([(\[{\"'`“‘«]?)([^\W\d_]+)([,;:!?)\]}\"'`”’».]?)")


def _split_simple(chunk: str) -> list[str] | None:
    match = _SIMPLE.fullmatch(chunk)
    if match is None:
        return None
    pre, body, suf = match.groups()
    if suf == "." and not (_is_lower(body[-1]) or (len(body) > 1 and _is_upper(body[-1]) and _is_upper(body[-2]))):
        return None
    if (pre and chunk[1:] in SPECIAL_CASES) or (suf and chunk[:-1] in SPECIAL_CASES) or not body.isalpha():
        return None
    tokens = [pre] if pre else []
    tokens.extend(SPECIAL_CASES.get(body, (body,)))
    if suf:
        tokens.append(suf)
    return tokens


def split_chunk(chunk: str) -> list[str]:
    """The tokens spaCy's blank English tokenizer makes of one whitespace-free chunk."""
    special = _special_at(chunk, 0, len(chunk), SPECIAL_CASES)
    if special is not None:
        return list(special)
    tokens = _split_simple(chunk)
    if tokens is None:
        tokens = _split(chunk, SPECIAL_CASES)
    return _rejoin_specials(tokens) if len(tokens) > 1 else tokens


def split_words(text: str) -> list[str]:
    """spaCy-compatible words of one text (for tests and one-off use; filters use `WordSplitter`)."""
    return [token for chunk in text.split() for token in split_chunk(chunk)]


# --- the vocabulary -------------------------------------------------------------------

#: Token flags (bits of `Tokens.flags`).
SYMBOL = 1  # every character is a Gopher symbol
HAS_ALPHA = 2  # at least one alphabetic character
PUNCT = 4  # spaCy's is_punct: every character is Unicode punctuation (P*)
SENT_END = 8  # a sentence terminal on its own ('.', '!', '?', ...)


def _token_flags(token: str) -> int:
    flags = 0
    if not token.strip(_GOPHER_SYMBOLS_STR):
        flags |= SYMBOL
    if any(ch.isalpha() for ch in token):
        flags |= HAS_ALPHA
    if all(unicodedata.category(ch)[0] == "P" for ch in token):
        flags |= PUNCT
    if token in TERMINAL_PUNCTUATION:
        flags |= SENT_END
    return flags


class _Growable:
    """A numpy array that grows by doubling."""

    def __init__(self, dtype) -> None:
        self.data = np.zeros(1024, dtype=dtype)
        self.size = 0

    def extend(self, values) -> None:
        values = np.asarray(values, dtype=self.data.dtype)
        end = self.size + len(values)
        if end > len(self.data):
            grown = np.zeros(max(end, 2 * len(self.data)), dtype=self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size:end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self.data[: self.size]


class _Vocab:
    def __init__(self, split: Callable[[str], list[str]]) -> None:
        self.split = split
        self.chunks: dict[str, int] = {}
        self.chunk_start = _Growable(np.int64)  # into chunk_tokens
        self.chunk_count = _Growable(np.int32)
        self.chunk_tokens = _Growable(np.int32)
        self.tokens: dict[str, int] = {}
        self.token_length = _Growable(np.int32)
        self.token_flags = _Growable(np.uint8)

    def chunk_ids(self, chunks: list[str]) -> np.ndarray:
        """Vocabulary ids of `chunks`, tokenizing and adding the new ones."""
        get = self.chunks.get
        ids = [get(c, -1) for c in chunks]
        new = [i for i, cid in enumerate(ids) if cid < 0]
        if new:
            tokens = self.tokens
            new_tokens: list[str] = []
            starts, counts, flat = [], [], []
            position = self.chunk_tokens.size
            for i in new:
                chunk = chunks[i]
                cid = self.chunks.get(chunk)
                if cid is None:  # (a chunk can be new twice in one call only if `chunks` repeats)
                    pieces = self.split(chunk)
                    for token in pieces:
                        tid = tokens.get(token)
                        if tid is None:
                            tid = tokens[token] = len(tokens)
                            new_tokens.append(token)
                        flat.append(tid)
                    cid = self.chunks[chunk] = len(self.chunks)
                    starts.append(position)
                    counts.append(len(pieces))
                    position += len(pieces)
                ids[i] = cid
            self.chunk_start.extend(starts)
            self.chunk_count.extend(counts)
            self.chunk_tokens.extend(flat)
            self.token_length.extend([len(t) for t in new_tokens])
            self.token_flags.extend([_token_flags(t) for t in new_tokens])
        return np.array(ids, dtype=np.int64)


@dataclass
class Tokens:
    """The words of `n` strings: flat token ids with per-row offsets."""

    ids: np.ndarray  # int32, vocabulary ids
    offsets: np.ndarray  # int64, len n + 1
    length: np.ndarray  # int32, characters per token
    flags: np.ndarray  # uint8, SYMBOL | HAS_ALPHA | PUNCT | SENT_END
    vocab: "_Vocab" = field(repr=False)

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    @cached_property
    def row(self) -> np.ndarray:
        """Row index of every token."""
        return np.repeat(np.arange(len(self.offsets) - 1), self.counts)

    def ids_of(self, words) -> np.ndarray:
        """Vocabulary ids of `words` that occur in this vocabulary."""
        return np.array([self.vocab.tokens[w] for w in words if w in self.vocab.tokens], dtype=np.int32)


def _whole_chunk(chunk: str) -> list[str]:
    # Arrow's whitespace split leaves empty chunks at the ends of a text; `str.split()` does not.
    return [chunk] if chunk else []


class WordSplitter:
    """Word splitting of Arrow string arrays, with a chunk cache.

    By default words are spaCy English tokens (`split_chunk`); with
    `spacy=False` a word is a whole whitespace-separated chunk (the Gopher
    paper's words). Thread-safe; one instance of each (`WORDS`,
    `WHITESPACE_WORDS`) is shared by all filters of a process so that the
    cache warms once. When the cache holds more than `max_chunks` distinct
    chunks it starts afresh (token ids are only comparable within one
    `Tokens`).
    """

    def __init__(self, max_chunks: int = 1_000_000, spacy: bool = True) -> None:
        self.max_chunks = max_chunks
        self._split = split_chunk if spacy else _whole_chunk
        self._vocab = _Vocab(self._split)
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every chunk seen (the next batches start with a cold cache)."""
        with self._lock:
            self._vocab = _Vocab(self._split)

    def split(self, strings: pa.Array) -> Tokens:
        strings = _as_array(strings)
        lists = pc.utf8_split_whitespace(strings)
        chunks_per_row = _list_lengths(lists)
        flat = pc.list_flatten(lists)
        with self._lock:
            if len(self._vocab.chunks) > self.max_chunks:
                self._vocab = _Vocab(self._split)
            vocab = self._vocab
            if len(flat):
                encoded = pc.dictionary_encode(flat)
                index = np.asarray(encoded.indices, dtype=np.int64)
                chunks = vocab.chunk_ids(encoded.dictionary.to_pylist())[index]
            else:
                chunks = np.zeros(0, dtype=np.int64)
            count = vocab.chunk_count.view()[chunks].astype(np.int64)
            start = vocab.chunk_start.view()[chunks]
            chunk_tokens = vocab.chunk_tokens.view()
            token_length = vocab.token_length.view()
            token_flags = vocab.token_flags.view()
        ends = np.cumsum(count)
        total = int(ends[-1]) if len(ends) else 0
        positions = np.arange(total, dtype=np.int64) - np.repeat(ends - count - start, count)
        token_ids = chunk_tokens[positions]
        chunk_offsets = np.concatenate([[0], np.cumsum(chunks_per_row)])
        token_ends = np.concatenate([[0], ends])
        return Tokens(
            ids=token_ids,
            offsets=token_ends[chunk_offsets],
            length=token_length[token_ids],
            flags=token_flags[token_ids],
            vocab=vocab,
        )


WORDS = WordSplitter()
WHITESPACE_WORDS = WordSplitter(spacy=False)

#: `static.heuristics.words`: how the word-counting rules split words.
WORDS_PAPER = "paper"
WORDS_DATATROVE = "datatrove"
WORD_DEFINITIONS = (WORDS_PAPER, WORDS_DATATROVE)


# --- arrays ----------------------------------------------------------------------------


def _as_array(values) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if values.null_count:
        values = pc.fill_null(values, "")
    return values


def _list_lengths(lists: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(pc.list_value_length(lists), 0), dtype=np.int64)


def per_row_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of `values` over each row's slice (rows given by `offsets`, len n+1)."""
    csum = np.concatenate([[0], np.cumsum(values, dtype=np.float64 if values.dtype.kind == "f" else np.int64)])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def bool_array(values: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(values, False), dtype=bool)


@dataclass
class Pieces:
    """Strings cut from the rows of a batch (lines, paragraphs), flat with row offsets."""

    values: pa.Array
    offsets: np.ndarray  # int64, len n + 1

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    @cached_property
    def row(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.offsets) - 1), self.counts)

    @cached_property
    def length(self) -> np.ndarray:
        return np.asarray(pc.utf8_length(self.values), dtype=np.int64)

    def take(self, mask: np.ndarray) -> "Pieces":
        counts = np.bincount(self.row[mask], minlength=len(self.offsets) - 1)
        return Pieces(self.values.filter(pa.array(mask)), np.concatenate([[0], np.cumsum(counts)]))

    def sum(self, values: np.ndarray) -> np.ndarray:
        return per_row_sum(values, self.offsets)

    def duplicates(self) -> np.ndarray:
        """True for every piece equal to an earlier piece of the same row."""
        if not len(self.values):
            return np.zeros(0, dtype=bool)
        encoded = pc.dictionary_encode(self.values)
        key = self.row * len(encoded.dictionary) + np.asarray(encoded.indices, dtype=np.int64)
        dup = np.ones(len(key), dtype=bool)
        dup[group(key)[2]] = False
        return dup


def group(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal values as groups: (group of each value, size of each group, first index of each group).

    `np.unique(..., return_index, return_inverse, return_counts)` without its
    stable sort (several times faster on 64-bit keys).
    """
    if not len(values):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(values, kind="quicksort")
    ordered = values[order]
    new = np.empty(len(values), dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(values)))
    first = np.minimum.reduceat(order, starts)
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return inverse, counts, first


def split_pieces(texts: pa.Array, pattern: str, regex: bool = True) -> Pieces:
    lists = pc.split_pattern_regex(texts, pattern) if regex else pc.split_pattern(texts, pattern)
    counts = _list_lengths(lists)
    return Pieces(pc.list_flatten(lists), np.concatenate([[0], np.cumsum(counts)]))


#: A line that starts a list item (CommonMark's bullet and ordered markers,
#: and the bullets of plain-text READMEs): never the continuation of the line before.
_LIST_ITEM_RE = r"^[ \t]*(?:[-*+\x{2022}\x{2023}\x{25e6}o]|\(?[0-9]{1,3}[.)]|\(?[a-zA-Z][.)])[ \t]"
#: A heading underline (setext, reStructuredText): its own line.
_UNDERLINE_RE = r"^[ \t]*(?:=+|-+|~+|\^+|\*+|#+|_+)[ \t\r]*$"


#: A line that ends a sentence (a terminal, then perhaps closing quotes or brackets) was not cut mid-sentence.
_SENTENCE_END_RE = "[" + "".join(f"\\x{{{ord(c):x}}}" for c in sorted(TERMINAL_PUNCTUATION)) + r"][\"')\]\x{2019}\x{201d}]*$"


def reflow_hard_wrapped(texts: pa.Array, min_width: int, max_width: int) -> pa.Array:
    """`texts` with the soft line breaks of hard-wrapped paragraphs replaced by spaces.

    Text wrapped at a fixed width (READMEs, NEWS files, e-mail, package
    descriptions: 72-80 columns) breaks lines mid-sentence; web-page
    extractions, for which C4's and FineWeb's line rules were designed, put
    one paragraph on one line. A break is taken to be soft exactly where a
    greedy line-filler (`fmt`, `textwrap`, an editor's auto-wrap) would have
    made it: between two non-blank lines of a paragraph (a run of non-blank
    lines) whose widest line W is a wrap width (`min_width` <= W <=
    `max_width`), when the first line has at least two words, does not end
    a sentence (a line that ends one was not cut mid-sentence), and the next
    line's first word would not have fitted after it (width + 1 + word > W),
    unless the next line starts a list item or is a heading underline.

    Lines far shorter than their paragraph's width (menus, headings, lists of
    short items, key: value headers), one-word lines (paths, hashes) and
    paragraphs with lines wider than `max_width` (web text, where a line is
    already a paragraph) are left as they are. Only "\\n" (with a "\\r"
    before it) is replaced, byte for byte, so offsets do not move.
    """
    texts = _as_array(texts)
    if texts.offset:
        texts = pc.take(texts, pa.array(np.arange(len(texts)), pa.int64()))
    lines = split_pieces(texts, "\n", regex=False)
    values = lines.values
    if len(values) < 2:
        return texts
    width = np.asarray(pc.utf8_length(pc.utf8_rtrim_whitespace(values)), dtype=np.int64)
    content = pc.utf8_trim_whitespace(values)
    blank = np.asarray(pc.utf8_length(content), dtype=np.int64) == 0
    first_word = np.asarray(pc.utf8_length(pc.struct_field(pc.extract_regex(values, r"^\s*(?P<w>\S*)"), [0])),
                            dtype=np.int64)
    two_words = bool_array(pc.match_substring_regex(content, r"\S\s+\S"))
    ends_sentence = bool_array(pc.match_substring_regex(content, _SENTENCE_END_RE))
    starts_block = bool_array(pc.match_substring_regex(values, _LIST_ITEM_RE)) | bool_array(
        pc.match_substring_regex(values, _UNDERLINE_RE))
    row = lines.row
    first_of_row = np.zeros(len(values), dtype=bool)
    first_of_row[lines.offsets[:-1][lines.counts > 0]] = True
    # Paragraphs: runs of non-blank lines within a row (each blank line is a run of its own).
    new_run = first_of_row | blank
    new_run[1:] |= blank[:-1]
    run = np.cumsum(new_run) - 1
    run_starts = np.flatnonzero(new_run)
    run_width = np.maximum.reduceat(width, run_starts)[run]
    nxt = np.arange(1, len(values))
    here = nxt - 1
    join = (
        (run[here] == run[nxt]) & ~blank[here] & ~blank[nxt]
        & (run_width[here] >= min_width) & (run_width[here] <= max_width)
        & two_words[here] & ~ends_sentence[here] & ~starts_block[nxt]
        & (width[here] + 1 + first_word[nxt] > run_width[here])
    )
    if not join.any():
        return texts
    # The byte offset of the "\n" that ends each line: its row's start plus the bytes of the
    # lines before it, each followed by its "\n".
    step = np.asarray(pc.binary_length(values), dtype=np.int64) + 1
    end_in_row = np.cumsum(step)
    end_in_row -= np.concatenate([[0], end_in_row])[lines.offsets[:-1]][row]
    buffers = texts.buffers()
    offset_type = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    text_offsets = np.frombuffer(buffers[1], dtype=offset_type)[: len(texts) + 1].astype(np.int64)
    newline = text_offsets[row[here[join]]] + end_in_row[here[join]] - 1
    # The copy goes into a buffer from Arrow's allocator, which pads it: Arrow's string kernels may read a
    # few bytes past the last string (utf8_split_whitespace did: on a bare numpy copy the last text's
    # split depended on whatever memory followed, and so, under threads, on the other thread's work).
    out = pa.allocate_buffer(buffers[2].size)
    data = np.frombuffer(out, dtype=np.uint8)
    data[:] = np.frombuffer(buffers[2], dtype=np.uint8)
    data[newline] = 0x20
    cr = newline[(newline > 0)]
    cr = cr[data[cr - 1] == 0x0D]
    data[cr - 1] = 0x20
    return pa.Array.from_buffers(texts.type, len(texts), [buffers[0], buffers[1], out],
                                 null_count=texts.null_count)


class BatchText:
    """The units of a batch's `text` column, each computed once on first use."""

    def __init__(self, texts: pa.Array) -> None:
        self.texts = _as_array(texts)
        self.n = len(self.texts)
        self._reflowed: dict[tuple[int, int], BatchText] = {}
        self._plain: BatchText | None = None

    def plain(self) -> "BatchText":
        """The units of these texts with their markup taken out (`filters.markup.markup_to_text`), cached."""
        if self._plain is None:
            from filters.markup import markup_to_text

            self._plain = BatchText(markup_to_text(self.texts))
        return self._plain

    def reflowed(self, min_width: int, max_width: int) -> "BatchText":
        """The units of these texts with hard-wrapped paragraphs joined (`reflow_hard_wrapped`), cached."""
        key = (min_width, max_width)
        if key not in self._reflowed:
            self._reflowed[key] = BatchText(reflow_hard_wrapped(self.texts, min_width, max_width))
        return self._reflowed[key]

    @cached_property
    def length(self) -> np.ndarray:
        """Characters per text."""
        return np.asarray(pc.utf8_length(self.texts), dtype=np.int64)

    @cached_property
    def words(self) -> Tokens:
        """spaCy-compatible words (datatrove's `split_into_words`)."""
        return WORDS.split(self.texts)

    @cached_property
    def whitespace_words(self) -> Tokens:
        """Whitespace-separated words (`str.split()`), as the Gopher paper counts them."""
        return WHITESPACE_WORDS.split(self.texts)

    def words_for(self, definition: str) -> Tokens:
        """The words of `definition`: "paper" (whitespace) or "datatrove" (spaCy tokens)."""
        if definition == WORDS_PAPER:
            return self.whitespace_words
        if definition == WORDS_DATATROVE:
            return self.words
        raise ValueError(f"unknown word definition {definition!r} (expected one of {WORD_DEFINITIONS})")

    def count(self, substring: str) -> np.ndarray:
        """Non-overlapping occurrences of `substring` per text (as `str.count`)."""
        return np.asarray(pc.count_substring(self.texts, substring), dtype=np.int64)

    @cached_property
    def lines(self) -> Pieces:
        """`text.splitlines()`: no empty last line after a final line break."""
        pieces = split_pieces(self.texts, LINE_BREAK_RE)
        trailing = bool_array(pc.match_substring_regex(self.texts, f"(?:{LINE_BREAK_RE})$")) | (self.length == 0)
        if not trailing.any():
            return pieces
        keep = np.ones(len(pieces.values), dtype=bool)
        keep[pieces.offsets[1:][trailing] - 1] = False
        return pieces.take(keep)

    @cached_property
    def newline_lines(self) -> Pieces:
        """`text.split("\\n")`."""
        return split_pieces(self.texts, "\n", regex=False)

    @cached_property
    def line_runs(self) -> Pieces:
        """`re.split("\\n+", text)`."""
        return split_pieces(self.texts, r"\n+")

    @cached_property
    def paragraphs(self) -> Pieces:
        """`re.split("\\n{2,}", text.strip())`."""
        return split_pieces(pc.utf8_trim_whitespace(self.texts), r"\n{2,}")


_CACHE_LOCK = threading.Lock()
_CACHE: list[tuple[tuple, BatchText]] = []


def batch_text(batch: pa.RecordBatch | pa.Table, column: str = "text") -> BatchText:
    """The `BatchText` of `batch[column]`, shared by all filters applied to the same batch.

    A small cache keyed on the identity of the column's Arrow buffers (kept
    alive by the cache entry, so a key cannot be reused by another array).
    """
    texts = batch.column(column)
    if isinstance(texts, pa.ChunkedArray) and texts.num_chunks == 1:
        texts = texts.chunk(0)
    if isinstance(texts, pa.ChunkedArray):
        return BatchText(texts)
    key = (texts.type, texts.offset, len(texts), *(b.address if b is not None else 0 for b in texts.buffers()))
    with _CACHE_LOCK:
        for cached_key, units in _CACHE:
            if cached_key == key:
                return units
    units = BatchText(texts)
    with _CACHE_LOCK:
        _CACHE.insert(0, (key, units))
        del _CACHE[2:]
    return units


def sentence_counts(tokens: Tokens) -> np.ndarray:
    """Sentences per row as spaCy's sentencizer counts them (at least 1 per row).

    A new sentence starts at a token that is neither punctuation nor a
    sentence terminal when a terminal ('.', '!', '?', ...) was seen since the
    previous such token of the row.
    """
    n_rows = len(tokens.offsets) - 1
    if not len(tokens.ids):
        return np.ones(n_rows, dtype=np.int64)
    ends = (tokens.flags & SENT_END) != 0
    candidate = ((tokens.flags & (PUNCT | SENT_END)) == 0)
    seen = np.concatenate([[0], np.cumsum(ends)])  # terminals before position k
    pos = np.flatnonzero(candidate)
    row = tokens.row[pos]
    prev = np.empty_like(pos)
    if len(pos):
        prev[0] = tokens.offsets[row[0]]
        prev[1:] = pos[:-1] + 1
        first_in_row = np.ones(len(pos), dtype=bool)
        first_in_row[1:] = row[1:] != row[:-1]
        prev[first_in_row] = tokens.offsets[row[first_in_row]]
    boundary = seen[pos] > seen[prev]
    return 1 + np.bincount(row[boundary], minlength=n_rows)


# --- per-row rules -----------------------------------------------------------------------


def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den per row, NaN where den is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def verdicts(name: str, n: int, rules: list[tuple[str, np.ndarray]], scores: dict[str, np.ndarray]) -> FilterResult:
    """A filter's result from (rule, failed) pairs in the order they are checked.

    A row's reason is `name:rule` of the first rule it fails; scores are
    stored as `name:score`, float64.
    """
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    for rule, failed in rules:
        newly = np.flatnonzero(keep & failed)
        if len(newly):
            keep[newly] = False
            label = f"{name}:{rule}"
            for i in newly.tolist():
                reason[i] = label
    return FilterResult(keep, reason, {f"{name}:{k}": np.asarray(v, dtype=np.float64) for k, v in scores.items()})


def below(values: np.ndarray, threshold) -> np.ndarray:
    """Rows under `threshold` (none when the threshold is None: the rule is off)."""
    if threshold is None:
        return np.zeros(len(values), dtype=bool)
    return values < threshold  # NaN compares False: a rule that cannot be computed does not drop


def above(values: np.ndarray, threshold) -> np.ndarray:
    """Rows over `threshold` (none when the threshold is None: the rule is off)."""
    if threshold is None:
        return np.zeros(len(values), dtype=bool)
    return values > threshold


def regex_escape_class(chars) -> str:
    """An RE2 character-class body matching exactly `chars`."""
    return "".join(f"\\x{{{ord(c):x}}}" for c in sorted(chars))


__all__ = [
    "ratio", "above", "below", "verdicts", "group",
    "BatchText", "Pieces", "Tokens", "WordSplitter", "WORDS", "WHITESPACE_WORDS", "batch_text",
    "WORDS_PAPER", "WORDS_DATATROVE", "WORD_DEFINITIONS", "split_chunk", "split_words",
    "sentence_counts", "per_row_sum", "bool_array", "split_pieces", "regex_escape_class",
    "TERMINAL_PUNCTUATION", "GOPHER_SYMBOLS", "WS_CLASS", "LINE_BREAK_RE", "SYMBOL", "HAS_ALPHA", "PUNCT",
    "SENT_END", "SPECIAL_CASES",
]
