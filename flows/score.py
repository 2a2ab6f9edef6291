"""The `score` flow: tier 2's scoring pass over a dataset with a run's checkpoint(s) (training.score does the work)."""

from __future__ import annotations

import dataclasses

from prefect import flow

from assay.config import load_params
from assay.output_lock import exclusive_output
from training.score import score_dataset


@flow(name="score", log_prints=True)
def score_flow(run: str, data: str, out: str, rev: str | None = None, overwrite: bool = False,
               checkpoints: list[int | str] | None = None, device: str | None = None,
               params_file: str | None = None) -> dict:
    """Score every document of DATA (as committed at REV, through DVC) with RUN's checkpoint(s) into OUT:
    loss, gradient norm and gradient alignment with the clean reference set, per document."""
    params = load_params(params_file).score
    if checkpoints:
        params = dataclasses.replace(params, checkpoints=list(checkpoints))
    with exclusive_output(out):  # two runs into OUT would overwrite each other's parts
        manifest = score_dataset(run, data, out, params, rev=rev, overwrite=overwrite, device=device)
        counts, timings = manifest["counts"], manifest["timings"]
        steps = ", ".join(str(c["step"]) for c in manifest["inputs"]["checkpoints"])
        print(f"score → {out}: {counts['scored_per_checkpoint']} of {counts['documents']} documents scored at step(s) "
              f"{steps} ({counts['reference']} in the reference set, never judged; {counts['capped_rows']} row(s) "
              f"capped at {counts['max_rows']} rows); {counts['parts_resumed']} of {counts['parts']} part(s) "
              f"resumed; {timings['seconds']:.1f} s, {timings['docs_per_second'] or 0:.1f} docs/s")
        return manifest
