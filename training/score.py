"""The scoring pass: a run's checkpoint over every document of a dataset, no optimizer step.

For each document (its first ``score.max_rows`` rows, built exactly as training builds
rows), one forward and one backward give its mean token loss, the norm of that loss's
gradient and the gradient's dot product and cosine with the gradient of a clean reference
set (training.alignment): tier 2's signals for every document, where round 0's telemetry
saw only the documents its batches drew.

The reference set is explicit and versioned: ``score.reference`` names sources and the
share of each taken (by a hash of the id, so the choice is stable across versions); its
ids go to ``OUT/reference.txt`` and the manifest. Its documents are scored like the rest
but marked ``reference=True``: the dynamic filter never judges them. Its gradient is the
gradient of its mean token loss, per stratum (``score.strata``: one for all, per kind,
or per kind x language), so documentation is judged against documentation and code
against code. With ``score.components: source`` (the default) a stratum keeps one
reference gradient per source with ``min_stratum_docs`` reference documents in it, and a
document's alignment is its best cosine with one of them (nearest component: package
documentation against package documentation, man pages against man pages), all in the
same backward.

With ``score.order_rise`` (the default) one more forward, without a backward, scores the
same rows with each row's tokens shuffled; ``order_rise`` is the relative rise of the
document's mean token loss. Real language needs its order and a bag of words does not, so
text that is already shuffled barely rises: the planted kind a first-order signal like the
alignment cannot see (its words, hence its gradient's direction, are real).

Output, in ``OUT``::

    part-00000.parquet ...   SCORE_SCHEMA rows: part = (checkpoint, block of score.part_docs documents)
    reference.txt            the reference set's ids, in dataset order
    manifest.json            fingerprint, inputs, params, reference set, strata, counts, timings

Parts are written atomically; a rerun with the same inputs and params redoes only the
missing parts (a killed run resumes, a deleted part is rewritten), and other inputs or
params need ``overwrite``.

Speed: documents are sorted by length and packed into batches of about
``score.batch_tokens`` tokens, each padded only to its longest row (a row's padding sits
after its last real token, and attention is causal, so trimming it changes nothing); one
backward per batch, without weight gradients (the per-document quantities need only the
activation gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from assay.config import ScoringParams, TrainModelParams, TrainParams
from assay.devices import pick_device
from assay.errors import AssayError
from assay.installation import differences, installation
from assay.schema import SCORE_SCHEMA
from assay.shards import (MANIFEST, atomic_write_bytes, atomic_write_json, publish_directory,
                          shard_name, staging_dir)
from assay.staging import SET_ASIDE, building, keep_finished, own_output, staged_installation, start_staging
from assay.stages.shard_stage import file_fingerprint
from assay.versions import DatasetVersion, open_version
from training.alignment import References, per_document_alignment
from training.checkpoint import (CHECKPOINTS, LATEST, broken_latest, complete_checkpoints, latest_checkpoint,
                                 load_state, read_trainer_state)
from training.data import TokenRows, build_rows, make_batch
from training.grad_norms import per_document_loss_and_grad_norm, token_losses
from training.model import Transformer
from training.tokenizer import TOKENIZER_FILE, load_tokenizer
from training.precision import precision_context, without_loss_scaling
from training.trainer import build_model

__all__ = ["REFERENCE_FILE", "adam_preconditioner", "read_scores", "score_dataset", "select_reference"]

REFERENCE_FILE = "reference.txt"
FORMAT = "assay-scores/1"
_MARKER = ".score-fingerprint"  # the fingerprint of the run whose parts the staging folder holds
_REFERENCE_SALT = "assay-score-reference"
ALL = "all"


# ------------------------------------------------------------------ documents
@dataclass
class _Docs:
    """Every document of the dataset, in dataset order (no text)."""

    ids: list[str]
    kind: np.ndarray  # object arrays of str
    lang: np.ndarray
    source: np.ndarray
    reference: np.ndarray  # bool
    stratum: np.ndarray  # object: the stratum each document is compared with

    def __len__(self) -> int:
        return len(self.ids)


def _hash_share(doc_id: str) -> float:
    h = hashlib.blake2b(f"{_REFERENCE_SALT}\x1f{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def select_reference(ids: list[str], sources: np.ndarray, shares: dict[str, float]) -> np.ndarray:
    """Which documents form the clean reference set: ``shares[source]`` of each named source,
    by a salted hash of the id (stable across dataset versions, independent of the train split)."""
    return np.array([s in shares and _hash_share(i) < shares[s] for i, s in zip(ids, sources)], dtype=bool)


def _read_docs(version: DatasetVersion, params: ScoringParams) -> _Docs:
    ids, kind, lang, source = [], [], [], []
    for batch in version.iter_batches(columns=["id", "kind", "lang", "source"]):
        ids += batch.column("id").to_pylist()
        kind += batch.column("kind").to_pylist()
        lang += batch.column("lang").to_pylist()
        source += batch.column("source").to_pylist()
    if len(set(ids)) != len(ids):
        raise AssayError(f"{version.path}: document ids are not unique; scores are keyed by id")
    kind_a, lang_a, source_a = (np.array(v, dtype=object) for v in (kind, lang, source))
    reference = select_reference(ids, source_a, params.reference)
    return _Docs(ids, kind_a, lang_a, source_a, reference, _strata(kind_a, lang_a, reference, params))


def _strata(kind: np.ndarray, lang: np.ndarray, reference: np.ndarray, params: ScoringParams) -> np.ndarray:
    """Each document's stratum: the finest of kind x lang / kind / all with enough reference documents."""
    n_ref = int(reference.sum())
    out = np.full(len(kind), ALL, dtype=object)
    if params.strata == ALL or n_ref == 0:
        return out
    kinds, kind_counts = np.unique(kind[reference], return_counts=True)
    big_kinds = {k for k, c in zip(kinds, kind_counts) if c >= params.min_stratum_docs}
    pairs: set[str] = set()
    if params.strata == "kind_lang":
        keys = np.array([f"{k}/{g}" for k, g in zip(kind, lang)], dtype=object)
        names, counts = np.unique(keys[reference], return_counts=True)
        pairs = {n for n, c in zip(names, counts) if c >= params.min_stratum_docs}
    for i, (k, g) in enumerate(zip(kind, lang)):
        pair = f"{k}/{g}"
        out[i] = pair if pair in pairs else k if k in big_kinds else ALL
    return out


def _iter_texts(version: DatasetVersion, wanted: Callable[[int], bool]) -> Iterator[tuple[int, str]]:
    """(dataset position, text) of the wanted documents, streamed."""
    position = 0
    for batch in version.iter_batches(columns=["text"]):
        for text in batch.column("text").to_pylist():
            if wanted(position):
                yield position, text or ""
            position += 1


def _iter_blocks(version: DatasetVersion, part_docs: int, blocks: list[int]) -> Iterator[tuple[int, list]]:
    """(block, [(position, text)]) for the given blocks of part_docs documents, in one streaming pass."""
    wanted = set(blocks)
    current, texts = None, []
    for position, text in _iter_texts(version, lambda p: p // part_docs in wanted):
        block = position // part_docs
        if block != current and texts:
            yield current, texts
            texts = []
        current = block
        texts.append((position, text))
    if texts:
        yield current, texts


# ------------------------------------------------------------------ rows and batches
@dataclass
class _Scored:
    """Capped token rows of some documents: ``pos[j]`` is the dataset position of rows.doc_ids[j]."""

    rows: TokenRows
    pos: np.ndarray
    n_rows: np.ndarray  # rows per document before the cap


def _rows_for(texts: list[tuple[int, str]], tokenizer, seq_len: int, max_rows: int) -> _Scored:
    """Token rows of ``(position, text)`` documents, exactly as training builds them, cut to
    each document's first ``max_rows`` rows."""
    need = max_rows * seq_len + 1
    rows = build_rows(((str(p), _scored_prefix(t, tokenizer, need)) for p, t in texts), tokenizer, seq_len)
    pos = np.array([int(p) for p in rows.doc_ids], dtype=np.int64)
    n_rows = np.bincount(rows.doc, minlength=len(pos)) if len(rows) else np.zeros(len(pos), dtype=np.int64)
    # The first max_rows rows of each document (rows of a document are consecutive, in order).
    first = np.zeros(len(rows), dtype=bool)
    if len(rows):
        starts = np.concatenate([[0], np.cumsum(n_rows)[:-1]])
        first = (np.arange(len(rows)) - starts[rows.doc]) < max_rows
    kept = TokenRows(rows.tokens[first], rows.lengths[first], rows.doc[first], rows.doc_ids, rows.pad_id)
    return _Scored(kept, pos, n_rows)


#: Characters of a long document tokenized to find its first rows (generous: about 4 per token).
_CHARS_PER_TOKEN = 8


def _scored_prefix(text: str, tokenizer, need: int) -> str:
    """A prefix of ``text`` whose first ``need`` tokens are the whole text's, or the text.

    Only the first max_rows rows are scored, so tokenizing a long document whole is waste.
    BPE merges never cross pre-tokens (words), and cutting the text can change only its last
    two words, so the prefix's tokens are the text's wherever the ``need``-th token lies in
    an earlier word; otherwise the whole text is used."""
    if len(text) <= need * _CHARS_PER_TOKEN:
        return text
    prefix = text[: need * _CHARS_PER_TOKEN]
    words = tokenizer.encode(prefix, add_special_tokens=False).word_ids
    if len(words) > need and words[need - 1] is not None and words[-1] is not None \
            and words[need - 1] < words[-1] - 1:
        return prefix
    return text


def _length_batches(rows: TokenRows, batch_tokens: int) -> list[np.ndarray]:
    """Row indices of each batch: whole documents, longest first, about batch_tokens tokens each
    (rows x the batch's longest row)."""
    if len(rows) == 0:
        return []
    n_docs = len(rows.doc_ids)
    longest = np.zeros(n_docs, dtype=np.int64)
    np.maximum.at(longest, rows.doc, rows.lengths)
    count = np.bincount(rows.doc, minlength=n_docs)
    doc_rows = np.split(np.argsort(rows.doc, kind="stable"), np.cumsum(count)[:-1])
    order = sorted((d for d in range(n_docs) if count[d]), key=lambda d: (-longest[d], -count[d], d))
    batches, current, width, n_rows = [], [], 0, 0
    for d in order:
        if current and (n_rows + count[d]) * width > batch_tokens:
            batches.append(np.concatenate([doc_rows[e] for e in current]))
            current, n_rows = [], 0
        if not current:
            width = int(longest[d])
        current.append(d)
        n_rows += int(count[d])
    if current:
        batches.append(np.concatenate([doc_rows[e] for e in current]))
    return batches


def _batch(rows: TokenRows, indices: np.ndarray, device: torch.device):
    batch = make_batch(rows, indices)
    width = int(batch.loss_mask.sum(1).max())  # the longest row's targets: beyond it only padding
    width = max(width, 1)
    return dataclasses.replace(batch, tokens=batch.tokens[:, :width].contiguous(),
                               targets=batch.targets[:, :width].contiguous(),
                               loss_mask=batch.loss_mask[:, :width].contiguous()).to(device)


# ------------------------------------------------------------------ checkpoints
@dataclass
class _Checkpoint:
    step: int
    path: Path
    state: dict


def _resolve_checkpoints(run_dir: Path, wanted: list[int | str]) -> list[_Checkpoint]:
    root = run_dir / CHECKPOINTS
    available = [p.name for p in complete_checkpoints(run_dir)]
    out: list[_Checkpoint] = []
    for w in wanted:
        if w == "last":
            path = latest_checkpoint(run_dir)
            broken = broken_latest(run_dir) if path is None else None
            if broken:
                raise AssayError(f"{broken}; name one (`--checkpoint STEP`), or write its name into "
                                 f"{root / LATEST}")
            if path is None:
                raise AssayError(f"{run_dir}: no checkpoint (train it first with `assay train`)")
        else:
            path = root / f"step-{int(w):08d}"
            if not (path / "trainer.json").is_file():
                raise AssayError(f"{run_dir}: no checkpoint of step {w} (available: {', '.join(available) or 'none'})")
        state = read_trainer_state(path)
        if all(c.step != state["step"] for c in out):
            out.append(_Checkpoint(int(state["step"]), path, state))
    first = out[0].state
    for c in out[1:]:
        if c.state["model_args"] != first["model_args"] or c.state["seq_len"] != first["seq_len"]:
            raise AssayError(f"{run_dir}: checkpoints {out[0].step} and {c.step} are of different models")
    return out


def _train_params(state: dict) -> TrainParams:
    return TrainParams(model=TrainModelParams(**state["model_args"]), seq_len=int(state["seq_len"]),
                       precision=without_loss_scaling(state.get("precision", "fp32")))


def load_model(checkpoint: Path, state: dict, vocab_size: int, device: torch.device) -> Transformer:
    """The checkpoint's model alone (no optimizer), through DCP's restricted reader."""
    model = build_model(_train_params(state), vocab_size, device)
    model_sd = get_model_state_dict(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_state({"model": model_sd}, checkpoint)
    set_model_state_dict(model, model_sd)
    model.train()  # as in training (MoE routing and every module behave as they did)
    return model


# ------------------------------------------------------------------ reference gradients
def adam_preconditioner(checkpoint: Path, model: Transformer) -> dict[str, torch.Tensor]:
    """Adam's diagonal preconditioner at ``checkpoint``, ``1 / (sqrt(v_hat) + eps)`` per trainable
    parameter (``v_hat``: the second moment, bias-corrected at its step; betas and eps as trained).

    ``score.precondition: adam`` compares a document's raw gradient with ``P G`` instead of ``G``:
    ``g . (P G)`` is the first-order change of the clean loss along the step Adam would take on
    the reference, and a diagonal scaling of ``G`` changes nothing in the one-backward algebra."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    groups = read_trainer_state(checkpoint).get("param_groups") or []
    hyper = {n: g for g in groups for n in g.get("params", [])}
    state = {"optim": {n: {"exp_avg_sq": torch.empty_like(params[n], device="cpu"),
                           "step": torch.tensor(0.0)} for n in names}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_state(state, checkpoint)
    except Exception as exc:  # a missing key, a damaged file: say it in one line
        raise AssayError(f"score.precondition: adam needs the optimizer state in {checkpoint}; "
                         f"it could not be read ({type(exc).__name__})") from None
    out = {}
    for n in names:
        beta2, eps = (hyper.get(n, {}).get("betas") or (0.9, 0.999))[1], hyper.get(n, {}).get("eps", 1e-8)
        step = float(state["optim"][n]["step"])
        if step < 1:
            raise AssayError(f"score.precondition: adam: {checkpoint} has no optimizer step for {n}")
        v_hat = state["optim"][n]["exp_avg_sq"].double() / (1 - beta2 ** step)
        out[n] = (1.0 / (v_hat.sqrt() + eps)).float().to(params[n].device)
    return out


def _reference_gradients(model: Transformer, scored: _Scored, docs: _Docs, params: ScoringParams,
                         precision: str, device: torch.device) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Per stratum, the reference gradient (fp32): by ``score.reference_aggregate``, the gradient of
    the reference documents' mean token loss (``tokens``: a document weighs by its tokens), the
    mean of their own mean-loss gradients (``documents``), or the mean of those gradients scaled
    to unit length (``unit``: every document one equal vote on the direction, whatever its
    length or gradient size).

    The per-document weights are folded into the loss: ``sum_d w_d L_d`` has the gradient
    ``sum_d w_d grad L_d``, so ``documents`` is one backward with ``w_d = 1`` and ``unit`` one more
    with ``w_d = 1 / ||grad L_d||``, the norms from a ghost pass over the same batch."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params_by_name = dict(model.named_parameters())
    # Finest groups used by any stratum; every stratum is a union of them.
    doc_stratum_key = {}
    for j, pos in enumerate(scored.pos):
        k, g = docs.kind[pos], docs.lang[pos]
        doc_stratum_key[j] = f"{k}/{g}" if params.strata == "kind_lang" else k if params.strata == "kind" else ALL
        if params.components == "source":  # finest groups by source too: each may be a component
            doc_stratum_key[j] += f"|{docs.source[pos]}"
    sums: dict[str, dict[str, torch.Tensor]] = {}
    tokens: dict[str, int] = {}
    n_docs: dict[str, int] = {}
    for group in sorted(set(doc_stratum_key.values())):
        members = np.array([doc_stratum_key[j] == group for j in range(len(scored.pos))])
        sub = _subset(scored.rows, members)
        acc = {n: torch.zeros_like(params_by_name[n], dtype=torch.float64) for n in names}
        total = 0
        for indices in _length_batches(sub, params.batch_tokens):
            batch = _batch(sub, indices, device)
            model.zero_grad(set_to_none=True)
            row_weight = _reference_row_weights(model, batch, params.reference_aggregate, precision, device)
            with precision_context(precision, device):
                token_loss = token_losses(model(batch.tokens), batch.targets, batch.loss_mask)
            (token_loss.sum() if row_weight is None else (token_loss.sum(1) * row_weight).sum()).backward()
            for n in names:
                if params_by_name[n].grad is not None:
                    acc[n] += params_by_name[n].grad.double()
            total += batch.n_tokens
        model.zero_grad(set_to_none=True)
        sums[group], tokens[group], n_docs[group] = acc, total, int(members.sum())

    def combine(groups: list[str]) -> dict[str, torch.Tensor]:
        # tokens: the mean over the groups' tokens; documents/unit: over their documents.
        n = sum((tokens if params.reference_aggregate == "tokens" else n_docs)[g] for g in groups)
        return {name: (sum(sums[g][name] for g in groups) / max(n, 1)).float() for name in names}

    def describe(groups: list[str], grads: dict[str, torch.Tensor]) -> dict:
        return {"reference_docs": sum(n_docs[g] for g in groups), "reference_tokens": sum(tokens[g] for g in groups),
                "gradient_norm": float(sum(t.double().pow(2).sum() for t in grads.values())) ** 0.5}

    strata = sorted(set(docs.stratum))
    out, info = {}, {}
    for s in strata:
        members = [g for g in sums if s == ALL or g.split("|")[0] == s or g.split("|")[0].split("/")[0] == s]
        out[s] = combine(members)
        info[s] = describe(members, out[s])
        info[s]["components"] = [s]
        if params.components == "source":
            by_source: dict[str, list[str]] = {}
            for g in members:
                by_source.setdefault(g.split("|")[1], []).append(g)
            big = [src for src, groups in sorted(by_source.items())
                   if sum(n_docs[g] for g in groups) >= params.min_stratum_docs]
            if big:  # else the stratum's whole reference is its one component
                info[s]["components"] = [f"{s}|{src}" for src in big]
                for src in big:
                    out[f"{s}|{src}"] = combine(by_source[src])
                    info[f"{s}|{src}"] = describe(by_source[src], out[f"{s}|{src}"])
    return out, info


def _stack_references(grads: dict[str, dict[str, torch.Tensor]], info: dict, strata_names: list[str],
                      device: torch.device) -> tuple[References, dict[str, int | list[int]]]:
    """The references to stack, and each stratum's index into them: one int per stratum, or with
    ``score.components`` the list of its components' indices, padded to the longest by repeating
    its first (a repeat cannot change a document's best cosine)."""
    components = {s: info[s].get("components", [s]) for s in strata_names}
    if all(c == [s] for s, c in components.items()):
        return References([grads[s] for s in strata_names], device=device), {s: k for k, s in enumerate(strata_names)}
    names = sorted({c for cs in components.values() for c in cs})
    width = max(len(cs) for cs in components.values())
    index = {s: [names.index(c) for c in cs] + [names.index(cs[0])] * (width - len(cs))
             for s, cs in components.items()}
    return References([grads[n] for n in names], device=device), index


def _reference_row_weights(model: Transformer, batch, aggregate: str, precision: str,
                           device: torch.device) -> torch.Tensor | None:
    """Per row, the weight of its token losses in the reference loss: ``w_d / N_d`` for the row's
    document ``d`` (``N_d`` its scored tokens), or None for ``tokens`` (plain sum)."""
    if aggregate == "tokens":
        return None
    n_docs = len(batch.doc_ids)
    doc_tokens = torch.zeros(n_docs, dtype=torch.float64, device=device).index_add_(
        0, batch.doc_index, batch.loss_mask.sum(1).double())
    weight = 1.0 / doc_tokens.clamp(min=1)
    if aggregate == "unit":
        with precision_context(precision, device):
            stats = per_document_loss_and_grad_norm(model, batch.tokens, batch.targets, batch.loss_mask,
                                                    batch.doc_index, n_docs, weight_grads=False)
        norm = stats.grad_norm.double().to(device)
        # A document with no gradient (no scored token, or exactly zero) has no direction to vote.
        weight = torch.where(norm > 0, weight / norm, torch.zeros_like(weight))
    return weight[batch.doc_index].to(torch.float32)


_SHUFFLE_SALT = "assay-score-order"


def shuffled_rows(rows: TokenRows, keys: list[str] | None = None) -> TokenRows:
    """The same rows with each row's real tokens in a random order (padding left in place).

    The order of a document's rows comes from a hash of its key (``keys[d]`` for ``rows.doc_ids[d]``;
    by default the doc id), so a document's shuffle, and its ``order_rise``, do not depend on which
    batch, part or run it is scored in."""
    out = rows.tokens.copy()
    by_doc = np.argsort(rows.doc, kind="stable")  # each document's rows, in their order
    bounds = np.searchsorted(rows.doc[by_doc], np.arange(len(rows.doc_ids) + 1))
    for d, doc_id in enumerate(rows.doc_ids if keys is None else keys):
        seed = hashlib.blake2b(f"{_SHUFFLE_SALT}\x1f{doc_id}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(seed, "big"))
        for r in by_doc[bounds[d]:bounds[d + 1]]:
            n = int(rows.lengths[r])
            out[r, :n] = rows.tokens[r, :n][rng.permutation(n)]
    return TokenRows(out, rows.lengths, rows.doc, rows.doc_ids, rows.pad_id)


def _subset(rows: TokenRows, doc_mask: np.ndarray) -> TokenRows:
    keep = doc_mask[rows.doc]
    new_index = np.cumsum(doc_mask) - 1
    return TokenRows(rows.tokens[keep], rows.lengths[keep], new_index[rows.doc[keep]],
                     [d for d, m in zip(rows.doc_ids, doc_mask) if m], rows.pad_id)


# ------------------------------------------------------------------ scoring one part
def _mean_document_loss(model: Transformer, batch, tokens: torch.Tensor, precision: str,
                        device: torch.device) -> np.ndarray:
    """Each batch document's mean token loss under ``model``, forward only (``tokens``: its scored tokens)."""
    with torch.no_grad(), precision_context(precision, device):
        token_loss = token_losses(model(batch.tokens), batch.targets, batch.loss_mask)
    doc_sum = torch.zeros(len(tokens), dtype=torch.float64, device=device).index_add_(
        0, batch.doc_index, token_loss.sum(1).double())
    return (doc_sum / tokens.double()).cpu().numpy()


def _score_rows(model: Transformer, scored: _Scored, docs: _Docs, references: References,
                stratum_index: dict[str, int | list[int]], ref_model: Transformer | None, step: int,
                params: ScoringParams, precision: str, device: torch.device, advance: Callable[[int, int], None]) -> pa.Table:
    rows = scored.rows
    # Keyed by the document's id: the rows' own doc ids are dataset positions, which move between versions.
    shuffled = shuffled_rows(rows, [docs.ids[p] for p in scored.pos]) if params.order_rise else None
    n = len(rows.doc_ids)
    cols = {k: np.full(n, np.nan) for k in ("loss", "grad_norm", "grad_dot", "alignment", "ref_loss", "order_rise")}
    tokens = np.zeros(n, dtype=np.int64)
    for indices in _length_batches(rows, params.batch_tokens):
        batch = _batch(rows, indices, device)
        local = np.array([int(d) for d in batch.doc_ids])  # dataset positions of the batch's documents
        j = np.searchsorted(scored.pos, local)
        doc_reference = torch.tensor([stratum_index[docs.stratum[p]] for p in local], device=device)
        with precision_context(precision, device):
            stats = per_document_alignment(model, batch.tokens, batch.targets, batch.loss_mask, batch.doc_index,
                                           len(local), references, doc_reference, weight_grads=False)
        if stats.alignment.dim() == 2:  # components: the best cosine, and the dot with that component
            best = stats.alignment.nan_to_num(-math.inf).argmax(1, keepdim=True)
            stats.grad_dot = stats.grad_dot.gather(1, best)[:, 0]
            stats.alignment = stats.alignment.gather(1, best)[:, 0]
        for key in ("loss", "grad_norm", "grad_dot", "alignment"):
            cols[key][j] = getattr(stats, key).double().cpu().numpy()
        tokens[j] = stats.tokens.cpu().numpy()
        if ref_model is not None:
            cols["ref_loss"][j] = _mean_document_loss(ref_model, batch, stats.tokens, precision, device)
        if shuffled is not None:
            # The same rows and lengths, so the same loss mask: only the order of the tokens differs.
            mixed_loss = _mean_document_loss(model, _batch(shuffled, indices, device), stats.tokens, precision, device)
            plain = stats.loss.double().cpu().numpy()
            with np.errstate(divide="ignore", invalid="ignore"):
                cols["order_rise"][j] = (mixed_loss - plain) / plain
        advance(len(local), batch.n_tokens)
    pos = scored.pos
    return pa.table({
        "step": pa.array(np.full(n, step, dtype=np.int64)),
        "sample_id": pa.array([docs.ids[p] for p in pos], pa.string()),
        "kind": pa.array(docs.kind[pos].tolist(), pa.string()),
        "lang": pa.array(docs.lang[pos].tolist(), pa.string()),
        "tokens": pa.array(tokens.astype(np.int32)),
        "loss": pa.array(cols["loss"].astype(np.float32)),
        "grad_norm": pa.array(cols["grad_norm"].astype(np.float32)),
        "grad_dot": pa.array(cols["grad_dot"].astype(np.float32)),
        "alignment": pa.array(cols["alignment"].astype(np.float32)),
        "stratum": pa.array(docs.stratum[pos].tolist(), pa.string()),
        "ref_loss": pa.array(cols["ref_loss"].astype(np.float32), mask=np.isnan(cols["ref_loss"]))
        if ref_model is not None else pa.nulls(n, pa.float32()),
        "order_rise": pa.array(cols["order_rise"].astype(np.float32), mask=np.isnan(cols["order_rise"]))
        if shuffled is not None else pa.nulls(n, pa.float32()),
        "reference": pa.array(docs.reference[pos]),
        "rows": pa.array(np.minimum(scored.n_rows, params.max_rows).astype(np.int32)),
        "capped": pa.array(scored.n_rows > params.max_rows),
    }, schema=SCORE_SCHEMA)


def _write_part(path: Path, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    atomic_write_bytes(path, buffer.getvalue())


# ------------------------------------------------------------------ output directory
def _prepare_out(out: Path, fingerprint: str, overwrite: bool) -> tuple[dict | None, Path]:
    """The finished manifest when nothing is left to do, and the folder this run writes its parts in.

    The parts are written in OUT's staging folder and published whole at the end
    (assay.shards.publish_directory), so OUT holds the previous scores, or none, until then; a
    killed run's parts are resumed when the fingerprint and the installation match (assay.installation),
    dropped when either does not.
    """
    previous = own_output(out, FORMAT, "a scores directory")
    staging, work = staging_dir(out), building(out)
    if previous is not None:
        if previous.get("fingerprint") == fingerprint and all((out / s).is_file() for s in previous.get("shards", [])):
            if keep_finished(out, previous, overwrite):
                shutil.rmtree(staging, ignore_errors=True)  # a run killed after publishing leaves it
                return previous, work
        elif previous.get("fingerprint") != fingerprint and not overwrite:
            raise AssayError(f"{out}: holds scores of other inputs or params; pass --overwrite to replace them")
    # The marker lies beside the parts, so it is never published with them.
    start_staging(out, staging / _MARKER, fingerprint)
    work.mkdir(parents=True, exist_ok=True)
    if previous is not None and previous.get("fingerprint") == fingerprint and \
            not differences(previous.get("installation"), installation()):  # another's parts: all redone
        # Parts of these very inputs are missing from OUT: the run redoes those alone. What is
        # there goes into the new folder unchanged, linked (the same filesystem) or else copied.
        for name in [*previous.get("shards", []), *(f".reference/{p.name}" for p in (out / ".reference").glob("*"))]:
            if (out / name).is_file() and not (work / name).exists():
                (work / name).parent.mkdir(exist_ok=True)
                try:
                    os.link(out / name, work / name)
                except OSError:
                    shutil.copy2(out / name, work / name)
    return None, work


def _fingerprint(version: DatasetVersion, run_dir: Path, checkpoints: list[_Checkpoint], params: ScoringParams,
                 ref_run: Path | None) -> str:
    blob = {
        "format": FORMAT,
        "data": version.data_hash,
        "tokenizer": file_fingerprint(run_dir / TOKENIZER_FILE),
        "checkpoints": [[c.step, file_fingerprint(c.path)] for c in checkpoints],
        "params": dataclasses.asdict(params),
        "reference_model": file_fingerprint(latest_checkpoint(ref_run)) if ref_run else None,
    }
    return hashlib.blake2b(json.dumps(blob, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


# ------------------------------------------------------------------ the pass
def _read_reference_cache(cache: Path, dev: torch.device) -> tuple[dict, dict] | None:
    """A killed run's reference gradients, or None when there are none to trust. The cache is
    only ever ours, but a file that does not load (truncated, edited, or holding anything but
    tensors, which ``weights_only`` refuses) costs one recomputation, never the run."""
    meta = cache.with_suffix(".json")
    if not (cache.is_file() and meta.is_file()):
        return None
    try:
        grads = torch.load(cache, map_location=dev, weights_only=True)
        info = json.loads(meta.read_text())
        if not isinstance(grads, dict) or not isinstance(info, dict) or "strata" not in info:
            raise ValueError("not a reference-gradient cache")
    except Exception as err:  # noqa: BLE001 (any failure to read it means recompute)
        warnings.warn(f"{cache}: the reference-gradient cache does not load ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else 'no detail'}); recomputing it", stacklevel=2)
        return None
    return grads, info


def score_dataset(run_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
                  params: ScoringParams | None = None, *, rev: str | None = None, overwrite: bool = False,
                  device: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Score every document of ``data_dir`` (at git ``rev`` through DVC, or the workspace)
    with the checkpoint(s) of ``run_dir``; write ``out_dir``; return its manifest."""
    params = params or ScoringParams()
    run_dir, out = Path(run_dir), Path(out_dir)
    t0, cpu0 = time.perf_counter(), time.process_time()
    version = open_version(data_dir, rev)
    checkpoints = _resolve_checkpoints(run_dir, params.checkpoints)
    tokenizer = load_tokenizer(run_dir)
    ref_run = Path(params.reference_model) if params.reference_model else None
    if ref_run is not None:
        _check_reference_model(run_dir, ref_run)
    fingerprint = _fingerprint(version, run_dir, checkpoints, params, ref_run)
    finished, work = _prepare_out(out, fingerprint, overwrite)
    if finished is not None:
        return finished

    docs = _read_docs(version, params)
    if not docs.reference.any():
        raise AssayError(f"{data_dir}: no document of the reference sources "
                         f"({', '.join(params.reference) or 'none configured'}) is in the dataset; "
                         "set score.reference to sources it holds")
    atomic_write_bytes(work / REFERENCE_FILE,
                       "".join(f"{i}\n" for i, r in zip(docs.ids, docs.reference) if r).encode())
    n_blocks = max(1, math.ceil(len(docs) / params.part_docs))
    dev = pick_device(device or params.device)
    state0 = checkpoints[0].state
    # The pass has no loss scaler: an fp16 run's model is scored in fp32 (fp8_fp16's in fp8 with bf16).
    seq_len, precision = int(state0["seq_len"]), without_loss_scaling(state0.get("precision", "fp32"))
    vocab = tokenizer.get_vocab_size()
    strata_names = sorted(set(docs.stratum))

    todo = [(c, b) for c in range(len(checkpoints)) for b in range(n_blocks)
            if not (work / shard_name(c * n_blocks + b)).is_file()]
    counts = {"documents": len(docs), "reference": int(docs.reference.sum()), "parts": len(checkpoints) * n_blocks,
              "parts_resumed": len(checkpoints) * n_blocks - len(todo)}
    strata_info: dict[str, dict] = {}
    ref_model = None
    if ref_run is not None:
        ref_ck = latest_checkpoint(ref_run)
        ref_model = load_model(ref_ck, read_trainer_state(ref_ck), vocab, dev)
    reference_rows = None
    scored_docs = scored_tokens = 0
    total = sum(min(len(docs), (b + 1) * params.part_docs) - b * params.part_docs for _, b in todo)
    with _progress(progress, total) as advance:
        def tick(n_docs: int, n_tokens: int) -> None:
            nonlocal scored_docs, scored_tokens
            scored_docs += n_docs
            scored_tokens += n_tokens
            advance(scored_docs, scored_tokens, time.perf_counter() - t0)

        for c, ck in enumerate(checkpoints):
            blocks = [b for cc, b in todo if cc == c]
            cache = work / ".reference" / f"step-{ck.step:08d}.pt"
            if not blocks and cache.with_suffix(".json").is_file():
                strata_info[str(ck.step)] = json.loads(cache.with_suffix(".json").read_text())
                continue
            model = load_model(ck.path, ck.state, vocab, dev)
            cached = _read_reference_cache(cache, dev)
            if cached is not None:
                grads, info = cached
            else:
                if reference_rows is None:
                    reference_rows = _rows_for(list(_iter_texts(version, lambda p: bool(docs.reference[p]))),
                                               tokenizer, seq_len, params.max_rows)
                r0 = time.perf_counter(), time.process_time()
                grads, info = _reference_gradients(model, reference_rows, docs, params, precision, dev)
                if params.precondition == "adam":
                    scale = adam_preconditioner(ck.path, model)
                    grads = {s: {n: g * scale[n].to(g) for n, g in by_name.items()} for s, by_name in grads.items()}
                    for s in info:
                        info[s]["preconditioned_norm"] = float(sum(t.double().pow(2).sum()
                                                                   for t in grads[s].values())) ** 0.5
                info = {"strata": info, "reference_seconds": round(time.perf_counter() - r0[0], 3),
                        "reference_cpu_seconds": round(time.process_time() - r0[1], 3)}
                buffer = io.BytesIO()
                torch.save(grads, buffer)
                atomic_write_bytes(cache, buffer.getvalue())
                atomic_write_json(cache.with_suffix(".json"), info)
            strata_info[str(ck.step)] = info
            references, stratum_index = _stack_references(grads, info["strata"], strata_names, dev)
            for b, texts in _iter_blocks(version, params.part_docs, blocks):
                scored = _rows_for(texts, tokenizer, seq_len, params.max_rows)
                # The filter reads a document's ref_loss at its last scored checkpoint only, and
                # the reference model's loss does not depend on the checkpoint: earlier ones skip it.
                last = c == len(checkpoints) - 1
                table = _score_rows(model, scored, docs, references, stratum_index, ref_model if last else None,
                                    ck.step, params, precision, dev, tick)
                _write_part(work / shard_name(c * n_blocks + b), table)
            del model

    manifest = _manifest(work, fingerprint, version, run_dir, checkpoints, params, docs, strata_info, counts,
                         (time.perf_counter() - t0, time.process_time() - cpu0), scored_docs, scored_tokens, n_blocks)
    for cache in (work / ".reference").glob("*.pt"):  # a resume cache, a model's size: not part of the output
        cache.unlink()
    manifest["installation"] = staged_installation(staging_dir(out) / _MARKER)
    atomic_write_json(work / MANIFEST, manifest)
    publish_directory(work, out, staging_dir(out) / SET_ASIDE)
    shutil.rmtree(staging_dir(out), ignore_errors=True)
    return manifest


def _check_reference_model(run_dir: Path, ref_run: Path) -> None:
    if latest_checkpoint(ref_run) is None:
        raise AssayError(f"score.reference_model: {ref_run} holds no checkpoint")
    mine, theirs = run_dir / TOKENIZER_FILE, ref_run / TOKENIZER_FILE
    if not theirs.is_file() or file_fingerprint(mine) != file_fingerprint(theirs):
        raise AssayError(f"score.reference_model: {ref_run} does not share {run_dir}'s tokenizer; RHO-LOSS "
                         "compares per-token losses, so train the reference model with the same tokenizer.json")


def _manifest(out: Path, fingerprint: str, version: DatasetVersion, run_dir: Path, checkpoints: list[_Checkpoint],
              params: ScoringParams, docs: _Docs, strata_info: dict, counts: dict, seconds: tuple[float, float],
              scored_docs: int, scored_tokens: int, n_blocks: int) -> dict:
    seconds, cpu_seconds = seconds
    # The reference gradients' time, as measured when they were computed (a resumed run reuses them).
    ref_seconds = sum(v["reference_seconds"] for v in strata_info.values())
    ref_cpu = sum(v["reference_cpu_seconds"] for v in strata_info.values())
    shards = [shard_name(i) for i in range(len(checkpoints) * n_blocks)]
    scored = capped = 0
    for name in shards:
        t = pq.read_table(out / name, columns=["capped"])
        scored += t.num_rows
        capped += sum(t.column("capped").to_pylist())
    ref_ids = [i for i, r in zip(docs.ids, docs.reference) if r]
    strata_docs = dict(zip(*np.unique(docs.stratum[~docs.reference], return_counts=True)))
    return {
        "format": FORMAT,
        "stage": "score",
        "created_at": datetime.now(timezone.utc).isoformat(),
        "fingerprint": fingerprint,
        # The model by content (a moved run keeps it): `assay run dynamic` checks its --run against it.
        "inputs": {"dataset": version.identity(), "run": str(run_dir),
                   "tokenizer": file_fingerprint(run_dir / TOKENIZER_FILE),
                   "checkpoints": [{"step": c.step, "path": str(c.path), "fingerprint": file_fingerprint(c.path)}
                                   for c in checkpoints],
                   "reference_model": params.reference_model},
        "params": dataclasses.asdict(params),
        "reference": {
            "file": REFERENCE_FILE, "documents": len(ref_ids),
            "ids_hash": hashlib.blake2b("\n".join(ref_ids).encode(), digest_size=16).hexdigest(),
            "selection": params.reference,
            "by_source": {str(k): int(v) for k, v in zip(*np.unique(docs.source[docs.reference], return_counts=True))},
        },
        "strata": {"mode": params.strata, "judged_docs": {str(k): int(v) for k, v in strata_docs.items()},
                   "by_step": strata_info},
        "counts": {**counts, "rows": scored, "scored_per_checkpoint": scored // max(1, len(checkpoints)),
                   "capped_rows": capped, "max_rows": params.max_rows,
                   "unscored_per_checkpoint": len(docs) - scored // max(1, len(checkpoints))},
        "loss_is": f"mean token loss over each document's first {params.max_rows} rows "
                   "(the whole document when it has no more; see the capped column)",
        "shards": shards,
        "timings": {"seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
                    "reference_seconds": round(ref_seconds, 3), "reference_cpu_seconds": round(ref_cpu, 3),
                    "documents_scored": scored_docs, "tokens_scored": scored_tokens,
                    "docs_per_second": round(scored_docs / seconds, 2) if seconds else None,
                    "tokens_per_second": round(scored_tokens / seconds, 1) if seconds else None},
    }


def read_scores(out_dir: str | Path) -> pa.Table:
    """Every row of a finished scoring pass (SCORE_SCHEMA)."""
    out = Path(out_dir)
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        raise AssayError(f"{out}: no {MANIFEST}; run `assay score` (it did not finish)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise AssayError(f"{out}: not a scores directory ({MANIFEST} of format {manifest.get('format')!r})")
    missing = [s for s in manifest["shards"] if not (out / s).is_file()]
    if missing:
        raise AssayError(f"{out}: {len(missing)} part(s) missing ({missing[0]} ...); rerun `assay score`")
    tables = [pq.read_table(out / s, schema=SCORE_SCHEMA) for s in manifest["shards"]]
    return pa.concat_tables(tables) if tables else SCORE_SCHEMA.empty_table()


@contextlib.contextmanager
def _progress(enabled: bool, total: int):
    """A rich bar with documents/s and tokens/s; a no-op when disabled."""
    if not enabled or total == 0:
        yield lambda *args: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("score"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), console=Console(file=sys.stderr)) as bar:
        task = bar.add_task("score", total=total, info="")

        def advance(docs: int, tokens: int, seconds: float) -> None:
            bar.update(task, completed=docs,
                       info=f"{docs / max(seconds, 1e-9):,.1f} docs/s  {tokens / max(seconds, 1e-9):,.0f} tok/s")

        yield advance
