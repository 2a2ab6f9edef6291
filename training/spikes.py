"""OLMo's spike rule: skip an optimizer step whose loss or gradient norm is an outlier.

A step is a spike when its value exceeds ``mean + sigma * std`` of the last
``window`` accepted steps (OLMo 2 uses 6 sigma over 128 steps). Rejected values
stay out of the history, so one spike does not widen the band for the next.
Nothing is judged until ``min_history`` steps are in, because the first steps'
loss falls faster than any band.

The history is a fixed-size tensor, so it is checkpointed with the model and a
resumed run judges the same steps the same way.
"""

from __future__ import annotations

import torch

__all__ = ["SpikeDetector"]


class SpikeDetector:
    def __init__(self, window: int = 128, sigma: float = 6.0, min_history: int = 20, n_series: int = 2):
        if window < 2 or min_history < 2 or min_history > window:
            raise ValueError(f"need 2 <= min_history ({min_history}) <= window ({window})")
        self.window, self.sigma, self.min_history = window, sigma, min_history
        # Row s is series s (0: loss, 1: grad norm) as a ring buffer; float64 so the
        # statistics do not depend on summation order subtleties of fp32.
        self.history = torch.zeros(n_series, window, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.long)  # accepted steps so far (all time)

    def check(self, values: list[float]) -> list[bool]:
        """Which of ``values`` (one per series) are spikes; does not record them."""
        n = int(min(self.count, self.window))
        if n < self.min_history:
            return [False] * len(values)
        recent = self.history[:, :n]
        mean, std = recent.mean(dim=1), recent.std(dim=1)
        return [bool(v > float(m + self.sigma * s)) for v, m, s in zip(values, mean, std)]

    def accept(self, values: list[float]) -> None:
        slot = int(self.count % self.window)
        self.history[:, slot] = torch.tensor(values, dtype=torch.float64)
        self.count += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint saves and restores in place."""
        return {"spike_history": self.history, "spike_count": self.count}
