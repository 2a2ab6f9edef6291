"""The `static` flow (tier 1): heuristics, embeddings and the confidence score, one task per shard."""

from __future__ import annotations

import dataclasses
import time

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from assay.config import load_params
from assay.encoder import is_local_model
from assay.shards import read_manifest
from assay.stages.shard_stage import plan_shards, require_unchanged, stage_fingerprint, stage_manifest
from assay.stages.static import STAGE, load_models, static_unit
from assay.output_lock import exclusive_output
from assay.staging import commit, prepare
from flows.progress import wait_with_progress
from flows.runners import task_runner

static_shard_task = task(static_unit, name="static-shard", cache_policy=NO_CACHE)


@flow(name="static", log_prints=True)
def static_flow(input_dir: str, out: str, overwrite: bool = False, params_file: str | None = None) -> dict:
    """Tier 1 over the dataset INPUT_DIR into OUT; returns the manifest."""
    started = time.perf_counter()
    params = load_params(params_file)
    units = plan_shards(input_dir)
    section = {"static": dataclasses.asdict(params.static), "io": dataclasses.asdict(params.io)}
    model_files = [m for m in (params.static.model or params.static.head,) if is_local_model(m)]
    fingerprint = stage_fingerprint(units, section, model_files)
    with exclusive_output(out):  # a second run into OUT would break this one's staging
        if prepare(out, fingerprint, overwrite=overwrite, inputs=[input_dir]):
            print(f"{out} is up to date with its inputs; nothing to do")
            return read_manifest(out)
        extra = {"models": None}
        if units:
            models = load_models(params.static)  # fail fast (a missing head) before any task starts
            extra["models"] = {"encoder": dataclasses.asdict(models.encoder.info), "scorer": models.scorer.name,
                               "heuristics": [f.name for f in models.heuristics]}
        else:  # an input its stage published empty: nothing to judge, so no model to need
            print(f"{input_dir} holds no documents (its stage kept none): the encoder and head are not loaded")
        futures = static_shard_task.map([u.index for u in units], [u.shard for u in units], unmapped(out),
                                        unmapped(params), [u.key for u in units])
        results = wait_with_progress(futures, f"static → {out}")
        require_unchanged(input_dir, units)  # every read is done: the output is of one input version
        manifest = stage_manifest(STAGE, input_dir, fingerprint, section, results, time.perf_counter() - started, extra)
        return commit(out, [u.key for u in units], manifest)


def run_static(input_dir: str, out: str, **kwargs) -> dict:
    params = load_params(kwargs.get("params_file"))
    plan_shards(input_dir)  # a missing input fails before Prefect starts
    return static_flow.with_options(task_runner=task_runner(params.flow))(input_dir, out, **kwargs)
