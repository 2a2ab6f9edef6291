"""Benchmark: CPU seconds per document of ingest -> static -> domain -> dedup on the demo corpus, the
per-core throughput that the scale-out projection (RELIABILITY.md) starts from.

    cd <a checkout where `make demo` has run>   # its params.yaml, models/quality and models/domain
    OMP_NUM_THREADS=1 .venv/bin/python bench/scaleout.py [--out DIR]

Each stage's flow runs with the thread runner and ONE worker, torch on one thread, so the process's CPU
seconds (user + system, all threads, from getrusage) are one core's work; CPU seconds are what a machine
shared with other jobs disturbs least (its wall time is printed too, with the load average). The Prefect
API server runs in a subprocess and is not counted; the flow engine's own per-task work is.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the stage outputs go (default: a temporary folder)")
    args = parser.parse_args()

    import torch
    import yaml
    from prefect.testing.utilities import prefect_test_harness

    torch.set_num_threads(1)
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["flow"].update(task_runner="threads", max_workers=1)
    root = Path(args.out or tempfile.mkdtemp(prefix="assay-scaleout-"))
    root.mkdir(parents=True, exist_ok=True)
    params_file = root / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    pf = str(params_file)
    with prefect_test_harness(server_startup_timeout=120):
        from flows.dedup import dedup_flow
        from flows.domain import domain_flow
        from flows.ingest import ingest_flow
        from flows.static import static_flow

        steps = [("ingest", lambda: ingest_flow(["demo"], f"{root}/raw", overwrite=True, params_file=pf)),
                 ("static", lambda: static_flow(f"{root}/raw", f"{root}/static", overwrite=True, params_file=pf)),
                 ("domain", lambda: domain_flow(f"{root}/static", f"{root}/domain", overwrite=True, params_file=pf)),
                 ("dedup", lambda: dedup_flow(f"{root}/domain", f"{root}/dedup", overwrite=True, params_file=pf))]
        rows = []
        for name, run in steps:
            cpu, wall = _cpu_seconds(), time.perf_counter()
            manifest = run()
            cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
            n = manifest["counts"].get("input") or manifest["counts"].get("documents")
            rows.append((name, n, cpu))
            print(f"RESULT {name}: {n} docs in, {cpu:.1f} CPU-s, {wall:.1f} s wall, {n / cpu:.1f} docs per CPU-s, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    raw = rows[0][1]
    total = sum(cpu for _, _, cpu in rows)
    print("\n| stage | docs in | CPU s | docs per CPU-s | CPU ms per raw document |\n|---|---:|---:|---:|---:|")
    for name, n, cpu in rows:
        print(f"| {name} | {n:,} | {cpu:.1f} | {n / cpu:.1f} | {1000 * cpu / raw:.1f} |")
    print(f"| all four | {raw:,} | {total:.1f} | {raw / total:.1f} | {1000 * total / raw:.1f} |")
    print(f"\nworkers (cores) for 1e9 documents in an hour at this rate: {1e9 / 3600 * total / raw:,.0f}")


if __name__ == "__main__":
    main()
