"""Planted corruption at demo size: does tier 2 find known-bad documents, and does round 1 gain from it?

    .venv/bin/python bench/planted.py --out /tmp/planted [--steps 300] [--per-kind 10]

1. The corpus: the demo's own sources (`assay ingest demo`: standard-library
   and package code, package documentation, man pages, Python reference
   topics), sized by --stdlib/--packages/--metadata/--man; the pool's junk
   sources are left out, so every real document is a plausible one. A fixed
   clean evaluation set (--eval-share of the real documents, by a hash of the
   id) is set aside and never trained on. --per-kind planted documents of
   each of assay.planted's six kinds go into the rest.
2. Round 0: the demo model (params.yaml `train`, holdout 0, --steps steps,
   checkpoints at the half and the end); the scoring pass at both checkpoints
   (params.yaml `score`, the reference set's sources given by --reference);
   the dynamic filter with params.yaml `dynamic`.
3. What it found: the recall of the planted documents per kind and per
   signal, the false-positive rate on the real ones with examples, and the
   AUC of each signal for planted vs real (alignment at the last checkpoint,
   averaged over both, each raw and as a z within its stratum, loss, gradient
   norm, and combinations).
4. Round 1, twice, same seed, steps and tokenizer (round 0's): on the curated
   corpus and on the uncurated one; each model's mean token loss on the fixed
   clean evaluation set.

With --rho-loss, RHO-LOSS (Mindermann et al. 2022) is measured too: before the
scoring pass a reference ("irreducible loss") model is trained, as the paper
does, on held-out clean data only: the corpus's reference set (the documents
`training.score.select_reference` picks from the --reference sources, the same
set the alignment uses as clean and the filter never judges), with round 0's
tokenizer, model, seed and steps. The pass then scores with
`score.reference_model` pointing at it, so `ref_loss` and the filter's
`reducible_loss` (= loss - ref_loss) fill in. The bench checks by id that the
reference model trained on no judged document (planted or real): its training
ids are a subset of the pass's reference.txt, which holds no planted id; and by
text hash that no judged document is a copy of one of them. Reference documents
that a planted document was made from (shuffled, one line repeated, relabelled:
its meta names the source) are left out of the reference model's data, or it
would train on a planted document's text (relabelled prose is the same text). Scores go to
OUT/scores-rho, results to OUT/results-rho.json (with --resume, an earlier
round 0 is reused).

Writes OUT/results.json and prints the tables as Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from assay.config import load_params  # noqa: E402
from assay.planted import PLANTED_KINDS, auc, planted_kind, with_planted  # noqa: E402
from assay.schema import DOCUMENT_COLUMNS, DOCUMENT_SCHEMA  # noqa: E402
from assay.shards import ShardWriter, list_shards  # noqa: E402


def _share(doc_id: str) -> float:
    return int.from_bytes(hashlib.blake2b(f"planted-eval\x1f{doc_id}".encode(), digest_size=8).digest(), "big") / 2**64


def write(folder: Path, table: pa.Table) -> Path:
    with ShardWriter(folder, DOCUMENT_SCHEMA) as writer:
        writer.write(table.select(list(DOCUMENT_COLUMNS)).cast(DOCUMENT_SCHEMA))
    return folder


def read(folder: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in list_shards(folder)])


def build_corpus(out: Path, args) -> tuple[Path, Path, Path]:
    """(corpus with planted documents, the same corpus curated later, the clean evaluation set)."""
    from flows.ingest import ingest_flow

    raw = out / "raw"
    if not (raw / "manifest.json").is_file():
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        demo = params["demo"]
        for key in demo:
            if key != "seed":
                demo[key] = 0
        demo.update(stdlib_files=args.stdlib, package_files=args.packages, package_metadata=args.metadata,
                    man_pages=args.man, seed=args.corpus_seed)
        params_file = out / "ingest-params.yaml"
        params_file.write_text(yaml.safe_dump(params))
        ingest_flow(["demo"], str(raw), params_file=str(params_file), overwrite=True)
    docs = read(raw)
    # The pool's METADATA header blocks are machine text (the junk of tier 1's pool); only the
    # long descriptions (package documentation) stay.
    sources = np.array(docs.column("source").to_pylist(), dtype=object)
    docs = docs.filter(pa.array(sources != "pypi-metadata"))
    ids = docs.column("id").to_pylist()
    held = np.array([_share(i) < args.eval_share for i in ids])
    evaluation, corpus = out / "eval", out / "corpus"
    if not list_shards(corpus):  # deterministic: a rerun reuses them
        write(evaluation, docs.filter(pa.array(held)))
        write(corpus, with_planted(docs.filter(pa.array(~held)), args.per_kind, seed=args.seed))
    return corpus, evaluation, raw


def eval_loss(run_dir: Path, data: Path, tokenizer, train_params) -> dict:
    """Mean token loss of a run's last checkpoint on `data`, with `tokenizer`, every row."""
    import torch

    from assay.versions import open_version
    from training.checkpoint import latest_checkpoint, read_trainer_state
    from training.score import load_model
    from training.trainer import _split_docs, evaluate
    from training.data import build_rows

    checkpoint = latest_checkpoint(run_dir)
    model = load_model(checkpoint, read_trainer_state(checkpoint), tokenizer.get_vocab_size(), torch.device("cpu"))
    docs = [(i, t) for i, t, _ in _split_docs(open_version(data), 0.0)]
    rows = build_rows(docs, tokenizer, train_params.seq_len)
    return evaluate(model, rows, dataclasses.replace(train_params, eval_rows=0), torch.device("cpu"))


def signal_table(scores: pa.Table, telemetry: pa.Table, params) -> dict[str, np.ndarray]:
    from filters.dynamic import robust_z, signals_for, strata

    last = int(max(scores.column("step").to_pylist()))
    both = signals_for(scores, telemetry, params)
    at_last = signals_for(scores, telemetry, dataclasses.replace(params, checkpoints=[last]))
    assert both.column("id").to_pylist() == at_last.column("id").to_pylist()

    def col(t, c):
        return np.array(t.column(c).to_pylist(), dtype=float)

    ids = both.column("id").to_pylist()
    reference = np.array(both.column("reference").to_pylist(), dtype=bool)
    judged = ~reference & np.isfinite(col(both, "alignment"))
    kind = np.array(both.column("kind").to_pylist(), dtype=object)
    lang = np.array(both.column("lang").to_pylist(), dtype=object)
    groups = strata(kind, lang, col(both, "tokens"), params.length_bands, params.min_stratum_docs, judged)
    out = {"id": np.array(ids, dtype=object), "judged": judged, "groups": groups, "kind": kind}
    out["align_last"], out["align_mean"] = col(at_last, "alignment"), col(both, "alignment")
    out["align_last_z"] = robust_z(out["align_last"], groups, judged)
    out["align_mean_z"] = robust_z(out["align_mean"], groups, judged)
    by_kind = strata(kind, lang, col(both, "tokens"), None, params.min_stratum_docs, judged)
    out["align_last_zk"] = robust_z(out["align_last"], by_kind, judged)
    out["align_mean_zk"] = robust_z(out["align_mean"], by_kind, judged)
    out["loss"], out["grad_norm"] = col(both, "loss"), col(both, "grad_norm")
    out["loss_z"] = robust_z(out["loss"], groups, judged)
    out["grad_norm_z"] = robust_z(out["grad_norm"], groups, judged)
    # RHO-LOSS: NaN unless the pass had a reference model. Its z uses the filter's own strata
    # (kind x lang x band over the documents that have the signal), as StratumOutlierFilter does.
    out["reducible"] = col(both, "reducible_loss")
    out["ref_loss"] = out["loss"] - out["reducible"]
    has = judged & np.isfinite(out["reducible"])
    rgroups = strata(kind, lang, col(both, "tokens"), params.length_bands, params.min_stratum_docs, has)
    out["reducible_z"] = robust_z(out["reducible"], rgroups, has)
    # Order sensitivity (score.order_rise): z within kind over the documents that have it, as the filter
    # reads it beside the alignment (dynamic.alignment_z_strata).
    out["order_rise"] = col(at_last, "order_rise")
    has = judged & np.isfinite(out["order_rise"])
    out["order_rise_zk"] = robust_z(out["order_rise"], strata(kind, lang, col(both, "tokens"), None,
                                                               params.min_stratum_docs, has), has)
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    """Percentile rank in [0, 1] (ties averaged; NaN lowest, as `auc` reads NaN)."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=-np.inf)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    _, start, counts = np.unique(x[order], return_index=True, return_counts=True)
    for s, c in zip(start, counts):
        ranks[order[s:s + c]] = s + (c - 1) / 2.0
    return ranks / max(len(x) - 1, 1)


def aucs(sig: dict[str, np.ndarray]) -> dict[str, float]:
    """AUC of each badness score (higher = more likely planted) over the judged documents."""
    j = sig["judged"]
    bad = np.array([planted_kind(i) is not None for i in sig["id"]])[j]
    candidates = {
        "alignment, last checkpoint": -sig["align_last"],
        "alignment, mean of checkpoints": -sig["align_mean"],
        "alignment z in stratum, last checkpoint": -sig["align_last_z"],
        "alignment z in stratum, mean of checkpoints": -sig["align_mean_z"],
        "alignment z in kind, last checkpoint": -sig["align_last_zk"],
        "alignment z in kind, mean of checkpoints": -sig["align_mean_zk"],
        "loss (high)": sig["loss"],
        "|loss z| in stratum (both ends)": np.abs(sig["loss_z"]),
        "grad norm (high)": sig["grad_norm"],
        "grad norm z in stratum": sig["grad_norm_z"],
        # Combinations: the alignment z, plus how far loss is outside the 3.5 band at either end.
        "combined: alignment z (mean) + loss tails": -sig["align_mean_z"] + np.maximum(np.abs(sig["loss_z"]) - 3.5, 0),
        "combined: max(-alignment z, |loss z|)": np.fmax(-sig["align_mean_z"], np.abs(sig["loss_z"])),
    }
    if np.isfinite(sig["order_rise"][j]).any():
        candidates["order rise z in kind (low)"] = -sig["order_rise_zk"]
        # The one-sided combination the filter's cascade approximates (either cut drops).
        candidates["combined: max(-alignment z in kind (last), -order rise z in kind)"] = np.fmax(
            -sig["align_last_zk"], -sig["order_rise_zk"])
    if np.isfinite(sig["reducible"][j]).any():
        # The filter reads the low end of reducible loss as bad (StratumOutlierFilter, low_z).
        candidates["RHO-LOSS: reducible loss (low)"] = -sig["reducible"]
        candidates["RHO-LOSS: reducible loss z in stratum (low)"] = -sig["reducible_z"]
        candidates["RHO-LOSS: ref_loss (high)"] = sig["ref_loss"]
        # Combination rule, fixed before it was computed: the mean of the two signals' percentile
        # ranks among the judged documents, the default alignment signal (z within kind, last
        # checkpoint) and reducible loss's z in stratum, each oriented bad-high.
        candidates["combined: rank mean of -alignment z in kind (last) and -reducible z"] = (
            _ranks(-sig["align_last_zk"][j]) + _ranks(-sig["reducible_z"][j])) / 2
    return {name: round(auc(score if len(score) == j.sum() else score[j], bad), 4)
            for name, score in candidates.items()}


RHO_RUN = "rho-reference"
RHO_DATA = "rho-reference-data"


def _text_hash(text: str | None) -> str:
    return hashlib.blake2b((text or "").encode(), digest_size=16).hexdigest()


def train_reference_model(args, docs: pa.Table, reference: dict[str, float], train_params) -> dict:
    """RHO-LOSS's irreducible-loss model: round 0's tokenizer, model, seed and steps, trained on the
    corpus's reference set alone (never judged), written to OUT/rho-reference."""
    from assay.versions import open_version
    from training.checkpoint import latest_checkpoint
    from training.score import select_reference
    from training.tokenizer import load_tokenizer
    from training.trainer import train

    ids = docs.column("id").to_pylist()
    chosen = select_reference(ids, np.array(docs.column("source").to_pylist(), dtype=object), reference)
    if any(planted_kind(i) for i, c in zip(ids, chosen) if c):
        raise AssertionError("a planted document is in the reference set; it must never train the reference model")
    sources_of_planted = _planted_sources(docs)
    texts = docs.column("text").to_pylist()
    judged_texts = {_text_hash(t) for t, c in zip(texts, chosen) if not c}
    # A planted document made from a reference one (relabelled prose is the very same text) must
    # not be learnt by the reference model, so its source leaves the reference model's data.
    excluded = [i for i, t, c in zip(ids, texts, chosen)
                if c and (i in sources_of_planted or _text_hash(t) in judged_texts)]
    chosen &= ~np.isin(np.array(ids, dtype=object), np.array(excluded, dtype=object))
    data = args.out / RHO_DATA
    if not (args.resume and list_shards(data)):
        for old in list_shards(data):
            old.unlink()
        write(data, docs.filter(pa.array(chosen)))
    tokenizer = load_tokenizer(args.out / "round-0")
    resume = args.resume and latest_checkpoint(args.out / RHO_RUN) is not None  # else a fresh run
    result = train(open_version(data), args.out / RHO_RUN, train_params, overwrite=not resume, resume=resume,
                   progress=False, tokenizer=tokenizer)
    trained = read(data)
    return {"documents": trained.num_rows, "ids": trained.column("id").to_pylist(), "excluded": len(excluded),
            "text_hashes": {_text_hash(t) for t in trained.column("text").to_pylist()},
            "steps": train_params.steps, "final_loss_mean10": result.metrics["final_loss_mean10"],
            "skipped_steps": result.metrics["skipped_steps"]}


def _planted_sources(docs: pa.Table) -> set[str]:
    """Ids of the real documents the planted ones were made from (meta "from")."""
    out = set()
    for i, m in zip(docs.column("id").to_pylist(), docs.column("meta").to_pylist()):
        if planted_kind(i) and m:
            source = json.loads(m).get("from")
            if source:
                out.add(source)
    return out


def check_reference_model_data(out: Path, docs: pa.Table, reference_ids: set[str], rho: dict) -> None:
    """The reference model trained on no judged document: by id (its training ids are within the
    pass's reference set, the documents the filter never judges, none is planted, none is a planted
    document's source) and by text (no judged document's text equals one it trained on)."""
    trained = set(rho["ids"])
    if not trained <= reference_ids:
        raise AssertionError(f"{len(trained - reference_ids)} of the reference model's training ids are not in the "
                             "pass's reference set")
    ids, texts = docs.column("id").to_pylist(), docs.column("text").to_pylist()
    judged = {i for i in ids if i not in reference_ids}
    if trained & judged or any(planted_kind(i) for i in trained):
        raise AssertionError("the reference model trained on a judged or planted document")
    copies = [i for i, t in zip(ids, texts) if i in judged and _text_hash(t) in rho["text_hashes"]]
    if copies:
        raise AssertionError(f"judged documents with a reference document's exact text: {copies[:5]}")
    if trained & _planted_sources(docs):
        raise AssertionError("the reference model trained on a document a planted one was made from")
    rho["check"] = {"trained_ids": len(trained), "reference_set_ids": len(reference_ids),
                    "left_out_as_planted_sources_or_copies": rho["excluded"], "judged_ids": len(judged),
                    "trained_and_judged_ids": 0, "judged_with_a_trained_text": 0, "trained_planted_sources": 0}


def rho_results(rho: dict, sig: dict[str, np.ndarray], scores: pa.Table, telemetry: pa.Table, params,
                verdict: dict) -> dict:
    """The reducible-loss filter alone at params.yaml's threshold, its share of the cascade's drops, and
    the cascade's alignment cut with and without it."""
    from filters.dynamic import AlignmentFilter, StratumOutlierFilter, signals_for

    signals = signals_for(scores, telemetry, params)
    ids = signals.column("id").to_pylist()
    bands, min_docs = tuple(params.length_bands), params.min_stratum_docs
    alone = StratumOutlierFilter("reducible_loss", None, params.reducible_low_z, bands, min_docs).apply(signals)
    align = AlignmentFilter(params.alignment_threshold, params.alignment_low_z, params.alignment_high_z, bands,
                            min_docs, params.alignment_z_strata).apply(signals)
    judged = set(i for i, r in zip(ids, signals.column("reference").to_pylist()) if not r)

    def count(drop: np.ndarray) -> dict[str, int]:
        hit = [i for i, d in zip(ids, drop) if d and i in judged]
        return {"planted": sum(bool(planted_kind(i)) for i in hit), "real": sum(not planted_kind(i) for i in hit)}

    j = sig["judged"]
    real = ~np.array([planted_kind(i) is not None for i in sig["id"]]) & j
    planted = j & ~real

    def med(x, m):
        return round(float(np.nanmedian(x[m])), 4)

    # In the cascade a document's reason is the first filter's that drops it: these are the ones
    # only reducible loss caught.
    by_rho = [i for i, v in verdict.items() if not v["kept"] and v["reason"] == "dynamic:reducible_loss_low"]

    return {
        "reference_model": {k: rho[k] for k in ("documents", "excluded", "steps", "final_loss_mean10",
                                                 "skipped_steps")},
        "check": rho.get("check"),
        "judged": {"planted": int(planted.sum()), "real": int(real.sum()),
                   "with_reducible_loss": int(np.isfinite(sig["reducible"][j]).sum())},
        "threshold_low_z": params.reducible_low_z,
        "dropped_by_reducible_loss_alone": count(~alone.keep),
        "dropped_by_reducible_loss_alone_per_kind": {
            k: sum(planted_kind(i) == k for i, d in zip(ids, ~alone.keep) if d) for k in PLANTED_KINDS},
        "dropped_with_reason_reducible_loss_low_in_cascade": {
            "planted": sum(bool(planted_kind(i)) for i in by_rho), "real": sum(not planted_kind(i) for i in by_rho)},
        "alignment_cut_alone": count(~align.keep),
        "alignment_cut_or_reducible_loss": count(~align.keep | ~alone.keep),
        "median": {"loss": {"planted": med(sig["loss"], planted), "real": med(sig["loss"], real)},
                   "ref_loss": {"planted": med(sig["ref_loss"], planted), "real": med(sig["ref_loss"], real)},
                   "reducible_loss": {"planted": med(sig["reducible"], planted), "real": med(sig["reducible"], real)}},
        "median_reducible_loss_by_planted_kind": {
            k: med(sig["reducible"], np.array([planted_kind(i) == k for i in sig["id"]])) for k in PLANTED_KINDS},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="Training steps per round (default: params.yaml train.steps).")
    parser.add_argument("--per-kind", type=int, default=10)
    parser.add_argument("--stdlib", type=int, default=250)
    parser.add_argument("--packages", type=int, default=150)
    parser.add_argument("--metadata", type=int, default=150)
    parser.add_argument("--man", type=int, default=150)
    parser.add_argument("--eval-share", type=float, default=0.1)
    parser.add_argument("--reference", default="pydoc-topics=1.0,man=0.5,python-stdlib=0.3,pypi-description=0.3",
                        help="score.reference as source=share,...")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the planted documents")
    parser.add_argument("--corpus-seed", type=int, default=0,
                        help="demo.seed: which files the corpus draws (a second seed = a corpus nobody tuned on)")
    parser.add_argument("--skip-round-1", action="store_true")
    parser.add_argument("--dim", type=int, default=None, help="Override train.model.dim (and ffn_hidden = 2 dim): "
                        "a smaller model than the demo's for a busy machine")
    parser.add_argument("--layers", type=int, default=None, help="Override train.model.n_layers")
    parser.add_argument("--seq-len", type=int, default=None, help="Override train.seq_len")
    parser.add_argument("--max-rows", type=int, default=None, help="Override score.max_rows")
    parser.add_argument("--params-file", type=Path, default=None, help="params.yaml for the filter (default: the repo's)")
    parser.add_argument("--reference-aggregate", choices=("tokens", "documents", "unit"), default=None,
                        help="Override score.reference_aggregate; scores go to OUT/scores-AGG and the results to "
                             "OUT/results-AGG.json, so several can be compared on one round 0")
    parser.add_argument("--rho-loss", action="store_true",
                        help="Also train a reference model on the reference set only (held-out clean data) and "
                             "score with it as score.reference_model (RHO-LOSS); scores in OUT/scores-rho")
    parser.add_argument("--resume", action="store_true",
                        help="Reuse OUT's round 0 when it has finished (the same corpus and settings), e.g. to "
                             "score it again with another --reference-aggregate")
    args = parser.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args.out.mkdir(parents=True, exist_ok=True)

    from assay.versions import open_version
    from training.score import read_scores, score_dataset
    from training.telemetry import read_telemetry
    from training.tokenizer import load_tokenizer
    from training.trainer import train

    params = load_params(args.params_file or ROOT / "params.yaml")
    steps = args.steps or params.train.steps
    model = params.train.model
    if args.dim:
        model = dataclasses.replace(model, dim=args.dim, ffn_hidden=2 * args.dim)
    if args.layers:
        model = dataclasses.replace(model, n_layers=args.layers)
    train_params = dataclasses.replace(params.train, model=model, steps=steps, holdout=0.0,
                                       checkpoint_every=max(1, steps // 2), device="cpu",
                                       seq_len=args.seq_len or params.train.seq_len)
    timings = {}
    t = time.perf_counter()
    corpus, evaluation, _ = build_corpus(args.out, args)
    timings["corpus_s"] = round(time.perf_counter() - t, 1)
    docs = read(corpus)
    print(f"corpus: {docs.num_rows} documents ({sum(planted_kind(i) is not None for i in docs.column('id').to_pylist())} planted), "
          f"eval set: {read(evaluation).num_rows}", flush=True)

    t = time.perf_counter()
    round0 = train(open_version(corpus), args.out / "round-0", train_params, overwrite=not args.resume,
                   resume=args.resume, progress=False)
    timings["round0_s"] = round(time.perf_counter() - t, 1)
    print(f"round 0: {timings['round0_s']} s, skipped steps {round0.metrics['skipped_steps']}", flush=True)

    reference = {k: float(v) for k, v in (item.split("=") for item in args.reference.split(","))}
    rho = None
    if args.rho_loss:
        t = time.perf_counter()
        rho = train_reference_model(args, docs, reference, train_params)
        timings["rho_reference_model_s"] = round(time.perf_counter() - t, 1)
        print(f"RHO-LOSS reference model: {timings['rho_reference_model_s']} s, {rho['documents']} documents",
              flush=True)
    score_params = dataclasses.replace(params.score, checkpoints=[steps // 2, steps], reference=reference, device="cpu",
                                       max_rows=args.max_rows or params.score.max_rows,
                                       reference_aggregate=args.reference_aggregate or params.score.reference_aggregate,
                                       reference_model=str(args.out / RHO_RUN) if rho else None)
    tag = (f"-{args.reference_aggregate}" if args.reference_aggregate else "") + ("-rho" if rho else "")
    scores_dir, results_file = args.out / f"scores{tag}", args.out / f"results{tag}.json"
    t = time.perf_counter()
    score_dataset(args.out / "round-0", corpus, scores_dir, score_params, overwrite=True, progress=False)
    timings["score_s"] = round(time.perf_counter() - t, 1)
    scores, telemetry = read_scores(scores_dir), read_telemetry(args.out / "round-0")
    print(f"scores: {timings['score_s']} s", flush=True)

    # The filter's params and code are read now, not at the start, so a long round 0 can be
    # followed by the thresholds in params.yaml at this moment (--params-file).
    params = load_params(args.params_file or ROOT / "params.yaml")
    from assay.stages.dynamic import verdicts

    judged = verdicts(scores, telemetry, params.dynamic)
    verdict = {r["id"]: r for r in judged.select(["id", "kept", "reason"]).to_pylist()}
    reference_ids = set((scores_dir / "reference.txt").read_text().split())
    if rho is not None:
        check_reference_model_data(args.out, docs, reference_ids, rho)
    ids = docs.column("id").to_pylist()
    sources = dict(zip(ids, docs.column("source").to_pylist()))
    planted = [i for i in ids if planted_kind(i)]
    real = [i for i in ids if not planted_kind(i) and i not in reference_ids]

    def dropped(i):
        return i in verdict and not verdict[i]["kept"]

    per_kind = {k: {"planted": sum(planted_kind(i) == k for i in planted),
                    "dropped": sum(planted_kind(i) == k and dropped(i) for i in planted)} for k in PLANTED_KINDS}
    reasons: dict[str, dict[str, int]] = {}
    for i in ids:
        if dropped(i):
            row = reasons.setdefault(verdict[i]["reason"], {"planted": 0, "real": 0})
            row["planted" if planted_kind(i) else "real"] += 1
    false_pos = [i for i in real if dropped(i)]
    fp_by_source: dict[str, list[int]] = {}
    for i in real:
        entry = fp_by_source.setdefault(sources[i], [0, 0])
        entry[0] += dropped(i)
        entry[1] += 1
    sig = signal_table(scores, telemetry, params.dynamic)
    results = {
        "corpus": {"documents": len(ids), "planted": len(planted), "real_judged": len(real),
                   "reference": len(reference_ids), "eval": read(evaluation).num_rows},
        "train": {"steps": steps, "checkpoints": [steps // 2, steps], "skipped_steps": round0.metrics["skipped_steps"],
                  "model": dataclasses.asdict(train_params.model), "seq_len": train_params.seq_len,
                  "final_loss_mean10": round0.metrics["final_loss_mean10"]},
        "recall": {"overall": round(sum(map(dropped, planted)) / max(len(planted), 1), 4), "per_kind": per_kind},
        "by_reason": reasons,
        "false_positive_rate": round(len(false_pos) / max(len(real), 1), 4),
        "false_positives_by_source": {s: {"dropped": d, "of": n} for s, (d, n) in sorted(fp_by_source.items())},
        "false_positive_examples": [{"id": i, "source": sources[i], "reason": verdict[i]["reason"]} for i in false_pos[:12]],
        "auc": aucs(sig),
        "median_alignment_by_planted_kind": {
            k: round(float(np.nanmedian(sig["align_mean"][[planted_kind(i) == k for i in sig["id"]]])), 4)
            for k in PLANTED_KINDS},
        "median_alignment_real_by_kind": {
            k: round(float(np.nanmedian(sig["align_mean"][sig["judged"] & (sig["kind"] == k) &
                                                           np.array([planted_kind(i) is None for i in sig["id"]])])), 4)
            for k in ("code", "text")},
        "params": {"dynamic": dataclasses.asdict(params.dynamic), "score": dataclasses.asdict(score_params)},
    }
    if rho is not None:
        results["rho_loss"] = rho_results(rho, sig, scores, telemetry, params.dynamic, verdict)
    results_file.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("recall", "by_reason", "false_positive_rate", "auc", "rho_loss")
                      if k in results}, indent=2), flush=True)

    if not args.skip_round_1:
        tokenizer = load_tokenizer(args.out / "round-0")
        kept = np.array([not dropped(i) for i in ids])
        curated = write(args.out / "curated", docs.filter(pa.array(kept)))
        round1 = {}
        for name, data in (("curated", curated), ("uncurated", corpus)):
            t = time.perf_counter()
            train(open_version(data), args.out / f"round-1-{name}", train_params, overwrite=True, progress=False,
                  tokenizer=tokenizer)
            round1[name] = {**eval_loss(args.out / f"round-1-{name}", evaluation, tokenizer, train_params),
                            "documents": int(kept.sum()) if name == "curated" else len(ids),
                            "seconds": round(time.perf_counter() - t, 1)}
            print(f"round 1 {name}: {round1[name]}", flush=True)
        round1["val_loss_difference_curated_minus_uncurated"] = round(
            round1["curated"]["val_loss"] - round1["uncurated"]["val_loss"], 5)
        results["round1"] = round1
    results["timings"] = timings
    results_file.write_text(json.dumps(results, indent=2))
    print(json.dumps(results.get("round1", {}), indent=2))


if __name__ == "__main__":
    main()
