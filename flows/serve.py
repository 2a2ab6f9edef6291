"""`assay serve`: deployments of every stage flow and of the pipeline flow, served to the Prefect UI.

The UI builds each Run form from the flow's type hints and docstring; the
defaults are those of the stage's command in dvc.yaml. Runs of a stage
deployment write where the form says, outside DVC's record; the `pipeline`
deployment is the one whose runs DVC records (flows/pipeline.py).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable

from prefect import Flow
from prefect.types.entrypoint import EntrypointType

from assay.config import load_params
from assay.errors import AssayError
from assay.prefect_server import require_api
from flows.runners import task_runner

# Pipeline order. Modules written later (by other work in progress) are
# skipped with a note, so that serving never waits on them.
STAGE_MODULES = ("flows.ingest", "flows.quality", "flows.static", "flows.domain_model", "flows.domain",
                 "flows.dedup", "flows.train", "flows.score", "flows.dynamic", "flows.report")

# Run-form defaults: the arguments of each stage's command in dvc.yaml, keyed by
# flow name; only the names a flow really takes are used.
DVC_DEFAULTS: dict[str, dict] = {
    "ingest": {"sources": ["demo"], "out": "data/raw", "overwrite": True},
    "quality-head": {"data": "data/raw", "out": "models/quality"},
    "static": {"input_dir": "data/raw", "out": "data/static", "overwrite": True},
    "domain-model": {"data": "data/static", "out": "models/domain"},
    "domain": {"input_dir": "data/static", "out": "data/domain", "overwrite": True},
    "dedup": {"input_dir": "data/domain", "out": "data/dedup", "overwrite": True},
    "train": {"data": "data/dedup", "out": "runs/round-0", "overwrite": True},
    "score": {"run": "runs/round-0", "data": "data/dedup", "out": "runs/round-0/scores", "overwrite": True},
    "dynamic": {"input_dir": "data/dedup", "scores_dir": "runs/round-0/scores", "run_dir": "runs/round-0",
                "out": "data/curated", "overwrite": True},
    "report": {"out": "reports"},
}


def stage_flows(report: Callable[[str], None] = print) -> list[Flow]:
    """The flows defined in STAGE_MODULES, in order; a module that does not exist yet is reported and skipped."""
    found = []
    for name in STAGE_MODULES:
        if importlib.util.find_spec(name) is None:
            report(f"{name}: no such module yet, its flow is not served")
            continue
        # A module that exists but fails to import is a bug to show, not to skip.
        module = importlib.import_module(name)
        flows = [obj for obj in vars(module).values()
                 if isinstance(obj, Flow) and getattr(obj.fn, "__module__", None) == name]
        if not flows:
            report(f"{name}: defines no flow, nothing served from it")
        found.extend(flows)
    return found


def defaults_for(flow: Flow) -> dict:
    accepted = inspect.signature(flow.fn).parameters
    return {k: v for k, v in DVC_DEFAULTS.get(flow.name, {}).items() if k in accepted}


def serve(pipeline_only: bool = False, name: str = "assay", limit: int | None = 1,
          params_file: str | None = None, report: Callable[[str], None] = print) -> None:
    """Register the deployments with the server at PREFECT_API_URL and run what the UI asks for, until interrupted."""
    from prefect.runner import Runner

    from flows.pipeline import pipeline_flow, repo_root

    url = require_api()
    params = load_params(params_file)
    runner_for_tasks = task_runner(params.flow)
    served: list[tuple[Flow, dict, list[str]]] = []
    try:
        repo_root()  # the pipeline needs a dvc.yaml here: say so now, not at the first run
        served.append((pipeline_flow, {}, ["assay", "pipeline"]))
    except AssayError as exc:
        if pipeline_only:
            raise
        report(f"pipeline: not served ({exc})")
    if not pipeline_only:
        # The stage flows run with params.yaml's task runner, as `assay run` does.
        served += [(f.with_options(task_runner=runner_for_tasks), defaults_for(f), ["assay", "stage"])
                   for f in stage_flows(report)]
    # Runs start after at most one poll: Prefect's 10 s default feels broken
    # behind a Run button, and a poll of a local server costs nothing.
    poll = float(os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY", 2))
    runner = Runner(name=f"assay-serve-{name}", query_seconds=poll, limit=limit)
    for flow, defaults, tags in served:
        runner.add_flow(flow, name=name, parameters=defaults, tags=tags, entrypoint_type=EntrypointType.MODULE_PATH)
        report(f"serving {flow.name}/{name}")
    address = url.removesuffix("/api")
    report(f"{len(served)} deployment(s) served from {os.getcwd()}; open {address}/deployments and press Run "
           f"(runs start within {poll:g} s). Ctrl-C stops serving.")
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        report("stopped serving")
