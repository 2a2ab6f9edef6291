"""What a filter is: given a record batch, keep or drop each row, with a reason.

In the manner of datatrove, a filter is a small class with one method. Unlike
datatrove, the method sees a whole Arrow record batch and answers for every
row at once, so the work is vectorised and a stage never builds Python dicts
per document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa


@dataclass
class FilterResult:
    """Per-row verdicts for one batch.

    `keep[i]` is False when row i is dropped; `reason[i]` then names the rule,
    as `filter_name:rule` (for example `gopher_quality:mean_word_length`), and
    is None for kept rows. `scores` are per-row numbers (float64, NaN where a
    filter did not score the row) that the stage stores in the decisions table
    and, where useful, as columns.
    """

    keep: np.ndarray
    reason: list[str | None]
    scores: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def keep_all(cls, n: int) -> "FilterResult":
        return cls(np.ones(n, dtype=bool), [None] * n, {})


class Filter(Protocol):
    #: Prefix of every reason this filter gives.
    name: str

    def apply(self, batch: pa.RecordBatch) -> FilterResult:
        """Verdicts for every row of `batch` (same length, same order)."""
        ...
