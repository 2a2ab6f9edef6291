"""A rank for tests/test_parallel.py: training.parallel.worker, except that rank 1 opens OTHER_DATA,
as if a new version had been published between the two ranks' opens.

argv: OTHER_DATA, then the worker's arguments.
"""

import os
import sys

import training.parallel.worker as worker
from assay.versions import open_version
from training.parallel.distributed import run_rank

other, argv = sys.argv[1], sys.argv[2:]


def open_as_this_rank(path, rev=None):
    return open_version(other if os.environ["RANK"] == "1" else path, rev)


worker.open_version = open_as_this_rank
run_rank(lambda: worker.main(argv))
