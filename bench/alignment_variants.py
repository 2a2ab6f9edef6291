"""Which definition of gradient alignment separates planted garbage best? One table, one run.

    .venv/bin/python bench/alignment_variants.py --bench /tmp/planted [--rows 4,1] [--checkpoint last]

Reads a finished `bench/planted.py --out DIR` (its corpus, round 0 and scores/reference.txt)
and recomputes every document's gradient by brute force (autograd of the document's own
mean token loss, one backward per document, fp32, flattened), then, for each variant,
the cosine with a reference gradient and the AUC of planted vs real judged documents
(assay.planted.auc; higher = planted lower). Variants, one axis at a time and crossed:

- reference set: the bench's (scores/reference.txt) or that plus --extra-reference
  (source=share, e.g. package documentation), evaluated on the documents judged under both;
- reference stratum: one for all, or per kind (the document's declared kind);
- reference aggregate: the gradient of the reference tokens' mean loss (each document
  weighted by its tokens: the scoring pass's), the mean of the per-document gradients,
  or the mean of the per-document *unit* gradients;
- parameters: all, all but the embedding and output matrices, attention only (LESS-like),
  or the mean of per-tensor cosines;
- Adam preconditioning from the checkpoint's optimizer state, P = 1 / (sqrt(v_hat) + eps):
  none; G -> P G (the ghost-computable one: the document's own gradient is untouched);
  both sides (P g . P G); both by P^1/2 (the inner product in Adam's metric);
- rows (--rows): the document's (and the reference's) first N rows, e.g. 4 (score.max_rows) or 1.

The document gradient's length normalisation (mean vs sum of token losses) is not a
variant: a cosine does not depend on the gradient's scale.

Prints the AUC table as Markdown and writes BENCH/variants.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from assay.planted import auc, planted_kind  # noqa: E402
from filters.dynamic import robust_z  # noqa: E402


def _load(run_dir: Path, checkpoint: str):
    import torch.distributed.checkpoint as dcp

    from assay.config import TrainModelParams, TrainParams
    from training.checkpoint import CHECKPOINTS, SafeReader, _single_process_ok, _tensor_state, latest_checkpoint
    from training.checkpoint import read_trainer_state
    from training.tokenizer import load_tokenizer
    from training.trainer import build_model, build_optimizer

    path = latest_checkpoint(run_dir) if checkpoint == "last" else run_dir / CHECKPOINTS / f"step-{int(checkpoint):08d}"
    state = read_trainer_state(path)
    tokenizer = load_tokenizer(run_dir)
    params = TrainParams(model=TrainModelParams(**state["model_args"]), seq_len=int(state["seq_len"]))
    model = build_model(params, tokenizer.get_vocab_size(), torch.device("cpu"))
    optimizer = build_optimizer(model, params)
    sd, _ = _tensor_state(model, optimizer, {})
    sd.pop("extra")
    with _single_process_ok():
        dcp.load(sd, storage_reader=SafeReader(str(path)))
    model.load_state_dict(sd["model"])
    model.train()
    # Adam's second moment per parameter name, bias-corrected at the checkpoint's step.
    beta2 = optimizer.defaults["betas"][1]
    eps = optimizer.defaults["eps"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    precond = {}
    for n in names:
        v = sd["optim"][n]["exp_avg_sq"]
        step = float(sd["optim"][n]["step"])
        precond[n] = 1.0 / ((v / (1 - beta2 ** step)).sqrt() + eps)
    return model, tokenizer, int(state["seq_len"]), int(state["step"]), names, precond


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, required=True, help="a bench/planted.py --out directory")
    parser.add_argument("--checkpoint", default="last")
    parser.add_argument("--rows", default="4", help="comma-separated: each document's first N rows (4 = score.max_rows)")
    parser.add_argument("--extra-reference", default="pypi-description=0.3,site-packages=0.3",
                        help="sources added to the reference set in the 'more' variant, as source=share,...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="judge only every n-th document (a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.shards import list_shards
    from training.data import make_batch
    from training.grad_norms import token_losses
    from training.score import _rows_for, select_reference

    docs = pa.concat_tables([pq.read_table(p) for p in list_shards(args.bench / "corpus")])
    ids = docs.column("id").to_pylist()
    kind = np.array(docs.column("kind").to_pylist(), dtype=object)
    source = np.array(docs.column("source").to_pylist(), dtype=object)
    texts = docs.column("text").to_pylist()
    base_ref = set((args.bench / "scores" / "reference.txt").read_text().split())
    extra = {k: float(v) for k, v in (item.split("=") for item in args.extra_reference.split(",") if item)}
    more_ref = base_ref | {i for i, r in zip(ids, select_reference(ids, source, extra)) if r}
    planted = np.array([planted_kind(i) is not None for i in ids])
    in_base = np.array([i in base_ref for i in ids])
    in_more = np.array([i in more_ref for i in ids])
    judged = ~in_more
    if args.limit:
        judged &= np.arange(len(ids)) % args.limit == 0
    print(f"{len(ids)} documents: reference {in_base.sum()} (more: {in_more.sum()}), judged {judged.sum()} "
          f"({(judged & planted).sum()} planted)", flush=True)

    model, tokenizer, seq_len, step, names, precond = _load(args.bench / "round-0", args.checkpoint)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    sizes = [shapes[n].numel() for n in names]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat_p = torch.cat([precond[n].reshape(-1) for n in names]).double()
    params = [dict(model.named_parameters())[n] for n in names]
    subsets = {
        "all": [True] * len(names),
        "no embed/output": [n not in ("tok_embeddings.weight", "output.weight") for n in names],
        "attention only": [".attention.w" in n for n in names],
    }

    rows_variants = sorted({int(r) for r in args.rows.split(",")}, reverse=True)
    scored = {r: _rows_for(list(enumerate(texts)), tokenizer, seq_len, r) for r in rows_variants}
    index = {r: {int(p): j for j, p in enumerate(scored[r].pos)} for r in rows_variants}

    def doc_grad(r: int, d: int) -> tuple[torch.Tensor, int] | None:
        rows = scored[r].rows
        j = index[r].get(d)
        where = np.nonzero(rows.doc == j)[0] if j is not None else []
        if len(where) == 0:
            return None
        batch = make_batch(rows, where)
        losses = token_losses(model(batch.tokens), batch.targets, batch.loss_mask)
        n = batch.loss_mask.sum()
        if n == 0:
            return None
        grads = torch.autograd.grad(losses.sum() / n, params, allow_unused=True)
        g = torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1) for x, p in zip(grads, params)])
        return g.double(), int(n)

    # Pass 1: reference aggregates. key (rows, set, stratum, aggregate) -> flat fp64 vector.
    sets = {"bench": in_base, "bench + more": in_more}
    strata = ("all", "kind")
    aggs = ("token-weighted (pass)", "mean of documents", "mean of unit gradients")
    refs: dict[tuple, torch.Tensor] = {}
    counts: dict[tuple, float] = {}
    for r in rows_variants:
        for d in np.nonzero(in_more)[0]:
            out = doc_grad(r, int(d))
            if out is None:
                continue
            g, n = out
            for set_name, mask in sets.items():
                if not mask[d]:
                    continue
                for stratum in ("all", kind[d]):
                    for agg, (vec, w) in zip(aggs, ((g * n, n), (g, 1), (g / g.norm(), 1))):
                        key = (r, set_name, stratum, agg)
                        if key not in refs:
                            refs[key] = torch.zeros_like(g)
                            counts[key] = 0.0
                        refs[key] += vec
                        counts[key] += w
        print(f"reference gradients, {r} row(s): {time.perf_counter() - t0:.0f} s", flush=True)
    for key in refs:
        refs[key] /= counts[key]

    precs = {  # name -> (reference transform, document transform)
        "none": (lambda v: v, lambda v: v),
        "P G (ghost)": (lambda v: flat_p * v, lambda v: v),
        "P g . P G": (lambda v: flat_p * v, lambda v: flat_p * v),
        "P^1/2 both": (lambda v: flat_p.sqrt() * v, lambda v: flat_p.sqrt() * v),
    }

    # Pass 2: per judged document, per-tensor dots with every reference and per-tensor squared norms.
    # A diagonal scaling on the document's side is moved onto the reference (g.(P E) = (P g).E), so
    # every dot is the raw gradient times one matrix per tensor.
    def seg_sq(v: torch.Tensor) -> np.ndarray:
        return np.array([float(v[offsets[k]:offsets[k + 1]].pow(2).sum()) for k in range(len(names))])

    ref_keys = {r: [(r, s, st, a, p) for (rr, s, st, a) in refs if rr == r for p in precs] for r in rows_variants}
    ref_sq, stacked = {}, {}
    for r in rows_variants:
        effective = []
        for key in ref_keys[r]:
            ref_tf, doc_tf = precs[key[4]]
            v = ref_tf(refs[key[:4]])
            ref_sq[key] = seg_sq(v)
            effective.append(doc_tf(v).float())
        big = torch.stack(effective)
        stacked[r] = [big[:, offsets[k]:offsets[k + 1]].contiguous() for k in range(len(names))]
        del big, effective
    judged_idx = np.nonzero(judged)[0]
    dots = {key: np.full((len(judged_idx), len(names)), np.nan) for r in rows_variants for key in ref_keys[r]}
    doc_sq = {(r, p): np.full((len(judged_idx), len(names)), np.nan) for r in rows_variants for p in precs}
    for j, d in enumerate(judged_idx):
        for r in rows_variants:
            out = doc_grad(r, int(d))
            if out is None:
                continue
            g = out[0]
            for p, (_, doc_tf) in precs.items():
                doc_sq[(r, p)][j] = seg_sq(doc_tf(g))
            gf = g.float()
            per = torch.stack([stacked[r][k] @ gf[offsets[k]:offsets[k + 1]] for k in range(len(names))], 1)
            per = per.double().numpy()
            for i, key in enumerate(ref_keys[r]):
                dots[key][j] = per[i]
        if j % 100 == 0:
            print(f"judged {j}/{len(judged_idx)}: {time.perf_counter() - t0:.0f} s", flush=True)

    # Per-document stratum: dots for "kind" were written only for the document's own kind's reference,
    # under the same key; fold the kind keys into one column per (rows, set, 'kind', agg, prec).
    labels = planted[judged_idx]
    kinds_j = kind[judged_idx]
    results = []
    for r, s, st, a, p in itertools.product(rows_variants, sets, strata, aggs, precs):
        dot = np.full((len(judged_idx), len(names)), np.nan)
        rsq = np.full((len(judged_idx), len(names)), np.nan)
        for k in (["all"] if st == "all" else sorted(set(kinds_j))):
            key = (r, s, k, a, p)
            if key not in dots:
                continue
            mine = np.ones(len(judged_idx), bool) if st == "all" else kinds_j == k
            dot[mine] = dots[key][mine]
            rsq[mine] = ref_sq[key]
        dsq = doc_sq[(r, p)]
        for subset, keep in subsets.items():
            keep = np.array(keep)
            cos = dot[:, keep].sum(1) / np.sqrt(dsq[:, keep].sum(1) * rsq[:, keep].sum(1))
            results.append({"rows": r, "reference": s, "stratum": st, "aggregate": a, "precondition": p,
                            "parameters": subset, "auc": auc(-cos, labels),
                            "auc_z_in_kind": auc(-robust_z(cos, kinds_j, np.isfinite(cos)), labels)})
        per = dot / np.sqrt(dsq * rsq)
        cos = np.nanmean(per, axis=1)
        results.append({"rows": r, "reference": s, "stratum": st, "aggregate": a, "precondition": p,
                        "parameters": "mean of per-tensor cosines", "auc": auc(-cos, labels),
                        "auc_z_in_kind": auc(-robust_z(cos, kinds_j, np.isfinite(cos)), labels)})
    results.sort(key=lambda x: -x["auc"])
    (args.bench / "variants.json").write_text(json.dumps({"step": step, "judged": int(judged.sum()),
                                                         "planted": int(labels.sum()), "results": results,
                                                         "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    print("| rows | reference | stratum | aggregate | precondition | parameters | AUC | AUC z in kind |")
    print("|---|---|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['rows']} | {x['reference']} | {x['stratum']} | {x['aggregate']} | {x['precondition']} | "
              f"{x['parameters']} | {x['auc']:.3f} | {x['auc_z_in_kind']:.3f} |")


if __name__ == "__main__":
    main()
