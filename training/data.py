"""Documents → fixed-length token rows → batches that know which document each token is from.

Each row holds tokens of exactly one document (a long document spans several
rows; the last is padded). Rows are never packed across documents, because the
dynamic filter needs every loss and every gradient attributed to one document:
with one document per row, a row's tokens get gradient from that document's
loss alone, so per-document gradient norms are exact (training.grad_norms).

Which rows form the batch of step ``s`` is a pure function of ``(seed, s)``,
so a resumed run draws the very batches the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from assay.errors import AssayError
from training.tokenizer import EOS, PAD

__all__ = ["ROWS_FORMAT", "Batch", "TokenRows", "batch_rows", "build_rows", "cached_rows", "is_holdout", "make_batch"]


def is_holdout(doc_id: str, fraction: float) -> bool:
    """Held out by a hash of the id, so a document stays on its side across dataset versions."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


@dataclass
class TokenRows:
    """``tokens`` (R, seq_len + 1) int32, padded; ``lengths`` (R,) real tokens per row;
    ``doc`` (R,) index into ``doc_ids``."""

    tokens: np.ndarray
    lengths: np.ndarray
    doc: np.ndarray
    doc_ids: list[str]
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class Batch:
    """One step's input. Row ``r`` belongs to document ``doc_ids[doc_index[r]]``."""

    tokens: torch.Tensor  # (B, N) long
    targets: torch.Tensor  # (B, N) long
    loss_mask: torch.Tensor  # (B, N) bool: False on padding
    doc_index: torch.Tensor  # (B,) long, 0 .. len(doc_ids) - 1
    doc_ids: list[str]

    def to(self, device: torch.device) -> Batch:
        return Batch(self.tokens.to(device), self.targets.to(device), self.loss_mask.to(device),
                     self.doc_index.to(device), self.doc_ids)

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _row_blocks(docs: Iterable[tuple[str, str]], tokenizer: Tokenizer, seq_len: int, doc_ids: list[str],
                encode_batch: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tokens (r, seq_len + 1) padded, lengths (r,), doc index (r,)) for each batch of documents
    encoded; appends each document's id to ``doc_ids`` as it gets its index."""
    eos, pad = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    width = seq_len + 1
    pending: list[tuple[str, str]] = []

    def flush() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunks: list[np.ndarray] = []
        doc_of_row: list[int] = []
        encoded = tokenizer.encode_batch([text for _, text in pending], add_special_tokens=False)
        for (doc_id, _), enc in zip(pending, encoded):
            ids = np.asarray(enc.ids + [eos], dtype=np.int32)
            if len(ids) < 2:
                continue
            index = len(doc_ids)
            doc_ids.append(doc_id)
            for start in range(0, len(ids) - 1, seq_len):
                chunks.append(ids[start:start + width])
                doc_of_row.append(index)
        pending.clear()
        tokens = np.full((len(chunks), width), pad, dtype=np.int32)
        lengths = np.zeros(len(chunks), dtype=np.int32)
        for r, chunk in enumerate(chunks):
            tokens[r, :len(chunk)] = chunk
            lengths[r] = len(chunk)
        return tokens, lengths, np.asarray(doc_of_row, dtype=np.int64)

    for doc in docs:
        pending.append(doc)
        if len(pending) >= encode_batch:
            yield flush()
    if pending:
        yield flush()


def build_rows(docs: Iterable[tuple[str, str]], tokenizer: Tokenizer, seq_len: int,
               encode_batch: int = 256) -> TokenRows:
    """Tokenize ``(id, text)`` pairs (EOS appended) into rows of ``seq_len + 1`` tokens, in memory.

    Consecutive rows of a document overlap by one token, so every token but the
    first is a target exactly once.
    """
    doc_ids: list[str] = []
    blocks = list(_row_blocks(docs, tokenizer, seq_len, doc_ids, encode_batch))
    width = seq_len + 1
    pad = tokenizer.token_to_id(PAD)
    if not blocks:
        return TokenRows(np.full((0, width), pad, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), doc_ids, pad)
    tokens, lengths, doc = (np.concatenate(parts) for parts in zip(*blocks))
    return TokenRows(tokens, lengths, doc, doc_ids, pad)


def _abandoned(name: str) -> bool:
    """A temporary (``.KEY.tmp-PID``) whose writer is gone; a live writer's (another rank's) is left alone."""
    if not name.startswith(".") or ".tmp-" not in name:
        return False
    try:
        os.kill(int(name.rsplit("-", 1)[1]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError):
        return False
    return False


#: The cache's layout, part of its key (training/trainer.py). 2: the ids as UTF-8 bytes and offsets, not an object
#: array, which loads only through pickle (a run folder may come from elsewhere); a cache of 1 is another key's.
ROWS_FORMAT = 2


def cached_rows(cache: Path, key: str, docs: Iterable[tuple[str, str]], tokenizer: Tokenizer, seq_len: int,
                encode_batch: int = 256) -> TokenRows:
    """``build_rows``, written to ``cache`` as it is made and read back memory-mapped.

    Training then holds only the rows' index (lengths, documents) in memory, never the
    corpus's tokens: a batch reads its rows' pages from the file. ``key`` names what the
    rows were made from (data, tokenizer, sequence length); a cache with the same key is
    reused as it is (a resumed run does not tokenize again); writing another key removes the
    folder's other keys, so give each set of rows its own folder.
    The cache is written under a temporary name and renamed whole, so a killed run
    leaves none half-written, and ranks of one run can race to write it.
    """
    cache = Path(cache)
    done = cache / key
    if not (done / "index.npz").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        doc_ids: list[str] = []
        lengths, doc = [], []
        with open(tmp / "tokens.int32", "wb") as handle:
            for block_tokens, block_lengths, block_doc in _row_blocks(docs, tokenizer, seq_len, doc_ids, encode_batch):
                handle.write(np.ascontiguousarray(block_tokens).tobytes())
                lengths.append(block_lengths)
                doc.append(block_doc)
            handle.flush()
            os.fsync(handle.fileno())
        encoded = [d.encode() for d in doc_ids]
        np.savez(tmp / "index.npz", lengths=np.concatenate(lengths or [np.zeros(0, np.int32)]),
                 doc=np.concatenate(doc or [np.zeros(0, np.int64)]),
                 ids_utf8=np.frombuffer(b"".join(encoded), np.uint8),
                 ids_end=np.cumsum([len(e) for e in encoded], dtype=np.int64),
                 width=seq_len + 1, pad=tokenizer.token_to_id(PAD))
        try:
            os.replace(tmp, done)
        except OSError:  # another rank finished the same rows first
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in cache.iterdir():  # rows of another key, or a killed writer's temporary
            if (stale / "index.npz").is_file() and stale.name != key or _abandoned(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
    try:  # an entry that is an object array (a pickle) is refused by np.load as it is read
        with np.load(done / "index.npz", allow_pickle=False) as npz:
            index = {name: npz[name] for name in npz.files}
    except ValueError as exc:
        raise AssayError(f"refusing to load {done / 'index.npz'}: {exc}") from None
    width, n = int(index["width"]), len(index["lengths"])
    tokens = (np.memmap(done / "tokens.int32", dtype=np.int32, mode="r", shape=(n, width)) if n
              else np.zeros((0, width), np.int32))
    blob, ends = index["ids_utf8"].tobytes(), index["ids_end"].tolist()
    doc_ids = [blob[start:end].decode() for start, end in zip([0, *ends[:-1]], ends)]
    return TokenRows(tokens, index["lengths"], index["doc"], doc_ids, int(index["pad"]))


def batch_rows(n_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of step ``step`` (0-based): epochs of seeded permutations, laid end to end."""
    if n_rows == 0:
        raise ValueError("no training rows")
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(positions, n_rows)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n_rows)
        hit = epochs == epoch
        out[hit] = perm[offsets[hit]]
    return out


def make_batch(rows: TokenRows, indices: np.ndarray) -> Batch:
    """Stack rows into inputs/targets; documents renumbered 0.. within the batch."""
    block = torch.from_numpy(rows.tokens[indices].astype(np.int64))
    lengths = torch.from_numpy(rows.lengths[indices].astype(np.int64))
    n = block.shape[1] - 1
    # Position t predicts token t + 1, which is real when t + 1 < length.
    loss_mask = torch.arange(n)[None, :] < (lengths[:, None] - 1)
    docs = rows.doc[indices]
    unique, doc_index = np.unique(docs, return_inverse=True)
    return Batch(
        tokens=block[:, :-1].contiguous(),
        targets=block[:, 1:].contiguous(),
        loss_mask=loss_mask,
        doc_index=torch.from_numpy(doc_index.astype(np.int64)),
        doc_ids=[rows.doc_ids[d] for d in unique],
    )
