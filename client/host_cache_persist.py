"""A ``HostCache`` index that survives the engine: ``/kvswap.<ns>.hcindex``.

The daemons keep their host pools when an engine process dies (an engine
restart, ``docs/operations.md``), but which block holds which hash is known only
to the scheduler's :class:`~kvswap.client.host_cache.HostCache`.  An engine that
asks for it (``HostCache(..., persist=namespace)``) gets that index mirrored in
the namespace's shared memory, so its successor starts with the blocks that are
still good instead of an empty tier.

The mirror is never ahead of the host pool, which is what makes it safe to
trust after a crash at any instruction:

* a host block is marked *being written* in ``prepare_store``, before the engine
  can send the evict that overwrites it, and
* it is marked ready (key first, then the state byte) only in
  ``complete_store(success=True)``, after its transfer was acknowledged.

So a block marked ready holds the bytes of its key; a crash between a
transfer's end and its bookkeeping loses that block from the mirror, never the
other way round.

A block still *being written* when the engine died is not free for its
successor: the dead engine's evict into it may not have reached a daemon yet
(a daemon busy or stopped, the message still in its socket) and would then run
after the successor's own evict into the same block, over it.  Tasks of two
clients are not ordered (docs/architecture.md), and nothing the successor sends
can be ordered after a message still on a dead client's connection.  What ends
such a message is the daemon that would have read it: a restarted rank starts
with new sockets and rings, and its journal replays what its predecessor had
admitted before it serves anything new.  So the successor *quarantines* those
blocks (state 3, with the ranks' epochs of that moment): they are handed out to
nobody until a later successor finds every rank's epoch above the recorded one,
and then are free again.  The cost is the blocks that were in flight at each
crash, counted in ``stats()["quarantined"]``; they add up over engine crashes
until every rank has restarted (an engine restart alone restarts no rank), and a
successor warns when they pass :data:`QUARANTINE_WARN` of the cache.  A daemon
that refused the tasks of a dead sender would make this unnecessary: nothing in
the protocol tells a daemon that a sender died (left open).

The pools themselves must be the ones the mirror describes:
the header records the inode of every rank's host pool segment, and a successor
that finds another pool (a relaunch, ``clear_caches(free_host=True)``, another
layout) discards the mirror.  A weight update frees the pools, and ``clear()``
(the HostCache's, after it) sets the recorded inodes to 0, "not known": the
next ``unready`` records the pools of that moment, before the engine can send
the evict whose block it marks, so a block's bytes are never in a pool older
than the one recorded.  With the pools kept (``free_host=False``) a weight
update leaves the inodes as they were, so the header also records the
namespace's barrier generation (every ``clear_caches`` moves it, a restarted
rank does not): a scheduler that died between ``clear_caches`` and the
cache's ``clear()`` leaves a mirror of the old weights' blocks, and its
successor discards it.  (Recorded at ``ready`` instead, a pool replaced between
the transfer and its bookkeeping would be trusted for a block it never held.)
A successor also discards a mirror that is not consistent (a key in two ready
blocks, a stamp at or past the next one): only a damaged segment looks so.
Keys are the 32-byte block hashes that ``block_hashes()`` returns (a persisted
index stores bytes, not Python objects).

::

    offset 0           64             64+8*tp      64+16*tp     +32*N        +N           +8*N
    +------------------+--------------+------------+------------+------------+------------+
    | header (8 x u64) | pool inodes  | quarantine | keys       | state      | stamps     |
    |                  | tp x u64     | tp x u64   | N x 32 B   | N x u8     | N x u64    |
    +------------------+--------------+------------+------------+------------+------------+
    header slots: magic, version, num_blocks, tp, next stamp, owner pid, generation,
                  1 reserved
    pool inodes: 0 = not known (after clear(), until the next unready())
    quarantine: every rank's epoch when the quarantined blocks were found (0: none)
    state: 0 free, 1 ready, 2 being written, 3 quarantined; stamps: completion order
    (oldest first)

One writer (the scheduler thread of the engine that owns it); its successor
reads it once, in the constructor, after the writer is gone.  The owner's pid is
in the header: a second HostCache of the namespace while the owner lives would
hand out the same blocks and write the one mirror over the other's, so it is
refused (claimed under ``flock``, so two successors starting at once cannot both
take it); ``close()`` gives it up, and a dead owner's claim is taken over.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import weakref

import numpy as np
import posix_ipc

from kvswap.client.errors import NamespaceError
from kvswap.client.naming import Names
from kvswap.client.shm_region import SHM_DIR, ShmRegion
from kvswap.client.signals import RankSlot, SignalSegment, pid_alive

log = logging.getLogger("kvswap.client")

MAGIC = int.from_bytes(b"KVSWAPHI", "little")
LAYOUT_VERSION = 2
HEADER_SLOTS = 8
KEY_BYTES = 32
_MAGIC, _VERSION, _NUM_BLOCKS, _TP, _NEXT_STAMP, _OWNER, _GENERATION = range(7)
FREE, READY, WRITING, QUARANTINED = range(4)  # the state byte of a block
QUARANTINE_WARN = 1 / 8  # of the blocks: a successor warns past this many quarantined
# This process's open mirrors by segment name: the owner pid cannot tell two caches of
# one process apart.
_OPEN: "weakref.WeakValueDictionary[str, PersistedIndex]" = weakref.WeakValueDictionary()


def segment_size(num_blocks: int, tp: int) -> int:
    return HEADER_SLOTS * 8 + 2 * tp * 8 + num_blocks * (KEY_BYTES + 1 + 8)


def pool_inodes(names: Names, tp: int) -> list[int]:
    """The inode of each rank's host pool segment (0 where it does not exist)."""
    out = []
    for rank in range(tp):
        try:
            out.append(os.stat(f"/dev/shm/{names.swap_segment(rank).lstrip('/')}").st_ino)
        except FileNotFoundError:
            out.append(0)
    return out


def generation(seg: SignalSegment) -> int:
    """The namespace's barrier generation: moved by every ``clear_caches`` (its clear
    barrier and the start-up barrier after the restore), not by a rank's restart."""
    return int(seg.ranks[:, RankSlot.BARRIER_ARRIVALS].max())


class PersistedIndex:
    """The mirror of one HostCache's ready blocks (see the module docstring)."""

    def __init__(self, namespace: str, num_blocks: int, run_root: str | None = None):
        names = Names.of(namespace, run_root)
        seg = SignalSegment.attach(names)
        try:
            tp = seg.tp_size
            epochs = [int(e) for e in seg.ranks[:, RankSlot.EPOCH]]
            gen = generation(seg)
        finally:
            seg.close()
        inodes = pool_inodes(names, tp)
        if not all(inodes):
            missing = [r for r, i in enumerate(inodes) if not i]
            raise ValueError(f"HostCache persist: rank(s) {missing} of namespace {namespace!r} "
                             f"have no host pool yet; create the HostCache after the workers "
                             f"registered (TransferClient.wait_ready)")
        self.name = names.host_cache_index
        self._names = names
        self._region = ShmRegion.create(self.name, segment_size(num_blocks, tp),
                                        exclusive=False)
        buf, n = self._region, num_blocks
        self._header = buf.array(0, (HEADER_SLOTS,), np.uint64)
        try:
            self._claim(namespace)
        except BaseException:
            self._header = None
            self._region.close()
            raise
        self._inodes = buf.array(HEADER_SLOTS * 8, (tp,), np.uint64)
        self._quarantine = buf.array(HEADER_SLOTS * 8 + tp * 8, (tp,), np.uint64)
        off = HEADER_SLOTS * 8 + 2 * tp * 8
        self._keys = buf.array(off, (n, KEY_BYTES), np.uint8)
        self._state = buf.array(off + n * KEY_BYTES, (n,), np.uint8)
        self._stamps = buf.array(off + n * (KEY_BYTES + 1), (n,), np.uint64)
        self.recovered: list[tuple[bytes, int]] = []
        self.quarantined: list[int] = []
        why = self._mismatch(num_blocks, tp, inodes, gen)
        if why is None:
            ready = np.flatnonzero(self._state == READY)
            order = ready[np.argsort(self._stamps[ready], kind="stable")]
            self.recovered = [(self._keys[i].tobytes(), int(i)) for i in order]
            why = self._inconsistent(ready)
        if why is None:
            self._quarantine_writes(epochs)
            log.info("HostCache persist: %d ready block(s) recovered from %s, %d "
                     "quarantined", len(self.recovered), self.name, len(self.quarantined))
        else:
            self.recovered = []
            if self._header[_MAGIC] != 0:
                log.warning("HostCache persist: %s discarded (%s)", self.name, why)
            self._state[:] = FREE
            self._quarantine[:] = 0
            self._header[_NUM_BLOCKS] = num_blocks
            self._header[_TP] = tp
            self._header[_NEXT_STAMP] = 1
            self._inodes[:] = inodes
            self._header[_GENERATION] = gen
            self._header[_VERSION] = LAYOUT_VERSION
            self._header[_MAGIC] = MAGIC

    def _mismatch(self, num_blocks: int, tp: int, inodes: list[int], gen: int) -> str | None:
        """Why the segment cannot be trusted, or None when it can."""
        h = self._header
        if h[_MAGIC] != MAGIC:
            return "no index written yet"
        if h[_VERSION] != LAYOUT_VERSION:
            return f"layout version {int(h[_VERSION])}, not {LAYOUT_VERSION}"
        if h[_NUM_BLOCKS] != num_blocks or h[_TP] != tp:
            return (f"written for {int(h[_NUM_BLOCKS])} blocks at TP {int(h[_TP])}, not "
                    f"{num_blocks} at TP {tp}")
        if list(map(int, self._inodes)) != inodes:
            return "the host pools are not the ones it describes (relaunched or freed)"
        if int(h[_GENERATION]) != gen:
            return "the namespace's caches were cleared since (a weight update)"
        return None

    def _claim(self, namespace: str) -> None:
        """Become the mirror's one writer (module docstring), or raise NamespaceError
        naming the live owner; nothing is changed then."""
        if _OPEN.get(self.name) is not None:
            gc.collect()  # a cache dropped without close() but still in a reference cycle
        if _OPEN.get(self.name) is not None:
            raise NamespaceError(
                f"HostCache persist: namespace {namespace!r}'s persisted index is owned by "
                f"another live HostCache of this process; one HostCache per namespace: "
                f"close() that one first")
        fd = os.open(f"{SHM_DIR}/{self.name.lstrip('/')}", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a few instructions by any claimant
            owner = int(self._header[_OWNER])
            if owner and owner != os.getpid() and pid_alive(owner):
                raise NamespaceError(
                    f"HostCache persist: namespace {namespace!r}'s persisted index is owned by "
                    f"the live HostCache of pid {owner}; one HostCache per namespace: close() "
                    f"that one (or end its process) first")
            self._header[_OWNER] = os.getpid()
        finally:
            os.close(fd)  # and the lock with it
        _OPEN[self.name] = self

    def _quarantine_writes(self, epochs: list[int]) -> None:
        """Blocks the dead writer left *being written* are quarantined at the ranks'
        epochs of now; quarantined ones are freed once every rank has restarted since
        (see the module docstring)."""
        held = self._state == QUARANTINED
        if held.any() and all(now > then > 0 for now, then in zip(epochs, self._quarantine)):
            self._state[held] = FREE
            log.info("HostCache persist: %d quarantined block(s) free again (every rank "
                     "restarted since)", int(held.sum()))
        writing = self._state == WRITING
        if writing.any():
            self._state[writing] = QUARANTINED
            self._quarantine[:] = epochs  # the newest quarantine sets when all are freed
        self.quarantined = [int(i) for i in np.flatnonzero(self._state == QUARANTINED)]
        if not self.quarantined:
            self._quarantine[:] = 0
        elif len(self.quarantined) > QUARANTINE_WARN * len(self._state):
            log.warning("HostCache persist: %d of %d host blocks are quarantined (stores "
                        "in flight when engines died); they are free again once every rank "
                        "has restarted (kill one and kvswap launch restarts it) or the "
                        "namespace is relaunched", len(self.quarantined), len(self._state))

    def _inconsistent(self, ready: np.ndarray) -> str | None:
        """Why the ready blocks cannot be what a writer left, or None (a damaged segment:
        the one writer gives a key one block and stamps below the next one)."""
        if len({k for k, _ in self.recovered}) != len(self.recovered):
            return "a key is in two ready blocks (the segment is damaged)"
        if ready.size and int(self._stamps[ready].max()) >= int(self._header[_NEXT_STAMP]):
            return "a ready block's stamp is not below the next stamp (the segment is damaged)"
        if int(self._header[_NEXT_STAMP]) >= 1 << 62:
            return "its next stamp is out of range (the segment is damaged)"
        return None

    # ------------------------------------------------------------------ writer
    def unready(self, ids: list[int]) -> None:
        """Blocks about to be written (prepare_store): being written from now on.  After
        a clear, the pools of this moment become the ones the mirror describes."""
        self._state[ids] = WRITING
        if not self._inodes.all():
            inodes = pool_inodes(self._names, len(self._inodes))
            if all(inodes):  # else not known still: a successor discards the mirror
                seg = SignalSegment.attach(self._names)
                try:
                    self._header[_GENERATION] = generation(seg)
                finally:
                    seg.close()
                self._inodes[:] = inodes

    def ready(self, keys: list[bytes], ids: list[int]) -> None:
        """Blocks whose store completed: key and stamp first, then the state byte."""
        if not ids:
            return
        self._keys[ids] = np.frombuffer(b"".join(keys), np.uint8).reshape(len(ids), KEY_BYTES)
        first = int(self._header[_NEXT_STAMP])
        self._stamps[ids] = np.arange(first, first + len(ids), dtype=np.uint64)
        self._header[_NEXT_STAMP] = first + len(ids)
        self._state[ids] = READY

    def clear(self) -> None:
        """Nothing ready, and the pools not known (a weight update frees them).  Blocks
        being written or quarantined stay so: with ``free_host=False`` the pools, and
        whatever may still write into them, outlive the update."""
        self._state[self._state == READY] = FREE
        self._inodes[:] = 0

    def close(self, unlink: bool = False) -> None:
        """Give up the claim and unmap; ``unlink`` removes the segment (the engine will
        not come back)."""
        if self._header is not None and int(self._header[_OWNER]) == os.getpid():
            self._header[_OWNER] = 0
        if _OPEN.get(self.name) is self:
            del _OPEN[self.name]
        self._header = self._inodes = self._quarantine = self._keys = self._state = None
        self._stamps = None
        if unlink:
            try:
                self._region.unlink()
            except posix_ipc.ExistentialError:
                pass
        self._region.close()
