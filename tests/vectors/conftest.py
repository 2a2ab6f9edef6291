"""Fixtures for the vector-store contract suite: one suite, every backend.

`local` always runs. `weaviate` runs only against a real server named by
WEAVIATE_URL (and WEAVIATE_API_KEY / WEAVIATE_GRPC_PORT if needed); each test
gets its own collection prefix and its collections are deleted afterwards.
"""

from __future__ import annotations

import os
import uuid

import pytest
from contract_data import WEAVIATE_SKIP, Corpus, make_corpus  # this folder is on sys.path (no __init__.py)


@pytest.fixture(params=["local", "weaviate"])
def backend(request) -> str:
    if request.param == "weaviate" and not os.environ.get("WEAVIATE_URL"):
        pytest.skip(WEAVIATE_SKIP)
    return request.param


@pytest.fixture
def opener(backend, tmp_path):
    """open_store(**kwargs) → the backend's store; call again to reopen the same data."""
    opened = []
    prefix = f"T{uuid.uuid4().hex[:12]}"

    def open_store(**kwargs):
        if backend == "local":
            from assay.vectors.local import LocalVectorStore

            store = LocalVectorStore(tmp_path / "vectors", **kwargs)
        else:
            from assay.vectors.weaviate_store import WeaviateVectorStore

            store = WeaviateVectorStore(os.environ["WEAVIATE_URL"], prefix=prefix, batch_size=100)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        try:
            store.close()
        except Exception:
            pass
    if backend == "weaviate":
        open_store().drop()


@pytest.fixture
def store(opener):
    return opener()


@pytest.fixture
def corpus() -> Corpus:
    return make_corpus()


@pytest.fixture
def graph(store, corpus):
    """The store holding the corpus: clusters first, then the documents."""
    store.upsert_clusters(corpus.clusters)
    store.upsert_documents(corpus.records)
    return store
