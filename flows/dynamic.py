"""The `dynamic` flow (tier 2): verdicts from the scores and the telemetry once, then one task per shard."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from assay.config import load_params
from assay.shards import read_manifest
from assay.stages.dynamic import (STAGE, dynamic_unit, read_run_telemetry, read_scores, require_same_signals,
                                  require_scores_of_input, require_scores_of_run, require_scores_of_version,
                                  require_signals,
                                  signals_fingerprint, verdicts)
from assay.stages.shard_stage import plan_shards, require_unchanged, stage_fingerprint, stage_manifest
from assay.output_lock import exclusive_output
from assay.staging import commit, prepare
from flows.progress import wait_with_progress
from flows.runners import task_runner

dynamic_shard_task = task(dynamic_unit, name="dynamic-shard", cache_policy=NO_CACHE)


@task(name="dynamic-verdicts", cache_policy=NO_CACHE)
def verdicts_task(scores_dir: str, run_dir: str, params):
    return verdicts(read_scores(scores_dir), read_run_telemetry(run_dir), params.dynamic)


@flow(name="dynamic", log_prints=True)
def dynamic_flow(input_dir: str, scores_dir: str, run_dir: str, out: str, overwrite: bool = False,
                 params_file: str | None = None, allow_data_change: bool = False) -> dict:
    """Tier 2 over the dataset INPUT_DIR into OUT, from SCORES_DIR and RUN_DIR's telemetry; returns the manifest."""
    started = time.perf_counter()
    params = load_params(params_file)
    units = plan_shards(input_dir)
    # Before any work and before the up-to-date check, so that an output made of mismatched signals is
    # refused rather than answered "up to date".
    require_scores_of_run(scores_dir, run_dir)
    require_scores_of_input(scores_dir, [u.shard for u in units], input_dir)
    if not allow_data_change:
        require_scores_of_version(scores_dir, input_dir)
    section = {"dynamic": dataclasses.asdict(params.dynamic), "io": dataclasses.asdict(params.io)}
    section["signals"] = signals_fingerprint(scores_dir, run_dir)
    fingerprint = stage_fingerprint(units, section)
    with exclusive_output(out):  # a second run into OUT would break this one's staging
        if prepare(out, fingerprint, overwrite=overwrite, inputs=[input_dir, scores_dir, run_dir]):
            print(f"{out} is up to date with its inputs; nothing to do")
            return read_manifest(out)
        judged = verdicts_task(scores_dir, run_dir, params)
        futures = dynamic_shard_task.map([u.index for u in units], [u.shard for u in units], unmapped(out),
                                         unmapped(params), [u.key for u in units], unmapped(judged))
        results = wait_with_progress(futures, f"dynamic → {out}")
        mentioned = Counter(judged.column("reason").drop_null().to_pylist())
        extra = {"signals": {"scores": scores_dir, "run": run_dir, "documents_with_signals": judged.num_rows,
                             "drops_among_them_by_reason": dict(sorted(mentioned.items()))}}
        require_unchanged(input_dir, units)  # every read is done: the output is of one input version
        require_same_signals(scores_dir, run_dir, section["signals"])  # and of one set of signals
        manifest = stage_manifest(STAGE, input_dir, fingerprint, section, results, time.perf_counter() - started, extra)
        return commit(out, [u.key for u in units], manifest)


def run_dynamic(input_dir: str, scores_dir: str, run_dir: str, out: str, **kwargs) -> dict:
    params = load_params(kwargs.get("params_file"))
    plan_shards(input_dir)  # missing inputs fail before Prefect starts
    require_signals(scores_dir, run_dir)
    return dynamic_flow.with_options(task_runner=task_runner(params.flow))(input_dir, scores_dir, run_dir, out, **kwargs)
