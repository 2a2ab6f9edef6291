"""Mixture-of-experts feed-forward with DeepSeek-V3 auxiliary-loss-free load balancing.

Routing (per token ``x``)::

    scores  = sigmoid(x @ W_router)                 # (T, E), fp32
    chosen  = topk(scores + expert_bias, k)         # selection uses the bias ...
    gates   = scores[chosen] / scores[chosen].sum() # ... the gating weights do not

``expert_bias`` is a buffer (no gradient).  Every forward adds the number of
tokens routed to each expert to the ``tokens_per_expert`` buffer; after an
optimizer step :meth:`MoE.update_bias` moves every expert's bias by
``gamma * sign(mean_load - load)`` (under-loaded experts up, over-loaded down)
and clears the counts.

Dispatch sorts the (token, slot) assignments by expert, gathers each expert's
tokens with ``index_select`` and scatters the gated outputs back with
``index_add_``: a Python loop over experts, none over tokens.  No capacity
limit, so no token is ever dropped (and routing stays causal).

Parallelism-agnostic: under data/expert parallelism the counts must be summed
across ranks (all-reduce ``tokens_per_expert``) before :meth:`update_bias`, and
a layout that reduces expert gradients over ranks with different tokens sets
``experts_in_graph`` (``training.parallel.data_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward", "MoE"]


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float, generator: torch.Generator | None = None) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(
                lin.weight, std=init_std, a=-3 * init_std, b=3 * init_std, generator=generator
            )


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with bias-based (auxiliary-loss-free) balancing."""

    def __init__(self, dim: int, hidden: int, n_experts: int, topk: int, bias_gamma: float = 1e-3):
        super().__init__()
        if not 1 <= topk <= n_experts:
            raise ValueError(f"need 1 <= topk ({topk}) <= n_experts ({n_experts})")
        self.dim = dim
        self.n_experts = n_experts
        self.topk = topk
        self.bias_gamma = bias_gamma
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(n_experts))
        # Selection bias: state to checkpoint, but never trained by gradient.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        # Load accumulated since the last update_bias() (summed over forwards).
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False
        )
        # Counts from the most recent forward alone (for forward(..., return_aux=True)).
        self.last_tokens_per_expert: torch.Tensor | None = None
        # (flat token ids sorted by expert, tokens per expert) from the most recent forward:
        # expert e got flat[ids[sum(counts[:e]) : sum(counts[:e + 1])]]. For training.grad_norms.
        self.last_dispatch: tuple[torch.Tensor, torch.Tensor] | None = None
        # The same for this rank's own tokens wherever their experts ran (under expert parallel
        # other ranks' experts, and last_dispatch is None): which tokens went to which expert.
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None
        # Which experts join this forward's graph: by default those this forward routed a token
        # to (an expert with none gets no gradient, None, and AdamW skips it). A parallel layout
        # whose gradient reduction needs the same experts on every rank of a group sets a
        # function from these counts to counts that say which experts run (the rest on no rows).
        self.experts_in_graph: Callable[[torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ init
    def init_weights(self, init_std: float, generator: torch.Generator | None = None) -> None:
        nn.init.trunc_normal_(self.router.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
        for expert in self.experts:
            expert.init_weights(init_std, generator)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
        self.last_tokens_per_expert = None

    # --------------------------------------------------------------- routing
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: (T, dim) -> (topk_idx (T, k) long, gates (T, k) fp32, scores (T, E) fp32)."""
        scores = torch.sigmoid(self.router(x).float())
        biased = scores + self.expert_bias.detach().to(scores.dtype)
        topk_idx = biased.topk(self.topk, dim=-1, sorted=False).indices
        gates = scores.gather(-1, topk_idx)
        gates = gates / gates.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return topk_idx, gates, scores

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n_tokens = flat.shape[0]
        topk_idx, gates, _ = self.route(flat)

        counts = torch.bincount(topk_idx.reshape(-1), minlength=self.n_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        self.last_tokens_per_expert = counts.detach()

        # Sort the T*k (token, slot) assignments by expert.
        order = torch.argsort(topk_idx.reshape(-1), stable=True)
        token_ids = torch.div(order, self.topk, rounding_mode="floor")
        sorted_gates = gates.reshape(-1).index_select(0, order)
        self.last_dispatch = self.last_routing = (token_ids, counts)

        joined = counts if self.experts_in_graph is None else self.experts_in_graph(counts)
        out = torch.zeros_like(flat)
        start = 0
        routed = counts.tolist()  # one host sync per layer (two when a layout joins experts)
        for e, (n, j) in enumerate(zip(routed, routed if joined is counts else joined.tolist())):
            if j == 0:
                continue  # with n == 0 < j the expert runs on no rows: a zero gradient, not None
            ids = token_ids[start : start + n]
            y = self.experts[e](flat.index_select(0, ids))
            y = y * sorted_gates[start : start + n].unsqueeze(-1).to(y.dtype)
            out.index_add_(0, ids, y.to(out.dtype))  # autocast: experts may return bf16
            start += n
        assert start == n_tokens * self.topk
        return out.reshape(shape)

    # ------------------------------------------------------------- balancing
    def load_stats(self) -> dict:
        """Load accumulated since the last :meth:`update_bias`."""
        load = self.tokens_per_expert.detach().clone()
        total = float(load.sum())
        mean = total / self.n_experts
        return {
            "tokens_per_expert": load,
            "total": total,
            "max_over_mean": float(load.max()) / mean if mean > 0 else float("nan"),
            "min_over_mean": float(load.min()) / mean if mean > 0 else float("nan"),
        }

    @torch.no_grad()
    def update_bias(self) -> dict:
        """Nudge the selection bias toward balance, clear the counts, return the stats used."""
        stats = self.load_stats()
        load = stats["tokens_per_expert"]
        if stats["total"] > 0:
            delta = self.bias_gamma * torch.sign(load.mean() - load)
            self.expert_bias.add_(delta.to(self.expert_bias.dtype))
        self.tokens_per_expert.zero_()
        return stats
