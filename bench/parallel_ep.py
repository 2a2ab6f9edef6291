"""Expert parallel on CPU: bytes per rank (all parameters and the experts alone) at ep 1 and 2.

    python bench/parallel_ep.py [--steps 4] [--dim 128] [--layers 4] [--experts 8] [--four]

Trains one MoE model (top-2 of ``--experts``) through `assay train`'s torchrun path as one
process, FSDP on 2 ranks (experts sharded like every other weight) and FSDP + ep 2 (each
rank keeps half the experts whole; the rest is FSDP-sharded), with ``--four`` also FSDP 4
and FSDP 4 + ep 2 (each expert on 2 of the 4 ranks, FSDP-sharded between them), and reports
``Parallel.memory_per_rank`` (largest rank, after the first optimizer step), tokens/s and
the final loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from parallel import run  # noqa: E402  (bench/parallel.py: one torchrun of the worker)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--four", action="store_true", help="also 4 ranks: FSDP 4, and FSDP 4 with ep 2 (2 sharded copies of each expert)")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="assay-bench-ep-"))
    sys.path.insert(0, str(ROOT / "tests"))
    from corpus import stdlib_documents, write_documents

    data = write_documents(tmp / "data", stdlib_documents(30), source="stdlib")
    hidden = 3 * args.dim
    params_file = tmp / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 4, "ffn_hidden": hidden, "ffn": "moe",
                  "n_experts": args.experts, "moe_topk": 2, "moe_hidden": hidden},
        "vocab_size": 2048, "seq_len": 128, "batch_size": 8, "steps": args.steps,
        "warmup_steps": 2, "checkpoint_every": args.steps, "eval_rows": 8, "device": "cpu",
        "telemetry": {"spike_min_history": 128}}}))
    expert_bytes = args.layers * args.experts * 3 * args.dim * hidden * 4  # fp32 SwiGLU w1, w2, w3

    rows = [("single", 1, run(data, params_file, tmp / "single", 1, {}, args.steps)),
            ("fsdp", 2, run(data, params_file, tmp / "fsdp", 2, {"dp_shard": 2}, args.steps)),
            ("fsdp+ep", 2, run(data, params_file, tmp / "ep", 2, {"dp_shard": 2, "ep": 2}, args.steps))]
    if args.four:
        rows += [("fsdp", 4, run(data, params_file, tmp / "fsdp4", 4, {"dp_shard": 4}, args.steps)),
                 ("fsdp+ep", 4, run(data, params_file, tmp / "ep4", 4, {"dp_shard": 4, "ep": 2}, args.steps))]
    total = rows[0][2]["metrics"]["parameters"]
    print(f"model: dim {args.dim}, {args.layers} MoE layers × {args.experts} experts (top-2, hidden {hidden}), "
          f"{total:,} parameters of which experts {expert_bytes // 4:,}; {args.steps} steps; {os.cpu_count()} cores")
    print(f"{'mode':<9}{'ranks':>6}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}"
          f"{'tok/s':>8}{'final loss':>12}")
    for mode, ranks, r in rows:
        mem = r["metrics"]["memory_per_rank"]
        print(f"{mode:<9}{ranks:>6}{mem['parameters'] / 1e6:>11.2f}{mem['gradients'] / 1e6:>10.2f}"
              f"{mem['optimizer'] / 1e6:>10.2f}{r['tokens'] / r['loop_s']:>8.0f}"
              f"{r['metrics']['final_loss']:>12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
