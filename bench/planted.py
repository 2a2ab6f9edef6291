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
    return out


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
    return {name: round(auc(score[j], bad), 4) for name, score in candidates.items()}


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
    score_params = dataclasses.replace(params.score, checkpoints=[steps // 2, steps], reference=reference, device="cpu",
                                       max_rows=args.max_rows or params.score.max_rows,
                                       reference_aggregate=args.reference_aggregate or params.score.reference_aggregate)
    tag = f"-{args.reference_aggregate}" if args.reference_aggregate else ""
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
    results_file.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("recall", "by_reason", "false_positive_rate", "auc")}, indent=2), flush=True)

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
