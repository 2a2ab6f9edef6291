"""JSON lines → documents: Arrow's C++ parser on blocks, Python on the lines it cannot vouch for.

Every line is judged on its own: a malformed, non-UTF-8, binary, empty or
too large line is quarantined with its line number and raw bytes, and the
rest of its block is kept. `parse_line` is that judgement, one line at a time
in Python; `ingest_jsonl_lines` applies it to every line and is the reference.

The default reader (`ingest_jsonl_blocks`) gets the same output faster: it
reads blocks, splits them at newlines, and hands the lines that can only be
plain JSON objects to `pyarrow.json` in one call (optionally on worker
threads while the reading thread writes the blocks before them:
`jsonl_threads`). A
block that Arrow rejects is split at the row Arrow names (or halved) until the
lines it rejects are alone; those, and every row whose Arrow value could
differ from Python's (see `_value_flags`), go through `parse_line`. Arrow
infers types per call, so each parsed piece is converted to the document
schema on its own and a field's type may change from one piece to the next.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import sys
import threading
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from assay import languages
from assay.ingest.decode import decode
from assay.ingest.plan import IngestOptions, Unit
from assay.schema import (
    DOCUMENT_SCHEMA,
    INVALID_BINARY,
    INVALID_EMPTY,
    INVALID_ENCODING,
    INVALID_JSON,
    INVALID_RECORD,
    INVALID_TOO_LARGE,
    document_id,
)

if TYPE_CHECKING:
    from assay.ingest.readers import Sink

#: Headroom over ingest.max_bytes for a line's other fields and JSON escapes.
LINE_SLACK = 65536
#: Record fields that fill document columns when they hold a non-empty string.
COLUMN_FIELDS = ("kind", "lang", "source", "path")
#: What `str.strip()` removes (every `str.isspace()` character; a test keeps
#: this in step). Arrow's own whitespace trim uses another set.
PY_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
#: Pieces of at most this many lines that Arrow rejects go to Python whole,
#: which bounds the Arrow calls a very dirty block costs.
SMALL_PIECE = 16
#: A rest of a rejected piece longer than this is retried in two halves.
HALVE_LINES = 1024
#: A record nested deeper than this is quarantined as invalid JSON. Python's json module
#: recurses once per level (it fails near 1000), and the meta column is serialised again,
#: so a depth no writer of real records uses is refused before either can fail.
MAX_JSON_DEPTH = 200
#: Arrow's JSON reader recurses once per level and crashes the process past its stack (a line
#: nested ~15,000 deep with 8 MiB): it is handed no line that may nest deeper than this.
#: Measured: about 500 bytes of stack a level; a thread with 512 KiB reads 1,000 levels, one
#: with 256 KiB fails at 500. Python's threads get 8 MiB on Linux (the soft stack limit).
#: A line over MAX_JSON_DEPTH but within this is found in the parsed table's type instead.
ARROW_MAX_DEPTH = 1000
#: Blocks prepared ahead of the writer per worker thread
#: (`IngestOptions.jsonl_threads`), which bounds memory to a few blocks.
PREPARE_AHEAD = 2

#: RE2 gives up at the first character outside the class, so this is cheap on text.
_BLANK = "^[" + "".join(f"\\x{{{ord(c):x}}}" for c in PY_WHITESPACE) + "]*$"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_ERROR_ROW = re.compile(r" in row (\d+)$")
_NULL_MEMBER = re.compile(rb":[ \t\r\n]*null")  # JSON's whitespace between a member's colon and value


@dataclass(frozen=True)
class LineDoc:
    number: int
    id: str
    text: str
    kind: str | None  # None: detected with the batch
    lang: str | None
    source: str
    path: str
    meta: str  # JSON object
    hint: str  # the record's own path, for kind/lang detection


@dataclass(frozen=True)
class LineBad:
    number: int
    id: str
    path: str
    reason: str
    detail: str
    raw: bytes | None


# --- reading --------------------------------------------------------------------------


def open_lines(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def read_lines(handle, limit: int) -> Iterator[tuple[int, bytes, bool, int]]:
    """(line number, bytes, too_long, bytes read); an over-long line is skipped, not loaded."""
    number = 0
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            size = len(line)
            while True:  # drain the rest of the line in bounded pieces
                rest = handle.readline(1 << 20)
                size += len(rest)
                if not rest or rest.endswith(b"\n"):
                    break
            yield number, line[:256], True, size
            continue
        yield number, line, False, len(line)


def _blocks(handle, block_bytes: int, limit: int,
            spare: list[bytearray] | None = None) -> Iterator[tuple[memoryview | None, int]]:
    """(whole lines, bytes read) in file order; the caller numbers the lines.

    A line longer than `limit` comes as (None, its size): it is drained, never
    held. A read error is raised after the whole lines read before it; the
    partial line it cut is dropped, as `read_lines` drops it. Blocks are read
    into the buffers of `spare` when it has some (see `_Block.recycle`).
    """
    pending = b""
    while True:
        raw, n, chunk_size, error = _read_after(handle, pending, block_bytes, spare.pop() if spare else None)
        if not chunk_size:
            if error is not None:
                raise error
            if n:  # the last line has no newline
                block = None if n > limit else memoryview(raw)[:n]
                del raw
                yield block, n
            return
        cut = raw.rfind(b"\n", 0, n) + 1
        pending = bytes(memoryview(raw)[cut:n])
        if cut:
            block = memoryview(raw)[:cut]  # no copy of the block
            del raw  # the view is all that holds the buffer while the caller has it
            yield block, cut
            del block
        else:  # no newline yet: the line is all in `pending`, and the buffer free again
            if spare is not None and isinstance(raw, bytearray):
                spare.append(raw)
            del raw
        if error is not None:
            raise error
        if len(pending) > limit:
            size = len(pending)
            while True:
                chunk, got, _, error = _read_after(handle, b"", block_bytes)
                if error is not None:
                    raise error
                end = chunk.find(b"\n", 0, got)
                if not got or end >= 0:
                    size += end + 1 if end >= 0 else 0
                    pending = bytes(memoryview(chunk)[end + 1:got]) if end >= 0 else b""
                    break
                size += got
            yield None, size


def _read_after(handle, pending: bytes, size: int,
                buffer: bytearray | None = None) -> tuple[bytes | bytearray, int, int, BaseException | None]:
    """`pending` followed by up to `size` more bytes: (an object whose first n bytes they are, n,
    how many bytes were read, the error that stopped reading).

    A plain file is read into `buffer` when it is large enough: a fresh buffer
    of a few MB costs the kernel a page fault per 4 KiB, about as much CPU as
    the read itself. A gzip stream is read with `read1` so that what was
    decompressed before a truncation or corruption is kept, as the line
    reader keeps those lines.
    """
    if not isinstance(handle, gzip.GzipFile):
        need = len(pending) + size
        if buffer is None or len(buffer) < need:
            buffer = bytearray(need + size // 2)  # room for the partial lines of later blocks
        buffer[:len(pending)] = pending
        got = handle.readinto(memoryview(buffer)[len(pending):need])
        return buffer, len(pending) + got, got, None
    parts, got = [pending], 0
    try:
        while got < size:
            part = handle.read1(size - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    except (OSError, EOFError, zlib.error) as exc:
        data = b"".join(parts)
        return data, len(data), got, exc
    data = b"".join(parts)
    return data, len(data), got, None


# --- one line in Python ---------------------------------------------------------------


def _record_fields(record: dict, options: IngestOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a record into contract columns and everything else (→ meta)."""
    columns, meta = {}, {}
    for key, value in record.items():
        if key in (options.text_field, options.id_field):
            continue
        if key in COLUMN_FIELDS and isinstance(value, str) and value:
            columns[key] = value
        elif key == "meta" and isinstance(value, dict):
            meta.update(value)
        else:
            meta[key] = value
    return columns, meta


def _text_problem(text: str, max_bytes: int) -> tuple[str, str] | None:
    if not text.strip():
        return INVALID_EMPTY, "text is empty or whitespace"
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        return INVALID_TOO_LARGE, f"text is {size} bytes > ingest.max_bytes={max_bytes}"
    if "\x00" in text:
        return INVALID_BINARY, "text contains NUL characters"
    return None


def parse_line(number: int, line: bytes, unit: Unit, options: IngestOptions, label: str) -> LineDoc | LineBad | None:
    """One line judged on its own: a document, a quarantined record, or None for a blank line."""
    locator = f"{label}:{number}"
    fallback_id = document_id(unit.source, f"line:{number}")
    if not line.strip():
        return None
    decoded = decode(line, fallback_encodings=list(options.fallback_encodings), min_confidence=options.encoding_confidence)
    if decoded.text is None:
        return LineBad(number, fallback_id, locator, decoded.reason, f"line {number}: {decoded.detail}", line)
    try:
        record = json.loads(decoded.text)
    except json.JSONDecodeError as exc:
        return LineBad(number, fallback_id, locator, INVALID_JSON, f"line {number}: {exc.msg} (column {exc.colno})", line)
    except RecursionError:
        too_deep = True
    else:
        # Counting brackets is an upper bound on the depth, and cheap; only a line over it is walked.
        too_deep = line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and _depth(record) > MAX_JSON_DEPTH
    if too_deep:
        return LineBad(number, fallback_id, locator, INVALID_JSON,
                       f"line {number}: nested deeper than {MAX_JSON_DEPTH} levels", line)
    if not isinstance(record, dict):
        return LineBad(number, fallback_id, locator, INVALID_RECORD, f"line {number}: not a JSON object", line)
    raw_id = record.get(options.id_field)
    doc_id = str(raw_id) if raw_id not in (None, "") else fallback_id
    text = record.get(options.text_field)
    if not isinstance(text, str):
        what = "missing" if text is None else f"a {type(text).__name__}, not a string"
        return LineBad(number, doc_id, locator, INVALID_RECORD, f"line {number}: field '{options.text_field}' is {what}", line)
    reason = _text_problem(text, options.max_bytes)
    if reason:
        return LineBad(number, doc_id, locator, reason[0], f"line {number}: {reason[1]}", line)
    columns, meta = _record_fields(record, options)
    if decoded.encoding:
        meta["encoding"] = decoded.encoding
    meta_json = json.dumps(meta, ensure_ascii=False, sort_keys=True)
    doc = LineDoc(number, doc_id, text, columns.get("kind"), columns.get("lang"), columns.get("source", unit.source),
                  columns.get("path", locator), meta_json, columns.get("path", ""))
    # JSON can escape half of a surrogate pair; Python keeps it, but no UTF-8 store can.
    if _SURROGATE_ESCAPE.search(line):
        try:
            "".join((doc.id, doc.text, doc.kind or "", doc.lang or "", doc.source, doc.path, doc.meta)).encode("utf-8")
        except UnicodeEncodeError:
            return LineBad(number, doc_id, locator, INVALID_ENCODING,
                           f"line {number}: a \\u escape encodes a lone surrogate, which is not text", line)
    return doc


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item)
    return deepest


#: Up to this many lines, `nesting_depths` scans each line alone rather than their whole span.
NESTING_LINES_ALONE = 64
_QUOTE, _BACKSLASH, _OPEN, _CLOSE, _PIPE = (np.uint8(ord(c)) for c in '"\\{}|')
_CASE = np.uint8(0x20)  # "[" | 0x20 == "{" and "]" | 0x20 == "}"; no other byte maps there
_TWO = np.uint8(2)


class Scratch(threading.local):
    """Arrays reused from block to block, one set per thread.

    A fresh temporary of a few MB costs the kernel a page fault per 4 KiB
    (about 3 µs each on the bench machine), as much as the work done on it.
    """

    def __init__(self) -> None:
        self.held: dict[str, np.ndarray] = {}

    def take(self, key: str, n: int, dtype: type) -> np.ndarray:
        held = self.held.get(key)
        if held is None or len(held) < n:
            held = self.held[key] = np.empty(n + n // 4, dtype)
        return held[:n]


def _take(scratch: Scratch | None, key: str, n: int, dtype: type) -> np.ndarray:
    return scratch.take(key, n, dtype) if scratch is not None else np.empty(n, dtype)


def nesting_events(data: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """Positions of the bytes that may decide JSON nesting: quotes, backslashes, brackets, and "|".

    With 0x20 set, "[", "\\" and "]" become "{", "|" and "}", three consecutive
    bytes, so one range test finds all five; the "|" it also finds is the
    caller's to drop. (Each pass over the bytes costs as much as the next:
    fewer passes is what makes this cheap.)
    """
    # numpy compares a uint8 array with a uint8 scalar several times faster than with an int.
    n = len(data)
    folded = np.bitwise_or(data, _CASE, out=_take(scratch, "bytes", n, np.uint8))
    np.subtract(folded, _OPEN, out=folded)  # wraps around below "{"
    found = np.less_equal(folded, _TWO, out=_take(scratch, "found", n, np.bool_))
    found |= np.equal(data, _QUOTE, out=_take(scratch, "mask", n, np.bool_))
    return np.flatnonzero(found)


def nesting_depths(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """Per line `data[starts[i]:ends[i]]` (sorted, disjoint): how deep `[` and `{` nest outside JSON strings.

    For a line that parses, this is `_depth` of its value. For one that does
    not, it bounds the depth a parser reaches before the first error: up to
    there, a quote opens or closes a string exactly when it follows an even
    run of backslashes, as here. Only the quote, backslash and bracket bytes
    of these lines are looked at.
    """
    n = len(starts)
    deepest = np.zeros(n, np.int64)
    if not n:
        return deepest
    if n <= NESTING_LINES_ALONE:  # a few long lines (code in a text field): only their bytes
        pos = np.concatenate([nesting_events(data[s:e], scratch) + s for s, e in zip(starts.tolist(), ends.tolist())])
    else:  # many short ones: one pass over the span is cheaper than a call per line
        pos = nesting_events(data[starts[0]:ends[-1]], scratch) + starts[0]
    # Only a backslash run that ends at a quote can change what a quote means, and every
    # backslash of such a run is followed by a backslash or a quote. The others (most of
    # the events in code, whose line breaks are escapes in JSON) and "|" are dropped here.
    byte = data[pos]
    after = data[np.minimum(pos + 1, len(data) - 1)]
    relevant = np.where(byte == _BACKSLASH, (after == _QUOTE) | (after == _BACKSLASH), byte != _PIPE)
    pos, byte = pos[relevant], byte[relevant]
    owner = np.searchsorted(ends, pos, side="right")
    keep = owner < n
    keep[keep] = pos[keep] >= starts[owner[keep]]
    pos, owner, byte = pos[keep], owner[keep], byte[keep]
    if not len(pos):
        return deepest
    backslash = byte == _BACKSLASH
    # Length of the run of backslashes that ends at each event (0 elsewhere).
    after_backslash = np.zeros(len(pos), bool)
    after_backslash[1:] = backslash[:-1] & (pos[1:] == pos[:-1] + 1)
    index = np.arange(len(pos))
    run_start = np.maximum.accumulate(np.where(backslash & ~after_backslash, index, 0))
    run = np.where(backslash, index - run_start + 1, 0)
    escaped = np.zeros(len(pos), bool)
    escaped[1:] = after_backslash[1:] & (run[:-1] % 2 == 1)
    quote = (byte == _QUOTE) & ~escaped
    first = np.searchsorted(owner, np.arange(n))  # each line's first event (len(pos) if none)

    def since_line_start(values: np.ndarray) -> np.ndarray:
        """Sum of `values` over the events of the same line before each event."""
        total = np.cumsum(values) - values
        return total - np.append(total, 0)[first][owner]

    outside = (since_line_start(quote.astype(np.int64)) & 1) == 0
    folded = byte | _CASE
    step = (outside & (folded == _OPEN)).astype(np.int64) - (outside & (folded == _CLOSE))
    depth = since_line_start(step) + step
    has = np.bincount(owner, minlength=n) > 0  # a line without events has depth 0, not its successor's
    deepest[has] = np.maximum.reduceat(depth, first[has])
    return np.maximum(deepest, 0)


#: `_line_ends` finds up to this many line ends of a block with `find`, the rest with numpy.
FIND_LINES = 256


def _line_ends(data: memoryview, scratch: Scratch | None = None) -> np.ndarray:
    """The offset after each newline of `data`, a view that starts at its buffer's start.

    `find` skips a long line at memchr's speed, and numpy's scan costs two passes
    over every byte: on the code-heavy bench file (4 MiB blocks of a few hundred
    lines) the whole scan took 0.03 CPU s against 0.08. A block of many short lines
    costs FIND_LINES calls before numpy takes over.
    """
    n, buffer, found = len(data), data.obj, []
    at = buffer.find(b"\n", 0, n)
    while at >= 0 and len(found) < FIND_LINES:
        found.append(at + 1)
        at = buffer.find(b"\n", at + 1, n)
    ends = np.array(found, np.int64)
    if at < 0:
        return ends
    rest = np.frombuffer(data, np.uint8)[at:]
    more = np.flatnonzero(np.equal(rest, np.uint8(10), out=_take(scratch, "mask", len(rest), np.bool_))) + (at + 1)
    return np.concatenate((ends, more))


#: Up to this many lines, `_opening_brackets` counts each line's slice of the mask alone.
BRACKET_LINES_ALONE = 2048


def _opening_brackets(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """Per line `data[starts[i]:ends[i]]` (sorted, disjoint): how many "[" and "{" it holds, in strings or not."""
    # One mask over the bytes, then a count per line: a fifth of what `bytes.count` twice per
    # line costs (it compares byte by byte); positions are found only for very many lines.
    folded = np.bitwise_or(data, _CASE, out=_take(scratch, "bytes", len(data), np.uint8))
    opening = np.equal(folded, _OPEN, out=_take(scratch, "mask", len(data), np.bool_))
    if len(starts) <= BRACKET_LINES_ALONE:
        return np.array([np.count_nonzero(opening[s:e]) for s, e in zip(starts.tolist(), ends.tolist())], np.int64)
    before = np.searchsorted(np.flatnonzero(opening), np.concatenate((starts, ends)))
    return before[len(starts):] - before[:len(starts)]


def ingest_jsonl_lines(unit: Unit, sink: "Sink", options: IngestOptions) -> int:
    """The reference reader: every line parsed by `parse_line`."""
    label = Path(unit.path).name
    bytes_in = 0
    with open_lines(unit.path) as handle:
        for number, line, too_long, size in read_lines(handle, options.max_bytes + LINE_SLACK):
            bytes_in += size
            if too_long:
                _quarantine(sink, unit, _too_long(unit, options, label, number))
                continue
            result = parse_line(number, line, unit, options, label)
            if result is None:
                sink.writer.counts["blank_lines"] += 1
            elif isinstance(result, LineBad):
                _quarantine(sink, unit, result)
            else:
                sink.document(result.id, result.text, result.kind, result.lang, result.source, result.path,
                              result.meta, name_hint=result.hint, where=f"line {number}")
    return bytes_in


def _too_long(unit: Unit, options: IngestOptions, label: str, number: int) -> LineBad:
    """A line over the limit: its locator only, since its bytes were never held."""
    return LineBad(number, document_id(unit.source, f"line:{number}"), f"{label}:{number}", INVALID_TOO_LARGE,
                   f"line {number} longer than ingest.max_bytes={options.max_bytes}", None)


def _quarantine(sink: "Sink", unit: Unit, bad: LineBad) -> None:
    sink.invalid(bad.id, unit.source, bad.path, bad.reason, bad.detail, bad.raw)


# --- blocks through Arrow ----------------------------------------------------------------


def ingest_jsonl(unit: Unit, sink: "Sink", options: IngestOptions) -> int:
    if options.jsonl_parser == "lines":
        return ingest_jsonl_lines(unit, sink, options)
    return ingest_jsonl_blocks(unit, sink, options)


def ingest_jsonl_blocks(unit: Unit, sink: "Sink", options: IngestOptions) -> int:
    """Blocks are read here, parsed and classified on `jsonl_threads` worker threads, and written here, in file order.

    Preparing a block is mostly Arrow's C++ code (the JSON parser, compute
    kernels) and writing is mostly the Parquet encoder; both release the GIL,
    so with free cores blocks are prepared while earlier ones are written. A
    read error is raised after the blocks read before it are written, as the
    line reader keeps the lines before a truncation.
    """
    label = Path(unit.path).name
    limit = options.max_bytes + LINE_SLACK
    bytes_in, number = 0, 0  # lines so far
    pending: deque[tuple["_Block | LineBad", Future | None]] = deque()
    spare: list[bytearray] = []  # buffers of written blocks, to read the next ones into
    scratch = Scratch()  # and each thread's temporary arrays, for this file only

    def emit_oldest() -> None:
        item, future = pending.popleft()
        if future is None:
            _quarantine(sink, unit, item)
        else:
            block = future.result()
            block.emit(sink)
            buffer = block.recycle()
            if buffer is not None:
                spare.append(buffer)

    threads = options.jsonl_threads
    ahead = PREPARE_AHEAD * threads
    executor = ThreadPoolExecutor(threads, "assay-jsonl") if threads else _OnThisThread()
    with open_lines(unit.path) as handle, executor as pool:
        try:
            try:
                for block, size in _blocks(handle, options.jsonl_block_bytes, limit, spare):
                    bytes_in += size
                    if block is None:
                        number += 1
                        pending.append((_too_long(unit, options, label, number), None))
                    else:
                        lines = _Block(block, number + 1, unit, options, label, limit, scratch)
                        number += lines.n
                        pending.append((lines, pool.submit(lines.prepare)))
                        del block, lines
                    while len(pending) > ahead:
                        emit_oldest()
            except (OSError, EOFError, zlib.error):
                while pending:  # what was read before the error is kept
                    emit_oldest()
                raise
            while pending:
                emit_oldest()
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()
    return bytes_in


class _OnThisThread:
    """An executor that runs each task when it is submitted (`jsonl_threads: 0`)."""

    def __enter__(self) -> "_OnThisThread":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # raised where the result is read, as from a pool
            future.set_exception(exc)
        return future


class _Block:
    """The whole lines of one block, judged as `parse_line` would, mostly by Arrow."""

    def __init__(self, data: memoryview, first: int, unit: Unit, options: IngestOptions, label: str, limit: int,
                 scratch: Scratch | None = None):
        self.data, self.first, self.unit, self.options, self.label, self.limit = data, first, unit, options, label, limit
        self.scratch = scratch
        ends = _line_ends(data, scratch)
        if not len(ends) or ends[-1] != len(data):
            ends = np.append(ends, len(data))
        self.starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
        self.ends = ends.astype(np.int64)
        self.n = len(self.ends)
        self.docs: list[tuple[np.ndarray, dict[str, pa.Array]]] = []  # (line indices, columns)
        self.python: list[int] = []  # line indices for parse_line
        self.bad: list[LineBad] = []
        self.too_long: list[int] = []
        self.suspects = np.zeros(0, np.int64)  # lines that may nest deeper than MAX_JSON_DEPTH (see `prepare`)
        self.blank = 0
        self.batch: pa.RecordBatch | None = None
        self.numbers = np.zeros(0, np.int64)  # the line number of each row of `batch`

    def line(self, i: int) -> bytes:
        return bytes(self.data[self.starts[i]:self.ends[i]])

    def recycle(self) -> bytearray | None:
        """After `emit`: the buffer the block was read into, if nothing else holds on to it.

        A view of it that is still alive (numpy, Arrow) makes `release` fail, and
        any other reference shows in its reference count: then it is left alone.
        """
        data, self.data = self.data, None
        buffer = data.obj
        try:
            data.release()
        except BufferError:
            return None
        del data
        # Two references: `buffer`, and getrefcount's own argument.
        return buffer if isinstance(buffer, bytearray) and sys.getrefcount(buffer) == 2 else None

    def number(self, i: int) -> int:
        return self.first + int(i)

    # -- sorting the lines --

    def prepare(self) -> "_Block":
        """Everything but the writing."""
        a = np.frombuffer(self.data, np.uint8)
        has_newline = a[self.ends - 1] == 10
        too_long = (self.ends - self.starts - has_newline) > self.limit
        # Only a line that starts with "{" can be a JSON object Arrow parses
        # as `json.loads` would; blank lines, a BOM, leading spaces and
        # anything else are left to Python.
        python = a[self.starts] != ord("{")
        # A line nested deeper than MAX_JSON_DEPTH is `parse_line`'s to quarantine, and Arrow's
        # parser would crash on one nested far deeper. Counting brackets is a cheap upper bound
        # (only a line longer than the limit can hold that many). A line with more than
        # ARROW_MAX_DEPTH gets its real depth, outside strings, before Arrow sees it; one with
        # fewer (code in a text field easily has a few hundred) is only a suspect, measured if
        # its table's type nests too deep (`_parse`), which real records never do.
        long = np.flatnonzero(self.ends - self.starts > MAX_JSON_DEPTH)
        if len(long):
            counts = _opening_brackets(a, self.starts[long], self.ends[long], self.scratch)
            self.suspects = long[(counts > MAX_JSON_DEPTH) & (counts <= ARROW_MAX_DEPTH)]
            many = long[counts > ARROW_MAX_DEPTH]
            if len(many):
                deep = nesting_depths(a, self.starts[many], self.ends[many], self.scratch) > MAX_JSON_DEPTH
                python[many[deep]] = True
        # Raw NUL and DEL bytes make a line binary to `decode`; Arrow would
        # accept DEL inside a string.
        for byte in (b"\x00", b"\x7f"):
            if self.data.obj.find(byte, 0, len(self.data)) >= 0:  # the view starts at 0
                at = np.flatnonzero(a == byte[0])
                python[np.searchsorted(self.ends, at, side="right")] = True
        if not _is_utf8(self.data):  # Arrow does not check; `decode` may still read a legacy encoding
            # Only a line with a byte >= 0x80 can be invalid (JSON writers often escape everything else).
            suspect = np.zeros(self.n, bool)
            suspect[np.searchsorted(self.ends, np.flatnonzero(a >= np.uint8(0x80)), side="right")] = True
            for i in np.flatnonzero(suspect & ~python & ~too_long):
                try:
                    self.line(i).decode("utf-8")
                except UnicodeDecodeError:
                    python[i] = True
        self.too_long = np.flatnonzero(too_long).tolist()
        self.python.extend(np.flatnonzero(python & ~too_long).tolist())
        arrow = np.flatnonzero(~python & ~too_long)
        if len(arrow):
            self._parse(arrow)
        self._finish()
        return self

    def _parse(self, lines: np.ndarray) -> None:
        """Arrow on these lines; what it rejects is split off and retried, down to single lines."""
        work = [lines]
        while work:
            piece = work.pop()
            try:
                table, depth = self._read_json(piece)
            except pa.ArrowException as exc:
                if len(piece) <= SMALL_PIECE:
                    self.python.extend(piece.tolist())
                    continue
                message = str(exc)
                match = _ERROR_ROW.search(message)
                row = int(match.group(1)) if match else -1
                if 0 < row < len(piece) and "changed from" in message:
                    # A field whose type changes is valid JSON: split there, both halves to Arrow.
                    work.extend((piece[:row], piece[row:]))
                elif 0 <= row < len(piece):
                    # The named row goes to Python; the rows before it parse, and a
                    # long rest is retried in halves, so many bad lines in a block of
                    # short lines cost a few re-parses of it, not one per bad line.
                    self.python.append(int(piece[row]))
                    rest = piece[row + 1:]
                    half = len(rest) // 2 if len(rest) > HALVE_LINES else len(rest)
                    work.extend(p for p in (piece[:row], rest[:half], rest[half:]) if len(p))
                else:
                    half = len(piece) // 2
                    work.extend((piece[:half], piece[half:]))
                continue
            if table.num_rows != len(piece):  # a line held more than one value
                if len(piece) <= SMALL_PIECE:
                    self.python.extend(piece.tolist())
                else:
                    half = len(piece) // 2
                    work.extend((piece[:half], piece[half:]))
                continue
            if depth > MAX_JSON_DEPTH:  # a suspect is too deep: to Python, the rest parsed again
                suspects = piece[np.isin(piece, self.suspects)]
                a = np.frombuffer(self.data, np.uint8)
                deep = suspects[nesting_depths(a, self.starts[suspects], self.ends[suspects], self.scratch) > MAX_JSON_DEPTH]
                deep = deep if len(deep) else piece  # cannot be (a type nests as deep as its deepest value)
                self.python.extend(deep.tolist())
                rest = piece[~np.isin(piece, deep)]
                if len(rest):
                    work.append(rest)
                continue
            self._convert(piece, table)

    def _read_json(self, lines: np.ndarray) -> tuple[pa.Table, int]:
        """These lines parsed by Arrow, and how deep its rows may nest (`_row_depth`)."""
        if len(lines) == self.n:
            buffer = self.data
        else:
            buffer = b"".join(self.data[s:e] for s, e in zip(self.starts[lines].tolist(), self.ends[lines].tolist()))
        if buffer[-1:] != b"\n":
            buffer = bytes(buffer) + b"\n"  # never in place: the block is a view of a read buffer
        # One chunk on the calling thread: blocks are already parsed in
        # parallel, and Arrow's chunked parse cost about 10% more CPU here.
        read_options = pa_json.ReadOptions(use_threads=False, block_size=len(buffer) + 1)
        table = pa_json.read_json(pa.BufferReader(buffer), read_options=read_options,
                                  parse_options=_text_typed(self.options.text_field))
        depth = _row_depth(table.schema)
        if depth > MAX_JSON_DEPTH:  # not for use; nor for `_has_timestamp`, which recurses per level
            return table, depth
        if _has_timestamp(table.schema):
            # Arrow reads ISO dates as timestamps; the text as written is what Python keeps.
            schema = pa.schema([f.with_type(_timestamps_as_strings(f.type)) for f in table.schema])
            table = pa_json.read_json(pa.BufferReader(buffer), read_options=read_options,
                                      parse_options=pa_json.ParseOptions(explicit_schema=schema))
        return table, depth

    # -- Arrow rows → documents --

    def _convert(self, lines: np.ndarray, table: pa.Table) -> None:
        options = self.options
        tf, idf = options.text_field, options.id_field
        n = table.num_rows
        cols = {name: _one_chunk(table.column(name)) for name in table.column_names}
        to_python = np.zeros(n, bool)

        text = cols.get(tf)
        if text is None or pa.types.is_null(text.type):
            text = pa.nulls(n, pa.large_string())
        elif pa.types.is_string(text.type) or pa.types.is_large_string(text.type):
            text = text.cast(pa.large_string())
        else:  # numbers, objects...: Python names the type in the detail
            self.python.extend(lines.tolist())
            return

        given_id = cols.get(idf)
        if given_id is not None:
            if pa.types.is_integer(given_id.type):
                given_id = given_id.cast(pa.string())
            elif pa.types.is_null(given_id.type):
                given_id = None
            elif not pa.types.is_string(given_id.type):  # Python's str() of a float, bool or object
                to_python |= _np(given_id.is_valid())
                given_id = None

        # Which values become columns and which go to meta, as `_record_fields` splits them.
        column_values: dict[str, pa.Array] = {}
        to_meta: list[tuple[str, pa.Array, np.ndarray]] = []  # (field, values, rows whose value goes to meta)
        nullish = np.zeros(n, bool)  # a null Arrow value: the field was missing, or null
        for name, values in cols.items():
            if name in (tf, idf):
                continue
            missing = _np(values.is_null())
            inner_null, inexact = _value_flags(values)
            nullish |= missing | inner_null
            to_python |= inexact
            if name in COLUMN_FIELDS and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                usable = _np(pc.fill_null(pc.not_equal(values, ""), False))
                column_values[name] = (values if usable.all() else pc.if_else(usable, values, None)).cast(pa.string())
                to_meta.append((name, values, ~usable & ~missing))
            else:
                to_meta.append((name, values, ~missing))
        meta_struct = cols.get("meta") if "meta" not in (tf, idf) else None
        if meta_struct is not None and pa.types.is_struct(meta_struct.type):
            # `dict.update` in field order decides a clash; Arrow keeps no per-row order.
            clashes = {meta_struct.type.field(i).name for i in range(meta_struct.type.num_fields)} & set(cols)
            if clashes:
                to_python |= _np(meta_struct.is_valid())
        # A null is only ambiguous if the line holds a JSON null as an object member, which
        # follows its colon. ("null" anywhere was too wide: one record with an extra field
        # sent every other one whose code said "null" to Python.)
        for i in np.flatnonzero(nullish & ~to_python):
            if _NULL_MEMBER.search(self.data, int(self.starts[lines[i]]), int(self.ends[lines[i]])):
                to_python[i] = True

        numbers = self.first + lines
        missing_text = _np(text.is_null())
        empty = _blank(text)
        nbytes = _np(pc.fill_null(pc.binary_length(text), 0))
        too_large = nbytes > options.max_bytes
        nul = _has_nul(text)
        problem = missing_text | empty | too_large | nul

        id_usable = (_np(pc.fill_null(pc.not_equal(given_id, ""), False)) if given_id is not None else np.zeros(n, bool))
        need_fallback = ~id_usable & ~to_python
        fallback: list[str | None] = [None] * n
        for i in np.flatnonzero(need_fallback):
            fallback[i] = document_id(self.unit.source, f"line:{numbers[i]}")
        ids = pa.array(fallback, pa.string())
        if given_id is not None:
            ids = pc.if_else(pa.array(id_usable), given_id.cast(pa.string()), ids)

        for i in np.flatnonzero(problem & ~to_python):
            number = int(numbers[i])
            if missing_text[i]:
                reason, detail = INVALID_RECORD, f"field '{tf}' is missing"
            elif empty[i]:
                reason, detail = INVALID_EMPTY, "text is empty or whitespace"
            elif too_large[i]:
                reason, detail = INVALID_TOO_LARGE, f"text is {int(nbytes[i])} bytes > ingest.max_bytes={options.max_bytes}"
            else:
                reason, detail = INVALID_BINARY, "text contains NUL characters"
            self.bad.append(LineBad(number, ids[int(i)].as_py(), f"{self.label}:{number}", reason, f"line {number}: {detail}",
                                    self.line(lines[i])))

        self.python.extend(lines[to_python].tolist())
        good = ~problem & ~to_python
        if not good.any():
            return
        kept = np.flatnonzero(good)
        take = None if len(kept) == n else pa.array(kept)  # all rows (the usual case): no copy of the texts

        def pick(values: pa.Array) -> pa.Array:
            return values if take is None else values.take(take)

        locators = None
        path = column_values.get("path")
        if path is None or path.null_count:
            locators = pa.array([f"{self.label}:{k}" for k in numbers[good].tolist()], pa.string())
        good_path = pick(path) if path is not None else None
        documents = {
            "id": pick(ids),
            "text": pick(text),
            "kind": pick(column_values["kind"]) if "kind" in column_values else pa.nulls(len(kept), pa.string()),
            "lang": pick(column_values["lang"]) if "lang" in column_values else pa.nulls(len(kept), pa.string()),
            "source": pc.fill_null(pick(column_values["source"]), self.unit.source)
            if "source" in column_values else pa.array([self.unit.source] * len(kept), pa.string()),
            "path": good_path if locators is None else (pc.coalesce(good_path, locators) if good_path is not None else locators),
            "meta": self._meta(to_meta, kept),
            "hint": pc.fill_null(good_path, "") if good_path is not None else pa.array([""] * len(kept), pa.string()),
        }
        self.docs.append((lines[good], documents))

    def _meta(self, to_meta: list[tuple[str, pa.Array, np.ndarray]], rows: np.ndarray) -> pa.Array:
        """The meta JSON of these rows; a null Arrow value here is a field the line did not have."""
        dicts: dict[int, dict[str, Any]] = {}
        for name, values, goes in to_meta:
            chosen = rows[goes[rows]]
            if not len(chosen):
                continue
            picked = values.take(pa.array(chosen)).to_pylist()
            merge = name == "meta" and pa.types.is_struct(values.type)
            for row, value in zip(chosen.tolist(), picked):
                target = dicts.setdefault(row, {})
                if merge:
                    target.update(_drop_missing(value))
                else:
                    target[name] = _drop_missing(value)
        if not dicts:
            return pa.array(["{}"] * len(rows), pa.string())
        return pa.array([json.dumps(dicts[r], ensure_ascii=False, sort_keys=True) if r in dicts else "{}"
                         for r in rows.tolist()], pa.string())

    # -- out, in line order --

    def _finish(self) -> None:
        """Python's lines parsed, the bad ones sorted, the documents in line order with kind and lang."""
        parsed: list[LineDoc] = []
        for i in sorted(self.python):
            result = parse_line(self.number(i), self.line(i), self.unit, self.options, self.label)
            if result is None:
                self.blank += 1
            elif isinstance(result, LineBad):
                self.bad.append(result)
            else:
                parsed.append(result)
        too_long = [_too_long(self.unit, self.options, self.label, self.number(i)) for i in self.too_long]
        self.bad = sorted(self.bad + too_long, key=lambda b: b.number)

        parts = [columns for _, columns in self.docs]
        order = [lines for lines, _ in self.docs]
        if parsed:
            parts.append({
                "id": pa.array([d.id for d in parsed], pa.string()),
                "text": pa.array([d.text for d in parsed], pa.large_string()),
                "kind": pa.array([d.kind for d in parsed], pa.string()),
                "lang": pa.array([d.lang for d in parsed], pa.string()),
                "source": pa.array([d.source for d in parsed], pa.string()),
                "path": pa.array([d.path for d in parsed], pa.string()),
                "meta": pa.array([d.meta for d in parsed], pa.string()),
                "hint": pa.array([d.hint for d in parsed], pa.string()),
            })
            order.append(np.array([d.number - self.first for d in parsed], np.int64))
        if not parts:
            return
        columns = parts[0]  # one part (a clean block): no copy
        self.numbers = self.first + np.sort(np.concatenate(order))
        if len(parts) > 1:
            take = pa.array(np.argsort(np.concatenate(order), kind="stable"))
            columns = {name: pa.concat_arrays([p[name] for p in parts]).take(take) for name in parts[0]}
        columns["kind"], columns["lang"] = detect_kind_and_lang(columns["text"], columns["hint"], columns["kind"], columns["lang"])
        self.batch = pa.RecordBatch.from_arrays([columns[name] for name in DOCUMENT_SCHEMA.names], schema=DOCUMENT_SCHEMA)

    def emit(self, sink: "Sink") -> None:
        """Hand the results to the sink, in line order."""
        counts = sink.writer.counts
        if self.blank:
            counts["blank_lines"] += self.blank
        counts["jsonl_lines_python"] += len(self.python)
        counts["jsonl_lines_arrow"] += self.n - len(self.python) - len(self.too_long)
        for bad in self.bad:
            _quarantine(sink, self.unit, bad)
        if self.batch is not None:
            sink.documents_batch(self.batch, where=lambda i: f"line {self.numbers[i]}")


def detect_kind_and_lang(texts: pa.Array, hints: pa.Array, kinds: pa.Array, langs: pa.Array) -> tuple[pa.Array, pa.Array]:
    """Given kinds/langs where set (null elsewhere), detected ones for the rest, on Arrow columns.

    Detection only reads the first `languages.SNIFF_CHARS` characters, so only
    those are handed over: the whole texts would be copied by its `take`s.
    """
    missing = _np(pc.or_(kinds.is_null(), langs.is_null()))
    if not missing.any():
        return kinds, langs
    rows = pa.array(np.flatnonzero(missing))
    heads = pc.utf8_slice_codeunits(texts.take(rows) if len(rows) < len(texts) else texts, 0, languages.SNIFF_CHARS)
    found_kinds, found_langs = languages.classify_batch(heads, hints.take(rows), heads=True)
    if len(rows) < len(texts):
        positions = np.full(len(texts), -1, np.int64)
        positions[missing] = np.arange(len(rows))
        take = pa.array(np.where(missing, positions, 0))
        found_kinds, found_langs = found_kinds.take(take), found_langs.take(take)
    return pc.coalesce(kinds, found_kinds), pc.coalesce(langs, found_langs)


# --- Arrow helpers -------------------------------------------------------------------


def _np(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _has_nul(text: pa.Array) -> np.ndarray:
    """Per string: does it hold a NUL character? (Null strings: False.)

    NULs are rare and Arrow's substring search is slow, so the whole value
    buffer is checked first with one vectorised minimum.
    """
    values = text.buffers()[2]
    if values is None or not values.size or np.frombuffer(values, np.uint8).min() != 0:
        return np.zeros(len(text), bool)
    return _np(pc.fill_null(pc.match_substring(text, "\x00"), False))


def _blank(text: pa.Array) -> np.ndarray:
    """Per string: would `str.strip()` leave nothing? (Null strings: False.)"""
    return _np(pc.fill_null(pc.match_substring_regex(text, _BLANK), False))


def _is_utf8(data: bytes) -> bool:
    array = pa.LargeStringArray.from_buffers(1, pa.py_buffer(np.array([0, len(data)], np.int64)), pa.py_buffer(data))
    try:
        array.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _text_typed(text_field: str) -> pa_json.ParseOptions:
    """Parse options that give the text field its type, and let Arrow infer the others.

    Inferred, every string column is first tried as a timestamp and the text is
    then cast to large_string: the bench file's blocks parsed in 0.48 CPU s, and in
    0.45 typed (medians of 5). A text that is not a string is an error in its row,
    which sends that row to Python (`_parse`), as an inferred non-string type does
    (`_convert`).
    """
    return pa_json.ParseOptions(explicit_schema=pa.schema([(text_field, pa.large_string())]))


def _row_depth(schema: pa.Schema) -> int:
    """How deep a row of this schema can nest, as `_depth` counts it (the row is one level).

    Inference gives each list and object of a value a list or struct level of
    the type, so no row nests deeper than this. Without recursion: the type
    may be as deep as ARROW_MAX_DEPTH.
    """
    deepest, stack = 1, [(field.type, 1) for field in schema]
    while stack:
        t, above = stack.pop()
        if pa.types.is_struct(t):
            deepest = max(deepest, above + 1)
            stack.extend((field.type, above + 1) for field in t)
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            deepest = max(deepest, above + 1)
            stack.append((t.value_type, above + 1))
    return deepest


def _has_timestamp(schema_or_type) -> bool:
    types = [f.type for f in schema_or_type] if isinstance(schema_or_type, pa.Schema) else [schema_or_type]
    for t in types:
        if pa.types.is_timestamp(t):
            return True
        if pa.types.is_struct(t) and _has_timestamp(pa.schema(list(t))):
            return True
        if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _has_timestamp(t.value_type):
            return True
    return False


def _timestamps_as_strings(t: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_timestamps_as_strings(f.type)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_timestamps_as_strings(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_timestamps_as_strings(t.value_type)))
    return t


def _value_flags(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per value: (a null inside an object, a number Arrow may have changed).

    A null object member may be a missing key, which Python leaves out, or a
    JSON null, which it keeps. A float column may hold integers written as
    such (Python keeps `1`, Arrow gives `1.0`), and Arrow reads `-NaN`, which
    Python rejects: only finite numbers with a fraction are taken as they are.
    A null list element is unambiguous.
    """
    n = len(values)
    t = values.type
    none = np.zeros(n, bool)
    if pa.types.is_struct(t):
        valid = _np(values.is_valid())
        inner, inexact = none.copy(), none.copy()
        for child in values.flatten():
            child_inner, child_inexact = _value_flags(child)
            inner |= child_inner | _np(child.is_null())
            inexact |= child_inexact
        return inner & valid, inexact & valid
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        items = pc.list_flatten(values)
        if not len(items):
            return none, none
        parents = _np(pc.list_parent_indices(values))
        item_inner, item_inexact = _value_flags(items)
        return (np.bincount(parents, weights=item_inner, minlength=n) > 0,
                np.bincount(parents, weights=item_inexact, minlength=n) > 0)
    if pa.types.is_floating(t):
        x = _np(values.cast(pa.float64())).astype(np.float64)
        with np.errstate(invalid="ignore"):
            exact = np.isfinite(x) & (np.floor(x) != x)
        return none, _np(values.is_valid()) & ~exact
    if (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_boolean(t) or pa.types.is_null(t)):
        return none, none
    return none, _np(values.is_valid())  # a type Arrow inferred that JSON does not have


def _drop_missing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_missing(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_missing(v) for v in value]
    return value
