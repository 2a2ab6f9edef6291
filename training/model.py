"""Decoder-only transformer (torchtitan style): plain ``nn.Module``, no parallelism inside.

Construction allocates, :meth:`Transformer.init_weights` initialises, so the model can be
built on the meta device and materialised later::

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)

Module names are fixed for parallel plans: ``tok_embeddings``, ``layers.{i}.attention_norm``,
``layers.{i}.attention.{wq,wk,wv,wo}``, ``layers.{i}.ffn_norm``,
``layers.{i}.feed_forward.{w1,w2,w3}`` (dense) or
``layers.{i}.feed_forward.{router,experts.{e}.{w1,w2,w3}}`` (MoE), ``norm``, ``output``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from assay.config import TRAIN_ATTENTIONS
from training.moe import FeedForward, MoE

__all__ = ["Attention", "ModelArgs", "RMSNorm", "Transformer", "TransformerBlock"]


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    ffn_hidden: int = 1408
    max_seq_len: int = 2048
    attention: str = "dense"  # "dense" | "sparse"
    sparse_window: int = 128
    sparse_block: int = 64
    sparse_topk: int = 8
    ffn: str = "dense"  # "dense" | "moe"
    n_experts: int = 8
    moe_topk: int = 2
    moe_hidden: int | None = None  # per-expert hidden size; defaults to ffn_hidden
    moe_bias_gamma: float = 1e-3
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.attention not in TRAIN_ATTENTIONS:
            raise ValueError(f"attention must be 'dense' or 'sparse', not {self.attention!r}")
        if self.ffn not in ("dense", "moe"):
            raise ValueError(f"ffn must be 'dense' or 'moe', not {self.ffn!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head dim must be even for RoPE")
        if self.ffn == "moe" and not 1 <= self.moe_topk <= self.n_experts:
            raise ValueError(f"need 1 <= moe_topk <= n_experts, got {self.moe_topk}/{self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None):
    """cos/sin tables, each (max_seq_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: (B, N, H, D); rotates interleaved pairs (x[2i], x[2i+1]) as in Llama.

    As one complex multiply: on CPU that is about 7x faster, forward and backward, than
    rotating the two halves with real arithmetic and stacking them back.
    """
    xf = x if x.dtype == torch.float64 else x.float()
    xc = torch.view_as_complex(xf.reshape(*x.shape[:-1], -1, 2))
    # FSDP2 casts forward inputs (cos and sin too) to bf16 under mixed precision; complex needs fp32+.
    rotation = torch.complex(cos.to(xf.dtype), sin.to(xf.dtype))[None, :, None, :]
    return torch.view_as_real(xc * rotation).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.kind = args.attention
        self.sparse_window = args.sparse_window
        self.sparse_block = args.sparse_block
        self.sparse_topk = args.sparse_topk
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        #: Replaces the attention over (B, H, N, D) q, k, v when set: a layout that shards the
        #: sequence (context parallel) installs its own kernel. None: ``kind`` chooses.
        self.kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def init_weights(self, init_std: float, generator: torch.Generator | None = None) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06, generator=generator)
        nn.init.trunc_normal_(
            self.wo.weight, std=init_std, a=-3 * init_std, b=3 * init_std, generator=generator
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # -1 heads: stays correct when a tensor-parallel plan shards wq/wk/wv by heads.
        q = self.wq(x).view(b, n, -1, self.head_dim)
        k = self.wk(x).view(b, n, -1, self.head_dim)
        v = self.wv(x).view(b, n, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
        if self.kernel is not None:
            o = self.kernel(q, k, v)
        elif self.kind == "sparse":
            # Lazy: the dense path must not depend on training.attention.
            from training.attention import dynamic_sparse_attention

            o = dynamic_sparse_attention(
                q, k, v, window=self.sparse_window, block=self.sparse_block, topk=self.sparse_topk
            )
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, n, -1)
        return self.wo(o)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.ffn == "moe":
            self.feed_forward: nn.Module = MoE(
                args.dim,
                args.moe_hidden or args.ffn_hidden,
                args.n_experts,
                args.moe_topk,
                args.moe_bias_gamma,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        # Depth-scaled init for the residual-output projections (wo, w2).
        self.init_std = 0.02 / math.sqrt(2 * args.n_layers)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.init_std, generator)
        self.feed_forward.init_weights(self.init_std, generator)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict with string indices: names stay "layers.{i}" even if a pipeline
        # stage deletes some of them.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        #: The global positions of the ``n`` tokens a forward sees, when they are not ``0 .. n-1``
        #: (a layout that gives this process part of each sequence sets it). None: ``0 .. n-1``.
        self.rope_positions: Callable[[int], torch.Tensor] | None = None

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic in ``seed``: every parameter and buffer is (re)written, in a fixed order,
        from a private generator on the parameters' device (the global RNG is untouched)."""
        device = self.rope_cos.device
        if device.type == "meta":
            raise RuntimeError("materialise first: model.to_empty(device=...) then init_weights()")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0, generator=gen)
        for layer in self.layers.values():
            layer.init_weights(gen)
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std, generator=gen)

    def moe_layers(self) -> list[MoE]:
        return [layer.feed_forward for layer in self.layers.values() if isinstance(layer.feed_forward, MoE)]

    def update_moe_bias(self) -> list[dict]:
        """Call after each optimizer step: bias update for every MoE layer, returns their stats."""
        return [m.update_bias() for m in self.moe_layers()]

    def forward(self, tokens: torch.Tensor, return_aux: bool = False):
        """``tokens`` (B, N) long -> logits (B, N, vocab) [, aux]."""
        n = tokens.shape[1]
        if n > self.args.max_seq_len:
            raise ValueError(f"sequence length {n} > max_seq_len {self.args.max_seq_len}")
        if self.rope_positions is None:
            cos, sin = self.rope_cos[:n], self.rope_sin[:n]
        else:
            positions = self.rope_positions(n)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # Pipeline stages may drop the embedding / head (set to None): pass hidden states through.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        logits = self.output(h) if self.output is not None else h
        if not return_aux:
            return logits
        moes = self.moe_layers()
        aux = {
            # (n_moe_layers, n_experts): tokens routed to each expert in this forward.
            "moe_tokens_per_expert": (
                torch.stack([m.last_tokens_per_expert for m in moes])
                if moes
                else torch.zeros(0, 0, dtype=torch.long)
            ),
        }
        return logits, aux
