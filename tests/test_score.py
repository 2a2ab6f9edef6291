"""Gradient alignment (training.alignment) against autograd, and the scoring pass (training.score, `assay score`)."""

from __future__ import annotations

import ast
import copy
import io
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from assay.config import ScoringParams, TrainModelParams, TrainParams, TrainTelemetryParams
from assay.errors import AssayError
from assay.schema import DOCUMENT_SCHEMA, SCORE_SCHEMA, document_id
from assay.shards import ShardWriter
from assay.versions import open_version
from training.alignment import References, per_document_alignment, per_document_alignment_reference
from training.data import build_rows, make_batch
from training.grad_norms import token_losses
from training.model import ModelArgs, Transformer

BIN = Path(sys.executable).parent
ASSAY = shutil.which("assay", path=str(BIN)) or "assay"

VOCAB, B, N, N_DOCS = 50, 5, 16, 3
# The same batch layout, model variants and one-thread fixture (autouse) as the ghost-norm tests.
from test_grad_norms import DOC_INDEX, VARIANTS, one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("cli_on_session_api")  # conftest: no temporary server per command


# ------------------------------------------------------------------ alignment vs autograd
def build(dtype=torch.float32, **kw) -> Transformer:
    args = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64, "max_seq_len": 32}
    model = Transformer(ModelArgs(**{**args, **kw}))
    model.init_weights(0)
    return model.to(dtype)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, N), generator=g)
    targets = torch.randint(0, VOCAB, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 12:] = False
    mask[3, 10:] = False
    mask[4, :3] = False
    targets[~mask] = -1
    return tokens, targets, mask


def real_gradient(model: Transformer, seed: int) -> dict[str, torch.Tensor]:
    """The mean-loss gradient of another batch: a reference with a real direction."""
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch(seed)
    token_losses(twin(tokens), targets, mask).sum().div(mask.sum()).backward()
    return {n: p.grad.detach().clone() for n, p in twin.named_parameters()}


def random_gradient(model: Transformer, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["ghost", "materialise"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dot_and_cosine_match_autograd_of_each_documents_own_loss(variant, method, dtype):
    model = build(dtype, **VARIANTS[variant])
    tokens, targets, mask = batch()
    refs = [real_gradient(model, 1), random_gradient(model, 2)]
    doc_reference = torch.tensor([0, 1, 0])  # two strata in one batch
    oracle = per_document_alignment_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference)
    stats = per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference,
                                   method=method, weight_grads=False)
    assert all(p.grad is None for p in model.parameters())  # weight_grads=False leaves .grad alone
    torch.testing.assert_close(stats.loss, oracle.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.grad_norm, oracle.grad_norm, rtol=1e-5, atol=0)
    # A dot product is accurate relative to ||grad L_d|| ||G||, the scale of its terms.
    scale = oracle.grad_norm * torch.stack([References(refs).norms[k] for k in doc_reference.tolist()])
    assert ((stats.grad_dot - oracle.grad_dot).abs() <= 1e-5 * scale).all(), (stats.grad_dot, oracle.grad_dot)
    torch.testing.assert_close(stats.alignment, oracle.alignment, rtol=0, atol=1e-5)
    # Against a real gradient the dot is far from 0, so it also holds to 1e-5 relative.
    real = doc_reference == 0
    torch.testing.assert_close(stats.grad_dot[real], oracle.grad_dot[real], rtol=1e-5, atol=0)
    assert oracle.alignment[real].abs().min() > 1e-3


@pytest.mark.parametrize("method", ["ghost", "materialise"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_several_references_per_document_in_one_backward(variant, method):
    """A 2-D doc_reference: each document against J references (score.components), in one backward."""
    model = build(torch.float64, **VARIANTS[variant])
    tokens, targets, mask = batch()
    refs = [real_gradient(model, 1), real_gradient(model, 5), random_gradient(model, 2)]
    doc_reference = torch.tensor([[0, 1], [2, 2], [1, 0]])  # a repeat, and the columns in either order
    stats = per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference,
                                   method=method, weight_grads=False)
    oracle = per_document_alignment_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference)
    assert stats.alignment.shape == stats.grad_dot.shape == oracle.alignment.shape == (N_DOCS, 2)
    scale = oracle.grad_norm[:, None] * References(refs).norms[doc_reference]  # the scale of a dot's terms
    assert ((stats.grad_dot - oracle.grad_dot).abs() <= 1e-6 * scale).all(), (stats.grad_dot, oracle.grad_dot)
    torch.testing.assert_close(stats.alignment, oracle.alignment, rtol=0, atol=1e-6)
    for j in range(2):  # each column is what a 1-D doc_reference gives
        one = per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference[:, j],
                                     method=method, weight_grads=False)
        torch.testing.assert_close(stats.alignment[:, j], one.alignment, rtol=1e-10, atol=1e-12)
    assert (stats.alignment[0, 0] - stats.alignment[0, 1]).abs() > 1e-3  # two real, different references
    with pytest.raises(ValueError, match="doc_reference must be"):
        per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference[:2])


def test_alignment_leaves_grad_as_a_plain_backward():
    model = build(torch.float64)
    twin = copy.deepcopy(model)
    tokens, targets, mask = batch()
    token_losses(twin(tokens), targets, mask).sum().div(mask.sum()).backward()
    per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, [random_gradient(model, 3)])
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_each_parameter_alone():
    """Zero the reference everywhere but one parameter: every layer kind's formula on its own."""
    model = build(torch.float64, **VARIANTS["moe"])
    tokens, targets, mask = batch()
    full = random_gradient(model, 4)
    for name in full:
        one = {n: t if n == name else torch.zeros_like(t) for n, t in full.items()}
        got = per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, [one], weight_grads=False)
        want = per_document_alignment_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS, [one])
        scale = want.grad_norm * References([one]).norms[0]
        assert ((got.grad_dot - want.grad_dot).abs() <= 1e-6 * scale).all(), name


def test_reference_must_cover_every_parameter():
    model = build()
    tokens, targets, mask = batch()
    ref = random_gradient(model, 0)
    ref.pop("output.weight")
    with pytest.raises(ValueError, match="output.weight"):
        per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, [ref])


# ------------------------------------------------------------------ the scoring pass
TINY = TrainModelParams(dim=32, n_layers=2, n_heads=2, ffn_hidden=64)


def tiny_train_params(**overrides) -> TrainParams:
    base = dict(model=TINY, vocab_size=320, seq_len=32, batch_size=4, steps=10, lr=1e-2, warmup_steps=2,
                checkpoint_every=5, holdout=0.0, eval_rows=16, device="cpu",
                telemetry=TrainTelemetryParams(spike_min_history=20))
    base.update(overrides)
    return TrainParams(**base)


def score_params(**overrides) -> ScoringParams:
    # The raw reference gradient unless a test asks for Adam's preconditioning (the default).
    base = dict(reference={"man": 1.0, "python-stdlib": 0.3}, min_stratum_docs=3, max_rows=3,
                batch_tokens=256, part_docs=16, device="cpu", precondition="none")
    base.update(overrides)
    return ScoringParams(**base)


def corpus_rows() -> list[tuple[str, str, str, str, str]]:
    """(source, locator, text, kind, lang): standard-library code, its docstrings as prose, junk, an empty text."""
    rows = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:24]:
        src = f.read_text(encoding="utf-8", errors="replace")
        rows.append(("python-stdlib", f.name, src[:6000], "code", "python"))
        try:
            doc = ast.get_docstring(ast.parse(src)) or ""
        except SyntaxError:
            doc = ""
        if len(doc) > 150:
            rows.append(("man" if len(rows) % 3 else "pypi-description", f.name, doc[:3000], "text", "en"))
    rng = random.Random(0)
    for i in range(4):
        rows.append(("junk", f"junk{i}", "".join(rng.choice("qxzjv ") for _ in range(300)), "text", "en"))
    rows.append(("junk", "empty", "", "text", "en"))
    return rows


def write_corpus(directory: Path, rows) -> Path:
    cols = {"id": [document_id(s, loc) for s, loc, *_ in rows], "text": [r[2] for r in rows],
            "kind": [r[3] for r in rows], "lang": [r[4] for r in rows], "source": [r[0] for r in rows],
            "path": [r[1] for r in rows], "meta": ["{}"] * len(rows)}
    with ShardWriter(directory, DOCUMENT_SCHEMA) as writer:
        writer.write(pa.Table.from_pydict(cols, schema=DOCUMENT_SCHEMA))
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from training.trainer import train

    root = tmp_path_factory.mktemp("score")
    rows = corpus_rows()
    data = write_corpus(root / "data", rows)
    torch.set_num_threads(1)
    train(open_version(data), root / "run", tiny_train_params(), overwrite=True, progress=False)
    return {"root": root, "data": data, "run": root / "run", "rows": rows}


@pytest.fixture(scope="module")
def scored(tiny):
    from training.score import read_scores, score_dataset

    out = tiny["root"] / "scores"
    torch.set_num_threads(1)
    manifest = score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    return {"out": out, "manifest": manifest, "table": read_scores(out)}


def test_every_document_with_text_is_scored_once(tiny, scored):
    table = scored["table"]
    assert table.schema.equals(SCORE_SCHEMA)
    ids = [document_id(s, loc) for s, loc, text, *_ in tiny["rows"] if text]
    assert sorted(table.column("sample_id").to_pylist()) == sorted(ids)  # the empty document has no row
    assert set(table.column("step").to_pylist()) == {10}
    m = scored["manifest"]
    assert m["counts"]["documents"] == len(tiny["rows"]) and m["counts"]["unscored_per_checkpoint"] == 1
    assert np.isfinite(table.column("alignment").to_numpy()).all()
    assert (np.abs(table.column("alignment").to_numpy()) <= 1 + 1e-6).all()
    assert set(table.column("stratum").to_pylist()) == {"text", "code"}
    rows_scored = table.column("rows").to_numpy()
    assert rows_scored.max() <= 3 and table.column("capped").to_numpy().any()


def test_reference_set_is_explicit_disjoint_and_never_judged(tiny, scored):
    from training.score import REFERENCE_FILE, select_reference

    out, table = scored["out"], scored["table"]
    listed = (out / REFERENCE_FILE).read_text().split()
    marked = [i for i, r in zip(table.column("sample_id").to_pylist(), table.column("reference").to_pylist()) if r]
    judged = [i for i, r in zip(table.column("sample_id").to_pylist(), table.column("reference").to_pylist()) if not r]
    assert sorted(listed) == sorted(marked) and listed
    assert not set(listed) & set(judged)
    # Exactly the configured sources, by the hash share; junk and other sources are judged.
    rows = tiny["rows"]
    ids = [document_id(s, loc) for s, loc, *_ in rows]
    chosen = select_reference(ids, np.array([r[0] for r in rows], dtype=object), {"man": 1.0, "python-stdlib": 0.3})
    assert sorted(listed) == sorted(i for i, c in zip(ids, chosen) if c)
    assert {r[0] for r, c in zip(rows, chosen) if c} == {"man", "python-stdlib"}
    assert all(r[0] != "man" or c for r, c in zip(rows, chosen))  # share 1.0: every man page
    n_code = sum(r[0] == "python-stdlib" for r in rows)
    assert 0 < sum(c for r, c in zip(rows, chosen) if r[0] == "python-stdlib") < n_code
    m = scored["manifest"]
    assert m["reference"]["documents"] == len(listed) and m["reference"]["selection"] == {"man": 1.0, "python-stdlib": 0.3}


def _autograd_gradients(tiny, table, n_docs: int = 6):
    """The checkpoint's model; per kind, the reference set's gradient; and (row, loss, tokens, gradient) of
    the first ``n_docs`` judged documents: all by plain autograd, rows built as training builds them."""
    from training.score import _resolve_checkpoints, load_model
    from training.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["run"])
    (ck,) = _resolve_checkpoints(tiny["run"], ["last"])
    model = load_model(ck.path, ck.state, tok.get_vocab_size(), torch.device("cpu"))
    by_id = {r["sample_id"]: r for r in table}
    texts = {document_id(s, loc): (text, kind) for s, loc, text, kind, _ in tiny["rows"]}

    def capped_batch(doc_ids):
        rows = build_rows([(i, texts[i][0]) for i in doc_ids], tok, 32)
        first = np.concatenate([np.flatnonzero(rows.doc == d)[:3] for d in range(len(rows.doc_ids))])
        return make_batch(rows, first)

    def flat_grad(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])

    # Per kind and score.reference_aggregate, the reference gradient from each reference document's
    # own gradient; "tokens" also as one backward of the whole set's mean token loss (the definition).
    refs = {"tokens": {}, "documents": {}, "unit": {}}
    for kind in ("text", "code"):
        members = [r["sample_id"] for r in table if r["reference"] and r["kind"] == kind]
        b = capped_batch(members)
        whole = flat_grad(token_losses(model(b.tokens), b.targets, b.loss_mask).sum() / b.loss_mask.sum())
        own = []
        for doc_id in members:
            bd = capped_batch([doc_id])
            n = int(bd.loss_mask.sum())
            own.append((flat_grad(token_losses(model(bd.tokens), bd.targets, bd.loss_mask).sum() / n), n))
        by_tokens = sum(g * n for g, n in own) / sum(n for _, n in own)
        assert torch.allclose(by_tokens, whole, rtol=1e-4, atol=1e-7)
        refs["tokens"][kind] = whole
        refs["documents"][kind] = sum(g for g, _ in own) / len(own)
        refs["unit"][kind] = sum(g / g.norm() for g, _ in own) / len(own)
    docs = []
    for doc_id in [r["sample_id"] for r in table if not r["reference"]][:n_docs]:
        b = capped_batch([doc_id])
        loss = token_losses(model(b.tokens), b.targets, b.loss_mask).sum() / b.loss_mask.sum()
        docs.append((by_id[doc_id], loss.item(), int(b.loss_mask.sum()), flat_grad(loss)))
    return ck, model, refs, docs


@pytest.mark.parametrize("aggregate", ["tokens", "unit", "documents"])
def test_scores_equal_autograd_of_each_documents_own_rows(tiny, scored, aggregate, tmp_path):
    """End to end: the reference gradient (each score.reference_aggregate) and each document's
    gradient recomputed by plain autograd from the run's checkpoint, rows built as training builds them."""
    from training.score import read_scores, score_dataset

    assert ScoringParams().reference_aggregate == "tokens" and score_params().reference_aggregate == "tokens"
    if aggregate == "tokens":
        table = scored["table"]
    else:
        out = tmp_path / "scores"
        manifest = score_dataset(tiny["run"], tiny["data"], out, score_params(reference_aggregate=aggregate),
                                 progress=False)
        assert manifest["params"]["reference_aggregate"] == aggregate
        table = read_scores(out)
    _, _, refs, docs = _autograd_gradients(tiny, table.to_pylist())
    # tokens and documents coincide when every reference document has the same scored length
    # (here most are capped at max_rows), so each is told apart from unit, and unit from tokens.
    other = "tokens" if aggregate == "unit" else "unit"
    moved = 0
    for row, loss, tokens, g in docs:
        ref = refs[aggregate][row["stratum"]]
        assert row["tokens"] == tokens
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
        assert row["alignment"] == pytest.approx(float(g @ ref / (g.norm() * ref.norm())), abs=1e-4)
        # The aggregates are different references: the check above would catch a swapped one.
        alt = refs[other][row["stratum"]]
        moved += abs(row["alignment"] - float(g @ alt / (g.norm() * alt.norm()))) > 1e-3
    assert moved >= len(docs) // 2


def test_reference_aggregate_is_checked():
    with pytest.raises(AssayError, match="reference_aggregate must be tokens, documents or unit"):
        score_params(reference_aggregate="median")


def test_adam_preconditioned_alignment_is_the_cosine_with_p_g(tiny, scored, tmp_path):
    """score.precondition: adam: the cosine of each document's raw gradient with P * G, where
    P = 1 / (sqrt(v_hat) + eps) is rebuilt here from AdamW's state as the trainer itself restores it."""
    from training.checkpoint import load_checkpoint
    from training.score import read_scores, score_dataset
    from training.trainer import OPTIMIZER_DEFAULTS, build_optimizer

    with pytest.raises(AssayError, match="precondition must be none or adam"):
        score_params(precondition="sgd")
    out = tmp_path / "scores"
    manifest = score_dataset(tiny["run"], tiny["data"], out, score_params(precondition="adam"), progress=False)
    assert manifest["params"]["precondition"] == "adam"
    ck, model, refs, docs = _autograd_gradients(tiny, read_scores(out).to_pylist())
    model.zero_grad(set_to_none=True)  # DCP initialises the optimizer's state only for gradient-free params
    optimizer = build_optimizer(model, tiny_train_params())
    load_checkpoint(ck.path, model, optimizer, {})
    beta2, eps = OPTIMIZER_DEFAULTS["betas"][1], OPTIMIZER_DEFAULTS["eps"]
    scale = []
    for p in model.parameters():
        state = optimizer.state[p]
        v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** float(state["step"]))
        scale.append((1 / (v_hat.sqrt() + eps)).reshape(-1))
    scale = torch.cat(scale)
    raw = {r["sample_id"]: r["alignment"] for r in scored["table"].to_pylist()}
    moved = 0
    for row, loss, _, g in docs:
        pg = scale * refs["tokens"][row["stratum"]]
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["alignment"] == pytest.approx(float(g @ pg / (g.norm() * pg.norm())), abs=1e-4)
        moved += abs(row["alignment"] - raw[row["sample_id"]]) > 1e-3
    assert moved >= len(docs) // 2  # P is far from a constant: the preconditioned cosine is another signal


def test_components_give_each_document_its_best_cosine_with_one_source(tiny, scored, tmp_path):
    """score.components: source: per stratum, each reference source with min_stratum_docs documents is a
    component (the token-weighted gradient of its documents); a document's alignment is its best cosine
    with its stratum's components, all recomputed by plain autograd."""
    from training.score import read_scores, score_dataset

    assert ScoringParams().components == "source"  # the default
    with pytest.raises(AssayError, match="score.components must be none or source"):
        score_params(components="kind")
    reference = {"man": 0.7, "pypi-description": 1.0, "python-stdlib": 0.3}
    out = tmp_path / "scores"
    params = score_params(components="source", reference=reference, min_stratum_docs=2)
    manifest = score_dataset(tiny["run"], tiny["data"], out, params, progress=False)
    table = read_scores(out).to_pylist()
    ck, model, _, docs = _autograd_gradients(tiny, table, n_docs=40)
    source = {document_id(s, loc): s for s, loc, *_ in tiny["rows"]}
    texts = {document_id(s, loc): text for s, loc, text, *_ in tiny["rows"]}
    from training.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["run"])

    def own(doc_id):
        rows = build_rows([(doc_id, texts[doc_id])], tok, 32)
        b = make_batch(rows, np.flatnonzero(rows.doc == 0)[:3])
        n = int(b.loss_mask.sum())
        model.zero_grad(set_to_none=True)
        (token_losses(model(b.tokens), b.targets, b.loss_mask).sum() / n).backward()
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]), n

    components: dict[str, list[torch.Tensor]] = {}
    for kind in ("text", "code"):
        by_source: dict[str, list] = {}
        for r in table:
            if r["reference"] and r["kind"] == kind:
                by_source.setdefault(source[r["sample_id"]], []).append(own(r["sample_id"]))
        components[kind] = [sum(g * n for g, n in gs) / sum(n for _, n in gs) for gs in by_source.values()
                            if len(gs) >= 2]
    assert len(components["text"]) == 2 and len(components["code"]) == 1  # man pages and package docs
    assert manifest["strata"]["by_step"]["10"]["strata"]["text"]["components"] == ["text|man", "text|pypi-description"]
    one = {r["sample_id"]: r["alignment"] for r in read_scores(_score_once(tiny, tmp_path, reference)).to_pylist()}
    moved = 0
    for row, loss, _, g in docs:
        cosines = [float(g @ c / (g.norm() * c.norm())) for c in components[row["stratum"]]]
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["alignment"] == pytest.approx(max(cosines), abs=1e-4)
        assert row["grad_dot"] == pytest.approx(float(g @ components[row["stratum"]][int(np.argmax(cosines))]),
                                                rel=1e-3, abs=1e-6)
        moved += abs(row["alignment"] - one[row["sample_id"]]) > 1e-3
    assert sum(r["stratum"] == "text" for r, *_ in docs) >= 3 and moved >= 3  # one reference per stratum differs


def _score_once(tiny, tmp_path, reference) -> Path:
    from training.score import score_dataset

    out = tmp_path / "scores-one"
    score_dataset(tiny["run"], tiny["data"], out,
                  score_params(reference=reference, min_stratum_docs=2, components="none"), progress=False)
    return out


def test_shuffled_rows_permute_each_rows_real_tokens_by_the_documents_id(tiny):
    from training.score import shuffled_rows
    from training.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["run"])
    texts = [(document_id(s, loc), text) for s, loc, text, *_ in tiny["rows"] if text][:8]
    rows = build_rows(texts, tok, 32)
    mixed = shuffled_rows(rows)
    assert mixed.tokens.shape == rows.tokens.shape and (mixed.lengths == rows.lengths).all()
    moved = 0
    for r, n in enumerate(rows.lengths):
        assert sorted(mixed.tokens[r, :n]) == sorted(rows.tokens[r, :n])  # the same tokens ...
        assert (mixed.tokens[r, n:] == rows.tokens[r, n:]).all()  # ... and the padding where it was
        moved += not (mixed.tokens[r, :n] == rows.tokens[r, :n]).all()
    assert moved >= len(rows) - 1  # a permutation of 32 tokens is the identity 1 time in 32!
    # A document's shuffle is its own, whoever shares its batch: scored alone, the same rows.
    alone = build_rows(texts[3:4], tok, 32)
    assert (shuffled_rows(alone).tokens == mixed.tokens[rows.doc == 3]).all()


def test_order_rise_is_the_loss_rise_with_each_rows_tokens_shuffled(tiny, scored, tmp_path):
    """Recomputed with plain forwards from the checkpoint; the same values whatever the batching and
    parts; and with score.order_rise off the column is null and the pass does no more."""
    from training.score import _resolve_checkpoints, load_model, read_scores, score_dataset, shuffled_rows
    from training.tokenizer import load_tokenizer

    table = scored["table"].to_pylist()
    tok = load_tokenizer(tiny["run"])
    (ck,) = _resolve_checkpoints(tiny["run"], ["last"])
    model = load_model(ck.path, ck.state, tok.get_vocab_size(), torch.device("cpu"))
    texts = {document_id(s, loc): text for s, loc, text, *_ in tiny["rows"]}
    rises = []
    for row in [r for r in table if not r["reference"]][:6]:
        rows = build_rows([(row["sample_id"], texts[row["sample_id"]])], tok, 32)
        first = np.arange(min(3, len(rows)))  # score.max_rows of the test's params
        with torch.no_grad():
            losses = []
            for r in (rows, shuffled_rows(rows)):
                b = make_batch(r, first)
                losses.append(float(token_losses(model(b.tokens), b.targets, b.loss_mask).sum() / b.loss_mask.sum()))
        assert row["loss"] == pytest.approx(losses[0], rel=1e-5)
        assert row["order_rise"] == pytest.approx((losses[1] - losses[0]) / losses[0], rel=1e-4, abs=1e-6)
        rises.append(row["order_rise"])
    assert len(set(rises)) == len(rises)  # a value per document, not a constant
    rebatched = read_scores_of(score_dataset(tiny["run"], tiny["data"], tmp_path / "b",
                                             score_params(batch_tokens=64, part_docs=5), progress=False),
                               tmp_path / "b")
    before = {r["sample_id"]: r["order_rise"] for r in table}
    assert {i: pytest.approx(v, rel=1e-4, abs=1e-6) for i, v in before.items()} == rebatched
    off = score_dataset(tiny["run"], tiny["data"], tmp_path / "off", score_params(order_rise=False), progress=False)
    assert off["params"]["order_rise"] is False
    assert read_scores(tmp_path / "off").column("order_rise").null_count == len(table)


def read_scores_of(manifest: dict, out: Path) -> dict[str, float]:
    from training.score import read_scores

    assert manifest["counts"]["parts"] >= 2
    t = read_scores(out)
    return dict(zip(t.column("sample_id").to_pylist(), t.column("order_rise").to_pylist()))


def test_scores_written_before_order_rise_read_as_null(scored, tmp_path):
    """A scores directory from before the column (format unchanged) still reads: order_rise is null."""
    from training.score import read_scores

    out = tmp_path / "old"
    shutil.copytree(scored["out"], out)
    for part in out.glob("part-*.parquet"):
        pq.write_table(pq.read_table(part).drop_columns(["order_rise"]), part)
    table = read_scores(out)
    assert table.schema.equals(SCORE_SCHEMA) and table.column("order_rise").null_count == table.num_rows


def test_a_deleted_part_alone_is_redone(tiny, scored, tmp_path):
    from training.score import read_scores, score_dataset

    out = tmp_path / "scores"
    shutil.copytree(scored["out"], out)
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) >= 3
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in parts}
    victim = parts[1]
    victim.unlink()
    manifest = score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    assert manifest["counts"]["parts_resumed"] == len(parts) - 1
    for p in parts:
        if p != victim:
            assert p.stat().st_mtime_ns == before[p.name][0], f"{p.name} was rewritten"
    assert victim.is_file()
    redone = pq.read_table(victim).to_pylist()
    original = pq.read_table(pa.BufferReader(before[victim.name][1])).to_pylist()
    assert [r["sample_id"] for r in redone] == [r["sample_id"] for r in original]
    for a, b in zip(redone, original):
        assert a["alignment"] == pytest.approx(b["alignment"], abs=1e-6)
    assert read_scores(out).num_rows == scored["table"].num_rows
    # Nothing left to do: the same call returns the manifest without touching a part.
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    again = score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    assert again == manifest
    assert {p: p.stat().st_mtime_ns for p in parts} == stamps


def test_scores_of_another_installation_are_kept_with_a_note_and_never_reused_in_part(tiny, scored, tmp_path, capsys):
    """assay.installation: a scored part is a verdict of the code and packages that wrote it."""
    from assay.installation import installation
    from training.score import score_dataset

    assert scored["manifest"]["installation"] == installation()
    out = tmp_path / "scores"
    shutil.copytree(scored["out"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["installation"]["code"] = "0" * 16  # as an earlier Assay's code would have recorded it
    (out / "manifest.json").write_text(json.dumps(manifest))
    parts = sorted(out.glob("part-*.parquet"))
    stamps = {p: p.stat().st_mtime_ns for p in parts}

    kept = score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    assert kept["installation"]["code"] == "0" * 16 and {p: p.stat().st_mtime_ns for p in parts} == stamps
    assert "is up to date with its inputs and params, but another installation made it" in capsys.readouterr().out

    parts[1].unlink()  # one part missing: the others, another installation's, are not linked in
    redone = score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    assert redone["counts"]["parts_resumed"] == 0 and redone["installation"] == installation()
    assert _same_scores(out, scored["out"])

    (out / "manifest.json").write_text(json.dumps(manifest | {"shards": redone["shards"]}))
    rebuilt = score_dataset(tiny["run"], tiny["data"], out, score_params(), overwrite=True, progress=False)
    assert rebuilt["counts"]["parts_resumed"] == 0 and rebuilt["installation"] == installation()
    assert "rebuilding it (--overwrite): another installation made it" in capsys.readouterr().out


def _same_scores(a: Path, b: Path) -> bool:
    from training.score import read_scores

    left, right = read_scores(a).to_pylist(), read_scores(b).to_pylist()
    return [r["sample_id"] for r in left] == [r["sample_id"] for r in right] and all(
        x["alignment"] == pytest.approx(y["alignment"], abs=1e-6) for x, y in zip(left, right))


class _Planted:
    """Unpickling this would run ``touch``: a reference cache must never be unpickled as objects."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("payload", ["truncated", "pickled-object"])
def test_a_reference_cache_that_does_not_load_is_recomputed(tiny, scored, tmp_path, payload):
    """A killed run leaves `.reference/step-N.pt` for the resume, in the folder it was building.
    One that does not load, a cut file or one holding a pickled object (which weights_only
    refuses), is recomputed with a warning: never trusted, never executed, and the redone part
    equals the original."""
    from assay.installation import installation
    from assay.shards import staging_dir
    from assay.staging import building
    from training.score import _MARKER, score_dataset

    out = tmp_path / "scores"
    # What a run killed before its last part leaves: its parts and its marker, no manifest, nothing at OUT.
    work = building(out)
    shutil.copytree(scored["out"], work)
    fingerprint = json.loads((work / "manifest.json").read_text())["fingerprint"]
    (staging_dir(out) / _MARKER).write_text(json.dumps({"fingerprint": fingerprint, "installation": installation()}))
    (work / "manifest.json").unlink()
    parts = sorted(work.glob("part-*.parquet"))
    victim = parts[0]
    original = pq.read_table(victim).to_pylist()
    victim.unlink()
    cache = work / ".reference" / f"step-{10:08d}.pt"
    cache.parent.mkdir(exist_ok=True)
    marker = tmp_path / "unpickled"
    if payload == "truncated":
        buffer = io.BytesIO()
        torch.save({"text": {"w": torch.ones(4)}}, buffer)
        cache.write_bytes(buffer.getvalue()[:40])
    else:
        torch.save({"text": _Planted(marker)}, cache)
    cache.with_suffix(".json").write_text(json.dumps({"strata": {}}))
    with pytest.warns(UserWarning, match="reference-gradient cache does not load"):
        score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
    assert not marker.exists()
    redone = pq.read_table(out / victim.name).to_pylist()
    assert [r["sample_id"] for r in redone] == [r["sample_id"] for r in original]
    for a, b in zip(redone, original):
        assert a["alignment"] == pytest.approx(b["alignment"], abs=1e-6)
    assert not list((out / ".reference").glob("*.pt"))  # recomputed, then cleared with the run's end


def test_other_params_need_overwrite_and_bad_inputs_say_why(tiny, scored, tmp_path):
    from training.score import score_dataset

    out = tmp_path / "scores"
    shutil.copytree(scored["out"], out)
    with pytest.raises(AssayError, match="--overwrite"):
        score_dataset(tiny["run"], tiny["data"], out, score_params(max_rows=2), progress=False)
    with pytest.raises(AssayError, match="no checkpoint of step 7"):
        score_dataset(tiny["run"], tiny["data"], tmp_path / "x", score_params(checkpoints=[7]), progress=False)
    with pytest.raises(AssayError, match="reference sources"):
        score_dataset(tiny["run"], tiny["data"], tmp_path / "y", score_params(reference={"nowhere": 1.0}),
                      progress=False)
    with pytest.raises(AssayError, match="no checkpoint"):
        score_dataset(tmp_path, tiny["data"], tmp_path / "z", score_params(), progress=False)
    # `latest` naming a step that is gone, the others still there: said so (it was "no checkpoint (train it
    # first)", a probe 2026-12-07). A missing `latest` is the newest whole step (tests/test_train.py).
    run = shutil.copytree(tiny["run"], tmp_path / "run", ignore=shutil.ignore_patterns("scores"))
    (run / "checkpoints" / "latest").write_text("step-00000099\n")
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    with pytest.raises(AssayError, match=rf"checkpoints/latest names 'step-00000099', which is not a complete "
                                         rf"checkpoint, though the run holds {', '.join(steps)}; name one"):
        score_dataset(run, tiny["data"], tmp_path / "w", score_params(), progress=False)


def test_cli_scores_two_checkpoints_end_to_end(tiny, tmp_path):
    from training.score import read_scores

    params = {"score": {"reference": {"man": 1.0, "python-stdlib": 0.3}, "min_stratum_docs": 3, "max_rows": 2,
                        "part_docs": 1000, "device": "cpu"}}
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    out = tmp_path / "scores"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([ASSAY, "--params", str(params_file), "score", "--run", str(tiny["run"]),
                           "--data", str(tiny["data"]), "--out", str(out), "--checkpoint", "5",
                           "--checkpoint", "last", "--overwrite", "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = read_scores(out)
    n_docs = sum(1 for r in tiny["rows"] if r[2])
    assert sorted(set(table.column("step").to_pylist())) == [5, 10]
    assert table.num_rows == 2 * n_docs
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"]["max_rows"] == 2 and (out / "reference.txt").is_file()
    # The checkpoints differ, so their scores do.
    by_step = {s: table.filter(pc.equal(table.column("step"), s)).sort_by("sample_id") for s in (5, 10)}
    assert not np.allclose(by_step[5].column("loss").to_numpy(), by_step[10].column("loss").to_numpy())


def test_reference_model_gives_rho_loss(tiny, tmp_path):
    """RHO-LOSS: ref_loss is the reference model's mean token loss on the very rows scored, on the
    last checkpoint's rows (the ones the filter reads); an earlier checkpoint's rows leave it null."""
    from training.score import _resolve_checkpoints, load_model, read_scores, score_dataset
    from training.tokenizer import load_tokenizer
    from training.trainer import train

    tok = load_tokenizer(tiny["run"])
    ref_run = tmp_path / "ref-run"
    train(open_version(tiny["data"]), ref_run, tiny_train_params(steps=5, seed=1), overwrite=True,
          progress=False, tokenizer=tok)
    out = tmp_path / "scores"
    score_dataset(tiny["run"], tiny["data"], out, score_params(reference_model=str(ref_run), checkpoints=[5, "last"]),
                  progress=False)
    rows = read_scores(out).to_pylist()
    last = max(r["step"] for r in rows)
    assert {r["step"] for r in rows} == {5, last} and last > 5
    assert all(r["ref_loss"] is None for r in rows if r["step"] == 5)
    table = [r for r in rows if r["step"] == last]
    assert table and all(r["ref_loss"] is not None for r in table)
    (ck,) = _resolve_checkpoints(ref_run, ["last"])
    ref_model = load_model(ck.path, ck.state, tok.get_vocab_size(), torch.device("cpu"))
    texts = {document_id(s, loc): text for s, loc, text, *_ in tiny["rows"]}
    for row in table[:5]:
        rows = build_rows([(row["sample_id"], texts[row["sample_id"]])], tok, 32)
        b = make_batch(rows, np.arange(min(len(rows), 3)))
        with torch.no_grad():
            want = token_losses(ref_model(b.tokens), b.targets, b.loss_mask).sum() / b.loss_mask.sum()
        assert row["ref_loss"] == pytest.approx(want.item(), rel=1e-5)
        assert row["ref_loss"] != pytest.approx(row["loss"], rel=1e-3)  # another model
    other = tmp_path / "other-tokenizer"
    train(open_version(tiny["data"]), other, tiny_train_params(steps=2, vocab_size=300), overwrite=True,
          progress=False)
    with pytest.raises(AssayError, match="tokenizer"):
        score_dataset(tiny["run"], tiny["data"], tmp_path / "s2", score_params(reference_model=str(other)),
                      progress=False)


def test_materialised_weight_gradients_are_reused_chunk_by_chunk(monkeypatch):
    """The dot taken from the norms' materialised per-document gradients, one document per chunk."""
    from training import grad_norms

    model = build(torch.float64)
    tokens, targets, mask = batch()
    refs = [real_gradient(model, 1), random_gradient(model, 2)]
    doc_reference = torch.tensor([1, 0, 1])
    want = per_document_alignment_reference(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference)
    monkeypatch.setattr(grad_norms, "_CHUNK_ELEMENTS", 1)
    got = per_document_alignment(model, tokens, targets, mask, DOC_INDEX, N_DOCS, refs, doc_reference,
                                 method="materialise", weight_grads=False)
    torch.testing.assert_close(got.alignment, want.alignment, rtol=0, atol=1e-8)


def test_an_out_that_is_not_ours_is_one_line_and_left_as_it_was(tiny, tmp_path):
    """`assay score --out` pointed at a file scored every document and then failed to publish; one
    whose manifest.json was not UTF-8 or not a JSON object stopped with a raw UnicodeDecodeError or
    AttributeError. The scores' output is checked as every stage's is (`staging.own_output`), before
    any work: one line, and the folder or file untouched."""
    from training.score import score_dataset

    file_out = tmp_path / "afile"
    file_out.write_text("a user's file\n")
    cases = {file_out: "is a file, not a directory"}
    for name, manifest in (("not-utf8", b"\xff\xfe{"), ("a-list", b"[1, 2]"), ("a-dataset", b'{"format": "assay-dataset/1"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_bytes(manifest)
        cases[tmp_path / name] = "manifest.json is not a scores directory's"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("someone else's\n")
    cases[tmp_path / "other"] = "exists and is not a scores directory"
    before = {p: sorted((f.name, f.read_bytes()) for f in ([p] if p.is_file() else p.iterdir())) for p in cases}
    for out, message in cases.items():
        with pytest.raises(AssayError, match=message):
            score_dataset(tiny["run"], tiny["data"], out, score_params(), progress=False)
        assert sorted((f.name, f.read_bytes()) for f in ([out] if out.is_file() else out.iterdir())) == before[out]
        assert not (tmp_path / f".{out.name}.staging").exists()
