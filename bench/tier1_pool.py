"""Tier 1 measured on labelled data, previous settings against new, in one run.

    .venv/bin/python bench/tier1_pool.py [--raw DIR] [--head DIR] [--before-head DIR] [--previous-head DIR]
                                         [--params FILE] [--json FILE] [--dev-only | --seen-only]
    .venv/bin/python bench/tier1_pool.py --raw DIR --shape-grid   # tier1e's choice of shape_scale and words_l2

Without --raw, `assay ingest demo` (params.yaml's `demo:` section) is run
into a temporary directory; without --head / --previous-head, the quality
heads are trained there with the reference recipe (`quality:` section:
positives are the reference set, negatives come only from the
`negatives_share` part of the pool, Platt-calibrated on the dev part): the
new one as params.yaml says; the one before tier1f's change (tier1e's
head) with tier1e's settings and without the pool's extra kinds
(`assay.ingest.demo.EXTRA_POOL_KINDS`: read as if the corpus did not hold
them), the previous one also without them, without the shape features and
with `quality.markup: false`.

Eight labelled sets, labels by provenance only:
- the pool's **dev part** (`quality.dev_share`; the kinds the pool had
  before tier1f, so that it holds the documents tier1e measured): where
  settings are chosen.
  The run re-derives every choice by the rules written down before they
  were made (BENCHMARKS.md): markup to text for the heuristics
  (`static.heuristics.markup`), the key-value records rule's threshold
  (`static.heuristics.records`), whether the head reads markup-stripped
  words (`quality.markup`), and `static.threshold`;
- the pool's **measured part** (same kinds), and the **first fresh set**
  (`assay.quality.fresh`): reported, never chosen on, but their numbers
  were seen before this change;
- **fresh set 2** (`assay.quality.fresh2`, its manifest
  tests/data/tier1_fresh2_manifest.tsv written before any score): scored
  first by the tier1c change's run; its misses motivated the records rule's
  comment and value-line classes, so it is seen;
- **fresh set 3** (`assay.quality.fresh3`, manifest written before any
  score): scored first by the tier1d run; its misses motivated tier1e's
  change (shape features in the head, comment runs in the markup step), and
  the shape features' scale and the words head's penalty were chosen on it
  and the sets above, so it is seen;
- the pool's **extra kinds** (tier1f's `EXTRA_POOL_KINDS`), dev and measured
  parts: junk only, so no AUC; the new head was trained on their negatives
  part and calibrated on their dev part (in-distribution, shown apart);
- **fresh set 4** (`assay.quality.fresh4`, its manifest
  tests/data/tier1_fresh4_manifest.tsv written before tier1e's change and
  before any score): scored first by tier1e's run; tier1f chose its change
  on it and the sets above, so it is seen;
- **fresh set 5** (`assay.quality.fresh5`, its manifest
  tests/data/tier1_fresh5_manifest.tsv written before tier1f's change and
  before any score, from folders no other set and no extra pool kind
  reads): unseen until this run, never chosen on.

On each, three settings: the **previous** ones (reflow, Gopher rules for
plain-text file sources, the calibrated raw-words head at 0.65: no markup
step, no records rule), the ones **before** tier1f (tier1e's: the head on
words and shape features trained without the extra pool kinds,
`words_l2` 0.1, `negatives_per_positive` 1.0, `static.threshold` 0.35),
and the **new** ones (params.yaml): heuristics alone, the head alone, tier
1 (both), the head's ROC AUC on every labelled document, and per kind the
keep rates (before -> new side by side). (tier1d's column, the markup step
without comment runs, was dropped: its numbers are in BENCHMARKS.md.)

`--shape-grid` re-derives tier1e's choice alone: a head per (shape_scale,
words_l2), its AUC on the seen sets (never fresh set 4), and the choice by
the rule fixed before the grid was first run (the largest minimum AUC).
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

THRESHOLD_GRID = [round(x, 2) for x in np.arange(0.05, 0.951, 0.05)]
RECORDS_GRID = [0.5, 0.6, 0.7, 0.8, 0.9]
#: static.threshold before this change (chosen on the dev part for the raw-words head).
PREVIOUS_THRESHOLD = 0.65
#: The words head's L2 penalty before tier1e (chosen on the dev part for words alone).
BEFORE_WORDS_L2 = 0.05
#: tier1e's settings (the "before" column): the shape head's penalty and scale, its negatives per positive,
#: static.threshold.
TIER1E_WORDS_L2 = 0.1
TIER1E_SHAPE_SCALE = 1.0
TIER1E_NEGATIVES_PER_POSITIVE = 1.0
TIER1E_THRESHOLD = 0.35


def pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def without_records(source_rules: dict) -> dict:
    return {k: [n for n in v if n != "records"] for k, v in source_rules.items()}


def previous_params(params, head: str):
    """params.yaml with the settings the tier1c change replaced (no markup step, no records rule, raw-words head)."""
    h = params.static.heuristics
    heuristics = dataclasses.replace(h, markup=dataclasses.replace(h.markup, enabled=False),
                                     records=dataclasses.replace(h.records, enabled=False))
    static = dataclasses.replace(params.static, heuristics=heuristics, head=head, model=None,
                                 source_rules=without_records(params.static.source_rules),
                                 threshold=PREVIOUS_THRESHOLD)
    quality = dataclasses.replace(params.quality, markup=False, shape=False, words_l2=BEFORE_WORDS_L2,
                                  negatives_per_positive=TIER1E_NEGATIVES_PER_POSITIVE, provenance_labels=False)
    return dataclasses.replace(params, static=static, quality=quality)


def before_params(params, head: str):
    """params.yaml as before tier1f (tier1e's settings); train its head without the extra pool kinds."""
    static = dataclasses.replace(params.static, head=head, model=None, threshold=TIER1E_THRESHOLD)
    quality = dataclasses.replace(params.quality, shape=True, shape_scale=TIER1E_SHAPE_SCALE,
                                  words_l2=TIER1E_WORDS_L2, negatives_per_positive=TIER1E_NEGATIVES_PER_POSITIVE,
                                  provenance_labels=False)
    return dataclasses.replace(params, static=static, quality=quality)


def split_extra(docs: dict) -> tuple[dict, dict]:
    """A pool part's documents of the kinds the pool had before tier1f, and those of its extra kinds."""
    from assay.ingest.demo import EXTRA_POOL_KINDS

    extra = [s in EXTRA_POOL_KINDS for s in docs["source"]]
    return ({k: [x for x, e in zip(v, extra) if not e] for k, v in docs.items()},
            {k: [x for x, e in zip(v, extra) if e] for k, v in docs.items()})


def _batch(docs: dict):
    import pyarrow as pa

    return pa.record_batch({"text": pa.array(docs["text"], pa.large_string()), "kind": pa.array(docs["kind"]),
                            "source": pa.array(docs["source"])})


def choose_on_dev(docs: dict, params, previous_scorer, new_scorer) -> dict:
    """The dev-part choices, by the rules fixed before they were made (BENCHMARKS.md)."""
    from assay.quality.metrics import roc_auc
    from assay.quality.pool import keep_rates, pool_labels
    from filters.heuristics import apply_by_source, build_heuristics
    from filters.records import RecordsFilter

    labels = pool_labels(docs["source"], [len(t) for t in docs["text"]])
    labelled = labels >= 0
    batch = _batch(docs)
    h = params.static.heuristics
    rules_before = without_records(params.static.source_rules)
    q_prev = previous_scorer.score(docs["text"], None)
    head_prev = q_prev >= PREVIOUS_THRESHOLD
    out: dict = {"labelled": int(labelled.sum()), "good": int((labels == 1).sum())}

    # 1. markup to text for the heuristics (records off, the previous head at its threshold).
    markup = {}
    for enabled in (False, True):
        hh = dataclasses.replace(h, markup=dataclasses.replace(h.markup, enabled=enabled),
                                 records=dataclasses.replace(h.records, enabled=False))
        keep = apply_by_source(build_heuristics(hh), batch, rules_before).keep
        markup[enabled] = {"heuristics": keep_rates(labels, keep), "tier1": keep_rates(labels, keep & head_prev)}
    eligible = [m for m, v in markup.items() if v["tier1"]["junk_dropped"] >= 0.9]
    out["markup"] = {str(k): v for k, v in markup.items()}
    out["chosen_markup"] = max(eligible, key=lambda m: (markup[m]["tier1"]["good_kept"], not m))

    # 2. the records rule alone (line classes as params.yaml): the lowest grid value dropping <= 1% of dev good prose.
    frac = RecordsFilter(dataclasses.replace(h.records, max_field_lines_frac=None)).apply(batch).scores[
        "records:field_lines_frac"]
    frac = np.nan_to_num(frac, nan=0.0)
    sources = np.array(docs["source"])
    grid = {}
    for t in RECORDS_GRID:
        dropped = frac > t
        grid[t] = {"good_dropped": float(dropped[labels == 1].mean()), "junk_dropped": float(dropped[labels == 0].mean()),
                   "pypi_metadata_dropped": float(dropped[sources == "pypi-metadata"].mean())}
    out["records_grid"] = grid
    ok = [t for t in RECORDS_GRID if grid[t]["good_dropped"] <= 0.01]
    out["chosen_records"] = min(ok) if ok else None

    # 2b. the records rule's line classes (comment lines out of the share, `key value` lines as fields):
    # each on unless, with it, the rule alone at the chosen threshold drops > 1% of dev good prose.
    classes = {}
    t = out["chosen_records"] if out["chosen_records"] is not None else 0.5
    for comments in (False, True):
        for values in (False, True):
            rp = dataclasses.replace(h.records, max_field_lines_frac=None, skip_comments=comments, value_lines=values)
            f = np.nan_to_num(RecordsFilter(rp).apply(batch).scores["records:field_lines_frac"], nan=0.0)
            classes[f"comments {'out' if comments else 'in'}, value lines {'on' if values else 'off'}"] = {
                "good_dropped": float((f[labels == 1] > t).mean()), "junk_dropped": float((f[labels == 0] > t).mean()),
                "max_good_frac": float(f[labels == 1].max()) if (labels == 1).any() else float("nan")}
    out["records_classes"] = classes
    out["chosen_skip_comments"] = classes["comments out, value lines off"]["good_dropped"] <= 0.01
    out["chosen_value_lines"] = classes["comments in, value lines on"]["good_dropped"] <= 0.01

    # 3. the head reading markup-stripped words or not, with the heuristics chosen so far.
    hh = dataclasses.replace(h, markup=dataclasses.replace(h.markup, enabled=out["chosen_markup"]),
                             records=dataclasses.replace(h.records, enabled=out["chosen_records"] is not None,
                                                         max_field_lines_frac=out["chosen_records"]))
    keep = apply_by_source(build_heuristics(hh), batch, params.static.source_rules).keep
    q_new = new_scorer.score(docs["text"], None)
    heads = {}
    for name, q in (("raw words", q_prev), ("markup-stripped words", q_new)):
        heads[name] = {"auc": roc_auc(labels[labelled] == 1, q[labelled]),
                       "tier1": keep_rates(labels, keep & (q >= PREVIOUS_THRESHOLD))}
    out["head"] = heads
    eligible = [n for n, v in heads.items() if v["tier1"]["junk_dropped"] >= 0.9]
    out["chosen_head"] = max(eligible, key=lambda n: (heads[n]["tier1"]["good_kept"], n == "raw words"))

    # 4. the threshold, with everything above.
    q = q_new if out["chosen_head"] == "markup-stripped words" else q_prev
    thresholds = {}
    for t in THRESHOLD_GRID:
        r = keep_rates(labels, keep & (q >= t))
        thresholds[t] = r["good_kept"] + r["junk_dropped"]
    out["threshold_grid"] = thresholds
    out["chosen_threshold"] = max(thresholds, key=lambda t: (round(thresholds[t], 12), -abs(t - 0.5)))
    return out


def shape_on_dev(docs: dict, before_scorer, new_scorer) -> dict:
    """The head before and after tier1f's change on the dev part (informational: tier1e chose the shape
    features' scale and the penalty, tier1f the extra kinds, on the seen sets, BENCHMARKS.md)."""
    from assay.quality.metrics import roc_auc
    from assay.quality.pool import pool_labels

    labels = pool_labels(docs["source"], [len(t) for t in docs["text"]])
    labelled = labels >= 0
    return {name: roc_auc(labels[labelled] == 1, scorer.score(docs["text"], None)[labelled])
            for name, scorer in (("tier1e's head (before)", before_scorer), ("new head", new_scorer))}


def print_choice(choice: dict, params) -> None:
    print(f"## dev part: the choices ({choice['labelled']} labelled, {choice['good']} good)\n")
    print("| 1. heuristics' markup step (records off; previous head at 0.65) | heuristics: good kept / junk dropped | tier 1 |")
    print("|---|---|---|")
    for name, v in choice["markup"].items():
        print(f"| markup {'on' if name == 'True' else 'off'} | {pct(v['heuristics']['good_kept'])} / "
              f"{pct(v['heuristics']['junk_dropped'])} | {pct(v['tier1']['good_kept'])} / {pct(v['tier1']['junk_dropped'])} |")
    print(f"\nchosen: markup {'on' if choice['chosen_markup'] else 'off'} "
          f"(params.yaml: {'on' if params.static.heuristics.markup.enabled else 'off'})\n")
    print("| 2. records: max_field_lines_frac | good prose dropped (rule alone) | junk dropped | METADATA headers dropped |")
    print("|---:|---:|---:|---:|")
    for t, v in choice["records_grid"].items():
        print(f"| {t} | {pct(v['good_dropped'])} | {pct(v['junk_dropped'])} | {pct(v['pypi_metadata_dropped'])} |")
    print(f"\nchosen: {choice['chosen_records']} (params.yaml: {params.static.heuristics.records.max_field_lines_frac})\n")
    print("| 2b. records line classes (rule alone at the chosen threshold) | good prose dropped | junk dropped | "
          "largest share on good prose |")
    print("|---|---:|---:|---:|")
    for name, v in choice["records_classes"].items():
        print(f"| {name} | {pct(v['good_dropped'])} | {pct(v['junk_dropped'])} | {v['max_good_frac']:.2f} |")
    r = params.static.heuristics.records
    print(f"\nchosen: skip_comments {choice['chosen_skip_comments']}, value_lines {choice['chosen_value_lines']} "
          f"(params.yaml: {r.skip_comments}, {r.value_lines})\n")
    print("| 3. the head reads | AUC (dev, every labelled document) | tier 1 at 0.65: good kept / junk dropped |")
    print("|---|---:|---|")
    for name, v in choice["head"].items():
        print(f"| {name} | {v['auc']:.4f} | {pct(v['tier1']['good_kept'])} / {pct(v['tier1']['junk_dropped'])} |")
    print(f"\nchosen: {choice['chosen_head']} (params.yaml quality.markup: {params.quality.markup})")
    grid = ", ".join(f"{t}: {v:.3f}" for t, v in choice["threshold_grid"].items())
    print(f"4. threshold: {choice['chosen_threshold']} (params.yaml: {params.static.threshold})\n"
          f"good kept + junk dropped per threshold: {grid}\n")
    if "shape" in choice:
        print("5. head AUC on dev (every labelled document): "
              + ", ".join(f"{k} {v:.4f}" for k, v in choice["shape"].items()) + "\n")


def print_side_by_side(name: str, old: dict, new: dict, was: str = "before") -> None:
    print(f"## {name}: {new['documents']} text documents, {new['labelled']} labelled "
          f"({new['heuristics']['good']} good, {new['heuristics']['junk']} junk)\n")
    print(f"| judge | {was}: good kept | {was}: junk dropped | new: good kept | new: junk dropped | new: precision |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, key in (("heuristics", "heuristics"), ("head alone", "head"), ("**tier 1**", "tier1")):
        o, n = old[key], new[key]
        print(f"| {label} | {pct(o['good_kept'])} | {pct(o['junk_dropped'])} | {pct(n['good_kept'])} | "
              f"{pct(n['junk_dropped'])} | {pct(n['precision'])} |")
    print(f"\nhead ROC AUC on every labelled document: {was} {old['head']['auc']:.4f}, new {new['head']['auc']:.4f}; "
          f"ECE: {was} {old['head']['ece']:.3f}, new {new['head']['ece']:.3f}")
    print(f"\n| kind | label | n | {was}: heuristics / head / tier 1 keep | new: heuristics / head / tier 1 keep | "
          "top drop reasons (new heuristics) |")
    print("|---|---|---:|---|---|---|")
    for source, v in new["per_source"].items():
        o = old["per_source"][source]
        reasons = ", ".join(f"{k} {c}" for k, c in v["top_reasons"]) or "-"
        print(f"| {source} | {v['label']} | {v['n']} | {pct(o['heuristics_keep'])} / {pct(o['head_keep'])} / "
              f"{pct(o['tier1_keep'])} | {pct(v['heuristics_keep'])} / {pct(v['head_keep'])} / {pct(v['tier1_keep'])} "
              f"| {reasons} |")
    print()


def print_summary(results: dict) -> None:
    print("## summary: tier 1 (heuristics, then the head), previous -> before -> new\n")
    print("| set | labelled (good / junk) | good prose kept | junk dropped | head AUC (every document) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        o, b, n = r["previous"], r["before"], r["new"]
        print(f"| {name} | {n['heuristics']['good']} / {n['heuristics']['junk']} | "
              f"{pct(o['tier1']['good_kept'])} -> {pct(b['tier1']['good_kept'])} -> **{pct(n['tier1']['good_kept'])}** | "
              f"{pct(o['tier1']['junk_dropped'])} -> {pct(b['tier1']['junk_dropped'])} -> "
              f"**{pct(n['tier1']['junk_dropped'])}** | {o['head']['auc']:.3f} -> {b['head']['auc']:.3f} -> "
              f"{n['head']['auc']:.3f} |")
    print()


#: tier1e's grid for the shape features' scale and the words head's penalty (chosen on the seen sets).
SHAPE_SCALES = [0.25, 0.5, 1.0, 2.0, 4.0]
WORDS_L2S = [0.02, 0.05, 0.1]


def shape_grid(raw: str, params, sets: list, work: Path) -> dict:
    """Head AUC on every labelled document of each seen set, per (shape_scale, words_l2), and the words-only
    head at the old penalty; the rule (fixed before the grid was run): the largest minimum AUC over the sets,
    ties (3 decimals) -> words_l2 0.05, then the scale nearest 1."""
    from assay.quality.metrics import roc_auc
    from assay.quality.pool import POOL_LABELS, labels_by_source
    from assay.quality.scorer import HeadScorer
    from assay.quality.train import reference_examples, train_head

    examples = reference_examples(raw, params)
    points = [(None, BEFORE_WORDS_L2)] + [(s, l2) for s in SHAPE_SCALES for l2 in WORDS_L2S]
    out: dict = {}
    print("| shape_scale : words_l2 | " + " | ".join(name for name, _, _ in sets) + " | min |")
    print("|---|" + "---|" * (len(sets) + 1))
    for scale, l2 in points:
        q = dataclasses.replace(params.quality, shape=scale is not None, shape_scale=scale or 1.0, words_l2=l2)
        head = work / f"grid-{scale}-{l2}"
        train_head(examples, dataclasses.replace(params, quality=q), head, recipe="reference")
        scorer = HeadScorer(head)
        aucs = []
        for _, docs, source_labels in sets:
            rows = [i for i, kind in enumerate(docs["kind"]) if kind == "text"]
            texts = [docs["text"][i] for i in rows]
            labels = labels_by_source([docs["source"][i] for i in rows], [len(t) for t in texts],
                                      POOL_LABELS if source_labels is None else source_labels)
            labelled = labels >= 0
            aucs.append(roc_auc(labels[labelled] == 1, scorer.score(texts, None)[labelled]))
        key = "words only" if scale is None else f"{scale} : {l2}"
        out[key] = {"scale": scale, "l2": l2, "auc": aucs, "min": min(aucs)}
        print(f"| {key} | " + " | ".join(f"{a:.3f}" for a in aucs) + f" | {min(aucs):.3f} |", flush=True)
    shaped = {k: v for k, v in out.items() if v["scale"] is not None}
    best = max(shaped, key=lambda k: (round(shaped[k]["min"], 3), shaped[k]["l2"] == BEFORE_WORDS_L2,
                                      -abs(shaped[k]["scale"] - 1.0)))
    if round(out["words only"]["min"], 3) > round(shaped[best]["min"], 3):
        best = "words only"
    print(f"\nchosen: {best} (params.yaml: shape {params.quality.shape}, shape_scale {params.quality.shape_scale}, "
          f"words_l2 {params.quality.words_l2})\n")
    return {"grid": out, "chosen": best}


def train(raw: str, params, out: str, exclude: tuple[str, ...] = ()) -> str:
    from assay.quality.train import reference_examples, train_head

    report = train_head(reference_examples(raw, params, exclude_sources=exclude), params, out, recipe="reference")
    t = report["training"]
    print(f"head {out} (quality.markup {params.quality.markup}, shape {params.quality.shape}, "
          f"words_l2 {params.quality.words_l2}, without {len(exclude)} extra kinds): {t['examples']} examples "
          f"({t['positives']} reference), held-out AUC {report['head']['auc']:.4f}; "
          f"calibration {report.get('calibration')}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", help="an ingested demo corpus (default: ingest one into a temporary directory)")
    parser.add_argument("--head", help="the new quality head (default: train one on --raw with params.yaml)")
    parser.add_argument("--before-head", help="the head before tier1f (default: train one with tier1e's settings, "
                        "without the extra pool kinds)")
    parser.add_argument("--previous-head", help="the previous head (default: train one with quality.markup: false)")
    parser.add_argument("--params", help="params.yaml (default: the nearest one)")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--dev-only", action="store_true", help="only the dev part's choices (no other set is scored)")
    parser.add_argument("--seen-only", action="store_true", help="score only the sets seen before (not fresh set 5)")
    parser.add_argument("--shape-grid", action="store_true",
                        help="only tier1e's choice: train a head per (shape_scale, words_l2) and print its AUC on "
                             "the seen sets (never fresh set 4)")
    args = parser.parse_args(argv)

    from assay.config import load_params
    from assay.quality.fresh import FRESH_LABELS, read_fresh
    from assay.quality.fresh2 import FRESH2_LABELS, read_fresh2
    from assay.quality.fresh3 import FRESH3_LABELS, read_fresh3
    from assay.quality.fresh4 import FRESH4_LABELS, read_fresh4
    from assay.quality.fresh5 import FRESH5_LABELS, read_fresh5
    from assay.ingest.demo import EXTRA_POOL_KINDS
    from assay.quality.pool import DEV, MEASURED, measure_tier1, read_pool
    from assay.quality.scorer import HeadScorer

    params = load_params(args.params)
    if args.shape_grid and args.raw is None:
        raise SystemExit("--shape-grid needs --raw (an ingested demo corpus)")
    work = Path(tempfile.mkdtemp(prefix="assay-tier1-pool-"))
    if args.shape_grid:
        seen = [("dev", read_pool(args.raw, params, part=DEV), None),
                ("measured", read_pool(args.raw, params, part=MEASURED), None),
                ("fresh 1", read_fresh(), FRESH_LABELS), ("fresh 2", read_fresh2()[0], FRESH2_LABELS),
                ("fresh 3", read_fresh3()[0], FRESH3_LABELS)]
        result = shape_grid(args.raw, params, seen, work)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=float))
        return result
    started = time.perf_counter()
    raw = args.raw
    if raw is None:
        raw = str(work / "raw")
        cmd = [str(Path(sys.executable).with_name("assay"))]
        if args.params:  # a group option: before the command
            cmd += ["--params", args.params]
        cmd += ["ingest", "demo", "--out", raw]
        subprocess.run(cmd, check=True, env=dict(os.environ, PREFECT_LOGGING_LEVEL="WARNING"),
                       stdout=subprocess.DEVNULL)
    extra_kinds = tuple(EXTRA_POOL_KINDS)
    prev_head = args.previous_head or train(raw, previous_params(params, ""), str(work / "previous-head"), extra_kinds)
    before_head = args.before_head or train(raw, before_params(params, ""), str(work / "before-head"), extra_kinds)
    head = args.head or train(raw, params, str(work / "head"))
    new = dataclasses.replace(params, static=dataclasses.replace(params.static, head=head, model=None))
    old = previous_params(new, prev_head)
    before = before_params(new, before_head)
    prev_scorer, before_scorer, new_scorer = HeadScorer(prev_head), HeadScorer(before_head), HeadScorer(head)
    if any(s.needs_embeddings for s in (prev_scorer, before_scorer, new_scorer)):
        raise SystemExit("this benchmark measures words heads (quality.features: words)")
    print()

    dev, dev_extra = split_extra(read_pool(raw, new, part=DEV))
    choice = choose_on_dev(dev, new, prev_scorer, new_scorer)
    choice["shape"] = shape_on_dev(dev, before_scorer, new_scorer)
    print_choice(choice, new)
    result: dict = {"dev_choice": choice}
    if args.dev_only:
        return result
    fresh2, fresh2_labels, missing = read_fresh2()
    print(f"fresh set 2: {len(fresh2['id'])} documents read back from the manifest; not readable: {missing or 'none'}")
    fresh3, fresh3_labels, missing3 = read_fresh3()
    print(f"fresh set 3: {len(fresh3['id'])} documents read back from the manifest; not readable: {missing3 or 'none'}")
    fresh4, fresh4_labels, missing4 = read_fresh4()
    print(f"fresh set 4: {len(fresh4['id'])} documents read back from the manifest; not readable: {missing4 or 'none'}")
    if args.seen_only:
        fresh5, fresh5_labels, missing5 = None, None, None
        print("fresh set 5: not read (--seen-only)\n")
    else:
        fresh5, fresh5_labels, missing5 = read_fresh5()
        print(f"fresh set 5: {len(fresh5['id'])} documents read back from the manifest; "
              f"not readable: {missing5 or 'none'}\n")
    measured, measured_extra = split_extra(read_pool(raw, new, part=MEASURED))
    pool_extra = {k: dev_extra[k] + measured_extra[k] for k in dev_extra}
    sets = (
        ("pool dev part (chosen on)", dev, None),
        ("pool measured part (seen before)", measured, None),
        ("pool extra kinds, dev + measured parts (junk only; the new head trained on their negatives part)",
         pool_extra, None),
        ("fresh set 1 (seen before)", read_fresh(), FRESH_LABELS),
        ("fresh set 2 (seen: scored by tier1c)", fresh2, FRESH2_LABELS),
        ("fresh set 3 (seen: scored by tier1d, chosen on by tier1e)", fresh3, FRESH3_LABELS),
        ("fresh set 4 (seen: scored by tier1e, chosen on by tier1f)", fresh4, FRESH4_LABELS),
        ("fresh set 5 (unseen)", fresh5, FRESH5_LABELS),
    )[: 7 if args.seen_only else 8]
    results = {}
    for name, docs, labels in sets:
        if not docs["id"]:
            continue
        extra = {} if labels is None else {"source_labels": labels}
        o = measure_tier1(docs, old, None, prev_scorer, **extra)
        b = measure_tier1(docs, before, None, before_scorer, **extra)
        n = measure_tier1(docs, new, None, new_scorer, **extra)
        print_side_by_side(name, b, n)
        results[name] = {"previous": o, "before": b, "new": n}
    # The manifest's labels are the ones measured (same kind + length rule, checked here).
    from assay.quality.pool import labels_by_source

    recomputed = labels_by_source(fresh2["source"], [len(t) for t in fresh2["text"]], FRESH2_LABELS)
    assert (recomputed == fresh2_labels).all(), "fresh set 2: labels differ from the manifest's"
    recomputed = labels_by_source(fresh3["source"], [len(t) for t in fresh3["text"]], FRESH3_LABELS)
    assert (recomputed == fresh3_labels).all(), "fresh set 3: labels differ from the manifest's"
    recomputed = labels_by_source(fresh4["source"], [len(t) for t in fresh4["text"]], FRESH4_LABELS)
    assert (recomputed == fresh4_labels).all(), "fresh set 4: labels differ from the manifest's"
    if fresh5 is not None:
        recomputed = labels_by_source(fresh5["source"], [len(t) for t in fresh5["text"]], FRESH5_LABELS)
        assert (recomputed == fresh5_labels).all(), "fresh set 5: labels differ from the manifest's"
    print_summary(results)
    result["sets"] = results
    print(f"total {time.perf_counter() - started:.0f} s (raw: {raw}, heads: {prev_head}, {before_head}, {head})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
