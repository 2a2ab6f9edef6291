"""Gradient alignment per checkpoint and per layer group, kept per document, so that ways of
reading it (more checkpoints, per-block cosines, z within strata, combinations) are compared
on the same gradients instead of one scoring pass each.

    .venv/bin/python bench/alignment_signals.py dump --bench /tmp/planted --checkpoints 50,100,150,200,250,300
    .venv/bin/python bench/alignment_signals.py table --bench /tmp/planted [--candidates ...]

`dump` reads a `bench/planted.py --out DIR` (its corpus and round-0 checkpoints; the round 0 of
`bench/planted.py`, or one trained with more checkpoints) and, at each checkpoint, recomputes by
brute force what the scoring pass computes ghost-style: every document's gradient (autograd of its
own mean token loss over its first --rows rows, fp32) and, per parameter tensor, its dot product
and squared norm with its kind's reference gradient (the pass's default: the reference set's
token-weighted mean loss, per kind; `--reference` as `bench/planted.py`'s), with the unit-gradient
aggregate (`score.reference_aggregate: unit`) beside it, and (totals only) its dot product with each
reference source's own gradient within its kind (the components of `score.components: source`).
Reference documents are not judged and get no row values. One file per checkpoint,
BENCH/signals/step-N.npz (step-N-rowsR.npz for --rows R other than 4).

`table` reads them back and prints, for each named candidate, the AUC of planted vs real over the
judged documents (not in the reference set); see CANDIDATES.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from assay.planted import auc, planted_kind  # noqa: E402
from filters.dynamic import robust_z, strata  # noqa: E402

BENCH_REFERENCE = "pydoc-topics=1.0,man=0.5,python-stdlib=0.3,pypi-description=0.3"


def _corpus(bench: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.shards import list_shards

    return pa.concat_tables([pq.read_table(p) for p in list_shards(bench / "corpus")])


def dump(bench: Path, checkpoints: list[int], rows: int, reference: str, threads: int) -> None:
    import torch

    from training.checkpoint import CHECKPOINTS, read_trainer_state
    from training.data import make_batch
    from training.grad_norms import token_losses
    from training.score import _rows_for, load_model, select_reference
    from training.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    docs = _corpus(bench)
    ids = docs.column("id").to_pylist()
    kind = np.array(docs.column("kind").to_pylist(), dtype=object)
    lang = np.array(docs.column("lang").to_pylist(), dtype=object)
    source = np.array(docs.column("source").to_pylist(), dtype=object)
    shares = {k: float(v) for k, v in (item.split("=") for item in reference.split(","))}
    is_ref = select_reference(ids, source, shares)
    run = bench / "round-0"
    tokenizer = load_tokenizer(run)
    out_dir = bench / "signals"
    out_dir.mkdir(exist_ok=True)
    scored = None
    for step in checkpoints:
        target = out_dir / _name(step, rows)
        if target.is_file():
            with np.load(target, allow_pickle=True) as f:
                if "comp_dot" in f.files:
                    continue
        t0 = time.perf_counter()
        path = run / CHECKPOINTS / f"step-{step:08d}"
        state = read_trainer_state(path)
        model = load_model(path, state, tokenizer.get_vocab_size(), torch.device("cpu"))
        if scored is None:
            scored = _rows_for(list(enumerate(docs.column("text").to_pylist())), tokenizer, int(state["seq_len"]), rows)
            index = {int(p): j for j, p in enumerate(scored.pos)}
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [dict(model.named_parameters())[n] for n in names]

        def grad(d: int):
            j = index.get(d)
            where = np.nonzero(scored.rows.doc == j)[0] if j is not None else []
            if len(where) == 0:
                return None
            batch = make_batch(scored.rows, where)
            n = batch.loss_mask.sum()
            if n == 0:
                return None
            losses = token_losses(model(batch.tokens), batch.targets, batch.loss_mask)
            loss = losses.sum() / n
            g = torch.autograd.grad(loss, params, allow_unused=True)
            return [(x if x is not None else torch.zeros_like(p)).double() for x, p in zip(g, params)], \
                int(n), float(loss)

        # Reference gradients per kind (the pass's strata: kind, >= 20 reference documents, else all).
        kinds, counts = np.unique(kind[is_ref], return_counts=True)
        big = {k for k, c in zip(kinds, counts) if c >= 20}
        stratum = np.array([k if k in big else "all" for k in kind], dtype=object)
        refs = {s: {"tokens": [torch.zeros_like(p, dtype=torch.float64) for p in params],
                    "unit": [torch.zeros_like(p, dtype=torch.float64) for p in params], "n": 0, "docs": 0}
                for s in set(stratum)}
        for d in np.nonzero(is_ref)[0]:
            got = grad(int(d))
            if got is None:
                continue
            g, n, _ = got
            norm = float(sum(x.pow(2).sum() for x in g)) ** 0.5
            # Components: the reference gradient of each source within each stratum (tokens-weighted).
            for s in ({stratum[d], "all"} & set(refs)) | {f"{stratum[d]}|{source[d]}"}:
                r = refs.setdefault(s, {"tokens": [torch.zeros_like(p, dtype=torch.float64) for p in params],
                                        "unit": [torch.zeros_like(p, dtype=torch.float64) for p in params],
                                        "n": 0, "docs": 0})
                for a, b, x in zip(r["tokens"], r["unit"], g):
                    a.add_(x, alpha=n)
                    b.add_(x, alpha=1.0 / norm)
                r["n"] += n
                r["docs"] += 1
        for r in refs.values():
            r["tokens"] = [a / max(r["n"], 1) for a in r["tokens"]]
            r["unit"] = [a / max(r["docs"], 1) for a in r["unit"]]
        n_docs, n_t = len(ids), len(names)
        comps = sorted(k for k in refs if "|" in k)
        comp_stratum = np.array([k.split("|")[0] for k in comps], dtype=object)
        comp_sq = np.array([float(sum(y.pow(2).sum() for y in refs[k]["tokens"])) for k in comps])
        comp_dot = np.full((n_docs, len(comps)), np.nan)
        dot = {a: np.full((n_docs, n_t), np.nan) for a in ("tokens", "unit")}
        ref_sq = {a: np.full((n_docs, n_t), np.nan) for a in ("tokens", "unit")}
        doc_sq = np.full((n_docs, n_t), np.nan)
        loss = np.full(n_docs, np.nan)
        tokens = np.zeros(n_docs)
        for d in range(n_docs):
            if is_ref[d]:  # never judged: the yardstick does not judge itself
                continue
            got = grad(d)
            if got is None:
                continue
            g, n, loss[d] = got
            tokens[d] = n
            doc_sq[d] = [float(x.pow(2).sum()) for x in g]
            for a in ("tokens", "unit"):
                r = refs[stratum[d]][a]
                dot[a][d] = [float((x * y).sum()) for x, y in zip(g, r)]
                ref_sq[a][d] = [float(y.pow(2).sum()) for y in r]
            for c, k in enumerate(comps):
                if comp_stratum[c] == stratum[d]:
                    comp_dot[d, c] = float(sum((x * y).sum() for x, y in zip(g, refs[k]["tokens"])))
            if d % 200 == 0:
                print(f"step {step}: {d}/{n_docs} documents, {time.perf_counter() - t0:.0f} s", flush=True)
        np.savez_compressed(target, names=np.array(names), ids=np.array(ids, dtype=object), kind=kind, lang=lang,
                            source=source, reference=is_ref, stratum=stratum, loss=loss, tokens=tokens,
                            doc_sq=doc_sq, dot_tokens=dot["tokens"], ref_sq_tokens=ref_sq["tokens"],
                            dot_unit=dot["unit"], ref_sq_unit=ref_sq["unit"], step=step,
                            comps=np.array(comps, dtype=object), comp_sq=comp_sq, comp_dot=comp_dot)
        print(f"step {step}: {time.perf_counter() - t0:.0f} s -> {target}", flush=True)


def _name(step: int, rows: int) -> str:
    return f"step-{step}.npz" if rows == 4 else f"step-{step}-rows{rows}.npz"


# ------------------------------------------------------------------ reading it back
def _load(bench: Path, step: int, rows: int = 4) -> dict:
    with np.load(bench / "signals" / _name(step, rows), allow_pickle=True) as f:
        return {k: f[k] for k in f.files}


def layer_groups(names: np.ndarray) -> np.ndarray:
    """Each tensor's group: 'embed', 'block.<i>' or 'head' (final norm and output)."""
    out = []
    for n in names:
        m = re.match(r"layers\.(\d+)\.", str(n))
        out.append(f"block.{m.group(1)}" if m else "embed" if "embed" in str(n) else "head")
    return np.array(out, dtype=object)


def cosine(s: dict, agg: str = "tokens", keep: np.ndarray | None = None) -> np.ndarray:
    keep = np.ones(s["doc_sq"].shape[1], bool) if keep is None else keep
    with np.errstate(invalid="ignore", divide="ignore"):
        return s[f"dot_{agg}"][:, keep].sum(1) / np.sqrt(s["doc_sq"][:, keep].sum(1) * s[f"ref_sq_{agg}"][:, keep].sum(1))


def group_cosines(s: dict, agg: str = "tokens") -> np.ndarray:
    """(documents, groups): the cosine restricted to each layer group's tensors."""
    groups = layer_groups(s["names"])
    return np.stack([cosine(s, agg, groups == g) for g in sorted(set(groups))], 1)


def _rank(x: np.ndarray) -> np.ndarray:
    """Ranks in [0, 1] (NaN stays NaN)."""
    out = np.full(len(x), np.nan)
    ok = np.isfinite(x)
    out[ok] = (np.argsort(np.argsort(x[ok], kind="mergesort"), kind="mergesort") + 0.5) / ok.sum()
    return out


def table(bench: Path, steps: list[int], names: list[str] | None) -> dict[str, float]:
    per = {st: _load(bench, st) for st in steps}
    s = per[max(steps)]
    ids = [str(i) for i in s["ids"]]
    judged = ~s["reference"].astype(bool) & np.isfinite(s["loss"])
    bad = np.array([planted_kind(i) is not None for i in ids])
    kind, lang = s["kind"], s["lang"]
    kind_lang = np.array([f"{k}/{g}" for k, g in zip(kind, lang)], dtype=object)
    # The filter's strata (kind x lang x length band, params.yaml dynamic), for the bench's own z.
    bands = strata(kind, lang, s["tokens"], [64, 256, 2048], 20, judged)

    def mean_cos(ck, agg="tokens"):
        return np.nanmean(np.stack([cosine(per[c], agg) for c in ck]), 0)

    def z(x, groups):
        return robust_z(x, groups, judged & np.isfinite(x))

    def loss_z():
        return z(s["loss"], bands)

    def norm_z():
        return z(np.sqrt(s["doc_sq"].sum(1)), bands)

    last = max(steps)
    have = set(steps)
    c = {}  # name -> badness (higher = more likely planted)
    c["raw, last"] = lambda: -mean_cos([last])
    if {150, 300} <= have:
        c["raw, mean 150/300 (bench baseline)"] = lambda: -mean_cos([150, 300])
    if {100, 200, 300} <= have:
        c["raw, mean 100/200/300"] = lambda: -mean_cos([100, 200, 300])
    if {200, 300} <= have:
        c["raw, mean 200/300"] = lambda: -mean_cos([200, 300])
    c["raw, mean of all dumped"] = lambda: -mean_cos(steps)
    # Fewer rows per document at more checkpoints: about the same tokens scored as one checkpoint at 4 rows.
    for rows in (1, 2):
        at = [st for st in steps if (bench / "signals" / _name(st, rows)).is_file()]
        if not at:
            continue
        fewer = {st: _load(bench, st, rows) for st in at}
        assert all([str(i) for i in f["ids"]] == ids for f in fewer.values())
        for label, ck in (("last", [last]), ("mean 150/300", [150, 300]), ("mean 200/300", [200, 300]),
                          ("mean 100/200/300", [100, 200, 300]), ("mean of all dumped", steps)):
            if set(ck) <= set(at):
                c[f"{rows} row(s), raw, {label}"] = lambda ck=ck, fewer=fewer: -np.nanmean(
                    np.stack([cosine(fewer[st]) for st in ck]), 0)
    # Nearest component: the best cosine with any one source's reference gradient within the document's
    # kind (a clean set is a mixture; documentation is judged against the nearest clean documentation).
    def nearest(st):
        f = per[st]
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = f["comp_dot"] / np.sqrt(f["doc_sq"].sum(1, keepdims=True) * f["comp_sq"][None, :])
        # The pass's rule (score.components: source): a source is a component of a stratum with
        # min_stratum_docs (20) reference documents in it. Here every stratum has one such source.
        ref = f["reference"].astype(bool)
        n_ref = np.array([(ref & (f["kind"] == k.split("|")[0]) & (f["source"] == k.split("|")[1])).sum()
                          for k in f["comps"]])
        cos = cos[:, n_ref >= 20]
        return np.nanmax(np.where(np.isfinite(cos), cos, -np.inf), 1)

    with_comp = [st for st in steps if "comp_dot" in per[st]]
    for label, ck in (("last", [last]), ("mean 150/300", [150, 300]), ("mean 100/200/300", [100, 200, 300])):
        if set(ck) <= set(with_comp):
            c[f"nearest component, {label}"] = lambda ck=ck: -np.nanmean(np.stack([nearest(st) for st in ck]), 0)
            c[f"nearest component, z in kind, {label}"] = lambda ck=ck: -z(
                np.nanmean(np.stack([nearest(st) for st in ck]), 0), kind)
            c[f"nearest component, z in filter strata, {label}"] = lambda ck=ck: -z(
                np.nanmean(np.stack([nearest(st) for st in ck]), 0), bands)
    c["unit ref, last"] = lambda: -mean_cos([last], "unit")
    c["z in kind, last"] = lambda: -z(mean_cos([last]), kind)
    c["z in kind x lang, last"] = lambda: -z(mean_cos([last]), kind_lang)
    c["z in kind x lang x band (filter strata), last"] = lambda: -z(mean_cos([last]), bands)
    if {150, 300} <= have:
        c["z in kind, mean 150/300"] = lambda: -z(mean_cos([150, 300]), kind)
        c["z in kind x lang, mean 150/300"] = lambda: -z(mean_cos([150, 300]), kind_lang)
    if {100, 200, 300} <= have:
        c["z in kind, mean 100/200/300"] = lambda: -z(mean_cos([100, 200, 300]), kind)
        c["z in kind x lang, mean 100/200/300"] = lambda: -z(mean_cos([100, 200, 300]), kind_lang)
    c["z in kind x lang, mean of all dumped"] = lambda: -z(mean_cos(steps), kind_lang)
    c["per-group cosines, median, last"] = lambda: -np.nanmedian(group_cosines(s), 1)
    c["per-group cosines, mean, last"] = lambda: -np.nanmean(group_cosines(s), 1)
    c["per-group cosines, z-mean in kind x lang, last"] = lambda: -np.nanmean(
        np.stack([z(col, kind_lang) for col in group_cosines(s).T], 1), 1)
    c["rank avg: raw last + |loss z|"] = lambda: _rank(-mean_cos([last])) + _rank(np.abs(loss_z()))
    c["rank avg: raw last + grad norm z"] = lambda: _rank(-mean_cos([last])) + _rank(norm_z())
    c["rank avg: raw last + |loss z| + grad norm z"] = lambda: 2 * _rank(-mean_cos([last])) + _rank(np.abs(loss_z())) + _rank(norm_z())
    # The union of the two one-sided tests the filter cascades (alignment low, loss high), both as
    # robust z within the filter's strata, and Stouffer's sum of the two.
    for label, ck in (("last", [last]), ("mean 150/300", [150, 300]), ("mean 100/200/300", [100, 200, 300]),
                      ("mean of all dumped", steps)):
        if not set(ck) <= have:
            continue
        c[f"max(-align z, loss z), {label}"] = lambda ck=ck: np.fmax(-z(mean_cos(ck), bands), loss_z())
        c[f"Stouffer -align z + loss z, {label}"] = lambda ck=ck: -z(mean_cos(ck), bands) + loss_z()
    c["loss z (high), last"] = loss_z
    c["|loss z|, last"] = lambda: np.abs(loss_z())
    c["grad norm z, last"] = norm_z
    out = {}
    for name, fn in c.items():
        if names and name not in names:
            continue
        out[name] = round(auc(fn()[judged], bad[judged]), 4)
    print(f"{bench}: steps {steps}, judged {judged.sum()} ({(judged & bad).sum()} planted)")
    print("| candidate | AUC |\n|---|---|")
    for name, v in out.items():
        print(f"| {name} | {v:.4f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("dump", "table"))
    parser.add_argument("--bench", type=Path, required=True)
    parser.add_argument("--checkpoints", default="150,300", help="comma-separated checkpoint steps")
    parser.add_argument("--rows", type=int, default=4, help="rows per document (score.max_rows)")
    parser.add_argument("--reference", default=BENCH_REFERENCE, help="score.reference as source=share,...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--candidates", default=None, help="|-separated candidate names (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    steps = [int(x) for x in args.checkpoints.split(",")]
    if args.what == "dump":
        dump(args.bench, steps, args.rows, args.reference, args.threads)
    else:
        result = table(args.bench, steps, args.candidates.split("|") if args.candidates else None)
        if args.json:
            args.json.write_text(json.dumps({"bench": str(args.bench), "steps": steps, "auc": result}, indent=1))


if __name__ == "__main__":
    main()
