"""Planted corruption: known-bad documents mixed into a real corpus, so a filter's recall can be measured.

Six kinds, each made from the real documents it is planted among:

- `random_bytes`: random bytes decoded as text (Latin-1, so every byte is a
  character: mojibake and control characters, as a wrong decode leaves);
- `shuffled`: a real document with its whitespace tokens shuffled across the
  document (the line lengths kept), so the vocabulary is real and the order is not;
- `repeated_line`: one non-blank line of a real document, repeated;
- `base64`: a base64 blob of random bytes, wrapped at 76 columns (MIME);
- `prose_as_code`: real prose labelled as code, in a real code document's language;
- `code_as_prose`: real code labelled as prose, in a real text document's language.

Every planted id starts with PLANTED_PREFIX and names its kind, and `meta`
holds {"planted": kind, "from": the source document's id}, so the truth is
known without a side table. The source is "planted", never a real source,
so a reference set chosen by source cannot contain a planted document.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random

import numpy as np
import pyarrow as pa

from assay.errors import AssayError
from assay.schema import DOCUMENT_COLUMNS, DOCUMENT_SCHEMA, KIND_CODE, KIND_TEXT

PLANTED_PREFIX = "planted-"
PLANTED_SOURCE = "planted"
PLANTED_KINDS = ("random_bytes", "shuffled", "repeated_line", "base64", "prose_as_code", "code_as_prose")


def planted_kind(doc_id: str) -> str | None:
    """The planted kind named by an id, or None for a real document."""
    if not doc_id.startswith(PLANTED_PREFIX):
        return None
    rest = doc_id[len(PLANTED_PREFIX):]
    return next((k for k in PLANTED_KINDS if rest.startswith(k + "-")), None)


def is_planted(ids: pa.Array | pa.ChunkedArray | list[str]) -> np.ndarray:
    values = ids.to_pylist() if hasattr(ids, "to_pylist") else list(ids)
    return np.array([planted_kind(v) is not None for v in values], dtype=bool)


def _length(rng: random.Random, real: list[dict]) -> int:
    return max(200, min(len(rng.choice(real)["text"]), 4000))


def _random_bytes(rng: random.Random, real: list[dict]) -> str:
    # Printable range and line breaks only: a NUL would make ingest call it binary, which is tier 0's job.
    raw = bytes(rng.choice(range(0x20, 0x100)) if rng.random() > 0.02 else 0x0A for _ in range(_length(rng, real)))
    return raw.decode("latin-1")


def shuffle_words(text: str, rng: random.Random) -> str:
    """The words of ``text`` shuffled across it, each line keeping its word count."""
    lines = [line.split() for line in text.splitlines()]
    words = [w for line in lines for w in line]
    rng.shuffle(words)
    out, at = [], 0
    for line in lines:
        out.append(" ".join(words[at:at + len(line)]))
        at += len(line)
    return "\n".join(out)


def _shuffled(rng: random.Random, doc: dict) -> str:
    return shuffle_words(doc["text"], rng)


def _repeated_line(rng: random.Random, doc: dict, real: list[dict]) -> str:
    lines = [line for line in doc["text"].splitlines() if len(line.strip()) >= 10] or [doc["text"][:80] or "x"]
    line = rng.choice(lines)
    return "\n".join([line] * max(20, _length(rng, real) // max(len(line), 1)))


def _base64(rng: random.Random, real: list[dict]) -> str:
    blob = base64.b64encode(bytes(rng.getrandbits(8) for _ in range(_length(rng, real) * 3 // 4))).decode()
    return "\n".join(blob[i:i + 76] for i in range(0, len(blob), 76))


def plant(docs: pa.Table, per_kind: int, seed: int = 0) -> pa.Table:
    """`per_kind` planted documents of each kind, made from `docs` (DOCUMENT_SCHEMA rows; both kinds needed)."""
    missing = [c for c in DOCUMENT_COLUMNS if c not in docs.column_names]
    if missing:
        raise AssayError(f"plant: documents lack column(s) {missing}")
    real = docs.select(list(DOCUMENT_COLUMNS)).to_pylist()
    text = [d for d in real if d["kind"] == KIND_TEXT]
    code = [d for d in real if d["kind"] == KIND_CODE]
    if not text or not code:
        raise AssayError(f"plant: needs text and code documents to plant among (got {len(text)} text, {len(code)} code)")
    rng = random.Random(seed)
    rows = []
    for kind in PLANTED_KINDS:
        for n in range(per_kind):
            host = rng.choice(real)  # kind and language to blend in with
            if kind == "random_bytes":
                origin, body = host, _random_bytes(rng, real)
            elif kind == "shuffled":
                origin = host
                body = _shuffled(rng, origin)
            elif kind == "repeated_line":
                origin = host
                body = _repeated_line(rng, origin, real)
            elif kind == "base64":
                origin, body = host, _base64(rng, real)
            elif kind == "prose_as_code":
                origin, host = rng.choice(text), rng.choice(code)
                body = origin["text"]
            else:  # code_as_prose
                origin, host = rng.choice(code), rng.choice(text)
                body = origin["text"]
            digest = hashlib.blake2b(f"{seed}:{kind}:{n}:{origin['id']}".encode(), digest_size=8).hexdigest()
            rows.append({
                "id": f"{PLANTED_PREFIX}{kind}-{digest}", "text": body, "kind": host["kind"], "lang": host["lang"],
                "source": PLANTED_SOURCE, "path": f"{kind}/{n}",
                "meta": json.dumps({"planted": kind, "from": origin["id"]}),
            })
    return pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA)


def with_planted(docs: pa.Table, per_kind: int, seed: int = 0) -> pa.Table:
    """`docs` (their document columns) followed by the planted documents."""
    return pa.concat_tables([docs.select(list(DOCUMENT_COLUMNS)).cast(DOCUMENT_SCHEMA), plant(docs, per_kind, seed)])


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting half (Mann-Whitney U).

    NaN scores rank lowest, so a signal that cannot score a positive does not get credit for it.
    """
    score = np.nan_to_num(np.asarray(score, dtype=np.float64), nan=-np.inf)
    positive = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # average ranks over ties
    _, start, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for s, c in zip(start, counts):
        ranks[order[s:s + c]] = s + (c + 1) / 2.0
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
