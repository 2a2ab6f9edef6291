"""Data-parallel training on CPU: tokens/s and bytes per rank for each mode at 1, 2 and 4 ranks.

    python bench/parallel.py [--data DIR] [--steps 20] [--dim 128] [--layers 4] [--ranks 1,2,4]
        [--modes ddp,ddp+zero1,fsdp,tp,fsdp+tp,pp,fsdp+pp,ddp+pp,cp,fsdp+cp,cp+pp] [--grad-norms ghost|off]

Each mode trains the same model on the same data and seed through `assay train`'s
torchrun path (training.parallel.worker), one CPU thread per rank, and reports from
the run's metrics.json and history.jsonl:

- tokens/s of the step loop (metrics.json's loop_tokens / loop_seconds: start-up,
  tokenizing and the final evaluation are not counted);
- bytes per rank of parameters, gradients and AdamW state, measured on the live
  tensors after the first optimizer step (``Parallel.memory_per_rank``, the largest
  rank), and their ratio to one process's: the ZeRO paper's "3×" of fp32 AdamW
  training (parameters + gradients + two moments = 4 × the parameters, of which the
  optimizer's part is 2×) against what each mode keeps per rank.

On 2 cores, 4 ranks share 2 cores: tokens/s says what the machine does, not what the
mode would do with a core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "single": (1, {}),
    "ddp": (None, {"dp_replicate": -2, "dp_shard": 1}),
    "ddp+zero1": (None, {"dp_replicate": -2, "dp_shard": 1, "zero1": True}),
    "fsdp": (None, {"dp_shard": -1}),
    "tp": (None, {"tp": -2, "dp_shard": 1}),  # every rank one tensor-parallel shard
    "fsdp+tp": (None, {"dp_shard": -1, "tp": 2}),  # 4 ranks: dp_shard 2 × tp 2
    "pp": (2, {"pp": 2, "dp_shard": 1}),  # two stages (params.yaml's schedule: 1F1B unless set)
    "fsdp+pp": (4, {"dp_shard": 2, "pp": 2}),  # each stage FSDP-sharded over 2 ranks
    "ddp+pp": (4, {"dp_replicate": 2, "dp_shard": 1, "pp": 2}),  # each stage replicated over 2 ranks
    "cp": (2, {"cp": 2, "dp_shard": 1}),  # every row's sequence split over 2 ranks (ring attention)
    "fsdp+cp": (4, {"dp_shard": 2, "cp": 2}),
    "cp+pp": (4, {"cp": 2, "pp": 2, "dp_shard": 1}),
}


def layout(mode: str, ranks: int) -> dict:
    fixed, spec = MODES[mode]
    spec = dict(spec)
    for name in ("dp_replicate", "tp"):
        if spec.get(name) == -2:
            spec[name] = ranks
    return spec


def run(data: Path, params_file: Path, out: Path, ranks: int, spec: dict, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    worker = ["-m", "training.parallel.worker", "--data", str(data), "--out", str(out), "--params-file",
              str(params_file), "--overwrite", "--steps", str(steps), "--parallel", json.dumps(spec)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *worker]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    wall = time.perf_counter() - started
    metrics = json.loads((out / "metrics.json").read_text())
    return {"wall_s": wall, "tokens": metrics["loop_tokens"], "loop_s": metrics["loop_seconds"], "metrics": metrics}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a dataset directory (default: 60 stdlib modules, written to a temp dir)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default="ddp,ddp+zero1,fsdp", help=f"comma-separated, of {', '.join(m for m in MODES if m != 'single')}")
    ap.add_argument("--grad-norms", choices=["ghost", "off"], default="ghost",
                    help="per-document gradient norms (train.telemetry.grad_norms; params.yaml's default is ghost): "
                         "run both to see what they cost in each layout")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="assay-bench-parallel-"))
    if args.data:
        data = Path(args.data)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from corpus import stdlib_documents, write_documents

        data = write_documents(tmp / "data", stdlib_documents(60), source="stdlib")
    params_file = tmp / "params.yaml"
    params_file.write_text(yaml.safe_dump({"train": {
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 4, "ffn_hidden": 3 * args.dim},
        "vocab_size": 2048, "seq_len": args.seq_len, "batch_size": args.batch, "steps": args.steps,
        "warmup_steps": 2, "checkpoint_every": args.steps, "eval_rows": 8, "device": "cpu",
        "telemetry": {"spike_min_history": 128, "grad_norms": args.grad_norms}}}))  # no spike skips in a short run

    rows = []
    baseline = run(data, params_file, tmp / "single", 1, {}, args.steps)
    rows.append(("single", 1, baseline))
    for mode in args.modes.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            fixed = MODES[mode][0]
            if ranks == 1 or (mode == "fsdp+tp" and ranks < 4) or (fixed is not None and ranks != fixed):
                continue  # fsdp+tp on 2 ranks would be tp alone; pp modes run at their one size
            rows.append((mode, ranks, run(data, params_file, tmp / f"{mode}-{ranks}", ranks, layout(mode, ranks),
                                          args.steps)))

    base_mem = baseline["metrics"]["memory_per_rank"]
    base_total = sum(base_mem.values())
    print(f"model: dim {args.dim}, {args.layers} layers, {baseline['metrics']['parameters']:,} parameters; "
          f"{args.steps} steps of {args.batch}×{args.seq_len}; per-document gradient norms {args.grad_norms}; "
          f"{os.cpu_count()} cores")
    print(f"{'mode':<11}{'ranks':>6}{'tok/s':>9}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}"
          f"{'total/P':>9}{'optim/P':>9}{'final loss':>12}")
    for mode, ranks, r in rows:
        mem = r["metrics"]["memory_per_rank"]
        p = base_mem["parameters"]
        print(f"{mode:<11}{ranks:>6}{r['tokens'] / r['loop_s']:>9.0f}{mem['parameters'] / 1e6:>11.2f}"
              f"{mem['gradients'] / 1e6:>10.2f}{mem['optimizer'] / 1e6:>10.2f}"
              f"{sum(mem.values()) / p:>9.2f}{mem['optimizer'] / p:>9.2f}{r['metrics']['final_loss']:>12.4f}")
    print(f"(total/P: bytes per rank of parameters + gradients + optimizer state over one process's parameter "
          f"bytes; one process: {base_total / base_mem['parameters']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
