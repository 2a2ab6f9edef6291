"""Tier 1 measured on the demo corpus's labelled pool: precision and recall, and the head's AUC.

    .venv/bin/python bench/tier1_pool.py [--raw DIR] [--head DIR] [--words paper|datatrove] [--json FILE]

Without --raw, `assay ingest demo` (params.yaml's `demo:` section) is run
into a temporary directory; without --head, the quality head is trained
there with the reference recipe (`quality:` section: positives are the
reference set, negatives come only from the `negatives_share` part of the
pool). Tier 1 is then measured on the measured part of the pool (neither
the negatives' part nor the dev part where settings are chosen; `--part dev`
reports on the dev part), with the labels of `assay.quality.pool` (set by
file provenance, before any score was seen):

- heuristics alone (the chain as the static stage runs it), each filter
  alone, the head alone at `static.threshold`, and tier 1 (both);
- the head's ROC AUC (good against junk) on every labelled document, not
  only on the heuristics' survivors;
- per source: how many, the keep rates, the top drop reasons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def print_report(r: dict) -> None:
    print(f"pool ({r['part']} part): {r['documents']} text documents, {r['labelled']} labelled "
          f"({r['heuristics']['good']} good, {r['heuristics']['junk']} junk); words: {r['words']}; "
          f"threshold {r['threshold']}\n")
    print("| judge | good prose kept (recall) | junk dropped | precision of kept |")
    print("|---|---:|---:|---:|")
    rows = [("heuristics (chain)", r["heuristics"])]
    rows += [(f"  {name} alone", v) for name, v in r["filters_alone"].items()]
    if r["gopher_chain"]:
        rows.append(("  Gopher rules only (repetition, then quality)", r["gopher_chain"]))
    rows += [("head alone", r["head"]), ("**tier 1 (heuristics, then head)**", r["tier1"])]
    if r["tier1_gopher_only"]:
        rows.append(("tier 1 with the Gopher rules only", r["tier1_gopher_only"]))
    for label, v in rows:
        print(f"| {label} | {pct(v['good_kept'])} | {pct(v['junk_dropped'])} | {pct(v['precision'])} |")
    print(f"\nhead ROC AUC, good vs junk, on every labelled document: {r['head']['auc']:.4f} "
          f"(on the heuristics' survivors only: {r['head']['auc_on_heuristic_survivors']:.4f})")
    q = r["head"]["score_p10_p50_p90"]
    print(f"head scores, 10th/50th/90th percentile: good {', '.join(f'{v:.3f}' for v in q['good'])}; "
          f"junk {', '.join(f'{v:.3f}' for v in q['junk'])}\n")
    print("| source | label | n | labelled | heuristics keep | head keep | tier 1 keep | head median | "
          "top drop reasons (heuristics) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for source, v in r["per_source"].items():
        reasons = ", ".join(f"{k.split(':', 1)[1]} {c}" for k, c in v["top_reasons"]) or "-"
        print(f"| {source} | {v['label']} | {v['n']} | {v['labelled']} | {pct(v['heuristics_keep'])} | "
              f"{pct(v['head_keep'])} | {pct(v['tier1_keep'])} | {v['head_median']:.3f} | {reasons} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", help="an ingested demo corpus (default: ingest one into a temporary directory)")
    parser.add_argument("--head", help="a trained quality head (default: train one on --raw)")
    parser.add_argument("--params", help="params.yaml (default: the nearest one)")
    parser.add_argument("--words", choices=["paper", "datatrove"], help="override static.heuristics.words")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--part", choices=["measured", "dev"], default="measured",
                        help="which part of the pool to report on (dev: where settings are chosen)")
    parser.add_argument("--threshold", type=float, help="override static.threshold")
    args = parser.parse_args(argv)

    from assay.config import load_params
    from assay.encoder import shared_encoder
    from assay.quality.pool import measure_tier1, read_pool
    from assay.quality.scorer import build_scorer, encoder_for
    from assay.quality.train import reference_examples, train_head

    params = load_params(args.params)
    if args.words:
        params.static.heuristics.words = args.words
    work = Path(tempfile.mkdtemp(prefix="assay-tier1-pool-"))
    started = time.perf_counter()
    raw = args.raw
    if raw is None:
        raw = str(work / "raw")
        cmd = [str(Path(sys.executable).with_name("assay")), "ingest", "demo", "--out", raw]
        if args.params:
            cmd += ["--params", args.params]
        subprocess.run(cmd, check=True, env=dict(os.environ, PREFECT_LOGGING_LEVEL="WARNING"),
                       stdout=subprocess.DEVNULL)
    head = args.head
    if head is None:
        head = str(work / "head")
        report = train_head(reference_examples(raw, params), params, head, recipe="reference")
        t = report["training"]
        print(f"head trained: {t['examples']} examples ({t['positives']} reference), "
              f"held-out AUC {report['head']['auc']:.4f}\n")
    static = dataclasses.replace(params.static, head=head, model=None)
    if args.threshold is not None:
        static = dataclasses.replace(static, threshold=args.threshold)
    params = dataclasses.replace(params, static=static)
    docs = read_pool(raw, params, part=args.part)
    result = {"part": args.part, **measure_tier1(docs, params, shared_encoder(encoder_for(static)), build_scorer(static))}
    print_report(result)
    print(f"\ntotal {time.perf_counter() - started:.0f} s (raw: {raw}, head: {head})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
