"""Vector store and knowledge graph (Document, Source, Cluster): local (faiss + SQLite) or Weaviate."""

from assay.vectors.base import (
    DOCUMENT_PROPERTIES,
    ClusterRecord,
    DocumentRecord,
    Hit,
    VectorStore,
    object_uuid,
    open_store,
    overlap_from_memberships,
)

__all__ = [
    "DOCUMENT_PROPERTIES",
    "ClusterRecord",
    "DocumentRecord",
    "Hit",
    "VectorStore",
    "object_uuid",
    "open_store",
    "overlap_from_memberships",
]
