"""Tier 3 measured on the labelled set: what each rule, each part and the stage keep and drop.

The judge is the provenance label of `assay.domain.labelled`, not the
stage's own rules. Every file of the set is judged once by each part of the
stage, with the stage's own functions (`CodeRulesFilter.evaluate`,
`SyntaxFilter`, `identify_languages`, the perplexity scorer and
`assay.stages.domain.screen_drops`); a mix is then a seeded subsample of the
evaluation split at a given share of generated files, and its verdicts are
composed the way `judge_batch` composes them (rules, then syntax, then the
screen; `tests/test_domain_labelled.py` checks the composition against
`judge_batch` itself).

For each rule (on its own), each part (on its own) and the whole stage, on a
mix:
- `kept_hand_share`: the share of the files it keeps that are hand-written:
  the effective-code ratio after it; before any filter it is the mix's own
  hand-written share;
- `generated_recall`: the share of generated files it drops;
- `hand_keep_rate`: the share of hand-written files it keeps.

A corpus-percentile band (the old default, now an option) is estimated on the
mix itself, as the stage estimates it on its corpus, so its verdicts move
with the mix's contamination.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from assay.config import BUNDLE_MARKERS, DomainParams
from assay.domain.labelled import CALIBRATION, EVALUATION, FRESH, GENERATED, LabelledFile, as_batch

#: Shares of generated files the issue asks about.
SHARES = (0.05, 0.30, 0.60)


@dataclass
class LabelledVerdicts:
    """Every part's verdict on every labelled file, computed once."""

    files: list[LabelledFile]
    generated: np.ndarray  # bool, the label
    split: np.ndarray  # str
    lang: np.ndarray  # str, after language ID
    rule_failed: dict[str, np.ndarray]  # each rule on its own
    rules_keep: np.ndarray
    syntax_keep: np.ndarray
    parse_checked: np.ndarray
    screened: np.ndarray
    perplexity: np.ndarray  # NaN where not screened
    literal_line_fraction: np.ndarray  # NaN where the literal-lines rule does not apply
    reasons: list[str | None] = field(default_factory=list)  # first rule/syntax reason


def judge_labelled(files: list[LabelledFile], params: DomainParams, scorer,
                   perplexity: np.ndarray | None = None) -> LabelledVerdicts:
    """Each part of the stage on every file (`scorer`: a `PerplexityScorer`).

    `perplexity`: the files' perplexities from an earlier call with the same
    scorer and language correction (they do not depend on the rules), to
    judge other rule settings without scoring again.
    """
    from filters.code_langid import identify_languages
    from filters.code_rules import CodeRulesFilter, code_features
    from filters.code_syntax import SyntaxFilter

    batch = as_batch(files)
    if params.correct_lang:
        langs, _ = identify_languages(batch, params)
        batch = batch.set_column(batch.schema.get_field_index("lang"), "lang", pa.array(langs, pa.string()))
    langs = batch.column("lang").to_pylist()
    rules, failures = CodeRulesFilter(params.rules).evaluate(batch)
    syntax = SyntaxFilter(params).apply(batch)
    ratio = syntax.scores["code_syntax:error_ratio"]
    ast_ok = syntax.scores["code_syntax:python_ast_ok"]
    screened = np.array([scorer.screens(lang) for lang in langs], dtype=bool)
    if perplexity is not None:
        if len(perplexity) != len(files):
            raise ValueError(f"{len(perplexity)} perplexities for {len(files)} files")
        ppl = np.asarray(perplexity, dtype=np.float64)
    else:
        ppl = np.full(len(files), np.nan)
        rows = np.flatnonzero(screened)
        if len(rows):
            ppl[rows] = scorer.perplexity([files[i].text for i in rows])
    reasons = [r or s for r, s in zip(rules.reason, syntax.reason)]
    features = code_features(batch, params.rules)
    applies = ~features.data_language & ~features.config_language & (features.nonblank_lines >= params.rules.literal_min_lines)
    literal = np.where(applies, features.literal_line_fraction, np.nan)
    return LabelledVerdicts(
        files=files,
        generated=np.array([f.label == GENERATED for f in files], dtype=bool),
        split=np.array([f.split for f in files]),
        lang=np.array(langs),
        rule_failed={k: np.asarray(v, dtype=bool) for k, v in failures.items()},
        rules_keep=np.asarray(rules.keep, dtype=bool),
        syntax_keep=np.asarray(syntax.keep, dtype=bool),
        parse_checked=~np.isnan(ratio) | ~np.isnan(ast_ok),
        screened=screened,
        perplexity=ppl,
        literal_line_fraction=literal,
        reasons=reasons,
    )


def mix(verdicts: LabelledVerdicts, share: float, split: str = EVALUATION, seed: int = 0) -> np.ndarray:
    """Indices of the largest seeded subsample of `split` with `share` generated files."""
    if not 0 < share < 1:
        raise ValueError(f"share of generated files must be in (0, 1), got {share}")
    in_split = verdicts.split == split
    gen = np.flatnonzero(in_split & verdicts.generated)
    hand = np.flatnonzero(in_split & ~verdicts.generated)
    total = int(min(len(gen) / share, len(hand) / (1 - share)))
    n_gen = min(int(round(total * share)), len(gen))
    n_hand = min(total - n_gen, len(hand))
    rng = random.Random(f"{seed}:{split}:{share}")
    chosen = rng.sample(gen.tolist(), n_gen) + rng.sample(hand.tolist(), n_hand)
    return np.array(sorted(chosen), dtype=np.int64)


def corpus_band(verdicts: LabelledVerdicts, idx: np.ndarray, percentiles: list[float] | None) -> tuple[float, float] | None:
    """The old default's band: percentiles of the mix's own perplexities (what the stage would estimate)."""
    if percentiles is None:
        return None
    values = verdicts.perplexity[idx]
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    low, high = np.percentile(values, percentiles)
    return float(low), float(high)


def part_drops(verdicts: LabelledVerdicts, idx: np.ndarray, params: DomainParams) -> dict[str, np.ndarray]:
    """Each rule, each part and the stage: which files of `idx` it drops (on its own)."""
    from assay.stages.domain import screen_drops

    band = corpus_band(verdicts, idx, params.model.percentile_band)
    too_low, too_high = screen_drops(verdicts.perplexity[idx], verdicts.screened[idx], params.model, band)
    rules = ~verdicts.rules_keep[idx]
    syntax = ~verdicts.syntax_keep[idx]
    screen = too_low | too_high
    out = {f"rule:{name}": failed[idx] for name, failed in verdicts.rule_failed.items()}
    out.update({"part:rules": rules, "part:syntax": syntax, "part:screen": screen,
                "stage": rules | syntax | screen})
    return out


@dataclass
class Row:
    name: str
    dropped: int
    kept: int
    kept_hand_share: float | None  # effective-code ratio after
    generated_recall: float
    hand_keep_rate: float


def score_mix(verdicts: LabelledVerdicts, idx: np.ndarray, params: DomainParams) -> tuple[float, list[Row]]:
    """(hand-written share before, a row per rule, part and the stage) on the mix `idx`."""
    gen = verdicts.generated[idx]
    before = float((~gen).mean())
    rows = []
    for name, dropped in part_drops(verdicts, idx, params).items():
        kept = ~dropped
        rows.append(Row(
            name=name,
            dropped=int(dropped.sum()),
            kept=int(kept.sum()),
            kept_hand_share=float((kept & ~gen).sum() / kept.sum()) if kept.any() else None,
            generated_recall=float((dropped & gen).sum() / gen.sum()) if gen.any() else float("nan"),
            hand_keep_rate=float((kept & ~gen).sum() / (~gen).sum()) if (~gen).any() else float("nan"),
        ))
    return before, rows


#: The generator markers before issue 10 (to run the old stage side by side).
LEGACY_MARKERS = ["auto-generated", "autogenerated", "automatically generated", "generated automatically",
                  "this file is generated", "generated by", "do not edit", "code generated", "@generated", "protoc"]


#: The bundle markers of issue 10's first pass (to run that stage side by side).
FIRST_PASS_BUNDLE_MARKERS = BUNDLE_MARKERS[:6]


def first_pass_params(params: DomainParams) -> DomainParams:
    """The stage as issue 10's first pass left it: its six bundle markers, no generator-signature or
    declaration-emit rule; everything else as `params`."""
    rules = dataclasses.replace(params.rules, bundle_markers=list(FIRST_PASS_BUNDLE_MARKERS),
                                generator_signatures=[], declaration_markers=[])
    return dataclasses.replace(params, rules=rules)


def legacy_params(params: DomainParams) -> DomainParams:
    """The stage before issue 10: old markers, no source-map, bundle, literal-lines, generator-signature or
    declaration-emit rule, no fixed floor, and the corpus band [2, 98]."""
    rules = dataclasses.replace(params.rules, autogen_markers=list(LEGACY_MARKERS), source_map_tail_lines=0,
                                max_literal_line_fraction=None, bundle_markers=[], generator_signatures=[],
                                declaration_markers=[])
    model = dataclasses.replace(params.model, min_perplexity=None, max_perplexity=1e9, percentile_band=[2.0, 98.0])
    return dataclasses.replace(params, rules=rules, model=model)


def calibrate_floor(verdicts: LabelledVerdicts, hand_keep: float = 0.98,
                    reference: list[float] | None = None) -> float:
    """The perplexity floor that keeps `hand_keep` of hand-written code, in and out of the model's domain.

    The lower of two (1 - hand_keep) percentiles: of the calibration split's
    screened hand-written files (code the model never saw), and of
    `reference`, the model's held-out reference perplexities
    (`assay_domain_model.json`: code like what it was trained on, which it
    finds far more predictable). Both are fixed before the evaluation split
    is scored and neither depends on a corpus the stage later judges.
    """
    mask = (verdicts.split == CALIBRATION) & ~verdicts.generated & verdicts.screened & ~np.isnan(verdicts.perplexity)
    if not mask.any():
        raise ValueError("no screened hand-written file in the calibration split: is the model's language there?")
    floor = float(np.percentile(verdicts.perplexity[mask], 100 * (1 - hand_keep)))
    if reference:
        floor = min(floor, float(np.percentile(np.asarray(reference, dtype=float), 100 * (1 - hand_keep))))
    return floor


def calibrate_literal_fraction(verdicts: LabelledVerdicts, hand_keep: float = 0.98) -> float:
    """The literal-lines threshold that keeps `hand_keep` of the calibration split's hand-written files it applies to."""
    mask = (verdicts.split == CALIBRATION) & ~verdicts.generated & ~np.isnan(verdicts.literal_line_fraction)
    return float(np.percentile(verdicts.literal_line_fraction[mask], 100 * hand_keep))


def with_floor(params: DomainParams, floor: float | None) -> DomainParams:
    return dataclasses.replace(params, model=dataclasses.replace(params.model, min_perplexity=floor))


def with_literal_fraction(params: DomainParams, fraction: float | None) -> DomainParams:
    return dataclasses.replace(params, rules=dataclasses.replace(params.rules, max_literal_line_fraction=fraction))


def stage_row(rows: list[Row]) -> Row:
    return next(r for r in rows if r.name == "stage")


def markdown_table(verdicts: LabelledVerdicts, params: DomainParams, shares=SHARES, split: str = EVALUATION, seed: int = 0, title: str = "") -> str:
    """One table per share: every rule, part and the stage (the bench and the docs print these)."""
    lines = []
    for share in shares:
        idx = mix(verdicts, share, split, seed)
        before, rows = score_mix(verdicts, idx, params)
        gen = int(verdicts.generated[idx].sum())
        lines.append(f"\n{title}{split} split, {share:.0%} generated: {len(idx)} files ({gen} generated, "
                     f"{len(idx) - gen} hand-written); effective-code ratio before: {before:.1%}; "
                     f"never parsed: {int((~verdicts.parse_checked[idx]).sum())}\n")
        lines.append("| rule / part | dropped | kept | effective-code ratio after | generated dropped | hand-written kept |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            if r.name.startswith("rule:") and r.dropped == 0:
                continue
            after = f"{r.kept_hand_share:.1%}" if r.kept_hand_share is not None else "-"
            name = f"**{r.name}**" if r.name == "stage" else r.name
            lines.append(f"| {name} | {r.dropped} | {r.kept} | {after} | {r.generated_recall:.1%} | {r.hand_keep_rate:.1%} |")
    return "\n".join(lines)


__all__ = ["CALIBRATION", "EVALUATION", "FIRST_PASS_BUNDLE_MARKERS", "FRESH", "LEGACY_MARKERS", "first_pass_params", "SHARES", "LabelledVerdicts", "Row", "calibrate_floor",
           "calibrate_literal_fraction", "corpus_band", "judge_labelled", "legacy_params", "markdown_table", "mix", "part_drops", "score_mix",
           "stage_row", "with_floor", "with_literal_fraction"]
