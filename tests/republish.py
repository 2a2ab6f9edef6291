"""An upstream stage rerun, on cue: a new version of a dataset published over it mid-run."""

from __future__ import annotations

import functools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from assay.shards import publish_directory


def new_version_of(dataset: Path, scratch: Path) -> Path:
    """What a stage rerun builds: the same part names, the first part with a row less."""
    built = Path(shutil.copytree(dataset, scratch / f"built-{len(list(scratch.glob('built-*')))}"))
    first = sorted(built.glob("part-*.parquet"))[0]
    table = pq.read_table(first)
    pq.write_table(table.slice(0, table.num_rows - 1), first)
    return built


def republish(dataset: Path, scratch: Path) -> None:
    """Publish a new version at `dataset` as a stage's commit does: the folder swapped whole."""
    publish_directory(new_version_of(dataset, scratch), dataset, scratch / "set-aside")


class RepublishAfter:
    """Republishes `dataset` when the `n`-th of a stage's tasks has finished (they run on threads)."""

    def __init__(self, dataset: Path, scratch: Path, n: int) -> None:
        self.dataset, self.scratch, self.n = dataset, scratch, n
        self.finished = 0
        self._lock = threading.Lock()

    def task_of(self, unit: Callable, name: str) -> Any:
        """A Prefect task running `unit` and then counting it; `functools.wraps` keeps the
        unit's parameters, which Prefect's `map` binds by name."""
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        @functools.wraps(unit)
        def run(*args: Any, **kwargs: Any) -> Any:
            result = unit(*args, **kwargs)
            with self._lock:
                self.finished += 1
                if self.finished == self.n:  # every task has read its shard
                    republish(self.dataset, self.scratch)
            return result

        return task(run, name=name, cache_policy=NO_CACHE)
