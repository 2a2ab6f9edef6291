"""Context parallel: ring attention, sharded sparse attention and `assay train --cp`, against one process.

Op level (real gloo ranks, torch.multiprocessing spawn): each rank holds its share of a
sequence, runs the distributed op forward and backward, and its output and its q/k/v
gradients must equal its share of the single-process op's (fp32, atol 1e-5).
Training level (torchrun, as `assay train --nproc 2 --cp 2` launches it): the same
tolerances as tests/test_parallel.py, with the per-document losses of the telemetry
summed over the cp ranks, and the ghost gradient norms of whole documents (their parts added over
the cp ranks) equal to one process's (rtol 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from corpus import stdlib_documents, write_documents
from test_parallel import TINY, _history, _torchrun, assert_step_one_matches
from training.attention import dynamic_sparse_attention
from training.parallel.context_parallel import contiguous_positions
from training.parallel.dims import ParallelDims
from training.parallel.ring_attention import zigzag_positions, zigzag_shard, zigzag_unshard
from training.telemetry import read_telemetry
from training.trainer import train

HERE = Path(__file__).parent
ATOL = 1e-5


# ------------------------------------------------------------------ zig-zag layout (pure)
def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(8, 4, 3).tolist() == [3, 4]
    every = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 2·cp = 4"):
        zigzag_positions(10, 2, 0)


def test_zigzag_shard_and_unshard_are_inverse():
    x = torch.randn(2, 3, 24, 5)
    for cp in (1, 2, 3, 4):
        parts = [zigzag_shard(x, cp, r, dim=2) for r in range(cp)]
        assert all(p.shape[2] == 24 // cp for p in parts)
        assert torch.equal(zigzag_unshard(parts, dim=2), x)
    assert torch.equal(zigzag_shard(x, 2, 1, dim=2), x[:, :, [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]])


def test_zigzag_balances_the_causal_triangle():
    # Unmasked (query, key) pairs per rank: equal under zig-zag, 36 against 100 for contiguous halves.
    n, cp = 16, 2
    pairs = [int((zigzag_positions(n, cp, r)[:, None] >= torch.arange(n)[None, :]).sum()) for r in range(cp)]
    assert pairs == [68, 68]
    halves = [int((contiguous_positions(n, cp, r)[:, None] >= torch.arange(n)[None, :]).sum()) for r in range(cp)]
    assert halves == [36, 100]


def test_cp_is_a_mesh_dimension_and_checks_the_world_size():
    assert ParallelDims(dp_shard=-1, cp=2, world_size=2).dp_shard == 1
    with pytest.raises(AssayError, match="world size is 2"):
        ParallelDims(dp_shard=1, cp=4, world_size=2)
    assert ParallelDims(dp_shard=-1, cp=2, world_size=4).dp_shard == 2  # CP×FSDP
    with pytest.raises(AssayError, match="combines with data parallel and pp only today, not with tp"):
        ParallelDims(dp_shard=1, tp=2, cp=2, world_size=4)
    assert ParallelDims(dp_shard=-1, cp=2, pp=2, world_size=8).dp_shard == 2  # CP × PP (tests/test_parallel_pp.py)


# ---------------------------------------------------------------- op level (gloo ranks)
RING_CASES = [  # (B, H, N per 2·cp chunk multiple, D, per-head scale)
    (2, 3, 4, 8, (1.0, 1.0, 1.0)),
    (1, 2, 1, 4, (1.0, 1.0)),  # one token per chunk
    (1, 3, 3, 16, (0.1, 3.0, 12.0)),  # uneven heads: very peaked and very flat softmaxes
]
SPARSE_CASES = [  # (B, H, blocks per rank, D, window, block, topk)
    (2, 2, 4, 8, 8, 4, 2),
    (1, 3, 6, 4, 13, 4, 3),  # window not a multiple of block
    (2, 2, 2, 8, 40, 8, 2),  # the halo spans several ranks
    (1, 2, 4, 4, 5, 4, 0),  # window only
    (1, 2, 2, 4, 3, 4, 8),  # topk above the number of candidates
]


def _inputs(shape, seed, scales=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(*shape, generator=g) for _ in range(4))
    if scales is not None:
        q = q * torch.tensor(scales)[None, :, None, None]
    return q, k, v, d_out


def _compare(rank, single, shard, distributed):
    """Max abs differences of this rank's output and q/k/v gradients from the single process's,
    relative to the reference's largest value where that is above 1: a head with queries scaled
    by 12 has key gradients in the tens, and fp32 rounding there is 1e-5 relative, not absolute."""
    q, k, v, d_out = single
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = distributed[0](*ref)
    out.backward(d_out)
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    local = distributed[1](*mine)
    local.backward(shard(d_out))
    pairs = [(local, shard(out))] + [(m.grad, shard(r.grad)) for r, m in zip(ref, mine)]
    return [float((a - b).abs().max() / b.abs().max().clamp_min(1.0)) for a, b in pairs]


def _op_worker(rank: int, world: int, store: str, result: str) -> None:
    from training.parallel.context_parallel import sharded_sparse_attention
    from training.parallel.distributed import leave
    from training.parallel.ring_attention import ring_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    errors = {}
    for i, (B, H, per_chunk, D, scales) in enumerate(RING_CASES):
        n = per_chunk * 2 * world
        errors[f"ring-{i}"] = _compare(
            rank, _inputs((B, H, n, D), i, scales), lambda t: zigzag_shard(t, world, rank, dim=2),
            (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), ring_attention))
    for i, (B, H, per_rank, D, window, block, topk) in enumerate(SPARSE_CASES):
        n = per_rank * block * world
        pos = contiguous_positions(n, world, rank)
        kw = {"window": window, "block": block, "topk": topk}
        errors[f"sparse-{i}"] = _compare(
            rank, _inputs((B, H, n, D), 100 + i), lambda t: t[:, :, pos].contiguous(),
            (lambda q, k, v: dynamic_sparse_attention(q, k, v, **kw),
             lambda q, k, v: sharded_sparse_attention(q, k, v, **kw)))
    for kind in ("dense", "sparse"):
        errors[f"model-{kind}"] = _model_errors(rank, world, kind)
    torch.save(errors, f"{result}.{rank}")
    leave()  # not a plain return: see leave()


def _model_errors(rank: int, world: int, kind: str) -> list[float]:
    """The whole Transformer with the cp hooks installed: this rank's logits and the cp-summed
    parameter gradients against one process's. Logits see RoPE directly, so global positions
    are checked here more sharply than a few training steps of a tiny model can."""
    from training.model import ModelArgs, Transformer
    from training.parallel.context_parallel import ContextParallel

    n = 32
    args = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=n, attention=kind,
                     sparse_window=6, sparse_block=4, sparse_topk=2)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 50, (2, n), generator=g)
    weight = torch.randn(2, n, 50, generator=g)
    model = Transformer(args)
    model.init_weights(seed=3)
    reference = model(tokens)
    (reference * weight).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    context = ContextParallel(dist.group.WORLD, world, rank, "contiguous" if kind == "sparse" else "zigzag")
    context.install(model)
    pos = context.positions(n // world)
    logits = model(tokens[:, pos])
    (logits * weight[:, pos]).sum().backward()
    errors = [float((logits - reference[:, pos]).abs().max())]
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        errors.append(float((p.grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1.0)))
    model.eval()  # evaluation runs whole rows: the hooks step aside
    errors.append(float((model(tokens) - reference).abs().max()))
    return errors


def _op_errors(world: int, tmp_path: Path) -> dict:
    result = str(tmp_path / "errors")
    mp.start_processes(_op_worker, args=(world, str(tmp_path / "store"), result), nprocs=world, start_method="spawn")
    return {r: torch.load(f"{result}.{r}") for r in range(world)}


def _assert_small(errors: dict) -> None:
    bad = {(rank, case): e for rank, cases in errors.items() for case, e in cases.items() if max(e) > ATOL}
    assert not bad, (f"(rank, case): [out, dq, dk, dv] or [logits, parameter grads.., eval logits], "
                     f"max abs errors (relative where above 1) above {ATOL}: {bad}")


@pytest.mark.parallel
@pytest.mark.parallel_quick
def test_ring_and_sharded_sparse_attention_equal_one_process_on_2_ranks(tmp_path):
    errors = _op_errors(2, tmp_path)
    assert set(errors[0]) == {f"ring-{i}" for i in range(len(RING_CASES))} | {
        f"sparse-{i}" for i in range(len(SPARSE_CASES))} | {"model-dense", "model-sparse"}
    _assert_small(errors)


@pytest.mark.parallel
def test_ring_and_sharded_sparse_attention_equal_one_process_on_4_ranks(tmp_path):
    _assert_small(_op_errors(4, tmp_path))


# ------------------------------------------------------- training (torchrun, 2 ranks)
SPARSE = {"attention": "sparse", "sparse_window": 8, "sparse_block": 8, "sparse_topk": 2}


def _params(path: Path, sparse: bool, grad_norms: str = "ghost") -> Path:
    train_params = {**TINY, "model": {**TINY["model"], **(SPARSE if sparse else {})},
                    "telemetry": {**TINY["telemetry"], "grad_norms": grad_norms}}
    path.write_text(yaml.safe_dump({"train": train_params}))
    return path


def _run(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stderr




@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("cp") / "data", stdlib_documents(14), source="stdlib")


@pytest.mark.parallel
@pytest.mark.parametrize("nproc,layout,sparse", [
    (2, {"cp": 2, "dp_shard": 1}, False),
    (2, {"cp": 2, "dp_shard": 1}, True),
    (4, {"cp": 2, "dp_shard": 2}, False),
], ids=["cp2-ring", "cp2-sparse", "fsdp2xcp2-ring"])
def test_cp_training_matches_one_process(data, nproc, layout, sparse, tmp_path):
    """`assay train --nproc 2 --cp 2` (the sparse run through the CLI, the others through the
    worker it launches): losses, step-1 gradients, parameters after 5 steps, per-document losses
    and ghost gradient norms (each document's parts added over the cp ranks), and the validation loss."""
    from training.checkpoint import latest_checkpoint, load_checkpoint
    from training.tokenizer import load_tokenizer
    from training.trainer import build_model, build_optimizer

    params_file = _params(tmp_path / "params.yaml", sparse)
    single = tmp_path / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)

    # Step 1's gradients (grad_worker runs forward_backward directly, so norms off there).
    no_norms = _params(tmp_path / "no-norms.yaml", sparse, grad_norms="off")
    assert_step_one_matches(nproc, layout, data, single, no_norms, tmp_path)
    layout = json.dumps(layout)

    run = tmp_path / "run"
    if sparse:
        assay = str(Path(sys.executable).parent / "assay")
        stderr = _run([assay, "--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                       "--nproc", "2", "--cp", "2", "--json"])
    else:
        stderr = _torchrun(nproc, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                               "--parallel", layout], module="training.parallel.worker")
    assert "per-document gradient norms are off" not in stderr
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)

    def final(path):
        params = load_params(params_file).train
        model = build_model(params, load_tokenizer(path).get_vocab_size(), torch.device("cpu"))
        load_checkpoint(latest_checkpoint(path), model, build_optimizer(model, params),
                        {"torch_rng": torch.get_rng_state()})
        return model.state_dict()

    mine, theirs = final(run), final(single)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)

    tel, ref_tel = read_telemetry(run), read_telemetry(single)
    key = lambda t: list(zip(t["step"].to_pylist(), t["sample_id"].to_pylist()))  # noqa: E731
    assert sorted(key(tel)) == sorted(key(ref_tel))  # every document of every step, written once
    ref_loss = dict(zip(key(ref_tel), ref_tel["loss"].to_pylist()))
    for k, loss in zip(key(tel), tel["loss"].to_pylist()):
        assert loss == pytest.approx(ref_loss[k], rel=1e-5)
    ref_norm = dict(zip(key(ref_tel), ref_tel["grad_norm"].to_pylist()))
    assert None not in ref_norm.values()
    assert tel["grad_norm"].to_pylist() == pytest.approx([ref_norm[k] for k in key(tel)], rel=1e-5)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["parallel"]["cp"] == 2 and metrics["parallel"]["world_size"] == nproc
    assert metrics["val_loss"] == pytest.approx(json.loads((single / "metrics.json").read_text())["val_loss"],
                                                rel=1e-5)
