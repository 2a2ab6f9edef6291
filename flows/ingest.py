"""The `ingest` flow: sources → a raw dataset, one task per file or file group."""

from __future__ import annotations

import dataclasses
import time

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from assay.config import load_params
from assay.ingest import fingerprint, jsonl_threads_for_run, manifest_for, options_from_params
from assay.ingest.plan import DEMO_SOURCE, check_source, plan, unit_key
from assay.ingest.readers import ingest_unit
from assay.ingest.repeated_ids import quarantine_repeated_ids
from assay.shards import read_manifest
from assay.output_lock import exclusive_output
from assay.staging import commit, prepare
from flows.progress import wait_with_progress
from flows.runners import task_runner

# Resumption is by staged files (assay.staging), which survive a killed
# process; Prefect's own result cache would not know a unit's files vanished.
ingest_unit_task = task(ingest_unit, name="ingest-unit", cache_policy=NO_CACHE)


@flow(name="ingest", log_prints=True)
def ingest_flow(
    sources: list[str],
    out: str,
    text_field: str | None = None,
    id_field: str | None = None,
    source_name: str | None = None,
    overwrite: bool = False,
    params_file: str | None = None,
) -> dict:
    """Ingest SOURCES into the dataset directory OUT and return its manifest."""
    started = time.perf_counter()
    params = load_params(params_file)
    options = options_from_params(params, text_field=text_field, id_field=id_field, source_name=source_name)
    units = plan(sources, options, demo_params=params.demo)
    threads = jsonl_threads_for_run(params.ingest.jsonl_threads, len(units), params.flow.max_workers)
    options = dataclasses.replace(options, jsonl_threads=threads)
    with exclusive_output(out):  # a second run into OUT would break this one's staging
        # `demo` names the bundled corpus, never a path: a folder named demo (the parent the lock
        # makes for `--out demo/raw`, say) is not an input.
        inputs = [s for s in sources if s != DEMO_SOURCE]
        if prepare(out, fingerprint(units, options, params), overwrite=overwrite, inputs=inputs):
            print(f"{out} is up to date with its inputs; nothing to do")
            return read_manifest(out)
        futures = ingest_unit_task.map(list(range(len(units))), units, unmapped(out), unmapped(options))
        results = wait_with_progress(futures, f"ingest → {out}")
        results = quarantine_repeated_ids(out, results)  # files ingested apart may give one id twice
        manifest = manifest_for(sources, units, options, params, results, time.perf_counter() - started)
        return commit(out, [unit_key(i, u) for i, u in enumerate(units)], manifest)


def run_ingest(sources: list[str], out: str, **kwargs) -> dict:
    """Run the flow with the task runner params.yaml asks for.

    Params and sources are checked first, so that a typo fails in
    milliseconds instead of after Prefect's server has started.
    """
    params = load_params(kwargs.get("params_file"))
    options = options_from_params(params, text_field=kwargs.get("text_field"), id_field=kwargs.get("id_field"))
    for spec in sources:
        check_source(spec, options)
    return ingest_flow.with_options(task_runner=task_runner(params.flow))(sources, out, **kwargs)
