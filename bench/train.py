"""Training on the demo corpus: sparse vs dense attention quality, fp32 / bf16 / fp8 loss, throughput.

    python bench/train.py [--data DIR] [--steps 200] [--seq-len 1024] [--threads 2]
                          [--configs dense,sparse,bf16,fp8,moe]

Without --data it ingests the demo corpus (`assay ingest demo`) into a temporary
directory first. Every configuration trains the same model (same seed, same
batches, same tokenizer) for the same number of steps through
``training.trainer.train``, telemetry included, and reports:

- held-out next-token accuracy and loss (the trainer's metrics.json);
- the mean training loss of the last 10 steps;
- training tokens/s over steps 2..N (forward, backward, per-document gradient norms, optimizer).

Verdicts printed at the end: sparse accuracy / dense accuracy (target >= 98.3%),
and |fp8 - bf16| / bf16 final loss (target <= 1%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assay.config import TrainModelParams, TrainParams  # noqa: E402
from assay.versions import open_version  # noqa: E402
from training.tokenizer import train_tokenizer  # noqa: E402
from training.trainer import tokenizer_texts, train  # noqa: E402


def configurations(args) -> dict[str, TrainParams]:
    model = TrainModelParams(dim=args.dim, n_layers=args.layers, n_heads=args.heads, ffn_hidden=3 * args.dim,
                             sparse_window=args.window, sparse_block=args.block, sparse_topk=args.topk)
    base = TrainParams(model=model, vocab_size=args.vocab, seq_len=args.seq_len, batch_size=args.batch,
                       steps=args.steps, warmup_steps=max(1, args.steps // 10), lr=args.lr,
                       checkpoint_every=args.steps, eval_rows=args.eval_rows, device="cpu", holdout=0.05)
    sparse = dataclasses.replace(model, attention="sparse")
    moe = dataclasses.replace(model, ffn="moe", n_experts=4, moe_topk=2, moe_hidden=args.dim * 3 // 2)
    return {
        "dense": base,  # fp32, dense attention: the reference
        "sparse": dataclasses.replace(base, model=sparse),
        "bf16": dataclasses.replace(base, precision="bf16"),
        "fp16": dataclasses.replace(base, precision="fp16"),  # with dynamic loss scaling
        "fp8": dataclasses.replace(base, precision="fp8"),
        "fp8_fp16": dataclasses.replace(base, precision="fp8_fp16"),  # fp8 with fp16 (and loss scaling) for the rest
        "moe": dataclasses.replace(base, model=moe),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a dataset directory (default: ingest the demo corpus)")
    ap.add_argument("--configs", default="dense,sparse,bf16,fp8,moe",
                    help="comma-separated, of: dense, sparse, bf16, fp16, fp8, fp8_fp16, moe")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--eval-rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="where the runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.out or tempfile.mkdtemp(prefix="assay-bench-train-"))
    data = args.data
    if data is None:
        data = str(work / "demo")
        if not (Path(data) / "manifest.json").exists():
            print("ingesting the demo corpus …", flush=True)
            subprocess.run([str(Path(sys.executable).parent / "assay"), "ingest", "demo", "--out", data,
                            "--overwrite"], check=True, capture_output=True)
    version = open_version(data)
    configs = configurations(args)
    wanted = args.configs.split(",")
    print(f"data {data}: {len(version.shards)} shard(s); {args.steps} steps of batch {args.batch} x "
          f"{args.seq_len} tokens; model dim {args.dim}, {args.layers} layers; sparse window {args.window}, "
          f"block {args.block}, top-{args.topk}; {args.threads} threads")

    # One tokenizer for all, so losses are comparable; each run starts from a copy of it.
    tokenizer = train_tokenizer(tokenizer_texts(version, configs["dense"]), args.vocab)
    results = {}
    header = f"{'config':8} {'val acc':>8} {'val loss':>9} {'loss@end':>9} {'tok/s':>8} {'seconds':>8}"
    print(header)
    for name in wanted:
        params = configs[name]
        start = time.perf_counter()
        marks: list[tuple[float, int]] = []

        def count(record: dict) -> None:
            marks.append((time.perf_counter(), record["tokens"]))

        result = train(version, work / name, params, overwrite=True, progress=False, on_step=count,
                       tokenizer=tokenizer)
        seconds = time.perf_counter() - start
        # Steps 2..N only: tokenizing the corpus and the first step's allocations are not throughput.
        tokens_per_s = sum(t for _, t in marks[1:]) / (marks[-1][0] - marks[0][0])
        m = result.metrics
        results[name] = {**{k: m[k] for k in ("val_accuracy", "val_loss", "final_loss_mean10", "skipped_steps")},
                         "tokens_per_s": tokens_per_s, "seconds": seconds}
        print(f"{name:8} {m['val_accuracy']:8.4f} {m['val_loss']:9.4f} {m['final_loss_mean10']:9.4f} "
              f"{tokens_per_s:8.0f} {seconds:8.1f}", flush=True)

    if "dense" in results and "sparse" in results:
        ratio = results["sparse"]["val_accuracy"] / results["dense"]["val_accuracy"]
        print(f"sparse / dense held-out accuracy: {ratio:.2%} (target >= 98.3%)")
    if "bf16" in results and "fp8" in results:
        gap = abs(results["fp8"]["final_loss_mean10"] - results["bf16"]["final_loss_mean10"])
        print(f"|fp8 - bf16| final loss: {gap / results['bf16']['final_loss_mean10']:.2%} of bf16 (target <= 1%)")
    for half, fp8 in (("bf16", "fp8"), ("fp16", "fp8_fp16")):
        if "dense" in results and half in results:
            gap = results[half]["final_loss_mean10"] / results["dense"]["final_loss_mean10"] - 1
            print(f"{half} - fp32 final loss: {gap:+.2%} of fp32; {results[half]['skipped_steps']} step(s) skipped")
    if "fp16" in results and "fp8_fp16" in results:
        gap = abs(results["fp8_fp16"]["final_loss_mean10"] - results["fp16"]["final_loss_mean10"])
        print(f"|fp8_fp16 - fp16| final loss: {gap / results['fp16']['final_loss_mean10']:.2%} of fp16")
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(f"runs and results.json in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
