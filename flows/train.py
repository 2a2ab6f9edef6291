"""The `train` flow: one training round on an exact dataset version (training.trainer does the work)."""

from __future__ import annotations

import dataclasses

from prefect import flow

from assay.config import load_params
from assay.versions import open_version
from training.trainer import train


@flow(name="train", log_prints=True)
def train_flow(data: str, out: str, rev: str | None = None, resume: bool = False, overwrite: bool = False,
               allow_data_change: bool = False, steps: int | None = None, device: str | None = None,
               profile: bool = False, params_file: str | None = None) -> dict:
    """Train a decoder LM on DATA (as committed at REV, through DVC) into OUT, with per-document telemetry."""
    params = load_params(params_file).train
    if steps is not None:
        params = dataclasses.replace(params, steps=steps)
    version = open_version(data, rev)
    where = f"rev {rev} ({version.commit[:10]})" if rev and version.commit else "the workspace"
    print(f"training on {data} at {where}: data hash {version.data_hash}, {len(version.shards)} shard(s)")
    result = train(version, out, params, resume=resume, overwrite=overwrite,
                   allow_data_change=allow_data_change, device=device, profile=profile)
    m = result.metrics
    if result.resumed_from:
        print(f"resumed from step {result.resumed_from}")
    val = "n/a" if m["val_loss"] is None else f"{m['val_loss']:.3f}, accuracy {m['val_accuracy']:.3f}"
    print(f"train → {out}: {m['steps']} steps, final loss {m['final_loss']:.3f}, validation loss {val}, "
          f"{m['skipped_steps']} skipped step(s)")
    return m
