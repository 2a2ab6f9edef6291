"""Pipeline parallel and its dynamic micro-batch scheduler.

Pure pieces (no marker, they run in `make test`): the split into stages composes to the whole
model; the scheduler's decisions on synthetic timings; the layout checks; the telemetry warning.

Real runs (marker `parallel`), torchrun on gloo with 2 ranks against one process on the same rows
of unequal length, data and seed: the losses of every step (rtol 1e-5), the gradients after
step 1 and the parameters after the last step (atol 2e-5) and each document's loss and gradient
norm (rtol 1e-5; documents with rows in several micro-batches among them),
for every schedule torch 2.13 offers, static and dynamic; `assay train --pp 2 --pp-dynamic` from the
CLI against one process; a pipelined run resumed from its checkpoint. These are test_parallel.py's
fp32 tolerances: the stages add the same terms in another order (micro-batch by micro-batch).

DP × PP (4 ranks: pp=2 × dp=2): FSDP × PP and DDP × PP, every schedule, against one process (step-1
gradients for GPipe/1F1B; losses, parameters, per-document losses, the held-out loss; through
`assay train` once), and a resume resharded from FSDP × PP to DDP × PP. With filler rows: sparse
attention and MoE (its routing counts corrected) under FSDP × PP; the dynamic scheduler under FSDP × PP,
the dp ranks planning together (step 1 re-planned into two passes). EP × PP: MoE experts sharded over
each stage's FSDP ranks (FSDP 2 × PP 2 × EP 2 through `assay train`, FSDP 4 × PP 2 × EP 2 on 8 ranks:
two copies of each expert per stage), with the DP × PP checks plus each step's gradient norm, balance
and the final bias. CP × PP: ring attention (cp 2 × pp 2 through `assay train`, and FSDP 2 × CP 2 × PP 2
on 8 ranks) and sparse attention (cp 2 × pp 2), with the DP × PP checks plus each step's gradient norm.

TP × PP: pp 2 × tp 2 (4 ranks, through `assay train --tp 2 --pp 2`), FSDP × TP × PP (dp_shard 2 × tp 2 ×
pp 2, 8 ranks) and HSDP × TP × PP (2 replicas × 2 shards × tp 2 × pp 2, 16 ranks) with the DP × PP checks
plus each step's gradient norm; a V schedule at tp 2 × pp 2; bf16 at tp 2 × pp 2 against one process in
bf16 (step 1 to rel 2e-5, then to bf16's precision).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from corpus import stdlib_documents, write_documents
from test_parallel import TINY, _final_params, _history, workspace  # noqa: F401
from test_parallel_cp import SPARSE

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from training.model import ModelArgs, Transformer
from training.parallel.dims import ParallelDims
from training.parallel.microbatch import MicroBatchScheduler, Sample, static_plan
from training.parallel.pipeline import (
    SCHEDULES,
    check_pipeline_layout,
    split_layers,
    split_model,
    stage_ids,
    valid_microbatches,
)
from training.telemetry import read_telemetry
from training.trainer import train

HERE = Path(__file__).parent


# ------------------------------------------------------------------ the split
def test_layers_split_evenly_and_stages_sit_where_the_schedules_want_them():
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(AssayError, match="4 pipeline stages need at least 4 layers"):
        split_layers(3, 4)
    assert stage_ids("1F1B", 2, 1) == [1]
    assert stage_ids("Interleaved1F1B", 2, 0) == [0, 2]  # looped
    assert stage_ids("ZBVZeroBubble", 2, 0) == [0, 3]  # V: rank 0 holds the first and the last
    assert not valid_microbatches("1F1B", 1, 2) and valid_microbatches("1F1B", 2, 2)
    assert not valid_microbatches("DualPipeV", 3, 2) and valid_microbatches("DualPipeV", 4, 2)
    with pytest.raises(AssayError, match="not one of"):
        stage_ids("Zigzag", 2, 0)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_stages_chained_compute_the_whole_model(schedule):
    """Each rank's pruned copy keeps its own blocks under their original names, and running the
    stages in order gives the unsplit model's logits exactly."""
    args = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_hidden=64, max_seq_len=16)
    whole = Transformer(args)
    whole.init_weights(seed=0)
    stages = {}
    names = set()
    for rank in range(2):
        part = copy.deepcopy(whole)
        stages.update(split_model(part, schedule, 2, rank))
        names |= {n for n, _ in part.named_parameters()}
        assert part.tok_embeddings is None or 0 in stage_ids(schedule, 2, rank)
    assert names == {n for n, _ in whole.named_parameters()}
    tokens = torch.randint(0, 64, (3, 16))
    h = tokens
    for s in sorted(stages):
        h = stages[s](h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)


# -------------------------------------------------------------- the scheduler
def _samples(cost, shapes, stages=(0, 1), nbytes=lambda m, w: 1000.0 * m * w):
    """Synthetic measurements: every stage takes cost(m, w) forward and twice that backward."""
    return [Sample(s, m, w, cost(m, w), 2 * cost(m, w), nbytes(m, w)) for s in stages for m, w in shapes]


def _scheduler(**kw) -> MicroBatchScheduler:
    return MicroBatchScheduler(**{"schedule": "1F1B", "pp": 2, "stage_rank": [0, 1], "full_width": 64,
                                  "valid_microbatches": lambda m: m >= 2, **kw})


def _covers(plan, n_rows):
    assert plan.rows() == list(range(n_rows))  # every row once, fillers apart
    for p in plan.passes:
        assert len({len(mb) for mb in p.microbatches}) == 1  # one shape per pass


def test_the_scheduler_waits_for_measurements_then_plans_every_row_once():
    sched = _scheduler()
    assert sched.plan([10] * 8) is None  # nothing measured yet: the caller runs its static plan
    sched.observe(_samples(lambda m, w: 1e-4 + 1e-6 * m * w, [(2, 64), (1, 64), (4, 32)]))
    plan = sched.plan([64, 5, 64, 7, 30, 64, 3, 9])
    _covers(plan, 8)
    assert plan == sched.plan([64, 5, 64, 7, 30, 64, 3, 9])  # deterministic: every rank agrees


def test_short_rows_run_narrow_in_their_own_pass_when_padding_costs_more_than_a_flush():
    """Half the rows are full (64 positions), half have 4: one full-width pass computes 50% padding.
    With compute proportional to positions the scheduler gives the short rows a narrow pass."""
    sched = _scheduler()
    sched.observe(_samples(lambda m, w: 1e-3 * m * w / 64, [(1, 64), (2, 64), (2, 16), (4, 16)]))
    lengths = [64] * 8 + [4] * 8
    plan = sched.plan(lengths)
    _covers(plan, 16)
    assert sorted(p.width for p in plan.passes) == [16, 64]
    static = static_plan(16, 4, 64)  # 4 micro-batches of 4 full-width rows: (4 + 1) slots of 12 ms
    assert sched.predict(static)[0] == pytest.approx(0.06, rel=1e-6)
    assert plan.predicted_seconds < 0.06 / 1.05
    assert sched.plan(lengths, baseline=static) == plan  # far faster: the baseline is left


def test_the_baseline_plan_stays_unless_the_gain_clears_the_margin():
    sched = _scheduler(margin=0.10)
    sched.observe(_samples(lambda m, w: 1e-5 * m * w, [(1, 64), (4, 64), (8, 64)]))
    best = sched.plan([64] * 16)
    baseline = static_plan(16, 8, 64)  # 8 micro-batches: predicted ~6% slower than the best 16
    assert best.passes[0].n_microbatches == 16
    kept = sched.plan([64] * 16, baseline=baseline)
    assert kept.passes == baseline.passes and kept.predicted_seconds == pytest.approx(sched.predict(baseline)[0])


def test_per_microbatch_overhead_and_fill_set_how_many_microbatches():
    """A large fixed cost per micro-batch favours few big ones; a large fill (bubble) favours many."""
    lengths = [64] * 16
    heavy = _scheduler()
    heavy.observe(_samples(lambda m, w: 0.05 + 1e-5 * m * w, [(1, 64), (4, 64), (8, 64)]))
    light = _scheduler()
    light.observe(_samples(lambda m, w: 1e-5 * m * w, [(1, 64), (4, 64), (8, 64)]))
    n_heavy = heavy.plan(lengths).passes[0].n_microbatches
    n_light = light.plan(lengths).passes[0].n_microbatches
    assert n_heavy == 2 and n_light == 16


def test_fill_and_per_microbatch_overhead_are_fitted_to_wall_times():
    """Passes' wall times = (M + fill) × compute + M × overhead: the scheduler recovers both, and a
    costly overhead (P2P, the schedule's own work) then pushes it to fewer micro-batches."""
    cost = lambda m, w: 1e-3 * m  # noqa: E731
    sched = _scheduler()
    sched.observe(_samples(cost, [(1, 64), (2, 64), (4, 64)]))
    assert sched.overheads() == (1, 0.0)  # nothing measured: 1F1B's pp - 1 slots, no overhead
    assert sched.plan([64] * 8).passes[0].n_microbatches == 8
    walls = [(static_plan(8, m, 64).passes[0], (m + 3) * 3 * cost(8 // m, 64) + m * 0.004) for m in (2, 4, 8)]
    sched.observe([], walls)
    fill, overhead = sched.overheads()
    assert fill == pytest.approx(3.0, rel=1e-6) and overhead == pytest.approx(0.004, rel=1e-6)
    # (M + 3) × 3 ms × 8/M + 4 ms × M: 4 micro-batches now beat 8.
    assert sched.plan([64] * 8).passes[0].n_microbatches == 4


def test_the_memory_cap_bounds_live_activations():
    """1F1B holds min(M, pp) micro-batches' activations per rank: under a cap it cuts finer."""
    lengths = [64] * 16
    shapes = [(1, 64), (4, 64), (8, 64)]
    cost = lambda m, w: 0.01 + 1e-5 * m * w  # noqa: E731
    free = _scheduler()
    free.observe(_samples(cost, shapes))
    assert free.plan(lengths).passes[0].shape == (2, 8, 64)  # overhead-bound: few, big micro-batches
    # Without a configured cap, the first peak observed (the static plan's) becomes the cap.
    cap = 2 * 2 * 64 * 1000.0  # 2 in flight × 2 rows × 64 positions × 1000 B
    capped = _scheduler()
    capped.observe(_samples(cost, shapes), peak_bytes=cap)
    plan = capped.plan(lengths)
    assert plan.passes[0].shape == (8, 2, 64)
    assert plan.predicted_peak_bytes == pytest.approx(cap, rel=1e-6)
    tight = _scheduler(memory_cap=10.0)
    tight.observe(_samples(cost, shapes))
    assert tight.plan(lengths) is None  # nothing fits: the pipeline runs its static plan


def test_without_trimming_passes_stay_full_width_and_fillers_round_up():
    """Sparse attention's block layout and MoE's routing counts (padding positions route in one
    process too) keep every pass at full width; filler rows may still round a micro-batch up."""
    # An even number of micro-batches (as an interleaved schedule may need): 7 rows cannot split.
    sched = _scheduler(trim=False, valid_microbatches=lambda m: m % 2 == 0)
    sched.observe(_samples(lambda m, w: 1e-3 * m * w / 64, [(1, 64), (2, 64), (2, 16)]))
    plan = sched.plan([64] * 6 + [4] * 6)
    assert [p.width for p in plan.passes] == [64]
    plan = sched.plan([64] * 7)
    _covers(plan, 7)
    assert [p.width for p in plan.passes] == [64]
    assert any(r < 0 for p in plan.passes for mb in p.microbatches for r in mb)


# ----------------------------------------------------------- checks, telemetry
def test_pipeline_layouts_that_cannot_run_are_refused():
    params = load_params(None).train
    bad = lambda **kw: type(params)(**{**params.__dict__, "parallel": type(params.parallel)(  # noqa: E731
        **{**params.parallel.__dict__, **kw})})
    check_pipeline_layout(ParallelDims(tp=2, pp=2, world_size=4), params)  # TP × PP runs (below)
    check_pipeline_layout(ParallelDims(dp_shard=2, tp=2, pp=2, world_size=8), params)  # FSDP × TP × PP
    with pytest.raises(AssayError, match="pp_dynamic does not run with tp > 1"):
        check_pipeline_layout(ParallelDims(tp=2, pp=2, world_size=4), bad(pp_dynamic=True))
    check_pipeline_layout(ParallelDims(cp=2, pp=2, world_size=4), params)  # CP × PP runs (below)
    check_pipeline_layout(ParallelDims(dp_shard=2, cp=2, pp=2, world_size=8), params)
    with pytest.raises(AssayError, match="pp_dynamic does not run with cp > 1"):
        check_pipeline_layout(ParallelDims(cp=2, pp=2, world_size=4), bad(pp_dynamic=True))
    with pytest.raises(AssayError, match="context parallel combines with data parallel and pp only today, not with tp"):
        ParallelDims(tp=2, pp=2, cp=2, world_size=8)
    check_pipeline_layout(ParallelDims(dp_shard=2, pp=2, ep=2, world_size=4), params)  # EP × PP runs (below)
    with pytest.raises(AssayError, match="expert parallel combines with data parallel and pp only today, not with tp or cp"):
        ParallelDims(dp_shard=2, tp=2, pp=2, ep=2, world_size=8)
    check_pipeline_layout(ParallelDims(dp_shard=2, pp=2, world_size=4), params)  # DP × PP runs (below)
    check_pipeline_layout(ParallelDims(dp_replicate=2, pp=2, world_size=4), params)
    check_pipeline_layout(ParallelDims(dp_shard=2, pp=2, world_size=4), bad(pp_dynamic=True))  # (below)
    check_pipeline_layout(ParallelDims(dp_shard=1, pp=2, world_size=2), bad(pp_dynamic=True))
    check_pipeline_layout(ParallelDims(dp_replicate=2, dp_shard=2, pp=2, world_size=8), params)  # HSDP × PP (below)
    model = lambda **kw: type(params)(**{**params.__dict__, "model": type(params.model)(  # noqa: E731
        **{**params.model.__dict__, **kw})})
    for changes in ({"attention": "sparse"}, {"ffn": "moe"}):  # DP × PP runs them (below)
        check_pipeline_layout(ParallelDims(dp_shard=2, pp=2, world_size=4), model(**changes))
    with pytest.raises(AssayError, match="not one of"):
        check_pipeline_layout(ParallelDims(dp_shard=1, pp=2, world_size=2), bad(pp_schedule="Zigzag"))
    with pytest.raises(AssayError, match="cannot run pp_microbatches=1"):
        check_pipeline_layout(ParallelDims(dp_shard=1, pp=2, world_size=2), bad(pp_microbatches=1))
    check_pipeline_layout(ParallelDims(dp_shard=1, pp=2, world_size=2), params)


# --------------------------------------------------------- real multi-process runs
def _run(config: dict, out: Path, nproc: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(HERE / "parallel" / "pp_worker.py")
    cmd = [sys.executable, script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    done = subprocess.run([*cmd, json.dumps(config), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out)


#: Row r belongs to document r % 12, so a batch of 8 rows holds documents split over micro-batches
#: (and, re-planned, over passes of different widths): their gradient norms need the cross terms.
BASE = {"steps": 4, "batch": 8, "docs": 12, "norms": True}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(BASE, tmp_path_factory.mktemp("pp") / "ref.pt", 1)


def _assert_same(got: dict, ref: dict) -> None:
    assert [x[0] for x in got["losses"]] == pytest.approx([x[0] for x in ref["losses"]], rel=1e-5)
    assert [x[1] for x in got["losses"]] == pytest.approx([x[1] for x in ref["losses"]], rel=1e-5)  # clip norms
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=2e-5, msg=name)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-4, atol=2e-5, msg=name)
    assert got["doc_losses"].keys() == ref["doc_losses"].keys()
    for key, loss in ref["doc_losses"].items():
        assert got["doc_losses"][key] == pytest.approx(loss, rel=1e-5), key
    assert got["doc_norms"].keys() == ref["doc_norms"].keys() and ref["doc_norms"]
    for key, norm in ref["doc_norms"].items():
        assert got["doc_norms"][key] == pytest.approx(norm, rel=1e-5), key


RUNS = [
    pytest.param("1F1B", True, id="1F1B-dynamic", marks=pytest.mark.parallel_quick),
    pytest.param("GPipe", False, id="GPipe"),
    pytest.param("1F1B", False, id="1F1B"),
    pytest.param("GPipe", True, id="GPipe-dynamic"),
    *[pytest.param(s, d, id=f"{s}{'-dynamic' if d else ''}") for s in SCHEDULES if s not in ("GPipe", "1F1B")
      for d in (False, True)],
]


@pytest.mark.parallel
@pytest.mark.parametrize("schedule,dynamic", RUNS)
def test_a_pipelined_run_matches_one_process(reference, schedule, dynamic, tmp_path):
    got = _run({**BASE, "schedule": schedule, "microbatches": 4, "dynamic": dynamic, "prime": dynamic},
               tmp_path / "pp.pt", 2)
    _assert_same(got, reference)
    if dynamic:  # step 1 ran re-planned (primed scheduler): narrower passes than the static (4, 2, 32)
        assert any(tuple(s)[2] < 32 for s in got["plans"][0]), got["plans"]
    else:
        assert all(tuple(s) == (4, 2, 32) for plan in got["plans"] for s in plan), got["plans"]


@pytest.mark.parallel
def test_assay_train_runs_pp_with_the_dynamic_scheduler(workspace, tmp_path):  # noqa: F811
    """`assay train --nproc 2 --pp 2 --pp-schedule 1F1B --pp-dynamic` against one process: losses
    for 5 steps, parameters after 5 (its DCP checkpoint, loaded into one whole model: the stages'
    parameters keep their names), per-document losses and gradient norms."""
    root, data, params_file, single = workspace
    run = tmp_path / "run"
    assay = str(Path(sys.executable).parent / "assay")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run([assay, "--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                           "--nproc", "2", "--pp", "2", "--pp-schedule", "1F1B", "--pp-dynamic"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "per-document gradient norms are off" not in done.stderr
    assert_run_matches_single(run, single, params_file)
    metrics = json.loads((run / "metrics.json").read_text())
    single_metrics = json.loads((single / "metrics.json").read_text())
    assert metrics["parallel"]["mode"] == "pp" and metrics["parameters"] == single_metrics["parameters"]
    assert metrics["val_loss"] == pytest.approx(single_metrics["val_loss"], rel=1e-5)



@pytest.mark.parallel
def test_a_pipelined_run_resumes_from_its_checkpoint(workspace, tmp_path):  # noqa: F811
    """pp=2 saved at step 3, rolled back to it and resumed on pp=2: the single process's 5-step curve.
    Each stage's optimizer hyperparameters come back although rank 0 alone wrote them by its names."""
    import shutil

    import yaml

    from test_parallel import TINY, _torchrun

    root, data, _, single = workspace
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "checkpoint_every": 3}}))
    run = tmp_path / "run"
    args = ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
            "--parallel", json.dumps({"pp": 2, "pp_dynamic": True})]
    _torchrun(2, args, module="training.parallel.worker")
    shutil.rmtree(run / "checkpoints" / "step-00000005")
    (run / "checkpoints" / "latest").write_text("step-00000003\n")
    _torchrun(2, [*args, "--resume"], module="training.parallel.worker")
    assert_run_matches_single(run, single, params_file, documents=False)



def assert_run_matches_single(run: Path, single: Path, params_file: Path, documents: bool = True) -> None:
    """A pipelined run against the single-process one: the loss curve (rtol 1e-5) and the final
    parameters (atol 2e-5); with ``documents``, also every document's loss and gradient norm at every
    step, once (the last stage writes it), rtol 1e-5."""
    assert _history(run) == pytest.approx(_history(single), rel=1e-5)
    mine, theirs = _final_params(run, params_file), _final_params(single, params_file)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=2e-5, msg=name)
    if documents:
        tel, ref = read_telemetry(run), read_telemetry(single)
        got = dict(zip(zip(tel["step"].to_pylist(), tel["sample_id"].to_pylist()), tel["loss"].to_pylist()))
        want = dict(zip(zip(ref["step"].to_pylist(), ref["sample_id"].to_pylist()), ref["loss"].to_pylist()))
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx([want[k] for k in got], rel=1e-5)
        got = dict(zip(zip(tel["step"].to_pylist(), tel["sample_id"].to_pylist()), tel["grad_norm"].to_pylist()))
        want = dict(zip(zip(ref["step"].to_pylist(), ref["sample_id"].to_pylist()), ref["grad_norm"].to_pylist()))
        assert None not in want.values()
        assert list(got.values()) == pytest.approx([want[k] for k in got], rel=1e-5)

# ------------------------------------------------------------------ DP × PP (4 ranks)
def _assay_train(args: list[str], timeout: int = 900) -> str:
    """`assay train` as a user runs it (it launches torchrun); returns stderr."""
    assay = str(Path(sys.executable).parent / "assay")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([assay, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stderr


DP_PP = [  # (ranks, layout, the `assay train` flags that give it; None: launched through the worker module)
    pytest.param(4, {"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
                 ["--dp-shard", "2", "--pp", "2", "--pp-schedule", "1F1B"], id="fsdp2xpp2-1F1B-cli"),
    pytest.param(4, {"dp_shard": 2, "pp": 2, "pp_schedule": "GPipe"}, None, id="fsdp2xpp2-GPipe"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 1, "pp": 2, "pp_schedule": "1F1B"}, None, id="ddp2xpp2-1F1B"),
    pytest.param(8, {"dp_replicate": 2, "dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"}, None, id="hsdp2x2xpp2-1F1B"),
]


@pytest.mark.parallel
@pytest.mark.parametrize("nproc,layout,flags", DP_PP)
def test_dp_times_pp_matches_one_process(workspace, nproc, layout, flags, tmp_path):  # noqa: F811
    """Pipeline stages each wrapped with data parallelism over their dp sub-mesh (FSDP2, HSDP, or
    FSDP-style replicate), 4 ranks (pp=2 × dp=2) or 8 (pp=2 × 2 replicas × 2 shards), against one process: step 1's loss and every
    gradient (tests/parallel/pp_dp_grads.py, shards and stages gathered), then 5 steps of the real
    trainer: losses (rtol 1e-5), parameters from its DCP checkpoint (atol 2e-5), each document's
    loss and gradient norm (rtol 1e-5; the last stage of each dp rank writes its own documents), the
    held-out loss and the parameter count. Step 2's batch holds one document:
    the second dp rank runs the masked placeholder row through its pipeline."""
    metrics = _layout_matches_one_process(workspace, nproc, layout, flags, tmp_path)
    fsdp, ddp = layout.get("dp_shard", 1) > 1, layout.get("dp_replicate", 1) > 1
    mode = ("hsdp+pp" if ddp else "fsdp+pp") if fsdp else "ddp+pp"
    assert metrics["parallel"]["mode"] == mode and metrics["parallel"]["world_size"] == nproc


def _layout_matches_one_process(workspace, nproc: int, layout: dict, flags: list[str] | None,  # noqa: F811
                                tmp_path: Path, fillers: bool | None = None, prime: bool = False) -> dict:
    """Step 1's loss and gradients, then 5 trainer steps of ``layout`` against one process (see
    test_dp_times_pp_matches_one_process); returns the run's metrics. ``fillers``: whether step
    1's plans must (True) or must not (False) pad a micro-batch with filler rows. ``prime``: step
    1's dynamic scheduler starts from synthetic measurements (it re-plans step 1); its plans, one
    per rank, are returned as metrics["step1_plans"]."""
    from test_parallel import _torchrun

    root, data, params_file, single = workspace
    grads_file, ref_file = tmp_path / "grads.pt", tmp_path / "ref.pt"
    _torchrun(nproc, [str(data), str(single), str(params_file), json.dumps(layout), str(grads_file),
                      *(["prime"] if prime else [])], script=HERE / "parallel" / "pp_dp_grads.py")
    _torchrun(1, [str(data), str(single), str(params_file), "{}", str(ref_file)],
              script=HERE / "parallel" / "grad_worker.py")
    got, ref = torch.load(grads_file), torch.load(ref_file)
    if fillers is not None:
        assert (got["fillers"] > 0) == fillers, got["fillers"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=2e-5, msg=name)

    run = tmp_path / "run"
    if flags is None:
        stderr = _torchrun(nproc, ["--data", str(data), "--out", str(run), "--params-file", str(params_file),
                                   "--parallel", json.dumps(layout)], module="training.parallel.worker")
    else:
        stderr = _assay_train(["--params", str(params_file), "train", "--data", str(data), "--out", str(run),
                               "--nproc", str(nproc), *flags])
    assert "per-document gradient norms are off" not in stderr  # every layout measures them
    assert_run_matches_single(run, single, params_file)
    metrics = json.loads((run / "metrics.json").read_text())
    single_metrics = json.loads((single / "metrics.json").read_text())
    assert metrics["parameters"] == single_metrics["parameters"]
    assert metrics["val_loss"] == pytest.approx(single_metrics["val_loss"], rel=1e-5)
    return {**metrics, "step1_plans": got["plans"]}


#: Models whose passes stay full width, with the changes from the tiny dense one (MoE's balancing
#: bias moves by 0.01 a step, so a miscount shows in its final value).
FULL_WIDTH_MODELS = {"sparse": SPARSE, "moe": {"ffn": "moe", "n_experts": 4, "moe_topk": 2, "moe_hidden": 32,
                                               "moe_bias_gamma": 0.01}}


def _full_width_single(workspace, name: str) -> tuple:  # noqa: F811
    """workspace's documents with FULL_WIDTH_MODELS[name], trained in one process (once per module)."""
    root, data, _, _ = workspace
    params_file = root / f"{name}-params.yaml"
    single = root / f"{name}-single"
    if not (single / "metrics.json").exists():
        model = {**TINY["model"], **FULL_WIDTH_MODELS[name]}
        params_file.write_text(yaml.safe_dump({"train": {**TINY, "model": model}}))
        train(open_version(data), single, load_params(params_file).train, progress=False)
    return root, data, params_file, single


@pytest.fixture(scope="module", params=sorted(FULL_WIDTH_MODELS))
def full_width_workspace(request, workspace):  # noqa: F811
    """workspace's documents with sparse attention (blocks of 8 in rows of 32) or MoE, one process."""
    return _full_width_single(workspace, request.param)


@pytest.mark.parallel
def test_sparse_attention_and_moe_under_dp_times_pp_match_one_process(full_width_workspace, tmp_path):
    """`assay train --nproc 4 --dp-shard 2 --pp 2` on a sparse-attention or an MoE model: each dp
    rank's rows are rounded up to whole micro-batches with filler rows (step 1's plans hold some:
    asserted). Sparse attention, per row like dense, never mixes them with real rows; MoE's routing
    counts have the fillers' tokens taken back out after each micro-batch's forward, and are added
    over dp, so the balancing bias moves as in one process (checked through the final parameters,
    which include it). test_dp_times_pp's checks against one process with the same model: step 1's
    gradients, 5 steps' losses, parameters, per-document losses, held-out loss."""
    metrics = _layout_matches_one_process(
        full_width_workspace, 4, {"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        ["--dp-shard", "2", "--pp", "2", "--pp-schedule", "1F1B"], tmp_path, fillers=True)
    assert metrics["parallel"]["mode"] == "fsdp+pp"
    from test_parallel import _records

    single = full_width_workspace[3]
    if json.loads((single / "metrics.json").read_text())["ffn"] == "moe":
        # The balance reported per step and the bias at the end: over every stage's layers.
        want = [r["moe_max_over_mean"] for r in _records(single)]
        assert [r["moe_max_over_mean"] for r in _records(tmp_path / "run")] == pytest.approx(want, rel=1e-6)
        single_metrics = json.loads((single / "metrics.json").read_text())
        assert metrics["moe_bias_abs_max"] == pytest.approx(single_metrics["moe_bias_abs_max"], rel=1e-6)


EP_PP = [  # (ranks, layout, `assay train` flags (None: the worker module under torchrun))
    pytest.param(4, {"dp_shard": 2, "pp": 2, "ep": 2, "pp_schedule": "1F1B"},
                 ["--dp-shard", "2", "--pp", "2", "--ep", "2", "--pp-schedule", "1F1B"], id="fsdp2xpp2-ep2-cli"),
    # Two copies of each expert per stage (ep_replicate 2): their gradients are summed over the copies.
    pytest.param(8, {"dp_shard": 4, "pp": 2, "ep": 2, "pp_schedule": "1F1B"}, None, id="fsdp4xpp2-ep2"),
]


@pytest.mark.parallel
@pytest.mark.parametrize("nproc,layout,flags", EP_PP)
def test_expert_parallel_under_dp_times_pp_matches_one_process(workspace, nproc, layout, flags, tmp_path):  # noqa: F811
    """`assay train --nproc 4 --dp-shard 2 --pp 2 --ep 2` on the MoE model: each stage's two dp
    ranks hold half of its layers' experts and exchange routed tokens (all-to-all within the
    stage), while the pipeline sends activations between stages (on 8 ranks, dp_shard 4, two
    copies of each expert per stage). Step 1's plans pad with filler
    rows (asserted), whose tokens are routed to other ranks' experts and taken back out of the
    counts; experts are left out of FSDP, their squared gradient norms added over the stage's ep
    ranks and then over the stages. Against one process: step 1's gradients (each expert's from
    its owner rank), 5 steps' losses, the parameters (every expert and the balancing bias), per-
    document losses, the held-out loss, the parameter count (each expert once), the per-step
    balance and the final bias."""
    moe = _full_width_single(workspace, "moe")
    metrics = _layout_matches_one_process(moe, nproc, layout, flags, tmp_path, fillers=True)
    assert metrics["parallel"]["mode"] == "fsdp+pp" and metrics["parallel"]["ep"] == 2
    from test_parallel import _records

    single = moe[3]
    want = [r["moe_max_over_mean"] for r in _records(single)]
    assert [r["moe_max_over_mean"] for r in _records(tmp_path / "run")] == pytest.approx(want, rel=1e-6)
    # Each step's clipped gradient norm: experts counted once each, on their owner rank.
    assert [r["grad_norm"] for r in _records(tmp_path / "run")] == pytest.approx(
        [r["grad_norm"] for r in _records(single)], rel=1e-5)
    single_metrics = json.loads((single / "metrics.json").read_text())
    assert metrics["moe_bias_abs_max"] == pytest.approx(single_metrics["moe_bias_abs_max"], rel=1e-6)


CP_PP = [  # (ranks, model (None: dense), layout, `assay train` flags (None: the worker module), mode)
    pytest.param(4, None, {"cp": 2, "pp": 2, "pp_schedule": "1F1B"}, ["--cp", "2", "--pp", "2", "--pp-schedule", "1F1B"],
                 "cp+pp", id="cp2xpp2-ring-cli"),
    pytest.param(4, "sparse", {"cp": 2, "pp": 2, "pp_schedule": "GPipe"}, None, "cp+pp", id="cp2xpp2-sparse"),
    pytest.param(8, None, {"dp_shard": 2, "cp": 2, "pp": 2, "pp_schedule": "1F1B"}, None, "fsdp+cp+pp",
                 id="fsdp2xcp2xpp2-ring"),
]


@pytest.mark.parallel
@pytest.mark.parametrize("nproc,model,layout,flags,mode", CP_PP)
def test_context_parallel_under_pp_matches_one_process(workspace, nproc, model, layout, flags, mode,  # noqa: F811
                                                       tmp_path):
    """Context parallel inside pipeline stages: each cp rank of a stage holds its share of every
    row's positions (zig-zag for ring attention, contiguous for sparse attention), which is what the
    stages send and receive; attention exchanges keys within the stage's cp group, and the cp ranks'
    gradients are averaged with the dp ranks' (DDP over cp, or FSDP over dp_shard × cp). Against one
    process: step 1's gradients, 5 steps' losses and clip norms, parameters, per-document losses (the
    last stage's first cp rank writes them, summed over cp), the held-out loss (whole rows, eval mode)."""
    ws = workspace if model is None else _full_width_single(workspace, model)
    metrics = _layout_matches_one_process(ws, nproc, layout, flags, tmp_path)
    assert metrics["parallel"]["mode"] == mode and metrics["parallel"]["cp"] == 2
    from test_parallel import _records

    assert [r["grad_norm"] for r in _records(tmp_path / "run")] == pytest.approx(
        [r["grad_norm"] for r in _records(ws[3])], rel=1e-5)


@pytest.fixture(scope="module")
def short_workspace(workspace):  # noqa: F811
    """workspace's documents cut to 20-140 characters, so that rows have unequal lengths (a
    document's last row is short), with the tiny dense model trained on them in one process, 12
    rows a step (a few short rows per dp rank to bucket)."""
    root = workspace[0]
    cut = [(name, text[:20 + (23 * i) % 120]) for i, (name, text) in enumerate(stdlib_documents(14))]
    data = write_documents(root / "short-data", cut, source="stdlib")
    params_file = root / "short-params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "batch_size": 12}}))
    single = root / "short-single"
    train(open_version(data), single, load_params(params_file).train, progress=False)
    return root, data, params_file, single


@pytest.mark.parallel
def test_the_dynamic_scheduler_under_dp_times_pp_matches_one_process(short_workspace, tmp_path):
    """`assay train --nproc 4 --dp-shard 2 --pp 2 --pp-dynamic`: the two dp ranks of each stage plan
    their own rows together (`MicroBatchScheduler.plan_together`): the same number of passes and
    micro-batches per pass, so that FSDP's collectives pair up, each with its own rows and widths.
    Step 1 from a primed scheduler runs re-planned (several passes, a narrower one: asserted) and
    gives one process's loss and gradients; then test_dp_times_pp's 5-step checks (the trainer's
    scheduler plans from what the stages measure)."""
    metrics = _layout_matches_one_process(
        short_workspace, 4, {"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B", "pp_dynamic": True},
        ["--dp-shard", "2", "--pp", "2", "--pp-schedule", "1F1B", "--pp-dynamic"], tmp_path, prime=True)
    assert metrics["parallel"]["mode"] == "fsdp+pp"
    plans = metrics["step1_plans"]  # per rank: (micro-batches, rows, width) per pass
    structure = {tuple(m for m, _, _ in plan) for plan in plans}
    assert len(structure) == 1, plans  # the same passes and micro-batch counts on every rank
    assert len(plans[0]) > 1 and any(w < 32 for plan in plans for _, _, w in plan), plans


TP_PP = [  # (ranks, layout, `assay train` flags (None: the worker module under torchrun), the run's mode)
    pytest.param(4, {"tp": 2, "pp": 2, "pp_schedule": "1F1B"}, ["--tp", "2", "--pp", "2"],
                 "tp+pp", id="tp2xpp2-1F1B-cli"),
    pytest.param(8, {"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1F1B"}, None,
                 "fsdp+tp+pp", id="fsdp2xtp2xpp2-1F1B"),
    # 16 ranks: 134 s on a 2-core machine (159 s while it was shared).
    pytest.param(16, {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1F1B"}, None,
                 "hsdp+tp+pp", id="hsdp2x2xtp2xpp2-1F1B"),
]


@pytest.mark.parallel
@pytest.mark.parametrize("nproc,layout,flags,mode", TP_PP)
def test_tp_times_pp_matches_one_process(workspace, nproc, layout, flags, mode, tmp_path):  # noqa: F811
    """Each pipeline stage's pruned model tensor + sequence parallel over its tp sub-mesh (and, on 8
    ranks, FSDP2 over dp_shard too: FSDP × TP × PP; on 16, HSDP over 2 replicas × 2 shards), against
    one process with test_dp_times_pp's checks: step 1's loss and every gradient (atol 2e-5), 5 trainer
    steps' losses and gradient norms (rtol 1e-5), parameters after step 5 (atol 2e-5), each document's
    loss recorded once (by the last stage's first tp rank), the held-out loss. Between stages each tp
    rank sends and receives its (rows, 32 / 2, dim) sequence shard of the residual stream. `assay train
    --nproc 4 --tp 2 --pp 2` with params.yaml's dp_shard -1 (here 1) is the CLI case."""
    from test_parallel import _records

    metrics = _layout_matches_one_process(workspace, nproc, layout, flags, tmp_path)
    assert metrics["parallel"]["mode"] == mode and metrics["parallel"]["world_size"] == nproc
    assert metrics["parallel"]["tp"] == 2 and metrics["parallel"]["pp"] == 2
    single, run = workspace[3], tmp_path / "run"
    # Each step's clipped gradient norm: tp shards add, tp-replicated weights (the norms') count once.
    assert [r["grad_norm"] for r in _records(run)] == pytest.approx([r["grad_norm"] for r in _records(single)],
                                                                     rel=1e-5)
    assert read_telemetry(run).num_rows == read_telemetry(single).num_rows  # not once per tp rank


@pytest.mark.parallel
def test_bf16_tp_times_pp_trains_like_one_process_in_bf16(workspace, tmp_path):  # noqa: F811
    """bf16 (autocast) at tp 2 × pp 2 on 4 ranks against one process in bf16 on the same data.

    Under autocast the residual stream stays fp32 (the embedding's output plus bf16 branch outputs),
    so the stage boundary carries fp32 and the stages' static metadata must say so (the probe in
    ``Pipeline._activation_dtypes`` runs under the step's autocast); only the row-parallel Linears
    (wo, w2) round differently, their tp partial sums each rounded to bf16 before the reduction.

    Tolerances. Step 1 (before any update): the step loss and each document's loss to rel 2e-5
    (measured 3.4e-6; one process in fp32 is up to 1.5e-4 away per document, so a pipeline that left
    autocast off fails here). After step 1 the curves are compared to bf16's precision as
    test_parallel.py's bf16 tests compare theirs (rel 2e-2; measured ≤ 3e-5): Adam normalises each
    element's step to about lr, so an element whose gradient sits at bf16's rounding level steps
    either way and the runs drift apart by more than their rounding. For the same reason the final
    parameters are compared per tensor against the 5-step update, not elementwise: the difference's
    norm is at most a third of the update's (measured 0.18 at most, on an RMSNorm weight; 0.28 for
    FSDP 2 in bf16 on 2 ranks; a stage that did not step gives 1). Gradient norms rel 2e-3 (bf16's
    2^-9 rounding; measured ≤ 5e-4), the held-out loss rel 2e-2."""
    from test_parallel import _records, _torchrun

    from training.tokenizer import load_tokenizer
    from training.trainer import build_model

    data = workspace[1]
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "precision": "bf16"}}))
    params = load_params(params_file).train
    single, run = tmp_path / "single", tmp_path / "run"
    train(open_version(data), single, params, progress=False)
    _torchrun(4, ["--data", str(data), "--out", str(run), "--params-file", str(params_file), "--parallel",
                  json.dumps({"tp": 2, "pp": 2, "dp_shard": 1, "pp_schedule": "1F1B"})],
              module="training.parallel.worker")
    mine, theirs = _records(run), _records(single)
    assert [r["skipped"] for r in mine] == [r["skipped"] for r in theirs] == [None] * len(theirs)
    assert mine[0]["loss"] == pytest.approx(theirs[0]["loss"], rel=2e-5)
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], rel=2e-2)
    assert [r["grad_norm"] for r in mine] == pytest.approx([r["grad_norm"] for r in theirs], rel=2e-3)

    tel, ref = read_telemetry(run), read_telemetry(single)
    got = dict(zip(zip(tel["step"].to_pylist(), tel["sample_id"].to_pylist()), tel["loss"].to_pylist()))
    want = dict(zip(zip(ref["step"].to_pylist(), ref["sample_id"].to_pylist()), ref["loss"].to_pylist()))
    assert tel.num_rows == ref.num_rows and got.keys() == want.keys()  # each document once, not per tp rank
    first = [k for k in want if k[0] == 1]
    assert [got[k] for k in first] == pytest.approx([want[k] for k in first], rel=2e-5)
    assert list(got.values()) == pytest.approx([want[k] for k in got], rel=2e-2)

    mine_p, theirs_p = _final_params(run, params_file), _final_params(single, params_file)
    start = build_model(params, load_tokenizer(single).get_vocab_size(), torch.device("cpu")).state_dict()
    for name, value in theirs_p.items():
        update = (value - start[name]).norm()
        assert (mine_p[name] - value).norm() <= update / 3, (name, float((mine_p[name] - value).norm() / update))

    metrics = json.loads((run / "metrics.json").read_text())
    single_metrics = json.loads((single / "metrics.json").read_text())
    assert metrics["precision"] == "bf16" and metrics["parallel"]["mode"] == "tp+pp"
    assert metrics["val_loss"] == pytest.approx(single_metrics["val_loss"], rel=2e-2)


@pytest.mark.parallel
def test_a_dp_times_pp_run_resumes_resharded(workspace, tmp_path):  # noqa: F811
    """FSDP × PP (GPipe) saved at step 3, rolled back to it and resumed as DDP × PP (1F1B): the DCP
    checkpoint holds every stage's shards by their whole-model names, and loads into the other
    layout's stages: the single process's 5-step curve and parameters."""
    from test_parallel import assert_resumes_resharded

    assert_resumes_resharded(workspace, tmp_path, (4, {"dp_shard": 2, "pp": 2, "pp_schedule": "GPipe"}),
                             (4, {"dp_replicate": 2, "dp_shard": 1, "pp": 2, "pp_schedule": "1F1B"}))


@pytest.fixture(scope="module")
def single4(workspace, tmp_path_factory):  # noqa: F811
    """One process on the same data with 4 layers: two stages per rank at pp=2."""
    import yaml

    from test_parallel import TINY

    from assay.versions import open_version
    from training.trainer import train

    root, data, _, _ = workspace
    tmp = tmp_path_factory.mktemp("single4")
    params_file = tmp / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {**TINY, "model": {**TINY["model"], "n_layers": 4}}}))
    train(open_version(data), tmp / "single", load_params(params_file).train, progress=False)
    return data, params_file, tmp / "single"


@pytest.mark.parallel
@pytest.mark.parametrize("layout", [
    pytest.param({"dp_shard": 2, "pp_schedule": "Interleaved1F1B"}, id="fsdp2xpp2-Interleaved1F1B"),
    pytest.param({"dp_shard": 2, "pp_schedule": "InterleavedZeroBubble"}, id="fsdp2xpp2-InterleavedZeroBubble"),
    pytest.param({"dp_shard": 2, "pp_schedule": "DualPipeV"}, id="fsdp2xpp2-DualPipeV"),
    pytest.param({"dp_replicate": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble"}, id="ddp2xpp2-ZBVZeroBubble"),
    # TP × PP with a V: two tp-sharded stages per rank, split weight backward, the held-out loss
    # through the plain forward (its P2P buffers hold width / tp positions).
    pytest.param({"tp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble"}, id="tp2xpp2-ZBVZeroBubble"),
])
def test_two_stages_per_rank_dp_times_pp_match_one_process(single4, layout, tmp_path):
    """The schedules holding two stages per rank (each stage module its own FSDP/replicate root, or tp),
    a 4-layer model, 4 ranks, against one process: 5 steps' losses (rtol 1e-5), final parameters
    (atol 2e-5), each document's loss (rtol 1e-5) and the held-out loss. The zero-bubble ones
    (split input/weight backward) differed by 0.06-0.5% while FSDP resharded after each forward;
    the V ones (ZBV, DualPipeV) failed in the held-out evaluation, pp alone too."""
    from test_parallel import _torchrun

    data, params_file, single = single4
    run = tmp_path / "run"
    _torchrun(4, ["--data", str(data), "--out", str(run), "--params-file", str(params_file), "--parallel",
                  json.dumps({**layout, "pp": 2})], module="training.parallel.worker")
    assert_run_matches_single(run, single, params_file)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["val_loss"] == pytest.approx(json.loads((single / "metrics.json").read_text())["val_loss"], rel=1e-5)
