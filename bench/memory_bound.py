"""Benchmark: measured peak memory of ingest, static, domain and dedup on a generated corpus.

    .venv/bin/python bench/memory_bound.py stream --gb 2 [--models DIR] [--work /tmp/memory-bench]
    .venv/bin/python bench/memory_bound.py stream --reuse KEPT_DIR --stages static [--env MALLOC_...=N]
    .venv/bin/python bench/memory_bound.py dedup --docs 250000,1000000 [--words 20-80,200-320]

`stream` generates a JSONL corpus of about `--gb` GB (deterministic: seeded),
then runs `assay ingest`, `assay run static` and `assay run domain` on it, one
after the other, each in a fresh Python process through the real CLI with
the project's params.yaml (only the model paths point at `--models`). Per
stage it prints the process's peak resident memory, the kernel's high-water
mark VmHWM read from /proc/self/status as the stage's process ends (not
ru_maxrss, which Linux carries across exec), with documents, bytes and
seconds. The Prefect API is one temporary server started here for all of
them (a separate process, not counted), so a stage's figure is its own
flow, tasks (threads) and models.

The corpus is prose and Python, each document's size drawn log-uniform:
97% between 20 KB and 400 KB, 3% between 400 KB and 5 MB (the "huge"
records: the biggest are over Gopher's 100,000 words and The Stack's
100,000 lines). Prose is sentences of pseudo-words and stop words,
in paragraphs; code is modules of generated functions and classes that
parse. The quality head and the domain model read only each document's
first tokens, so a corpus of fewer, larger documents keeps the 2 GB run to
tens of minutes on 2 cores; the heuristics, rules and parsers read all of
every document.

`dedup` writes N short documents (bench/dedup_memory.py's generator: words
from a 5,000-word vocabulary, 5% near copies) straight into a dataset of
shards (the shape static writes, with an `embeddings/` stream of random unit
vectors, so SemDeDup and the graph run as on real data; the encoder is not
what is measured) and runs `assay run dedup` on it the same way. With
documents of two lengths at the same count it shows whether dedup's peak
follows documents or bytes.

`--models DIR` is a folder with `quality/` (the head) and `domain/` (the
domain model), as `make demo` leaves in models/. Without it the models are
trained first in the work folder with the project's params
(`assay ingest demo`, `quality train`, `run static`, `domain train`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASSAY_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}
MARK = "MEMORY-BOUND-RESULT "

# The stage's process runs the CLI in-process and reports its own high-water mark when the CLI returns.
# A sampler thread also keeps the resident size over time, to show where the peak is reached.
_CHILD = r"""
import json, sys, threading, time
def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
samples, heap, t0 = [], [], time.perf_counter()
# glibc's own account every 0.5 s: bytes in use (small chunks + mmapped) against free bytes its heaps keep, so a
# rise in RSS reads as kept objects (in use grows) or fragmentation (free grows); Arrow's pool apart.
from assay.allocator import large_requests_mmapped, mallinfo
def sample():
    n = 0
    while True:
        t = round(time.perf_counter() - t0, 1)
        samples.append((t, status("VmRSS")))
        m = mallinfo() if n % 2 == 0 else None
        if m is not None:
            # getattr: pyarrow may be half imported (in sys.modules, not yet its functions) while the stage starts
            arrow = getattr(sys.modules.get("pyarrow"), "total_allocated_bytes", lambda: 0)
            heap.append((t, m.uordblks + m.hblkhd, m.fordblks, m.arena, arrow()))
        n += 1
        time.sleep(0.25)
threading.Thread(target=sample, daemon=True).start()
from assay.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)
print("MEMORY-BOUND-RESULT " + json.dumps({"rc": code, "vmhwm": status("VmHWM"), "seconds": time.perf_counter() - t0,
                                           "cpu_seconds": usage.ru_utime + usage.ru_stime,
                                           "samples": samples, "heap": heap, "mmap_threshold_fixed": large_requests_mmapped()}),
      flush=True)
sys.exit(code)
"""


# --- the corpus ---------------------------------------------------------------------------------------

STOP = ["the", "of", "and", "to", "in", "that", "is", "with", "for", "as", "was", "on", "be", "have", "by", "it"]


def _vocabulary(rng: np.random.Generator, n: int) -> np.ndarray:
    """Pronounceable pseudo-words of 2-4 syllables (letters only, 4-11 characters)."""
    onsets = ["b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl", "gr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "n", "r", "s", "l", "t", "nd", "st"]
    words = set()
    while len(words) < n:
        k = int(rng.integers(2, 5))
        words.add("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                          + codas[rng.integers(len(codas))] for _ in range(k)))
    return np.array(sorted(words), dtype=object)


class Pools:
    """Sentences and Python functions that documents are assembled from, seeded."""

    def __init__(self, seed: int, sentences: int = 200_000, functions: int = 40_000):
        rng = np.random.default_rng(seed)
        vocab = _vocabulary(rng, 30_000)
        zipf = 1.0 / np.arange(1, len(vocab) + 1)
        zipf /= zipf.sum()
        lengths = rng.integers(8, 22, size=sentences)
        words = vocab[rng.choice(len(vocab), size=int(lengths.sum()), p=zipf)]
        stops = rng.random(len(words)) < 0.3  # about a third of running English is stop words
        words[stops] = np.array(STOP, dtype=object)[rng.integers(len(STOP), size=int(stops.sum()))]
        ends = np.cumsum(lengths)
        self.sentences = [" ".join(words[e - k:e]).capitalize() + "." for e, k in zip(ends.tolist(), lengths.tolist())]
        names = vocab[rng.integers(len(vocab), size=(functions, 5))]
        consts = rng.integers(2, 999, size=(functions, 3)).tolist()
        self.functions = [self._function(i, n.tolist(), c, self.sentences[i]) for i, (n, c) in
                          enumerate(zip(names, consts))]

    @staticmethod
    def _function(i: int, n: list[str], c: list[int], doc: str) -> str:
        f, a, b, v, w = n
        if i % 3 == 0:
            return (f"def {f}_{i}({a}, {b}=None):\n    \"\"\"{doc}\"\"\"\n    {v} = [{a} * {c[0]} for {a} in range({c[1]})]\n"
                    f"    if {b} is not None and len({v}) > {c[2]}:\n        {v}.append({b})\n    return sum({v}) - {c[2]}\n")
        if i % 3 == 1:
            return (f"class {f.capitalize()}{i}:\n    \"\"\"{doc}\"\"\"\n\n    def __init__(self, {a}):\n"
                    f"        self.{a} = {a}\n        self.{w} = {{}}\n\n    def {v}(self, {b}):\n"
                    f"        self.{w}[{b}] = self.{a} + {c[0]}\n        return self.{w}.get({b}, {c[1]})\n")
        return (f"def {f}_{i}({a}, {b}):\n    # {doc}\n    {v} = {a}\n    while {v} < {b}:\n        {v} += {c[0]}\n"
                f"        if {v} % {c[1]} == 0:\n            break\n    return {v}, {b} - {v}\n")

    def prose(self, rng: np.random.Generator, size: int) -> str:
        picks = rng.integers(len(self.sentences), size=size // 80 + 1).tolist()
        paragraphs, out, n = [], [], 0
        for j in picks:
            out.append(self.sentences[j])
            n += len(self.sentences[j]) + 1
            if len(out) >= 6 or n >= size:
                paragraphs.append(" ".join(out))
                out = []
            if n >= size:
                break
        if out:
            paragraphs.append(" ".join(out))
        return "\n\n".join(paragraphs)

    def code(self, rng: np.random.Generator, size: int) -> str:
        parts = ["import os\nimport sys\nfrom collections import defaultdict\n"]
        n = len(parts[0])
        for j in rng.integers(len(self.functions), size=size // 250 + 1).tolist():
            parts.append(self.functions[j])
            n += len(self.functions[j]) + 2
            if n >= size:
                break
        return "\n\n".join(parts)


def document_sizes(rng: np.random.Generator, total: int) -> list[int]:
    sizes, n = [], 0
    while n < total:
        low, high = (20e3, 400e3) if rng.random() < 0.97 else (400e3, 5e6)
        size = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        sizes.append(size)
        n += size
    return sizes


def generate_corpus(folder: Path, total_bytes: int, seed: int = 0, file_bytes: int = 256 * 2**20,
                    copies: int = 1) -> dict:
    """JSONL files of about `file_bytes` under `folder`, `total_bytes` of text in all (deterministic in the seed),
    then `copies - 1` more copies of them with other ids."""
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pools = Pools(seed)
    stats = {"docs": 0, "text_bytes": 0, "code_docs": 0, "huge_docs": 0, "largest": 0, "files": 0, "file_bytes": 0}
    handle, written = None, 0
    for i, size in enumerate(document_sizes(rng, total_bytes)):
        if handle is None or written >= file_bytes:
            if handle:
                handle.close()
            handle = open(folder / f"corpus-{stats['files']:04d}.jsonl", "w", encoding="utf-8")
            stats["files"] += 1
            written = 0
        code = rng.random() < 0.4
        text = pools.code(rng, size) if code else pools.prose(rng, size)
        line = json.dumps({"id": f"doc-{i:08d}", "text": text,
                           "path": f"src/pkg{i % 97}/mod_{i}.py" if code else f"notes/{i % 89}/page_{i}.txt"}) + "\n"
        handle.write(line)
        written += len(line)
        stats["file_bytes"] += len(line)
        stats["docs"] += 1
        stats["code_docs"] += code
        stats["text_bytes"] += len(text)
        stats["huge_docs"] += len(text) >= 400_000
        stats["largest"] = max(stats["largest"], len(text))
    if handle:
        handle.close()
    originals = sorted(folder.glob("corpus-*.jsonl"))
    for copy in range(1, copies):  # the same documents again under new ids: a longer corpus of the same windows
        for source in originals:
            with open(source, encoding="utf-8") as f, \
                    open(folder / f"{source.stem}-copy{copy}.jsonl", "w", encoding="utf-8") as out:
                for line in f:
                    record = json.loads(line)
                    record["id"] = f"{record['id']}-copy{copy}"
                    out.write(json.dumps(record) + "\n")
    for key in ("docs", "text_bytes", "code_docs", "huge_docs", "file_bytes", "files"):
        stats[key] *= copies
    stats["copies"] = copies
    stats["seconds"] = round(time.perf_counter() - started, 1)
    return stats


# --- running a stage ----------------------------------------------------------------------------------


def run_stage(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> dict:
    """`assay ARGS` in a fresh process; its peak VmHWM, seconds and resident-size samples."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"assay {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(MARK):])
    result["args"] = args
    return result


def stage_env(api_url: str | None) -> dict[str, str]:
    # The stages run in their own working folders, so a relative PYTHONPATH entry (bench/leak_mutation's
    # command) is made absolute here, where it was meant.
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, **ASSAY_ENV, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *inherited])}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def write_params(work: Path, models: Path, changes: dict | None = None, base: Path = ROOT / "params.yaml") -> Path:
    """The project's params with the model paths pointing at `models`, and `changes` (section -> {key: value})."""
    import yaml

    params = yaml.safe_load(base.read_text())
    params["static"]["head"] = str(models / "quality")
    params["domain"]["model"]["model"] = str(models / "domain")
    for section, values in (changes or {}).items():
        node = params
        for key in section.split("."):
            node = node[key]
        node.update(values)
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def train_models(work: Path, env: dict[str, str], params_file: Path, timeout: float) -> Path:
    """The head and the domain model, trained as dvc.yaml chains them (demo corpus, then static, then domain)."""
    models = work / "models"
    p = ["--params", str(params_file)]
    for args in (["ingest", "demo", "--out", "demo/raw", "--overwrite"],
                 ["quality", "train", "--data", "demo/raw", "--out", "models/quality"],
                 ["run", "static", "--in", "demo/raw", "--out", "demo/static", "--overwrite"],
                 ["domain", "train", "--data", "demo/static", "--out", "models/domain"]):
        proc = subprocess.run([str(Path(sys.executable).parent / "assay"), *p, *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"assay {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return models


def dataset_stats(folder: Path) -> dict:
    from assay.shards import list_shards, read_manifest

    import pyarrow.parquet as pq

    shards = list_shards(folder)
    rows = sum(pq.ParquetFile(s).metadata.num_rows for s in shards)
    text = 0
    for s in shards:
        meta = pq.ParquetFile(s).metadata
        col = meta.schema.to_arrow_schema().get_field_index("text")
        text += sum(meta.row_group(g).column(col).total_uncompressed_size for g in range(meta.num_row_groups))
    return {"docs": rows, "shards": len(shards), "bytes_on_disk": sum(s.stat().st_size for s in shards),
            "text_bytes_uncompressed": text, "manifest_counts": read_manifest(folder).get("counts")}


def stream(corpus_bytes: int, work: Path, models: Path, env: dict[str, str], timeout: float,
           stages: tuple[str, ...] = ("ingest", "static", "domain"), changes: dict | None = None,
           base: Path = ROOT / "params.yaml", seed: int = 0, copies: int = 1,
           file_bytes: int = 256 * 2**20, reuse: bool = False) -> dict:
    """Generate the corpus into `work`, run the stages; per stage its peak, documents, bytes and seconds.
    The stages read `base` (params.yaml) with the model paths set to `models` and `changes` applied.
    With `reuse`, `work` is a folder an earlier run kept: its corpus (and the outputs of stages not run
    again) are used as they are, so variants of one stage are measured on the same input."""
    work.mkdir(parents=True, exist_ok=True)
    if reuse:
        corpus = json.loads((work / "corpus.json").read_text())
    else:
        corpus = generate_corpus(work / "jsonl", corpus_bytes, seed, file_bytes, copies)
        (work / "corpus.json").write_text(json.dumps(corpus))
    params = write_params(work, models, changes, base)
    p = ["--params", str(params)]
    commands = {
        "ingest": ["ingest", *sorted(str(f) for f in (work / "jsonl").glob("*.jsonl")), "--out", str(work / "raw"), "--overwrite"],
        "static": ["run", "static", "--in", str(work / "raw"), "--out", str(work / "static"), "--overwrite"],
        "domain": ["run", "domain", "--in", str(work / "static"), "--out", str(work / "domain"), "--overwrite"],
    }
    inputs = {"ingest": None, "static": work / "raw", "domain": work / "static"}
    results = {"corpus": corpus, "stages": {}}
    for stage in stages:
        out = work / commands[stage][commands[stage].index("--out") + 1]
        if reuse:  # a finished output would be taken as it is (same fingerprint): the stage would not run
            shutil.rmtree(out, ignore_errors=True)
        r = run_stage([*p, *commands[stage]], work, env, timeout)
        r["in"] = dataset_stats(inputs[stage]) if inputs[stage] else {"docs": corpus["docs"],
                                                                        "bytes": corpus["file_bytes"]}
        r["out"] = dataset_stats(out)
        results["stages"][stage] = r
    return results


# --- dedup on many short documents ----------------------------------------------------------------------


def short_texts(n: int, words: tuple[int, int], seed: int = 0):
    """bench/dedup_memory.py's documents with `words` (low, high) words each: drawn from a 5,000-word
    vocabulary of letters only (the shingler folds digits), 5% of them copies of others with one word changed,
    so that LSH has pairs to find."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    vocab = np.array(["".join(chr(97 + (i // 26**k) % 26) for k in range(3)) for i in range(5000)], dtype=object)
    lengths = rng.integers(words[0], words[1] + 1, size=n)
    drawn = vocab[rng.integers(len(vocab), size=int(lengths.sum()))]
    ends = np.cumsum(lengths)
    texts = [" ".join(drawn[e - k:e]) for e, k in zip(ends.tolist(), lengths.tolist())]
    del drawn
    copies = rng.choice(n, size=n // 20, replace=False)
    for c, s in zip(copies.tolist(), rng.integers(0, n, size=len(copies)).tolist()):
        w = texts[s].split(" ")
        w[rng.integers(len(w))] = "edited"
        texts[c] = " ".join(w)
    return pa.array(texts, pa.large_string())


def dedup_dataset(folder: Path, n: int, words: tuple[int, int], shard_docs: int = 100_000, seed: int = 0,
                  dim: int = 384) -> dict:
    """N short documents in shards of `shard_docs` (documents and embeddings), as static leaves a dataset."""
    import pyarrow as pa

    from assay.schema import DOCUMENT_SCHEMA, embedding_schema
    from assay.shards import ShardWriter, write_manifest

    texts = short_texts(n, words, seed)
    rng = np.random.default_rng(seed)
    for shard, start in enumerate(range(0, n, shard_docs)):  # one shard per shard_docs, as a stage's units give
        k = min(shard_docs, n - start)
        ids = pa.array([f"d{i:09d}" for i in range(start, start + k)], pa.string())
        batch = pa.RecordBatch.from_pydict({
            "id": ids, "text": texts.slice(start, k), "kind": ["text"] * k, "lang": ["en"] * k,
            "source": [f"bench-{i % 7}" for i in range(start, start + k)], "path": [""] * k, "meta": ["{}"] * k,
        }, schema=DOCUMENT_SCHEMA)
        vectors = rng.standard_normal((k, dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for where, schema, data in ((folder, DOCUMENT_SCHEMA, batch), (folder / "embeddings", embedding_schema(dim),
                                    pa.RecordBatch.from_arrays([ids, pa.FixedSizeListArray.from_arrays(
                                        pa.array(vectors.reshape(-1)), dim)], schema=embedding_schema(dim)))):
            with ShardWriter(where, schema, target_bytes=1 << 62, first_index=shard) as writer:
                writer.write(data)
    write_manifest(folder, {"stage": "bench", "inputs": [], "counts": {"documents": n}})
    return {"docs": n, "text_bytes": int(texts.nbytes), "shards": math.ceil(n / shard_docs)}


def dedup(n: int, words: tuple[int, int], work: Path, models: Path, env: dict[str, str], timeout: float) -> dict:
    folder = work / f"dedup-in-{n}-{words[0]}"
    made = dedup_dataset(folder, n, words)
    params = write_params(work, models)
    r = run_stage(["--params", str(params), "run", "dedup", "--in", str(folder), "--out",
                   str(work / f"dedup-out-{n}-{words[0]}"), "--overwrite"], work, env, timeout)
    r["in"] = made
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(work / f"dedup-out-{n}-{words[0]}", ignore_errors=True)
    return r


# --- the command --------------------------------------------------------------------------------------


class PrefectServer:
    """One temporary Prefect API for every stage process (without it each CLI call starts its own)."""

    def __enter__(self):
        os.environ.update(ASSAY_ENV)
        os.environ.setdefault("PREFECT_HOME", str(Path(self.home) / "prefect"))
        from prefect.testing.utilities import prefect_test_harness
        from prefect.settings import PREFECT_API_URL

        self._harness = prefect_test_harness(server_startup_timeout=90)
        self._harness.__enter__()
        self.url = PREFECT_API_URL.value()
        return self

    def __init__(self, home: Path):
        self.home = home

    def __exit__(self, *exc):
        self._harness.__exit__(*exc)
        return False


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def stretches(samples: list, cuts: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 1.0)) -> list[tuple[int, int]]:
    """(max, min) resident bytes per stretch of a run: the first tenth, then to each quarter's end. A stage
    that keeps what it reads, or whose heap fragments, rises from stretch to stretch; a bounded one levels off."""
    end, start, out = samples[-1][0], 0.0, []
    for cut in cuts:
        rss = [r for t, r in samples if start * end <= t <= cut * end] or [samples[-1][1]]
        out.append((max(rss), min(rss)))
        start = cut
    return out


def print_stream(results: dict) -> None:
    c = results["corpus"]
    print(f"\ncorpus: {c['docs']:,} documents ({c['code_docs']:,} Python), {c['text_bytes'] / 1e9:.2f} GB of text, "
          f"{c['file_bytes'] / 1e9:.2f} GB of JSONL in {c['files']} files; {c['huge_docs']} documents >= 400 KB, "
          f"the largest {c['largest'] / 1e6:.1f} MB; generated in {c['seconds']} s")
    print("\n| stage | documents in | bytes in | documents out | peak RSS (VmHWM) MiB | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage, r in results["stages"].items():
        bytes_in = r["in"].get("bytes", r["in"].get("text_bytes_uncompressed"))
        print(f"| {stage} | {r['in']['docs']:,} | {bytes_in / 1e9:.2f} GB | {r['out']['docs']:,} | "
              f"{_mb(r['vmhwm'])} | {r['seconds']:.0f} |")
    for stage, r in results["stages"].items():
        parts = stretches(r["samples"])
        print(f"{stage}: {r.get('cpu_seconds', 0):.0f} s of CPU; RSS max (min) MiB by stretch (0-10-25-50-75-100%): "
              + ", ".join(f"{_mb(hi)} ({_mb(lo)})" for hi, lo in parts))
        if r.get("heap"):  # glibc's in-use and free bytes, and Arrow's, at the end of each stretch
            end = r["heap"][-1][0]
            at = [min(r["heap"], key=lambda h: abs(h[0] - cut * end)) for cut in (0.1, 0.25, 0.5, 0.75, 1.0)]
            print(f"{stage} malloc in use / free in its heaps / Arrow MiB at those points: "
                  + ", ".join(f"{_mb(h[1])} / {_mb(h[2])} / {_mb(h[4])}" for h in at))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("stream", help="a generated corpus through ingest, static and domain")
    s.add_argument("--gb", type=float, default=2.0, help="corpus size in GB of text (1e9 bytes)")
    s.add_argument("--stages", default="ingest,static,domain", help="stages to run, in order")
    s.add_argument("--batch-bytes", type=int, default=None,
                   help="io.batch_bytes for the run (default: params.yaml's; a huge value: batches of rows only)")
    s.add_argument("--reuse", type=Path, default=None,
                   help="a work folder kept by an earlier run (--keep): its corpus and outputs are used as they "
                        "are (no generation; --gb is ignored), and it is kept")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every stage's environment (e.g. MALLOC_MMAP_THRESHOLD_=262144); repeatable")
    d = sub.add_parser("dedup", help="dedup's whole-stage peak on N short documents")
    d.add_argument("--docs", default="250000,1000000", help="document counts, comma-separated")
    d.add_argument("--words", default="20-80", help="document lengths in words, comma-separated ranges")
    for p in (s, d):
        p.add_argument("--work", type=Path, default=Path("/tmp/memory-bench"), help="work folder (removed after)")
        p.add_argument("--models", type=Path, default=None, help="folder with quality/ and domain/")
        p.add_argument("--timeout", type=float, default=3600, help="seconds per stage")
        p.add_argument("--keep", action="store_true", help="keep the generated data")
        p.add_argument("--json", type=Path, help="also write every measurement here")
    args = parser.parse_args(argv)

    reuse = getattr(args, "reuse", None)
    work = reuse.resolve() if reuse else args.work / f"{args.what}-{os.getpid()}"
    if reuse:
        args.keep = True
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work}", flush=True)
    try:
        with PrefectServer(work) as server:
            env = stage_env(server.url)
            for pair in getattr(args, "env", []):
                key, _, value = pair.partition("=")
                env[key] = value
            models = args.models
            if models is None:
                started = time.perf_counter()
                models = train_models(work, env, write_params(work, work / "models"), args.timeout)
                print(f"models trained in {time.perf_counter() - started:.0f} s")
            models = models.resolve()
            if args.what == "stream":
                changes = {"io": {"batch_bytes": args.batch_bytes}} if args.batch_bytes else None
                results = stream(int(args.gb * 1e9), work, models, env, args.timeout,
                                 tuple(args.stages.split(",")), changes, reuse=reuse is not None)
                print_stream(results)
            else:
                results = {"dedup": []}
                for words in args.words.split(","):
                    lo, hi = map(int, words.split("-"))
                    for n in map(int, args.docs.split(",")):
                        r = dedup(n, (lo, hi), work, models, env, args.timeout)
                        results["dedup"].append({**r, "words": [lo, hi]})
                        print(f"dedup {n:,} documents of {lo}-{hi} words ({r['in']['text_bytes'] / 1e6:,.0f} MB text): "
                              f"peak {_mb(r['vmhwm'])} MiB, {r['vmhwm'] / n:,.0f} B/doc, {r['seconds']:.0f} s", flush=True)
                print("\n| documents | words each | text MB | peak RSS (VmHWM) MiB | per million documents MiB | seconds |")
                print("|---:|---|---:|---:|---:|---:|")
                for r in results["dedup"]:
                    n = r["in"]["docs"]
                    print(f"| {n:,} | {r['words'][0]}-{r['words'][1]} | {r['in']['text_bytes'] / 1e6:,.0f} | "
                          f"{_mb(r['vmhwm'])} | {_mb(r['vmhwm'] * 1e6 / n)} | {r['seconds']:.0f} |")
                # The slope between two counts of the same length: what each added million documents costs,
                # without the process's fixed part (interpreter, Prefect, torch) that the per-document ratio carries.
                by_words: dict = {}
                for r in results["dedup"]:
                    by_words.setdefault(tuple(r["words"]), []).append(r)
                for words, rs in by_words.items():
                    rs.sort(key=lambda r: r["in"]["docs"])
                    for a, b in zip(rs, rs[1:]):
                        slope = (b["vmhwm"] - a["vmhwm"]) / (b["in"]["docs"] - a["in"]["docs"]) * 1e6
                        print(f"{words[0]}-{words[1]} words: {a['in']['docs']:,} -> {b['in']['docs']:,} documents: "
                              f"+{_mb(slope)} MiB per million documents ({slope / 1e6:,.0f} B/doc)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
