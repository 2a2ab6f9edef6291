"""Tensor + sequence parallel against one process, launched for real with torchrun on gloo.

Same tiny model, data and seed as tests/test_parallel.py (its fixtures and helpers are imported,
not copied). tp=2 alone and FSDP dp_shard=2 × tp=2 on 4 ranks must give the single process's
losses for 5 steps (rtol 1e-5), gradients after step 1 and parameters after step 5 (atol 2e-5),
and the same per-document losses (rtol 1e-5) and ghost gradient norms (rtol 1e-4) in telemetry,
each document recorded once. These are test_parallel.py's fp32 tolerances: the tp ranks add the
same terms in another order (row-parallel partial sums, the norms' sequence shards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import test_parallel
from test_parallel import (_final_params, _history, _telemetry, _torchrun, assert_resumes_resharded,
                           assert_step_one_matches)

from assay.errors import AssayError
from training.model import ModelArgs, Transformer
from training.parallel.dims import ParallelDims
from training.parallel.tensor_parallel import check_tensor_parallel, check_tensor_parallel_layout
from training.telemetry import read_telemetry

pytestmark = pytest.mark.parallel
HERE = Path(__file__).parent
workspace = test_parallel.workspace  # its fixture: the data, params and the single-process run


# ------------------------------------------------------------------ pure pieces
def test_tp_refuses_layouts_it_cannot_split_evenly():
    def model(**kw) -> Transformer:
        with torch.device("meta"):
            return Transformer(ModelArgs(**{"vocab_size": 64, "dim": 32, "n_heads": 2, "ffn_hidden": 64,
                                            "max_seq_len": 32, "n_layers": 1, **kw}))

    check_tensor_parallel(model(), 2)  # splits evenly: no error
    with pytest.raises(AssayError, match=r"n_heads 2 is not divisible by tp=4"):
        check_tensor_parallel(model(), 4)
    with pytest.raises(AssayError, match=r"seq_len \(train.seq_len\) 30 is not divisible by tp=4"):
        check_tensor_parallel(model(n_heads=4, max_seq_len=30), 4)
    with pytest.raises(AssayError, match=r"vocabulary \(66 tokens\) is not divisible by tp=4"):
        check_tensor_parallel(model(n_heads=4, vocab_size=66), 4)
    with pytest.raises(AssayError, match="MoE feed-forward layers are not tensor-parallel"):
        check_tensor_parallel(model(ffn="moe", n_experts=2, moe_topk=1), 2)
    with pytest.raises(AssayError, match="tp with DDP"):
        check_tensor_parallel_layout(ParallelDims(dp_replicate=2, dp_shard=1, tp=2, world_size=4))
    check_tensor_parallel_layout(ParallelDims(dp_shard=2, tp=2, world_size=4))
    assert ParallelDims(dp_shard=-1, tp=2, world_size=4).dp_shard == 2


# --------------------------------------------------------- real multi-process runs
def test_ghost_norms_of_a_tensor_parallel_model_equal_the_unsharded_ones(tmp_path):
    """Per-document ghost norms under tp=2 (each rank's shards, summed over tp) against the same
    model unsharded: dense and sparse attention, ghost and materialised Linear norms. rtol 1e-6:
    only fp32 summation order differs."""
    out = tmp_path / "norms.json"
    _torchrun(2, [str(out)], script=HERE / "parallel" / "tp_norms.py")
    results = json.loads(out.read_text())
    assert len(results) == 4
    for r in results:
        case = f"{r['attention']}/{r['method']}"
        assert r["grads_close"], case
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6), case
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-6), case


def _assay_train(params_file: Path, data: Path, run: Path, *flags: str, timeout: int = 900):
    assay = str(Path(sys.executable).parent / "assay")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                           *flags], capture_output=True, text=True, env=env, timeout=timeout)


MODES = [
    pytest.param(2, {"tp": 2}, id="tp-2", marks=pytest.mark.parallel_quick),
    pytest.param(4, {"dp_shard": 2, "tp": 2}, id="fsdp-2x-tp-2"),
]


@pytest.mark.parametrize("nproc,layout", MODES)
def test_tensor_parallel_training_matches_one_process(workspace, nproc, layout, tmp_path):
    root, data, params_file, single = workspace
    assert_step_one_matches(nproc, layout, data, single, params_file, tmp_path)

    run = tmp_path / "run"
    if nproc == 4:  # the command: `assay train --nproc 4 --dp-shard 2 --tp 2`
        done = _assay_train(params_file, data, run, "--nproc", "4", "--dp-shard", "2", "--tp", "2")
        assert done.returncode == 0, done.stderr[-4000:]
    else:
        _torchrun(nproc, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                          "--parallel", json.dumps(layout)], module="training.parallel.worker")
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    # The checkpoint holds DTensor shards; DCP loads them into one process's plain model.
    mine, theirs = _final_params(run, params_file), _final_params(single, params_file)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    tel, ref_tel = _telemetry(run), _telemetry(single)
    assert read_telemetry(run).num_rows == len(tel)  # one record per document and step: tp ranks don't repeat it
    assert tel.keys() == ref_tel.keys()
    for key, (loss, norm) in ref_tel.items():
        assert tel[key][0] == pytest.approx(loss, rel=1e-5) and tel[key][1] == pytest.approx(norm, rel=1e-4)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["parallel"]["world_size"] == nproc and metrics["parallel"]["tp"] == 2
    assert metrics["parallel"]["mode"] == ("fsdp+tp" if nproc == 4 else "tp")


def test_hsdp_by_tp_on_eight_ranks_gives_the_single_process_step(workspace, tmp_path):
    """dp_replicate=2 × dp_shard=2 × tp=2 (a 3-D mesh): step 1's loss and gradients (ghost norms on,
    as the trainer runs it) equal one process's."""
    root, data, params_file, single = workspace
    layout = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    _torchrun(8, [str(data), str(single), str(params_file), json.dumps(layout), str(tmp_path / "got.pt")],
              script=HERE / "parallel" / "grad_worker.py")
    _torchrun(1, [str(data), str(single), str(params_file), "{}", str(tmp_path / "ref.pt")],
              script=HERE / "parallel" / "grad_worker.py")
    got, ref = torch.load(tmp_path / "got.pt"), torch.load(tmp_path / "ref.pt")
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=2e-5, msg=name)


def test_a_tensor_parallel_run_resumes_on_fsdp_and_refuses_heads_it_cannot_split(workspace, tmp_path):
    """DCP reshards DTensor shards: a tp=2 run rolled back to its step-3 checkpoint resumes as FSDP
    on 2 ranks with the single process's 5-step curve and parameters. A tp that does not divide the
    heads is refused before training, with the reason."""
    root, data, _, single = workspace
    params_file = assert_resumes_resharded(workspace, tmp_path, (2, {"tp": 2}), (2, {"dp_shard": 2}))

    refused = _assay_train(params_file, data, tmp_path / "tp4", "--nproc", "4", "--tp", "4")
    assert refused.returncode != 0
    assert "n_heads 2 is not divisible by tp=4" in refused.stderr + refused.stdout
