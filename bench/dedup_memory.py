"""Benchmark: measured memory of MinHash signatures and LSH for N documents, against the formula.

    .venv/bin/python bench/dedup_memory.py [--docs 1000000] [--workers 1,2]

`filters.minhash.lsh_bytes_per_doc` states the LSH stage's memory per
document from its arrays' sizes (signature 448 B, band keys, sort order).
This measures what the code path really holds, each phase in a fresh
subprocess:

1. signatures: N synthetic short documents (20-80 words from a 5,000-word
   vocabulary, 5% of them lightly edited copies of others, so that LSH
   finds pairs) as one Arrow string array, then `filters.minhash.signatures`
   over batches of `io.batch_rows` rows and one concatenation, as
   `assay.stages.dedup.scan_shard` and `gather` do;
2. LSH: the signatures (loaded from the file phase 1 wrote) in a
   `Corpus`, then every band's candidate pairs through
   `assay.stages.dedup.band_pairs` and the clusters through `near_step`,
   with 1 worker, and with `flow.max_workers` threads at once as the Prefect
   thread runner runs the band tasks. The same with the band function of
   before this change ("before": it copied every alive row's whole
   signature and built a (n, 112) bool temporary in every band).

Peak memory is the kernel's high-water mark of resident memory (VmHWM),
reset through /proc/self/clear_refs right after the inputs are built, so a
phase's figure is its peak over what was resident when it started; numpy's
own allocations are also traced with tracemalloc (peak of the traced bytes
over the same start). Per-document figures divide by N. Parameters are the built-in defaults
(`assay.config.Params()`: FineWeb's 14 x 8, batches of 1,024 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


class Phase:
    """Peak RSS and peak traced (numpy) bytes over the state at entry."""

    def __enter__(self):
        import ctypes
        import gc
        import tracemalloc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the phase's growth shows in RSS
        _reset_peak()
        self.rss0 = _status("VmRSS")
        tracemalloc.start()
        self.traced0 = tracemalloc.get_traced_memory()[0]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import tracemalloc

        self.seconds = time.perf_counter() - self.t0
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.peak_rss = _status("VmHWM") - self.rss0
        self.held_rss = _status("VmRSS") - self.rss0
        self.peak_traced = peak - self.traced0
        self.held_traced = current - self.traced0
        return False


def synthetic_texts(n: int, seed: int = 0):
    """n short documents: 20-80 words drawn uniformly from a 5,000-word vocabulary; 5% are copies of others
    with one word changed (so LSH has pairs to find, and distinct documents share almost no 5-gram)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    # Letters only: the shingler folds every digit run to "0", so "w0123" and "w0456" would be one word.
    vocab = np.array(["".join(chr(97 + (i // 26**k) % 26) for k in range(3)) for i in range(5000)], dtype=object)
    lengths = rng.integers(20, 81, size=n)
    words = vocab[rng.integers(len(vocab), size=int(lengths.sum()))]
    ends = np.cumsum(lengths)
    texts = [" ".join(words[e - k : e]) for e, k in zip(ends.tolist(), lengths.tolist())]
    copies = rng.choice(n, size=n // 20, replace=False)
    sources = rng.integers(0, n, size=len(copies))
    for c, s in zip(copies.tolist(), sources.tolist()):
        w = texts[s].split(" ")
        w[rng.integers(len(w))] = "edited"
        texts[c] = " ".join(w)
    return pa.array(texts, pa.large_string())


def _before_band_pairs(corpus, alive, band, params):
    """assay.stages.dedup.band_pairs as it was: whole signatures of the alive rows copied, per band."""
    import numpy as np

    from filters.minhash import band_buckets, candidate_pairs_for_band, has_shingles

    rows = np.flatnonzero(alive & has_shingles(corpus.signatures))
    return candidate_pairs_for_band(rows, band_buckets(corpus.signatures[rows], band, params.minhash))


def phase_generate(n: int, text_file: str) -> dict:
    """Writes the documents to an Arrow file, so the measuring process reads them without Python garbage."""
    import pyarrow as pa

    texts = synthetic_texts(n)
    with pa.OSFile(text_file, "wb") as sink, pa.ipc.new_file(sink, pa.schema([("text", pa.large_string())])) as w:
        w.write_table(pa.table({"text": texts}))
    return {"phase": "generate", "docs": n, "text_bytes": int(texts.nbytes)}


def _before_gather(scans):
    """The signatures part of assay.stages.dedup.gather as it was: concatenated, the scans' arrays kept."""
    import numpy as np

    return np.concatenate([s.signatures for s in scans])


def phase_signatures(text_file: str, sig_file: str, shard_docs: int, variant: str) -> dict:
    """Signatures as the stage computes and gathers them: per shard, batches of io.batch_rows rows concatenated
    (scan_shard), then every shard's concatenated (gather), while the caller still holds its scans."""
    import numpy as np
    import pyarrow as pa

    from assay.config import Params
    from assay.stages import dedup as stage
    from filters import minhash

    params = Params()
    with pa.OSFile(text_file, "rb") as source:  # read into memory (not mapped): resident before the phase starts
        texts = pa.ipc.open_file(source).read_all().column("text").combine_chunks()
    n = len(texts)
    minhash.signatures(texts.slice(0, 100), params.dedup.minhash)  # warm: RE2 classes, caches
    batch = params.io.batch_rows
    with Phase() as ph:
        scans = []
        for start in range(0, n, shard_docs):
            shard = texts.slice(start, min(shard_docs, n - start))
            parts = [minhash.signatures(shard.slice(i, batch), params.dedup.minhash) for i in range(0, len(shard), batch)]
            scans.append(stage.ShardScan([], [], [], [], [], np.zeros(0), np.zeros(0, np.uint64), np.concatenate(parts)))
            del parts
        sig = stage.gather(scans).signatures if variant == "now" else _before_gather(scans)
    np.save(sig_file, sig)
    return {"phase": "signatures", "variant": variant, "docs": n, "shards": len(scans),
            "text_bytes": int(texts.nbytes), "seconds": ph.seconds,
            "peak_rss": ph.peak_rss, "held_rss": ph.held_rss, "peak_traced": ph.peak_traced,
            "held_traced": ph.held_traced, "nbytes": int(sig.nbytes)}


def phase_lsh(sig_file: str, workers: int, variant: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from assay.config import Params
    from assay.stages import dedup as stage

    params = Params().dedup
    sig = np.load(sig_file)
    n = len(sig)
    corpus = stage.Corpus(ids=np.array([f"{i:08d}" for i in range(n)], dtype=object), kinds=None, sources=None,
                          langs=None, paths=None, quality=np.full(n, np.nan), hashes=None, signatures=sig,
                          shard_of=np.zeros(n, dtype=np.int64))
    alive = np.ones(n, dtype=bool)
    fn = stage.band_pairs if variant == "now" else _before_band_pairs
    with Phase() as ph:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            pairs = list(pool.map(lambda b: fn(corpus, alive, b, params), range(params.minhash.bands)))
    pair_bytes = sum(p.nbytes for p in pairs)
    with Phase() as uf:
        kept = stage.near_step(corpus, alive, pairs)
    return {"phase": "lsh", "variant": variant, "workers": workers, "docs": n, "seconds": ph.seconds,
            "peak_rss": ph.peak_rss, "held_rss": ph.held_rss, "peak_traced": ph.peak_traced,
            "pairs": int(sum(len(p) for p in pairs)), "pair_bytes": int(pair_bytes),
            "union_find_peak_rss": uf.peak_rss, "union_find_peak_traced": uf.peak_traced,
            "dropped": int((kept != np.arange(n)).sum())}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--shard-docs", type=int, default=100_000, help="documents per input shard")
    parser.add_argument("--workers", default="1,2", help="band tasks at once (the thread runner's max_workers is 2)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = (phase_generate(int(rest[0]), rest[1]) if kind == "generate"
                  else phase_signatures(rest[0], rest[1], int(rest[2]), rest[3]) if kind == "signatures"
                  else phase_lsh(rest[0], int(rest[1]), rest[2]))
        print(json.dumps(result))
        return

    from assay.config import Params
    from filters.minhash import lsh_bytes_per_doc

    params = Params().dedup.minhash
    formula = lsh_bytes_per_doc(params)
    n = args.docs
    with tempfile.TemporaryDirectory() as tmp:
        sig_file, text_file = str(Path(tmp) / "sig.npy"), str(Path(tmp) / "texts.arrow")
        _child(["generate", str(n), text_file])
        sigs = [_child(["signatures", text_file, sig_file, str(args.shard_docs), v]) for v in ("before", "now")]
        s = sigs[-1]
        lsh = [_child(["lsh", sig_file, str(w), v]) for v in ("before", "now") for w in map(int, args.workers.split(","))]
    print(json.dumps({"signatures": sigs, "lsh": lsh}))
    mib = 2**20
    print(f"{n:,} synthetic documents ({s['text_bytes'] / mib:.0f} MiB of text); {params.bands} bands x "
          f"{params.rows} rows; peaks over the memory resident when each phase began.\n")
    print("| phase | workers | seconds | peak RSS MiB | B/doc | peak numpy (tracemalloc) B/doc | held after B/doc | "
          "formula B/doc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in sigs:
        print(f"| signatures ({s['variant']}): {s['shards']} shards, batches of {Params().io.batch_rows}, "
              f"concatenated per shard, then gathered | 1 | {s['seconds']:.1f} | {s['peak_rss'] / mib:.0f} | "
              f"{s['peak_rss'] / n:.0f} | {s['peak_traced'] / n:.0f} | {s['held_traced'] / n:.0f} "
              f"(array: {s['nbytes'] / n:.0f}) | {formula['signature']} |")
    for r in lsh:
        extra = r["peak_rss"] / n
        print(f"| LSH, 14 bands + union-find ({r['variant']}) | {r['workers']} | {r['seconds']:.1f} | "
              f"{r['peak_rss'] / mib:.0f} | {extra:.0f} + 448 signature = {extra + formula['signature']:.0f} | "
              f"{r['peak_traced'] / n:.0f} + 448 | pairs {r['pair_bytes'] / n:.0f} ({r['pairs']:,} pairs) | "
              f"{formula['signature']} + {formula['band_task']} x {r['workers']} = "
              f"{formula['signature'] + formula['band_task'] * r['workers']} |")
    print(f"\nunion-find and keep rule (near_step), after the bands: peak {lsh[-1]['union_find_peak_rss'] / n:.0f} B/doc RSS, "
          f"{lsh[-1]['union_find_peak_traced'] / n:.0f} B/doc numpy; near duplicates dropped: {lsh[-1]['dropped']:,}.")


if __name__ == "__main__":
    main()
