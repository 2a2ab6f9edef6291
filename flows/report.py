"""The `report` flow: one offline HTML page of the pipeline's outputs (assay.report_html does the work)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from assay.output_lock import exclusive_output
from assay.report_html import (ReportInputs, build_report, measure_labelled_code, require_labelled_out,
                                require_report_out)
from assay.shards import atomic_write_json


@task(name="measure-labelled-code", cache_policy=NO_CACHE)
def measure_task(model: str, out: str, params_file: str | None) -> str:
    atomic_write_json(out, measure_labelled_code(Path(model), params_file))
    return out


@flow(name="report", log_prints=True)
def report_flow(out: str = "reports", raw: str = "data/raw", static: str = "data/static", domain: str = "data/domain",
                dedup: str = "data/dedup", curated: str = "data/curated", round0: str = "runs/round-0",
                round1: str = "runs/round-1", models: str = "models", labelled: str = "bench/labelled_code.json",
                repo: str = ".", examples: int = 3, measure_labelled: bool = False,
                params_file: str | None = None) -> dict:
    """Write OUT/index.html: kept and dropped per tier, score histograms, loss curves, lineage, examples."""
    inputs = ReportInputs(Path(raw), Path(static), Path(domain), Path(dedup), Path(curated), Path(round0),
                          Path(round1), Path(models), Path(labelled), Path(repo))
    with exclusive_output(out):  # two reports into OUT would write over each other
        require_report_out(inputs, Path(out))  # before the measurement, which takes a minute
        if measure_labelled:
            require_labelled_out(inputs)
            print(f"measuring tier 3 on the labelled set with {inputs.models / 'domain'} → {labelled}")
            measure_task(str(inputs.models / "domain"), labelled, params_file)
        summary = build_report(inputs, out, examples)
        missing = [key for key, s in summary["sections"].items() if s["missing"]]
        damaged = [key for key, s in summary["sections"].items() if s["damaged"]]
        print(f"report → {summary['page']}: {len(summary['charts'])} charts, {summary['bytes'] / 2**20:.1f} MB"
              + (f"; sections with missing inputs: {', '.join(missing)}" if missing else ""))
        if damaged:
            print(f"DAMAGED inputs (the page names each file) kept these sections from being drawn whole: "
                  f"{', '.join(damaged)}")
        return summary
