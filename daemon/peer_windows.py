"""Write windows: the only addresses a sender's Transfer Engine writes on this rank,
each fenced off the moment its receive ends without ``done``.

**The hazard.**  A receive a sender has begun can end without the sender's last
word: the sender is silent for ``--peer-timeout`` (a SIGSTOP, a long pause, a
partition), it aborts, or this daemon stops.  Its blocks are then released and
the engine reuses them (an evict into them, answered OK).  Nothing bounds the
sender's write, though: a stalled sender resumes and its bytes still land, over
the reused blocks, and a later load returns OK with wrong bytes.

**What the Transfer Engine gives** (Mooncake 0.3.13, TCP, measured with two
processes): a request whose destination lies outside every registered buffer is
refused by the receiving engine (the sender's write returns -1), but the check
is made once, when the request starts: a 256 MiB request accepted before
``unregister_memory`` landed in full after it.  A write returns 0 only once the
receiver acknowledged every byte applied (the acknowledged TCP framing;
``MC_TCP_PROTO=1`` turns it off and is refused at start).  An ``abort`` proves
nothing: the write returns at its first failed request while others may still
be in flight.  So unregistering the pool cannot stop a stalled request, and
re-registering it would refuse the next requests of every healthy transfer in
flight (they would fail TRANSFER_FAILED).

**The fence.**  Each begun receive writes through a window of its own: a second
mapping of the whole host pool (the same shm pages at other addresses),
registered with the engine; ``begin``'s answer gives the sender the window's
bases.  ``done`` (every request applied) returns the window clean, for reuse.
Any other end fences it *before* the blocks are released: over the extents the
receive's blocks span, an anonymous private mapping is put in place with
``mmap(MAP_FIXED)`` (atomic: a request in flight writes scratch pages from then
on, never the pool), the window is unregistered (on RDMA that deregisters the
memory region, which is what stops the NIC) and the rest of it unmapped.  On
TCP the scratch extents are registered again, so that late requests land there
instead of being refused: a refusal resets the sender's connections, and its
next transfer to this rank then waited ~1 s or failed.  Whatever that sender
does afterwards, however long it stalled, no byte of it reaches a block, so the
blocks are released at once: no quarantine, no wait.  The scratch stays mapped
(a late write into an unmapped address would kill the daemon) until that
sender's ``done`` proves its write over.  One that never sends it (it died,
or it aborted: an abort proves nothing) leaves that address space reserved,
and memory only for the late bytes that arrived.

**What only a restart fixes.**  Nothing but ``done`` proves a fenced write over,
so scratch a sender never releases stays until this process ends.  Each scratch
extent is a mapping of its own; the kernel allows a process ``vm.max_map_count``
of them (65,530 by default), and an ``mmap`` that fails leaves a fence undone.
So once the fences of the process hold :data:`MAX_FENCED_MAPS` (the
:class:`FenceLedger`, across clears), or a fence fails, the windows call
``on_unsafe`` and the rank fails: its supervisor restarts it, and the end of
the process ends its Transfer Engine and every late write with it.  Until then
a receive whose fence failed keeps its blocks held (daemon/peer_receiver.py).

**Why not the others.**  Quarantine (hold the blocks until the sender's ``done``)
keeps them from the engine for as long as a sender stalls, which is unbounded.
Staging (write elsewhere, copy after ``done``) copies every byte of every
transfer.  Windows cost nothing on the happy path once warm: a window is reused,
its page tables kept; a fresh one costs ~60 us to map and register and its first
write pays the page faults (docs/pd.md has the measurements).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from typing import Callable

import numpy as np
import posix_ipc

from kvswap.client.errors import ErrorCode, KvswapError

log = logging.getLogger("kvswap.daemon.peer")

KEEP = 4  # clean windows kept for reuse; more are unmapped when they come back
MAX_FENCED_MAPS = 8192  # scratch mappings held before the rank restarts to reclaim them
OnUnsafe = Callable[[str], None]  # the rank can no longer fence: fail it (message says why)
FENCED_SINCE = (1, 9)  # the protocol version from which senders write through windows
PAGE = mmap.PAGESIZE
_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def fences(v: tuple[int, int] | None) -> bool:
    """Does a ``begin`` carrying protocol version ``v`` write through the window its
    answer names?  (Before 1.9 a begin has no version and writes the pool.)  ``v`` as
    the listener checked it (daemon/peer_receiver.py ``read_message``): None, or two
    integers; anything else was refused PROTOCOL_ERROR there (``int(inf)`` here had
    raised OverflowError in the listener thread and failed the rank)."""
    return v is not None and v >= FENCED_SINCE


def _map(addr: int | None, length: int, flags: int, fd: int) -> int:
    out = _libc.mmap(addr, length, _RW, flags, fd, 0)
    if out is None or out == _MAP_FAILED or (addr is not None and out != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(out)


def _unmap(addr: int, length: int) -> None:
    if length > 0 and _libc.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        log.error("munmap of %d bytes at %#x failed: %s", length, addr, os.strerror(err))


class FenceLedger:
    """The scratch every fence of this process holds, across the pools it attached
    (one per rank daemon; the threads that fence and drop share it under its lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.maps = 0
        self.bytes = 0

    def change(self, kept: list[tuple[int, int]], sign: int) -> None:
        with self._lock:
            self.maps += sign * len(kept)
            self.bytes += sign * sum(n for _, n in kept)

    @property
    def exhausted(self) -> bool:
        """The fences hold :data:`MAX_FENCED_MAPS` mappings: only a restart frees them."""
        return self.maps >= MAX_FENCED_MAPS


class Window:
    """One mapping of the pool that one begun receive's sender writes through."""

    def __init__(self, owner: "PeerWindows", addr: int):
        self.owner = owner
        self.addr = addr
        self.ids: np.ndarray = np.empty(0, dtype=np.int64)  # the receive's host blocks
        self.fenced = False
        self.kept: list[tuple[int, int]] = []  # scratch left mapped after a fence

    @property
    def bases(self) -> list[int]:
        return [self.addr + off for off in self.owner.offsets]

    def release(self) -> bool:
        """``done``: the window is clean again.  False if it was fenced meanwhile (the
        pool was detached): the receive did not land in the pool."""
        return self.owner._release(self)

    def fence(self) -> None:
        """No write through this window reaches the pool any more (idempotent).  Raises
        OSError if the mapping could not be replaced: the blocks must then stay held.
        Either that or a ledger left exhausted calls the owner's ``on_unsafe``."""
        owner = self.owner
        try:
            owner._fence(self)
        except OSError as exc:
            owner.on_unsafe(f"a receive's write window could not be fenced ({exc}): its "
                            f"sender may still write the pool; restarting the rank ends it")
            raise
        if owner.ledger.exhausted:
            owner.on_unsafe(f"the write windows of failed receives hold {owner.ledger.maps} "
                            f"scratch mappings (at most {MAX_FENCED_MAPS}) that their senders "
                            f"never released with done; restarting the rank frees them")

    def drop(self) -> None:
        """The fenced receive's sender said ``done``: its write is over, unmap the
        scratch."""
        self.owner._drop(self)


class PeerWindows:
    """The windows over one attached host pool (receiver thread; detach on the control
    thread; one lock)."""

    def __init__(self, engine, shm_name: str, inode: int, pool_addr: int, pool_bytes: int,
                 bases: tuple[int, ...], block_bytes: tuple[int, ...], accept_late: bool,
                 ledger: FenceLedger, on_unsafe: OnUnsafe):
        shm = posix_ipc.SharedMemory(shm_name, 0)
        try:
            if inode and os.fstat(shm.fd).st_ino != inode:
                raise KvswapError(f"host pool {shm_name} was replaced under this daemon",
                                  ErrorCode.NOT_READY)
            self._fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
        self._engine = engine
        self._length = -(-pool_bytes // PAGE) * PAGE
        self.offsets = [b - pool_addr for b in bases]
        self._block_bytes = block_bytes
        self._accept_late = accept_late
        self._lock = threading.Lock()
        self._free: list[Window] = []
        self._busy: set[Window] = set()
        self._closed = False
        self.ledger = ledger
        self.on_unsafe = on_unsafe

    def take(self, ids: np.ndarray) -> Window:
        """A clean window for a receive into host blocks ``ids`` (mapped and registered
        now if none is free)."""
        with self._lock:
            if self._closed:
                raise KvswapError("the host pool was released (clear)", ErrorCode.NOT_READY)
            if self._free:
                w = self._free.pop()
            else:
                addr = _map(None, self._length, mmap.MAP_SHARED, self._fd)
                try:
                    self._engine.register_window(addr, self._length)
                except KvswapError:
                    _unmap(addr, self._length)
                    raise
                w = Window(self, addr)
            w.ids = np.asarray(ids, dtype=np.int64)
            self._busy.add(w)
            return w

    def _release(self, w: Window) -> bool:
        with self._lock:
            if w.fenced:
                return False
            self._busy.discard(w)
            if self._closed or len(self._free) >= KEEP:
                self._close_clean(w)
            else:
                self._free.append(w)
            return True

    def _close_clean(self, w: Window) -> None:
        self._engine.unregister_window(w.addr)
        _unmap(w.addr, self._length)

    def _extents(self, w: Window) -> list[tuple[int, int]]:
        """[start, end) of the window the receive's spans can touch, page-rounded, merged."""
        if w.ids.size == 0:
            return []
        lo, hi = int(w.ids.min()), int(w.ids.max()) + 1
        spans = sorted((off + lo * bpb, off + hi * bpb)
                       for off, bpb in zip(self.offsets, self._block_bytes))
        out: list[list[int]] = []
        for a, b in spans:
            a, b = a // PAGE * PAGE, min(-(-b // PAGE) * PAGE, self._length)
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    def _fence(self, w: Window) -> None:
        with self._lock:
            if w.fenced or w not in self._busy:
                # fenced already, or handed back by a release that raced this fence (a
                # stop): its addresses may be unmapped or lent again, never ours to map
                return
            extents = self._extents(w)
            for a, b in extents:  # atomic per extent: in-flight writes now hit scratch
                _map(w.addr + a, b - a, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED |
                     _MAP_NORESERVE, -1)
            self._engine.unregister_window(w.addr)  # RDMA: the memory region is gone
            w.fenced = True  # from here on the pool is out of its sender's reach
            self._busy.discard(w)
            w.kept = [(w.addr + a, b - a) for a, b in extents]
            if self._accept_late:  # TCP: late requests land in scratch, not refused (a
                for addr, n in w.kept:  # refusal resets the sender's lanes: its next
                    try:  # transfer here would wait ~1 s or fail)
                        self._engine.register_window(addr, n)
                    except KvswapError as exc:
                        log.warning("late writes to a fenced window will be refused: %s", exc)
            prev = 0
            for a, b in extents + [(self._length, self._length)]:
                _unmap(w.addr + prev, a - prev)  # never written by that sender
                prev = b
            self.ledger.change(w.kept, +1)
        log.warning("a receive's write window was fenced (%d bytes of scratch; %d bytes in %d "
                    "mappings held in all until those senders say done)",
                    sum(n for _, n in w.kept), self.ledger.bytes, self.ledger.maps)

    def _drop(self, w: Window) -> None:
        with self._lock:
            for addr, n in w.kept:
                if self._accept_late:
                    self._engine.unregister_window(addr)
                _unmap(addr, n)
            self.ledger.change(w.kept, -1)
            w.kept = []

    def close(self) -> None:
        """The pool is detached: fence the windows of receives still begun, unmap the
        clean ones.  A fence that fails leaves that window mapped and the rank failed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            busy = list(self._busy)
        for w in busy:
            try:
                w.fence()
            except OSError as exc:
                log.error("a write window could not be fenced at detach: %s", exc)
        with self._lock:
            free, self._free = self._free, []
            for w in free:
                self._close_clean(w)
            os.close(self._fd)
