"""glibc malloc settings for a daemon that runs for weeks (glibc only).

Two glibc defaults make a long-lived, multi-threaded daemon's resident memory
climb and stay high after a burst of large requests:

* each thread that allocates gets its own arena, up to 8 per core, and memory
  freed into an arena is rarely returned to the system: ``M_ARENA_MAX`` 2
  keeps the daemon's handful of threads on two arenas;
* the mmap threshold adapts upwards after large frees, so later multi-MiB
  buffers (decoded id lists, staging) come from the heap and stay there: a
  fixed ``M_MMAP_THRESHOLD`` of 128 KiB returns every such buffer to the
  system when it is freed.

What is still freed into the heap is returned by ``malloc_trim(0)``, which the
heartbeat thread calls at most every :data:`TRIM_EVERY_S` seconds
(:class:`Trimmer`).  On another C library every function here does nothing and
says so once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Callable

M_MMAP_THRESHOLD = -3  # glibc malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 << 10
ARENA_MAX = 2
TRIM_EVERY_S = 5.0


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The running process's C library if it is glibc (it has gnu_get_libc_version)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def tune() -> str:
    """Apply the settings (at start, before the daemon's threads exist); return what
    was done, for the log."""
    libc = glibc()
    if libc is None:
        return "malloc: not glibc, default settings kept"
    version = libc.gnu_get_libc_version().decode()
    ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(M_ARENA_MAX, ARENA_MAX) == 1)
    if not ok:
        return f"malloc: glibc {version} refused mallopt; default settings kept"
    return (f"malloc: glibc {version}, mmap threshold {MMAP_THRESHOLD_BYTES >> 10} KiB, "
            f"{ARENA_MAX} arenas, trimmed every {TRIM_EVERY_S:.0f}s")


def trim() -> bool:
    """``malloc_trim(0)``: return free heap memory to the system; True if any was."""
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class Trimmer:
    """Calls ``trim`` when at least ``every_s`` seconds passed since the last call
    (the heartbeat thread calls :meth:`maybe` on each beat)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, trim: Callable[[], bool] = trim,
                 clock: Callable[[], float] = time.monotonic):
        self._every_s = every_s
        self._trim = trim
        self._clock = clock
        self._next = clock() + every_s  # heartbeat thread

    def maybe(self) -> None:
        now = self._clock()
        if now >= self._next:
            self._next = now + self._every_s
            self._trim()
