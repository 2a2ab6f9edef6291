"""The task runner named in params.yaml (`flow.task_runner`).

Threads by default. Dask and Ray come from Prefect's own integrations, so the
same flow runs on a cluster without code changes; they are optional installs.
"""

from __future__ import annotations

import warnings

from assay.config import FlowParams
from assay.errors import AssayError


def task_runner(params: FlowParams):
    kind = params.task_runner
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=params.max_workers)
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise AssayError("flow.task_runner=dask needs `pip install prefect-dask`") from None
        if params.address:
            return DaskTaskRunner(address=params.address)
        # LocalCluster's scheduler listens on 127.0.0.1, but its dashboard (":8787") on every interface,
        # with no login: keep it local too. A shared cluster is one the user starts (flow.address).
        return DaskTaskRunner(cluster_kwargs={"n_workers": params.max_workers, "dashboard_address": "127.0.0.1:8787"})
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise AssayError("flow.task_runner=ray needs `pip install prefect-ray`") from None
        if params.address:
            return RayTaskRunner(address=params.address)
        # A local Ray's gcs_server, raylet and workers listen on every interface, and Ray 2.60 has no
        # setting to keep them on 127.0.0.1 (RELIABILITY.md, measured): say so where the user chose it.
        warnings.warn("flow.task_runner=ray without flow.address starts a local Ray whose servers listen on every "
                      "network interface (Ray has no loopback-only setting); to choose where they listen, start "
                      "Ray yourself (`ray start --head --node-ip-address ...`) and set flow.address", stacklevel=2)
        return RayTaskRunner()
    raise AssayError(f"params: flow.task_runner = {kind!r}; expected threads, dask or ray")
