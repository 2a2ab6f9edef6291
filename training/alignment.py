"""Per-document gradient alignment: ``grad L_d · G`` and its cosine, from the one backward.

Why: the size of a document's gradient did not separate garbage from real documents on
the demo (AUC 0.45-0.57, issue 11), but its *direction* did: the cosine between a
document's gradient and the gradient of a trusted clean set reached AUC 0.90. It is the
first-order estimate of whether a step on the document lowers the clean set's loss
(TracIn, Pruthi et al. 2020; LESS, Xia et al. 2024), read at one checkpoint.

Setting and notation as in :mod:`training.grad_norms`: the batch backward gives every
supported layer's output gradient ``g_t``, and ``(N_tot / N_d) g_t`` is the output
gradient of document ``d``'s own loss ``L_d`` (rows never mix documents). For a fixed
reference gradient ``G`` (one tensor per parameter) the dot product is linear in the
per-document gradient, so it is a sum over the document's tokens with no per-document
gradient materialised:

* Linear ``y = W a (+ b)``:  ``grad_W L_d · G_W = sum_{t in d} g_t^T G_W a_t``
  (one ``(M, d_in) x (d_in, d_out)`` product per row: the cost of the layer's forward);
  bias: ``sum_t g_t · G_b``;
* Embedding: ``sum_t g_t · G_E[tok_t]`` (the padding row never receives gradient);
* RMSNorm ``y = x_hat * w``: ``sum_t (g_t * x_hat_t) · G_w``;
* MoE experts: the same Linear formula on the expert's tokens laid out by row.

Where the norms already materialise a Linear's per-document weight gradients (the cheaper
norm for long rows, see training.grad_norms), the dot is taken from them instead, an
elementwise product rather than another matmul. Each sum is taken per row, then per
document, and multiplied once by
``N_tot / (N_d * loss_scale)``. The cosine divides by ``||grad L_d||`` (the ghost norm of
the same backward) and ``||G||``.

Documents may be judged against different references (strata: text against text, code
against code): ``doc_reference[d]`` picks the reference of document ``d``, and a layer
does one product per reference present in the batch, on that reference's rows only, so
the cost does not grow with the number of strata.

A document may also be compared with several references at once (``doc_reference`` of shape
``(n_docs, J)``: the components of a mixed clean set, e.g. man pages and package documentation
for prose): one observer per column, in the same backward, so each column costs one more
product per layer, and the dots and cosines come back as ``(n_docs, J)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from training.grad_norms import (
    DocumentStats,
    LayerGrad,
    _plan,
    _Rows,
    per_document_loss_and_grad_norm,
    token_losses,
)

__all__ = [
    "AlignmentStats",
    "References",
    "gradient_norm",
    "per_document_alignment",
    "per_document_alignment_reference",
]


@dataclass
class AlignmentStats(DocumentStats):
    """DocumentStats plus, per document, ``grad L_d · G`` and its cosine with ``G``."""

    grad_dot: torch.Tensor | None = None  # (n_docs,) float64; (n_docs, J) for a 2-D doc_reference
    alignment: torch.Tensor | None = None  # the same shape, NaN for empty documents or G = 0


def gradient_norm(reference: Mapping[str, torch.Tensor]) -> float:
    """``||G||`` over all its tensors, in float64."""
    return float(sum(t.double().pow(2).sum() for t in reference.values())) ** 0.5


class References:
    """Reference gradients stacked per parameter, ``(K, *shape)``, with their norms: built once,
    so a batch picks a row's reference by indexing. ``references[k]`` maps every trainable
    parameter's name to a tensor of its shape."""

    def __init__(self, references: Sequence[Mapping[str, torch.Tensor]], *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        if not references:
            raise ValueError("at least one reference gradient is needed")
        names = list(references[0])
        for k, ref in enumerate(references):
            if set(ref) != set(names):
                raise ValueError(f"reference gradient {k} names other parameters than reference 0")
        self.stacked = {n: torch.stack([ref[n].detach() for ref in references]).to(device=device, dtype=dtype)
                        for n in names}
        self.norms = torch.tensor([gradient_norm(ref) for ref in references], dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.norms)

    def check(self, model: nn.Module) -> list[str]:
        """The model's trainable parameter names, after checking that every one has a reference."""
        names = []
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if n not in self.stacked:
                raise ValueError(f"the reference gradients lack trainable parameter {n}")
            if tuple(self.stacked[n].shape[1:]) != tuple(p.shape):
                raise ValueError(f"reference gradient of {n} has shape {tuple(self.stacked[n].shape[1:])}, "
                                 f"the parameter {tuple(p.shape)}")
            names.append(n)
        return names


class _Dots:
    """A LayerObserver: accumulates, per row, the raw ``sum_t`` dot with each row's reference."""

    def __init__(self, model: nn.Module, references: References, row_reference: torch.Tensor, n_rows: int,
                 device: torch.device):
        names = {p: n for n, p in model.named_parameters()}
        self.by_module: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for module in model.modules():
            own = {attr: references.stacked[names[p]]
                   for attr, p in module.named_parameters(recurse=False) if p.requires_grad}
            if own:
                self.by_module[module] = own
        self.row_reference = row_reference
        self.groups = [(k, (row_reference == k).nonzero(as_tuple=True)[0]) for k in row_reference.unique().tolist()]
        self.per_row = torch.zeros(n_rows, dtype=torch.float64, device=device)
        self.per_doc: torch.Tensor | None = None  # dots taken from materialised per-document weight gradients
        self.doc_reference: torch.Tensor | None = None

    def doc_weight_grads(self, layer: LayerGrad, docs: torch.Tensor, per_doc: torch.Tensor) -> None:
        """The norms materialised these documents' weight gradients: dot them with G directly
        (an elementwise product) instead of another matmul per row."""
        weight = self.by_module[layer.module]["weight"].to(per_doc.dtype)
        refs = self.doc_reference[docs]
        for k in refs.unique().tolist():  # by reference, so G is broadcast, never gathered per document
            mine = (refs == k).nonzero(as_tuple=True)[0]
            chunk = per_doc if len(mine) == len(docs) else per_doc[mine]
            # Elementwise then a pairwise sum: a BLAS matvec would accumulate ~1e6 terms in fp32.
            self.per_doc.index_add_(0, docs[mine], (chunk * weight[k]).sum((1, 2)).double())

    def __call__(self, layer: LayerGrad, rows: _Rows) -> None:
        refs = self.by_module[layer.module]
        g = layer.g
        if layer.kind == "embedding":
            module = layer.module
            tok = layer.x.reshape(rows.n_rows, -1)
            table = refs["weight"].to(g.dtype)
            if len(self.groups) == 1:
                picked = table[self.groups[0][0]][tok]  # (B, N, dim): G_E[tok_t]
            else:  # of each row's reference
                picked = table[self.row_reference[:, None].expand_as(tok), tok]
            per_token = (picked * g.reshape(*tok.shape, -1)).sum(-1)
            if module.padding_idx is not None:
                per_token = per_token.masked_fill(tok == module.padding_idx, 0)
            self.per_row += per_token.sum(1).double()
            return
        if layer.kind == "rmsnorm":
            per_row = g.reshape(rows.n_rows, -1, g.shape[-1]).sum(1)  # sum_t g_t * x_hat_t
            self.per_row += (per_row * refs["weight"].to(g.dtype)[self.row_reference]).sum(1).double()
            return
        a = layer.x  # (B, M, d_in), g (B, M, d_out)
        if "bias" in refs:
            self.per_row += (g.sum(1) * refs["bias"].to(g.dtype)[self.row_reference]).sum(1).double()
        if "weight" not in refs or layer.weight_grads_visited:
            return
        weight = refs["weight"].to(g.dtype)
        for k, idx in self.groups:
            if len(self.groups) == 1:
                a_k, g_k = a, g
            else:
                a_k, g_k = a[idx], g[idx]
            # sum_t g_t^T G a_t = sum over (t, o) of (a G^T)_{t,o} g_{t,o}; multiply in the
            # narrower side's order so the temporary is the smaller of (M, d_in), (M, d_out).
            if a_k.shape[-1] <= g_k.shape[-1]:
                dots = ((g_k @ weight[k]) * a_k).sum((1, 2))
            else:
                dots = ((a_k @ weight[k].mT) * g_k).sum((1, 2))
            if len(self.groups) == 1:
                self.per_row += dots.double()
            else:
                self.per_row.index_add_(0, idx, dots.double())


def _doc_reference(doc_reference: torch.Tensor | None, n_docs: int, k: int, device: torch.device) -> torch.Tensor:
    if doc_reference is None:
        return torch.zeros(n_docs, dtype=torch.long, device=device)
    doc_reference = doc_reference.to(device)
    if doc_reference.shape[:1] != (n_docs,) or doc_reference.dim() not in (1, 2) \
            or (doc_reference.dim() == 2 and doc_reference.shape[1] == 0):
        raise ValueError(f"doc_reference must be ({n_docs},) or ({n_docs}, J), got {tuple(doc_reference.shape)}")
    if n_docs and (int(doc_reference.min()) < 0 or int(doc_reference.max()) >= k):
        raise ValueError(f"doc_reference must lie in [0, {k})")
    return doc_reference


def per_document_alignment(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_index: torch.Tensor,
    n_docs: int,
    references: References | Sequence[Mapping[str, torch.Tensor]],
    doc_reference: torch.Tensor | None = None,
    *,
    loss_scale: float = 1.0,
    method: str = "auto",
    weight_grads: bool = True,
) -> AlignmentStats:
    """One forward and one backward: every document's loss, ``||grad L_d||``, ``grad L_d · G``
    and the cosine, where ``G = references[doc_reference[d]]`` (a mapping from parameter name
    to a tensor of the parameter's shape; default: ``references[0]`` for every document).
    A 2-D ``doc_reference`` ``(n_docs, J)`` compares every document with J references (a row may
    repeat one), and ``grad_dot`` and ``alignment`` are ``(n_docs, J)``.

    Leaves ``.grad`` as ``(loss * loss_scale).backward()`` would, like
    :func:`training.grad_norms.per_document_loss_and_grad_norm`. Pass a :class:`References`
    to stack the references once for many batches; ``weight_grads=False`` leaves ``.grad``
    alone and skips the weight-gradient products (the scoring pass). Models the ghost path cannot attribute fall back, with a
    warning, to :func:`per_document_alignment_reference`.
    """
    device = tokens.device
    if not isinstance(references, References):
        references = References(references, device=device)
    references.check(model)
    doc_reference = _doc_reference(doc_reference, n_docs, len(references), device)
    norms = references.norms.to(device)
    if _plan(model).unsupported:
        warnings.warn("per-document alignment cannot use ghost norms for this model; "
                      "using the per-document reference loop", stacklevel=2)
        stats = per_document_alignment_reference(model, tokens, targets, loss_mask, doc_index, n_docs,
                                                 references, doc_reference)
        loss = token_losses(model(tokens), targets, loss_mask.bool()).sum() / stats.tokens.sum()
        if weight_grads:
            (loss * loss_scale).backward()
        stats.batch_loss = loss.detach()
        return stats

    columns = doc_reference.reshape(n_docs, -1).T  # (J, n_docs): one observer per column
    observers = []
    for column in columns:
        dots = _Dots(model, references, column[doc_index], tokens.shape[0], device)
        dots.doc_reference = column
        dots.per_doc = torch.zeros(n_docs, dtype=torch.float64, device=device)
        observers.append(dots)
    stats = per_document_loss_and_grad_norm(model, tokens, targets, loss_mask, doc_index, n_docs,
                                            loss_scale=loss_scale, method=method, observers=observers,
                                            weight_grads=weight_grads)
    raw = torch.stack([d.per_doc.index_add_(0, doc_index, d.per_row) for d in observers], 1)
    n_d = stats.tokens.double()
    grad_dot = (raw * (n_d.sum() / (n_d * loss_scale))[:, None]).masked_fill((stats.tokens == 0)[:, None],
                                                                           float("nan"))
    alignment = grad_dot / (stats.grad_norm[:, None] * norms[columns.T])
    if doc_reference.dim() == 1:
        grad_dot, alignment = grad_dot[:, 0], alignment[:, 0]
    return AlignmentStats(
        loss=stats.loss, grad_norm=stats.grad_norm, tokens=stats.tokens, batch_loss=stats.batch_loss,
        grad_dot=grad_dot, alignment=alignment,
    )


def per_document_alignment_reference(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_index: torch.Tensor,
    n_docs: int,
    references: References | Sequence[Mapping[str, torch.Tensor]],
    doc_reference: torch.Tensor | None = None,
) -> AlignmentStats:
    """Brute force: per document, ``torch.autograd.grad`` of its own ``L_d`` flattened and
    dotted with its reference(s). Leaves ``.grad`` as it was; costs a backward per document.
    The test oracle and the benchmark's naive baseline."""
    device = tokens.device
    if not isinstance(references, References):
        references = References(references, device=device)
    names = references.check(model)
    doc_reference = _doc_reference(doc_reference, n_docs, len(references), device)
    params = dict(model.named_parameters())
    mask = loss_mask.bool()
    doc_tokens = torch.zeros(n_docs, dtype=torch.long, device=device).index_add_(0, doc_index, mask.sum(1))
    loss = torch.full((n_docs,), float("nan"), dtype=torch.float64, device=device)
    grad_norm = loss.clone()
    slots = doc_reference.reshape(n_docs, -1)
    grad_dot = torch.full(slots.shape, float("nan"), dtype=torch.float64, device=device)
    alignment = grad_dot.clone()
    token_loss = token_losses(model(tokens), targets, mask)
    docs = [d for d in range(n_docs) if doc_tokens[d] > 0]
    for i, d in enumerate(docs):
        loss_d = token_loss[doc_index == d].sum() / doc_tokens[d]
        grads = torch.autograd.grad(loss_d, [params[n] for n in names], allow_unused=True,
                                    retain_graph=i + 1 < len(docs))
        flat = torch.cat([(g if g is not None else torch.zeros_like(params[n])).double().reshape(-1)
                          for n, g in zip(names, grads)])
        loss[d] = loss_d.detach().double()
        grad_norm[d] = flat.norm()
        for j, k in enumerate(slots[d].tolist()):
            flat_ref = torch.cat([references.stacked[n][k].double().reshape(-1).to(device) for n in names])
            grad_dot[d, j] = flat @ flat_ref
            alignment[d, j] = grad_dot[d, j] / (grad_norm[d] * flat_ref.norm())
    if doc_reference.dim() == 1:
        grad_dot, alignment = grad_dot[:, 0], alignment[:, 0]
    n_d = doc_tokens.double()
    batch_loss = (loss.nan_to_num() * n_d).sum() / n_d.sum()
    return AlignmentStats(loss=loss, grad_norm=grad_norm, tokens=doc_tokens, batch_loss=batch_loss,
                          grad_dot=grad_dot, alignment=alignment)
