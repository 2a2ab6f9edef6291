"""The local vector store killed with SIGKILL in the middle of writing (issue 13, section 4).

A child process upserts documents in rounds of 50 and saves after each round, for ever;
the parent kills it at several moments. Whatever moment the kill lands on (between
saves, during the SQLite copy, the faiss write, the rename or the CURRENT switch), the
store must open on a complete generation: a whole number of rounds, every document of
those rounds with its exact vector, and the index and the graph in step. The next
writer clears the leftovers and can carry on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from assay.vectors import DocumentRecord
from assay.vectors.local import LocalVectorStore

ROUND, DIM = 50, 16

WRITER = f"""
import sys
import numpy as np
from assay.vectors import DocumentRecord
from assay.vectors.local import LocalVectorStore

store = LocalVectorStore(sys.argv[1], exact_max=10_000)
r = store.count() // {ROUND}
while True:
    ids = [f"d{{r}}-{{i}}" for i in range({ROUND})]
    store.upsert_documents(DocumentRecord(d, vector=_v, kind="text", source=f"s{{r % 3}}", status="kept")
                           for d, _v in zip(ids, np.random.default_rng(r).normal(size=({ROUND}, {DIM})).astype(np.float32)))
    store.save()
    print(r, flush=True)
    r += 1
"""


def _expected_vector(doc_id: str) -> np.ndarray:
    r, i = (int(x) for x in doc_id[1:].split("-"))
    v = np.random.default_rng(r).normal(size=(ROUND, DIM)).astype(np.float32)[i]
    return v / np.linalg.norm(v)


def _check_complete(path: Path) -> int:
    store = LocalVectorStore(path, exact_max=10_000, read_only=True)
    try:
        n = store.count()
        assert n % ROUND == 0, f"{n} documents: a round was half saved"
        for r in range(n // ROUND):
            for i in (0, ROUND - 1):
                got = store.get(f"d{r}-{i}")
                assert got is not None, f"d{r}-{i} lost"
                np.testing.assert_allclose(got.vector, _expected_vector(f"d{r}-{i}"), rtol=1e-5, atol=1e-6)
        if n:
            hit = store.near_id(f"d{n // ROUND - 1}-0", k=1)
            assert hit and hit[0].doc_id != f"d{n // ROUND - 1}-0"  # the index answers, excluding the query
        return n
    finally:
        store.close()


@pytest.mark.slow
def test_kill_minus_nine_mid_write_leaves_a_complete_generation(tmp_path):
    path = tmp_path / "vectors"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    seen, mid_save = [], 0
    for delay in (0.0, 0.004, 0.011, 0.023, 0.05, 0.1, 0.2):  # different moments of a save
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline(), child.stderr.read()  # it saved one round: it is in its loop
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        mid_save += any(p.name.startswith(".") for p in path.iterdir())  # a save's temporary was left
        n = _check_complete(path)
        assert not seen or n >= seen[-1], "a later run lost saved rounds"
        seen.append(n)
    print(f"documents after each kill: {seen}; kills that landed inside a save: {mid_save}")
    assert seen[-1] > 0
    # The next writer removes what killed saves left behind, and goes on.
    store = LocalVectorStore(path, exact_max=10_000)
    assert not [p for p in path.iterdir() if p.name.startswith(".")]
    store.upsert_documents([DocumentRecord("after", vector=np.ones(DIM, np.float32), kind="text", status="kept")])
    store.close()
    assert LocalVectorStore(path, read_only=True).get("after") is not None
