"""Decoder model and MoE: shapes, causality, meta-device init, routing, bias balancing, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.model import ModelArgs, Transformer
from training.moe import MoE

torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_args(**kw) -> ModelArgs:
    base = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64,
            "max_seq_len": 32, "n_experts": 4, "moe_topk": 2, "moe_hidden": 32,
            "moe_bias_gamma": 1e-2}
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_shapes_and_aux(ffn):
    model = build(tiny_args(ffn=ffn))
    tokens = torch.randint(0, 64, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 64)
    assert torch.isfinite(logits).all()
    logits2, aux = model(tokens, return_aux=True)
    torch.testing.assert_close(logits, logits2)
    load = aux["moe_tokens_per_expert"]
    if ffn == "moe":
        assert load.shape == (2, 4)
        assert (load.sum(-1) == 3 * 16 * 2).all()
    else:
        assert load.numel() == 0


def test_module_names_for_parallel_plans():
    names = {n for n, _ in build(tiny_args(ffn="dense")).named_parameters()}
    for n in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.attention.wo.weight",
              "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
              "layers.0.feed_forward.w3.weight", "norm.weight", "output.weight"):
        assert n in names
    moe_names = {n for n, _ in build(tiny_args(ffn="moe")).named_parameters()}
    assert "layers.0.feed_forward.router.weight" in moe_names
    assert "layers.0.feed_forward.experts.3.w2.weight" in moe_names
    assert not any("expert_bias" in n for n in moe_names)  # a buffer, not a parameter


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_causality(ffn):
    model = build(tiny_args(ffn=ffn)).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 24), generator=g)
    i = 10
    changed = tokens.clone()
    changed[:, i + 1:] = torch.randint(0, 64, (2, 24 - i - 1), generator=g)
    assert not torch.equal(changed, tokens)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : i + 1], b[:, : i + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, i + 1:], b[:, i + 1:])


# Sparse attention that really selects: 64 tokens are 16 blocks of 4, and each query sees at
# most window + topk * block = 8 + 2 * 4 = 16 keys, so most of the past is chosen, not seen.
SPARSE = {"attention": "sparse", "sparse_window": 8, "sparse_block": 4, "sparse_topk": 2,
          "max_seq_len": 64}


@pytest.mark.parametrize("ffn", ["dense", "moe"])
@pytest.mark.parametrize("i", [37, 44, 50])
def test_sparse_causality(ffn, i):
    # The target of position i is token i + 1: changing tokens i + 1 .. must leave every
    # logit up to i as it was, whatever block offset i + 1 falls on.
    model = build(tiny_args(ffn=ffn, **SPARSE)).eval()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (2, 64), generator=g)
    changed = tokens.clone()
    changed[:, i + 1:] = (tokens[:, i + 1:] + torch.randint(1, 64, (2, 63 - i), generator=g)) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : i + 1], b[:, : i + 1], rtol=0, atol=0)
    assert not torch.allclose(a[:, i + 1:], b[:, i + 1:])


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_decoding_token_by_token_matches_full_forward(attention):
    # Generation recomputes the prefix: the logits at t from a forward over tokens[: t + 1]
    # must equal the full forward's logits at t, at every t (crossing all 16 blocks).
    model = build(tiny_args(**{**SPARSE, "attention": attention})).eval()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        for t in range(64):
            step = model(tokens[:, : t + 1])[:, -1]
            torch.testing.assert_close(step, full[:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_meta_construction_matches_eager(ffn):
    args = tiny_args(ffn=ffn)
    torch.manual_seed(123)  # eager construction consumes the global RNG; init must not care
    eager = build(args, seed=7)
    with torch.device("meta"):
        meta = Transformer(args)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    eager_state = dict(eager.named_parameters()) | dict(eager.named_buffers())
    meta_state = dict(meta.named_parameters()) | dict(meta.named_buffers())
    assert eager_state.keys() == meta_state.keys()
    for name, t in eager_state.items():
        assert torch.equal(t, meta_state[name]), name
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(eager(tokens), meta(tokens))
    # A different seed gives different weights.
    other = build(args, seed=8)
    assert not torch.equal(other.output.weight, eager.output.weight)


def make_moe(gamma=0.05, dim=16, n_experts=8, topk=2) -> MoE:
    moe = MoE(dim, hidden=16, n_experts=n_experts, topk=topk, bias_gamma=gamma)
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    return moe


def test_routing_topk_and_gates():
    moe = make_moe()
    x = torch.randn(100, 16)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # selection bias must not leak into gates
        idx, gates, scores = moe.route(x)
    assert idx.shape == (100, 2) and gates.shape == (100, 2)
    # exactly topk distinct experts per token
    assert (idx.sort(-1).values[:, 0] != idx.sort(-1).values[:, 1]).all()
    torch.testing.assert_close(gates.sum(-1), torch.ones(100))
    assert (gates > 0).all()
    # chosen by biased scores, weighted by un-biased ones
    expected_idx = (scores + moe.expert_bias).topk(2, -1).indices
    assert torch.equal(idx.sort(-1).values, expected_idx.sort(-1).values)
    sel = scores.gather(-1, idx)
    torch.testing.assert_close(gates, sel / sel.sum(-1, keepdim=True))


def test_moe_forward_matches_reference_loop():
    moe = make_moe()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = moe(x)
        idx, gates, _ = moe.route(x.reshape(-1, 16))
        flat = x.reshape(-1, 16)
        ref = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for j in range(2):
                ref[t] += gates[t, j] * moe.experts[int(idx[t, j])](flat[t : t + 1])[0]
    torch.testing.assert_close(out, ref.reshape(2, 5, 16), rtol=1e-5, atol=1e-6)


def test_load_stats_sum_and_reset():
    moe = make_moe()
    with torch.no_grad():
        moe(torch.randn(3, 7, 16))
        moe(torch.randn(5, 16))
    stats = moe.load_stats()
    assert stats["total"] == (21 + 5) * 2
    assert int(stats["tokens_per_expert"].sum()) == 52
    assert stats["max_over_mean"] >= 1.0
    used = moe.update_bias()
    assert used["total"] == 52
    assert moe.load_stats()["total"] == 0
    assert moe.expert_bias.requires_grad is False


def test_bias_balancing_reduces_imbalance():
    torch.manual_seed(0)
    moe = make_moe(gamma=0.02)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0  # inputs below have positive mean: expert 0 always wins
        moe.router.weight[1:] = 0.1 * torch.randn(7, 16)

    def batch():
        return torch.randn(256, 16) + 1.0

    with torch.no_grad():
        moe(batch())
        first = moe.update_bias()
        assert first["tokens_per_expert"][0] >= 250  # (nearly) every token picks expert 0
        assert first["max_over_mean"] > 3.9  # at most 256 / (512 / 8) = 4
        history = []
        for _ in range(80):
            moe(batch())
            history.append(moe.update_bias()["max_over_mean"])
    late = sum(history[-10:]) / 10
    assert late < 0.5 * first["max_over_mean"], history
    assert moe.expert_bias[0] < moe.expert_bias[1:].min()  # the favourite was pushed down


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_training_reduces_loss(ffn):
    torch.manual_seed(0)
    model = build(tiny_args(ffn=ffn), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]

    def loss_fn():
        return F.cross_entropy(model(inp).reshape(-1, 64), tgt.reshape(-1))

    losses = []
    for _ in range(15):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_moe_bias()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    if ffn == "moe":
        assert all(m.expert_bias.abs().sum() > 0 for m in model.moe_layers())


def test_args_validation_and_sparse_lazy_import():
    with pytest.raises(ValueError):
        tiny_args(attention="flash")
    with pytest.raises(ValueError):
        tiny_args(ffn="moe", moe_topk=5)
    # Building a sparse model must not import training.attention; only forward does.
    model = build(tiny_args(attention="sparse"))
    assert model.layers["0"].attention.kind == "sparse"
