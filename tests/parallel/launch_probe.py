"""A rank for tests/test_local_launch.py: joins the group as the trainer does, all-reduces, reports.

argv: OUT_DIR [fail-once | hang]. Each rank writes OUT_DIR/rank-R-attempt-A.json. ``fail-once``: rank 1
exits 3 on the first attempt, after the group formed. ``hang``: every rank waits after reporting.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from training.parallel.distributed import init_distributed, leave

out, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "")
world = init_distributed()
total = world.sum(torch.tensor([float(world.rank + 1)]))
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")
(out / f"rank-{world.rank}-attempt-{attempt}.json").write_text(json.dumps(
    {"sum": total.item(), "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}))
if mode == "fail-once" and attempt == 0 and world.rank == 1:
    os._exit(3)
if mode == "hang":
    time.sleep(600)
world.barrier()
leave()
