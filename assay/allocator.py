"""glibc malloc settings for long-running stages that handle documents of megabytes.

glibc serves a request of at least M_MMAP_THRESHOLD bytes (128 KiB at start)
with its own mmap, returned to the kernel on free. But its threshold is
dynamic: freeing such a chunk raises the threshold to the chunk's size (up
to 32 MiB on 64-bit). After the first multi-megabyte document is freed,
every later 0.4-5 MB buffer (a document's str, its lowered copy, token
lists, tensors) is carved out of the threads' heaps instead, among
long-lived small objects, and the holes it leaves are reused only by
requests that fit them. On bench/memory_bound.py's generated corpus (3% of
documents 0.4-5 MB) static's resident size rose through the run with
memory free inside the heaps (RELIABILITY.md); with the threshold fixed,
large buffers go back to the kernel when freed and the heaps hold only
small objects.

Setting the threshold with mallopt also turns the dynamic adjustment off,
as MALLOC_MMAP_THRESHOLD_ does, but from inside the stage, so it holds
however the stage is started (CLI, Prefect worker, DVC).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

#: glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Buffers of this size and more are mmapped and returned to the kernel on free (glibc starts at 128 KiB).
MMAP_THRESHOLD = 256 * 1024
#: glibc's default: free memory above this at the top of a heap goes back to the kernel.
TRIM_THRESHOLD = 128 * 1024

_DONE = False
_LOCK = threading.Lock()


def bound_heap_growth() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once). False where the C library is not glibc
    (musl, macOS: no mallopt or other semantics), which is left as it is."""
    global _DONE
    with _LOCK:
        if _DONE:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
            mallopt = libc.mallopt
            libc.gnu_get_libc_version  # glibc only: other libcs' mallopt (if any) may not take these numbers
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # The dynamic rule also raises the trim threshold (to twice the mmap threshold), and a large free before
        # this call (imports, model files) may already have: set back to the default, free memory at the top of
        # a heap goes back to the kernel, as in a process started with MALLOC_MMAP_THRESHOLD_ (RELIABILITY.md).
        # Free space already inside the heaps still serves large requests; new ones no longer grow them.
        _DONE = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return _DONE


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33)."""

    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> Mallinfo2 | None:
    """glibc's account of this process's heaps (``uordblks`` + ``hblkhd`` in use, ``fordblks`` free inside
    the heaps); None where the C library has no ``mallinfo2``. For the memory benchmark and its tests."""
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = Mallinfo2
    return call()


def large_requests_mmapped() -> bool | None:
    """Whether a 1 MiB request is mmapped right after an 8 MiB free: True once the threshold is fixed,
    False under glibc's dynamic one (the free raised it to 8 MiB); None where not glibc. The largest of
    three tries, since other threads' mmaps move the count too."""
    if mallinfo() is None:
        return None
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    seen = []
    for _ in range(3):
        libc.free(libc.malloc(8 << 20))
        before = mallinfo().hblkhd
        small = libc.malloc(1 << 20)
        seen.append(mallinfo().hblkhd - before)
        libc.free(small)
    return max(seen) >= 1 << 20
