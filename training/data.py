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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from training.tokenizer import EOS, PAD

__all__ = ["Batch", "TokenRows", "batch_rows", "build_rows", "is_holdout", "make_batch"]


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


def build_rows(docs: Iterable[tuple[str, str]], tokenizer: Tokenizer, seq_len: int,
               encode_batch: int = 256) -> TokenRows:
    """Tokenize ``(id, text)`` pairs (EOS appended) into rows of ``seq_len + 1`` tokens.

    Consecutive rows of a document overlap by one token, so every token but the
    first is a target exactly once.
    """
    eos, pad = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    width = seq_len + 1
    chunks: list[np.ndarray] = []
    doc_of_row: list[int] = []
    doc_ids: list[str] = []
    pending: list[tuple[str, str]] = []

    def flush() -> None:
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

    for doc in docs:
        pending.append(doc)
        if len(pending) >= encode_batch:
            flush()
    if pending:
        flush()
    tokens = np.full((len(chunks), width), pad, dtype=np.int32)
    lengths = np.zeros(len(chunks), dtype=np.int32)
    for r, chunk in enumerate(chunks):
        tokens[r, :len(chunk)] = chunk
        lengths[r] = len(chunk)
    return TokenRows(tokens, lengths, np.asarray(doc_of_row, dtype=np.int64), doc_ids, pad)


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
