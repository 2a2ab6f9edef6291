"""The `domain` flow (tier 3): code rules, parsing and the domain model's screen, one task per shard."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from assay.config import load_params
from assay.shards import read_manifest
from assay.stages.domain import STAGE, domain_unit, load_models, perplexity_band, rule_clean_share
from assay.stages.shard_stage import plan_shards, require_unchanged, stage_fingerprint, stage_manifest, summarize
from assay.output_lock import exclusive_output
from assay.staging import commit, prepare
from flows.progress import wait_with_progress
from flows.runners import task_runner

domain_shard_task = task(domain_unit, name="domain-shard", cache_policy=NO_CACHE)


@flow(name="domain", log_prints=True)
def domain_flow(input_dir: str, out: str, overwrite: bool = False, params_file: str | None = None) -> dict:
    """Tier 3 over the dataset INPUT_DIR into OUT; returns the manifest."""
    started = time.perf_counter()
    params = load_params(params_file)
    units = plan_shards(input_dir)
    section = {"domain": dataclasses.asdict(params.domain), "io": dataclasses.asdict(params.io)}
    model = params.domain.model.model
    fingerprint = stage_fingerprint(units, section, [model] if Path(model).exists() else [])
    with exclusive_output(out):  # a second run into OUT would break this one's staging
        if prepare(out, fingerprint, overwrite=overwrite, inputs=[input_dir]):
            print(f"{out} is up to date with its inputs; nothing to do")
            return read_manifest(out)
        if units:
            models = load_models(params.domain)  # fail fast on a missing model, before any task
            band = perplexity_band([u.shard for u in units], params.domain, models)
            languages = models.scorer.languages
        else:  # an input its stage published empty: nothing to judge, so no model to need
            print(f"{input_dir} holds no documents (its stage kept none): the domain model is not loaded")
            band, languages = None, None
        if band:
            print(f"perplexity band {params.domain.model.percentile_band} percentiles: {band[0]:.1f} - {band[1]:.1f}")
        futures = domain_shard_task.map([u.index for u in units], [u.shard for u in units], unmapped(out),
                                        unmapped(params), [u.key for u in units], unmapped(band))
        results = wait_with_progress(futures, f"domain → {out}")
        clean = rule_clean_share(summarize(results))
        screen = params.domain.model
        extra = {"rule_clean_share": clean,
                 "models": {"domain_model": model, "languages": languages,
                            "perplexity_screen": [screen.min_perplexity, screen.max_perplexity],
                            "perplexity_band": band}}
        require_unchanged(input_dir, units)  # every read is done: the output is of one input version
        manifest = stage_manifest(STAGE, input_dir, fingerprint, section, results, time.perf_counter() - started, extra)
        return commit(out, [u.key for u in units], manifest)


def run_domain(input_dir: str, out: str, **kwargs) -> dict:
    params = load_params(kwargs.get("params_file"))
    plan_shards(input_dir)
    return domain_flow.with_options(task_runner=task_runner(params.flow))(input_dir, out, **kwargs)
