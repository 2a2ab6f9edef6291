"""The stage flows on real engines: Dask (a 2-worker `distributed.LocalCluster`) and Ray (a local
`ray.init`), chosen through params.yaml's `flow.task_runner`, give the thread runner's output.

And dedup's LSH is partitioned: each band task reads its band's columns of the staged signatures,
not the corpus's whole signature matrix.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from corpus import stdlib_documents, write_documents

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SITE = Path(sysconfig.get_paths()["purelib"])
STAGES = ("ingest", "static", "domain", "dedup", "dynamic")


def _digest(row: dict) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=repr).encode()).hexdigest()


def _summary(out: Path) -> dict:
    """What must not depend on the engine: every document (all columns, by content hash), every decision,
    and the manifest's counts."""
    docs = sorted(_digest(r) for f in sorted(out.glob("part-*.parquet")) for r in pq.read_table(f).to_pylist())
    decisions = []
    if (out / "decisions").is_dir():
        decisions = sorted(_digest(r) for r in pq.read_table(out / "decisions").to_pylist())
    manifest = json.loads((out / "manifest.json").read_text())
    return {"docs": docs, "decisions": decisions, "counts": manifest.get("counts")}


def _params_file(root: Path, base: dict, runner: str, address: str | None) -> Path:
    params = copy.deepcopy(base)
    params["flow"].update(task_runner=runner, address=address, max_workers=2)
    path = root / f"params-{runner}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _run_stages(root: Path, params_file: Path, signals: dict | None) -> dict[str, Path]:
    """The five stage flows through their `run_*` entry points, which pick the runner from params."""
    from flows.dedup import run_dedup
    from flows.domain import run_domain
    from flows.dynamic import run_dynamic
    from flows.ingest import run_ingest
    from flows.static import run_static

    outs = {stage: root / stage for stage in STAGES}
    run_ingest(sorted(str(p) for p in (root.parent / "src").iterdir()), str(outs["ingest"]), params_file=str(params_file))
    run_static(str(outs["ingest"]), str(outs["static"]), params_file=str(params_file))
    run_domain(str(outs["static"]), str(outs["domain"]), params_file=str(params_file))
    run_dedup(str(outs["domain"]), str(outs["dedup"]), params_file=str(params_file))
    if signals is not None:
        # The scores were computed on the thread run's dedup output; this runner's output holds the same
        # documents (asserted below) but is another version (its manifest records its own run), which
        # dynamic refuses unless told: the flag is what a user re-running under another runner passes.
        run_dynamic(str(outs["dedup"]), str(signals["scores"]), str(signals["run"]), str(outs["dynamic"]),
                    params_file=str(params_file), allow_data_change=True)
    return outs


@pytest.fixture(scope="module")
def threads_run(tmp_path_factory, prefect_harness):
    """A tiny corpus (prose, package metadata, code, planted duplicates), its models, and the five stages
    under the thread runner; round 0's scores and telemetry for tier 2 come from a tiny run on its dedup output."""
    from pydoc_data.topics import topics

    from assay.config import ScoringParams, TrainModelParams, TrainParams
    from assay.versions import open_version
    from flows.domain_model import domain_model_flow
    from flows.ingest import ingest_flow
    from flows.quality import quality_train_flow
    from training.score import score_dataset
    from training.trainer import train

    base_root = tmp_path_factory.mktemp("scaleout")
    reference, code, mixed = (base_root / "src" / name for name in ("reference", "code", "mixed"))
    for folder in (reference, code, mixed):
        folder.mkdir(parents=True)
    for name in sorted(topics)[:16]:
        (reference / f"{name}.txt").write_text(topics[name])
    for i, meta in enumerate(sorted(SITE.glob("*.dist-info/METADATA"))[:12]):
        (mixed / f"pkg{i}.txt").write_text(meta.read_text(errors="replace"))
    for name in ("textwrap.py", "colorsys.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py", "glob.py",
                 "queue.py", "sched.py", "base64.py"):
        shutil.copy(STDLIB / name, code / name)
    # Duplicates for dedup: an exact copy, a near copy (a two-line header), a copy of prose.
    (mixed / "textwrap_copy.py").write_text((STDLIB / "textwrap.py").read_text())
    header = "# Vendored from CPython's Lib/heapq.py; keep in step with upstream.\n# Local changes: none.\n"
    (mixed / "heapq_vendored.py").write_text(header + (STDLIB / "heapq.py").read_text())
    first = sorted(topics)[0]
    (mixed / "topic-copy.txt").write_text(topics[first])

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["quality"]["reference_sources"] = ["reference"]
    params["quality"]["negatives_share"] = 1.0
    params["static"]["head"] = str(base_root / "head")
    params["static"]["threshold"] = 0.44  # an uncalibrated head (see tests/test_static.py)
    params["domain"]["train"]["reference_sources"] = ["code"]
    params["domain"]["train"].update(n_layer=1, n_head=2, n_embd=32, context=64, steps=20, vocab_size=1000)
    params["domain"]["model"].update(model=str(base_root / "domain-model"), window=64)
    params["dedup"]["semantic"]["docs_per_cluster"] = 10
    params["dynamic"]["min_stratum_docs"] = 2  # a few dozen documents
    params["io"]["batch_rows"] = 16  # several batches per shard
    params["io"]["shard_bytes"] = 64 * 1024  # several shards, so several tasks per stage
    setup_params = base_root / "params-setup.yaml"
    setup_params.write_text(yaml.safe_dump(params))

    raw = base_root / "setup-raw"
    ingest_flow([str(reference), str(code), str(mixed)], str(raw), params_file=str(setup_params))
    quality_train_flow(str(raw), str(base_root / "head"), params_file=str(setup_params))
    domain_model_flow(str(raw), str(base_root / "domain-model"), params_file=str(setup_params))

    root = base_root / "threads"
    root.mkdir()
    outs = _run_stages(root, _params_file(root, params, "threads", None), None)
    train_params = TrainParams(model=TrainModelParams(dim=32, n_layers=1, n_heads=2, ffn_hidden=64), vocab_size=300,
                               seq_len=32, batch_size=4, steps=6, checkpoint_every=3, holdout=0.0, eval_rows=8,
                               warmup_steps=2, device="cpu")
    signals = {"run": base_root / "round0", "scores": base_root / "scores"}
    train(open_version(outs["dedup"]), signals["run"], train_params, progress=False)
    score_dataset(signals["run"], outs["dedup"], signals["scores"],
                  ScoringParams(checkpoints=[3, 6], reference={"reference": 0.3, "code": 0.3}, strata="kind",
                                min_stratum_docs=2, max_rows=4, device="cpu"),
                  progress=False)
    from flows.dynamic import run_dynamic

    run_dynamic(str(outs["dedup"]), str(signals["scores"]), str(signals["run"]), str(outs["dynamic"]),
                params_file=str(root / "params-threads.yaml"))
    return {"base": base_root, "params": params, "signals": signals,
            "summary": {stage: _summary(out) for stage, out in outs.items()}}


def _assert_same_as_threads(threads_run: dict, outs: dict[str, Path]) -> None:
    for stage in STAGES:
        got, want = _summary(outs[stage]), threads_run["summary"][stage]
        assert want["docs"], f"{stage}: the thread runner's output is empty; the comparison would prove nothing"
        assert got["counts"] == want["counts"], stage
        assert got["docs"] == want["docs"], f"{stage}: documents differ from the thread runner's"
        assert got["decisions"] == want["decisions"], f"{stage}: decisions differ from the thread runner's"


def test_the_thread_run_exercises_every_step(threads_run):
    """The reference run drops something at each stage where the corpus plants it, so equality below means something."""
    summary = threads_run["summary"]
    assert summary["dedup"]["counts"]["input"] > len(summary["dedup"]["docs"])  # duplicates went
    assert summary["static"]["decisions"] and summary["domain"]["decisions"] and summary["dynamic"]["decisions"]
    dropped = {s: summary[s]["counts"].get("dropped", 0) for s in STAGES[1:]}
    assert sum(v > 0 for v in dropped.values()) >= 3, dropped
    assert summary["dedup"]["counts"]["by_reason"].get("near_dup"), summary["dedup"]["counts"]  # the band tasks found it


def test_stage_flows_on_a_dask_local_cluster_match_threads(threads_run):
    distributed = pytest.importorskip("distributed", reason="the dask extra is not installed (pip install -e '.[dask]')")
    pytest.importorskip("prefect_dask", reason="the dask extra is not installed (pip install -e '.[dask]')")

    root = threads_run["base"] / "dask"
    root.mkdir()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  memory_limit="2GiB") as cluster:
        params_file = _params_file(root, threads_run["params"], "dask", cluster.scheduler_address)
        with distributed.Client(cluster) as client:
            outs = _run_stages(root, params_file, threads_run["signals"])
            # The tasks ran in the cluster's worker processes, not in this one.
            ran = client.run(lambda: __import__("sys").modules.get("assay.stages.dedup") is not None)
    assert len(ran) == 2 and any(ran.values()), ran
    _assert_same_as_threads(threads_run, outs)


def test_stage_flows_on_local_ray_match_threads(threads_run):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    pytest.importorskip("prefect_ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

    root = threads_run["base"] / "ray"
    root.mkdir()
    from prefect_ray import RayTaskRunner

    from assay.config import load_params
    from flows.runners import task_runner

    params_file = _params_file(root, threads_run["params"], "ray", None)
    assert isinstance(task_runner(load_params(params_file).flow), RayTaskRunner)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        outs = _run_stages(root, params_file, threads_run["signals"])
    finally:
        ray.shutdown()
    _assert_same_as_threads(threads_run, outs)


def test_band_task_reads_only_its_bands_columns(tmp_path):
    """The staged signatures of one band are enough for that band's task (the others are deleted from the
    files), it gives `band_pairs`'s answer on the whole matrix, and another band's task cannot run on them."""
    from assay.config import DedupParams
    from assay.stages.dedup import (Corpus, band_pairs, scan_shard, signatures_file, staged_band_pairs,
                                    write_alive)
    from filters.minhash import signatures

    params = DedupParams()
    docs = stdlib_documents(12)
    docs += [(f"copy-{name}", text[: len(text) * 9 // 10]) for name, text in docs[:4]]  # near copies
    shards = [write_documents(tmp_path / f"in{i}", docs[i::2]) for i in range(2)]
    folder = str(tmp_path / "staged")
    files = [signatures_file(folder, i) for i in range(2)]
    scans = [scan_shard(str(next(Path(s).glob("part-*.parquet"))), params, 5, signatures_to=f)
             for s, f in zip(shards, files)]
    assert all(s.signatures is None for s in scans)  # nothing of the matrix comes back to the flow
    texts = [t for i in range(2) for _, t in docs[i::2]]
    whole = signatures(texts, params.minhash)
    n = len(texts)
    alive = np.ones(n, dtype=bool)
    alive[1] = False
    alive_file = write_alive(alive, folder)
    corpus = Corpus(*([np.zeros(n)] * 7), whole, np.zeros(n, int))
    band = next(b for b in range(1, params.minhash.bands) if len(band_pairs(corpus, alive, b, params)))
    expected = band_pairs(corpus, alive, band, params)  # the near copies collide in this band
    for f in files:  # keep only this band's column and the shingled flag
        table = pq.read_table(f)
        pq.write_table(table.select(["shingled", f"band_{band:03d}"]), f)
    assert np.array_equal(staged_band_pairs(files, alive_file, band, params), expected)
    assert np.array_equal(staged_band_pairs([f"file://{f}" for f in files], f"file://{alive_file}", band, params),
                          expected)  # an fsspec URL reads the same
    with pytest.raises(Exception, match=f"band_{band - 1:03d}"):
        staged_band_pairs(files, alive_file, band - 1, params)


def test_the_alive_bits_round_trip_without_the_ast_module(tmp_path, monkeypatch):
    """Band tasks read the alive file at once on the thread runner. It was `np.save`d, and `np.load` parses
    its header with `ast.literal_eval`, which CPython 3.11 cannot run in two threads at once: a clean-clone
    `make test` failed with "AST constructor recursion depth mismatch". Now no AST is built to read it."""
    import ast

    from assay.errors import AssayError
    from assay.stages.dedup import read_alive, write_alive

    def no_ast(*args, **kwargs):
        raise AssertionError("the alive file was read through the ast module")

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 1001):
        alive = rng.random(n) < 0.5
        path = write_alive(alive, str(tmp_path / f"n{n}"))
        with monkeypatch.context() as patched:
            patched.setattr(ast, "literal_eval", no_ast)
            assert np.array_equal(read_alive(path), alive), n
    Path(path).write_bytes(Path(path).read_bytes()[:-1])  # cut short
    with pytest.raises(AssayError, match=r"damaged \(133 bytes, not the 134 its count says\)"):
        read_alive(path)


def test_band_task_arguments_do_not_grow_with_the_corpus(tmp_path):
    """What a band task is sent (paths, the band, the params) pickles to the same size for 10 and 1000 shards'
    worth of documents: the signatures never travel through the scheduler."""
    import inspect

    import cloudpickle

    from assay.config import DedupParams
    from assay.stages.dedup import ALIVE, signatures_file, staged_band_pairs

    assert list(inspect.signature(staged_band_pairs).parameters) == ["files", "alive_file", "band", "params"]
    params = DedupParams()
    folder = str(tmp_path / "staged")
    files = [signatures_file(folder, i) for i in range(4)]
    size = len(cloudpickle.dumps((files, f"{folder}/{ALIVE}", 3, params)))
    assert size < 4096, size


def _judged_corpus(n: int):
    """A corpus of `n` documents in shards of 100 rows, a third of them duplicates of rows anywhere in it."""
    from assay.stages.dedup import Corpus, Verdicts

    ids = np.array([f"doc-{i:08d}" for i in range(n)], dtype=object)
    text = np.array(["text"] * n, dtype=object)
    corpus = Corpus(ids, text, text, text, text, np.zeros(n), np.zeros(n, dtype=np.uint64), None, np.arange(n) // 100)
    rows = np.arange(n)
    dup = rows % 3 == 0
    duplicate_of = np.where(dup, (rows * 7919 + 1) % n, -1)
    reason = ["near_dup" if d else None for d in dup]
    verdicts = Verdicts(reason, duplicate_of, duplicate_of.copy(), np.full(n, -1), np.where(dup, 0.95, np.nan), {})
    return corpus, verdicts


def test_write_task_arguments_follow_its_shard_not_the_corpus(tmp_path):
    """What a dedup write task is sent (its shard's verdicts, paths, the params) pickles to the same size for a
    corpus of 1,000 and of 100,000 documents, shards of 100 rows alike; the corpus and its verdicts never
    travel to a worker. Before, every write task was sent both whole: 100x the bytes at 100,000 documents."""
    import inspect

    import cloudpickle

    from assay.config import Params
    from assay.stages.dedup import shard_verdicts, write_shard

    assert list(inspect.signature(write_shard).parameters) == ["index", "shard", "out_dir", "params", "key", "verdicts"]
    params = Params()
    sizes = {}
    for n in (1_000, 100_000):
        corpus, verdicts = _judged_corpus(n)
        mine = shard_verdicts(corpus, verdicts, np.flatnonzero(corpus.shard_of == 4))
        assert len(mine.reason) == 100
        assert mine.duplicate_of[2] == f"doc-{(402 * 7919 + 1) % n:08d}" and mine.duplicate_of[1] is None
        assert mine.reason[2] == "near_dup" and np.isnan(mine.similarity[1])
        sizes[n] = len(cloudpickle.dumps((4, str(tmp_path / "part-00004.parquet"), str(tmp_path / "out"), params,
                                          "00004-key", mine)))
        whole = len(cloudpickle.dumps((corpus, verdicts)))
    assert abs(sizes[100_000] - sizes[1_000]) <= 0.01 * sizes[1_000], sizes
    assert sizes[100_000] * 50 < whole, (sizes, whole)
