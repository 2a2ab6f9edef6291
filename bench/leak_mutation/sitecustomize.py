"""A deliberate leak, to check that tests/test_memory_bound.py catches one.

Put this folder first on PYTHONPATH and set ASSAY_MUTATE_KEEP=1: every process (the stages the slow
test launches included) then keeps every batch `assay.shards.shard_batches` yields, as a stage that
held its input would. The slow test must then fail its growth check (static's live bytes):

    ASSAY_MUTATE_KEEP=1 PYTHONPATH=bench/leak_mutation:. .venv/bin/pytest -q -s -m slow tests/test_memory_bound.py
"""

import os

if os.environ.get("ASSAY_MUTATE_KEEP"):
    import assay.shards as _shards

    _original = _shards.shard_batches
    _kept = []

    def shard_batches(*args, **kwargs):
        for batch in _original(*args, **kwargs):
            _kept.append(batch)
            yield batch

    _shards.shard_batches = shard_batches
