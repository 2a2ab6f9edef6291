"""The `train` flow: one training round on an exact dataset version (training.trainer does the work)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from prefect import flow

from assay.config import load_params
from assay.errors import AssayError
from assay.versions import open_version
from training.parallel.dims import ParallelDims
from training.parallel.launch import Launch, launch
from training.trainer import METRICS_FILE, train


@flow(name="train", log_prints=True)
def train_flow(data: str, out: str, rev: str | None = None, resume: bool = False, overwrite: bool = False,
               allow_data_change: bool = False, steps: int | None = None, device: str | None = None,
               profile: bool = False, params_file: str | None = None, nproc: int = 1,
               parallel: dict | None = None, nnodes: str = "1", rdzv_endpoint: str | None = None,
               max_restarts: int = 0) -> dict:
    """Train a decoder LM on DATA (as committed at REV, through DVC) into OUT, with per-document telemetry.

    NPROC > 1 launches that many ranks (on one machine every socket on 127.0.0.1; torchrun across
    machines), laid out by PARALLEL (overrides of params.yaml's train.parallel); this flow run waits
    for them and reads their metrics.
    """
    params = load_params(params_file).train
    if steps is not None:
        params = dataclasses.replace(params, steps=steps)
    version = open_version(data, rev)
    where = f"rev {rev} ({version.commit[:10]})" if rev and version.commit else "the workspace"
    print(f"training on {data} at {where}: data hash {version.data_hash}, {len(version.shards)} shard(s)")
    if version.modified:
        print(f"{data} differs from what DVC recorded for it (a stage ran outside dvc repro?): it is identified "
              "by its own digest; `dvc commit` (or `dvc repro`) records it")
    if nproc > 1 or nnodes != "1":
        m = _launch(data, out, rev, resume, overwrite, allow_data_change, steps, device, params_file, nproc,
                    parallel or {}, nnodes, rdzv_endpoint, max_restarts)
        print(f"train → {out}: {m['steps']} steps on {m['parallel']['world_size']} ranks ({m['parallel']['mode']}), "
              f"final loss {m['final_loss']:.3f}")
        return m
    result = train(version, out, params, resume=resume, overwrite=overwrite,
                   allow_data_change=allow_data_change, device=device, profile=profile)
    m = result.metrics
    if result.resumed_from:
        print(f"resumed from step {result.resumed_from}")
    if result.resumed_from is not None and result.resumed_from > params.steps:
        print(f"note: the run was already at step {result.resumed_from}, past train.steps = {params.steps}; "
              "nothing was trained (a run is never cut back: --overwrite starts again)")
    val = "n/a" if m["val_loss"] is None else f"{m['val_loss']:.3f}, accuracy {m['val_accuracy']:.3f}"
    print(f"train → {out}: {m['steps']} steps, final loss {m['final_loss']:.3f}, validation loss {val}, "
          f"{m['skipped_steps']} skipped step(s)")
    return m


def _launch(data, out, rev, resume, overwrite, allow_data_change, steps, device, params_file, nproc, parallel,
            nnodes, rdzv_endpoint, max_restarts) -> dict:
    args = ["--data", data, "--out", out]
    for flag, value in (("--rev", rev), ("--steps", steps), ("--device", device), ("--params-file", params_file)):
        if value is not None:
            args += [flag, str(value)]
    args += [flag for flag, on in (("--resume", resume), ("--overwrite", overwrite),
                                   ("--allow-data-change", allow_data_change)) if on]
    if nnodes.isdigit():  # check the layout before starting N processes to say it is wrong
        layout = dataclasses.asdict(load_params(params_file).train.parallel)
        layout.update(parallel)
        # Only the mesh sizes: train.parallel also holds per-mode options (zero1, pp_schedule, ...).
        sizes = {f.name for f in dataclasses.fields(ParallelDims)} - {"world_size"}
        ParallelDims(**{k: v for k, v in layout.items() if k in sizes}, world_size=nproc * int(nnodes))
    spec = Launch(nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts, parallel=parallel)
    print("launching: " + " ".join(spec.command(args)))
    code = launch(spec, args)
    if code != 0:
        raise AssayError(f"the ranks exited with {code}; each rank's error is above")
    return json.loads((Path(out) / METRICS_FILE).read_text())
