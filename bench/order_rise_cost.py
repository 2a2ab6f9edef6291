"""The scoring pass's cost of `score.order_rise`: one run and corpus scored with it off and on, interleaved.

    .venv/bin/python bench/order_rise_cost.py --bench /tmp/ord/s3 [--repeats 2]

--bench is a `bench/planted.py --out DIR` run (its `corpus` and `round-0`). Each pass scores the last checkpoint
with params.yaml's `score` and the bench's reference set, on one thread; printed: the pass's own timings
(manifest `timings`: wall and CPU seconds, of which the reference gradients), then the CPU ratio on / off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: bench/planted.py's default --reference.
REFERENCE = {"pydoc-topics": 1.0, "man": 0.5, "python-stdlib": 0.3, "pypi-description": 0.3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, required=True, help="a bench/planted.py output directory")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    from assay.config import load_params
    from training.score import score_dataset

    torch.set_num_threads(1)
    base = dataclasses.replace(load_params(ROOT / "params.yaml").score, checkpoints=["last"], reference=REFERENCE,
                               device="cpu")
    cpu: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for on in (False, True):
                out = Path(tmp) / f"scores-{on}-{rep}"
                manifest = score_dataset(args.bench / "round-0", args.bench / "corpus", out,
                                         dataclasses.replace(base, order_rise=on), progress=False)
                t = manifest["timings"]
                cpu[on].append(t["cpu_seconds"])
                print(f"order_rise {str(on):<5} round {rep}: {json.dumps(t)}", flush=True)
    off, on = sorted(cpu[False])[len(cpu[False]) // 2], sorted(cpu[True])[len(cpu[True]) // 2]
    print(f"CPU s, median: off {off:.1f}, on {on:.1f}: {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
