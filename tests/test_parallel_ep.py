"""Expert parallel (ep == dp_shard, experts sharded over the FSDP ranks) against one process.

- The MoE layer alone, spawned on 2 gloo ranks in float64: each rank routes an unequal
  slice of the tokens; its outputs, input gradients, the router's gradient (summed) and
  its experts' gradients equal one process's to 1e-12, also when one rank's experts get
  no token at all (then their gradients stay None, as in one process).
- Without ep, under FSDP (tests/parallel/moe_fsdp_routing.py): an expert one rank's tokens reach
  and the other's do not gets its reduced gradient on both (1e-12); one no rank routed to keeps None.
- Training with torchrun: step 1's gradients (atol 2e-5), the losses of 5 steps (rtol 1e-5),
  the parameters and the balancing bias after 5 steps (atol 2e-5), as tests/test_parallel.py
  checks the data-parallel modes. The tolerances are fp32's.
- Per-document losses and ghost gradient norms stay exact under ep (rel 1e-5 and 1e-4, as
  tests/test_parallel.py checks the data-parallel modes): step 1's documents' norms (computed
  partly on the ranks holding the experts), also of the experts alone, which are too small a
  share of the whole for its tolerance to see them go wrong, and the telemetry of all 5 steps.
  On 4 ranks step 1 has 3 documents: one rank runs the placeholder row, its experts serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from corpus import stdlib_documents, write_documents
from ports import free_port
from test_parallel import _telemetry, _torchrun
from training.checkpoint import latest_checkpoint, load_checkpoint
from training.parallel.dims import ParallelDims
from training.trainer import build_model, build_optimizer, train

pytestmark = pytest.mark.parallel
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
STEPS = 5

TINY_MOE = {"model": {"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "ffn": "moe", "n_experts": 4,
                      "moe_topk": 2, "moe_hidden": 32, "moe_bias_gamma": 0.01},
            "vocab_size": 320, "seq_len": 32, "batch_size": 6, "steps": STEPS, "lr": 1e-2, "warmup_steps": 2,
            "checkpoint_every": STEPS, "holdout": 0.2, "eval_rows": 16, "device": "cpu",
            "telemetry": {"spike_min_history": 100}}


def test_ep_layouts_are_checked():
    assert ParallelDims(dp_shard=2, ep=2, world_size=2).ep == 2
    assert ParallelDims(dp_shard=4, ep=2, world_size=4).dp == 4  # experts on 2 replicas
    assert ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=4).dp == 4  # HSDP
    with pytest.raises(AssayError, match="must divide"):
        ParallelDims(dp_replicate=2, dp_shard=1, ep=2, world_size=2)
    with pytest.raises(AssayError, match="must divide"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)
    with pytest.raises(AssayError, match="not with tp or cp"):
        ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4)
    assert ParallelDims(dp_shard=2, pp=2, ep=2, world_size=4).ep == 2  # EP × PP (tests/test_parallel_pp.py)


@pytest.mark.parametrize("bias", [pytest.param([0.0] * 4, id="uneven"),
                                  pytest.param([1.0, 1.0, -1.0, -1.0], id="rank-1-gets-nothing",
                                               marks=pytest.mark.parallel_quick)])
def test_dispatch_and_combine_equal_one_process(bias, tmp_path):
    from parallel.ep_dispatch import check

    result = tmp_path / "result"
    mp.spawn(check, args=(2, free_port(), bias, str(result)), nprocs=2)
    got = [(tmp_path / f"result.{r}").read_text().split() for r in range(2)]
    assert all(g[0] == "ok" for g in got)
    # Expert parameters with a gradient on each rank: all 6 on both, or none on rank 1.
    assert [int(g[1]) for g in got] == ([6, 6] if bias[0] == 0 else [6, 0])


@pytest.mark.parallel_quick
def test_fsdp_runs_the_experts_any_rank_routed_to(tmp_path):
    """Without ep, FSDP owns the experts: an expert one rank's tokens reach and another's do not
    must still be reduced on both (see tests/parallel/moe_fsdp_routing.py)."""
    from parallel.moe_fsdp_routing import check

    result = tmp_path / "result"
    mp.spawn(check, args=(2, free_port(), True, str(result)), nprocs=2)
    assert [(tmp_path / f"result.{r}").read_text().split() for r in range(2)] == [["ok"], ["ok"]]


@pytest.mark.parallel_quick
def test_expert_copies_are_sharded_and_run_any_copy_routed_to(tmp_path):
    """ep < dp: each expert's copies are FSDP-sharded over ep_replicate, and an expert one copy's
    ep group routes to and the other's does not still runs on both (tests/parallel/ep_copies_routing.py)."""
    from parallel.ep_copies_routing import WORLD, check

    result = tmp_path / "result"
    mp.spawn(check, args=(WORLD, free_port(), str(result)), nprocs=WORLD)
    assert [(tmp_path / f"result.{r}").read_text().split() for r in range(WORLD)] == [["ok"]] * WORLD


# --------------------------------------------------------- real multi-process runs
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-ep")
    data = write_documents(root / "data", stdlib_documents(14), source="stdlib")
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": TINY_MOE}))
    single = root / "single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    return root, data, params_file, single


def _history(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "history.jsonl").read_text().splitlines()]


def _final_state(run: Path, params_file: Path) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into one process's whole model (every expert, from its owner rank)."""
    from training.tokenizer import load_tokenizer

    params = load_params(params_file).train
    model = build_model(params, load_tokenizer(run).get_vocab_size(), torch.device("cpu"))
    load_checkpoint(latest_checkpoint(run), model, build_optimizer(model, params), {"torch_rng": torch.get_rng_state()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


LAYOUTS = [
    pytest.param(2, {"dp_shard": 2, "ep": 2}, id="fsdp-2-ep-2"),
    pytest.param(4, {"dp_shard": 4, "ep": 2}, id="fsdp-4-ep-2"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, id="hsdp-2x2-ep-2"),
]


@pytest.mark.parametrize("nproc,layout", LAYOUTS)
def test_ep_training_matches_one_process(workspace, nproc, layout, tmp_path):
    root, data, params_file, single = workspace
    copies = nproc // layout["ep"]  # ranks holding each expert
    layout = json.dumps(layout)
    # Step 1's gradients: the union of the ranks' (each holds its own experts).
    out = tmp_path / "grads.pt"
    _torchrun(nproc, [str(data), str(single), str(params_file), layout, str(out)],
              script=HERE / "parallel" / "ep_grads.py")
    _torchrun(1, [str(data), str(single), str(params_file), "{}", str(tmp_path / "ref.pt")],
              script=HERE / "parallel" / "ep_grads.py")
    ranks = [torch.load(f"{out}.{r}") for r in range(nproc)]
    ref = torch.load(tmp_path / "ref.pt.0")
    assert ranks[0]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert ranks[0]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for rank in ranks:  # balancing sees the whole batch's loads on every rank
        for mine, theirs in zip(rank["loads"], ref["loads"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    experts = [n for n in ref["grads"] if ".experts." in n]
    assert experts and all(sum(n in rk["grads"] for rk in ranks) == copies for n in experts)
    for name, g in ref["grads"].items():
        for got in (rk["grads"][name] for rk in ranks if name in rk["grads"]):
            torch.testing.assert_close(got, g, rtol=1e-4, atol=2e-5, msg=name)
    for part in ("doc_norms", "expert_norms"):  # whole per-document norms, and the experts' part alone
        doc_norms = {d: n for rk in ranks for d, n in rk[part].items()}
        assert doc_norms.keys() == ref[part].keys() and len(doc_norms) > 1
        for doc, norm in ref[part].items():
            assert norm > 0 and doc_norms[doc] == pytest.approx(norm, rel=1e-4), (part, doc)

    # Five steps of the real trainer.
    run = tmp_path / "run"
    stderr = _torchrun(nproc, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                           "--parallel", layout], module="training.parallel.worker")
    assert "per-document gradient norms are off" not in stderr
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_state(run, params_file), _final_state(single, params_file)
    assert any(k.endswith("expert_bias") for k in theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    for name in (k for k in theirs if k.endswith("expert_bias")):  # the bias moved, and identically
        assert theirs[name].abs().max() > 0 and torch.equal(mine[name], theirs[name]), name
    # Per-document telemetry: every document of every step once, its loss and gradient norm exact.
    tel, ref_tel = _telemetry(run), _telemetry(single)
    assert tel.keys() == ref_tel.keys()
    for key, (loss, norm) in ref_tel.items():
        assert norm is not None and tel[key][0] == pytest.approx(loss, rel=1e-5), key
        assert tel[key][1] == pytest.approx(norm, rel=1e-4), key
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["parallel"]["ep"] == 2
    reference = json.loads((single / "metrics.json").read_text())
    assert metrics["parameters"] == reference["parameters"]
    assert metrics["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # ZeRO-3 throughout: each rank holds about 1/dp_shard of the parameters and optimizer state, its
    # experts' included (with copies, sharded over all of them; FSDP pads each shard a little).
    shards = json.loads(layout)["dp_shard"]
    for kind in ("parameters", "optimizer"):
        assert metrics["memory_per_rank"][kind] <= 1.05 * reference["memory_per_rank"][kind] / shards, kind


def test_an_ep_run_saved_on_four_ranks_resumes_on_two(workspace, tmp_path):
    """Each expert is written by a rank holding it; a 4-rank ep run rolled back to its step-3
    checkpoint resumes on 2 ranks (each expert now on one rank) on the single process's curve."""
    import shutil

    root, data, _, single = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY_MOE, "checkpoint_every": 3}}))
    run = tmp_path / "run"
    args = ["--data", str(data), "--out", str(run), "--params-file", str(params_file)]
    _torchrun(4, [*args, "--parallel", json.dumps({"dp_shard": 4, "ep": 2})], module="training.parallel.worker")
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / f"step-{STEPS:08d}")
    (checkpoints / "latest").write_text("step-00000003\n")
    _torchrun(2, [*args, "--resume", "--parallel", json.dumps({"dp_shard": 2, "ep": 2})],
              module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_state(run, params_file), _final_state(single, params_file)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)


def test_the_cli_runs_expert_parallel(workspace, tmp_path):
    root, data, params_file, single = workspace
    assay = str(Path(sys.executable).parent / "assay")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    run = tmp_path / "run"
    done = subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                           "--nproc", "2", "--dp-shard", "2", "--ep", "2", "--json"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((run / "metrics.json").read_text())["parallel"]["ep"] == 2
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    refused = subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out",
                              str(tmp_path / "odd"), "--nproc", "2", "--dp-shard", "2", "--ep", "3"],
                             capture_output=True, text=True, env=env, timeout=900)
    assert refused.returncode == 1 and "ep" in refused.stderr
