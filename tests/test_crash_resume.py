"""kill -9 at several moments of a stage run, then rerun: the output equals an uninterrupted run's.

Each stage runs as a user runs it, through the `assay` CLI in its own process group, and is
SIGKILLed at moments chosen by watching its staging folder beside the output (its finished
units), not by sleeping: early (staging prepared, nothing finished), mid-run (some units
finished), and late (all but one unit finished, or all of them with the commit next). The
rerun is the stage's own command again, as dvc.yaml runs it. While the killed run's leftovers lie on disk, and at
every poll of a running stage, every part-*.parquet a reader can list must be a whole shard, and the
output folder, once it exists, must be a whole dataset: its manifest, and exactly the parts it names.

The inputs (the ingested demo, both models, round 0 and every stage's uninterrupted output)
are built once, by the same CLI, with tiny params and small shards so that each stage has
several units.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from assay.shards import SHARD_PATTERN, iter_batches, list_shards, staging_dir
from assay.staging import building
from corpus import tiny_pipeline_params

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ASSAY = str(Path(sys.executable).parent / "assay")
STAGE_TIMEOUT_S = 600
POLL_S = 0.01


#: Secrets a user's environment may hold (RELIABILITY.md, "Security defaults"): every stage below runs with
#: them set (no WEAVIATE_URL, so nothing connects), and none may reach an output, a log or a manifest.
SECRETS = {"WEAVIATE_API_KEY": "wv-key-5d41402abc4b2a76", "AWS_ACCESS_KEY_ID": "AKIAASSAYTESTKEY0001",
           "AWS_SECRET_ACCESS_KEY": "aws-secret-7d793037a0760186574b"}


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    # The session's Prefect API (tests/conftest.py): without it every CLI call starts its own server.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **SECRETS)
    url = PREFECT_API_URL.value()
    if url:
        env["PREFECT_API_URL"] = url
    return env


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    proc = subprocess.run([ASSAY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    assert proc.returncode == 0, f"assay {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    leaked = [name for name, value in SECRETS.items() if value in proc.stdout + proc.stderr]
    assert not leaked, f"assay {' '.join(args)} printed {leaked}"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, prefect_harness):
    """Every stage's input, and its uninterrupted output, made by the CLI as dvc.yaml chains it."""
    root = tmp_path_factory.mktemp("crash")
    params = tiny_pipeline_params(ROOT / "params.yaml")
    params["io"].update(shard_bytes=60_000, batch_rows=64)  # ~6 input shards: ~6 units per shard stage
    params["score"]["part_docs"] = 20  # several score parts
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = _env()
    p = ["--params", "params.yaml"]
    _cli([*p, "ingest", "demo", "--out", "data/raw", "--overwrite"], root, env)
    _cli([*p, "quality", "train", "--data", "data/raw", "--out", "models/quality"], root, env)
    for stage in STAGES:
        if stage == "domain":
            _cli([*p, "domain", "train", "--data", "data/static", "--out", "models/domain"], root, env)
        if stage == "score":
            _cli([*p, "train", "--data", "data/dedup", "--out", "runs/round-0", "--overwrite"], root, env)
        _cli([*p, *STAGES[stage](STAGE_REF[stage])], root, env)
    return {"root": root, "env": env}


#: Each stage's command line, given its output folder (dvc.yaml's, with the reference outputs as inputs).
STAGES = {
    "static": lambda out: ["run", "static", "--in", "data/raw", "--out", out, "--overwrite"],
    "domain": lambda out: ["run", "domain", "--in", "data/static", "--out", out, "--overwrite"],
    "dedup": lambda out: ["run", "dedup", "--in", "data/domain", "--out", out, "--overwrite"],
    "score": lambda out: ["score", "--run", "runs/round-0", "--data", "data/dedup", "--out", out, "--overwrite"],
    "dynamic": lambda out: ["run", "dynamic", "--in", "data/dedup", "--scores", "runs/round-0/scores",
                            "--run", "runs/round-0", "--out", out, "--overwrite"],
}
STAGE_REF = {"static": "data/static", "domain": "data/domain", "dedup": "data/dedup",
             "score": "runs/round-0/scores", "dynamic": "data/curated"}


# --- what a reader sees ----------------------------------------------------------------


def _visible_shards(out: Path) -> list[Path]:
    """Every part-*.parquet a reader could list: the dataset's and every stream folder's."""
    if not out.is_dir():
        return []
    shards = list(list_shards(out))
    for folder in out.iterdir():
        if folder.is_dir() and not folder.name.startswith("."):
            shards += list_shards(folder)
    return shards


def _check_whole(out: Path, seen: set | None = None) -> int:
    """The folder, when there is one, is a published dataset (its manifest and exactly the document parts it
    names, never a commit's first parts), and each listed shard opens and reads to its end.

    `seen` holds the (path, inode, mtime) already read, so a poll reads only what is new."""
    if out.is_dir():
        listed = sorted(p.name for p in list_shards(out))
        manifest = json.loads((out / "manifest.json").read_text())  # FileNotFoundError: a half-published set
        assert listed == sorted(manifest["shards"]), f"{out}: parts {listed} against the manifest's {manifest['shards']}"
    whole = 0
    for shard in _visible_shards(out):
        try:
            st = shard.stat()
            key = (str(shard), st.st_ino, st.st_mtime_ns)
            if seen is not None and key in seen:
                continue
            pq.read_table(shard)
        except FileNotFoundError:
            continue
        if seen is not None:
            seen.add(key)
        whole += 1
    return whole


def _staged_done(out: Path) -> int:
    return len(list(staging_dir(out).glob("*/done.json")))


# --- kill points ------------------------------------------------------------------------


def _progress(stage: str, out: Path) -> dict[str, int]:
    if stage == "score":
        # training/score.py writes its parts, each atomically, into the folder it publishes at the end.
        return {"started": int((staging_dir(out) / ".score-fingerprint").is_file()),
                "done": len(list_shards(building(out))), "committed": len(list_shards(out))}
    return {"started": int(staging_dir(out).is_dir()), "done": _staged_done(out),
            "committed": len(list_shards(out))}


def _run_until(stage: str, args: list[str], root: Path, env: dict[str, str], out: Path, ready) -> dict:
    """Start the stage; SIGKILL its process group once `ready(progress)` holds (or let it finish)."""
    started = time.perf_counter()
    # stderr to a file, not a pipe: nobody reads a pipe while polling, and a full one would stall the stage.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([ASSAY, *args], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=log, start_new_session=True)
    polls = whole_checks = 0
    killed = False
    seen: set = set()
    try:
        while proc.poll() is None:
            progress = _progress(stage, out)
            whole_checks += _check_whole(out, seen)
            polls += 1
            if ready is not None and ready(progress):
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            if time.perf_counter() - started > STAGE_TIMEOUT_S:
                raise AssertionError(f"{stage} ran past {STAGE_TIMEOUT_S} s")
            time.sleep(POLL_S)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not killed:
        log.seek(0)
        assert proc.returncode == 0, f"assay {' '.join(args)} failed:\n{log.read()[-3000:].decode(errors='replace')}"
    log.close()
    return {"killed": killed, "seconds": round(time.perf_counter() - started, 2), "at": _progress(stage, out),
            "polls": polls, "shards_read": whole_checks}


# --- comparing outputs ------------------------------------------------------------------


def _streams(out: Path) -> dict[str, pa.Table]:
    tables = {"docs": list_shards(out)}
    for folder in sorted(p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if list_shards(folder):
            tables[folder.name] = list_shards(folder)
    return {name: pa.concat_tables([pq.read_table(s) for s in shards]) for name, shards in tables.items()}


def _row_hashes(table: pa.Table) -> Counter[str]:
    return Counter(hashlib.blake2b(json.dumps(row, sort_keys=True, default=repr).encode(), digest_size=16).hexdigest()
                   for row in table.to_pylist())


def _assert_same_output(stage: str, out: Path, ref: Path) -> dict[str, int]:
    assert not staging_dir(out).exists(), "the staging folder outlived the commit"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "temporaries left behind"
    got, want = _streams(out), _streams(ref)
    assert sorted(got) == sorted(want)
    id_column = "sample_id" if stage == "score" else "id"
    for name, table in want.items():
        mine = got[name]
        assert mine.num_rows == table.num_rows, f"{name}: {mine.num_rows} rows, uninterrupted run {table.num_rows}"
        assert _row_hashes(mine) == _row_hashes(table), f"{name}: rows differ from the uninterrupted run's"
        assert mine.equals(table), f"{name}: same rows, other order or types"
    ids = got["docs"].column(id_column).to_pylist()
    key = list(zip(got["docs"].column("step").to_pylist(), ids)) if stage == "score" else ids
    assert len(key) == len(set(key)), "duplicate documents"
    if "decisions" in got:
        decided = got["decisions"].column("id").to_pylist()
        assert len(decided) == len(set(decided)), "a document decided twice"
    # What a downstream stage reads: every batch of the resumed output.
    assert sum(b.num_rows for b in iter_batches(out)) == want["docs"].num_rows
    manifest_of = lambda d: json.loads((d / "manifest.json").read_text())  # noqa: E731
    assert manifest_of(out)["fingerprint"] == manifest_of(ref)["fingerprint"]
    if stage == "dedup":
        _assert_same_graph(out, ref, got["decisions"].column("id").to_pylist())
    return {name: t.num_rows for name, t in got.items()}


def _assert_same_graph(out: Path, ref: Path, ids: list[str]) -> None:
    """Dedup's graph upsert into the local vector store (OUT/vectors): every judged document's
    record (properties, vector, duplicate_of, clusters), every cluster, the sources and the count
    equal the uninterrupted run's, read through the store's own API."""
    from assay.vectors.local import LocalVectorStore

    with LocalVectorStore(out / "vectors") as mine, LocalVectorStore(ref / "vectors") as theirs:
        assert mine.count() == theirs.count() > 0
        assert mine.sources() == theirs.sources()
        clusters = set()
        for doc_id in ids:
            a, b = mine.get(doc_id), theirs.get(doc_id)
            assert (a is None) == (b is None), doc_id
            if b is None:
                continue
            assert a.properties() == b.properties(), doc_id
            assert (a.duplicate_of, a.clusters) == (b.duplicate_of, b.clusters), doc_id
            assert (a.vector is None) == (b.vector is None), doc_id
            if b.vector is not None:
                assert np.array_equal(a.vector, b.vector), doc_id
            clusters.update(b.clusters)
        for cluster_id in sorted(clusters):
            assert mine.get_cluster(cluster_id) == theirs.get_cluster(cluster_id), cluster_id


# --- the tests --------------------------------------------------------------------------


def _units(stage: str, ref: Path) -> int:
    if stage == "score":
        return len(list_shards(ref))
    return json.loads((ref / "manifest.json").read_text())["counts"]["units"]


def _kill_points(stage: str, n: int):
    """(label, predicate over progress): early, mid-run, and late (all but one unit finished, or all: commit next)."""
    mid = max(1, n // 2)
    return [
        ("early: prepared, 0 units finished", lambda p: p["started"] and p["done"] == 0),
        (f"mid: >= {mid} of {n} units finished", lambda p: p["done"] >= mid),
        (f"late: >= {n - 1} of {n} units finished", lambda p: p["done"] >= n - 1),
    ]


@pytest.mark.parametrize("stage", list(STAGES))
def test_kill_9_and_rerun_gives_the_uninterrupted_output(pipeline, stage, record_property):
    root, env = pipeline["root"], pipeline["env"]
    ref = root / STAGE_REF[stage]
    out = root / "killed" / stage
    args = ["--params", "params.yaml", *STAGES[stage](str(out.relative_to(root)))]
    n = _units(stage, ref)
    assert n >= 3, f"{stage}: only {n} units; the kills need several"
    log = []
    for label, ready in _kill_points(stage, n):
        finished_at_start = _progress(stage, out)["done"]
        run = _run_until(stage, args, root, env, out, ready)
        run["point"], run["finished_at_start"] = label, finished_at_start
        log.append(run)
        if not run["killed"]:
            break  # finished before the moment came (a fast machine): the rest is the rerun below
        # The killed run's leftovers: every shard a reader lists is whole, and no temporary looks like one.
        assert _check_whole(out) == len(_visible_shards(out))  # pyarrow raises on a torn shard
        assert all(SHARD_PATTERN.match(p.name) is None for p in out.rglob("*") if ".tmp-" in p.name)
    # On a loaded machine a kill can land after the run has committed: the dataset is then complete before
    # the rerun, which does nothing, and the manifest is the killed run's own.
    complete_before_rerun = (out / "manifest.json").is_file()
    final = _run_until(stage, args, root, env, out, None)
    final["point"] = "rerun to the end"
    log.append(final)
    rows = _assert_same_output(stage, out, ref)
    kills = sum(r["killed"] for r in log)
    assert kills >= 2, f"{stage}: the stage finished before the kills could land: {log}"
    manifest = json.loads((out / "manifest.json").read_text())
    resumed = manifest["counts"]["parts_resumed" if stage == "score" else "units_resumed"]
    if complete_before_rerun:
        # The run that wrote it resumed exactly what the kill before it had left finished (none after a kill at 0).
        assert resumed == log[-2]["finished_at_start"], (stage, resumed, log)
    else:
        assert resumed >= 1, f"{stage}: the rerun redid every unit instead of resuming the finished ones"
    summary = {"stage": stage, "units": n, "kills": kills, "resumed_units_in_last_run": resumed, "rows": rows,
               "runs": log}
    record_property("crash_resume", json.dumps(summary))
    print(json.dumps(summary))


# --- training: a kill inside a checkpoint write -----------------------------------------


def test_training_resumes_exactly_after_a_kill_inside_a_checkpoint_write(tmp_path, prefect_harness):
    import dataclasses

    from corpus import stdlib_documents, write_documents
    from test_train import TINY_MODEL, _history, _params_file, tiny_params
    from training.telemetry import read_telemetry

    data = write_documents(tmp_path / "data", stdlib_documents(12), source="stdlib")
    # A wider model than the other tests' so that its checkpoint (with Adam's state) takes a moment to write.
    params = tiny_params(steps=60, checkpoint_every=20, seq_len=64, batch_size=8,
                         model=dataclasses.replace(TINY_MODEL, dim=128, ffn_hidden=512))
    params_file = _params_file(tmp_path, params)
    env = _env()
    base = [ASSAY, "--params", str(params_file), "train", "--data", str(data), "--device", "cpu"]
    straight = subprocess.run([*base, "--out", str(tmp_path / "straight")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    assert straight.returncode == 0, straight.stderr[-3000:]

    # The second save (step 40): `latest` names step 20, and step 40 is half on disk when the kill lands.
    landed = None
    for attempt in range(3):  # a save takes tens of ms: a poll may miss it on a loaded machine; try again
        killed = tmp_path / f"killed-{attempt}"
        checkpoints = killed / "checkpoints"
        target = checkpoints / "step-00000040.tmp-save"
        proc = subprocess.Popen([*base, "--out", str(killed)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.time() + STAGE_TIMEOUT_S
            while proc.poll() is None and time.time() < deadline:
                if target.is_dir():
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.002)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if target.is_dir() and not (checkpoints / "step-00000040").exists():
            landed = attempt
            break
    assert landed is not None, "three runs saved step 40 before the poll saw it being written"
    assert (checkpoints / "latest").read_text().strip() == "step-00000020"
    assert not (killed / "metrics.json").exists()

    resumed = subprocess.run([*base, "--out", str(killed), "--resume"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 20" in resumed.stdout + resumed.stderr
    assert not list(checkpoints.glob("*.tmp-save")), "the partial save outlived the resume"
    assert _history(killed) == _history(tmp_path / "straight")
    assert read_telemetry(killed).equals(read_telemetry(tmp_path / "straight"))
    print(json.dumps({"stage": "train", "kill": "inside save of step 40", "attempts": landed + 1}))


def test_secrets_in_the_environment_never_reach_the_outputs(pipeline):
    """The whole chain above (ingest, both models, static, domain, dedup with its graph upsert, round 0,
    score, dynamic, and every killed and resumed run) ran with WEAVIATE_API_KEY and AWS credentials set:
    no byte of any file it wrote (datasets, decisions, manifests, models, runs, telemetry, staging
    leftovers, params.yaml) holds one, nor any of Prefect's (its database, PREFECT_HOME), and no CLI
    call printed one (checked in `_cli`)."""
    files = [p for p in pipeline["root"].rglob("*") if p.is_file()]
    assert len(files) > 50 and any(p.name == "manifest.json" for p in files)
    for path in files:
        data = path.read_bytes()
        leaked = [name for name, value in SECRETS.items() if value.encode() in data]
        assert not leaked, f"{path.relative_to(pipeline['root'])} holds {leaked}"
    # Prefect's own record of every run above (flow and task parameters, logs, artifacts, states) lies
    # outside the run's folder: the session server's SQLite file, its -wal, and PREFECT_HOME.
    database = _prefect_database()
    kept = [p for p in database.parent.glob(database.name + "*") if p.is_file()]
    home = Path(os.environ["PREFECT_HOME"])
    kept += [p for p in home.rglob("*") if p.is_file()]
    assert database in kept and database.stat().st_size > 100_000, f"no Prefect database at {database}"
    for path in kept:
        data = path.read_bytes()
        leaked = [name for name, value in SECRETS.items() if value.encode() in data]
        assert not leaked, f"Prefect's {path} holds {leaked}"
    print(json.dumps({"run_files": len(files), "prefect_files": sorted(p.name for p in kept),
                      "prefect_db_bytes": sum(p.stat().st_size for p in kept if p.name.startswith(database.name))}))


def _prefect_database() -> Path:
    """The SQLite file of the session's Prefect server (prefect_test_harness puts it in a temporary folder)."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from sqlalchemy.engine import make_url

    url = make_url(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    assert url.get_backend_name() == "sqlite" and url.database, f"not a SQLite Prefect database: {url!r}"
    return Path(url.database)
