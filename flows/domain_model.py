"""The `domain-model` flow: train tier 3's small code LM on reference code."""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from assay.config import load_params
from assay.domain.perplexity import REPORT
from assay.domain.train import train_domain_model
from assay.output_lock import exclusive_output
from assay.staging import require_model_out


@flow(name="domain-model", log_prints=True)
def domain_model_flow(data: str, out: str, params_file: str | None = None) -> dict:
    """Train the GPT-2-architecture domain model on DATA's reference code; save it to OUT."""
    params = load_params(params_file)
    with exclusive_output(out):  # two trainings into OUT would save over each other
        # Saving replaces OUT whole: refuse, before training, an OUT that is not an earlier domain model.
        require_model_out(Path(out), [data], "a domain model", lambda folder: (folder / REPORT).is_file())
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
        with Progress(*columns, console=Console(file=sys.stderr)) as progress:
            bar = progress.add_task("domain model", total=params.domain.train.steps, loss=float("nan"))
            report = train_domain_model(data, out, params,
                                        progress=lambda step, loss: progress.update(bar, advance=1, loss=loss))
        print(f"domain model → {out}: loss {report['loss_first']:.3f} → {report['loss_last']:.3f}, "
              f"held-out median perplexity {report['heldout_perplexity_median']:.2f} "
              f"({report['reference']['train_files']} train / {report['reference']['heldout_files']} held-out files, "
              f"{report['seconds']} s)")
        return report
