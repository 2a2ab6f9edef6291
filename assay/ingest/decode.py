"""Bytes → text, or the reason the bytes are not usable text.

The order of checks matters: binary before encoding (a PNG is not "badly
encoded text"), and a legacy encoding is accepted only when a detector is
confident, because a wrong guess silently corrupts text for every later stage.
A UTF-16 or UTF-32 byte order mark comes first of all: such text is half NUL
bytes, so the binary check would refuse it, and the mark names its encoding.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from assay.schema import INVALID_BINARY, INVALID_EMPTY, INVALID_ENCODING

#: Bytes sniffed for binary content.
SNIFF_BYTES = 8192

# Control characters that never appear in text files (tab, newlines, form
# feed, escape and backspace are allowed: terminals and man pages use them).
_TEXT_CONTROL = {0x08, 0x09, 0x0A, 0x0C, 0x0D, 0x1B}
_BINARY_BYTES = bytes(b for b in range(32) if b not in _TEXT_CONTROL) + b"\x7f"
_DELETE_BINARY = bytes.maketrans(b"", b"")


@dataclass(frozen=True)
class Decoded:
    text: str | None
    encoding: str | None = None  # set when not UTF-8
    reason: str | None = None  # set when text is None
    detail: str | None = None


def is_binary(data: bytes) -> bool:
    """NUL bytes, or more than 10% control bytes, in the first few KB."""
    head = data[:SNIFF_BYTES]
    if not head:
        return False
    if b"\x00" in head:
        return True
    controls = len(head) - len(head.translate(_DELETE_BINARY, _BINARY_BYTES))
    return controls / len(head) > 0.10


#: Byte order marks that name a wide encoding (UTF-32 first: its LE mark begins with UTF-16 LE's).
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
              (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _decode_wide(data: bytes, encoding: str) -> Decoded:
    try:
        text = data.decode(encoding)  # the codec reads the mark's byte order and drops it
    except UnicodeDecodeError as exc:
        return Decoded(None, reason=INVALID_ENCODING,
                       detail=f"{encoding} byte order mark, but not {encoding} ({exc.reason} at byte {exc.start})")
    if is_binary(text[:SNIFF_BYTES].encode("utf-8", "surrogatepass")):
        return Decoded(None, reason=INVALID_BINARY, detail=f"{encoding} byte order mark, then control or NUL characters")
    if not text.strip():
        return Decoded(None, reason=INVALID_EMPTY, detail="only whitespace")
    return Decoded(text, encoding=encoding)


def decode(data: bytes, *, fallback_encodings: list[str], min_confidence: float) -> Decoded:
    for bom, encoding in _WIDE_BOMS:
        if data.startswith(bom):
            return _decode_wide(data, encoding)
    if not data.strip():
        return Decoded(None, reason=INVALID_EMPTY, detail=f"{len(data)} bytes, all whitespace" if data else "0 bytes")
    if is_binary(data):
        return Decoded(None, reason=INVALID_BINARY, detail="control or NUL bytes in the first 8 KB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _decode_legacy(data, exc, fallback_encodings, min_confidence)
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        return Decoded(None, reason=INVALID_EMPTY, detail="only whitespace")
    return Decoded(text)


def _codec_name(name: str) -> str:
    try:
        return codecs.lookup(name).name
    except LookupError:
        return name


def _decode_legacy(data: bytes, error: UnicodeDecodeError, allowed: list[str], min_confidence: float) -> Decoded:
    from charset_normalizer import from_bytes

    matches = list(from_bytes(data[: 1 << 20]))
    utf8_error = f"not UTF-8 ({error.reason} at byte {error.start})"
    if not matches:
        return Decoded(None, reason=INVALID_ENCODING, detail=f"{utf8_error}; no encoding detected")
    best = matches[0]
    confidence = 1.0 - best.chaos
    # Single-byte Latin code pages often decode the same bytes to the same
    # text; the detector then ranks them arbitrarily. Any candidate as good as
    # the best one that is also allowed is an equally confident answer.
    candidates: set[str] = set()
    for match in matches:
        if match.chaos <= best.chaos:
            candidates.add(match.encoding)
            candidates.update(match.could_be_from_charset)
    # Compared by Python's own name for each codec: the detector says "latin_1" and a user may
    # write "latin-1" or "ISO-8859-1" (the names are checked when the params load).
    candidates = {_codec_name(name) for name in candidates}
    encoding = next((enc for enc in allowed if _codec_name(enc) in candidates), None)
    if encoding is None or confidence < min_confidence:
        return Decoded(
            None,
            reason=INVALID_ENCODING,
            detail=f"{utf8_error}; detector says {best.encoding} with confidence {confidence:.2f}",
        )
    try:
        return Decoded(data.decode(encoding), encoding=encoding)
    except UnicodeDecodeError:
        return Decoded(None, reason=INVALID_ENCODING, detail=f"{utf8_error}; does not decode as {encoding} either")
