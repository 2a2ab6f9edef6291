"""Order sensitivity: does a document's loss rise when its words are shuffled? A candidate tier-2 signal for
the planted kind gradient alignment misses (word-shuffled text), measured against alignment and combined with it.

    .venv/bin/python bench/order_sensitivity.py --bench /tmp/rho/s0 [--bench /tmp/rho/s1 ...] [--rows 4]

Each --bench is a `bench/planted.py --out DIR --rho-loss` run: its corpus, round 0's last checkpoint and the
scoring pass's rows (`scores-rho`, else `scores`). For every judged document (the pass's rows at the last
checkpoint that are not in the reference set), over its first --rows rows as the pass cuts them:

- `loss`: the checkpoint's mean token loss on the document;
- `word`: the same on the document with its whitespace-separated words shuffled across it (line lengths kept),
  and `token`: with each row's tokens shuffled; the signal is the relative rise, (shuffled - loss) / loss.
  Language needs its order, so real text rises; text that is already a bag of words does not.

Printed: the AUC of planted vs real (higher = planted ranked lower) of the pass's alignment as a robust z within
kind (the filter's reading), of each rise as a z within kind, and of their one-sided combination
max(-alignment z, -rise z); per planted kind, alignment against the word rise against the combination.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from assay.planted import PLANTED_KINDS, auc, planted_kind, shuffle_words  # noqa: E402
from filters.dynamic import robust_z  # noqa: E402


def shuffle_tokens(tokens: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each row's real tokens in a random order (padding left in place)."""
    out = tokens.copy()
    for r, n in enumerate(lengths):
        out[r, :n] = tokens[r, :n][rng.permutation(int(n))]
    return out


def document_losses(model, scored, n_docs: int, tokens: np.ndarray | None = None) -> np.ndarray:
    """Mean token loss per document over its scored rows (``tokens``: other tokens for the same rows)."""
    import torch

    from training.data import TokenRows, make_batch
    from training.grad_norms import token_losses

    rows = scored.rows if tokens is None else TokenRows(tokens, scored.rows.lengths, scored.rows.doc,
                                                         scored.rows.doc_ids, scored.rows.pad_id)
    total, count = np.zeros(n_docs), np.zeros(n_docs)
    with torch.no_grad():
        for start in range(0, len(rows.tokens), 64):
            idx = np.arange(start, min(start + 64, len(rows.tokens)))
            batch = make_batch(rows, idx)
            loss = token_losses(model(batch.tokens), batch.targets, batch.loss_mask)
            docs = scored.pos[rows.doc[idx]]
            np.add.at(total, docs, (loss * batch.loss_mask).sum(1).numpy())
            np.add.at(count, docs, batch.loss_mask.sum(1).numpy())
    return total / np.maximum(count, 1)


def measure(bench: Path, rows: int, seed: int) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    from assay.shards import list_shards
    from training.checkpoint import CHECKPOINTS, read_trainer_state
    from training.score import _rows_for, _train_params, load_model
    from training.tokenizer import load_tokenizer

    scores_dir = bench / "scores-rho" if (bench / "scores-rho").exists() else bench / "scores"
    scores = pa.concat_tables([pq.read_table(p) for p in list_shards(scores_dir)])
    last = pc.max(scores.column("step")).as_py()
    at_last = scores.filter(pc.equal(scores.column("step"), last)).to_pydict()
    judged = {i: (a, k) for i, a, k, r in zip(at_last["sample_id"], at_last["alignment"], at_last["kind"],
                                               at_last["reference"]) if not r}
    corpus = pa.concat_tables([pq.read_table(p, columns=["id", "text"]) for p in list_shards(bench / "corpus")])
    text = dict(zip(corpus.column("id").to_pylist(), corpus.column("text").to_pylist()))
    ids = sorted(judged)
    checkpoint = bench / "round-0" / CHECKPOINTS / f"step-{last:08d}"
    state = read_trainer_state(checkpoint)
    tokenizer = load_tokenizer(bench / "round-0")
    model = load_model(checkpoint, state, tokenizer.get_vocab_size(), torch.device("cpu"))
    seq_len = _train_params(state).seq_len

    scored = _rows_for([(p, text[i]) for p, i in enumerate(ids)], tokenizer, seq_len, rows)
    loss = document_losses(model, scored, len(ids))
    token = document_losses(model, scored, len(ids),
                            shuffle_tokens(scored.rows.tokens, scored.rows.lengths, np.random.default_rng(seed)))
    rng = random.Random(seed)
    words = _rows_for([(p, shuffle_words(text[i], rng)) for p, i in enumerate(ids)], tokenizer, seq_len, rows)
    word = document_losses(model, words, len(ids))

    planted = np.array([planted_kind(i) is not None for i in ids])
    kind = np.array([judged[i][1] for i in ids], dtype=object)
    everyone = np.ones(len(ids), dtype=bool)
    z_align = robust_z(np.array([judged[i][0] for i in ids]), kind, everyone)
    z_word = robust_z((word - loss) / np.maximum(loss, 1e-6), kind, everyone)
    z_token = robust_z((token - loss) / np.maximum(loss, 1e-6), kind, everyone)
    per_kind = {}
    for k in PLANTED_KINDS:
        m = np.array([planted_kind(i) in (k, None) for i in ids])
        per_kind[k] = tuple(auc(s[m], planted[m]) for s in (-z_align, -z_word, np.maximum(-z_align, -z_word)))
    return {"judged": len(ids), "planted": int(planted.sum()), "step": last,
            "alignment z": auc(-z_align, planted), "word rise z": auc(-z_word, planted),
            "token rise z": auc(-z_token, planted),
            "max(-alignment z, -word rise z)": auc(np.maximum(-z_align, -z_word), planted),
            "max(-alignment z, -token rise z)": auc(np.maximum(-z_align, -z_token), planted),
            "per_kind": per_kind}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="append", type=Path, required=True,
                    help="a bench/planted.py output directory (repeat for several draws)")
    ap.add_argument("--rows", type=int, default=4, help="rows per document, as the scoring pass's max_rows")
    ap.add_argument("--seed", type=int, default=1234, help="the shuffles' seed")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for bench in args.bench:
        result = measure(bench, args.rows, args.seed)
        print(f"{bench}: {result['judged']} judged ({result['planted']} planted), step {result['step']}")
        for name, value in result.items():
            if isinstance(value, float):
                print(f"  {name:<36} AUC {value:.3f}")
        print(f"  {'per planted kind':<36} alignment z / word rise z / max")
        for k, (a, w, m) in result["per_kind"].items():
            print(f"    {k:<34} {a:.3f} / {w:.3f} / {m:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
