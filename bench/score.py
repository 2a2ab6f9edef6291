"""The scoring pass (`assay score`) at demo size, and its alignment against the naive baseline.

    python bench/score.py [--data DIR] [--run RUN] [--docs 1000] [--steps 30] [--threads 2] [--naive-batches 6]

1. A corpus: ``--data`` (e.g. a demo's data/dedup), or about ``--docs`` real documents built
   here: standard-library modules (code, source ``python-stdlib``) and their docstrings
   (text; a third under the demo's reference source ``pydoc-topics``, the rest ``pypi-description``).
2. A run: ``--run`` (e.g. runs/round-0), or the params.yaml model (train section) trained
   ``--steps`` steps on the corpus.
3. The whole pass, ``score_dataset`` with params.yaml's ``score`` section: wall time, documents/s
   and tokens/s (the reference gradient and tokenization included).
4. Side by side, alternating on the same batches (the pass's own length batches of judged
   documents, the first ``--naive-batches``): the one-backward alignment
   (training.alignment, no weight gradients) against the naive way to the same cosines
   (each document alone: forward, backward of its own loss, its full gradient flattened and
   dotted with G), and a plain forward + backward of the batch for scale. Documents/s,
   tokens/s (CPU time, which other jobs on a shared machine do not inflate, and wall time)
   and the largest cosine difference.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assay.config import load_params  # noqa: E402
from assay.schema import DOCUMENT_SCHEMA, document_id  # noqa: E402
from assay.shards import ShardWriter  # noqa: E402
from assay.versions import open_version  # noqa: E402
from training.alignment import References, per_document_alignment  # noqa: E402
from training.grad_norms import token_losses  # noqa: E402
from training.score import (  # noqa: E402
    _batch,
    _iter_texts,
    _length_batches,
    _read_docs,
    _reference_gradients,
    _resolve_checkpoints,
    _rows_for,
    load_model,
    score_dataset,
)
from training.tokenizer import load_tokenizer  # noqa: E402
from training.trainer import train  # noqa: E402


def build_corpus(directory: Path, n_docs: int) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"))
    rows = []
    for f in files:
        if len(rows) >= n_docs:
            break
        if "test" in f.parts or "tests" in f.parts:
            continue
        src = f.read_text(encoding="utf-8", errors="replace")
        if len(src) < 200:
            continue
        loc = f.relative_to(root).as_posix()
        rows.append(("python-stdlib", loc, src, "code", "python"))
        try:
            doc = ast.get_docstring(ast.parse(src)) or ""
        except (SyntaxError, ValueError):
            doc = ""
        if len(doc) > 300:
            source = "pydoc-topics" if len(rows) % 3 == 0 else "pypi-description"
            rows.append((source, loc, doc, "text", "en"))
    cols = {"id": [document_id(s, loc) for s, loc, *_ in rows], "text": [r[2] for r in rows],
            "kind": [r[3] for r in rows], "lang": [r[4] for r in rows], "source": [r[0] for r in rows],
            "path": [r[1] for r in rows], "meta": ["{}"] * len(rows)}
    with ShardWriter(directory, DOCUMENT_SCHEMA) as writer:
        writer.write(pa.Table.from_pydict(cols, schema=DOCUMENT_SCHEMA))
    return directory


def naive(model, rows, indices, doc_reference, flat_refs, device):
    """Each document alone: forward, backward of its own loss, full gradient . G."""
    out = []
    params = [p for p in model.parameters() if p.requires_grad]
    for d in np.unique(rows.doc[indices]):
        mine = indices[rows.doc[indices] == d]
        b = _batch(rows, mine, device)
        model.zero_grad(set_to_none=True)
        loss = token_losses(model(b.tokens), b.targets, b.loss_mask).sum() / b.loss_mask.sum()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params]).double()  # fp64: 2M-term sums
        ref = flat_refs[doc_reference[int(d)]]
        out.append(float(flat @ ref / (flat.norm() * ref.norm())))
    model.zero_grad(set_to_none=True)
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-batches", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="Reuses the corpus and run an earlier call left there.")
    ap.add_argument("--no-pass", action="store_true", help="Only the side-by-side comparison.")
    ap.add_argument("--no-side", action="store_true", help="Only the whole pass.")
    ap.add_argument("--by-length", action="store_true",
                    help="Only: one backward vs the naive loop on synthetic batches of each document length "
                         "(the params.yaml model, random init, random tokens).")
    ap.add_argument("--reference-grads", type=Path,
                    help="Side by side: reference gradients saved by an earlier pass (OUT/.reference/step-N.pt, "
                         "kept until a pass completes) instead of computing them again.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.by_length:
        by_length(load_params().train, args.reps)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-score-"))
    params = load_params()
    device = torch.device("cpu")

    data = args.data or (work / "data" if any((work / "data").glob("part-*.parquet")) else
                         build_corpus(work / "data", args.docs))
    run = args.run
    if run is None and (work / "run" / "metrics.json").is_file():
        run = work / "run"  # trained by an earlier invocation with this --work
    if run is None:
        run = work / "run"
        t = time.perf_counter()
        train(open_version(data), run, dataclasses.replace(params.train, steps=args.steps, device="cpu",
                                                            checkpoint_every=args.steps),
              overwrite=True, progress=False)
        print(f"trained {args.steps} steps in {time.perf_counter() - t:.0f} s")
    score = dataclasses.replace(params.score, device="cpu")
    if args.data is None:  # the built corpus's reference sources
        score = dataclasses.replace(score, reference={"pydoc-topics": 1.0, "python-stdlib": 0.3})

    if not args.no_pass:
        whole_pass(run, data, work, score, args.threads)
    if not args.no_side:
        side_by_side(run, data, score, args.naive_batches, args.reps, device, args.reference_grads)


def by_length(train_params, reps: int) -> None:
    """Where batching pays: many short documents per batch, or a few long ones."""
    from training.model import ModelArgs, Transformer

    vocab = train_params.vocab_size
    model = Transformer(ModelArgs(vocab_size=vocab, max_seq_len=train_params.seq_len,
                                  **dataclasses.asdict(train_params.model)))
    model.init_weights(0)
    g = torch.Generator().manual_seed(0)
    ref = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    references = References([ref])
    flat_ref = torch.cat([ref[n].reshape(-1) for n, _ in model.named_parameters()]).double()
    params = list(model.parameters())
    print("| documents x rows x tokens | one backward docs/CPU-s | naive docs/CPU-s | naive time / one backward |"
          " max abs cosine difference |")
    print("|---|---|---|---|---|")
    for n_rows, width, rows_per_doc in ((64, 64, 1), (32, 128, 1), (16, 256, 1), (16, 256, 4)):
        tokens = torch.randint(0, vocab, (n_rows, width), generator=g)
        targets = torch.randint(0, vocab, (n_rows, width), generator=g)
        mask = torch.ones(n_rows, width, dtype=torch.bool)
        doc_index = torch.arange(n_rows) // rows_per_doc
        n_docs = n_rows // rows_per_doc

        def fast():
            return per_document_alignment(model, tokens, targets, mask, doc_index, n_docs, references,
                                          weight_grads=False).alignment.double()

        def slow():
            out = []
            for d in range(n_docs):
                mine = doc_index == d
                model.zero_grad(set_to_none=True)
                (token_losses(model(tokens[mine]), targets[mine], mask[mine]).sum() / mask[mine].sum()).backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params]).double()
                out.append(float(flat @ flat_ref / (flat.norm() * flat_ref.norm())))
            model.zero_grad(set_to_none=True)
            return torch.tensor(out, dtype=torch.float64)

        best, result = {}, {}
        for _ in range(reps):
            for name, fn in (("fast", fast), ("slow", slow)):
                c0 = time.process_time()
                result[name] = fn()
                best[name] = min(best.get(name, 1e9), time.process_time() - c0)
        diff = float((result["fast"] - result["slow"]).abs().max())
        print(f"| {n_docs} x {rows_per_doc} x {width} | {n_docs / best['fast']:.1f} | {n_docs / best['slow']:.1f} | "
              f"{best['slow'] / best['fast']:.2f}x | {diff:.1e} |")


def whole_pass(run: Path, data: Path, work: Path, score, threads: int) -> None:
    t, c0 = time.perf_counter(), time.process_time()
    manifest = score_dataset(run, data, work / "scores", score, overwrite=True, progress=False)
    wall, cpu_s = time.perf_counter() - t, time.process_time() - c0
    c, tm = manifest["counts"], manifest["timings"]
    print(f"\nwhole pass: {c['documents']} documents ({c['reference']} reference), {tm['tokens_scored']:,} tokens "
          f"scored (at most {score.max_rows} rows each; {c['capped_rows']} documents capped); {wall:.1f} s wall "
          f"({c['rows'] / wall:.2f} docs/s, {tm['tokens_scored'] / wall:,.0f} tokens/s), {cpu_s:.1f} s CPU time "
          f"({c['rows'] / cpu_s:.2f} docs/CPU-s, {tm['tokens_scored'] / cpu_s:,.0f} tokens/CPU-s), {threads} threads")
    ref_tokens = 0
    for by in manifest["strata"]["by_step"].values():  # "all" spans the others: count it only alone
        strata = by["strata"]
        ref_tokens += sum(v["reference_tokens"] for k, v in strata.items() if k != "all" or len(strata) == 1)
    print(f"  of which the reference gradients ({ref_tokens:,} tokens, plain forward + backward): "
          f"{tm['reference_seconds']:.1f} s wall, {tm['reference_cpu_seconds']:.1f} s CPU "
          f"(when computed; a resumed pass reuses them)")


def side_by_side(run: Path, data: Path, score, naive_batches: int, reps: int, device: torch.device,
                 reference_grads: Path | None = None) -> None:
    """The pass's own batches, alternating the one-backward alignment, the naive loop and a plain step."""
    version = open_version(data)
    docs = _read_docs(version, score)
    (ck,) = _resolve_checkpoints(run, ["last"])
    tokenizer = load_tokenizer(run)
    seq_len, precision = int(ck.state["seq_len"]), ck.state.get("precision", "fp32")
    model = load_model(ck.path, ck.state, tokenizer.get_vocab_size(), device)
    if reference_grads is not None:
        grads = torch.load(reference_grads, weights_only=True)
    else:
        ref_rows = _rows_for(list(_iter_texts(version, lambda p: bool(docs.reference[p]))), tokenizer, seq_len,
                             score.max_rows)
        grads, _ = _reference_gradients(model, ref_rows, docs, score, precision, device)
    strata = sorted(set(docs.stratum))
    references = References([grads[s] for s in strata])
    flat_refs = [torch.cat([grads[s][n].reshape(-1) for n, p in model.named_parameters() if p.requires_grad]).double()
                 for s in strata]
    judged = _rows_for(list(_iter_texts(version, lambda p: not docs.reference[p])), tokenizer, seq_len,
                       score.max_rows)
    batches = _length_batches(judged.rows, score.batch_tokens)
    # Spread the sample over the length range: long, middle and short batches.
    pick = np.unique(np.linspace(0, len(batches) - 1, naive_batches).round().astype(int))
    sample = [batches[i] for i in pick]
    stratum_of = {j: strata.index(docs.stratum[p]) for j, p in enumerate(judged.pos)}
    n_docs = sum(len(np.unique(judged.rows.doc[b])) for b in sample)
    n_tokens = sum(_batch(judged.rows, b, device).n_tokens for b in sample)

    def fast() -> np.ndarray:
        out = []
        for b in sample:
            batch = _batch(judged.rows, b, device)
            local = np.unique(judged.rows.doc[b])
            dr = torch.tensor([stratum_of[int(d)] for d in local])
            stats = per_document_alignment(model, batch.tokens, batch.targets, batch.loss_mask, batch.doc_index,
                                           len(local), references, dr, weight_grads=False)
            out.append(stats.alignment.numpy())
        return np.concatenate(out)

    def slow() -> np.ndarray:
        return np.concatenate([naive(model, judged.rows, b, stratum_of, flat_refs, device) for b in sample])

    def plain() -> None:
        for b in sample:
            batch = _batch(judged.rows, b, device)
            model.zero_grad(set_to_none=True)
            (token_losses(model(batch.tokens), batch.targets, batch.loss_mask).sum() / batch.n_tokens).backward()
        model.zero_grad(set_to_none=True)

    cpu = {"one backward (alignment)": [], "naive (a backward per document)": [], "plain forward+backward": []}
    wall_t = {k: [] for k in cpu}
    result = {}
    for _ in range(reps):
        for name, fn in zip(cpu, (fast, slow, plain)):
            c0, w0 = time.process_time(), time.perf_counter()
            result[name] = fn()
            cpu[name].append(time.process_time() - c0)
            wall_t[name].append(time.perf_counter() - w0)
    diff = np.abs(result["one backward (alignment)"] - result["naive (a backward per document)"]).max()
    print(f"\nside by side: {len(sample)} batches, {n_docs} documents, {n_tokens:,} tokens; best of {reps}")
    print("| method | docs/s (CPU) | tokens/s (CPU) | docs/s (wall) | CPU time vs one backward |")
    print("|---|---|---|---|---|")
    base = min(cpu["one backward (alignment)"])
    for name in cpu:
        c_, w_ = min(cpu[name]), min(wall_t[name])
        print(f"| {name} | {n_docs / c_:.1f} | {n_tokens / c_:,.0f} | {n_docs / w_:.1f} | {c_ / base:.2f}x |")
    print(f"\nlargest |cosine difference|, one backward vs naive: {diff:.2e}")


if __name__ == "__main__":
    main()
