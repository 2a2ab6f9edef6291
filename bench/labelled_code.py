"""Tier 3 on the labelled set of real code: each rule, each part and the stage, at 5%, 30% and 60% generated.

    .venv/bin/python bench/labelled_code.py [--model models/domain] [--calibrate] [--legacy] [--first-pass]

The set (`assay.domain.labelled`) is labelled by provenance; thresholds are
calibrated on its calibration split only, and every table is on the
evaluation split (other packages; seen when issue 10's first pass read its
misses) and on the fresh split (packages no earlier pass used, added and
labelled before any score in the second pass). With `--calibrate` it prints
the two calibrated thresholds, each keeping `--hand-keep` (98%) of
hand-written files: the perplexity floor for the model (the lower of the 2nd
percentiles of the calibration split's hand-written files that the model
screens and of the model's own held-out reference files) and the
literal-lines fraction (the 98th percentile of the calibration split's
hand-written files), then judges with them. With `--first-pass` it also
prints the stage as issue 10's first pass left it (six bundle markers, no
generator-signature or declaration-emit rule) and with `--legacy` the stage
before issue 10 (the old marker list, no source-map, bundle or literal-lines
rule, no fixed floor, and the corpus-percentile band [2, 98] estimated on
each mix), all on the same mixes, judged in one run. The summary at the top
compares them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/domain")
    parser.add_argument("--params", default=None, help="params.yaml (default: the project's)")
    parser.add_argument("--calibrate", action="store_true", help="calibrate the floor and literal-lines fraction")
    parser.add_argument("--hand-keep", type=float, default=0.98)
    parser.add_argument("--legacy", action="store_true", help="also the stage before issue 10 on the same mixes")
    parser.add_argument("--first-pass", action="store_true", help="also the stage of issue 10's first pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import numpy as np

    from assay.config import load_params
    from assay.domain.evaluate import (
        SHARES,
        calibrate_floor,
        calibrate_literal_fraction,
        first_pass_params,
        judge_labelled,
        legacy_params,
        markdown_table,
        mix,
        score_mix,
        stage_row,
        with_floor,
        with_literal_fraction,
    )
    from assay.domain.labelled import CALIBRATION, EVALUATION, FRESH, build_labelled_set
    from assay.domain.perplexity import PerplexityScorer

    params = load_params(args.params).domain
    params = dataclasses.replace(params, model=dataclasses.replace(params.model, model=args.model))
    started = time.perf_counter()
    files = build_labelled_set()
    built = time.perf_counter() - started
    scorer = PerplexityScorer(params.model)
    verdicts = judge_labelled(files, params, scorer)
    judged = time.perf_counter() - started - built
    for split in (CALIBRATION, EVALUATION, FRESH):
        in_split = verdicts.split == split
        gen = int((in_split & verdicts.generated).sum())
        langs = ", ".join(f"{lang} {int((in_split & (verdicts.lang == lang)).sum())}"
                          for lang in sorted(set(verdicts.lang[in_split])))
        print(f"{split}: {int(in_split.sum())} files, {gen} generated, {int(in_split.sum()) - gen} hand-written ({langs})")
    print(f"built in {built:.0f} s, judged in {judged:.0f} s; model {args.model} screens "
          f"{scorer.languages or 'every language'}")

    if args.calibrate:
        reference = scorer.report.get("heldout_perplexities")
        floor = calibrate_floor(verdicts, args.hand_keep, reference)
        literal = calibrate_literal_fraction(verdicts, args.hand_keep)
        print(f"\ncalibrated on the calibration split, each keeping {args.hand_keep:.0%} of its hand-written files: "
              f"min_perplexity {floor:.1f} (the lower of its 2nd percentile among the files the model screens, "
              f"{calibrate_floor(verdicts, args.hand_keep):.1f}, and of the model's {len(reference or [])} held-out "
              f"reference files), "
              f"max_literal_line_fraction {literal:.3f} (of the files the rule applies to)")
        params = with_literal_fraction(with_floor(params, round(floor, 1)), round(literal, 2))
        verdicts = judge_labelled(files, params, scorer, verdicts.perplexity)
        for split in (CALIBRATION, EVALUATION, FRESH):
            for label, mask in (("generated", verdicts.generated), ("hand-written", ~verdicts.generated)):
                values = verdicts.perplexity[(verdicts.split == split) & mask & verdicts.screened]
                values = values[~np.isnan(values)]
                if len(values):
                    q = np.percentile(values, [2, 10, 50, 90])
                    print(f"  {split} {label}: {len(values)} screened, perplexity p2 {q[0]:.0f}, p10 {q[1]:.0f}, "
                          f"median {q[2]:.0f}, p90 {q[3]:.0f}")

    stages = [("this stage", params, verdicts)]
    if args.first_pass:
        first = first_pass_params(params)
        stages.append(("first pass", first, judge_labelled(files, first, scorer, verdicts.perplexity)))
    if args.legacy:
        old = legacy_params(params)
        stages.append(("before issue 10", old, judge_labelled(files, old, scorer, verdicts.perplexity)))

    print("\n## Summary: the whole stage on each split and share (effective-code ratio = share of kept files "
          "labelled hand-written)\n")
    print("| split | generated share | files | effective-code ratio before | "
          + " | ".join(f"after, {name}" for name, _, _ in stages) + " | "
          + " | ".join(f"generated dropped, {name}" for name, _, _ in stages) + " | "
          + " | ".join(f"hand-written kept, {name}" for name, _, _ in stages) + " |")
    print("|---|---:|---:|---:|" + "---:|" * (3 * len(stages)))
    for split in (EVALUATION, FRESH):
        for share in SHARES:
            idx = mix(verdicts, share, split, args.seed)
            rows = []
            for _, stage_params, stage_verdicts in stages:
                before, scored = score_mix(stage_verdicts, idx, stage_params)
                rows.append(stage_row(scored))
            print(f"| {split} | {share:.0%} | {len(idx)} | {before:.1%} | "
                  + " | ".join(f"{r.kept_hand_share:.1%}" for r in rows) + " | "
                  + " | ".join(f"{r.generated_recall:.1%}" for r in rows) + " | "
                  + " | ".join(f"{r.hand_keep_rate:.1%}" for r in rows) + " |")

    for split in (FRESH, EVALUATION):
        print(f"\n## This stage on the {split} split (min_perplexity {params.model.min_perplexity}, "
              f"max_literal_line_fraction {params.rules.max_literal_line_fraction}, "
              f"percentile_band {params.model.percentile_band})")
        print(markdown_table(verdicts, params, split=split, seed=args.seed))
        missed = np.flatnonzero((verdicts.split == split) & verdicts.generated & verdicts.rules_keep
                                & verdicts.syntax_keep)
        print(f"\n{split}: generated files no rule or parse drops ({len(missed)}; the screen may still drop some): "
              + ", ".join(files[i].path for i in missed))
    for name, stage_params, stage_verdicts in stages[1:]:
        for split in (FRESH, EVALUATION):
            print(f"\n## The stage {name} on the {split} split")
            print(markdown_table(stage_verdicts, stage_params, split=split, seed=args.seed))


if __name__ == "__main__":
    main()
