"""Tier 3 on the labelled set of real code: each rule, each part and the stage, at 5%, 30% and 60% generated.

    .venv/bin/python bench/labelled_code.py [--model models/domain] [--calibrate] [--legacy]

The set (`assay.domain.labelled`) is labelled by provenance; thresholds are
calibrated on its calibration split only and every table is on the
evaluation split (other packages). With `--calibrate` it prints the two
calibrated thresholds, each keeping `--hand-keep` (98%) of hand-written
files: the perplexity floor for the model (the lower of the 2nd percentiles
of the calibration split's hand-written files that the model screens and of
the model's own held-out reference files) and the literal-lines fraction
(the 98th percentile of the calibration split's hand-written files), then
judges with them. With `--legacy` it also prints the old stage
on the same mixes: the old marker list, no source-map, bundle or
literal-lines rule, no fixed floor, and the corpus-percentile band [2, 98]
estimated on each mix.
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
    parser.add_argument("--calibrate", action="store_true", help="print the calibrated perplexity floor")
    parser.add_argument("--hand-keep", type=float, default=0.98)
    parser.add_argument("--legacy", action="store_true", help="also the old stage on the same mixes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import numpy as np

    from assay.config import load_params
    from assay.domain.evaluate import (
        calibrate_floor,
        calibrate_literal_fraction,
        judge_labelled,
        legacy_params,
        markdown_table,
        with_floor,
        with_literal_fraction,
    )
    from assay.domain.labelled import CALIBRATION, EVALUATION, build_labelled_set
    from assay.domain.perplexity import PerplexityScorer

    params = load_params(args.params).domain
    params = dataclasses.replace(params, model=dataclasses.replace(params.model, model=args.model))
    started = time.perf_counter()
    files = build_labelled_set()
    built = time.perf_counter() - started
    scorer = PerplexityScorer(params.model)
    verdicts = judge_labelled(files, params, scorer)
    judged = time.perf_counter() - started - built
    for split in (CALIBRATION, EVALUATION):
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
        verdicts = judge_labelled(files, params, scorer)
        for split in (CALIBRATION, EVALUATION):
            for label, mask in (("generated", verdicts.generated), ("hand-written", ~verdicts.generated)):
                values = verdicts.perplexity[(verdicts.split == split) & mask & verdicts.screened]
                values = values[~np.isnan(values)]
                if len(values):
                    q = np.percentile(values, [2, 10, 50, 90])
                    print(f"  {split} {label}: {len(values)} screened, perplexity p2 {q[0]:.0f}, p10 {q[1]:.0f}, "
                          f"median {q[2]:.0f}, p90 {q[3]:.0f}")

    print(f"\n## The stage (min_perplexity {params.model.min_perplexity}, max_literal_line_fraction "
          f"{params.rules.max_literal_line_fraction}, percentile_band {params.model.percentile_band})")
    print(markdown_table(verdicts, params, seed=args.seed))
    if args.legacy:
        old = legacy_params(params)
        old_verdicts = judge_labelled(files, old, scorer)
        print("\n## The old stage (old markers; no source-map, bundle or literal-lines rule; no floor; "
              "corpus-percentile band [2, 98] of each mix)")
        print(markdown_table(old_verdicts, old, seed=args.seed))


if __name__ == "__main__":
    main()
