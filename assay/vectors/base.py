"""The vector store and knowledge graph: one interface, two backends.

The graph (DESIGN.md, "Vector store and knowledge graph")::

    Document (vector; doc_id, kind, lang, source, path, quality, status)
      ── fromSource  ──▶ Source (name)
      ── inCluster   ──▶ Cluster (cluster_id, kind exact|near|semantic, size)   (0..n)
      ── duplicateOf ──▶ Document (the kept one)                              (0..1)

Write semantics, the same for every backend:

* `upsert_documents` is idempotent: a document is keyed by `doc_id` (uuid5 of
  it in Weaviate) and a second upsert replaces the first, properties, vector
  and references alike. `DocumentRecord.clusters` is the whole list of the
  document's clusters; `vector=None` means the document has no vector.
  Sources are created on the fly; a cluster a document names that does not
  exist yet is created as a placeholder (kind "unknown", size 0) until
  `upsert_clusters` writes it. `duplicate_of` may name a document that comes
  later (in this call or a later one).
* `upsert_clusters` writes the Cluster nodes (kind, size) and links the
  listed members that are already stored (it adds links, never removes them).

Scores are cosine similarities (1 - cosine distance). `where` is a dict of
equality filters on Document properties (`None` matches a missing value).
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from assay.errors import AssayError

#: Scalar properties of a Document, in schema order; `where` filters may name these.
DOCUMENT_PROPERTIES = ("doc_id", "kind", "lang", "source", "path", "quality", "status")
TEXT_PROPERTIES = ("doc_id", "kind", "lang", "source", "path", "status")
CLUSTER_KINDS = ("exact", "near", "semantic")
#: Kind of a cluster a document named before `upsert_clusters` wrote it.
PLACEHOLDER_KIND = "unknown"

#: The uuid5 namespace per collection (Weaviate ids; the local store keys by name).
_NAMESPACES = {"Document": "", "Source": "Source:", "Cluster": "Cluster:"}


def object_uuid(collection: str, key: str) -> str:
    """The deterministic object id of `key` in `collection`.

    Identical to `weaviate.util.generate_uuid5(key, namespace)`:
    uuid5(NAMESPACE_DNS, namespace + key), with namespace "" for documents, so
    a Document's id is `generate_uuid5(doc_id)`.
    """
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, _NAMESPACES[collection] + str(key)))


@dataclass
class DocumentRecord:
    doc_id: str
    vector: np.ndarray | None = None
    kind: str | None = None
    lang: str | None = None
    source: str | None = None
    path: str | None = None
    quality: float | None = None
    #: "kept" or the drop reason ("exact_dup", "near_dup", "semantic_dup", ...).
    status: str | None = None
    clusters: list[str] = field(default_factory=list)
    duplicate_of: str | None = None

    def properties(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DOCUMENT_PROPERTIES}


@dataclass
class ClusterRecord:
    cluster_id: str
    kind: str
    #: Documents to link to the cluster on upsert. Reads (`get_cluster`) fill
    #: it; `clusters_of` leaves it empty (use `cluster_members`).
    members: list[str] = field(default_factory=list)
    #: Defaults to len(members).
    size: int | None = None

    def __post_init__(self) -> None:
        if self.size is None:
            self.size = len(self.members)


@dataclass
class Hit:
    doc_id: str
    #: Cosine similarity to the query, in [-1, 1].
    score: float
    source: str | None
    status: str | None
    #: All Document properties (DOCUMENT_PROPERTIES).
    properties: dict[str, Any] = field(default_factory=dict)


def check_document(record: DocumentRecord) -> None:
    if not isinstance(record.doc_id, str) or not record.doc_id:
        raise AssayError(f"a document needs a non-empty string doc_id, not {record.doc_id!r}")
    for name in TEXT_PROPERTIES:
        value = getattr(record, name)
        if value is not None and not isinstance(value, str):
            raise AssayError(f"document {record.doc_id}: {name} must be a string or None, not {value!r}")
    if record.quality is not None and not isinstance(record.quality, (int, float, np.floating)):
        raise AssayError(f"document {record.doc_id}: quality must be a number or None, not {record.quality!r}")
    if record.duplicate_of == record.doc_id:
        raise AssayError(f"document {record.doc_id} cannot be a duplicate of itself")


def check_cluster(record: ClusterRecord) -> None:
    if not isinstance(record.cluster_id, str) or not record.cluster_id:
        raise AssayError(f"a cluster needs a non-empty string cluster_id, not {record.cluster_id!r}")
    if record.kind not in CLUSTER_KINDS:
        raise AssayError(f"cluster {record.cluster_id}: kind must be one of {', '.join(CLUSTER_KINDS)}, not {record.kind!r}")


def check_where(where: dict[str, Any] | None) -> dict[str, Any]:
    """Validated equality filters: known property names, scalar values."""
    if not where:
        return {}
    for key, value in where.items():
        if key not in DOCUMENT_PROPERTIES:
            raise AssayError(f"cannot filter on {key!r}: filters take Document properties ({', '.join(DOCUMENT_PROPERTIES)})")
        if value is not None and not isinstance(value, (str, int, float)):
            raise AssayError(f"filter {key}={value!r}: values are strings, numbers or None")
        if key in TEXT_PROPERTIES and value is not None and not isinstance(value, str):
            raise AssayError(f"filter {key}={value!r}: {key} is a string property")
    return dict(where)


def as_query_vector(vector: Any, dim: int | None = None) -> np.ndarray:
    """A float32 unit vector; AssayError on a wrong shape, NaN or zero vector."""
    array = np.asarray(vector, dtype=np.float32).reshape(-1)
    if dim is not None and array.shape[0] != dim:
        raise AssayError(f"vector has dimension {array.shape[0]}, the store holds {dim}")
    norm = float(np.linalg.norm(array))
    if not np.isfinite(norm) or norm == 0.0:
        raise AssayError("vector is zero or not finite; cosine similarity needs a non-zero vector")
    return array / norm


def overlap_from_memberships(pairs: Iterable[tuple[str, str | None]]) -> list[tuple[str, str, int]]:
    """(cluster_id, source) pairs → [(source_a, source_b, shared clusters)], a < b.

    Two sources share a cluster when both have a document in it; pairs are
    sorted by count (descending), then by name.
    """
    by_cluster: dict[str, set[str]] = {}
    for cluster_id, source in pairs:
        if source is not None:
            by_cluster.setdefault(cluster_id, set()).add(source)
    counts: Counter[tuple[str, str]] = Counter()
    for sources in by_cluster.values():
        for a, b in combinations(sorted(sources), 2):
            counts[(a, b)] += 1
    return sorted(((a, b, n) for (a, b), n in counts.items()), key=lambda t: (-t[2], t[0], t[1]))


def counts_by_source(pairs: Iterable[tuple[str | None, int]]) -> list[tuple[str, int]]:
    """(source, documents) pairs → [(source, documents)], most documents first, then by name.

    Documents without a source (None) belong to no Source node and are left out; a source
    named in several pairs gets their sum.
    """
    counts: Counter[str] = Counter()
    for source, n in pairs:
        if source is not None:
            counts[source] += int(n)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class VectorStore(ABC):
    """Documents with vectors, their sources and duplicate clusters."""

    # --- writes ---------------------------------------------------------------

    @abstractmethod
    def upsert_documents(self, records: Iterable[DocumentRecord]) -> int:
        """Insert or replace documents (keyed by doc_id); returns how many were written."""

    @abstractmethod
    def upsert_clusters(self, records: Iterable[ClusterRecord]) -> int:
        """Insert or replace Cluster nodes and link their stored members; returns how many."""

    # --- vector queries ---------------------------------------------------------

    @abstractmethod
    def near(self, vector: Sequence[float] | np.ndarray, k: int = 10, where: dict[str, Any] | None = None) -> list[Hit]:
        """The k documents most cosine-similar to `vector` that match `where`, best first."""

    def near_many(self, vectors: np.ndarray, k: int = 10, where: dict[str, Any] | None = None) -> list[list[Hit]]:
        """`near` for each row of `vectors` (backends may batch it)."""
        return [self.near(v, k, where) for v in np.asarray(vectors)]

    @abstractmethod
    def near_id(self, doc_id: str, k: int = 10, where: dict[str, Any] | None = None) -> list[Hit]:
        """The k nearest neighbours of a stored document, the document itself excluded."""

    # --- graph queries ------------------------------------------------------------

    @abstractmethod
    def get(self, doc_id: str, *, with_vector: bool = True) -> DocumentRecord | None:
        """The document with its clusters and what it duplicates, or None. `with_vector=False` leaves
        `vector` None: a graph question then reads no vector index, and fetches no vector over the network."""

    @abstractmethod
    def get_cluster(self, cluster_id: str) -> ClusterRecord | None:
        """The cluster with its members filled in, or None."""

    @abstractmethod
    def cluster_members(self, cluster_id: str) -> list[str]:
        """doc_ids in the cluster, sorted."""

    @abstractmethod
    def clusters_of(self, doc_id: str) -> list[ClusterRecord]:
        """The clusters of a document (members left empty), sorted by cluster_id."""

    @abstractmethod
    def duplicates_of(self, doc_id: str) -> list[str]:
        """doc_ids whose duplicateOf is `doc_id`, sorted."""

    @abstractmethod
    def source_overlap(self) -> list[tuple[str, str, int]]:
        """[(source_a, source_b, clusters with documents of both)], most shared first."""

    @abstractmethod
    def source_counts(self) -> list[tuple[str, int]]:
        """[(source, documents it has in the graph)], most documents first, then by name."""

    @abstractmethod
    def count(self) -> int:
        """Number of documents."""

    # --- lifecycle --------------------------------------------------------------

    @property
    @abstractmethod
    def exact(self) -> bool:
        """True when `near` returns the exact top k (brute force), False for ANN."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def drop(self) -> None:
        """Delete everything this store holds (its directory or collections) and close it."""

    def __enter__(self) -> "VectorStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def open_store(params, dataset_dir: str | os.PathLike, *, read_only: bool = False) -> VectorStore:
    """The configured store: Weaviate when WEAVIATE_URL is set, else `params.backend`.

    `params` is an `assay.config.VectorParams`. The local store lives at
    `dataset_dir / params.local_path`, always inside the dataset (VectorParams refuses an absolute
    or `..` local_path, and the names the dataset itself uses). `read_only`: the
    local store is read as it is and never written: a query must not rebuild, clean or save a
    store that DVC tracks (nor remove a concurrent writer's unfinished generation), and a
    local store that does not exist is an error rather than an empty store.
    """
    url = os.environ.get("WEAVIATE_URL") or None
    backend = "weaviate" if url else params.backend
    if backend == "local":
        from assay.vectors.local import POINTER, LocalVectorStore

        path = Path(dataset_dir) / params.local_path
        if read_only and not (path / POINTER).is_file():
            raise AssayError(f"{dataset_dir}: holds no vector store ({path} has no {POINTER}); the graph is "
                             "written by `assay run dedup`")
        return LocalVectorStore(path, exact_max=params.exact_max, read_only=read_only)
    if backend == "weaviate":
        url = url or params.weaviate_url
        if not url:
            raise AssayError("vectors.backend is weaviate but neither WEAVIATE_URL nor vectors.weaviate_url is set")
        from assay.vectors.weaviate_store import WeaviateVectorStore

        return WeaviateVectorStore(url, prefix=params.collection_prefix, batch_size=params.batch_size)
    from assay.config import VECTOR_BACKENDS

    raise AssayError(f"vectors.backend must be one of {', '.join(VECTOR_BACKENDS)}, not {params.backend!r}")
