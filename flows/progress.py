"""A progress bar over mapped Prefect task futures, as they finish."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from prefect.futures import PrefectFuture, as_completed
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def wait_with_progress(futures: Sequence[PrefectFuture], description: str) -> list:
    """Results in submission order; raises the first task failure."""
    console = Console(file=sys.stderr)
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False, disable=not futures) as progress:
        bar = progress.add_task(description, total=len(futures))
        for future in as_completed(list(futures)):
            future.result()  # surface a failure as soon as it happens
            progress.advance(bar)
    return [f.result() for f in futures]
