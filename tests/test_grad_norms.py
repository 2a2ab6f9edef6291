"""Per-document losses and gradient norms (training.grad_norms) against brute force."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.grad_norms import (
    MicroBatchNorms,
    per_document_grad_norms_functional,
    per_document_grad_norms_reference,
    per_document_loss_and_grad_norm,
    token_losses,
)
from training.model import ModelArgs, Transformer

VOCAB, B, N, N_DOCS = 50, 5, 16, 3
# Row -> document. Document 0 spans rows 0 and 3 (not adjacent), document 2 rows 2 and 4.
DOC_INDEX = torch.tensor([0, 1, 2, 0, 2])
VARIANTS = {
    "dense": {},
    "moe": {"ffn": "moe", "n_experts": 4, "moe_topk": 2},
    "sparse": {"attention": "sparse", "sparse_window": 4, "sparse_block": 4, "sparse_topk": 2},
}


@pytest.fixture(autouse=True)
def one_thread():
    # These models are tiny: on a busy 2-core box, intra-op threads only add contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(dtype=torch.float64, seed: int = 0, **kw) -> Transformer:
    args = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64, "max_seq_len": 32}
    model = Transformer(ModelArgs(**{**args, **kw}))
    model.init_weights(seed)
    return model.to(dtype)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, N), generator=g)
    targets = torch.randint(0, VOCAB, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 12:] = False  # trailing padding
    mask[3, 10:] = False
    mask[4, :3] = False  # a masked prefix (e.g. a prompt)
    targets[~mask] = -1  # garbage at masked positions must not matter
    return tokens, targets, mask


def plain_grads(model: nn.Module, tokens, targets, mask) -> dict[str, torch.Tensor]:
    """What an ordinary training step leaves in .grad."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    loss = F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.masked_fill(~mask, -100).reshape(-1), ignore_index=-100
    )
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_no_hooks(model: nn.Module) -> None:
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks


@pytest.mark.parametrize("method", ["auto", "ghost", "materialise"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_and_plain_backward(variant, method):
    model = build(**VARIANTS[variant])
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()

    ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    assert all(p.grad is None for p in model.parameters())  # the reference leaves .grad alone
    stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS, method=method)

    assert stats.tokens.tolist() == [16 + 10, 12, 16 + 13]
    torch.testing.assert_close(stats.loss, ref.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)
    assert (stats.grad_norm > 0).all()
    torch.testing.assert_close(stats.batch_loss.double(), ref.batch_loss, rtol=1e-10, atol=0)

    expected = plain_grads(twin, tokens, targets, mask)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-15, msg=name)
    if variant == "moe":  # one forward's worth of load, as in a plain step: the reference undid its own
        for a, b in zip(model.moe_layers(), twin.moe_layers()):
            assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    assert_no_hooks(model)


# Two passes as a pipeline schedule runs them (training.parallel.pipeline): micro-batches of rows
# (-1: a filler row), the second pass of a dense model trimmed to 12 positions (rows 1 and 3 end
# before that; the pipeline trims dense models only). Document 0 (rows 0, 3) is split over the
# passes, document 2 (rows 2, 4) over two micro-batches.
PASSES = [([[0, 4], [2, -1]], 16), ([[3], [1]], 12)]


@pytest.mark.parametrize("method", ["auto", "ghost", "materialise"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_micro_batches_give_the_whole_batch_norms(variant, method):
    model = build(**VARIANTS[variant])
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()
    want = per_document_loss_and_grad_norm(twin, tokens, targets, mask, DOC_INDEX, N_DOCS)

    n_total = int(mask.sum())
    layouts = [[torch.tensor(mb) for mb in mbs] for mbs, _ in PASSES]
    norms = MicroBatchNorms(model, DOC_INDEX, N_DOCS, layouts, method=method)
    assert norms.split[:N_DOCS].tolist() == [True, False, True]
    for mbs, width in PASSES:
        width = width if variant == "dense" else N
        norms.start_pass([torch.tensor(mb) for mb in mbs], width)
        losses = []
        for chunk, rows in enumerate(torch.tensor(mb) for mb in mbs):
            take = rows.clamp_min(0)
            m = mask[take, :width] & (rows >= 0)[:, None]
            with norms.forward_of(chunk):
                logits = model(tokens[take, :width])
            losses.append(token_losses(logits, targets[take, :width], m).sum() / n_total)
        for loss in reversed(losses):  # backwards in another order than the forwards, as 1F1B runs them
            loss.backward()
    n_d = torch.zeros(N_DOCS, dtype=torch.float64).index_add_(0, DOC_INDEX, mask.sum(1).double())
    got = norms.finish().sqrt() * n_total / n_d

    torch.testing.assert_close(got, want.grad_norm, rtol=1e-8, atol=0)
    for name, p in model.named_parameters():  # the hooks leave the gradients alone
        torch.testing.assert_close(p.grad, dict(twin.named_parameters())[name].grad, rtol=1e-10, atol=1e-13,
                                   msg=name)
    assert_no_hooks(model)


# Parameter groups by name: freezing all other parameters makes the total norm that of one
# group, so a mistake in one module type cannot hide behind the big embedding/output norms.
GROUPS = {
    "dense": ["tok_embeddings", "attention.w", "feed_forward.w", "_norm.", "output"],
    "moe": ["feed_forward.router", "experts.0.", "experts.", "_norm."],
    "sparse": ["attention.w"],
}


@pytest.mark.parametrize("method", ["ghost", "materialise"])
@pytest.mark.parametrize("variant,group", [(v, g) for v, gs in GROUPS.items() for g in gs])
def test_each_parameter_group_alone(variant, group, method):
    model = build(**VARIANTS[variant])
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(group in name or (group == "_norm." and name == "norm.weight"))
        trainable += p.requires_grad
    assert trainable
    tokens, targets, mask = batch()
    ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS, method=method)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)
    assert (ref.grad_norm > 0).all()


@pytest.mark.parametrize("method", ["ghost", "materialise"])
def test_chunking_keeps_documents_whole(monkeypatch, method):
    """With one-row chunks, a two-row document must still be summed before squaring."""
    from training import grad_norms

    model = build(**VARIANTS["moe"])
    tokens, targets, mask = batch()
    ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    monkeypatch.setattr(grad_norms, "_CHUNK_ELEMENTS", 1)
    stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS, method=method)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", ["ghost", "materialise"])
def test_linear_bias_and_embedding_padding_idx(method):
    """Module options the Transformer doesn't use, but a converted or wrapped model may."""
    model = build()
    torch.manual_seed(0)
    model.output = nn.Linear(32, VOCAB, bias=True, dtype=torch.float64)
    model.tok_embeddings.padding_idx = 0  # PyTorch then gives row 0 no gradient
    tokens, targets, mask = batch()
    tokens[:, :4] = 0
    ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS, method=method)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)
    assert model.tok_embeddings.weight.grad[0].abs().max() == 0


def test_norms_are_per_document_not_per_row():
    """Summing per-row norms (or ignoring the rescaling) would be visibly wrong."""
    model = build()
    tokens, targets, mask = batch()
    stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    per_row = per_document_loss_and_grad_norm(model, tokens, targets, mask, torch.arange(B), B)
    ref_rows = per_document_grad_norms_reference(model, tokens, targets, mask, torch.arange(B), B)
    torch.testing.assert_close(per_row.grad_norm, ref_rows.grad_norm, rtol=1e-5, atol=0)
    # Document 0 = rows 0 and 3: its gradient is the token-weighted mean of theirs.
    assert not torch.isclose(stats.grad_norm[0], per_row.grad_norm[0], rtol=1e-3)
    assert stats.grad_norm[0] < per_row.grad_norm[[0, 3]].max()  # convexity of the norm


def test_empty_document_and_loss_scale():
    model = build()
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()
    stats = per_document_loss_and_grad_norm(
        model, tokens, targets, mask, DOC_INDEX, N_DOCS + 1, loss_scale=8.0
    )
    ref = per_document_grad_norms_reference(twin, tokens, targets, mask, DOC_INDEX, N_DOCS)
    assert stats.tokens[3] == 0 and stats.loss[3].isnan() and stats.grad_norm[3].isnan()
    torch.testing.assert_close(stats.grad_norm[:3], ref.grad_norm, rtol=1e-5, atol=0)
    expected = plain_grads(twin, tokens, targets, mask)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 8.0 * expected[name], rtol=1e-12, atol=1e-15, msg=name)


def test_autocast_bf16():
    model = build(dtype=torch.float32)
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
        stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
        expected = plain_grads(twin, tokens, targets, mask)
    assert stats.grad_norm.dtype == torch.float64 and torch.isfinite(stats.grad_norm).all()
    # bf16 matmuls in both; the norms are accumulated in fp32 from the same bf16 operands.
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=3e-3, atol=0)  # seen: 4e-4
    torch.testing.assert_close(stats.loss, ref.loss, rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap has no SDPA batching rule
def test_functional_variant_matches_reference():
    model = build()
    tokens, targets, mask = batch()
    ref = per_document_grad_norms_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    stats = per_document_grad_norms_functional(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.loss, ref.loss, rtol=1e-10, atol=0)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="MoE"):
        per_document_grad_norms_functional(build(**VARIANTS["moe"]), tokens, targets, mask, DOC_INDEX, N_DOCS)


class _Tempered(nn.Module):
    """A learnable logit temperature: a parameter in a module the ghost hooks don't know."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, tokens):
        return self.inner(tokens) * self.temperature


def test_unknown_parameter_falls_back_to_reference():
    model = _Tempered(build())
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()
    with pytest.warns(UserWarning, match="temperature|_Tempered"):
        stats = per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    ref = per_document_grad_norms_reference(twin, tokens, targets, mask, DOC_INDEX, N_DOCS)
    torch.testing.assert_close(stats.grad_norm, ref.grad_norm, rtol=1e-10, atol=0)
    expected = plain_grads(twin, tokens, targets, mask)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-15, msg=name)


def test_module_run_twice_is_refused_before_backward():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build()

        def forward(self, tokens):
            return self.inner(tokens) + self.inner(tokens)

    model = Twice()
    tokens, targets, mask = batch()
    with pytest.raises(RuntimeError, match="ran twice"):
        per_document_loss_and_grad_norm(model, tokens, targets, mask, DOC_INDEX, N_DOCS)
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model)


def test_planted_outlier_has_largest_grad_norm():
    """Train on cyclic documents; a document of random tokens then stands out."""
    torch.manual_seed(0)
    model = build(dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)

    def cyclic(rows: int) -> torch.Tensor:  # 0..9 repeating, random phase
        return (torch.randint(0, 10, (rows, 1), generator=g) + torch.arange(N + 1)) % 10

    ones = torch.ones(8, N, dtype=torch.bool)
    for _ in range(30):  # the trainer's loop: our call, then the optimizer step
        seq = cyclic(8)
        per_document_loss_and_grad_norm(model, seq[:, :-1], seq[:, 1:], ones, torch.arange(8), 8)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seq = cyclic(6)
    seq[3] = torch.randint(0, VOCAB, (N + 1,), generator=g)
    # Document 0 spans rows 0 and 1; the outlier (row 3) is document 2.
    doc_index = torch.tensor([0, 0, 1, 2, 3, 4])
    stats = per_document_loss_and_grad_norm(
        model, seq[:, :-1], seq[:, 1:], torch.ones(6, N, dtype=torch.bool), doc_index, 5
    )
    assert int(stats.grad_norm.argmax()) == 2
    others = stats.grad_norm[[0, 1, 3, 4]]
    assert stats.grad_norm[2] > 10 * others.max()
    assert int(stats.loss.argmax()) == 2
