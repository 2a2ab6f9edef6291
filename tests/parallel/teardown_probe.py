"""A rank for tests/test_local_launch.py's teardown tests: a gloo group still referenced when the
rank ends, as the trainer's is.

argv: OUT_DIR HOLDER [plain]. Each rank all-gathers over the group and leaves it held by HOLDER:

- ``cycle``: an object in a reference cycle, as DDP's reducer holds the group. Automatic garbage
  collection is off, so only ``shutdown()``'s collection can free it. The rank writes how many of
  gloo's threads ran before and after ``shutdown()`` to OUT_DIR/rank-R.json, then calls ``leave()``.
- ``global``: a module global, as DTensor's cached ``DeviceMesh`` holds it under FSDP and TP, so
  nothing frees it before the process ends. The rank ends at once through ``leave()``; with
  ``plain``, through ``destroy_process_group`` and a plain exit, to measure what ``leave()`` prevents.
  At once matters: gloo's thread drops the finished all-gather's tensors just after the collective
  returns, and a rank aborts when that happens during the interpreter's teardown.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from training.parallel.distributed import init_distributed, leave, shutdown


def gloo_threads() -> int:
    """gloo's threads in this process (it names them pt_gloo_runloop and gloo_tcp_loop)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            count += Path(f"/proc/self/task/{task}/comm").read_text().startswith(("pt_gloo", "gloo"))
        except OSError:  # the thread ended while we listed
            pass
    return count


class Holder:
    pass


gc.disable()
out, holder, plain = Path(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["plain"]
world = init_distributed()
gathered = [torch.empty(1000) for _ in range(world.world_size)]
dist.all_gather(gathered, torch.full((1000,), float(world.rank)))
if holder == "cycle":
    held = Holder()
    held.group, held.me = dist.group.WORLD, held
    del held
    before = gloo_threads()
    shutdown()
    (out / f"rank-{world.rank}.json").write_text(json.dumps({"before": before, "after": gloo_threads()}))
    leave()
KEPT = dist.group.WORLD
if plain:
    dist.destroy_process_group()
else:
    leave()
