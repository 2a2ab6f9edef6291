"""Tier 1 measured on labelled data, old settings against new, in one run.

    .venv/bin/python bench/tier1_pool.py [--raw DIR] [--head DIR] [--params FILE] [--words paper|datatrove] [--json FILE]

Without --raw, `assay ingest demo` (params.yaml's `demo:` section) is run
into a temporary directory; without --head, the quality head is trained
there with the reference recipe (`quality:` section: positives are the
reference set, negatives come only from the `negatives_share` part of the
pool, and the head is Platt-calibrated on the dev part).

Three labelled sets, labels by provenance only:
- the pool's **dev part** (`quality.dev_share`): where settings are chosen.
  The run re-derives the choices by the rules written down before they were
  made (the notes in BENCHMARKS.md): the line handling of C4's and FineWeb's
  rules (A: as published; B: hard-wrapped paragraphs reflowed; C: B, and
  the Gopher rules only for plain-text file sources, `static.source_rules`)
  and `static.threshold` (the grid value maximising tier 1's good kept +
  junk dropped);
- the pool's **measured part**: reported on, never chosen on (but its
  numbers were seen before this change);
- the **fresh set** (`assay.quality.fresh`): other files of this machine,
  of kinds the pool never reads, labelled before any score was computed.

On the last two, side by side: the **old** settings (published line rules
without reflow, no per-source rules, the head's raw probability at 0.44)
and the **new** ones (params.yaml: reflow, `static.source_rules`, the
calibrated head at `static.threshold`). For each: heuristics alone, the
head alone, tier 1 (both), the head's ROC AUC on every labelled document
and its calibration error (ECE), and per source the keep rates.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The settings before this change (BENCHMARKS.md's earlier tier 1 table).
OLD_THRESHOLD = 0.44
THRESHOLD_GRID = [round(x, 2) for x in np.arange(0.05, 0.951, 0.05)]


def pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def old_params(params):
    """params.yaml with the settings this change replaced (the head is scored raw by the caller)."""
    heuristics = dataclasses.replace(params.static.heuristics,
                                     reflow=dataclasses.replace(params.static.heuristics.reflow, enabled=False))
    static = dataclasses.replace(params.static, heuristics=heuristics, source_rules={}, threshold=OLD_THRESHOLD)
    return dataclasses.replace(params, static=static)


def choose_on_dev(docs: dict, params, raw_scorer, calibrated_scorer, encoder=None) -> dict:
    """The dev-part choices, by the rules fixed before they were made."""
    import pyarrow as pa

    from assay.quality.pool import keep_rates, pool_labels
    from filters.heuristics import apply_by_source, build_heuristics

    labels = pool_labels(docs["source"], [len(t) for t in docs["text"]])
    batch = pa.record_batch({"text": pa.array(docs["text"], pa.large_string()), "kind": pa.array(docs["kind"]),
                             "source": pa.array(docs["source"])})
    embeddings = encoder.encode(docs["text"]) if encoder is not None else None
    raw = raw_scorer.score(docs["text"], embeddings) >= OLD_THRESHOLD
    h = params.static.heuristics
    no_reflow = dataclasses.replace(h, reflow=dataclasses.replace(h.reflow, enabled=False))
    candidates = {
        "A: published line rules": (no_reflow, {}),
        "B: reflow": (h, {}),
        "C: reflow + Gopher rules only for file sources": (h, params.static.source_rules),
    }
    lines = {}
    for name, (heuristics, rules) in candidates.items():
        keep = apply_by_source(build_heuristics(heuristics), batch, rules).keep
        lines[name] = {"heuristics": keep_rates(labels, keep), "tier1": keep_rates(labels, keep & raw)}
    eligible = [n for n, v in lines.items() if v["tier1"]["junk_dropped"] >= 0.9]
    # Ties go to the earlier candidate (fewer changes to the published rules).
    chosen_lines = max(eligible, key=lambda n: (lines[n]["tier1"]["good_kept"], -list(candidates).index(n)))
    heuristics, rules = candidates[chosen_lines]
    keep = apply_by_source(build_heuristics(heuristics), batch, rules).keep
    quality = calibrated_scorer.score(docs["text"], embeddings)
    grid = {}
    for t in THRESHOLD_GRID:
        r = keep_rates(labels, keep & (quality >= t))
        grid[t] = r["good_kept"] + r["junk_dropped"]
    chosen_threshold = max(grid, key=lambda t: (round(grid[t], 12), -abs(t - 0.5)))
    return {"candidates": lines, "chosen_lines": chosen_lines, "threshold_grid": grid,
            "chosen_threshold": chosen_threshold, "labelled": int((labels >= 0).sum()), "good": int((labels == 1).sum())}


def print_choice(choice: dict, params) -> None:
    print(f"## dev part: the choices ({choice['labelled']} labelled, {choice['good']} good)\n")
    print("| line handling (head raw at 0.44) | heuristics: good kept / junk dropped | tier 1 |")
    print("|---|---|---|")
    for name, v in choice["candidates"].items():
        print(f"| {name} | {pct(v['heuristics']['good_kept'])} / {pct(v['heuristics']['junk_dropped'])} | "
              f"{pct(v['tier1']['good_kept'])} / {pct(v['tier1']['junk_dropped'])} |")
    grid = ", ".join(f"{t}: {v:.3f}" for t, v in choice["threshold_grid"].items())
    print(f"\nchosen: {choice['chosen_lines']}; threshold (calibrated head): {choice['chosen_threshold']} "
          f"(params.yaml: {params.static.threshold})\ngood kept + junk dropped per threshold: {grid}\n")


def print_side_by_side(name: str, old: dict, new: dict) -> None:
    print(f"## {name}: {new['documents']} text documents, {new['labelled']} labelled "
          f"({new['heuristics']['good']} good, {new['heuristics']['junk']} junk)\n")
    print("| judge | old: good kept | old: junk dropped | new: good kept | new: junk dropped | new: precision |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, key in (("heuristics", "heuristics"), ("head alone", "head"), ("**tier 1**", "tier1")):
        o, n = old[key], new[key]
        print(f"| {label} | {pct(o['good_kept'])} | {pct(o['junk_dropped'])} | {pct(n['good_kept'])} | "
              f"{pct(n['junk_dropped'])} | {pct(n['precision'])} |")
    print(f"\nhead ROC AUC on every labelled document: old {old['head']['auc']:.4f}, new {new['head']['auc']:.4f}; "
          f"ECE: old {old['head']['ece']:.3f} (raw), new {new['head']['ece']:.3f} (calibrated); "
          f"thresholds {old['threshold']} / {new['threshold']}")
    print("each filter alone (new settings): " + "; ".join(
        f"{k} {pct(v['good_kept'])} / {pct(v['junk_dropped'])}" for k, v in new["filters_alone"].items()))
    print("\n| source | label | n | old: heuristics / tier 1 keep | new: heuristics / head / tier 1 keep | "
          "new head median | top drop reasons (new heuristics) |")
    print("|---|---|---:|---|---|---:|---|")
    for source, v in new["per_source"].items():
        o = old["per_source"][source]
        reasons = ", ".join(f"{k.split(':', 1)[1]} {c}" for k, c in v["top_reasons"]) or "-"
        print(f"| {source} | {v['label']} | {v['n']} | {pct(o['heuristics_keep'])} / {pct(o['tier1_keep'])} | "
              f"{pct(v['heuristics_keep'])} / {pct(v['head_keep'])} / {pct(v['tier1_keep'])} | "
              f"{v['head_median']:.3f} | {reasons} |")
    print()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", help="an ingested demo corpus (default: ingest one into a temporary directory)")
    parser.add_argument("--head", help="a trained quality head (default: train one on --raw)")
    parser.add_argument("--params", help="params.yaml (default: the nearest one)")
    parser.add_argument("--words", choices=["paper", "datatrove"], help="override static.heuristics.words")
    parser.add_argument("--fresh-per-kind", type=int, default=None, help="fresh documents per kind (default 60)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)

    from assay.config import load_params
    from assay.quality.fresh import FRESH_LABELS, PER_KIND, read_fresh
    from assay.quality.pool import DEV, MEASURED, measure_tier1, read_pool
    from assay.encoder import shared_encoder
    from assay.quality.scorer import HeadScorer, encoder_for
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
              f"held-out AUC {report['head']['auc']:.4f}; calibration {report.get('calibration')}\n")
    new = dataclasses.replace(params, static=dataclasses.replace(params.static, head=head, model=None))
    old = old_params(new)
    raw_scorer, calibrated = HeadScorer(head, calibrated=False), HeadScorer(head)
    if calibrated.calibration is None:
        print("note: this head carries no calibration; the new settings score it raw\n")

    # Only an embedding head needs the encoder; a words head reads the text.
    encoder = shared_encoder(encoder_for(new.static)) if calibrated.needs_embeddings else None
    choice = choose_on_dev(read_pool(raw, new, part=DEV), new, raw_scorer, calibrated, encoder)
    print_choice(choice, new)
    result = {"dev_choice": choice}
    measured = read_pool(raw, new, part=MEASURED)
    fresh = read_fresh(args.fresh_per_kind or PER_KIND)
    for name, docs, labels in (("measured part of the pool", measured, None), ("fresh set", fresh, FRESH_LABELS)):
        extra = {} if labels is None else {"source_labels": labels}
        o = measure_tier1(docs, old, encoder, raw_scorer, **extra)
        n = measure_tier1(docs, new, encoder, calibrated, **extra)
        print_side_by_side(name, o, n)
        result[name] = {"old": o, "new": n}
    print(f"total {time.perf_counter() - started:.0f} s (raw: {raw}, head: {head})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
