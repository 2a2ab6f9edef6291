"""What the Weaviate backend sends, checked without a server.

These test our request building: URL parsing, the uuid5 ids, the collection
configs, filters, batch objects and references, and the retry loop around
`collection.batch`. Where possible the objects are passed through the
client's own serialisers (`_CollectionConfigCreate._to_dict`, the gRPC filter
and batch encoders) so that a shape the client would reject fails here. They
prove nothing about a server's answers: that is the contract suite's job,
which runs against a real server when WEAVIATE_URL is set.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from assay.errors import AssayError
from assay.vectors import ClusterRecord, DocumentRecord, object_uuid
from assay.vectors import weaviate_store as ws


# --- connection ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://localhost:8080", ("localhost", 8080, False, "localhost", 50051, False)),
        ("http://weaviate.internal", ("weaviate.internal", 8080, False, "weaviate.internal", 50051, False)),
        ("https://vectors.example.com", ("vectors.example.com", 443, True, "vectors.example.com", 50051, True)),
        ("https://vectors.example.com:8443/", ("vectors.example.com", 8443, True, "vectors.example.com", 50051, True)),
        ("10.0.0.5:9000", ("10.0.0.5", 9000, False, "10.0.0.5", 50051, False)),
        ("http://[::1]:8080", ("[::1]", 8080, False, "[::1]", 50051, False)),
    ],
)
def test_parse_url(url, expected, monkeypatch):
    monkeypatch.delenv("WEAVIATE_GRPC_PORT", raising=False)
    spec = ws.parse_url(url)
    assert (spec.http_host, spec.http_port, spec.http_secure, spec.grpc_host, spec.grpc_port, spec.grpc_secure) == expected


def test_grpc_port_from_the_environment_or_argument(monkeypatch):
    monkeypatch.setenv("WEAVIATE_GRPC_PORT", "50052")
    assert ws.parse_url("http://localhost:8080").grpc_port == 50052
    assert ws.parse_url("http://localhost:8080", grpc_port=6000).grpc_port == 6000
    monkeypatch.setenv("WEAVIATE_GRPC_PORT", "fifty")
    with pytest.raises(AssayError, match="WEAVIATE_GRPC_PORT"):
        ws.parse_url("http://localhost:8080")


@pytest.mark.parametrize("url", ["ftp://host:21", "http://host:99999", "http://host:8080/v1", "http://:8080"])
def test_bad_urls(url):
    with pytest.raises(AssayError, match="Weaviate URL"):
        ws.parse_url(url)


def test_unreachable_server_is_a_one_line_assay_error(monkeypatch):
    monkeypatch.setenv("WEAVIATE_API_KEY", "not-a-real-key")
    started = time.perf_counter()
    with pytest.raises(AssayError) as info:
        ws.WeaviateVectorStore("http://127.0.0.1:9", prefix="Nothing")
    assert str(info.value).startswith("cannot reach Weaviate at http://127.0.0.1:9 (REST 9, gRPC 50051)")
    assert "\n" not in str(info.value)
    assert time.perf_counter() - started < 30


# --- ids ----------------------------------------------------------------------------------


def test_uuid5_ids_match_the_client_and_are_per_collection():
    from weaviate.util import generate_uuid5

    assert object_uuid("Document", "doc-1") == generate_uuid5("doc-1")
    assert object_uuid("Source", "web") == generate_uuid5("web", "Source:")
    assert object_uuid("Cluster", "near-3") == generate_uuid5("near-3", "Cluster:")
    assert object_uuid("Document", "x") == object_uuid("Document", "x")
    assert len({object_uuid(c, "same") for c in ("Document", "Source", "Cluster")}) == 3
    uuid.UUID(object_uuid("Document", "ünïcode/path.py"))


# --- collections ----------------------------------------------------------------------------


def _create_payload(config: dict) -> dict:
    """The JSON the client would POST to /v1/schema for collections.create(**config)."""
    from weaviate.collections.classes.config import _CollectionConfigCreate

    return _CollectionConfigCreate(**config)._to_dict()


def test_collection_configs():
    configs = ws.collection_configs("test7")
    assert [c["name"] for c in configs] == ["Test7Source", "Test7Cluster", "Test7Document"]
    payloads = {c["name"]: _create_payload(c) for c in configs}
    document = payloads["Test7Document"]
    assert document["class"] == "Test7Document"
    vector = document["vectorConfig"]["default"]
    assert vector["vectorizer"] == {"none": {}}
    assert vector["vectorIndexType"] == "hnsw"
    assert vector["vectorIndexConfig"]["distance"] == "cosine"
    assert document["invertedIndexConfig"]["indexNullState"] is True
    props = {p["name"]: p for p in document["properties"]}
    assert list(props) == ["doc_id", "kind", "lang", "source", "path", "quality", "status", "fromSource", "inCluster"]
    for name in ("doc_id", "kind", "lang", "source", "path", "status"):
        assert props[name]["dataType"] == ["text"] and props[name]["tokenization"] == "field", name
    assert props["quality"]["dataType"] == ["number"]
    assert props["fromSource"]["dataType"] == ["Test7Source"]
    assert props["inCluster"]["dataType"] == ["Test7Cluster"]
    cluster = {p["name"]: p for p in payloads["Test7Cluster"]["properties"]}
    assert cluster["kind"]["tokenization"] == "field" and cluster["size"]["dataType"] == ["int"]
    assert payloads["Test7Source"]["vectorConfig"]["default"]["vectorizer"] == {"none": {}}
    ref = ws.self_reference("test7")._to_dict()
    assert ref == {"name": "duplicateOf", "dataType": ["Test7Document"]}


def test_collection_prefix_rules():
    assert ws.collection_names("")["Document"] == "Document"
    assert ws.collection_names("run_42")["Cluster"] == "Run_42Cluster"
    for bad in ("1abc", "a-b", "x y", "é"):
        with pytest.raises(AssayError, match="collection_prefix"):
            ws.collection_names(bad)


# --- filters -----------------------------------------------------------------------------------


def _grpc(filters):
    from weaviate.collections.filters import _FilterToGRPC

    return _FilterToGRPC.convert(filters)


def test_where_filters():
    from weaviate.proto.v1 import base_pb2

    assert ws.build_filter(None) is None and ws.build_filter({}) is None
    single = _grpc(ws.build_filter({"status": "near_dup"}))
    assert single.operator == base_pb2.Filters.OPERATOR_EQUAL
    assert single.target.property == "status" and single.value_text == "near_dup"
    both = _grpc(ws.build_filter({"status": "kept", "kind": "code"}))
    assert both.operator == base_pb2.Filters.OPERATOR_AND
    assert [(f.target.property, f.value_text) for f in both.filters] == [("status", "kept"), ("kind", "code")]
    null = _grpc(ws.build_filter({"quality": None}))
    assert null.operator == base_pb2.Filters.OPERATOR_IS_NULL and null.value_boolean is True
    number = _grpc(ws.build_filter({"quality": 1}))
    assert number.value_number == 1.0
    me = object_uuid("Document", "d1")
    excluded = _grpc(ws.build_filter({"kind": "text"}, exclude_uuid=me))
    assert [f.operator for f in excluded.filters] == [base_pb2.Filters.OPERATOR_EQUAL, base_pb2.Filters.OPERATOR_NOT_EQUAL]
    assert excluded.filters[1].target.property == "_id" and excluded.filters[1].value_text == me
    with pytest.raises(AssayError, match="cannot filter on"):
        ws.build_filter({"colour": "red"})
    with pytest.raises(AssayError, match="string property"):
        ws.build_filter({"status": 3})


def test_reference_filters():
    members = _grpc(ws.member_filter("near-0"))
    assert members.target.single_target.on == "inCluster"
    assert members.target.single_target.target.property == "cluster_id" and members.value_text == "near-0"
    dups = _grpc(ws.duplicate_filter("d7"))
    assert dups.target.single_target.on == "duplicateOf"
    assert dups.target.single_target.target.property == "doc_id" and dups.value_text == "d7"


# --- batch objects --------------------------------------------------------------------------------


def _grpc_object(collection: str, kwargs: dict):
    from weaviate.collections.batch.grpc_batch import _BatchGRPC
    from weaviate.collections.classes.batch import BatchObject
    from weaviate.util import _ServerVersion

    batch = _BatchGRPC(_ServerVersion(1, 27, 0), None, None)
    return batch.grpc_object(BatchObject(collection=collection, index=0, **kwargs)._to_internal())


def test_document_objects():
    record = DocumentRecord("d1", np.array([3.0, 4.0]), kind="text", lang=None, source="web", path="a/b.txt",
                            quality=np.float32(0.5), status="near_dup", clusters=["sem-2", "near-1", "near-1"],
                            duplicate_of="d0")
    kwargs = ws.document_object(record)
    assert kwargs["uuid"] == object_uuid("Document", "d1")
    assert kwargs["properties"] == {"doc_id": "d1", "kind": "text", "source": "web", "path": "a/b.txt",
                                    "quality": 0.5, "status": "near_dup"}
    assert type(kwargs["properties"]["quality"]) is float
    assert kwargs["vector"] == [3.0, 4.0]  # raw; the collection's cosine metric normalises
    assert kwargs["references"] == {
        "fromSource": object_uuid("Source", "web"),
        "inCluster": [object_uuid("Cluster", "near-1"), object_uuid("Cluster", "sem-2")],
    }
    proto = _grpc_object("TDocument", kwargs)
    refs = {r.prop_name: list(r.uuids) for r in proto.properties.single_target_ref_props}
    assert refs == {"fromSource": [object_uuid("Source", "web")],
                    "inCluster": [object_uuid("Cluster", "near-1"), object_uuid("Cluster", "sem-2")]}
    assert set(proto.properties.non_ref_properties.fields) == {"doc_id", "kind", "source", "path", "quality", "status"}
    assert np.frombuffer(proto.vector_bytes, dtype="<f4").tolist() == [3.0, 4.0]

    bare = ws.document_object(DocumentRecord("d2"))
    assert bare["references"] is None and bare["vector"] is None and bare["properties"] == {"doc_id": "d2"}
    with pytest.raises(AssayError, match="d3"):
        ws.document_object(DocumentRecord("d3", np.zeros(4)))
    with pytest.raises(AssayError, match="d4"):
        ws.document_object(DocumentRecord("d4", np.array([1.0, np.nan])))


def test_cluster_and_source_objects():
    assert ws.cluster_object(ClusterRecord("near-1", "near", members=["a", "b"])) == {
        "properties": {"cluster_id": "near-1", "kind": "near", "size": 2},
        "uuid": object_uuid("Cluster", "near-1"),
    }
    assert ws.source_object("web") == {"properties": {"name": "web"}, "uuid": object_uuid("Source", "web")}
    _grpc_object("TCluster", ws.cluster_object(ClusterRecord("c", "exact", size=5)))


def test_record_from_properties():
    values = ws.record_from_properties({"doc_id": "d", "quality": 1, "status": "kept"})
    assert values == {"doc_id": "d", "kind": None, "lang": None, "source": None, "path": None, "quality": 1.0, "status": "kept"}
    assert ws._default_vector({"default": [1.0, 2.0]}) == [1.0, 2.0]
    assert ws._default_vector({}) is None and ws._default_vector(None) is None


# --- the retry loop around collection.batch ------------------------------------------------------------


class _StubBatchCollection:
    """Stands in for `collection` in run_batch: the part of the client's batch
    interface it uses (fixed_size, add_object/add_reference, failed_objects /
    failed_references). Not a server: `fail` decides which items fail."""

    name = "TDocument"

    def __init__(self, fail):
        self.fail = fail  # (kind, item, attempt) -> error message or None
        self.sent: list[tuple[str, dict]] = []
        self.attempts = {"object": 0, "reference": 0}
        self.batch = self
        self.failed_objects: list = []
        self.failed_references: list = []
        self._kind = None

    def fixed_size(self, batch_size):
        assert batch_size == 7
        self.failed_objects, self.failed_references = [], []
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._kind:
            self.attempts[self._kind] += 1
        self._kind = None
        return False

    def add_object(self, **kwargs):
        from weaviate.collections.classes.batch import BatchObject, ErrorObject

        self._kind = "object"
        self.sent.append(("object", kwargs))
        message = self.fail("object", kwargs, self.attempts["object"])
        if message:
            self.failed_objects.append(ErrorObject(message, BatchObject(collection=self.name, index=0, **kwargs)))

    def add_reference(self, **kwargs):
        from weaviate.collections.classes.batch import BatchReference, ErrorReference

        self._kind = "reference"
        self.sent.append(("reference", kwargs))
        message = self.fail("reference", kwargs, self.attempts["reference"])
        if message:
            ref = BatchReference(from_object_collection=self.name, from_object_uuid=kwargs["from_uuid"],
                                 from_property_name=kwargs["from_property"], to_object_uuid=kwargs["to"], index=0)
            self.failed_references.append(ErrorReference(message, ref))


def _objects(n):
    return [ws.document_object(DocumentRecord(f"d{i}", np.ones(3), status="kept")) for i in range(n)]


def _refs(n):
    return [dict(from_uuid=object_uuid("Document", f"d{i}"), from_property="duplicateOf", to=object_uuid("Document", "d0"))
            for i in range(1, n)]


def test_run_batch_retries_only_what_failed():
    flaky = object_uuid("Document", "d2")
    stub = _StubBatchCollection(lambda kind, item, attempt: "timeout" if kind == "object" and item["uuid"] == flaky and attempt < 2 else None)
    ws.run_batch(stub, _objects(4), _refs(3), batch_size=7, backoff=0)
    objects = [item["uuid"] for kind, item in stub.sent if kind == "object"]
    assert objects == [o["uuid"] for o in _objects(4)] + [flaky, flaky]
    # References go out once, after every object is in.
    kinds = [kind for kind, _ in stub.sent]
    assert kinds[-2:] == ["reference", "reference"] and kinds.count("reference") == 2


def test_run_batch_retries_failed_references():
    stub = _StubBatchCollection(lambda kind, item, attempt: "busy" if kind == "reference" and attempt == 0 and item["from_uuid"] == object_uuid("Document", "d1") else None)
    ws.run_batch(stub, _objects(3), _refs(3), batch_size=7, backoff=0)
    refs = [item["from_uuid"] for kind, item in stub.sent if kind == "reference"]
    assert [str(r) for r in refs] == [object_uuid("Document", "d1"), object_uuid("Document", "d2"), object_uuid("Document", "d1")]


def test_run_batch_gives_up_with_the_first_error():
    stub = _StubBatchCollection(lambda kind, item, attempt: "vector lengths don't match: 3 vs 384" if kind == "object" else None)
    with pytest.raises(AssayError, match=r"TDocument failed for 2 objects after 2 retries: vector lengths don't match"):
        ws.run_batch(stub, _objects(2), _refs(2), batch_size=7, retries=2, backoff=0)
    assert stub.attempts["object"] == 3 and stub.attempts["reference"] == 0
