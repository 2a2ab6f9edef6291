"""Tier 3 on one shard: code gets language ID, The Stack rules, parsing, then the domain model.

A cascade over `kind == code` rows (text passes through untouched):
1. language identification corrects `lang` where the content disagrees
   with the file name (`domain.correct_lang`);
2. the rules (size, line length, alphabetic share, generator markers,
   encoded data, minified code, data/config files);
3. syntax: the tree-sitter error-node ratio, with `ast` for Python;
4. the domain model's perplexity over the first window, for the languages
   the model knows: under `domain.model.min_perplexity` (generated tables
   are far more predictable than hand-written code) or above
   `domain.model.max_perplexity` is dropped. Both are fixed numbers,
   calibrated for the model on the labelled set's calibration split
   (`bench/labelled_code.py --calibrate`), so the screen's verdict on a file
   does not depend on what else is in the corpus. A band of the corpus's own
   perplexity percentiles (`domain.model.percentile_band`, the old default)
   is still available as an option; it only catches a kind of generated file
   while that kind is a few percent of the corpus.

The summary reports the rule-clean share of the input and of what was kept
(`filters.code_rules.rule_clean_flags`) and how many code files were never
parsed. It describes the input by the stage's own rules; the stage's
precision and recall are measured on labelled data by `assay.domain.evaluate`.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from assay.allocator import bound_heap_growth
from assay.config import DomainModelParams, DomainParams, Params
from assay.domain.perplexity import PerplexityScorer, estimate_band
from assay.schema import DECISION_SCHEMA, DOCUMENT_SCHEMA, KIND_CODE
from assay.stages.shard_stage import open_planned, scores_column, with_score_column
from assay.shards import open_shard, shard_batches
from assay.staging import UnitResult, UnitWriter, finished_unit
from filters.code_langid import identify_languages
from filters.code_rules import RULE_CLEAN_PARTS, CodeRulesFilter, rule_clean_flags
from filters.code_syntax import SyntaxFilter

STAGE = "domain"
PERPLEXITY = "code_perplexity"
PPL_HIGH = "domain_model:perplexity_high"
PPL_LOW = "domain_model:perplexity_low"
#: The parts of the rule-clean share, each a per-document boolean.
CLEAN_PARTS = (*RULE_CLEAN_PARTS, "in_screen")


@dataclass
class DomainModels:
    rules: CodeRulesFilter
    syntax: SyntaxFilter
    scorer: PerplexityScorer


_MODELS: dict[str, DomainModels] = {}
_LOCK = threading.Lock()


def load_models(params: DomainParams) -> DomainModels:
    # Before any document is read, as in static (assay/allocator.py: megabyte documents' buffers
    # would otherwise fragment glibc's heaps once the first large one is freed).
    bound_heap_growth()
    key = json.dumps(params, default=lambda o: o.__dict__, sort_keys=True)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = DomainModels(CodeRulesFilter(params.rules), SyntaxFilter(params), PerplexityScorer(params.model))
        return _MODELS[key]


def perplexity_band(shards: list[str], params: DomainParams, models: DomainModels) -> tuple[float, float] | None:
    """The corpus's perplexity band (`percentile_band`, off by default), estimated on a seeded sample of its code.

    A sample keeps the stage one pass over the data: each shard's task can
    decide on its own, and a resumed run recomputes the same band.
    """
    if params.model.percentile_band is None:
        return None
    rng = random.Random(0)
    size, seen, sample = params.model.band_sample, 0, []
    clip = models.scorer.window * 16
    for shard in shards:
        columns = ["text", "kind", "lang"]
        for batch in shard_batches(open_shard(shard, shard, DOCUMENT_SCHEMA, columns), shard, columns=columns):
            for text, kind, lang in zip(*(batch.column(c).to_pylist() for c in ("text", "kind", "lang"))):
                if kind != KIND_CODE or not models.scorer.screens(lang):
                    continue
                seen += 1
                if len(sample) < size:
                    sample.append(text[:clip])
                elif (j := rng.randrange(seen)) < size:
                    sample[j] = text[:clip]
    return estimate_band(models.scorer, sample, params.model.percentile_band)


def judge_batch(batch: pa.RecordBatch, params: DomainParams, models: DomainModels,
                band: tuple[float, float] | None):
    """(batch with corrected lang, keep, reason, scores, rule-clean flags of code rows)."""
    n = batch.num_rows
    keep = np.ones(n, dtype=bool)
    reason: list[str | None] = [None] * n
    scores: dict[str, np.ndarray] = {}
    code = np.flatnonzero(np.asarray(pc.fill_null(pc.equal(batch.column("kind"), KIND_CODE), False), dtype=bool))
    if not len(code):
        return batch, keep, reason, scores, {part: np.zeros(0, dtype=bool) for part in (*CLEAN_PARTS, "parse_checked")}

    if params.correct_lang:
        langs, changed = identify_languages(batch.take(pa.array(code)), params)
        if changed.any():
            new_lang = batch.column("lang").to_pylist()
            for j, i in enumerate(code):
                new_lang[i] = langs[j]
            batch = batch.set_column(batch.schema.get_field_index("lang"), "lang", pa.array(new_lang, pa.string()))
        full = np.full(n, np.nan)
        full[code] = changed.astype(float)
        scores["domain:lang_corrected"] = full
    sub = batch.take(pa.array(code))

    def merge(result, alive):
        for j, i in enumerate(code):
            if alive[j] and not result.keep[j]:
                reason[i] = result.reason[j]
        for name, values in result.scores.items():
            full = np.full(n, np.nan)
            full[code] = values
            scores[name] = full
        return alive & result.keep

    rules, failures = models.rules.evaluate(sub)
    syntax = models.syntax.apply(sub)
    alive = merge(rules, np.ones(len(code), dtype=bool))
    alive = merge(syntax, alive)

    # The perplexity screen, for the languages the model was trained on. Every
    # code row is scored (not only survivors) so the before-ratio is honest.
    screened = np.array([models.scorer.screens(lang) for lang in sub.column("lang").to_pylist()], dtype=bool)
    ppl = np.full(len(code), np.nan)
    rows = np.flatnonzero(screened)
    if len(rows):
        ppl[rows] = models.scorer.perplexity(sub.column("text").take(pa.array(rows)).to_pylist())
    too_low, too_high = screen_drops(ppl, screened, params.model, band)
    for j in np.flatnonzero(alive & (too_high | too_low)):
        reason[code[j]] = PPL_HIGH if too_high[j] else PPL_LOW
    alive &= ~(too_high | too_low)
    full = np.full(n, np.nan)
    full[code] = ppl
    scores[PERPLEXITY] = full
    keep[code] = alive

    flags = rule_clean_flags(sub, params, syntax=syntax, failures=failures)
    flags["in_screen"] = ~(too_high | too_low)
    return batch, keep, reason, scores, flags


def screen_drops(ppl: np.ndarray, screened: np.ndarray, params: DomainModelParams,
                 band: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(too predictable, too surprising) per file, from its perplexity (NaN: not scored).

    Fixed thresholds (`min_perplexity`, `max_perplexity`), narrowed by the
    corpus's percentile band when one is given.
    """
    low = params.min_perplexity if params.min_perplexity is not None else 0.0
    high = params.max_perplexity if params.max_perplexity is not None else np.inf
    if band is not None:
        low, high = max(low, band[0]), min(high, band[1])
    scored = screened & ~np.isnan(ppl)
    with np.errstate(invalid="ignore"):
        return scored & (ppl < low), scored & (ppl > high)


def domain_unit(index: int, shard: str, out_dir: str, params: Params, key: str,
                band: tuple[float, float] | None) -> UnitResult:
    """Tier 3 over one input shard into `out_dir`'s staging area (resumable)."""
    done = finished_unit(out_dir, key)
    if done is not None:
        return done
    started = time.perf_counter()
    models = load_models(params.domain)
    parquet = open_planned(shard, key)
    writer = UnitWriter(out_dir, key, with_score_column(parquet.schema_arrow, PERPLEXITY), target_bytes=params.io.shard_bytes)
    try:
        for batch in shard_batches(parquet, shard, batch_size=params.io.batch_rows, max_bytes=params.io.batch_bytes):
            batch, keep, reason, scores, flags = judge_batch(batch, params.domain, models, band)
            n = batch.num_rows
            ppl = scores.get(PERPLEXITY, np.full(n, np.nan))
            out = batch if PERPLEXITY in batch.schema.names else batch.append_column(
                PERPLEXITY, pa.array(ppl, pa.float64(), from_pandas=True))
            writer.docs.write(out.filter(pa.array(keep)))
            writer.write_decisions(pa.RecordBatch.from_arrays(
                [batch.column("id"), pa.array([STAGE] * n, pa.string()), pa.array(keep),
                 pa.array(reason, pa.string()), scores_column(scores, n), pa.nulls(n, pa.string())],
                schema=DECISION_SCHEMA))
            code = np.asarray(pc.fill_null(pc.equal(batch.column("kind"), KIND_CODE), False), dtype=bool)
            kept_code = keep[code]
            clean = np.logical_and.reduce([flags[p] for p in CLEAN_PARTS]) if code.any() else np.zeros(0, bool)
            writer.counts["code_in"] += int(code.sum())
            writer.counts["code_kept"] += int(kept_code.sum())
            writer.counts["never_parsed"] += int((~flags["parse_checked"]).sum()) if code.any() else 0
            writer.counts["rule_clean_in"] += int(clean.sum())
            writer.counts["rule_clean_kept"] += int((clean & kept_code).sum())
            for part in CLEAN_PARTS:
                writer.counts[f"part_in:{part}"] += int(flags[part].sum())
                writer.counts[f"part_kept:{part}"] += int((flags[part] & kept_code).sum())
            writer.counts["lang_corrected"] += int(np.nansum(scores.get("domain:lang_corrected", np.zeros(1))))
    except BaseException:
        writer.abort()
        raise
    return writer.finish(bytes_in=Path(shard).stat().st_size, seconds=time.perf_counter() - started)


def rule_clean_share(counts: dict[str, int]) -> dict[str, object]:
    """The rule-clean share of the code before and after the stage, its parts, and the files never parsed.

    "after" is 1 whenever the stage keeps only rule-clean code, as it does:
    this describes the input, it does not measure the stage.
    """
    code_in, code_kept = counts.get("code_in", 0), counts.get("code_kept", 0)
    return {
        "before": counts.get("rule_clean_in", 0) / code_in if code_in else None,
        "after": counts.get("rule_clean_kept", 0) / code_kept if code_kept else None,
        "code_in": code_in,
        "code_kept": code_kept,
        "never_parsed": counts.get("never_parsed", 0),
        "parts_before": {p: counts.get(f"part_in:{p}", 0) / code_in if code_in else None for p in CLEAN_PARTS},
        "parts_after": {p: counts.get(f"part_kept:{p}", 0) / code_kept if code_kept else None for p in CLEAN_PARTS},
    }
