"""The trainer: data rows and batches, spikes, checkpoints, exact resume, DVC revs, the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from assay.config import TrainModelParams, TrainParams, TrainTelemetryParams
from assay.errors import AssayError
from assay.versions import open_version
from corpus import stdlib_documents, write_documents
from dvc_repo import dvc_repo, run_ok
from training.data import batch_rows, build_rows, is_holdout, make_batch
from training.spikes import SpikeDetector
from training.telemetry import read_telemetry
from training.tokenizer import EOS, train_tokenizer
from training.trainer import learning_rate, train

pytestmark = pytest.mark.usefixtures("cli_on_session_api")  # conftest: no temporary server per command

BIN = Path(sys.executable).parent
ASSAY = shutil.which("assay", path=str(BIN)) or "assay"

TINY_MODEL = TrainModelParams(dim=32, n_layers=2, n_heads=2, ffn_hidden=64)


def tiny_params(**overrides) -> TrainParams:
    base = dict(model=TINY_MODEL, vocab_size=320, seq_len=32, batch_size=4, steps=20, lr=1e-2,
                warmup_steps=2, checkpoint_every=10, holdout=0.25, eval_rows=64, device="cpu",
                telemetry=TrainTelemetryParams(spike_min_history=20))
    base.update(overrides)
    return TrainParams(**base)


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory) -> Path:
    return write_documents(tmp_path_factory.mktemp("train") / "data", stdlib_documents(12), source="stdlib")


# ------------------------------------------------------------------ rows, batches
def test_rows_make_every_token_a_target_exactly_once():
    docs = [("a", "alpha beta gamma " * 30), ("b", "x"), ("c", "def f():\n    return 1\n" * 9)]
    tok = train_tokenizer([t for _, t in docs], 300)
    rows = build_rows(docs, tok, seq_len=16)
    eos = tok.token_to_id(EOS)
    for d, (doc_id, text) in enumerate(docs):
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        mine = np.flatnonzero(rows.doc == d)
        assert rows.doc_ids[d] == doc_id
        # Targets are tokens 1.. of each row; concatenated they are the document minus its first token.
        targets = np.concatenate([rows.tokens[r, 1:rows.lengths[r]] for r in mine])
        assert targets.tolist() == ids[1:]
        inputs = np.concatenate([rows.tokens[r, :rows.lengths[r] - 1] for r in mine])
        assert inputs.tolist() == ids[:-1]
    batch = make_batch(rows, np.arange(len(rows)))
    assert int(batch.loss_mask.sum()) == sum(len(tok.encode(t).ids) for _, t in docs)  # +eos -first
    assert [batch.doc_ids[i] for i in batch.doc_index.tolist()] == [rows.doc_ids[d] for d in rows.doc]
    assert (batch.targets[batch.loss_mask] != rows.pad_id).all()


def test_cached_rows_equal_the_in_memory_rows_are_memory_mapped_and_reused(tmp_path):
    from training.data import cached_rows

    docs = [("a", "alpha beta gamma " * 30), ("b", "x"), ("c", "def f():\n    return 1\n" * 9), ("d", "")]
    tok = train_tokenizer([t for _, t in docs], 300)
    made = build_rows(docs, tok, seq_len=16)
    cached = cached_rows(tmp_path / "rows", "k1", iter(docs), tok, seq_len=16, encode_batch=2)
    assert isinstance(cached.tokens, np.memmap)  # the tokens stay on disk
    assert np.array_equal(cached.tokens, made.tokens) and np.array_equal(cached.lengths, made.lengths)
    assert np.array_equal(cached.doc, made.doc) and cached.doc_ids == made.doc_ids
    assert cached.pad_id == made.pad_id

    def not_again():
        raise AssertionError("the cache was not reused")
        yield

    again = cached_rows(tmp_path / "rows", "k1", not_again(), tok, seq_len=16)
    assert np.array_equal(again.tokens, made.tokens)
    # A killed writer's temporary is never read, and the next writer clears it; another key replaces k1.
    (tmp_path / "rows" / ".k2.tmp-999999999").mkdir()
    other = cached_rows(tmp_path / "rows", "k2", iter(docs[:1]), tok, seq_len=16)
    assert other.doc_ids == ["a"]
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == ["k2"]


def test_batches_are_a_pure_function_of_seed_and_step():
    first_epoch = np.concatenate([batch_rows(10, 5, s, seed=3) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(10))  # an epoch is a permutation
    assert (batch_rows(10, 5, 7, seed=3) == batch_rows(10, 5, 7, seed=3)).all()
    assert not (batch_rows(10, 5, 0, seed=3) == batch_rows(10, 5, 0, seed=4)).all()
    straddle = batch_rows(10, 4, 2, seed=3)  # positions 8..11: two of epoch 0, two of epoch 1
    assert len(straddle) == 4


def test_holdout_is_by_id_and_about_the_fraction():
    ids = [f"doc-{i}" for i in range(4000)]
    held = [is_holdout(i, 0.1) for i in ids]
    assert 0.08 < np.mean(held) < 0.12
    assert held == [is_holdout(i, 0.1) for i in ids]
    assert not any(is_holdout(i, 0.0) for i in ids)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    p = tiny_params(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [learning_rate(s, p) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)


# ------------------------------------------------------------------ spikes
def test_spike_detector_needs_history_then_flags_six_sigma():
    det = SpikeDetector(window=8, sigma=6.0, min_history=4)
    assert det.check([1e9, 1e9]) == [False, False]  # nothing judged without history
    for v in (1.0, 1.1, 0.9, 1.0, 1.05):
        det.accept([v, v])
    assert det.check([1.2, 1.2]) == [False, False]
    assert det.check([5.0, 1.0]) == [True, False]
    for _ in range(20):  # the ring buffer forgets old values
        det.accept([3.0, 3.0])
    assert det.check([3.0, 3.0]) == [False, False]


def test_a_loss_spike_skips_the_step_and_flags_its_documents(tmp_path):
    # One-row documents of near-identical prose, and one of random characters. The loss on the
    # prose flattens within a few dozen steps; the random document is then a 6-sigma outlier.
    rng = np.random.default_rng(0)
    prose = [(f"p{i}", f"The cat number {i % 7} sat on the mat and looked at the door.") for i in range(80)]
    garbage = ("garbage", "".join(rng.choice(list("qzxjkv0123456789#$%&QZXJ"), 45)))
    docs = prose[:50] + [garbage] + prose[50:]
    data = write_documents(tmp_path / "data", docs)
    params = tiny_params(batch_size=2, steps=70, holdout=0.0, checkpoint_every=70, seq_len=64, lr=1e-2,
                         telemetry=TrainTelemetryParams(spike_window=16, spike_min_history=16))
    # Rows are documents in order (each fits one row); choose a seed that draws the garbage
    # (row 50) only after the loss has flattened.
    def garbage_steps(seed: int) -> list[int]:
        return [s + 1 for s in range(params.steps) if 50 in batch_rows(len(docs), 2, s, seed)]

    seed = next(s for s in range(500) if min(garbage_steps(s)) >= 32)
    params = dataclasses.replace(params, seed=seed)
    spikes = garbage_steps(seed)

    result = train(open_version(data), tmp_path / "run", params, progress=False)
    history = [json.loads(line) for line in (tmp_path / "run/history.jsonl").read_text().splitlines()]
    skipped = {h["step"]: h["skipped"] for h in history if h["skipped"]}
    assert set(skipped) == set(spikes), (skipped, spikes)
    assert all(reason.startswith("skipped_step:") for reason in skipped.values())
    assert result.metrics["skipped_steps"] == len(spikes)

    telemetry = read_telemetry(tmp_path / "run").to_pylist()
    flagged = [r for r in telemetry if r["flagged"]]
    from assay.schema import document_id

    assert {r["sample_id"] for r in flagged} >= {document_id("tests", "garbage")}
    assert {r["step"] for r in flagged} == set(spikes)
    for step in spikes:
        worst = max((r for r in telemetry if r["step"] == step), key=lambda r: r["loss"])
        assert worst["sample_id"] == document_id("tests", "garbage")

    # The optimizer really skipped it: AdamW counted one step fewer than the run made.
    from training.checkpoint import latest_checkpoint, load_checkpoint
    from training.trainer import build_model, build_optimizer

    model = build_model(params, result.metrics["vocab_size"], torch.device("cpu"))
    optimizer = build_optimizer(model, params)
    load_checkpoint(latest_checkpoint(tmp_path / "run"), model, optimizer, {})
    steps = {float(s["step"]) for s in optimizer.state.values()}
    assert steps == {float(params.steps - len(spikes))}


def test_a_skipped_step_drops_its_moe_routing_counts_and_a_taken_one_moves_the_bias():
    """`end_moe_step`, the trainer's MoE balancing after each step: a skipped step (a loss or
    gradient spike) leaves the bias as it was and drops the step's routing counts, so the next
    update sees the next step's tokens alone; a taken step moves the bias and reports the worst
    layer's max/mean load."""
    from training.model import ModelArgs, Transformer
    from training.parallel.distributed import init_distributed
    from training.parallel.setup import Parallel
    from training.trainer import end_moe_step

    params = tiny_params()
    par = Parallel.setup(params, init_distributed())
    model = Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=16,
                                  ffn="moe", n_experts=4, moe_topk=2, moe_bias_gamma=0.1))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens)
    assert all(int(m.tokens_per_expert.sum()) == 3 * 16 * 2 for m in model.moe_layers())
    assert end_moe_step(model, par, stepped=False) is None
    assert all(int(m.tokens_per_expert.sum()) == 0 and not m.expert_bias.any() for m in model.moe_layers())
    with torch.no_grad():
        model(tokens[:1])
    load = end_moe_step(model, par, stepped=True)
    stats = [m.load_stats() for m in model.moe_layers()]
    assert all(s["total"] == 0 for s in stats)  # cleared by the update
    assert load is not None and load >= 1.0
    assert all(m.expert_bias.abs().max() == pytest.approx(0.1) for m in model.moe_layers())
    dense = Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=16))
    assert end_moe_step(dense, par, stepped=True) is None


# ------------------------------------------------------------------ runs in-process
def test_training_writes_the_run_and_telemetry_contract(stdlib_data, tmp_path):
    result = train(open_version(stdlib_data), tmp_path / "run", tiny_params(steps=12), progress=False)
    m = result.metrics
    run = tmp_path / "run"
    for name in ("tokenizer.json", "history.jsonl", "metrics.json", "checkpoints/latest"):
        assert (run / name).exists(), name
    assert len(list((run / "rows").glob("*/*/tokens.int32"))) == 2  # training and held-out rows, on disk
    assert json.loads((run / "metrics.json").read_text()) == m
    assert 0 < m["val_accuracy"] < 1 and m["val_loss"] > 0 and m["val_rows"] > 0
    assert m["data"]["data_hash"].startswith("local-") and m["data"]["tracked"] is False

    from assay.schema import TELEMETRY_SCHEMA

    table = read_telemetry(run)
    assert table.schema.equals(TELEMETRY_SCHEMA)
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 13))
    by_step = table.group_by("step").aggregate([("tokens", "sum")]).to_pydict()
    assert dict(zip(by_step["step"], by_step["tokens_sum"])) == {h["step"]: h["tokens"] for h in history}
    assert all(g is not None and g > 0 for g in table.column("grad_norm").to_pylist())
    ids = set(open_version(stdlib_data).iter_batches(columns=["id"]).__next__().column("id").to_pylist())
    assert set(table.column("sample_id").to_pylist()) <= ids


def test_a_finished_run_is_not_redone_and_a_used_out_is_not_clobbered(stdlib_data, tmp_path):
    params = tiny_params(steps=4)
    train(open_version(stdlib_data), tmp_path / "run", params, progress=False)
    # The same command again: the finished run stands (it refused until 2026-12-07; now it continues, as
    # every stage's rerun resumes); other params need --resume or --overwrite.
    assert train(open_version(stdlib_data), tmp_path / "run", params, progress=False).resumed_from == 4
    with pytest.raises(AssayError, match="--resume .* or --overwrite"):
        train(open_version(stdlib_data), tmp_path / "run", tiny_params(steps=5), progress=False)
    again = train(open_version(stdlib_data), tmp_path / "run", params, overwrite=True, progress=False)
    assert again.resumed_from == 4  # same data and params: the finished run stands
    with pytest.raises(AssayError, match="no checkpoint"):
        train(open_version(stdlib_data), tmp_path / "empty", params, resume=True, progress=False)


def test_a_first_save_cut_before_its_pointer_continues_and_a_broken_pointer_is_named(stdlib_data, tmp_path):
    """A kill between a save's rename and its `latest` (the first save: no pointer yet) left a whole step
    folder that nothing read: the same command said "not empty; pass --overwrite", which throws it away.
    Now a missing pointer means the newest whole step; one naming a gone step is said by train, score and
    export, with the steps the run holds."""
    from training.export import export_run

    params = tiny_params(steps=4, checkpoint_every=2)
    straight = tmp_path / "straight"
    train(open_version(stdlib_data), straight, params, progress=False)
    killed = Path(shutil.copytree(straight, tmp_path / "killed"))
    shutil.rmtree(killed / "checkpoints/step-00000004")
    (killed / "checkpoints/latest").unlink()
    (killed / "metrics.json").unlink()
    result = train(open_version(stdlib_data), killed, params, progress=False)  # the same command
    assert result.resumed_from == 2 and _history(killed) == _history(straight)

    (killed / "checkpoints/latest").write_text("step-00000006\n")  # a folder deleted by hand
    said = (r"checkpoints/latest names 'step-00000006', which is not a complete checkpoint, though the run holds "
            r"step-00000002, step-00000004")
    for resume in (False, True):
        with pytest.raises(AssayError, match=said + "; to continue the run, write the newest's name into"):
            train(open_version(stdlib_data), killed, params, resume=resume, progress=False)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["latest", "step-00000002", "step-00000004"]
    with pytest.raises(AssayError, match=said + "; write the name of the one to export into"):
        export_run(killed, tmp_path / "hf")
    for pointer, named in ((b"\xff\xfe", "cannot be read"), (b"../../straight/checkpoints/step-00000004",
                                                              r"names '\.\./\.\./straight.*', which is not")):
        (killed / "checkpoints/latest").write_bytes(pointer)  # bytes that are not text; a path out of the run
        with pytest.raises(AssayError, match=f"checkpoints/latest {named}"):
            train(open_version(stdlib_data), killed, params, progress=False)
    assert train(open_version(stdlib_data), killed, params, overwrite=True, progress=False).resumed_from is None


def test_an_out_that_is_not_a_run_is_one_line_and_left_as_it_was(stdlib_data, tmp_path):
    """`assay train --out` a file stopped on a raw NotADirectoryError; `--out DATA --overwrite` wrote
    the run into its own dataset's folder (changing the data it records); `--out . --overwrite`
    wrote a run over any folder and wiped its `telemetry/`, `profile/`, `metrics.json`. Now --overwrite
    replaces only an earlier run, keeping what other Assay stages wrote beside it (`RUN/scores`)."""
    import shutil

    params = tiny_params(steps=2)
    data = tmp_path / "data"
    shutil.copytree(stdlib_data, data)
    (tmp_path / "afile").write_text("a user's file\n")
    project = tmp_path / "project"
    (project / "telemetry").mkdir(parents=True)
    (project / "telemetry" / "mine.csv").write_text("a,b\n")
    (project / "metrics.json").write_text("{}")
    (project / "notes.txt").write_text("keep me\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = {tmp_path / "afile": "is a file, not a directory", data: "is the dataset",
             data / "run": "lies inside the dataset", tmp_path: "holds the dataset",
             project: "holds notes.txt, which no run writes", tmp_path / "dangling": "symbolic link to nothing"}
    def snapshot():
        return sorted((str(f.relative_to(tmp_path)), f.read_bytes()) for f in tmp_path.rglob("*") if f.is_file())
    before = snapshot()
    for out, message in cases.items():
        with pytest.raises(AssayError, match=message):
            train(open_version(data), out, params, overwrite=True, progress=False)
        assert snapshot() == before, out
    # An earlier run with the scores scored beside it (DVC removed the run's own outputs first).
    run = tmp_path / "run"
    train(open_version(data), run, params, progress=False)
    (run / "scores").mkdir()
    (run / "scores" / "manifest.json").write_text('{"format": "assay-scores/1"}')
    for name in ("checkpoints", "telemetry", "tokenizer.json", "history.jsonl", "metrics.json"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    again = train(open_version(data), run, tiny_params(steps=2, seed=3), overwrite=True, progress=False)
    assert again.resumed_from is None and (run / "scores" / "manifest.json").is_file()


def test_a_run_that_fails_before_writing_leaves_no_folder_it_made_and_keeps_the_users(stdlib_data, tmp_path):
    """A run that failed after making its --out (here: a damaged part, read while learning the tokenizer)
    left that folder, and the missing parents made with it, empty behind; a folder the user made stays."""
    data = tmp_path / "data"
    shutil.copytree(stdlib_data, data)
    part = next(data.glob("part-*.parquet"))
    part.write_bytes(b"PAR1" + bytes(64))  # same name, not Parquet: found only when read
    mine = tmp_path / "mine"
    mine.mkdir()
    for out in (tmp_path / "runs" / "round-0", mine):
        with pytest.raises(AssayError, match="not a readable Parquet shard"):
            train(open_version(data), out, tiny_params(steps=2), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "mine"]
    assert list(mine.iterdir()) == []


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8", "fp8_fp16"])
def test_reduced_precision_trains(stdlib_data, tmp_path, precision):
    result = train(open_version(stdlib_data), tmp_path / precision, tiny_params(steps=10, precision=precision),
                   progress=False)
    history = [json.loads(line) for line in (tmp_path / precision / "history.jsonl").read_text().splitlines()]
    assert np.isfinite([h["loss"] for h in history]).all()
    assert history[-1]["loss"] < history[0]["loss"]
    assert result.metrics["precision"] == precision


def test_fp16_overflows_skip_the_step_halve_the_scale_blame_no_document_and_resume_exactly(stdlib_data, tmp_path):
    """fp16 with dynamic loss scaling (torch.amp.GradScaler), started at a scale too large for fp16:
    each overflowing step is skipped without touching the model and halves the scale, until gradients fit;
    the steps are `overflow:loss_scale`, not `skipped_step:` (tier 2 does not read them as evidence against
    their documents, whose gradient norms are unknown, not infinite); the scale is in the checkpoint."""
    from filters.dynamic import _telemetry_signals
    from training.trainer import OVERFLOW

    params = tiny_params(steps=12, checkpoint_every=4, precision="fp16", loss_scale_init=2.0**24)
    train(open_version(stdlib_data), tmp_path / "run", params, progress=False)
    history = _history(tmp_path / "run")
    overflows = [h["step"] for h in history if h["skipped"] == OVERFLOW]
    assert overflows == list(range(1, len(overflows) + 1)) and 2 <= len(overflows) < 12
    assert [h["loss_scale"] for h in history] == [2.0**24 / 2 ** min(s, len(overflows)) for s in range(1, 13)]
    # A skipped step leaves the model as it was: until the first applied step, every loss is the initial
    # model's, which a run at learning rate 0 (AdamW's decay is lr * wd: nothing moves) reproduces bit for bit.
    frozen = train(open_version(stdlib_data), tmp_path / "frozen", tiny_params(steps=12, precision="fp16", lr=0.0),
                   progress=False)
    assert frozen.metrics["skipped_steps"] == 0
    still = _history(tmp_path / "frozen")
    first_applied = len(overflows) + 1
    assert [h["loss"] for h in history[:first_applied]] == [h["loss"] for h in still[:first_applied]]
    assert history[first_applied]["loss"] != still[first_applied]["loss"]

    telemetry = read_telemetry(tmp_path / "run")
    steps = np.asarray(telemetry.column("step").to_pylist())
    reasons = telemetry.column("reason").to_pylist()
    norms = np.asarray(telemetry.column("grad_norm").to_pylist(), dtype=float)
    at_overflow = np.isin(steps, overflows)
    assert {reasons[i] for i in np.flatnonzero(at_overflow)} == {OVERFLOW}
    assert np.isnan(norms[at_overflow]).all() and np.isfinite(norms[~at_overflow]).all()
    signals = _telemetry_signals(telemetry, anomaly_z=3.5, min_gap=1)
    assert not signals["skipped_draws"].any() and not signals["non_finite"].any()

    # Rolled back to step 4 (the scale halved four times) and resumed: the uninterrupted run's numbers.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    for later in ("step-00000008", "step-00000012"):
        shutil.rmtree(resumed / "checkpoints" / later)
    (resumed / "checkpoints" / "latest").write_text("step-00000004\n")
    (resumed / "metrics.json").unlink()
    result = train(open_version(stdlib_data), resumed, params, resume=True, progress=False)
    assert result.resumed_from == 4
    assert _history(resumed) == history
    with pytest.raises(AssayError, match="loss scaling"):  # bf16 has no scaler state to carry on
        train(open_version(stdlib_data), resumed, dataclasses.replace(params, precision="bf16"), resume=True,
              progress=False)


def test_sparse_attention_and_moe_train_with_balanced_routing(stdlib_data, tmp_path):
    model = dataclasses.replace(TINY_MODEL, attention="sparse", sparse_window=8, sparse_block=8, sparse_topk=2,
                                ffn="moe", n_experts=4, moe_topk=2, moe_bias_gamma=0.01)
    result = train(open_version(stdlib_data), tmp_path / "run", tiny_params(steps=10, model=model), progress=False)
    history = [json.loads(line) for line in (tmp_path / "run/history.jsonl").read_text().splitlines()]
    assert history[-1]["loss"] < history[0]["loss"]
    assert result.metrics["moe_bias_abs_max"] > 0  # the balancing bias moved
    assert all(h["moe_max_over_mean"] >= 1.0 for h in history)  # load statistics, every step


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_metadata_with_code_in_it_is_refused(stdlib_data, tmp_path):
    from training.checkpoint import latest_checkpoint, load_checkpoint
    from training.trainer import build_model, build_optimizer

    params = tiny_params(steps=2)
    result = train(open_version(stdlib_data), tmp_path / "run", params, progress=False)
    checkpoint = latest_checkpoint(tmp_path / "run")

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Exploit()))
    model = build_model(params, result.metrics["vocab_size"], torch.device("cpu"))
    with pytest.raises(Exception, match="not allowed"):
        load_checkpoint(checkpoint, model, build_optimizer(model, params), {})
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------ the CLI
def _cli(args, cwd, check=True, **kwargs):
    proc = subprocess.run([ASSAY, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"assay {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _params_file(tmp_path: Path, params: TrainParams) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": dataclasses.asdict(params)}, sort_keys=False))
    return path


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("flags,says", [
    (["--steps", "0"], "Invalid value for '--steps'"),
    (["--steps", "-1"], "Invalid value for '--steps'"),
    (["--nproc", "0"], "Invalid value for '--nproc'"),
    (["--max-restarts", "-1"], "Invalid value for '--max-restarts'"),
    (["--tp", "2"], "--tp lays out ranks; it needs --nproc above 1"),
    (["--pp-schedule", "1F1B"], "--pp-schedule lays out ranks"),
])
def test_train_options_out_of_range_are_refused_before_anything_is_written(stdlib_data, tmp_path, flags, says):
    """`--steps 0` crashed after leaving a half-made run; `--tp 2` on one process trained one plain process."""
    bad = _cli(["train", "--data", stdlib_data, "--out", tmp_path / "run", *flags], cwd=tmp_path, check=False)
    assert bad.returncode != 0 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_cli_trains_20_steps_and_the_loss_falls(stdlib_data, tmp_path):
    params_file = _params_file(tmp_path, tiny_params(steps=20))
    proc = _cli(["--params", params_file, "train", "--data", stdlib_data, "--out", tmp_path / "run",
                 "--device", "cpu", "--profile", "--json"], cwd=tmp_path)
    metrics = json.loads(proc.stdout[proc.stdout.index("{"):])
    history = _history(tmp_path / "run")
    assert len(history) == 20
    assert np.mean([h["loss"] for h in history[-5:]]) < np.mean([h["loss"] for h in history[:5]]) - 0.3
    assert metrics["steps"] == 20 and metrics["device"] == "cpu"
    assert (tmp_path / "run/profile/trace.json").stat().st_size > 0
    assert "tok/s" in proc.stderr  # the progress bar's throughput
    bad = _cli(["--params", params_file, "train", "--data", tmp_path / "nope", "--out", tmp_path / "r2"],
               cwd=tmp_path, check=False)
    assert bad.returncode == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr


def test_resume_after_kill_9_is_bit_exact(stdlib_data, tmp_path):
    # Big enough that the 50 steps after the checkpoint take a few seconds: room to kill.
    params = tiny_params(steps=100, checkpoint_every=50, seq_len=64, batch_size=8,
                         model=dataclasses.replace(TINY_MODEL, dim=64, ffn_hidden=128))
    params_file = _params_file(tmp_path, params)
    base = ["--params", params_file, "train", "--data", stdlib_data, "--device", "cpu"]
    _cli([*base, "--out", tmp_path / "straight"], cwd=tmp_path)

    killed = tmp_path / "killed"
    # Its own process group, killed whole: the CLI's temporary Prefect server dies with it.
    proc = subprocess.Popen([ASSAY, *map(str, base), "--out", str(killed)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (killed / "checkpoints/latest").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "metrics.json").exists(), "killed too late: the run had finished"

    # The same command, no --resume: a stopped run's line says "rerun the same command to resume", and
    # the rerun refused ("holds a run; pass --resume") until 2026-12-07 (a probe).
    resumed = _cli([*base, "--out", killed], cwd=tmp_path)
    assert "resumed from step 50" in resumed.stdout + resumed.stderr
    assert _history(killed) == _history(tmp_path / "straight")
    assert read_telemetry(killed).equals(read_telemetry(tmp_path / "straight"))


# ------------------------------------------------------------------ DVC revisions
def test_training_reads_the_version_committed_at_a_rev(tmp_path):
    repo, env, dvc = dvc_repo(tmp_path / "repo")
    write_documents(repo / "data/ds", stdlib_documents(6), source="v1")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "v1"], repo, env)
    run_ok(["git", "tag", "v1"], repo, env)
    shutil.rmtree(repo / "data/ds")
    write_documents(repo / "data/ds", stdlib_documents(6, offset=6), source="v2")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    run_ok(["git", "commit", "-qam", "v2"], repo, env)

    old, new = open_version(repo / "data/ds", rev="v1"), open_version(repo / "data/ds")
    assert old.tracked and new.tracked and old.data_hash != new.data_hash
    assert old.data_hash.endswith(".dir") and old.commit != new.commit
    sources = {s for b in old.iter_batches(columns=["source"]) for s in b.column("source").to_pylist()}
    assert sources == {"v1"}  # the workspace holds v2; the rev's bytes come from DVC's cache
    with pytest.raises(AssayError, match="does not exist"):
        open_version(repo / "data/nothing", rev="v1")

    params = tiny_params(steps=4, checkpoint_every=2)
    first = train(old, tmp_path / "run", dataclasses.replace(params, steps=2), progress=False)
    assert first.metrics["data"]["rev"] == "v1" and first.metrics["data"]["data_hash"] == old.data_hash
    with pytest.raises(AssayError, match="--allow-data-change"):
        train(new, tmp_path / "run", params, resume=True, progress=False)
    continued = train(new, tmp_path / "run", params, resume=True, allow_data_change=True, progress=False)
    assert continued.resumed_from == 2 and continued.metrics["data"]["data_hash"] == new.data_hash


def test_a_tracked_dataset_changed_in_the_workspace_is_named_by_its_bytes_not_dvcs_record(tmp_path, monkeypatch):
    """DVC's filesystem reads a workspace file from disk but names it by the hash DVC recorded.
    A stage run outside `dvc repro` publishes new bytes before anything records them: those
    bytes must not train under the recorded version's hash (a resume would take them for it)."""
    from assay import versions
    from assay.shards import publish_directory

    repo, env, dvc = dvc_repo(tmp_path / "repo")
    data = repo / "data/ds"
    write_documents(data, stdlib_documents(6), source="v1", target_bytes=1)
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "v1"], repo, env)
    recorded = open_version(data)
    assert recorded.tracked and not recorded.modified and recorded.data_hash.endswith(".dir")

    def publish(source: str) -> None:  # as a stage's commit does: the folder swapped whole
        built = write_documents(tmp_path / f"built-{source}", stdlib_documents(6, offset=6), source=source,
                                target_bytes=1)
        publish_directory(built, data, tmp_path / f"aside-{source}")

    publish("v2")
    changed = open_version(data)
    assert changed.modified and not changed.tracked and changed.data_hash.startswith("local-")
    assert changed.data_hash == open_version(shutil.copytree(data, tmp_path / "copy")).data_hash  # its bytes' digest
    assert changed.identity()["modified_since_dvc"] is True
    sources = {s for b in changed.iter_batches(columns=["source"]) for s in b.column("source").to_pylist()}
    assert sources == {"v2"}

    run_ok([dvc, "add", "-q", "data/ds"], repo, env)  # recorded now: DVC's hash names it again
    again = open_version(data)
    assert again.tracked and not again.modified and again.data_hash not in (recorded.data_hash, changed.data_hash)

    # A version published while DVC is being asked: its answer may be about either, so the open stops.
    asked = versions._as_dvc_recorded

    def then_publish(repo, prefix):
        answer = asked(repo, prefix)
        publish("v2b")
        return answer

    monkeypatch.setattr(versions, "_as_dvc_recorded", then_publish)
    with pytest.raises(AssayError, match="was replaced while it was being opened"):
        open_version(data)
    monkeypatch.undo()
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    again = open_version(data)
    assert again.tracked and not again.modified

    # A run reading the recorded version while a new one is published over it stops at the next part.
    assert len(again.shards) == 6
    reading = again.iter_batches(columns=["source"])
    assert next(reading).column("source").to_pylist() == ["v2b"]
    publish("v3")
    with pytest.raises(AssayError, match=r"part-00001.parquet: replaced since this run opened"):
        list(reading)


def test_a_tracked_part_edited_in_place_keeping_its_size_and_mtime_is_named_by_its_bytes(tmp_path):
    """DVC's status trusts its cache of hashes by inode, size and mtime: a byte flipped in place with
    the mtime set back is "unchanged" to it, and `open_version` named the new bytes by the recorded
    md5 (a resume, a score or a model card would take them for the recorded version). Each part's
    bytes are now checked against the md5 DVC recorded for that file."""
    import hashlib
    import os

    repo, env, dvc = dvc_repo(tmp_path / "repo")
    data = repo / "data/ds"
    write_documents(data, stdlib_documents(6), source="v1", target_bytes=1)
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    recorded = open_version(data)
    assert recorded.tracked and not recorded.modified and recorded.data_hash.endswith(".dir")

    part = data / recorded.shards[-1]
    st = part.stat()
    raw = bytearray(part.read_bytes())
    before = hashlib.md5(raw).hexdigest()
    raw[len(raw) // 2] ^= 0xFF  # same size, same name; the mtime is set back below
    with open(part, "r+b") as handle:  # in place: the same inode
        handle.write(raw)
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert part.stat().st_ino == st.st_ino and part.stat().st_size == st.st_size
    assert hashlib.md5(part.read_bytes()).hexdigest() != before
    status = run_ok([dvc, "status", "--json", "data/ds.dvc"], repo, env)
    assert status.strip() == "{}"  # DVC: up to date, the reason for the check
    edited = open_version(data)
    assert edited.modified and not edited.tracked and edited.data_hash.startswith("local-")
    assert edited.data_hash == open_version(shutil.copytree(data, tmp_path / "copy")).data_hash


def test_a_version_recorded_between_reading_dvcs_hash_and_asking_its_status_is_named_by_its_bytes(
        tmp_path, monkeypatch):
    """`open_version` reads the recorded md5, then asks DVC's status of the workspace. A new
    version published and recorded (`dvc add`, or a `dvc repro` writing dvc.lock) in between must
    not be named by the old md5. It is not: DVC's repository keeps the index it loaded for the md5
    (`Repo.index` is cached), and the status compares the workspace with that index, so the new
    bytes are found modified and named by their digest."""
    from assay import versions
    from assay.shards import publish_directory

    repo, env, dvc = dvc_repo(tmp_path / "repo")
    data = repo / "data/ds"
    write_documents(data, stdlib_documents(6), source="v1", target_bytes=1)
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    old = open_version(data)
    assert old.tracked and not old.modified

    opened = versions._workspace

    def recorded_after_the_hash_was_read(given, absolute, dvc_repo_, prefix, md5, commit):
        assert md5 == old.data_hash  # the md5 open_version read, before the new version exists
        built = write_documents(tmp_path / "built", stdlib_documents(6, offset=6), source="v2", target_bytes=1)
        publish_directory(built, data, tmp_path / "aside")
        run_ok([dvc, "add", "-q", "data/ds"], repo, env)
        return opened(given, absolute, dvc_repo_, prefix, md5, commit)

    monkeypatch.setattr(versions, "_workspace", recorded_after_the_hash_was_read)
    raced = open_version(data)
    monkeypatch.undo()
    assert raced.data_hash != old.data_hash
    assert raced.modified and raced.data_hash == open_version(shutil.copytree(data, tmp_path / "copy")).data_hash
    assert {s for b in raced.iter_batches(columns=["source"]) for s in b.column("source").to_pylist()} == {"v2"}
    now = open_version(data)  # opened afresh, the new version is named by DVC's new record
    assert now.tracked and not now.modified and now.data_hash not in (old.data_hash, raced.data_hash)


def test_the_train_flow_says_when_tracked_data_differs_from_dvcs_record(prefect_harness, tmp_path):
    """The line goes to the flow run's log, read back from the harness's Prefect API, which is
    where a user sees it in the UI (the console's handler depends on what ran before)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from flows.train import train_flow
    from republish import republish

    repo, env, dvc = dvc_repo(tmp_path / "repo")
    data = write_documents(repo / "data/ds", stdlib_documents(6), source="v1")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    republish(data, tmp_path)  # a stage run outside dvc repro
    params_file = _params_file(tmp_path, tiny_params(steps=3))
    state = train_flow(str(data), str(tmp_path / "run"), device="cpu", params_file=str(params_file), return_state=True)
    metrics = state.result()
    assert metrics["data"]["modified_since_dvc"] is True and metrics["data"]["data_hash"].startswith("local-")
    APILogWorker.drain_all()  # the log lines the flow sent, delivered before they are read back

    async def messages() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        return [log.message for log in logs]

    assert any("data/ds differs from what DVC recorded for it" in m for m in asyncio.run(messages()))


def test_an_untracked_edit_that_keeps_every_size_changes_the_identity(tmp_path):
    data = write_documents(tmp_path / "ds", stdlib_documents(4), source="v1")
    before = open_version(data)
    copy = shutil.copytree(data, tmp_path / "copy")
    assert open_version(copy).data_hash == before.data_hash  # same bytes, same identity
    shard = sorted(data.glob("part-*.parquet"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte flipped: same size, same name, same manifest
    shard.write_bytes(bytes(raw))
    after = open_version(data)
    assert not after.tracked and after.data_hash != before.data_hash


def test_train_flow_runs_under_the_prefect_harness(prefect_harness, stdlib_data, tmp_path):
    from flows.train import train_flow

    params_file = _params_file(tmp_path, tiny_params(steps=5))
    metrics = train_flow(str(stdlib_data), str(tmp_path / "run"), steps=3, device="cpu", params_file=str(params_file))
    assert metrics["steps"] == 3 and len(_history(tmp_path / "run")) == 3
    assert metrics["data"]["path"] == str(stdlib_data)


def test_losses_only_telemetry_agrees_with_the_ghost_path(stdlib_data, tmp_path):
    ghost = train(open_version(stdlib_data), tmp_path / "ghost", tiny_params(steps=2), progress=False)
    off = train(open_version(stdlib_data), tmp_path / "off",
                tiny_params(steps=2, telemetry=TrainTelemetryParams(grad_norms="off", spike_min_history=20)),
                progress=False)
    with_norms, without = read_telemetry(tmp_path / "ghost").to_pylist(), read_telemetry(tmp_path / "off").to_pylist()
    assert [r["sample_id"] for r in with_norms] == [r["sample_id"] for r in without]
    assert all(r["grad_norm"] is None for r in without)
    step1 = [(a["loss"], b["loss"]) for a, b in zip(with_norms, without) if a["step"] == 1]
    np.testing.assert_allclose(*zip(*step1), rtol=1e-5)  # same model, same batch: same per-document losses
    assert ghost.metrics["steps"] == off.metrics["steps"] == 2


def test_a_version_says_whether_its_commit_records_its_data(tmp_path):
    """The exported model card told users to `git checkout <commit> && dvc pull` the data; the commit
    was HEAD when training, whose dvc.lock need not hold it (a `dvc repro` not yet committed)."""
    from training.export import _reproduce

    repo, env, dvc = dvc_repo(tmp_path / "repo")
    data = repo / "data/ds"
    write_documents(data, stdlib_documents(6), source="v1")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "v1"], repo, env)
    committed = open_version(data).identity()
    assert committed["tracked"] and committed["commit_records_data"]
    assert "git checkout <commit> && dvc pull" in _reproduce(committed)

    shutil.rmtree(data)
    write_documents(data, stdlib_documents(6, offset=6), source="v2")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)  # recorded by DVC, not committed to git
    recorded = open_version(data).identity()
    assert recorded["tracked"] and not recorded["modified_since_dvc"] and not recorded["commit_records_data"]
    assert "does not hold this data (DVC recorded it after that commit" in _reproduce(recorded)
    assert open_version(data, rev="HEAD").identity()["commit_records_data"]  # a rev's data is its commit's

    (data / "part-00000.parquet").write_bytes((data / "part-00000.parquet").read_bytes() + b"x")
    assert not open_version(data).identity()["commit_records_data"]
    plain = tmp_path / "plain"
    write_documents(plain, stdlib_documents(3), source="p")
    untracked = open_version(plain).identity()
    assert not untracked["commit_records_data"] and "untracked data" in _reproduce(untracked)


def test_the_same_command_continues_its_run_and_other_settings_are_refused(stdlib_data, tmp_path):
    """A rerun without --resume into a run of the same data and settings continues it (the stop line
    says "rerun the same command to resume"); one of other settings is refused, naming the choice."""
    params = tiny_params(steps=2, checkpoint_every=2)
    version = open_version(stdlib_data)
    train(version, tmp_path / "run", params, progress=False)
    again = train(version, tmp_path / "run", params, progress=False)
    assert again.resumed_from == 2 and again.steps == 2
    with pytest.raises(AssayError, match=r"holds a run \(step 2\) of other data or settings; pass --resume"):
        train(version, tmp_path / "run", dataclasses.replace(params, lr=params.lr * 2), progress=False)
    # Fewer steps than the run has done: said, not silently ignored (a probe, 2026-12-07).
    proc = _cli(["--params", _params_file(tmp_path, params), "train", "--data", stdlib_data, "--out", tmp_path / "run",
                 "--resume", "--steps", "1", "--device", "cpu"], cwd=tmp_path)
    assert "note: the run was already at step 2, past train.steps = 1; nothing was trained" in proc.stdout + proc.stderr


def test_a_run_stopped_before_its_first_checkpoint_is_started_over_by_the_same_command(stdlib_data, tmp_path, capsys):
    """Stopped (a kill, a full disk) before any checkpoint, a run holds its tokenizer, rows, history and
    telemetry: nothing to resume. The same command started over only with --overwrite until 2026-12-07,
    though the stop line says "rerun the same command to resume" (a probe: a disk full at the first save)."""
    import shutil

    params = tiny_params(steps=4, checkpoint_every=2)
    version = open_version(stdlib_data)
    straight = train(version, tmp_path / "straight", params, progress=False)
    run = tmp_path / "run"
    train(version, run, params, progress=False)
    shutil.rmtree(run / "checkpoints")  # what the stopped run had: its entries up to the first save
    (run / "checkpoints" / "step-00000002.tmp-save").mkdir(parents=True)  # and a save cut short
    (run / "metrics.json").unlink()
    capsys.readouterr()
    again = train(version, run, params, progress=False)
    assert f"note: {run} holds a run stopped before its first checkpoint: nothing to resume; starting over" in \
        capsys.readouterr().out
    assert again.resumed_from is None and _history(run) == _history(tmp_path / "straight")
    assert straight.metrics["final_loss"] == again.metrics["final_loss"]
    # A finished run (metrics.json) whose checkpoints are gone, or a folder holding more than a run's own
    # entries, is not one: the rerun still asks for --overwrite.
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(AssayError, match="is not empty; pass --overwrite to replace it"):
        train(version, run, params, progress=False)
    (run / "metrics.json").unlink()
    (run / "notes.txt").write_text("mine\n")
    with pytest.raises(AssayError, match="is not empty; pass --overwrite to replace it"):
        train(version, run, params, progress=False)
    assert (run / "notes.txt").read_text() == "mine\n"


def test_a_run_resumed_under_another_installation_records_both_and_its_card_names_them(stdlib_data, tmp_path, capsys):
    """assay.installation: continuing a run after a code change or an upgrade is allowed (training is
    not a verdict), but the run, and the model card, say which installation ran which steps."""
    from assay.installation import installation
    from training.checkpoint import latest_checkpoint
    from training.export import export_run

    version = open_version(stdlib_data)
    first = train(version, tmp_path / "run", tiny_params(steps=2, checkpoint_every=2), progress=False)
    assert first.metrics["installations"] == [{"from_step": 0, "installation": installation()}]
    assert first.metrics["installation"] == installation()
    older = installation()
    older["packages"]["torch"] = "2.12.0"
    state = latest_checkpoint(tmp_path / "run") / "trainer.json"
    recorded = json.loads(state.read_text())
    state.write_text(json.dumps({**recorded, "installations": [{"from_step": 0, "installation": older}]}))

    resumed = train(version, tmp_path / "run", tiny_params(steps=4, checkpoint_every=2), resume=True, progress=False)
    assert resumed.metrics["installations"] == [{"from_step": 0, "installation": older},
                                                {"from_step": 2, "installation": installation()}]
    assert f"from step 2, whose steps another installation ran (torch 2.12.0 -> {torch.__version__})" in \
        capsys.readouterr().out
    export_run(tmp_path / "run", tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "- Steps 0-2: trained with Assay" in card and ", torch 2.12.0, tokenizers " in card
    assert "- Steps 2-4: trained with Assay" in card and f", torch {torch.__version__}, tokenizers " in card

    # A checkpoint of an Assay that recorded no installation: its steps are said to be unknown.
    state = latest_checkpoint(tmp_path / "run") / "trainer.json"
    recorded = json.loads(state.read_text())
    state.write_text(json.dumps({k: v for k, v in recorded.items() if k != "installations"}))
    again = train(version, tmp_path / "run", tiny_params(steps=6, checkpoint_every=2), resume=True, progress=False)
    assert again.metrics["installations"] == [{"from_step": 0, "installation": None},
                                              {"from_step": 4, "installation": installation()}]


# ------------------------------------------------------------------ damaged checkpoints
from test_security import _copy_run, _loaders, tiny_run  # noqa: E402,F401  (every loader of a checkpoint; the run)


@pytest.mark.parametrize("cut", [20_000, 0])
@pytest.mark.parametrize("loader", ["resume", "score", "export"])
def test_a_checkpoint_whose_files_do_not_load_is_one_line_naming_it_in_every_loader(tiny_run, tmp_path, loader, cut):
    """A shard cut short (a copy that stopped, a disk that filled outside Assay) raised DCP's CheckpointException,
    a BaseException: `assay train`'s resume printed a raw traceback, `assay export` torch's own advice."""
    run, checkpoint = _copy_run(tiny_run, tmp_path)
    shard = next(checkpoint.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(AssayError, match=rf"^{re.escape(str(checkpoint))}: damaged, its files do not load \(rank 0: "
                                         r"\w+.*\); restore it from a copy, or use an earlier checkpoint of the run"
                       ) as refused:
        _loaders(run, checkpoint, tiny_run[1])[loader]()
    assert "\n" not in str(refused.value)
