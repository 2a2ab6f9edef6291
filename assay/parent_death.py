"""A child process that dies with the process that started it, even when that one is SIGKILLed.

Servers and training ranks are started in sessions of their own (so that a terminal's Ctrl-C
reaches only their parent, which then stops them in order). Nothing would then stop them if the
parent were killed outright: Linux's parent-death signal (prctl PR_SET_PDEATHSIG) does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` by which the child gets SIGTERM when its parent dies
    (None off Linux, where Popen then runs nothing).

    The signal follows the parent *thread* that forks, so call Popen from a thread that lives as
    long as the child should (the main thread). prctl is looked up here, before the fork: between
    fork and exec another thread's locks (the dynamic loader's among them) may be held, so the
    child makes only two system calls.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl ran: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal
