"""Dedup, global across shards: exact, then near (MinHash LSH), then semantic.

The stage is a map-reduce:
- map (one task per shard): per document, the normalised content hash and
  the MinHash signature, plus the few columns the decisions need;
- reduce: exact duplicates by hash; LSH candidate pairs band by band (each
  band is independent, so bands are separate tasks that a Dask or Ray runner
  can spread) and union-find clusters; SemDeDup on the stored embeddings;
  the signatures do not travel through the reduce: the map writes them to
  the output's staging area, one column per band, and each band task reads
  its band's columns from there (a local path, or an fsspec URL);
- map again: each shard is written out without its duplicates, with a
  `cluster` column, and a decision for every input row.
Documents dropped at one step are not considered at the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.config import DedupParams, MinHashParams, Params
from assay.errors import AssayError
from assay.schema import DECISION_SCHEMA, DOCUMENT_SCHEMA
from assay.shards import MANIFEST, iter_batches, open_shard, shard_batches, staging_dir
from assay.stages.shard_stage import open_planned
from assay.staging import UnitResult, UnitWriter, finished_unit
from filters.exact_dedup import choose_kept, normalized_hashes
from filters.minhash import SIG_DTYPE, band_keys, candidate_pairs_for_band, clusters, has_shingles, signatures
from assay.stages.graph import KEPT
from filters.semantic_dedup import REASON as SEMANTIC_DUP
from filters.semantic_dedup import semantic_duplicates

STAGE = "dedup"
EXACT_DUP = "exact_dup"
NEAR_DUP = "near_dup"
#: A document's status in the graph: kept, or the reason dedup dropped it (`assay query --status`).
STATUSES = (KEPT, EXACT_DUP, NEAR_DUP, SEMANTIC_DUP)
CLUSTER = "cluster"
EMBEDDINGS = "embeddings"
#: The scans' signatures, in the output's staging area (removed with it at commit).
SIGNATURES = "dedup-signatures"
ALIVE = "alive.bits"
SHINGLED = "shingled"


@dataclass
class ShardScan:
    """What the reduce steps need from one shard: small, no text."""

    ids: list[str]
    kinds: list[str]
    sources: list[str]
    langs: list[str]
    paths: list[str]
    quality: np.ndarray
    hashes: np.ndarray
    signatures: np.ndarray | None


def scan_shard(shard: str, params: DedupParams, batch_rows: int, signatures_to: str | None = None,
               batch_bytes: int | None = None, key: str | None = None) -> ShardScan:
    """One shard's scan. With `signatures_to` (a file path or fsspec URL) the MinHash signatures are
    written there by band (`write_signatures`) and the scan returned carries none. `batch_bytes` bounds
    the text shingled at once (`io.batch_bytes`); `key`, the stage's unit key for the shard, has the
    scan refuse a shard replaced since the stage planned its run."""
    ids, kinds, sources, langs, paths, quality, hashes, sigs = [], [], [], [], [], [], [], []
    parquet = open_shard(shard, shard, DOCUMENT_SCHEMA) if key is None else open_planned(shard, key)
    has_quality = "quality" in parquet.schema_arrow.names
    columns = ["id", "text", "kind", "source", "lang", "path"] + (["quality"] if has_quality else [])
    for batch in shard_batches(parquet, shard, batch_size=batch_rows, columns=columns, max_bytes=batch_bytes):
        ids += batch.column("id").to_pylist()
        kinds += batch.column("kind").to_pylist()
        sources += batch.column("source").to_pylist()
        langs += batch.column("lang").to_pylist()
        paths += batch.column("path").to_pylist()
        q = batch.column("quality").to_numpy(zero_copy_only=False) if has_quality else np.full(batch.num_rows, np.nan)
        quality.append(np.asarray(q, dtype=np.float64))
        hashes.append(normalized_hashes(batch.column("text"), batch.column("kind")))
        if params.minhash.enabled:
            sigs.append(signatures(batch.column("text"), params.minhash))
    stacked = None
    if params.minhash.enabled:
        width = params.minhash.bands * params.minhash.rows
        stacked = np.concatenate(sigs) if sigs else np.zeros((0, width), dtype=SIG_DTYPE)
        if signatures_to is not None:
            write_signatures(stacked, signatures_to, params.minhash)
            stacked = None
    return ShardScan(
        ids, kinds, sources, langs, paths,
        np.concatenate(quality) if quality else np.zeros(0),
        np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64),
        stacked,
    )


def signatures_folder(out_dir: str, staging: str | None = None, run_key: str = "") -> str:
    """Where the scans stage their signatures: .OUT.staging/dedup-signatures, beside OUT (a path on
    a filesystem every worker shares), removed with the staging area at commit; or, with `staging`
    (`dedup.minhash.staging`, an fsspec URL), a folder of this run's own under it, named by OUT
    and `run_key` (the stage's fingerprint): a rerun into the same OUT finds its own, and two runs
    into two OUTs never share one."""
    if staging is None:
        return str(staging_dir(out_dir) / SIGNATURES)
    name = hashlib.blake2b(f"{Path(out_dir).resolve()}\0{run_key}".encode(), digest_size=8).hexdigest()
    return f"{staging.rstrip('/')}/{SIGNATURES}-{name}"


def drop_signatures(folder: str) -> None:
    """Remove a run's staged signatures once the stage has committed (an fsspec URL's folder; the
    one beside OUT went with the staging area)."""
    fs, path = fsspec.core.url_to_fs(folder)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def signatures_file(folder: str, index: int) -> str:
    return f"{folder}/{index:05d}.parquet"


def _band_column(band: int) -> str:
    return f"band_{band:03d}"


def _atomic_write(path: str, write) -> None:
    """`write(fs, tmp_path)`, then a rename: a reader never sees a half-written file."""
    fs, target = fsspec.core.url_to_fs(path)
    fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        write(fs, tmp)
        fs.mv(tmp, target)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def write_signatures(sigs: np.ndarray, path: str, params: MinHashParams) -> None:
    """One shard's signatures as Parquet with one column per band (fixed-size lists of `rows` uint32) and
    a `shingled` flag, so that a band's reader fetches that band's 32 B a document, not all 448."""
    width, bands = params.rows, params.bands
    if sigs.ndim != 2 or sigs.shape[1] != bands * width:
        raise AssayError(f"signatures of shape {sigs.shape}; expected (n, {bands * width}) for {bands} bands x {width} rows")
    columns = {SHINGLED: pa.array(has_shingles(sigs))}
    for band in range(bands):
        flat = np.ascontiguousarray(sigs[:, band * width : (band + 1) * width]).reshape(-1)
        columns[_band_column(band)] = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.uint32()), width)
    table = pa.table(columns)
    # Signatures are hash values: compression would cost time and save nothing.
    _atomic_write(path, lambda fs, tmp: pq.write_table(table, tmp, filesystem=fs, compression="none"))


def write_alive(alive: np.ndarray, folder: str) -> str:
    """The rows still in the running after exact dedup, one bit a document, beside the signatures: the
    count as 8 bytes little-endian, then the bits packed.

    Not `np.save`: `np.load` parses its header with `ast.literal_eval`, and CPython 3.11's AST constructor
    is not thread-safe; band tasks reading this file at once on the thread runner failed now and then with
    "SystemError: AST constructor recursion depth mismatch" (a clean-clone `make test`, 2026-12-07).
    """
    path = f"{folder}/{ALIVE}"

    def write(fs, tmp):
        with fs.open(tmp, "wb") as handle:
            handle.write(len(alive).to_bytes(8, "little"))
            handle.write(np.packbits(alive.astype(bool)).tobytes())

    _atomic_write(path, write)
    return path


def read_alive(path: str) -> np.ndarray:
    fs, target = fsspec.core.url_to_fs(path)
    with fs.open(target, "rb") as handle:
        data = handle.read()
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or len(data) - 8 != (n + 7) // 8:
        raise AssayError(f"{path}: damaged ({len(data)} bytes, not the {8 + (n + 7) // 8} its count says); "
                         "rerun the dedup stage")
    return np.unpackbits(np.frombuffer(data, np.uint8, offset=8), count=n).astype(bool)


def staged_band_pairs(files: list[str], alive_file: str, band: int, params: DedupParams) -> np.ndarray:
    """`band_pairs` from the staged signatures: reads only this band's column (and the shingled flag) of each
    shard's file, in shard order, so the task's input is 32 B a document whatever the number of bands."""
    if not 0 <= band < params.minhash.bands:
        raise ValueError(f"band {band} outside 0..{params.minhash.bands - 1}")
    alive = read_alive(alive_file)
    width = params.minhash.rows
    rows, keys, start = [], [], 0
    for path in files:
        fs, target = fsspec.core.url_to_fs(path)
        with fs.open(target, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            wanted = [SHINGLED, _band_column(band)]
            missing = [c for c in wanted if c not in parquet.schema_arrow.names]
            if missing:
                raise AssayError(f"{path}: staged signatures without column(s) {', '.join(missing)}")
            table = parquet.read(columns=wanted)
        n = table.num_rows
        if start + n > len(alive):
            raise AssayError(f"{path}: signatures past the {len(alive)} rows of {alive_file}")
        take = alive[start : start + n] & table.column(SHINGLED).to_numpy()
        values = table.column(1).combine_chunks().flatten().to_numpy().reshape(n, width)[take]
        rows.append(start + np.flatnonzero(take))
        keys.append(band_keys(values, band))
        start += n
    if start != len(alive):
        raise AssayError(f"{len(files)} signature files hold {start} rows; {alive_file} has {len(alive)}")
    if not rows:
        return np.empty((0, 2), dtype=np.int64)
    # band_keys is row by row, so keys per shard, concatenated, are band_pairs' keys of the whole corpus.
    return candidate_pairs_for_band(np.concatenate(rows), np.concatenate(keys))


@dataclass
class Corpus:
    """Every input document's scan, concatenated in shard order."""

    ids: np.ndarray
    kinds: np.ndarray
    sources: np.ndarray
    langs: np.ndarray
    paths: np.ndarray
    quality: np.ndarray
    hashes: np.ndarray
    signatures: np.ndarray | None
    shard_of: np.ndarray


def gather(scans: list[ShardScan]) -> Corpus:
    """The scans concatenated in shard order. The signatures move: each scan's array is copied into the
    corpus's and then released, so the peak is the corpus's signatures plus one shard's, and the caller, who
    keeps its scans, does not hold every signature twice (448 B a document; `bench/dedup_memory.py`)."""
    signatures = None
    if scans and all(s.signatures is not None for s in scans):
        if len(scans) == 1:
            signatures = scans[0].signatures
        else:
            first = scans[0].signatures
            signatures = np.empty((sum(len(s.signatures) for s in scans), first.shape[1]), dtype=first.dtype)
            start = 0
            for s in scans:
                signatures[start : start + len(s.signatures)] = s.signatures
                start += len(s.signatures)
                s.signatures = None
    for s in scans:
        s.signatures = None
    return Corpus(
        ids=np.array([i for s in scans for i in s.ids], dtype=object),
        kinds=np.array([k for s in scans for k in s.kinds], dtype=object),
        sources=np.array([k for s in scans for k in s.sources], dtype=object),
        langs=np.array([k for s in scans for k in s.langs], dtype=object),
        paths=np.array([k for s in scans for k in s.paths], dtype=object),
        quality=np.concatenate([s.quality for s in scans]) if scans else np.zeros(0),
        hashes=np.concatenate([s.hashes for s in scans]) if scans else np.zeros(0),
        signatures=signatures,
        shard_of=np.concatenate([np.full(len(s.ids), i) for i, s in enumerate(scans)]) if scans else np.zeros(0, int),
    )


def _kept_rows(groups: np.ndarray, alive: np.ndarray, corpus: Corpus) -> np.ndarray:
    """Row of the kept member of each row's group; rows not alive are their own group."""
    groups = np.where(alive, groups, -1 - np.arange(len(groups)))  # singletons
    return choose_kept(groups, corpus.ids, corpus.quality)


def exact_step(corpus: Corpus) -> np.ndarray:
    """Row of the kept copy for every row (itself when kept)."""
    _, groups = np.unique(corpus.hashes, return_inverse=True)
    return _kept_rows(groups.reshape(-1), np.ones(len(groups), dtype=bool), corpus)


def band_pairs(corpus: Corpus, alive: np.ndarray, band: int, params: DedupParams) -> np.ndarray:
    """LSH candidate pairs (global rows) from one band, among alive rows with shingles."""
    if not 0 <= band < params.minhash.bands:
        raise ValueError(f"band {band} outside 0..{params.minhash.bands - 1}")
    rows = np.flatnonzero(alive & has_shingles(corpus.signatures))
    width = params.minhash.rows
    # Only this band's columns of the rows (32 B a document; whole signatures would be 448 B, per concurrent band).
    values = corpus.signatures[rows, band * width : (band + 1) * width]
    return candidate_pairs_for_band(rows, band_keys(values, band))


def near_step(corpus: Corpus, alive: np.ndarray, pairs: list[np.ndarray]) -> np.ndarray:
    """Row of the kept document of each alive row's near-duplicate cluster."""
    all_pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)
    return _kept_rows(clusters(len(corpus.ids), all_pairs), alive, corpus)


def find_embeddings(input_dir: str | Path, max_hops: int = 8) -> Path | None:
    """The nearest `embeddings/` folder: the dataset's own, or an upstream stage's (by manifest)."""
    here = Path(input_dir)
    for _ in range(max_hops):
        if (here / EMBEDDINGS).is_dir():
            return here / EMBEDDINGS
        try:
            inputs = json.loads((here / MANIFEST).read_text()).get("inputs") or []
        except (OSError, json.JSONDecodeError):
            return None
        upstream = next((i.get("dataset") for i in inputs if isinstance(i, dict) and i.get("dataset")), None)
        if upstream is None:
            return None
        here = Path(upstream)
    return None


def load_vectors(folder: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(vectors for `ids` in order, found mask); streamed, only the wanted rows kept."""
    wanted = {doc_id: row for row, doc_id in enumerate(ids)}
    vectors: np.ndarray | None = None
    found = np.zeros(len(ids), dtype=bool)
    value_set = pa.array(list(wanted), pa.string())
    for batch in iter_batches(folder, filter_ids=None):
        batch = batch.filter(pc.is_in(batch.column("id"), value_set=value_set))
        if batch.num_rows == 0:
            continue
        dim = batch.schema.field("vector").type.list_size
        if vectors is None:
            vectors = np.zeros((len(ids), dim), dtype=np.float32)
        flat = batch.column("vector").values.to_numpy(zero_copy_only=False).reshape(-1, dim)
        rows = np.array([wanted[i] for i in batch.column("id").to_pylist()])
        vectors[rows] = flat
        found[rows] = True
    return (vectors if vectors is not None else np.zeros((len(ids), 0), np.float32)), found


@dataclass
class Verdicts:
    """The reduce's answer, per corpus row."""

    reason: list[str | None]
    duplicate_of: np.ndarray  # row, -1 when kept
    near_cluster: np.ndarray  # row of the kept doc of its near cluster (-1: none)
    semantic_cluster: np.ndarray  # k-means cluster, -1 when not embedded
    similarity: np.ndarray  # semantic max similarity (NaN when not computed)
    counts: dict[str, int]


def decide(corpus: Corpus, exact_kept: np.ndarray, near_kept: np.ndarray | None,
           vectors: np.ndarray | None, params: DedupParams) -> Verdicts:
    n = len(corpus.ids)
    reason: list[str | None] = [None] * n
    duplicate_of = np.full(n, -1, dtype=np.int64)
    counts = {"input": n, EXACT_DUP: 0, NEAR_DUP: 0, SEMANTIC_DUP: 0}
    alive = np.ones(n, dtype=bool)
    if params.exact:
        dup = exact_kept != np.arange(n)
        for row in np.flatnonzero(dup):
            reason[row], duplicate_of[row] = EXACT_DUP, exact_kept[row]
        alive &= ~dup
        counts[EXACT_DUP] = int(dup.sum())
    near_cluster = np.full(n, -1, dtype=np.int64)
    if near_kept is not None:
        dup = alive & (near_kept != np.arange(n)) & (near_kept >= 0)
        sizes = np.bincount(near_kept[near_kept >= 0], minlength=n)
        in_cluster = alive & (near_kept >= 0) & (sizes[np.maximum(near_kept, 0)] > 1)
        near_cluster[in_cluster] = near_kept[in_cluster]
        for row in np.flatnonzero(dup):
            reason[row], duplicate_of[row] = NEAR_DUP, near_kept[row]
        alive &= ~dup
        counts[NEAR_DUP] = int(dup.sum())
    semantic_cluster = np.full(n, -1, dtype=np.int64)
    similarity = np.full(n, np.nan)
    if vectors is not None and params.semantic.enabled:
        if params.semantic.keep not in ("farthest", "quality"):
            raise AssayError(f"params: dedup.semantic.keep = {params.semantic.keep!r}; expected farthest or quality")
        rows = np.flatnonzero(alive)
        result = semantic_duplicates(vectors[rows], params.semantic, corpus.quality[rows])
        semantic_cluster[rows] = result.cluster
        similarity[rows] = result.max_similarity
        for j in np.flatnonzero(~result.keep):
            row = rows[j]
            reason[row], duplicate_of[row] = SEMANTIC_DUP, rows[result.duplicate_of[j]]
        counts[SEMANTIC_DUP] = int((~result.keep).sum())
    counts["kept"] = n - sum(counts[k] for k in (EXACT_DUP, NEAR_DUP, SEMANTIC_DUP))
    return Verdicts(reason, duplicate_of, near_cluster, semantic_cluster, similarity, counts)


@dataclass
class ShardVerdicts:
    """What one shard's write needs of the reduce's answer, per row of that shard, in order.

    A write task is sent this, not the corpus and its verdicts: on Dask or Ray each task's
    arguments travel to its worker, and the whole corpus's would grow with the corpus.
    """

    reason: list[str | None]
    cluster: list[str | None]  # id of the kept document of its near-duplicate cluster
    duplicate_of: list[str | None]  # id of the document it duplicates
    similarity: np.ndarray  # SemDeDup's max similarity, NaN when not computed


def shard_verdicts(corpus: Corpus, verdicts: Verdicts, rows: np.ndarray) -> ShardVerdicts:
    """The verdicts of the corpus rows `rows` (one shard's, in its order)."""
    ids = corpus.ids
    return ShardVerdicts(
        reason=[verdicts.reason[r] for r in rows],
        cluster=[ids[c] if c >= 0 else None for c in verdicts.near_cluster[rows]],
        duplicate_of=[ids[d] if d >= 0 else None for d in verdicts.duplicate_of[rows]],
        similarity=verdicts.similarity[rows],
    )


def write_shard(index: int, shard: str, out_dir: str, params: Params, key: str,
                verdicts: ShardVerdicts) -> UnitResult:
    """One input shard out: kept rows with a `cluster` column, a decision per row."""
    done = finished_unit(out_dir, key)
    if done is not None:
        return done
    started = time.perf_counter()
    parquet = open_planned(shard, key)
    if parquet.metadata.num_rows != len(verdicts.reason):
        raise AssayError(f"{shard}: {parquet.metadata.num_rows} rows, but the reduce judged {len(verdicts.reason)}; "
                         "the shard changed during the run")
    schema = parquet.schema_arrow
    if CLUSTER not in schema.names:
        schema = schema.append(pa.field(CLUSTER, pa.string()))
    writer = UnitWriter(out_dir, key, schema, target_bytes=params.io.shard_bytes)
    offset = 0
    try:
        for batch in shard_batches(parquet, shard, batch_size=params.io.batch_rows, max_bytes=params.io.batch_bytes):
            n = batch.num_rows
            part = slice(offset, offset + n)
            offset += n
            reasons = verdicts.reason[part]
            keep = np.array([r is None for r in reasons])
            out = (batch.append_column(CLUSTER, pa.array(verdicts.cluster[part], pa.string()))
                   if CLUSTER not in batch.schema.names else batch)
            writer.docs.write(out.filter(pa.array(keep)))
            details = [None if d is None else f"duplicate of {d}" for d in verdicts.duplicate_of[part]]
            scores = [[("semantic_similarity", float(x))] if not np.isnan(x) else None
                      for x in verdicts.similarity[part]]
            writer.write_decisions(pa.RecordBatch.from_arrays(
                [batch.column("id"), pa.array([STAGE] * n, pa.string()), pa.array(keep), pa.array(reasons, pa.string()),
                 pa.array(scores, DECISION_SCHEMA.field("scores").type), pa.array(details, pa.string())],
                schema=DECISION_SCHEMA))
    except BaseException:
        writer.abort()
        raise
    return writer.finish(bytes_in=Path(shard).stat().st_size, seconds=time.perf_counter() - started)
