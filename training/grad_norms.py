"""Per-document losses and gradient norms from the training step's own forward and backward.

Why: a document whose gradient is far larger than its neighbours' is often junk (random
bytes, boilerplate in a new language, a broken encoding). Its gradient norm is the
quantity an optimizer step actually feels, so it is a sharper data-quality signal than
its loss alone. Measuring it must not cost an extra backward per document, so we take
it from the one backward the trainer runs anyway.

Setting
-------
A batch has ``B`` rows of ``N`` positions. Row ``r`` holds tokens of one document
``doc[r]`` (a long document may fill several rows; rows never mix documents).
With per-token losses ``l_t`` and loss mask ``m_t``::

    L   = (1 / N_tot) * sum_t m_t l_t            N_tot = sum_t m_t        (batch loss)
    L_d = (1 / N_d)   * sum_{t in d} m_t l_t     N_d   = sum_{t in d} m_t (document loss)

We want ``||grad_theta L_d||_2`` over all trainable parameters, for every ``d``.

Rescaling the batch backward
----------------------------
Rows do not interact (attention stays inside a row, MoE routing is per token, there is no
batch normalisation; a model that mixed rows would break this, and the tests compare
against autograd of each document's own loss), so an activation ``z_t`` at a position of row ``r`` only influences
the losses of row ``r``, which all belong to ``d = doc[r]``::

    dL/dz_t   = (1 / N_tot) * sum_{s in r} m_s dl_s/dz_t
    dL_d/dz_t = (1 / N_d)   * sum_{s in r} m_s dl_s/dz_t = (N_tot / N_d) * dL/dz_t

So the output gradients ``g_t`` of every layer in the ordinary batch backward, times
``N_tot / N_d``, are exactly the output gradients of ``L_d`` (positions of other
documents get 0). Squared norms therefore take the factor ``(N_tot / N_d)^2``, applied
once at the end (and ``1 / loss_scale^2`` when the backward ran on ``loss * loss_scale``).

Per-layer contributions (each parameter belongs to one module, so squared norms add)
-----------------------------------------------------------------------------------
Linear ``y_t = W a_t (+ b)``: ``grad_W L_d ∝ sum_{t in d} g_t a_t^T`` -- the
per-example gradient trick of Goodfellow (2015, "Efficient per-example gradient
computations"), applied to groups of tokens. Its squared Frobenius norm can be computed
two ways: the ghost norm of ghost clipping (Li et al. 2022, "Large Language Models Can Be
Strong Differentially Private Learners"; in Opacus as ``GradSampleModuleFastGradientClipping``)
or by materialising the group gradient, and we take the cheaper per layer (the "mixed
ghost clipping" rule of Bu et al. 2022, ghost when ``T^2`` is small next to ``d_in d_out``):

* ghost:       ``sum_{t,s in d} (g_t . g_s)(a_t . a_s)``: two Gram matrices per pair of
  rows of the same document, cost ``~ P M^2 (d_in + d_out)`` (``P`` row pairs, the ``B``
  rows with themselves included; ``M`` positions per row: ``N``, fewer for an expert);
* materialise: ``||sum_{t in d} g_t a_t^T||^2`` via one ``(d_out, d_in)`` matrix per row,
  cost ``~ B M d_in d_out`` -- the same as the weight gradient itself.

Bias: ``||sum_{t in d} g_t||^2``.

Embedding: ``grad_E L_d`` has row ``v`` equal to ``sum_{t in d, tok_t = v} g_t``. Instead of the
ghost form ``sum_{t,s} (g_t . g_s) [tok_t = tok_s]`` we sum ``g_t`` per distinct
(document, token id) pair, which is exact and linear in the number of tokens.

RMSNorm ``y = x_hat * w``: the per-token weight gradient is ``g_t * x_hat_t`` (elementwise),
a ``dim``-vector, so we simply sum it per document.

MoE experts see a subset of the tokens (``flat.index_select(0, ids)``); ``MoE.last_dispatch``
says which, and we lay those tokens back out by row (zero-padded) before the same Linear
formulas. Zero padding contributes nothing to either form.

All norm arithmetic is fp32 (fp64 for an fp64 model), also under ``torch.autocast``;
the activation is first rounded to the Linear's compute dtype, as autocast does, so the
norm is built from the operands the weight gradient really uses.

Mechanics: forward hooks keep each supported module's input and register a tensor hook
on its output; the tensor hook receives ``g`` during the backward, adds the module's
per-document squared norms to an accumulator and drops the saved input. Nothing touches
the gradients themselves, so ``.grad`` ends up exactly as a plain ``loss.backward()``
leaves it. Hooks live only inside a context manager.

Tensor parallelism (DTensor weights and activations on a 1-D mesh, training.parallel.tensor_parallel):
the hooks run before the plan's output hooks, so they see each module's own DTensor input and
output. Every rank computes the squared norms of the weight block it holds, from the matching
slices of ``a`` and ``g`` (a column-parallel Linear's output features, a row-parallel one's input
features, an embedding's vocabulary rows; sequence-sharded operands are gathered first), and the
per-document sums are all-reduced over the mesh. A replicated weight (the norms under sequence
parallel) has the same squared norm on every rank: only the mesh's first rank adds it.

Expert parallelism (training.parallel.expert_parallel: each ep rank holds some experts and runs
them on the tokens every rank of its ep group routes there): a document's gradient for expert
``e`` is ``sum_{t in d, routed to e} g_t a_t^T``, and all those tokens are on the rank owning ``e``.
So that rank computes the document's squared norm for ``e`` (the documents are its "rows",
each one's tokens zero-padded), and the squared norms, indexed by a document numbering shared by
the ep group, are all-reduced over it; each rank keeps its own documents'. A received ``g_t`` is
the gradient of its source rank's loss, so the owner's rescaling applies to it unchanged.

Context parallelism (training.parallel.context_parallel: each rank holds some positions of every row):
a document's gradient is the sum of the ranks' parts, so each layer's per-document parts are summed over
the cp group before squaring (:func:`_context_sq_norms`).

Pipeline parallelism (training.parallel.pipeline): the schedule runs the step's rows as micro-batches,
stage by stage. :class:`MicroBatchNorms` gives each micro-batch hooks of its own; a document's rows in
several micro-batches are measured together after the last backward (their cross terms), and the
stages' squared norms add over the pp group (each parameter lives on one stage). With tp, cp or ep
inside the stages, each micro-batch does what one batch does under them.

Models with parameters this module cannot attribute (an unknown module type owning
parameters, a parameter shared between modules) fall back, with a warning, to
:func:`per_document_grad_norms_reference` (one more forward, and a backward per document).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from training.model import RMSNorm
from training.moe import MoE
from training.parallel.expert_parallel import EPDispatch, LocalExperts

__all__ = [
    "DocumentStats",
    "LayerGrad",
    "LayerObserver",
    "MicroBatchNorms",
    "per_document_grad_norms_functional",
    "per_document_grad_norms_reference",
    "per_document_loss_and_grad_norm",
    "token_losses",
]

Method = Literal["auto", "ghost", "materialise"]

# Upper bound on the elements of one temporary (Gram matrices, per-row weight gradients):
# bounds the extra memory of a hook independently of the batch size.
_CHUNK_ELEMENTS = 1 << 25


@dataclass
class DocumentStats:
    """Per-document results of one batch; documents without unmasked tokens get NaN."""

    loss: torch.Tensor  # (n_docs,) mean token loss L_d over the document's unmasked tokens
    grad_norm: torch.Tensor  # (n_docs,) ||grad_theta L_d||_2 over all trainable parameters
    tokens: torch.Tensor  # (n_docs,) long: unmasked tokens of each document in this batch
    batch_loss: torch.Tensor  # () the batch loss L (before loss_scale), detached


# ----------------------------------------------------------------------------- losses
def token_losses(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, N) cross-entropy, 0 at masked positions (whatever their target holds)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the softmax of a large vocabulary wants fp32
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.masked_fill(~mask, -100).reshape(-1),
        ignore_index=-100,
        reduction="none",
    )
    return ce.view(mask.shape)


def _check_batch(
    tokens: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, doc_index: torch.Tensor, n_docs: int
) -> None:
    if tokens.dim() != 2 or targets.shape != tokens.shape or loss_mask.shape != tokens.shape:
        raise ValueError(
            f"tokens, targets, loss_mask must all be (B, N); got {tuple(tokens.shape)}, "
            f"{tuple(targets.shape)}, {tuple(loss_mask.shape)}"
        )
    if doc_index.shape != tokens.shape[:1]:
        raise ValueError(f"doc_index must be (B,) = ({tokens.shape[0]},), got {tuple(doc_index.shape)}")
    if doc_index.numel() and (int(doc_index.min()) < 0 or int(doc_index.max()) >= n_docs):
        raise ValueError(f"doc_index must lie in [0, {n_docs})")


def _doc_tokens(mask: torch.Tensor, doc_index: torch.Tensor, n_docs: int) -> torch.Tensor:
    return torch.zeros(n_docs, dtype=torch.long, device=mask.device).index_add_(
        0, doc_index, mask.sum(1)
    )


# ----------------------------------------------------------------------------- layout
class _Rows:
    """Which rows share a document: everything the hooks need about the batch."""

    def __init__(self, doc_index: torch.Tensor, n_docs: int, seq_len: int):
        self.row_doc = doc_index
        self.n_rows = doc_index.numel()
        self.n_docs = n_docs
        self.seq_len = seq_len
        # Pairs r < r' of rows of one document, for the ghost sum's cross terms (weight 2 by
        # symmetry); the diagonal r == r' is handled without indexing.
        same = doc_index[:, None] == doc_index[None, :]
        self.pair_left, self.pair_right = torch.triu(same, diagonal=1).nonzero(as_tuple=True)
        rows_of: dict[int, list[int]] = {}
        for r, d in enumerate(doc_index.tolist()):
            rows_of.setdefault(d, []).append(r)
        self._rows_of_doc = sorted(rows_of.items())
        self._chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def in_order(self, chunk_rows: torch.Tensor) -> bool:
        """Whether a chunk is every row of the batch, in order (then indexing would only copy)."""
        return chunk_rows.numel() == self.n_rows and bool(
            (chunk_rows == torch.arange(self.n_rows, device=chunk_rows.device)).all())

    def doc_chunks(self, max_rows: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Whole documents grouped into chunks of at most ``max_rows`` rows (more only for
        one document that alone has more): (rows, chunk-local document of each row, documents)."""
        if max_rows not in self._chunks:
            device = self.row_doc.device
            chunks, rows, local, docs = [], [], [], []
            for d, doc_rows in self._rows_of_doc:
                if rows and len(rows) + len(doc_rows) > max_rows:
                    chunks.append((rows, local, docs))
                    rows, local, docs = [], [], []
                local += [len(docs)] * len(doc_rows)
                rows += doc_rows
                docs.append(d)
            if rows:
                chunks.append((rows, local, docs))
            self._chunks[max_rows] = [
                tuple(torch.tensor(v, dtype=torch.long, device=device) for v in c) for c in chunks
            ]
        return self._chunks[max_rows]


def _pad_by_row(ids: torch.Tensor, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For a token subset (flat ids b * N + n): (row, slot) of each token in a zero-padded
    (B, M, .) layout, M = most tokens any row has. Works for any order of ``ids``."""
    row = torch.div(ids, rows.seq_len, rounding_mode="floor")
    slot, m = _slots(row, rows.n_rows)
    return row, slot, m


def _slots(row: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, int]:
    """Slot of each token within its row (in the order given), and the most tokens any row has."""
    count = torch.bincount(row, minlength=n_rows)
    order = torch.argsort(row, stable=True)
    first = count.cumsum(0) - count
    slot = torch.empty_like(row)
    slot[order] = torch.arange(row.numel(), device=row.device) - first[row[order]]
    return slot, int(count.max()) if row.numel() else 0


# ----------------------------------------------------------------------------- norms
def _linear_sq_norms(
    a: torch.Tensor, g: torch.Tensor, rows: _Rows, weight: bool, bias: bool, method: Method,
    visit: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Per-document squared norms of sum_{t in d} g_t a_t^T (and of sum g_t); a, g are (B, M, .).

    When the weight gradients are materialised, ``visit(docs, per_doc)`` sees each chunk of
    them (raw: before the per-document rescaling), so an observer reuses them for free."""
    B, M, d_in = a.shape
    d_out = g.shape[-1]
    out = torch.zeros(rows.n_docs, dtype=torch.float64, device=a.device)
    if bias:
        per_doc = torch.zeros(rows.n_docs, d_out, dtype=g.dtype, device=g.device)
        out += per_doc.index_add_(0, rows.row_doc, g.sum(1)).pow(2).sum(1).double()
    if not weight:
        return out
    if method == "auto":
        n_pairs = B + rows.pair_left.numel()
        ghost_cost = n_pairs * M * M * (d_in + d_out)
        method = "ghost" if ghost_cost <= B * M * d_in * d_out else "materialise"

    if method == "ghost":
        # Diagonal blocks: each row with itself.
        step = max(1, _CHUNK_ELEMENTS // max(1, M * M))
        for i in range(0, B, step):
            ga = torch.bmm(a[i : i + step], a[i : i + step].mT)
            gg = torch.bmm(g[i : i + step], g[i : i + step].mT)
            out.index_add_(0, rows.row_doc[i : i + step], (ga * gg).sum((1, 2)).double())
        # Off-diagonal blocks between two rows of one document, twice by symmetry.
        for i in range(0, rows.pair_left.numel(), step):
            left, right = rows.pair_left[i : i + step], rows.pair_right[i : i + step]
            ga = torch.bmm(a[left], a[right].mT)
            gg = torch.bmm(g[left], g[right].mT)
            out.index_add_(0, rows.row_doc[left], 2 * (ga * gg).sum((1, 2)).double())
        return out

    # Whole documents per chunk, so that a document's rows are summed before squaring while
    # memory stays at a few (d_out, d_in) matrices per row of the chunk.
    for chunk_rows, local_doc, docs in rows.doc_chunks(max(1, _CHUNK_ELEMENTS // (d_in * d_out))):
        if rows.in_order(chunk_rows):  # the whole batch in row order: no gathered copies of a and g
            per_row = torch.bmm(g.mT, a)
        else:
            per_row = torch.bmm(g[chunk_rows].mT, a[chunk_rows])
        if len(docs) < len(chunk_rows):
            per_row = per_row.new_zeros(len(docs), d_out, d_in).index_add_(0, local_doc, per_row)
        out.index_add_(0, docs, per_row.pow(2).sum((1, 2)).double())
        if visit is not None:
            visit(docs, per_row)
    return out


def _embedding_sq_norms(module: nn.Embedding, tok: torch.Tensor, g: torch.Tensor, rows: _Rows,
                        vocab: tuple[int, int] | None = None) -> torch.Tensor:
    """``vocab``: (first, size) of the rows of the table this rank holds, if it holds a shard."""
    tok = tok.reshape(-1)
    g = g.reshape(tok.numel(), -1)
    doc = rows.row_doc.repeat_interleave(tok.numel() // rows.n_rows)
    if module.padding_idx is not None:  # that row of the table never receives gradient
        keep = tok != module.padding_idx
        tok, g, doc = tok[keep], g[keep], doc[keep]
    if vocab is not None:
        keep = (tok >= vocab[0]) & (tok < vocab[0] + vocab[1])
        tok, g, doc = tok[keep], g[keep], doc[keep]
    key = doc * module.num_embeddings + tok
    unique, inverse = torch.unique(key, return_inverse=True)
    per_key = torch.zeros(unique.numel(), g.shape[1], dtype=g.dtype, device=g.device)
    per_key.index_add_(0, inverse, g)
    out = torch.zeros(rows.n_docs, dtype=torch.float64, device=g.device)
    return out.index_add_(0, unique // module.num_embeddings, per_key.pow(2).sum(1).double())


def _rmsnorm_per_token(module: RMSNorm, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token weight gradient ``g_t * x_hat_t`` (B, N, dim), x_hat recomputed exactly as
    RMSNorm.forward does (fp32, then back to x's dtype)."""
    xf = x.float()
    x_hat = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).type_as(x)
    return g.to(dtype) * x_hat.to(dtype)


def _rmsnorm_sq_norms(per_token: torch.Tensor, rows: _Rows) -> torch.Tensor:
    per_row = per_token.reshape(rows.n_rows, -1, per_token.shape[-1]).sum(1)
    per_doc = per_row.new_zeros(rows.n_docs, per_row.shape[1])
    return per_doc.index_add_(0, rows.row_doc, per_row).pow(2).sum(1).double()


# ------------------------------------------------------------------ tensor parallel
@dataclass
class _Shard:
    """Which piece of a module's weight this rank holds when the model runs on DTensors (tensor
    parallel): the 1-D mesh, and the local block's shape and offset in the whole weight."""

    mesh: object  # DeviceMesh
    shape: tuple[int, ...] | None  # None: the weight is whole here (replicated or a plain tensor)
    offset: tuple[int, ...] | None

    @property
    def sharded(self) -> bool:
        return self.shape is not None

    @property
    def counted_here(self) -> bool:
        """A shard's squared norm is this rank's alone; a replicated weight's is the same on
        every rank, so only the mesh's first rank adds it."""
        return self.sharded or self.mesh.get_local_rank() == 0


def _shard_of(module: nn.Module, x, output) -> _Shard | None:
    """Read in the forward, when the weight is the one the kernel uses (FSDP2 has gathered its
    data-parallel shards; what is left is the tensor-parallel layout)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, DTensor):
        if weight.device_mesh.ndim != 1:
            raise RuntimeError("per-document ghost norms need each weight laid out on a 1-D (tensor-parallel) "
                               f"mesh in the forward, not {weight.device_mesh}")
        if not any(p.is_shard() for p in weight.placements):
            return _Shard(weight.device_mesh, None, None)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return _Shard(weight.device_mesh, tuple(shape), tuple(offset))
    for t in (x, output):
        if isinstance(t, DTensor):
            return _Shard(t.device_mesh, None, None)
    return None


def _features(t: torch.Tensor, offset: int | None, size: int | None) -> torch.Tensor:
    """The whole-batch activation's features ``[offset, offset + size)`` (all when None) as a
    plain tensor: a DTensor already split that way over the features is used as it is, anything
    else (split along the sequence, a partial sum) is gathered first."""
    if isinstance(t, DTensor):
        p = t.placements[0]
        local = t.to_local()
        if (size is not None and p.is_shard() and p.dim % t.ndim == t.ndim - 1 and local.shape[-1] == size
                and offset == t.device_mesh.get_local_rank() * size):
            return local
        t = t.full_tensor()
    if size is None or (offset == 0 and size == t.shape[-1]):
        return t
    return t[..., offset : offset + size]


# ------------------------------------------------------------------ expert parallel
class _EPDocuments:
    """The documents of every rank of an ep group under one numbering (rank by rank), and the
    squared norms this rank's experts add to any of them.

    Built before the forward on every rank of the group (also one without documents: its
    experts still serve the others'), so the collectives match."""

    def __init__(self, rows: _Rows, group: dist.ProcessGroup):
        self.group = group
        device = rows.row_doc.device
        mine = torch.tensor([rows.n_rows, rows.n_docs, rows.seq_len], dtype=torch.long, device=device)
        sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, mine, group=group)
        n_rows, n_docs, self.seq_len = torch.stack(sizes).unbind(1)
        padded = rows.row_doc.new_zeros(int(n_rows.max()))
        padded[: rows.n_rows] = rows.row_doc
        row_docs = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(row_docs, padded, group=group)
        first = n_docs.cumsum(0) - n_docs
        #: [source rank, source row] -> the row's document in the group's numbering.
        self.doc_of_row = torch.stack(row_docs) + first[:, None]
        self.n_docs = int(n_docs.sum())
        me = dist.get_rank(group)
        self.mine = slice(int(first[me]), int(first[me]) + rows.n_docs)
        self.sq_norms = torch.zeros(self.n_docs, dtype=torch.float64, device=device)

    def documents(self, source: torch.Tensor) -> torch.Tensor:
        """Group numbering of the document of each (source rank, flat position) row."""
        rank, position = source.unbind(1)
        return self.doc_of_row[rank, torch.div(position, self.seq_len[rank], rounding_mode="floor")]

    def add(self, a: torch.Tensor, g: torch.Tensor, source: torch.Tensor, weight: bool, bias: bool,
            method: Method) -> None:
        """Add an expert Linear's per-document squared norms; ``a``, ``g``: (rows, .) its input
        and output gradient, ``source``: where each row came from."""
        self.sq_norms += _expert_sq_norms(a, g, self.documents(source), self.n_docs, weight, bias, method)

    def mine_summed(self) -> torch.Tensor:
        """After the backward: this rank's documents' squared norms from every expert of the group."""
        dist.all_reduce(self.sq_norms, group=self.group)
        return self.sq_norms[self.mine]


def _expert_sq_norms(a: torch.Tensor, g: torch.Tensor, docs: torch.Tensor, n_docs: int, weight: bool, bias: bool,
                     method: Method) -> torch.Tensor:
    """(n_docs,) squared norms of an expert Linear's per-document gradients, from its token rows
    ``a``, ``g`` (rows, .) and each row's document ``docs``."""
    present, group = torch.unique(docs, return_inverse=True)
    slot, m = _slots(group, present.numel())
    # One "row" per document present, holding all its tokens: the same formulas as by rows.
    rows = _Rows(present, n_docs, m)
    a = a.new_zeros(present.numel(), m, a.shape[1]).index_put_((group, slot), a)
    g = g.new_zeros(present.numel(), m, g.shape[1]).index_put_((group, slot), g)
    return _linear_sq_norms(a, g, rows, weight, bias, method)


def _ep_group(model: nn.Module) -> dist.ProcessGroup | None:
    groups = {m.experts.group for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, LocalExperts)}
    if len(groups) > 1:
        raise RuntimeError("per-document ghost norms: MoE layers expert-parallel over different groups")
    return groups.pop() if groups else None


# ------------------------------------------------------------------ context parallel
def _context_sq_norms(layer: LayerGrad, rows: _Rows, group: dist.ProcessGroup) -> torch.Tensor:
    """Context parallel: every rank holds some positions of every row (the same rows, documents
    and layers on each), so a document's gradient is the sum over the group of each rank's part,
    and its norm is not a sum of the ranks' norms. Each part is a per-document sum of per-token
    terms, so the parts are added with an all-reduce and squared after: a Linear's weight part
    materialised per document (``(d_out, d_in)`` each, in chunks of documents; the ghost form's
    cross terms would need the other ranks' activations), an RMSNorm's and a bias's vectors. An
    embedding's part is sparse (its rows by token), so its token ids and output gradients are
    gathered instead (one activation's worth). Every rank ends with the same squared norms.

    The hooks fire in the same order on every rank (an expert routed anywhere in the group runs on
    every rank, on no rows where this rank has none: ``data_parallel.join_experts_routed_in_group``),
    so the collectives pair up."""
    module = layer.module
    if layer.kind == "embedding":
        return _embedding_sq_norms(module, _gather_positions(layer.x, group), _gather_positions(layer.g, group), rows)
    if layer.kind == "rmsnorm":
        return _summed_squares(_per_document(layer.g.sum(1), rows), group)
    a, g = layer.x, layer.g
    out = torch.zeros(rows.n_docs, dtype=torch.float64, device=g.device)
    if module.bias is not None and module.bias.requires_grad:
        out += _summed_squares(_per_document(g.sum(1), rows), group)
    if module.weight.requires_grad:
        d_in, d_out = a.shape[-1], g.shape[-1]
        for chunk_rows, local_doc, docs in rows.doc_chunks(max(1, _CHUNK_ELEMENTS // (d_in * d_out))):
            per_row = torch.bmm(g[chunk_rows].mT, a[chunk_rows])
            per_doc = per_row.new_zeros(len(docs), d_out, d_in).index_add_(0, local_doc, per_row)
            dist.all_reduce(per_doc, group=group)
            out.index_add_(0, docs, per_doc.pow(2).sum((1, 2)).double())
    return out


def _per_document(per_row: torch.Tensor, rows: _Rows) -> torch.Tensor:
    return per_row.new_zeros(rows.n_docs, per_row.shape[1]).index_add_(0, rows.row_doc, per_row)


def _summed_squares(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(n_docs, k) parts summed over the group, then each document's squared norm."""
    dist.all_reduce(part, group=group)
    return part.pow(2).sum(1).double()


def _gather_positions(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(rows, n, ...) from every rank of the group, laid side by side: (rows, n·cp, ...)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 1)


# ----------------------------------------------------------------------------- hooks
@dataclass
class _Plan:
    kinds: dict[nn.Module, str]  # module -> "linear" | "embedding" | "rmsnorm"
    expert_of: dict[nn.Module, tuple[MoE, int]]  # Linear inside an MoE expert -> (moe, e; local e under ep)
    unsupported: list[str]


def _plan(model: nn.Module) -> _Plan:
    expert_of: dict[nn.Module, tuple[MoE, int]] = {}
    for moe in model.modules():
        if isinstance(moe, MoE):
            for e, expert in enumerate(moe.experts):
                for m in expert.modules():
                    expert_of[m] = (moe, e)
    kinds: dict[nn.Module, str] = {}
    unsupported: list[str] = []
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        for p in params:
            if id(p) in owner:  # its two gradients would interfere: cross terms we don't track
                unsupported.append(f"{name} (parameter shared with {owner[id(p)]})")
            owner[id(p)] = name
        if isinstance(module, nn.Linear):  # subclasses too (e.g. Float8Linear)
            kinds[module] = "linear"
        elif isinstance(module, nn.Embedding) and not module.scale_grad_by_freq:
            kinds[module] = "embedding"
        elif isinstance(module, RMSNorm):
            kinds[module] = "rmsnorm"
        else:
            unsupported.append(f"{name} ({type(module).__name__})")
    return _Plan(kinds, expert_of, unsupported)


@dataclass
class LayerGrad:
    """What the backward hook of one module sees, in the layout every per-document formula uses.

    ``linear``: ``x`` the input as the kernel saw it and ``g`` the output gradient, both
    ``(B, M, .)`` by row (``M = N``, or an MoE expert's zero-padded tokens per row);
    ``embedding``: ``x`` the token ids and ``g`` the output gradient; ``rmsnorm``: ``x`` None
    and ``g`` the per-token weight gradient ``g_t * x_hat_t``. ``g`` is the gradient of the
    batch loss as the backward computed it (before the per-document rescaling)."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "rmsnorm"
    x: torch.Tensor | None
    g: torch.Tensor
    #: True once an observer's ``doc_weight_grads(layer, docs, per_doc)`` has seen this Linear's
    #: materialised per-document weight gradients (observers are called after the norms).
    weight_grads_visited: bool = False


#: Called in the backward with every supported layer's LayerGrad and the batch's row layout
#: (training.alignment accumulates per-document gradient dot products this way). An observer
#: may also define ``doc_weight_grads(layer, docs, per_doc)``: it then sees the per-document
#: weight gradients of a Linear whose norms materialise them, chunk by chunk, before its call.
LayerObserver = Callable[[LayerGrad, "_Rows"], None]


class _GhostNorms:
    """Forward hooks that save inputs; output tensor hooks that turn g into squared norms."""

    def __init__(self, plan: _Plan, rows: _Rows, method: Method, observers: Sequence[LayerObserver] = ()):
        self.plan, self.rows, self.method = plan, rows, method
        self.observers = tuple(observers)
        self.sq_norms = torch.zeros(rows.n_docs, dtype=torch.float64, device=rows.row_doc.device)
        self.called: set[nn.Module] = set()
        self.capturing = True  # False after the forward: recomputation (checkpointing) is ignored
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.outputs: list[torch.Tensor] = []  # hooked outputs: the backward's targets without weight gradients
        #: Tensor parallel: the mesh whose ranks each hold part of ``sq_norms`` (summed after the backward).
        self.mesh = None
        #: Expert parallel: the norms this rank's experts add to the ep group's documents.
        self.ep_docs: _EPDocuments | None = None
        #: Context parallel: the group whose ranks hold the other positions of these rows.
        self.context: dist.ProcessGroup | None = None

    def _forward_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self.capturing:
            return
        if module in self.called:
            raise RuntimeError(
                f"{type(module).__name__} ran twice in one forward; per-document ghost norms "
                "need each parameterised module to run once (use the reference instead)"
            )
        self.called.add(module)
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return
        dispatch = None
        if module in self.plan.expert_of:
            moe, e = self.plan.expert_of[module]
            if self.ep_docs is not None:
                if self.observers:
                    raise RuntimeError("per-layer observers do not support expert-parallel layers")
                dispatch = (moe.ep_dispatch, e)
            elif moe.last_dispatch is None:
                raise RuntimeError("MoE.last_dispatch missing: cannot map expert tokens to rows")
            else:
                dispatch = (moe.last_dispatch, e)
        elif args[0].numel() // max(1, _width(module, args[0])) != self.rows.n_rows * self.rows.seq_len:
            raise RuntimeError(
                f"{type(module).__name__} input {tuple(args[0].shape)} does not hold one entry per "
                f"batch position ({self.rows.n_rows} x {self.rows.seq_len})"
            )
        saved = {"x": args[0], "out_dtype": output.dtype, "dispatch": dispatch,
                 "shard": _shard_of(module, args[0], output)}
        if saved["shard"] is not None and self.observers:
            raise RuntimeError("per-layer observers do not support tensor-parallel (DTensor) layers")
        self.outputs.append(output)
        self.handles.append(output.register_hook(lambda g: self._on_grad(module, saved, g)))

    def _on_grad(self, module: nn.Module, saved: dict, g: torch.Tensor) -> None:
        # Hooks run inside the backward: no graph, and no autocast from the caller's context.
        with torch.no_grad(), torch.autocast(g.device.type, enabled=False):
            if saved["dispatch"] is not None and isinstance(saved["dispatch"][0], EPDispatch):
                self._on_expert_grad(module, saved, g)
                saved.clear()
                return
            layer = self._layer(module, saved, g)
            self._add(layer, saved["shard"])
            for observe in self.observers:
                observe(layer, self.rows)
        saved.clear()  # free the input now rather than at the end of the step

    def _add(self, layer: LayerGrad, shard: _Shard | None, rows: _Rows | None = None) -> None:
        """Add a layer's per-document squared norms (of this rank's shard, under tp); ``rows``: the
        layout of ``layer``'s rows when they are not the whole batch's."""
        rows = rows or self.rows
        if self.context is not None:
            self.sq_norms += _context_sq_norms(layer, rows, self.context)
        elif shard is None:
            self.sq_norms += self._sq_norms(layer, rows=rows)
        else:
            self.mesh = shard.mesh
            if shard.counted_here:
                self.sq_norms += self._sq_norms(layer, shard, rows)

    def _on_expert_grad(self, module: nn.Module, saved: dict, g: torch.Tensor) -> None:
        """Expert parallel: this expert's rows may come from any rank of the ep group."""
        a, g, source = _expert_operands(saved, g)
        bias = module.bias is not None and module.bias.requires_grad
        self.ep_docs.add(a, g, source, module.weight.requires_grad, bias, self.method)

    def _layer(self, module: nn.Module, saved: dict, g: torch.Tensor) -> LayerGrad:
        x, rows = saved["x"], self.rows
        dtype = torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32
        kind = self.plan.kinds[module]
        if saved["shard"] is not None:
            x, g = _shard_operands(kind, x, g, saved["shard"])
        if kind == "embedding":
            return LayerGrad(module, kind, x, g.to(dtype))
        if kind == "rmsnorm":
            return LayerGrad(module, kind, None, _rmsnorm_per_token(module, x, g, dtype))
        # Linear: the weight gradient is built from the input as the layer's kernel saw it
        # (autocast casts it to the output dtype), accumulated in fp32.
        a = x.to(saved["out_dtype"]).to(dtype).reshape(-1, x.shape[-1])
        g = g.to(dtype).reshape(-1, g.shape[-1])
        if saved["dispatch"] is None:
            a = a.view(rows.n_rows, rows.seq_len, -1)
            g = g.view(rows.n_rows, rows.seq_len, -1)
        else:
            (token_ids, counts), e = saved["dispatch"]
            start = int(counts[:e].sum())
            ids = token_ids[start : start + a.shape[0]]
            row, slot, m = _pad_by_row(ids, rows)
            a = a.new_zeros(rows.n_rows, m, a.shape[1]).index_put_((row, slot), a)
            g = g.new_zeros(rows.n_rows, m, g.shape[1]).index_put_((row, slot), g)
        return LayerGrad(module, kind, a, g)

    def _sq_norms(self, layer: LayerGrad, shard: _Shard | None = None, rows: _Rows | None = None) -> torch.Tensor:
        module, rows = layer.module, rows or self.rows
        if layer.kind == "embedding":
            vocab = (shard.offset[0], shard.shape[0]) if shard is not None and shard.sharded else None
            return _embedding_sq_norms(module, layer.x, layer.g, rows, vocab)
        if layer.kind == "rmsnorm":
            return _rmsnorm_sq_norms(layer.g, rows)
        weight = module.weight.requires_grad
        bias = module.bias is not None and module.bias.requires_grad
        visitors = [o.doc_weight_grads for o in self.observers if hasattr(o, "doc_weight_grads")]

        def visit(docs: torch.Tensor, per_doc: torch.Tensor) -> None:
            layer.weight_grads_visited = True
            for v in visitors:
                v(layer, docs, per_doc)

        return _linear_sq_norms(layer.x, layer.g, rows, weight, bias, self.method, visit if visitors else None)


def _expert_operands(saved: dict, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert-parallel expert Linear's (input as its kernel saw it, output gradient), one row per
    token it ran, and each row's source (ep rank, flat position)."""
    x = saved["x"]
    dtype = torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32
    a = x.to(saved["out_dtype"]).to(dtype).reshape(-1, x.shape[-1])
    g = g.to(dtype).reshape(-1, g.shape[-1])
    record, e = saved["dispatch"]
    start = int(record.counts[:e].sum())
    return a, g, record.source[start : start + a.shape[0]]


def _shard_operands(kind: str, x, g, shard: _Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain whole-batch operands for the gradient of this rank's block of the weight: a Linear's
    ``W[o:o+m, i:i+n]`` gets ``g[..., o:o+m]`` and ``x[..., i:i+n]``; an embedding's rows
    ``[v, v+m)`` (filtered by token later) and columns ``[c, c+n)`` get ``g[..., c:c+n]``; an RMSNorm's
    ``x`` stays whole (its rsqrt needs every feature), ``g`` is cut like its weight."""
    shape, offset = shard.shape, shard.offset
    if kind == "linear":
        return (_features(x, offset and offset[1], shape and shape[1]),
                _features(g, offset and offset[0], shape and shape[0]))
    if kind == "embedding":
        return _features(x, None, None), _features(g, offset and offset[1], shape and shape[1])
    if shard.sharded and shape[0] != g.shape[-1]:
        raise RuntimeError("per-document ghost norms: a feature-sharded RMSNorm weight is not supported")
    return _features(x, None, None), _features(g, None, None)


def _width(module: nn.Module, x: torch.Tensor) -> int:
    """Features per position of a module input (1 for an embedding's token ids)."""
    return 1 if isinstance(module, nn.Embedding) else x.shape[-1]


@contextmanager
def _ghost_norm_hooks(
    plan: _Plan, rows: _Rows, method: Method, observers: Sequence[LayerObserver] = ()
) -> Iterator[_GhostNorms]:
    ghost = _GhostNorms(plan, rows, method, observers)
    # prepend: under tensor parallelism, see the module's own DTensor output (its layout says which
    # shard of the gradient this rank holds), before the plan's hook redistributes it.
    ghost.handles.extend(m.register_forward_hook(ghost._forward_hook, prepend=True) for m in plan.kinds)
    try:
        yield ghost
    finally:
        for h in ghost.handles:
            h.remove()
        ghost.handles.clear()


# ------------------------------------------------------------------ pipeline parallel
class _MicroBatchGhost(_GhostNorms):
    """One micro-batch's hooks: the usual norms of its whole documents' rows, and the rows of the
    step's split documents (rows in more than one micro-batch) set aside for :class:`MicroBatchNorms`,
    which measures them once, together. Filler rows (the last document slot) are not measured."""

    def __init__(self, plan: _Plan, rows: _Rows, method: Method, split_rows: torch.Tensor, split: "_SplitRows",
                 context: dist.ProcessGroup | None):
        super().__init__(plan, rows, method)
        self.split_rows, self.split, self.context = split_rows, split, context
        measured = rows.row_doc < rows.n_docs - 1
        measured[split_rows] = False
        #: The rows whose norms this micro-batch adds, and their layout; None: every row.
        self.measured_rows: torch.Tensor | None = None
        if not bool(measured.all()):
            self.measured_rows = torch.nonzero(measured).squeeze(1)
            self.measured = _Rows(rows.row_doc[self.measured_rows], rows.n_docs, rows.seq_len)

    def _add_measured(self, layer: LayerGrad, shard: _Shard | None) -> None:
        if self.measured_rows is None:
            self._add(layer, shard)
            return
        if shard is not None:
            self.mesh = shard.mesh  # the squares kept for later are this rank's shard's too
        if self.measured_rows.numel():  # the same on every cp rank (they hold the same rows)
            idx = self.measured_rows
            part = LayerGrad(layer.module, layer.kind, None if layer.x is None else layer.x[idx], layer.g[idx])
            self._add(part, shard, self.measured)

    def _on_grad(self, module: nn.Module, saved: dict, g: torch.Tensor) -> None:
        if not saved:
            # A zero-bubble schedule's weight pass may run the node again: its g was seen already.
            return
        with torch.no_grad(), torch.autocast(g.device.type, enabled=False):
            if saved["dispatch"] is not None and isinstance(saved["dispatch"][0], EPDispatch):
                self._on_ep_expert_grad(module, saved, g)
                saved.clear()
                return
            layer = self._layer(module, saved, g)
            self._add_measured(layer, saved["shard"])
            if self.split_rows.numel():
                self.split.keep(layer, self.rows.row_doc, self.split_rows, saved["shard"])
        saved.clear()

    def _on_ep_expert_grad(self, module: nn.Module, saved: dict, g: torch.Tensor) -> None:
        """Expert parallel: rows from the ep group's micro-batches, documents in the group's numbering
        (the same in every micro-batch of the step); split documents' rows are kept as well."""
        a, g, source = _expert_operands(saved, g)
        docs = self.ep_docs.documents(source)
        weight, bias = module.weight.requires_grad, module.bias is not None and module.bias.requires_grad
        kept = self.split.split_in_group[docs]
        if kept.any():
            self.split.experts.setdefault(module, []).append((a[kept], g[kept], docs[kept]))
            a, g, docs = a[~kept], g[~kept], docs[~kept]
        self.ep_docs.sq_norms += _expert_sq_norms(a, g, docs, self.ep_docs.n_docs, weight, bias, self.method)


class _SplitRows:
    """Every layer's operands on the rows of split documents, kept until the step's last
    backward: a document's squared norm has cross terms between its rows, which only the
    whole set of its rows gives. Memory: those rows' activations and output gradients (under
    tp, of this rank's shard)."""

    def __init__(self, n_docs: int):
        self.n_docs = n_docs
        self.layers: dict[nn.Module, list[tuple[LayerGrad, torch.Tensor]]] = {}
        self.shards: dict[nn.Module, _Shard | None] = {}
        #: Expert parallel: each of this rank's experts' rows of split documents (a, g, document in the
        #: ep group's numbering), and which documents of that numbering are split.
        self.experts: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.split_in_group: torch.Tensor | None = None

    def keep(self, layer: LayerGrad, row_doc: torch.Tensor, rows: torch.Tensor, shard: _Shard | None) -> None:
        if layer.kind == "rmsnorm":  # its norm needs only each row's summed per-token gradient
            part = LayerGrad(layer.module, layer.kind, None, layer.g[rows].sum(1, keepdim=True))
        else:
            part = LayerGrad(layer.module, layer.kind, layer.x[rows], layer.g[rows])
        self.layers.setdefault(layer.module, []).append((part, row_doc[rows]))
        self.shards[layer.module] = shard

    def sq_norms(self, plan: _Plan, method: Method, context: dist.ProcessGroup | None) -> torch.Tensor | None:
        """Every kept document's squared norms over the layers (this rank's shards under tp; summed
        over cp), from all its rows at once: the same formulas as one batch of those rows. Called on
        every rank in the same layer order (cp and tp ranks run the same layers on the same rows)."""
        out = None
        for module, parts in self.layers.items():
            kind = parts[0][0].kind
            docs = torch.cat([d for _, d in parts])
            # Rows of other passes may be narrower (trimmed) or hold fewer expert tokens: zero
            # padding adds nothing to any form.
            width = max(p.g.shape[1] for p, _ in parts)
            x = None if kind == "rmsnorm" else torch.cat([_pad_positions(p.x, width) for p, _ in parts])
            g = torch.cat([_pad_positions(p.g, width) for p, _ in parts])
            ghost = _GhostNorms(plan, _Rows(docs, self.n_docs, width), method)
            ghost.context = context
            ghost._add(LayerGrad(module, kind, x, g), self.shards[module])
            out = ghost.sq_norms if out is None else out + ghost.sq_norms
        return out

    def expert_sq_norms(self, n_docs: int, method: Method) -> torch.Tensor | None:
        """Expert parallel: what this rank's experts add to the split documents (the ep group's numbering)."""
        out = None
        for module, parts in self.experts.items():
            a, g, docs = (torch.cat(t) for t in zip(*parts))
            bias = module.bias is not None and module.bias.requires_grad
            norms = _expert_sq_norms(a, g, docs, n_docs, module.weight.requires_grad, bias, method)
            out = norms if out is None else out + norms
        return out


def _gathered_flags(flags: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``flags`` (of its own length) laid end to end, rank by rank."""
    sizes = [torch.zeros(1, dtype=torch.long, device=flags.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([flags.numel()], device=flags.device), group=group)
    padded = torch.zeros(int(max(sizes)), dtype=torch.long, device=flags.device)
    padded[: flags.numel()] = flags.long()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(n)] for p, n in zip(parts, sizes)]).bool()


def _pad_positions(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_zeros(t.shape[0], width - t.shape[1], *t.shape[2:])
    return torch.cat([t, pad], 1)


class MicroBatchNorms:
    """Per-document squared gradient norms of this rank's layers when a pipeline schedule runs
    the step's rows as micro-batches (training.parallel.pipeline), unscaled.

    Why it is exact: each parameter lives on one stage, so a document's squared norm is the sum
    of the stages' (all-reduced over the pp group by the caller). Within a stage a micro-batch is
    a batch of its own for the hooks (its rows, its width); a document whose rows fall in several
    micro-batches would lose the cross terms between them, so those rows are kept
    (:class:`_SplitRows`) and measured together after the step's last backward. The schedule may
    run forwards and backwards of different micro-batches in any order: each forward's hooks
    belong to the micro-batch being forwarded (``forward_of``), and its output hooks write there.

    Under tp each rank adds its shards' squares (as one batch does) and the result is summed over the
    tp mesh here; under cp (``context``) each layer's per-document parts are summed over the cp
    ranks before squaring, and every cp rank returns the same whole-row result.

    The caller scales the result as the batch loss it backpropagated asks: a micro-batch's loss is
    its token-loss sum over a step-wide count ``c``, so ``||grad L_d||^2 = sq * (c / (s * N_d))^2``
    for a loss scale ``s`` (``N_d``: the whole rows' target tokens). Filler rows (``doc`` -1)
    belong to no document."""

    def __init__(self, model: nn.Module, doc_index: torch.Tensor, n_docs: int,
                 microbatches: Sequence[Sequence[torch.Tensor]], method: Method = "auto",
                 context: dist.ProcessGroup | None = None):
        """``microbatches``: for each pass of the step, each micro-batch's rows of the batch (-1 filler);
        ``context``: the cp group whose ranks hold the other positions of these rows."""
        self.plan = _plan(model)
        if self.plan.unsupported:
            raise ValueError("per-document norms under pp cannot attribute the gradient of "
                             + ", ".join(self.plan.unsupported))
        self.n_docs, self.method, self.context = n_docs, method, context
        self.doc_index = doc_index
        # Slot n_docs collects the filler rows, which no document owns.
        in_microbatches = torch.zeros(n_docs + 1, dtype=torch.long, device=doc_index.device)
        for mbs in microbatches:
            for rows in mbs:
                in_microbatches[torch.unique(self._docs(rows))] += 1
        self.split = in_microbatches > 1
        self.split[n_docs] = False
        self.kept = _SplitRows(n_docs + 1)
        self.ep_group = _ep_group(model)
        if self.ep_group is not None:
            self.kept.split_in_group = _gathered_flags(self.split, self.ep_group)
        self.current: _MicroBatchGhost | None = None
        # prepend: under tp, see each module's own DTensor output before the plan's hook makes it local.
        self.handles = [m.register_forward_hook(self._forward_hook, prepend=True) for m in self.plan.kinds]
        self._passes: list[list[_MicroBatchGhost]] = []

    def _docs(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.doc_index.device)
        return torch.where(rows >= 0, self.doc_index[rows.clamp_min(0)], self.n_docs)

    def start_pass(self, microbatches: Sequence[torch.Tensor], width: int) -> None:
        """The next pass's micro-batches (their rows of the batch, -1 filler), all ``width`` wide."""
        ghosts = []
        for rows in microbatches:
            docs = self._docs(rows)
            ghost = _MicroBatchGhost(self.plan, _Rows(docs, self.n_docs + 1, width), self.method,
                                     torch.nonzero(self.split[docs]).squeeze(1), self.kept, self.context)
            if self.ep_group is not None:
                # Collectives of the ep group (the stage's ranks, which run the same passes): before
                # the schedule, not inside it. Every micro-batch numbers the group's documents alike.
                ghost.ep_docs = _EPDocuments(ghost.rows, self.ep_group)
            ghosts.append(ghost)
        self._passes.append(ghosts)

    @contextmanager
    def forward_of(self, chunk: int) -> Iterator[None]:
        """The forwards inside belong to micro-batch ``chunk`` of the current pass."""
        self.current = self._passes[-1][chunk]
        try:
            yield
        finally:
            self.current = None  # recomputation in a backward (checkpointing) is not captured

    def _forward_hook(self, module: nn.Module, args: tuple, output) -> None:
        if self.current is not None:
            self.current._forward_hook(module, args, output)

    def finish(self) -> torch.Tensor:
        """After the step's last backward: (n_docs,) float64 squared norms over this rank's layers."""
        self.close()
        total = self.split.new_zeros(self.n_docs + 1, dtype=torch.float64)
        meshes = set()
        for ghosts in self._passes:
            for ghost in ghosts:
                total += ghost.sq_norms
                meshes.add(ghost.mesh)
        kept = self.kept.sq_norms(self.plan, self.method, self.context)
        if kept is not None:  # split documents: measured whole (the micro-batches left them out)
            total += kept
        meshes.discard(None)
        if meshes:  # tensor parallel: each rank added the squares of its shards
            (mesh,) = meshes
            dist.all_reduce(total, group=mesh.get_group())
        if self.ep_group is not None:  # expert parallel: this rank's experts' part of the group's documents
            ep = [ghost.ep_docs for ghosts in self._passes for ghost in ghosts]
            experts = sum(e.sq_norms for e in ep)
            kept = self.kept.expert_sq_norms(ep[0].n_docs, self.method)
            if kept is not None:
                experts = experts + kept
            dist.all_reduce(experts, group=self.ep_group)
            total = total + experts[ep[0].mine]
        self._passes.clear()
        self.kept.layers.clear()
        self.kept.shards.clear()
        self.kept.experts.clear()
        return total[: self.n_docs]

    def close(self) -> None:
        """Remove the hooks (``finish`` does; for a step that failed before it)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


# ----------------------------------------------------------------------------- public API
def per_document_loss_and_grad_norm(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_index: torch.Tensor,
    n_docs: int,
    *,
    loss_scale: float = 1.0,
    method: Method = "auto",
    observers: Sequence[LayerObserver] = (),
    weight_grads: bool = True,
    context: dist.ProcessGroup | None = None,
) -> DocumentStats:
    """One forward and one backward of the batch loss, plus every document's loss and
    ``||grad L_d||``.

    Populates ``.grad`` exactly as ``(loss * loss_scale).backward()`` would (accumulating
    into existing ``.grad`` like it), so the caller steps the optimizer afterwards. Run it
    inside ``torch.autocast`` if the step uses autocast. ``method`` forces the Linear norm
    algorithm (``"ghost"`` / ``"materialise"``); ``"auto"`` picks the cheaper per layer.
    Reported losses and norms do not include ``loss_scale``. ``observers`` are called in the
    backward with each layer's :class:`LayerGrad` (they need the ghost path: a model this
    module cannot attribute raises ``ValueError`` instead of falling back).
    ``weight_grads=False`` leaves ``.grad`` alone and skips the weight-gradient products (about
    a third of a backward): the per-document quantities need only the activation gradients.

    ``context``: the context-parallel group, whose ranks hold the other positions of these rows
    (training.parallel.context_parallel). Each rank then passes its own positions, and its
    ``loss_scale`` makes ``loss_scale / its target tokens`` the same on every rank (0 on a rank
    without target tokens, which still runs: its keys serve the others' attention). The norms are
    the whole documents', the same on every rank; the losses and tokens stay this rank's part.
    """
    _check_batch(tokens, targets, loss_mask, doc_index, n_docs)
    if loss_scale < 0 or (loss_scale == 0 and context is None):
        raise ValueError("loss_scale must be > 0")
    mask = loss_mask.bool()
    doc_tokens = _doc_tokens(mask, doc_index, n_docs)
    n_total = int(doc_tokens.sum())
    ep_group = _ep_group(model)
    if n_total == 0 and ep_group is None and context is None:
        # Under ep a rank without target tokens still runs: its experts serve the group's documents.
        raise ValueError("the batch has no unmasked token")
    if context is not None and (observers or ep_group is not None):
        raise ValueError("per-document norms under cp take no per-layer observers and no expert parallelism")

    plan = _plan(model)
    if plan.unsupported and (observers or context is not None):
        raise ValueError("per-layer observers and cp need ghost norms, which cannot attribute the gradient of "
                         + ", ".join(plan.unsupported))
    if plan.unsupported:
        warnings.warn(
            "per-document ghost norms cannot attribute the gradient of "
            + ", ".join(plan.unsupported)
            + "; using the per-document reference loop",
            stacklevel=2,
        )
        stats = per_document_grad_norms_reference(model, tokens, targets, loss_mask, doc_index, n_docs)
        loss = token_losses(model(tokens), targets, mask).sum() / n_total
        if weight_grads:
            (loss * loss_scale).backward()
        stats.batch_loss = loss.detach()
        return stats

    rows = _Rows(doc_index, n_docs, tokens.shape[1])
    with _ghost_norm_hooks(plan, rows, method, observers) as ghost:
        if ep_group is not None:
            ghost.ep_docs = _EPDocuments(rows, ep_group)
        ghost.context = context
        logits = model(tokens)
        ghost.capturing = False
        token_loss = token_losses(logits, targets, mask)
        loss = token_loss.sum() / max(n_total, 1)  # no target token (ep only): loss and gradients 0
        if weight_grads:
            (loss * loss_scale).backward()
        else:
            # Asking for the hooked outputs' gradients only prunes every weight-gradient product.
            torch.autograd.grad(loss * loss_scale, ghost.outputs, allow_unused=True)
    sq_norms = ghost.sq_norms
    if ghost.mesh is not None:  # tensor parallel: each rank added the squared norms of its shards
        dist.all_reduce(sq_norms, group=ghost.mesh.get_group())
    if ghost.ep_docs is not None:  # expert parallel: the experts' part came from the ranks holding them
        sq_norms = sq_norms + ghost.ep_docs.mine_summed()

    doc_loss_sum = torch.zeros(n_docs, dtype=torch.float64, device=tokens.device)
    doc_loss_sum.index_add_(0, doc_index, token_loss.detach().sum(1).double())
    n_d = doc_tokens.double()
    token_scale = torch.tensor(loss_scale / max(n_total, 1), dtype=torch.float64, device=tokens.device)
    whole_doc_tokens = doc_tokens
    if context is not None:  # the whole rows': a rank without target tokens learns the scale from the others
        dist.all_reduce(token_scale, op=dist.ReduceOp.MAX, group=context)
        whole_doc_tokens = doc_tokens.clone()
        dist.all_reduce(whole_doc_tokens, group=context)
    # The backward ran on token_scale · (sum of token losses): g_t -> dL_d/dz_t (inf for empty documents ...)
    scale = 1 / (token_scale * whole_doc_tokens.double())
    grad_norm = (sq_norms * scale**2).sqrt()
    empty = whole_doc_tokens == 0  # ... which have no loss, hence no gradient: report NaN
    # cp: a document without target tokens on this rank has 0 here (its part of the group's sum).
    doc_mean = doc_loss_sum / n_d.clamp_min(1) if context is not None else doc_loss_sum / n_d
    return DocumentStats(
        loss=doc_mean.masked_fill(empty, float("nan")),
        grad_norm=grad_norm.masked_fill(empty, float("nan")),
        tokens=doc_tokens,
        batch_loss=loss.detach(),
    )


@contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Undo forward side effects (MoE load counters, last-forward records) of extra forwards."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    records = [
        (m, name, getattr(m, name))
        for m in model.modules()
        if isinstance(m, MoE)
        for name in ("last_tokens_per_expert", "last_dispatch")
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, name, value in records:
            setattr(m, name, value)


def per_document_grad_norms_reference(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_index: torch.Tensor,
    n_docs: int,
) -> DocumentStats:
    """Exact per-document losses and norms by brute force: one forward of the batch, then
    for each document ``torch.autograd.grad`` of its own ``L_d``. Leaves ``.grad`` and the
    model's buffers as they were. Costs ``n_docs`` extra backward passes.

    The whole batch, not each document's rows alone, goes through the model: this is the
    definition of ``grad L_d`` on this batch, so if rows did interact (which the ghost
    method assumes they don't) the two would disagree instead of both being wrong, and MoE
    routing is the very same as in the training forward."""
    _check_batch(tokens, targets, loss_mask, doc_index, n_docs)
    mask = loss_mask.bool()
    doc_tokens = _doc_tokens(mask, doc_index, n_docs)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.full((n_docs,), float("nan"), dtype=torch.float64, device=tokens.device)
    grad_norm = loss.clone()
    with _preserved_state(model):
        token_loss = token_losses(model(tokens), targets, mask)
        docs = [d for d in range(n_docs) if doc_tokens[d] > 0]
        for i, d in enumerate(docs):
            loss_d = token_loss[doc_index == d].sum() / doc_tokens[d]
            grads = torch.autograd.grad(loss_d, params, allow_unused=True, retain_graph=i + 1 < len(docs))
            grad_norm[d] = sum(g.double().pow(2).sum() for g in grads if g is not None) ** 0.5
            loss[d] = loss_d.detach().double()
    n_d = doc_tokens.double()
    batch_loss = (loss.nan_to_num() * n_d).sum() / n_d.sum()
    return DocumentStats(loss=loss, grad_norm=grad_norm, tokens=doc_tokens, batch_loss=batch_loss)


def per_document_grad_norms_functional(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_index: torch.Tensor,
    n_docs: int,
) -> DocumentStats:
    """``torch.func`` variant: ``vmap(grad)`` over rows, row gradients summed per document.

    Materialises one full gradient per row (memory ``B x parameters``), so it suits small
    models only, and ``vmap`` rejects data-dependent control flow, so no MoE. Leaves
    ``.grad`` untouched.
    """
    from torch.func import functional_call, grad_and_value, vmap

    _check_batch(tokens, targets, loss_mask, doc_index, n_docs)
    if any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError("vmap cannot trace the MoE dispatch; use per_document_loss_and_grad_norm")
    mask = loss_mask.bool()
    doc_tokens = _doc_tokens(mask, doc_index, n_docs)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def row_loss_sum(params, tok, tgt, m):
        logits = functional_call(model, (params, frozen, buffers), (tok[None],))[0]
        # Masking by multiplication: ignore_index would need a data-dependent count.
        ce = F.cross_entropy(logits, tgt.clamp_min(0), reduction="none")
        return (ce * m).sum()

    grads, loss_sums = vmap(grad_and_value(row_loss_sum), in_dims=(None, 0, 0, 0))(
        params, tokens, targets.masked_fill(~mask, 0), mask.to(tokens.device, torch.float32)
    )
    n_d = doc_tokens.double()
    sq = torch.zeros(n_docs, dtype=torch.float64, device=tokens.device)
    for g in grads.values():
        per_doc = torch.zeros(n_docs, *g.shape[1:], dtype=g.dtype, device=g.device)
        sq += per_doc.index_add_(0, doc_index, g).pow(2).flatten(1).sum(1).double()
    loss_sum = torch.zeros(n_docs, dtype=torch.float64, device=tokens.device)
    loss_sum.index_add_(0, doc_index, loss_sums.double())
    empty = doc_tokens == 0
    return DocumentStats(
        loss=(loss_sum / n_d).masked_fill(empty, float("nan")),
        grad_norm=(sq.sqrt() / n_d).masked_fill(empty, float("nan")),
        tokens=doc_tokens,
        batch_loss=loss_sum.sum() / n_d.sum(),
    )
