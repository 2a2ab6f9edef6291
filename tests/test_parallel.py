"""Parity of the data-parallel modes with one process, launched for real with torchrun on gloo.

Each mode trains the same tiny model on the same data and seed as a single process,
and must give the same losses for 5 steps (rtol 1e-5), the same gradients after step 1
(atol 2e-5) and the same parameters after step 5 (atol 2e-5), per-document telemetry
included. The tolerances are fp32's: ranks add the same terms in another order.

`make test` runs the two-rank modes marked `parallel_quick`; `make test-parallel` runs all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from corpus import stdlib_documents, write_documents
from dvc_repo import dvc_repo, run_ok
from ports import free_port
from training.checkpoint import latest_checkpoint, load_checkpoint
from training.parallel.batches import assign_documents, local_batch
from training.parallel.dims import ParallelDims
from training.parallel.launch import Launch
from training.telemetry import read_telemetry
from training.trainer import build_model, build_optimizer, train

pytestmark = pytest.mark.parallel
HERE = Path(__file__).parent
STEPS = 5

TINY = {"model": {"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64},
        "vocab_size": 320, "seq_len": 32, "batch_size": 6, "steps": STEPS, "lr": 1e-2, "warmup_steps": 2,
        "checkpoint_every": STEPS, "holdout": 0.2, "eval_rows": 16, "device": "cpu",
        "telemetry": {"spike_min_history": 100}}


# ------------------------------------------------------------------ pure pieces
def test_dims_check_the_world_size_and_refuse_what_is_not_built():
    assert ParallelDims(dp_shard=-1, world_size=4).dp_shard == 4
    assert ParallelDims(dp_replicate=2, dp_shard=-1, world_size=4).dp == 4
    with pytest.raises(AssayError, match="world size is 4"):
        ParallelDims(dp_replicate=3, dp_shard=1, world_size=4)
    assert ParallelDims(dp_shard=-1, tp=2, world_size=4).dp_shard == 2  # tp is built (test_parallel_tp.py)


def test_documents_are_never_split_and_ranks_balance():
    owner = assign_documents([50, 10, 30, 30, 5], 2)
    loads = [sum(t for t, o in zip([50, 10, 30, 30, 5], owner) if o == r) for r in range(2)]
    assert sorted(loads) == [60, 65]
    assert assign_documents([7], 3).tolist() == [0]  # ranks 1 and 2 get the placeholder


def test_local_batches_cover_the_batch_once_and_their_losses_scale_to_the_mean(tmp_path):
    from training.data import build_rows, make_batch
    from training.tokenizer import train_tokenizer

    docs = [(f"d{i}", "word " * (5 + 13 * i)) for i in range(5)]
    tok = train_tokenizer([t for _, t in docs], 300)
    rows = build_rows(docs, tok, seq_len=8)
    whole = make_batch(rows, torch.arange(len(rows)).numpy())
    parts = [local_batch(whole, r, 3) for r in range(3)]
    ids = [d for p in parts if p.has_documents for d in p.batch.doc_ids]
    assert sorted(ids) == sorted(whole.doc_ids)
    assert sum(p.batch.n_tokens for p in parts if p.has_documents) == whole.n_tokens
    # Averaging dp × (local sum / global tokens) over ranks gives the global mean.
    assert sum(p.loss_scale for p in parts) / 3 * 3 == pytest.approx(3.0)


# --------------------------------------------------------- real multi-process runs
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    data = write_documents(root / "data", stdlib_documents(14), source="stdlib")
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": TINY}))
    single = root / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    return root, data, params_file, single


def _launch(nproc: int, args: list[str], module: str | None = None, script: Path | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone` with one thread per rank; the finished launch, its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    target = ["-m", module] if module else [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *target, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(nproc: int, args: list[str], module: str | None = None, script: Path | None = None,
              timeout: int = 600) -> str:
    """`_launch`, failing the test with the ranks' output unless every rank succeeded; returns stderr."""
    done = _launch(nproc, args, module, script, timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stderr


def assert_step_one_matches(nproc: int, layout: dict, data: Path, single: Path, params_file: Path,
                            tmp_path: Path) -> None:
    """Step 1's loss and gradients under ``layout`` equal one process's (grad_worker runs the
    parallel functions directly; each parameter's gradient gathered whole)."""
    grads_file, ref_file = tmp_path / "grads.pt", tmp_path / "ref.pt"
    _torchrun(nproc, [str(data), str(single), str(params_file), json.dumps(layout), str(grads_file)],
              script=HERE / "parallel" / "grad_worker.py")
    _torchrun(1, [str(data), str(single), str(params_file), "{}", str(ref_file)],
              script=HERE / "parallel" / "grad_worker.py")
    got, ref = torch.load(grads_file), torch.load(ref_file)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=2e-5, msg=name)


def _history(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "history.jsonl").read_text().splitlines()]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def _final_params(run: Path, params_file: Path) -> dict[str, torch.Tensor]:
    params = load_params(params_file).train
    from training.tokenizer import load_tokenizer

    model = build_model(params, load_tokenizer(run).get_vocab_size(), torch.device("cpu"))
    load_checkpoint(latest_checkpoint(run), model, build_optimizer(model, params), {"torch_rng": torch.get_rng_state()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _telemetry(run: Path) -> dict[tuple[int, str], tuple[float, float]]:
    t = read_telemetry(run)
    return {(s, d): (l, g) for s, d, l, g in zip(t["step"].to_pylist(), t["sample_id"].to_pylist(),
                                                 t["loss"].to_pylist(), t["grad_norm"].to_pylist())}


MODES = [
    pytest.param(2, {"dp_shard": 2}, id="fsdp-2", marks=pytest.mark.parallel_quick),
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1, "zero1": True}, id="ddp-zero1-2",
                 marks=pytest.mark.parallel_quick),
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1}, id="ddp-2"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2}, id="hsdp-2x2"),
    pytest.param(4, {"dp_shard": 4}, id="fsdp-4"),
]


@pytest.mark.parametrize("nproc,layout", MODES)
def test_parallel_training_matches_one_process(workspace, nproc, layout, tmp_path):
    root, data, params_file, single = workspace
    assert_step_one_matches(nproc, layout, data, single, params_file, tmp_path)

    # Five steps of the real trainer, launched as `assay train --nproc` launches it.
    run = tmp_path / "run"
    _torchrun(nproc, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                      "--parallel", json.dumps(layout)], module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_params(run, params_file), _final_params(single, params_file)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    tel, ref_tel = _telemetry(run), _telemetry(single)
    assert tel.keys() == ref_tel.keys()  # every document of every step, once
    for key, (loss, norm) in ref_tel.items():
        assert tel[key][0] == pytest.approx(loss, rel=1e-5) and tel[key][1] == pytest.approx(norm, rel=1e-4)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["parallel"]["world_size"] == nproc


def test_ranks_name_a_dvc_tracked_workspace_dataset_by_dvcs_hash(workspace, tmp_path):
    """Each rank opens the dataset and asks DVC's status of it as it starts (DVC's state is one SQLite
    file): both find it as recorded, agree, and the run is named by DVC's `.dir` hash."""
    _, _, params_file, _ = workspace
    repo, env, dvc = dvc_repo(tmp_path / "repo")
    write_documents(repo / "data/ds", stdlib_documents(14), source="stdlib")
    run_ok([dvc, "add", "-q", "data/ds"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "data"], repo, env)
    run = tmp_path / "run"
    _torchrun(2, ["--data", str(repo / "data/ds"), "--out", str(run), "--params-file", str(params_file),
                  "--parallel", json.dumps({"dp_shard": 2})], module="training.parallel.worker")
    data = json.loads((run / "metrics.json").read_text())["data"]
    assert data["data_hash"].endswith(".dir") and data["data_hash"] == open_version(repo / "data/ds").data_hash
    assert data["tracked"] and not data["modified_since_dvc"]


def test_ranks_that_opened_different_versions_stop_before_training(workspace, tmp_path):
    """A version published between two ranks' opens would have them train on different data under rank
    0's name: every rank stops, naming both versions, and nothing is written."""
    _, data, params_file, _ = workspace
    other = write_documents(tmp_path / "other", stdlib_documents(14, offset=14), source="stdlib")
    run = tmp_path / "run"
    done = _launch(2, [str(other), "--data", str(data), "--out", str(run), "--params-file", str(params_file),
                       "--parallel", json.dumps({"dp_shard": 2})], script=HERE / "parallel" / "split_version_worker.py")
    assert done.returncode != 0, done.stdout[-2000:]
    for rank, path in ((0, data), (1, other)):
        assert f"rank {rank}: error: {path}: the ranks opened different versions of it" in done.stderr
    assert open_version(data).data_hash in done.stderr and open_version(other).data_hash in done.stderr
    assert latest_checkpoint(run) is None and not (run / "metrics.json").exists()


def test_bf16_under_fsdp_trains_like_one_process_in_bf16(workspace, tmp_path):
    """FSDP2's mixed-precision policy casts every forward input to bf16, RoPE's cos and sin
    too, which the complex rotation refused: bf16 under FSDP failed at the first forward.
    bf16 sums in another order on each layout, so the curves agree to bf16's precision only."""
    root, data, _, _ = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "precision": "bf16"}}))
    single = tmp_path / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    run = tmp_path / "run"
    _torchrun(2, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                  "--parallel", json.dumps({"dp_shard": 2})], module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=2e-2)


@pytest.mark.parametrize("layout", [{"dp_replicate": 2, "dp_shard": 1}, {"dp_replicate": 2, "dp_shard": 1, "zero1": True},
                                    {"dp_shard": 2}, {"tp": 2}, {"cp": 2},
                                    {"pp": 2, "dp_shard": 1, "pp_microbatches": 2}],
                         ids=["ddp-2", "zero1-2", "fsdp-2", "tp-2", "cp-2", "pp-2"])
def test_fp16_loss_scaling_agrees_across_ranks_and_trains_like_one_process(workspace, tmp_path, layout):
    """fp16 with dynamic loss scaling from a scale too large for fp16: every rank must see the same overflows
    (DDP's and ZeRO-1's gradients are all-reduced; FSDP's, TP's and CP's, which FSDP shards over its
    dp_shard_cp mesh, are DTensors, whose inf check torch reduces over the mesh), so the skipped steps and
    the scale are one process's exactly, and the losses agree to fp16's precision (each layout sums in
    another order)."""
    mine, theirs = _two_ranks_and_one(workspace, tmp_path, layout, {**TINY, "steps": 8, "checkpoint_every": 8,
                                                                     "precision": "fp16", "loss_scale_init": 2.0**24})
    assert [(r["skipped"], r["loss_scale"]) for r in mine] == [(r["skipped"], r["loss_scale"]) for r in theirs]
    assert 2 <= sum(r["skipped"] == "overflow:loss_scale" for r in theirs) < 8
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], rel=2e-3)


@pytest.mark.parametrize("nproc", [2, 4], ids=["ep-2", "ep-2-with-copies"])
def test_fp16_under_expert_parallel_skips_and_trains_as_the_same_ranks_without_it(workspace, tmp_path, nproc):
    """fp16 with ep 2: experts' gradients are plain tensors, each on its own rank, so the overflow verdict
    is agreed over the world (``training.parallel.loss_scaling``). The reference is the same two dp ranks
    with every expert on each (FSDP): the same documents per rank, so the same fp16 magnitudes. (Not one
    process: a rank's backward carries dp times a token's gradient, so fp16 overflows at other scales;
    this MoE model overflows at 2^20 on 2 ranks and not in one process, measured.) On 4 ranks each expert
    has two copies, FSDP-sharded between them: their gradients are DTensors on a mesh of their own."""
    root, data, _, _ = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "steps": 8, "checkpoint_every": 8, "model": MOE_MODEL,
                                                     "precision": "fp16", "loss_scale_init": 2.0**24}}))
    runs = {}
    for name, layout in (("fsdp", {"dp_shard": nproc}), ("ep", {"dp_shard": nproc, "ep": 2})):
        runs[name] = tmp_path / name
        _torchrun(nproc, ["--data", str(data), "--out", str(runs[name]), "--params-file", str(params_file),
                      "--parallel", json.dumps(layout)], module="training.parallel.worker")
    mine, theirs = _records(runs["ep"]), _records(runs["fsdp"])
    assert [(r["skipped"], r["loss_scale"]) for r in mine] == [(r["skipped"], r["loss_scale"]) for r in theirs]
    assert 2 <= sum(r["skipped"] == "overflow:loss_scale" for r in theirs) < 8
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], rel=2e-3)


@pytest.mark.parallel_quick
@pytest.mark.parametrize("kinds", ["plain", "mixed"])
def test_the_loss_scaler_agrees_on_an_overflow_only_one_rank_sees(tmp_path, kinds):
    """Rank 1 alone holds an inf gradient (as an expert's or a pipeline stage's would be): both ranks must
    skip the step and halve the scale. torch's GradScaler steps on rank 0 and keeps its scale (checked
    below), and cannot unscale an optimizer holding plain and DTensor gradients at all."""
    out = tmp_path / "agreed.json"
    _torchrun(2, [str(out), "agreed", kinds], script=HERE / "parallel" / "loss_scaler_worker.py")
    assert json.loads(out.read_text()) == [{"rank": 0, "scale": 512.0, "stepped": False},
                                           {"rank": 1, "scale": 512.0, "stepped": False}]
    if kinds == "plain":  # what the agreement is for
        _torchrun(2, [str(tmp_path / "torch.json"), "torch", kinds], script=HERE / "parallel" / "loss_scaler_worker.py")
        assert json.loads((tmp_path / "torch.json").read_text())[0] == {"rank": 0, "scale": 1024.0, "stepped": True}


MOE_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "ffn": "moe", "n_experts": 4, "moe_topk": 2,
             "moe_hidden": 32, "moe_bias_gamma": 0.01}
# 64 experts, top-2, about 96 tokens per rank and step: every step some expert gets tokens on one
# rank and none on the other, the case data parallel must agree on (join_experts_routed_in_group).
# (Not top-1: its gate is s / s = 1, so the router's gradient is rounding noise that AdamW scales
# up to lr-sized steps, different in every summation order.)
MANY_EXPERTS = {**MOE_MODEL, "n_experts": 64, "moe_topk": 2, "moe_hidden": 8}


@pytest.mark.parametrize("layout", [pytest.param({"dp_shard": 2}, id="fsdp", marks=pytest.mark.parallel_quick),
                                    pytest.param({"dp_replicate": 2, "dp_shard": 1}, id="ddp"),
                                    pytest.param({"dp_replicate": 2, "dp_shard": 1, "zero1": True}, id="zero1"),
                                    pytest.param({"cp": 2, "dp_shard": 1}, id="cp")])
def test_moe_without_expert_parallel_matches_one_process(workspace, tmp_path, layout):
    """Without ep, data parallel owns the experts and reduces what each rank holds, and each step
    some expert is reached on one rank only and some on none. Before: FSDP aborted in gloo at step 1
    (checked again with the join removed: it still does); DDP, and CP over DDP, stopped with "Expected
    to have finished reduction in the prior iteration" (their reducer wants every parameter's gradient).
    Against one process: 5 steps' losses (rtol 1e-5), the final parameters with every expert and the
    balancing bias (atol 2e-5), each document's loss (rtol 1e-5) and ghost gradient norm (rtol 1e-4, as
    for the dense model; under cp an expert with no rows here still takes part in the norms' sums)."""
    root, data, _, _ = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "model": MANY_EXPERTS}}))
    single = tmp_path / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    run = tmp_path / "run"
    _torchrun(2, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                  "--parallel", json.dumps(layout)], module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_params(run, params_file), _final_params(single, params_file)
    assert any(name.endswith("experts.63.w1.weight") for name in theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    tel, ref_tel = _telemetry(run), _telemetry(single)
    assert tel.keys() == ref_tel.keys()  # every document of every step, once
    for key, (loss, norm) in ref_tel.items():
        assert tel[key][0] == pytest.approx(loss, rel=1e-5) and tel[key][1] == pytest.approx(norm, rel=1e-4), key


EVERY_MODE = [
    pytest.param({"dp_replicate": 2, "dp_shard": 1}, id="ddp"),
    pytest.param({"dp_replicate": 2, "dp_shard": 1, "zero1": True}, id="zero1"),
    pytest.param({"dp_shard": 2}, id="fsdp"),
    pytest.param({"tp": 2}, id="tp"),
    pytest.param({"pp": 2, "dp_shard": 1, "pp_microbatches": 2}, id="pp"),
    pytest.param({"cp": 2, "dp_shard": 1}, id="cp"),
    pytest.param({"dp_shard": 2, "ep": 2}, id="ep"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", EVERY_MODE)
def test_bf16_and_fp8_train_in_every_mode_like_one_process(workspace, tmp_path, layout, precision):
    """Each parallel mode on 2 ranks in bf16 and in fp8 (its Linears' forward GEMMs in float8, the rest in
    bf16): the 5-step loss curve of one process in the same precision, to bf16's precision (the layouts sum
    in other orders, and bf16 keeps 8 bits of mantissa)."""
    train_params = {**TINY, "precision": precision, **({"model": MOE_MODEL} if "ep" in layout else {})}
    mine, theirs = _two_ranks_and_one(workspace, tmp_path, layout, train_params)
    assert [r["skipped"] for r in mine] == [r["skipped"] for r in theirs] == [None] * STEPS
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], rel=2e-2)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["precision"] == precision


def _two_ranks_and_one(workspace, tmp_path: Path, layout: dict, train_params: dict) -> tuple[list[dict], list[dict]]:
    """The per-step records of `train_params` run on 2 ranks under `layout` (tmp_path/run) and on one process."""
    root, data, _, _ = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": train_params}))
    single = tmp_path / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    run = tmp_path / "run"
    _torchrun(2, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                  "--parallel", json.dumps(layout)], module="training.parallel.worker")
    return _records(run), _records(single)


def test_a_run_saved_on_four_ranks_resumes_on_two(workspace, tmp_path):
    """DCP reshards: a 4-rank FSDP run rolled back to its step-3 checkpoint and resumed on
    2 ranks gives the single process's 5-step curve and parameters."""
    assert_resumes_resharded(workspace, tmp_path, (4, {"dp_shard": 4}), (2, {"dp_shard": 2}))


def assert_resumes_resharded(workspace, tmp_path: Path, first: tuple[int, dict], then: tuple[int, dict]) -> Path:
    """Train under ``first`` (ranks, layout), roll back to the step-3 checkpoint, resume under
    ``then``: the single process's 5-step curve and final parameters. Returns the params file."""
    import shutil

    root, data, _, single = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "checkpoint_every": 3}}))
    run = tmp_path / "run"
    args = ["--data", str(data), "--out", str(run), "--params-file", str(params_file)]
    _torchrun(first[0], [*args, "--parallel", json.dumps(first[1])], module="training.parallel.worker")
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / f"step-{STEPS:08d}")
    (checkpoints / "latest").write_text("step-00000003\n")
    _torchrun(then[0], [*args, "--resume", "--parallel", json.dumps(then[1])], module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_params(run, params_file), _final_params(single, params_file)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    return params_file


@pytest.mark.parametrize("launcher", ["one machine", "torchrun"])
def test_a_killed_rank_restarts_the_group_from_its_checkpoint(workspace, tmp_path, launcher):
    """--max-restarts 3: SIGKILL one rank after the first checkpoint; the group restarts, resumes
    from that checkpoint with no one involved, and ends on the uninterrupted curve. Both launchers
    `assay train` uses: its own on one machine, and torchrun's c10d rendezvous (what several
    machines use; here one node at a loopback endpoint).

    More than one restart is allowed because a restarted gloo group on this machine sometimes
    fails to connect once (a stale peer address, "Connection refused") and forms on the next try."""
    import re
    import signal
    import time

    root, data, _, _ = workspace
    steps = 12
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "steps": steps, "checkpoint_every": 4}}))
    reference = tmp_path / "reference"
    train(open_version(data), reference, load_params(params_file).train, progress=False)

    run = tmp_path / "run"
    endpoint = None if launcher == "one machine" else f"127.0.0.1:{free_port()}"
    spec = Launch(2, rdzv_endpoint=endpoint, max_restarts=3, parallel={"dp_shard": 2})
    cmd = spec.command(["--data", str(data), "--out", str(run), "--params-file", str(params_file)])
    log = tmp_path / "launcher.log"  # a file, not a pipe: nobody reads a pipe while we wait
    agent = subprocess.Popen(cmd, env=spec.environment(), stdout=log.open("w"),
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while latest_checkpoint(run) is None:
            assert agent.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
        ranks = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        killed_at = json.loads((latest_checkpoint(run) / "trainer.json").read_text())["step"]
        os.kill(int(ranks[-1]), signal.SIGKILL)
        killed = time.time()
        agent.wait(timeout=900)
        output = log.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    assert re.search(r"elastic restart \d: resuming from", output)
    recovered = float(re.search(r"elastic restart: first step \d+ finished at ([\d.]+)", output).group(1))
    print(f"recovery: {recovered - killed:.1f} s from the kill to the first step after it")
    assert killed_at < steps
    assert _history(run) == pytest.approx(_history(reference), rel=1e-5)


def test_the_cli_launches_the_ranks_and_refuses_what_is_not_built(workspace, tmp_path):
    root, data, params_file, single = workspace
    assay = str(Path(sys.executable).parent / "assay")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    run = tmp_path / "run"
    done = subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                           "--nproc", "2", "--dp-shard", "2", "--json"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["parallel"]["mode"] == "fsdp" and metrics["parallel"]["world_size"] == 2
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    refused = subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out",
                              str(tmp_path / "tp"), "--nproc", "4", "--dp-shard", "3", "--tp", "2"],
                             capture_output=True, text=True, env=env, timeout=900)
    # A layout that does not fill the world is refused before any rank starts.
    assert refused.returncode == 1 and "but the world size is 4" in refused.stderr
