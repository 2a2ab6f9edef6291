"""The Weaviate backend (official `weaviate-client` v4; server 1.27 or later).

Collections (names carry `collection_prefix`, e.g. "T1234Document")::

    Source   name                                   no vectors of its own
    Cluster  cluster_id, kind, size                 no vectors of its own
    Document doc_id, kind, lang, source, path, quality, status
             fromSource → Source, inCluster → Cluster, duplicateOf → Document
             self-provided vectors, HNSW, cosine distance

Text properties use FIELD tokenization, so `where={"status": "near_dup"}` is
an exact match (the default "word" tokenization would split "near_dup" and
match "near" too), and the inverted index keeps null state, so
`where={"quality": None}` works.

Object ids are `generate_uuid5(doc_id)` for documents and
`generate_uuid5(key, "Source:" | "Cluster:")` for the others
(`assay.vectors.base.object_uuid`), so re-importing replaces objects in place.

A document upsert is two batches: the objects (properties, vector, and the
fromSource/inCluster references, whose targets are created first), then the
duplicateOf references, added once every object of the call exists. A batch
import replaces the whole object, references included, so an upsert resets
the document's references to what the record says. Failed objects and
references are retried a few times; then the first error becomes an
AssayError.

Everything below `WeaviateVectorStore` that builds requests (URL parsing,
collection configs, filters, properties) is plain functions, tested without a
server in tests/vectors/test_weaviate_requests.py.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from assay.errors import AssayError
from assay.vectors.base import (
    DOCUMENT_PROPERTIES,
    PLACEHOLDER_KIND,
    ClusterRecord,
    DocumentRecord,
    Hit,
    VectorStore,
    as_query_vector,
    check_cluster,
    check_document,
    check_where,
    chunked,
    counts_by_source,
    object_uuid,
    overlap_from_memberships,
)

DEFAULT_HTTP_PORT = 8080
DEFAULT_GRPC_PORT = 50051
#: Records buffered per upsert round (objects are sent in batches of batch_size).
ROUND = 5000
#: Page size for fetches. A filtered fetch that fills one page is not paged on by
#: offset (Weaviate caps offset + limit at QUERY_MAXIMUM_RESULTS, 10,000 by default,
#: and would silently stop there) but redone as a cursor scan (``after=``).
PAGE = 1000
RETRIES = 3


# --- request building (no server needed) ------------------------------------------------


@dataclass(frozen=True)
class ConnectionSpec:
    """Keyword arguments for `weaviate.connect_to_custom` (without auth)."""

    http_host: str
    http_port: int
    http_secure: bool
    grpc_host: str
    grpc_port: int
    grpc_secure: bool


def parse_url(url: str, grpc_port: int | str | None = None) -> ConnectionSpec:
    """http(s)://host[:port] → connection parameters.

    The REST port defaults to 8080 for http and 443 for https; gRPC is on the
    same host, port `grpc_port` (else WEAVIATE_GRPC_PORT, else 50051), secure
    when the URL is https.
    """
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise AssayError(f"Weaviate URL {url!r}: the scheme must be http or https")
    try:
        port = parts.port
    except ValueError:
        raise AssayError(f"Weaviate URL {url!r}: bad port") from None
    host = parts.hostname
    if not host:
        raise AssayError(f"Weaviate URL {url!r}: no host")
    if parts.path not in ("", "/"):
        raise AssayError(f"Weaviate URL {url!r}: give host and port only, no path")
    if ":" in host:  # IPv6: the client builds "scheme://host:port" and "host:port"
        host = f"[{host}]"
    secure = parts.scheme == "https"
    if grpc_port is None:
        grpc_port = os.environ.get("WEAVIATE_GRPC_PORT") or DEFAULT_GRPC_PORT
    try:
        grpc = int(grpc_port)
    except ValueError:
        raise AssayError(f"WEAVIATE_GRPC_PORT must be a port number, not {grpc_port!r}") from None
    return ConnectionSpec(
        http_host=host,
        http_port=port or (443 if secure else DEFAULT_HTTP_PORT),
        http_secure=secure,
        grpc_host=host,
        grpc_port=grpc,
        grpc_secure=secure,
    )


def check_prefix(prefix: str) -> str:
    if prefix and not (prefix[0].isascii() and prefix[0].isalpha() and all(c.isascii() and (c.isalnum() or c == "_") for c in prefix)):
        raise AssayError(f"collection_prefix {prefix!r}: letters, digits and _ only, starting with a letter")
    return prefix[:1].upper() + prefix[1:]


def collection_names(prefix: str = "") -> dict[str, str]:
    """Logical name → Weaviate collection name (capitalised, as Weaviate stores it)."""
    prefix = check_prefix(prefix)
    return {name: f"{prefix}{name}" for name in ("Source", "Cluster", "Document")}


def collection_configs(prefix: str = "") -> list[dict[str, Any]]:
    """`client.collections.create(**kwargs)` for Source, Cluster, Document, in that order.

    The self-reference Document.duplicateOf is added after creation
    (`self_reference()`), since the target must exist when a reference
    property is defined.
    """
    from weaviate.classes.config import Configure, DataType, Property, ReferenceProperty, Tokenization, VectorDistances

    names = collection_names(prefix)

    def text(name: str) -> Property:
        return Property(name=name, data_type=DataType.TEXT, tokenization=Tokenization.FIELD, index_searchable=False)

    def inverted():
        return Configure.inverted_index(index_null_state=True)  # `where={"quality": None}` needs it

    return [
        dict(
            name=names["Source"],
            properties=[text("name")],
            vector_config=Configure.Vectors.self_provided(),
            inverted_index_config=inverted(),
        ),
        dict(
            name=names["Cluster"],
            properties=[text("cluster_id"), text("kind"), Property(name="size", data_type=DataType.INT)],
            vector_config=Configure.Vectors.self_provided(),
            inverted_index_config=inverted(),
        ),
        dict(
            name=names["Document"],
            properties=[
                *(text(name) for name in ("doc_id", "kind", "lang", "source", "path")),
                Property(name="quality", data_type=DataType.NUMBER),
                text("status"),
            ],
            references=[
                ReferenceProperty(name="fromSource", target_collection=names["Source"]),
                ReferenceProperty(name="inCluster", target_collection=names["Cluster"]),
            ],
            vector_config=Configure.Vectors.self_provided(
                vector_index_config=Configure.VectorIndex.hnsw(distance_metric=VectorDistances.COSINE),
            ),
            inverted_index_config=inverted(),
        ),
    ]


def self_reference(prefix: str = ""):
    from weaviate.classes.config import ReferenceProperty

    return ReferenceProperty(name="duplicateOf", target_collection=collection_names(prefix)["Document"])


def build_filter(where: dict[str, Any] | None, exclude_uuid: str | None = None):
    """Equality filters (None → is null), AND-ed; None when there is nothing to filter."""
    from weaviate.classes.query import Filter

    filters = []
    for name, value in check_where(where).items():
        prop = Filter.by_property(name)
        if value is None:
            filters.append(prop.is_none(True))
        elif name == "quality":
            filters.append(prop.equal(float(value)))
        else:
            filters.append(prop.equal(value))
    if exclude_uuid is not None:
        filters.append(Filter.by_id().not_equal(exclude_uuid))
    if not filters:
        return None
    return filters[0] if len(filters) == 1 else Filter.all_of(filters)


def member_filter(cluster_id: str):
    """Documents whose inCluster reference points at `cluster_id`."""
    from weaviate.classes.query import Filter

    return Filter.by_ref("inCluster").by_property("cluster_id").equal(cluster_id)


def duplicate_filter(doc_id: str):
    """Documents whose duplicateOf reference points at `doc_id`."""
    from weaviate.classes.query import Filter

    return Filter.by_ref("duplicateOf").by_property("doc_id").equal(doc_id)


def document_properties(record: DocumentRecord) -> dict[str, Any]:
    """The Document object's properties; None values are left out (stored as null)."""
    props = {}
    for name in DOCUMENT_PROPERTIES:
        value = getattr(record, name)
        if value is None:
            continue
        props[name] = float(value) if name == "quality" else value
    return props


def document_vector(record: DocumentRecord) -> list[float] | None:
    if record.vector is None:
        return None
    vector = np.asarray(record.vector, dtype=np.float32).reshape(-1)
    try:
        as_query_vector(vector)  # cosine needs a finite, non-zero vector
    except AssayError as exc:
        raise AssayError(f"document {record.doc_id}: {exc}") from None
    return vector.tolist()


def document_object(record: DocumentRecord) -> dict[str, Any]:
    """`batch.add_object(**kwargs)` for a document (duplicateOf is added separately)."""
    references: dict[str, Any] = {}
    if record.source is not None:
        references["fromSource"] = object_uuid("Source", record.source)
    if record.clusters:
        references["inCluster"] = [object_uuid("Cluster", c) for c in sorted(set(record.clusters))]
    return dict(
        properties=document_properties(record),
        vector=document_vector(record),
        uuid=object_uuid("Document", record.doc_id),
        references=references or None,
    )


def cluster_object(record: ClusterRecord) -> dict[str, Any]:
    return dict(
        properties={"cluster_id": record.cluster_id, "kind": record.kind, "size": int(record.size)},
        uuid=object_uuid("Cluster", record.cluster_id),
    )


def source_object(name: str) -> dict[str, Any]:
    return dict(properties={"name": name}, uuid=object_uuid("Source", name))


def record_from_properties(props: dict[str, Any]) -> dict[str, Any]:
    values = {name: props.get(name) for name in DOCUMENT_PROPERTIES}
    if values["quality"] is not None:
        values["quality"] = float(values["quality"])
    return values


def run_batch(collection, objects: Sequence[dict[str, Any]] = (), references: Sequence[dict[str, Any]] = (),
              *, batch_size: int = 200, retries: int = RETRIES, backoff: float = 0.5) -> None:
    """Send objects, then references, with `collection.batch.fixed_size`; retry what failed.

    `objects` are `add_object` kwargs, `references` `add_reference` kwargs.
    After `retries` retries, raises AssayError with the first error message.
    """
    pending_objects = list(objects)
    pending_refs = list(references)
    by_uuid = {str(o["uuid"]): o for o in pending_objects}
    for attempt in range(retries + 1):
        failed_objects: list = []
        if pending_objects:
            with collection.batch.fixed_size(batch_size=batch_size) as batch:
                for obj in pending_objects:
                    batch.add_object(**obj)
            failed_objects = list(collection.batch.failed_objects)
        failed_refs: list = []
        if not failed_objects and pending_refs:
            with collection.batch.fixed_size(batch_size=batch_size) as batch:
                for ref in pending_refs:
                    batch.add_reference(**ref)
            failed_refs = list(collection.batch.failed_references)
        if not failed_objects and not failed_refs:
            return
        first = (failed_objects or failed_refs)[0].message
        if attempt == retries:
            what = f"{len(failed_objects)} objects" if failed_objects else f"{len(failed_refs)} references"
            raise AssayError(f"Weaviate import into {collection.name} failed for {what} after {retries} retries: {first}")
        if failed_objects:
            pending_objects = [by_uuid[str(e.object_.uuid)] for e in failed_objects]
            # References wait until their objects are in.
        else:
            pending_objects = []
            pending_refs = [
                dict(from_uuid=e.reference.from_object_uuid, from_property=e.reference.from_property_name,
                     to=e.reference.to_object_uuid)
                for e in failed_refs
            ]
        time.sleep(backoff * (2**attempt))


def connect(url: str, api_key: str | None = None, grpc_port: int | str | None = None):
    """A connected WeaviateClient, or AssayError naming the URL."""
    import weaviate
    from weaviate.classes.init import AdditionalConfig, Auth, Timeout

    spec = parse_url(url, grpc_port)
    auth = Auth.api_key(api_key) if api_key else None
    try:
        return weaviate.connect_to_custom(
            **spec.__dict__,
            auth_credentials=auth,
            additional_config=AdditionalConfig(timeout=Timeout(init=10, query=60, insert=120)),
        )
    except Exception as exc:  # the client raises several types (connection, start-up, gRPC, auth)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AssayError(
            f"cannot reach Weaviate at {url} (REST {spec.http_port}, gRPC {spec.grpc_port}): {message[:300]}"
        ) from None


# --- the store ---------------------------------------------------------------------------


class WeaviateVectorStore(VectorStore):
    def __init__(self, url: str, *, prefix: str = "", batch_size: int = 200, api_key: str | None = None,
                 grpc_port: int | str | None = None, client=None) -> None:
        self.url = url
        self.names = collection_names(prefix)
        self.prefix = prefix
        self.batch_size = int(batch_size)
        if client is None:
            client = connect(url, api_key if api_key is not None else os.environ.get("WEAVIATE_API_KEY"), grpc_port)
        self.client = client
        self._known_sources: set[str] = set()
        self._known_clusters: set[str] = set()
        try:
            self._ensure_collections()
        except AssayError:
            self.client.close()
            raise
        except Exception as exc:
            self.client.close()
            raise AssayError(f"Weaviate at {url}: cannot create the collections: {exc}") from None
        self.documents = self.client.collections.get(self.names["Document"])
        self.clusters = self.client.collections.get(self.names["Cluster"])
        self.sources = self.client.collections.get(self.names["Source"])

    def _ensure_collections(self) -> None:
        from weaviate.exceptions import UnexpectedStatusCodeError

        for config in collection_configs(self.prefix):
            if not self.client.collections.exists(config["name"]):
                try:
                    self.client.collections.create(**config)
                except UnexpectedStatusCodeError as exc:  # created meanwhile by another process
                    if not self.client.collections.exists(config["name"]):
                        raise AssayError(f"Weaviate: cannot create collection {config['name']}: {exc}") from None
        documents = self.client.collections.get(self.names["Document"])
        references = documents.config.get().references or []
        if not any(ref.name == "duplicateOf" for ref in references):
            documents.config.add_reference(self_reference(self.prefix))

    # --- writes ---------------------------------------------------------------------

    def _ensure_sources(self, names: set[str]) -> None:
        missing = sorted(names - self._known_sources)
        if missing:
            run_batch(self.sources, [source_object(n) for n in missing], batch_size=self.batch_size)
            self._known_sources.update(missing)

    def _ensure_clusters(self, cluster_ids: set[str]) -> None:
        """Create placeholder Cluster objects for ids that do not exist yet."""
        from weaviate.classes.query import Filter

        unknown = sorted(cluster_ids - self._known_clusters)
        for part in chunked(unknown, PAGE):
            uuids = [object_uuid("Cluster", c) for c in part]
            found = self.clusters.query.fetch_objects(filters=Filter.by_id().contains_any(uuids), limit=len(uuids),
                                                      return_properties=["cluster_id"])
            existing = {o.properties.get("cluster_id") for o in found.objects}
            missing = [c for c in part if c not in existing]
            if missing:
                run_batch(self.clusters, [cluster_object(ClusterRecord(c, PLACEHOLDER_KIND, size=0)) for c in missing],
                          batch_size=self.batch_size)
            self._known_clusters.update(part)

    def upsert_documents(self, records: Iterable[DocumentRecord]) -> int:
        written = 0
        # doc_id → the document its latest record says it duplicates (None: none).
        duplicate_of: dict[str, str | None] = {}
        for chunk in chunked(records, ROUND):
            for record in chunk:
                check_document(record)
            chunk = list({r.doc_id: r for r in chunk}.values())
            self._ensure_sources({r.source for r in chunk if r.source is not None})
            self._ensure_clusters({c for r in chunk for c in r.clusters})
            run_batch(self.documents, [document_object(r) for r in chunk], batch_size=self.batch_size)
            duplicate_of.update((r.doc_id, r.duplicate_of) for r in chunk)
            written += len(chunk)
        duplicate_refs = [
            dict(from_uuid=object_uuid("Document", doc), from_property="duplicateOf", to=object_uuid("Document", target))
            for doc, target in duplicate_of.items() if target is not None
        ]
        if duplicate_refs:
            run_batch(self.documents, references=duplicate_refs, batch_size=self.batch_size)
        return written

    def upsert_clusters(self, records: Iterable[ClusterRecord]) -> int:
        from weaviate.classes.query import Filter, QueryReference

        written = 0
        for chunk in chunked(records, ROUND):
            for record in chunk:
                check_cluster(record)
            run_batch(self.clusters, [cluster_object(r) for r in chunk], batch_size=self.batch_size)
            self._known_clusters.update(r.cluster_id for r in chunk)
            # Link the stored members that are not linked yet.
            wanted: dict[str, set[str]] = {}
            for record in chunk:
                for member in record.members:
                    wanted.setdefault(member, set()).add(record.cluster_id)
            refs = []
            for part in chunked(sorted(wanted), PAGE):
                uuids = [object_uuid("Document", d) for d in part]
                found = self.documents.query.fetch_objects(
                    filters=Filter.by_id().contains_any(uuids), limit=len(uuids), return_properties=["doc_id"],
                    return_references=QueryReference(link_on="inCluster", return_properties=["cluster_id"]),
                )
                for obj in found.objects:
                    have = {o.properties.get("cluster_id") for o in _ref_objects(obj, "inCluster")}
                    for cluster_id in sorted(wanted[obj.properties["doc_id"]] - have):
                        refs.append(dict(from_uuid=obj.uuid, from_property="inCluster", to=object_uuid("Cluster", cluster_id)))
            if refs:
                run_batch(self.documents, references=refs, batch_size=self.batch_size)
            written += len(chunk)
        return written

    # --- vector queries ---------------------------------------------------------------

    def _hits(self, result) -> list[Hit]:
        hits = []
        for obj in result.objects:
            props = record_from_properties(obj.properties)
            hits.append(Hit(doc_id=props["doc_id"], score=1.0 - float(obj.metadata.distance), source=props["source"],
                            status=props["status"], properties=props))
        return hits

    def _near(self, vector: list[float], k: int, filters) -> list[Hit]:
        from weaviate.classes.query import MetadataQuery

        if k <= 0:
            return []
        result = self.documents.query.near_vector(
            near_vector=vector, limit=int(k), filters=filters,
            return_metadata=MetadataQuery(distance=True), return_properties=list(DOCUMENT_PROPERTIES),
        )
        return self._hits(result)

    def near(self, vector, k: int = 10, where: dict[str, Any] | None = None) -> list[Hit]:
        return self._near(as_query_vector(vector).tolist(), k, build_filter(where))

    def near_id(self, doc_id: str, k: int = 10, where: dict[str, Any] | None = None) -> list[Hit]:
        filters = build_filter(where, exclude_uuid=object_uuid("Document", doc_id))
        obj = self.documents.query.fetch_object_by_id(object_uuid("Document", doc_id), include_vector=True,
                                                      return_properties=["doc_id"])
        if obj is None:
            raise AssayError(f"no document {doc_id!r} in the vector store")
        vector = _default_vector(obj.vector)
        if vector is None:
            raise AssayError(f"document {doc_id!r} has no vector")
        return self._near(vector, k, filters)

    # --- graph queries -------------------------------------------------------------------

    def get(self, doc_id: str, *, with_vector: bool = True) -> DocumentRecord | None:
        from weaviate.classes.query import QueryReference

        obj = self.documents.query.fetch_object_by_id(
            object_uuid("Document", doc_id), include_vector=with_vector, return_properties=list(DOCUMENT_PROPERTIES),
            return_references=[
                QueryReference(link_on="inCluster", return_properties=["cluster_id"]),
                QueryReference(link_on="duplicateOf", return_properties=["doc_id"]),
            ],
        )
        if obj is None:
            return None
        vector = _default_vector(obj.vector)
        duplicate = [o.properties.get("doc_id") for o in _ref_objects(obj, "duplicateOf")]
        return DocumentRecord(
            vector=None if vector is None else np.asarray(vector, dtype=np.float32),
            clusters=sorted({o.properties.get("cluster_id") for o in _ref_objects(obj, "inCluster")}),
            duplicate_of=duplicate[0] if duplicate else None,
            **record_from_properties(obj.properties),
        )

    def _referrers(self, where, link_on: str, ref_property: str, value: str) -> list[str]:
        """doc_id of every Document matching ``where``: its ``link_on`` reference has ``ref_property == value``.

        One filtered query answers the usual case, a result smaller than a page.
        A full page may have more behind it; offset paging would stop silently at
        QUERY_MAXIMUM_RESULTS, and Weaviate's cursor (``after=``) takes no filter,
        so the answer then comes from a cursor scan of the collection with the same
        test applied here: slower, never truncated.
        """
        from weaviate.classes.query import QueryReference

        collection = self.documents
        try:
            page = collection.query.fetch_objects(filters=where, limit=PAGE, return_properties=["doc_id"])
            if len(page.objects) < PAGE:
                return [o.properties["doc_id"] for o in page.objects]
            found = []
            for obj in collection.iterator(
                return_properties=["doc_id"],
                return_references=QueryReference(link_on=link_on, return_properties=[ref_property]),
                cache_size=PAGE,
            ):
                if any(ref.properties.get(ref_property) == value for ref in _ref_objects(obj, link_on)):
                    found.append(obj.properties["doc_id"])
            return found
        except AssayError:
            raise
        except Exception as exc:
            raise AssayError(f"Weaviate query on {collection.name} ({link_on}.{ref_property} = {value!r}) failed: "
                             f"{str(exc).splitlines()[0][:300]}") from None

    def cluster_members(self, cluster_id: str) -> list[str]:
        return sorted(self._referrers(member_filter(cluster_id), "inCluster", "cluster_id", cluster_id))

    def get_cluster(self, cluster_id: str) -> ClusterRecord | None:
        obj = self.clusters.query.fetch_object_by_id(object_uuid("Cluster", cluster_id))
        if obj is None:
            return None
        props = obj.properties
        return ClusterRecord(cluster_id, props.get("kind"), members=self.cluster_members(cluster_id), size=int(props.get("size") or 0))

    def clusters_of(self, doc_id: str) -> list[ClusterRecord]:
        from weaviate.classes.query import QueryReference

        obj = self.documents.query.fetch_object_by_id(
            object_uuid("Document", doc_id), return_properties=["doc_id"],
            return_references=QueryReference(link_on="inCluster", return_properties=["cluster_id", "kind", "size"]),
        )
        if obj is None:
            return []
        found = {}
        for ref in _ref_objects(obj, "inCluster"):
            p = ref.properties
            found[p["cluster_id"]] = ClusterRecord(p["cluster_id"], p.get("kind"), size=int(p.get("size") or 0))
        return [found[c] for c in sorted(found)]

    def duplicates_of(self, doc_id: str) -> list[str]:
        return sorted(self._referrers(duplicate_filter(doc_id), "duplicateOf", "doc_id", doc_id))

    def source_overlap(self) -> list[tuple[str, str, int]]:
        """A full scan of Document (source and inCluster ids), aggregated here."""
        from weaviate.classes.query import QueryReference

        pairs = []
        for obj in self.documents.iterator(
            return_properties=["source"],
            return_references=QueryReference(link_on="inCluster", return_properties=["cluster_id"]),
        ):
            source = obj.properties.get("source")
            for ref in _ref_objects(obj, "inCluster"):
                pairs.append((ref.properties.get("cluster_id"), source))
        return overlap_from_memberships(pairs)

    def source_counts(self) -> list[tuple[str, int]]:
        """A cursor scan of Document's source property, counted here, as `source_overlap` is:
        slower than a grouped aggregate, but the same answer as the local store's, never cut short."""
        counts: Counter[str | None] = Counter(obj.properties.get("source")
                                              for obj in self.documents.iterator(return_properties=["source"]))
        return counts_by_source(counts.items())

    def count(self) -> int:
        return int(self.documents.aggregate.over_all(total_count=True).total_count or 0)

    @property
    def exact(self) -> bool:
        return False  # Weaviate's HNSW is approximate

    def close(self) -> None:
        self.client.close()

    def drop(self) -> None:
        """Delete this prefix's collections (Document first) and close the client."""
        try:
            self.client.collections.delete([self.names["Document"], self.names["Cluster"], self.names["Source"]])
        finally:
            self.client.close()


def _ref_objects(obj, name: str) -> list:
    references = getattr(obj, "references", None) or {}
    ref = references.get(name)
    return list(ref.objects) if ref is not None else []


def _default_vector(vector) -> list[float] | None:
    if vector is None:
        return None
    if isinstance(vector, dict):
        vector = vector.get("default")
    if vector is None or len(vector) == 0:
        return None
    return list(vector)
