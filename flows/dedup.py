"""The `dedup` flow: exact, near (MinHash LSH, one task per band) and semantic dedup, then the graph."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from assay.config import load_params
from assay.shards import read_manifest
from assay.stages.dedup import (
    STAGE,
    decide,
    drop_signatures,
    exact_step,
    find_embeddings,
    gather,
    load_vectors,
    near_step,
    scan_shard,
    shard_verdicts,
    signatures_file,
    signatures_folder,
    staged_band_pairs,
    write_alive,
    write_shard,
)
from assay.stages.graph import upsert_graph
from assay.stages.shard_stage import plan_shards, require_unchanged, stage_fingerprint, stage_manifest
from assay.output_lock import exclusive_output
from assay.staging import building, commit, prepare
from flows.progress import wait_with_progress
from flows.runners import task_runner

scan_task = task(scan_shard, name="dedup-scan", cache_policy=NO_CACHE)
band_task = task(staged_band_pairs, name="dedup-lsh-band", cache_policy=NO_CACHE)
write_task = task(write_shard, name="dedup-write", cache_policy=NO_CACHE)
graph_task = task(upsert_graph, name="dedup-graph", cache_policy=NO_CACHE)


@task(name="dedup-embeddings", cache_policy=NO_CACHE)
def embeddings_task(input_dir: str, corpus, params) -> np.ndarray | None:
    """Stored tier-1 embeddings; only documents that have none are embedded, once."""
    if not params.dedup.semantic.enabled:
        return None
    folder = find_embeddings(input_dir)
    vectors, found = load_vectors(folder, corpus.ids) if folder else (None, np.zeros(len(corpus.ids), bool))
    missing = np.flatnonzero(~found)
    if len(missing):
        from assay.encoder import shared_encoder
        from assay.shards import iter_batches

        print(f"{len(missing)} of {len(corpus.ids)} documents have no stored embedding"
              f"{'' if folder else ' (no embeddings/ upstream)'}: computing them with the shared encoder")
        wanted = set(corpus.ids[missing])
        texts = {}
        for batch in iter_batches(input_dir, columns=["id", "text"], filter_ids=wanted):
            texts.update(zip(batch.column("id").to_pylist(), batch.column("text").to_pylist()))
        encoder = shared_encoder(params.static.encoder)
        computed = encoder.encode([texts[i] for i in corpus.ids[missing]])
        if vectors is None or vectors.shape[1] == 0:
            vectors = np.zeros((len(corpus.ids), computed.shape[1]), dtype=np.float32)
        vectors[missing] = computed
    else:
        print(f"reusing {len(corpus.ids)} stored embeddings from {folder}")
    return vectors


@flow(name="dedup", log_prints=True)
def dedup_flow(input_dir: str, out: str, overwrite: bool = False, params_file: str | None = None) -> dict:
    """Dedup INPUT_DIR into OUT (global across shards) and upsert the knowledge graph."""
    started = time.perf_counter()
    params = load_params(params_file)
    units = plan_shards(input_dir)
    section = {"dedup": dataclasses.asdict(params.dedup), "io": dataclasses.asdict(params.io),
               "vectors": dataclasses.asdict(params.vectors)}
    fingerprint = stage_fingerprint(units, section)
    with exclusive_output(out):  # a second run into OUT would break this one's staging
        if prepare(out, fingerprint, overwrite=overwrite, inputs=[input_dir]):
            print(f"{out} is up to date with its inputs; nothing to do")
            return read_manifest(out)

        # The scans write their signatures to the staging area and return none: the band tasks read them
        # from there, each only its band's columns, so no task and not this process holds the whole matrix.
        staged = signatures_folder(out, params.dedup.minhash.staging, fingerprint)
        files = [signatures_file(staged, u.index) for u in units]
        scans = wait_with_progress(scan_task.map([u.shard for u in units], unmapped(params.dedup),
                                                 unmapped(params.io.batch_rows), files,
                                                 batch_bytes=unmapped(params.io.batch_bytes),
                                                 key=[u.key for u in units]),
                                   "dedup: hash + MinHash")
        corpus = gather(scans)
        del scans  # the corpus holds everything now; the scans' id lists would double the per-document memory
        exact_kept = exact_step(corpus) if params.dedup.exact else np.arange(len(corpus.ids))
        alive = exact_kept == np.arange(len(corpus.ids))
        near_kept = None
        if params.dedup.minhash.enabled:
            alive_file = write_alive(alive, staged)
            pairs = wait_with_progress(band_task.map(unmapped(files), unmapped(alive_file),
                                                     list(range(params.dedup.minhash.bands)), unmapped(params.dedup)),
                                       "dedup: LSH bands")
            near_kept = near_step(corpus, alive, pairs)
        vectors = embeddings_task(input_dir, corpus, params)
        verdicts = decide(corpus, exact_kept, near_kept, vectors, params.dedup)
        counts = verdicts.counts
        print(f"dedup: {counts['input']} in, exact {counts['exact_dup']}, near {counts['near_dup']}, "
              f"semantic {counts['semantic_dup']} removed, {counts['kept']} kept")

        # Each write task is sent its own shard's verdicts: what travels to a worker follows the shard.
        per_shard = [shard_verdicts(corpus, verdicts, np.flatnonzero(corpus.shard_of == u.index)) for u in units]
        results = wait_with_progress(
            write_task.map([u.index for u in units], [u.shard for u in units], unmapped(out), unmapped(params),
                           [u.key for u in units], per_shard),
            f"dedup → {out}")
        require_unchanged(input_dir, units)  # every read is done; before the graph, which may be a server's
        # The local index goes into the dataset being built, so it is published with the rest.
        graph = graph_task(str(building(out)), corpus, verdicts, vectors, params)
        extra = {"dedup": counts, "graph": graph}
        manifest = stage_manifest(STAGE, input_dir, fingerprint, section, results, time.perf_counter() - started, extra)
        committed = commit(out, [u.key for u in units], manifest)
        if params.dedup.minhash.staging is not None:
            drop_signatures(staged)
        return committed


def run_dedup(input_dir: str, out: str, **kwargs) -> dict:
    params = load_params(kwargs.get("params_file"))
    plan_shards(input_dir)
    return dedup_flow.with_options(task_runner=task_runner(params.flow))(input_dir, out, **kwargs)
