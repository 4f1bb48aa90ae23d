"""Shared-memory signal segment of a namespace, and the cross-rank barrier.

One POSIX shm segment per namespace, ``/kvswap.<ns>.signals``, created (and
later unlinked) by the launcher; daemons, CacheWorkers, clients and
``kvswap status`` only attach.  Everything in it is a little-endian u64 slot,
so every field is written with one aligned store and each field has one
writing thread (the table below; the engine heartbeat is the exception: every
CacheWorker writes its current time, and any recent value means alive):
readers never see a torn value and no lock is needed.  Observing the segment never blocks a daemon.

::

    offset 0                      128                 128 + 256*r     128 + 256*tp
    +-----------------------------+-------------------+-----+------------+------------------+
    | namespace header (16 x u64) | rank 0 (32 x u64) | ... | rank tp-1  | layer tables     |
    +-----------------------------+-------------------+-----+------------+------------------+
    layer tables: per rank, 64 entries x 8 u64 (4 KiB):
        task_id | generation | layers_done | num_layers | state (LayerState) | 3 reserved
    then agreement tables: per rank, 64 entries x 4 u64 (2 KiB):
        task_id | round | value | state (AgreeState)
    then stats: per rank, latency histograms (evict, load, backup, prefetch) x
        (queued, exec) x (26 log2-us buckets, count, sum_us), then 64 error counters
        indexed by ErrorCode position

    namespace header                      rank block
    slot  field                           slot  field
    0     magic "KVSWAPSG"                0     state (RankState)
    1     layout_version                  1     pid
    2     tp_size                         2     epoch
    3     created_unix_ns                 3     heartbeat_ns (CLOCK_MONOTONIC)
    4     launcher_pid                    4     cache_ready (0/1)
    5     engine_heartbeat_ns             5     swap_ready (0/1)
    6     kvcache_status (KvCacheStatus)  6     inflight
    7     storage_tier (0/1)              7     completed
    8     engine_timeout_ms               8     failed
    9-15  reserved                        9     bytes_evicted
                                          10    bytes_loaded
                                          11    num_device_blocks
                                          12    num_host_blocks
                                          13    barrier_arrivals
                                          14    last_error (ErrorCode)
                                          15    swap_bytes_total
                                          16    swap_bytes_pinned
                                          17    conn_refused
                                          18-31 reserved

Writers and readers of every field are in :data:`HEADER_FIELDS` and
:data:`RANK_FIELDS` (and in ``docs/signals.md``).

Barrier: each rank publishes in ``barrier_arrivals`` the highest barrier
generation it has reached; generation g completes for a rank when every
participant's value is >= g.  A rank that arrives posts every other
participant's wake semaphore (``/kvswap.<ns>.wake.r<r>``), so waiters sleep
instead of spinning; they wake at least every 50 ms to check for a FAILED or
silent participant (abort) and for their deadline (timeout).  An arrival is
never withdrawn: it says the rank reached the point the barrier stands for,
which giving up the wait does not undo (:class:`Barrier`).
"""

from __future__ import annotations

import enum
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np
import posix_ipc

from kvswap.client.errors import (
    BarrierAborted,
    BarrierTimeout,
    ErrorCode,
    KvswapError,
    NamespaceError,
    RankTimeout,
)
from kvswap.client.naming import Names
from kvswap.client.shm_region import allocate
from kvswap.client.protocol import OPS

MAGIC = int.from_bytes(b"KVSWAPSG", "little")
LAYOUT_VERSION = 5
HEADER_SLOTS = 16
RANK_SLOTS = 32
RANK_BYTES = RANK_SLOTS * 8
HEADER_OFFSET = 0
RANKS_OFFSET = HEADER_SLOTS * 8
LAYER_SLOTS = 64  # layer-progress entries per rank (a ring)
LAYER_ENTRY_SLOTS = 8
LAYER_TABLE_BYTES = LAYER_SLOTS * LAYER_ENTRY_SLOTS * 8
AGREE_SLOTS = 64  # agreement entries per rank (a ring)
AGREE_ENTRY_SLOTS = 4
AGREE_TABLE_BYTES = AGREE_SLOTS * AGREE_ENTRY_SLOTS * 8

# Latency histograms: per rank, per timed op, per phase, log2 buckets of
# microseconds (bucket b counts values in [2^(b-1), 2^b) us; bucket 0 is < 1 us;
# the last bucket also takes everything longer), then a count and a sum (us).
# The timed ops are those the op table marks ``timed``, in its order; that order
# is part of this layout (drawn above and in docs/signals.md; a test holds the
# three equal), so a new timed op goes after the existing timed ones in the op
# table and bumps LAYOUT_VERSION.
HIST_OPS: tuple[str, ...] = tuple(op.value for op, spec in OPS.items() if spec.timed)
HIST_PHASES = ("queued", "exec")
HIST_BUCKETS = 26  # up to 2^25 us (33 s) before the open last bucket
HIST_SLOTS = HIST_BUCKETS + 2  # buckets, count, sum_us
ERROR_SLOTS = 64  # errors by code, indexed by position in ErrorCode
STATS_BYTES = (len(HIST_OPS) * len(HIST_PHASES) * HIST_SLOTS + ERROR_SLOTS) * 8
SHM_MODE = 0o600


@enum.unique
class RankState(enum.IntEnum):
    """Life cycle of one rank daemon, as published in its ``state`` slot.

    ABSENT -> STARTING -> ATTACHING -> READY <-> PAUSED
    READY -> CLEARING -> CLEARED -> ATTACHING (restore)
    any -> STOPPING -> STOPPED (clean exit);  any -> FAILED
    """

    ABSENT = 0  # slot never written: daemon not started yet
    STARTING = 1  # process up, binding its socket
    ATTACHING = 2  # serving; waiting for caches to be registered / the start-up barrier
    READY = 3  # caches attached, swap space ready, all ranks attached
    PAUSED = 4
    CLEARING = 5
    CLEARED = 6
    STOPPING = 7  # shutdown requested; queued tasks are failed, running one finishes
    STOPPED = 8  # exited cleanly
    FAILED = 9  # unrecoverable error; see last_error and the rank's log


@enum.unique
class KvCacheStatus(enum.IntEnum):
    """Namespace-wide state of the engine's KV caches (weight-update flow)."""

    NORMAL = 0
    CLEARING = 1
    CLEARED = 2


@dataclass(frozen=True)
class Slot:
    name: str
    index: int
    writer: str
    readers: str
    doc: str


HEADER_FIELDS: tuple[Slot, ...] = (
    Slot("magic", 0, "launcher (create)", "every attacher",
         "0x475350415753564B ('KVSWAPSG' little-endian)"),
    Slot("layout_version", 1, "launcher (create)", "every attacher", "this layout's version"),
    Slot("tp_size", 2, "launcher (create)", "every attacher", "number of rank blocks"),
    Slot("created_unix_ns", 3, "launcher (create)", "status", "wall-clock creation time"),
    Slot("launcher_pid", 4, "launcher (create)", "daemons (orphan check), next launcher, status",
         "pid of the supervising launcher"),
    Slot("engine_heartbeat_ns", 5, "every CacheWorker's heartbeat thread (each writes its "
         "current time; any recent value means alive)", "launcher, daemons (orphan check), status",
         "last engine heartbeat, CLOCK_MONOTONIC ns; 0 = never"),
    Slot("kvcache_status", 6, "rank 0's daemon (clear / restore)", "status, engine",
         "KvCacheStatus"),
    Slot("storage_tier", 7, "launcher (create)", "engine (HostCache.prefetch)",
         "1: launched with --storage, 0: without"),
    Slot("engine_timeout_ms", 8, "launcher (create)", "CacheWorker (checks its heartbeat)",
         "--engine-timeout in ms; 0 = never"),
)

RANK_FIELDS: tuple[Slot, ...] = (
    Slot("state", 0, "daemon (state machine, under its lock)",
         "launcher, supervisor, client, status, barrier", "RankState"),
    Slot("pid", 1, "daemon main thread", "supervisor, next daemon of the rank, status",
         "daemon process id"),
    Slot("epoch", 2, "daemon main thread (+1 at every start)", "client (restart detection), "
         "daemon (ep check), status", "incremented on every daemon start"),
    Slot("heartbeat_ns", 3, "daemon heartbeat thread", "supervisor, barrier, client, status",
         "last beat, CLOCK_MONOTONIC ns"),
    Slot("cache_ready", 4, "daemon control thread", "status", "1 while caches are attached"),
    Slot("swap_ready", 5, "daemon control thread", "status", "1 while the host pool exists"),
    Slot("inflight", 6, "daemon I/O thread", "daemon control thread (clear drain), status",
         "tasks of TRANSFER ops (copies and storage ops) accepted and not yet answered"),
    Slot("completed", 7, "daemon I/O thread", "status",
         "tasks of TRANSFER ops (copies and storage ops) answered OK"),
    Slot("failed", 8, "daemon I/O thread", "status",
         "requests rejected, or tasks of TRANSFER ops answered with an error other than "
         "CANCELLED"),
    Slot("bytes_evicted", 9, "daemon I/O thread", "status",
         "bytes copied device -> host by successful evicts"),
    Slot("bytes_loaded", 10, "daemon I/O thread", "status",
         "bytes copied host -> device by successful loads"),
    Slot("num_device_blocks", 11, "daemon control thread", "client (range checks), status",
         "blocks per device tensor"),
    Slot("num_host_blocks", 12, "daemon control thread", "client (range checks), status",
         "blocks per host tensor"),
    Slot("barrier_arrivals", 13, "the rank's barrier caller (control thread; main thread "
         "at a restart)", "barrier", "highest barrier generation reached (no wait lowers it)"),
    Slot("last_error", 14, "daemon (any thread, via state machine)", "launcher, client, status",
         "ErrorCode of the last failure"),
    Slot("swap_bytes_total", 15, "daemon control thread", "status", "size of the host swap pool"),
    Slot("swap_bytes_pinned", 16, "daemon control thread", "status",
         "bytes of the pool made ready so far: populated (host), populated then pinned (cuda)"),
    Slot("conn_refused", 17, "daemon connection guard thread; reset at start",
         "TransferClient error messages, status --json",
         "connections refused since the daemon started: its share of file descriptors was "
         "used up"),
)


@enum.unique
class HeaderSlot(enum.IntEnum):
    """Slot index of each namespace header field."""

    MAGIC = 0
    LAYOUT_VERSION = 1
    TP_SIZE = 2
    CREATED_UNIX_NS = 3
    LAUNCHER_PID = 4
    ENGINE_HEARTBEAT_NS = 5
    KVCACHE_STATUS = 6
    STORAGE_TIER = 7
    ENGINE_TIMEOUT_MS = 8


@enum.unique
class RankSlot(enum.IntEnum):
    """Slot index of each rank field."""

    STATE = 0
    PID = 1
    EPOCH = 2
    HEARTBEAT_NS = 3
    CACHE_READY = 4
    SWAP_READY = 5
    INFLIGHT = 6
    COMPLETED = 7
    FAILED = 8
    BYTES_EVICTED = 9
    BYTES_LOADED = 10
    NUM_DEVICE_BLOCKS = 11
    NUM_HOST_BLOCKS = 12
    BARRIER_ARRIVALS = 13
    LAST_ERROR = 14
    SWAP_BYTES_TOTAL = 15
    SWAP_BYTES_PINNED = 16
    CONN_REFUSED = 17


def layers_offset(tp_size: int) -> int:
    return RANKS_OFFSET + tp_size * RANK_BYTES


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs.  A zombie (exited, not yet reaped) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no descriptor to spare (EMFILE), or no /proc: it exists (kill said so)
        return True


def agree_offset(tp_size: int) -> int:
    return layers_offset(tp_size) + tp_size * LAYER_TABLE_BYTES


def stats_offset(tp_size: int) -> int:
    return agree_offset(tp_size) + tp_size * AGREE_TABLE_BYTES


def segment_size(tp_size: int) -> int:
    return stats_offset(tp_size) + tp_size * STATS_BYTES


_ERROR_INDEX = {code: i for i, code in enumerate(ErrorCode)}
assert len(_ERROR_INDEX) <= ERROR_SLOTS


def hist_bucket(us: float) -> int:
    """Bucket of a duration in microseconds (see HIST_BUCKETS)."""
    return min(HIST_BUCKETS - 1, max(0, int(us)).bit_length())


def u64_cells(arr: np.ndarray) -> memoryview:
    """A C-contiguous ``<u8`` array as a flat memoryview of native u64 ints (the same
    on the little-endian hosts kvswap runs on): reading or writing one item costs a
    third of numpy's scalar indexing, and a daemon updates several per task."""
    return memoryview(arr).cast("B").cast("Q")


class RankStats:
    """A rank's histograms and error counters; written by its daemon's I/O thread only."""

    __slots__ = ("hist", "errors", "_hist", "_errors", "_phases")

    def __init__(self, hist: np.ndarray, errors: np.ndarray):
        self.hist = hist  # (op, phase, HIST_SLOTS)
        self.errors = errors  # (ERROR_SLOTS,)
        self._hist, self._errors = u64_cells(hist), u64_cells(errors)
        self._phases = hist.shape[1]

    def record(self, op: int, phase: int, us: float) -> None:
        row = (op * self._phases + phase) * HIST_SLOTS
        cells = self._hist
        cells[row + hist_bucket(us)] += 1
        cells[row + HIST_BUCKETS] += 1
        cells[row + HIST_BUCKETS + 1] += int(us)

    def error(self, code: ErrorCode) -> None:
        self._errors[_ERROR_INDEX[code]] += 1

    def snapshot(self) -> dict:
        hist = {}
        for oi, op in enumerate(HIST_OPS):
            hist[op] = {}
            for pi, phase in enumerate(HIST_PHASES):
                row = self.hist[oi, pi]
                hist[op][phase] = {"buckets": [int(x) for x in row[:HIST_BUCKETS]],
                                   "count": int(row[HIST_BUCKETS]),
                                   "sum_us": int(row[HIST_BUCKETS + 1])}
        errors = {code.name: int(self.errors[i]) for code, i in _ERROR_INDEX.items()
                  if int(self.errors[i])}
        return {"histograms": hist, "errors": errors}


@enum.unique
class AgreeSlot(enum.IntEnum):
    """Slot index inside one agreement entry."""

    TASK_ID = 0  # written last when the entry is posted
    ROUND = 1
    VALUE = 2
    STATE = 3  # AgreeState


@enum.unique
class AgreeState(enum.IntEnum):
    FREE = 0
    POSTED = 1
    ABORTED = 2  # the owner gave up (timeout, failure, cancel): everyone aborts
    DONE = 3  # a POSTED last-round entry whose owner completed the task (value still valid)


@enum.unique
class LayerSlot(enum.IntEnum):
    """Slot index inside one layer-progress entry."""

    TASK_ID = 0  # written last when an entry is claimed
    GENERATION = 1  # bumped when the entry is (re)claimed
    LAYERS_DONE = 2
    NUM_LAYERS = 3
    STATE = 4  # LayerState


@enum.unique
class LayerState(enum.IntEnum):
    FREE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: system-wide on Linux, so comparable across processes."""
    return time.monotonic_ns()


class SegmentClosed(KvswapError):
    """A :class:`SignalSegment` used after its :meth:`~SignalSegment.close`: raised
    instead of reading or writing a mapping that may be gone."""

    default_code = ErrorCode.SHUTTING_DOWN


def _u64_view(buf: mmap.mmap, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A ``<u8`` view of ``buf``.  ``np.frombuffer`` keeps a buffer export on the mmap
    for as long as the array or any view derived from it lives (a slice, a reshape, a
    :func:`u64_cells` memoryview), so the mmap refuses to close under it: memory
    safety does not depend on who closes what when.  ``np.ndarray(buffer=mmap)``
    would release the export at once and keep a bare pointer, which a later unmap
    leaves dangling (a read then kills the process with SIGSEGV)."""
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype="<u8", count=count, offset=offset).reshape(shape)


class SignalSegment:
    """A mapped signal segment.  Only the creator may :meth:`unlink` it.

    The views (``header``, ``ranks``, ``layers``, ``agree``) raise
    :class:`SegmentClosed` once :meth:`close` was called.  A view obtained before
    (kept by a :class:`RankSignals`, a ``LayerProgress``, or a thread that was
    reading while another closed) keeps the mapping alive until it is dropped."""

    def __init__(self, names: Names, shm: posix_ipc.SharedMemory, buf: mmap.mmap,
                 creator: bool, readonly: bool):
        self.names = names
        self._shm = shm
        self._buf: mmap.mmap | None = buf
        self._close_lock = threading.Lock()
        self.creator = creator
        self.readonly = readonly
        header = _u64_view(buf, (HEADER_SLOTS,), HEADER_OFFSET)
        self.tp_size = int(header[HeaderSlot.TP_SIZE])
        tp = self.tp_size
        self._header: np.ndarray | None = header
        self._ranks: np.ndarray | None = _u64_view(buf, (tp, RANK_SLOTS), RANKS_OFFSET)
        self._layers: np.ndarray | None = _u64_view(
            buf, (tp, LAYER_SLOTS, LAYER_ENTRY_SLOTS), layers_offset(tp))
        self._agree: np.ndarray | None = _u64_view(
            buf, (tp, AGREE_SLOTS, AGREE_ENTRY_SLOTS), agree_offset(tp))
        self._stats: np.ndarray | None = _u64_view(buf, (tp, STATS_BYTES // 8),
                                                   stats_offset(tp))

    # ------------------------------------------------------------------ views
    def _closed_error(self) -> SegmentClosed:
        return SegmentClosed(f"the signal segment {self.names.signals} of namespace "
                             f"{self.names.namespace!r} was closed by its owner (a "
                             f"TransferClient, CacheWorker or status reader): open a new one")

    def _open(self, view: np.ndarray | None) -> np.ndarray:
        if view is None:
            raise self._closed_error()
        return view

    @property
    def closed(self) -> bool:
        return self._buf is None

    @property
    def header(self) -> np.ndarray:
        """The namespace header (:class:`HeaderSlot`)."""
        return self._open(self._header)

    @property
    def ranks(self) -> np.ndarray:
        """``(tp_size, RANK_SLOTS)``: every rank's block (:class:`RankSlot`)."""
        return self._open(self._ranks)

    @property
    def layers(self) -> np.ndarray:
        """``(tp_size, LAYER_SLOTS, LAYER_ENTRY_SLOTS)``: layer-progress rings."""
        return self._open(self._layers)

    @property
    def agree(self) -> np.ndarray:
        """``(tp_size, AGREE_SLOTS, AGREE_ENTRY_SLOTS)``: agreement rings."""
        return self._open(self._agree)

    # ------------------------------------------------------------------ open/close
    @classmethod
    def create(cls, names: Names, tp_size: int, storage_tier: bool = False,
               engine_timeout_s: float = 0.0) -> "SignalSegment":
        """Create the namespace's segment (the launcher); ``storage_tier``: launched
        with ``--storage``; ``engine_timeout_s``: its ``--engine-timeout``."""
        if not 1 <= tp_size <= 1024:
            raise ValueError(f"tp_size must be in [1, 1024], got {tp_size}")
        try:
            shm = posix_ipc.SharedMemory(names.signals, posix_ipc.O_CREX, mode=SHM_MODE,
                                         size=segment_size(tp_size))
        except posix_ipc.ExistentialError:
            raise NamespaceError(
                f"namespace {names.namespace!r} is in use: {names.signals} already exists"
            ) from None
        try:
            allocate(shm.fd, shm.size, names.signals)  # a full /dev/shm: an error, not SIGBUS
            buf = mmap.mmap(shm.fd, shm.size)
        except BaseException:
            posix_ipc.unlink_shared_memory(names.signals)
            raise
        finally:
            shm.close_fd()
        header = _u64_view(buf, (HEADER_SLOTS,), HEADER_OFFSET)
        header[HeaderSlot.TP_SIZE] = tp_size
        header[HeaderSlot.LAYOUT_VERSION] = LAYOUT_VERSION
        header[HeaderSlot.CREATED_UNIX_NS] = time.time_ns()
        header[HeaderSlot.LAUNCHER_PID] = os.getpid()
        header[HeaderSlot.KVCACHE_STATUS] = KvCacheStatus.NORMAL
        header[HeaderSlot.STORAGE_TIER] = int(storage_tier)
        header[HeaderSlot.ENGINE_TIMEOUT_MS] = round(engine_timeout_s * 1000)
        # written last: attachers treat the segment as valid from here
        header[HeaderSlot.MAGIC] = MAGIC
        seg = cls(names, shm, buf, creator=True, readonly=False)
        del header
        return seg

    @classmethod
    def attach(cls, names: Names, readonly: bool = False) -> "SignalSegment":
        try:
            shm = posix_ipc.SharedMemory(names.signals, 0, read_only=readonly)
        except posix_ipc.ExistentialError:
            raise NamespaceError(
                f"namespace {names.namespace!r} does not exist (no {names.signals}); "
                f"start it with 'kvswap launch --namespace {names.namespace}'"
            ) from None
        try:
            size = shm.size
            if size < RANKS_OFFSET:
                raise NamespaceError(f"{names.signals} is too small ({size} bytes)")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            buf = mmap.mmap(shm.fd, size, prot=prot)
        finally:
            shm.close_fd()
        header = _u64_view(buf, (HEADER_SLOTS,), HEADER_OFFSET)
        magic, version = int(header[HeaderSlot.MAGIC]), int(header[HeaderSlot.LAYOUT_VERSION])
        tp = int(header[HeaderSlot.TP_SIZE])
        del header
        if magic != MAGIC:
            buf.close()
            raise NamespaceError(f"{names.signals} is not a kvswap signal segment (bad magic)")
        if version != LAYOUT_VERSION:
            buf.close()
            raise NamespaceError(
                f"{names.signals} has layout version {version}, this kvswap reads {LAYOUT_VERSION}"
            )
        if size < segment_size(tp):
            buf.close()
            raise NamespaceError(f"{names.signals} is truncated for tp_size={tp}")
        return cls(names, shm, buf, creator=False, readonly=readonly)

    def close(self) -> None:
        """Drop this segment's views and unmap, or leave the unmapping to the last view
        still alive elsewhere.

        Every view is built by :func:`_u64_view`, which holds a buffer export on the
        mmap, so ``mmap.close()`` raises ``BufferError`` while any view lives (a
        ``RankSignals`` or ``RankStats`` a caller kept, a ``LayerProgress`` table, a
        view another thread is reading right now); the mapping is then released when
        the last such view is garbage collected, never under a reader.  From here on
        this object's views raise :class:`SegmentClosed`."""
        with self._close_lock:
            buf = self._buf
            if buf is None:
                return
            self._buf = None
            self._header = self._ranks = self._layers = self._agree = self._stats = None
        try:
            buf.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes with the last one

    def unlink(self) -> None:
        """Remove the segment's name.  Creator only (attachers never unlink)."""
        if not self.creator:
            raise NamespaceError("only the creator of a signal segment may unlink it")
        try:
            posix_ipc.unlink_shared_memory(self.names.signals)
        except posix_ipc.ExistentialError:
            pass

    # ------------------------------------------------------------------ access
    def rank(self, r: int) -> "RankSignals":
        if not 0 <= r < self.tp_size:
            raise ValueError(f"rank {r} out of range for tp_size {self.tp_size}")
        return RankSignals(r, self.ranks[r])

    def stats(self, r: int) -> RankStats:
        n_hist = len(HIST_OPS) * len(HIST_PHASES) * HIST_SLOTS
        row = self._open(self._stats)[r]
        return RankStats(row[:n_hist].reshape(len(HIST_OPS), len(HIST_PHASES), HIST_SLOTS),
                         row[n_hist:])

    def state_of(self, r: int) -> RankState:
        try:
            return RankState(int(self.ranks[r, RankSlot.STATE]))
        except ValueError:
            return RankState.FAILED

    def heartbeat_age_s(self, r: int, now: int | None = None) -> float | None:
        hb = int(self.ranks[r, RankSlot.HEARTBEAT_NS])
        if hb == 0:
            return None
        return max(0, (now if now is not None else now_ns()) - hb) / 1e9

    def rank_snapshot(self, r: int, now: int | None = None) -> dict:
        """Plain-data copy of one rank: its fields (state and last error as names,
        the heartbeat as an age), histograms and error counts."""
        row = {f.name: int(self.ranks[r, f.index]) for f in RANK_FIELDS}
        row["rank"] = r
        row["state"] = self.state_of(r).name
        try:
            row["last_error"] = ErrorCode(row["last_error"]).name
        except ValueError:
            row["last_error"] = str(row["last_error"])
        row["heartbeat_age_s"] = self.heartbeat_age_s(r, now)
        del row["heartbeat_ns"]
        row.update(self.stats(r).snapshot())
        return row

    def snapshot(self) -> dict:
        """Plain-data copy of the segment (for status and tests)."""
        now = now_ns()
        hdr = self.header
        engine_hb = int(hdr[HeaderSlot.ENGINE_HEARTBEAT_NS])
        ranks = [self.rank_snapshot(r, now) for r in range(self.tp_size)]
        try:
            kv = KvCacheStatus(int(hdr[HeaderSlot.KVCACHE_STATUS])).name
        except ValueError:
            kv = str(int(hdr[HeaderSlot.KVCACHE_STATUS]))
        return {
            "namespace": self.names.namespace,
            "tp_size": self.tp_size,
            "launcher_pid": int(hdr[HeaderSlot.LAUNCHER_PID]),
            "created_unix_ns": int(hdr[HeaderSlot.CREATED_UNIX_NS]),
            "engine_heartbeat_age_s": (max(0, now - engine_hb) / 1e9) if engine_hb else None,
            "kvcache_status": kv,
            "ranks": ranks,
        }


class RankSignals:
    """The slots of one rank, indexed by :class:`R`."""

    __slots__ = ("rank", "slots", "_cells")

    def __init__(self, rank: int, slots: np.ndarray):
        self.rank = rank
        self.slots = slots
        self._cells = u64_cells(slots)

    def __getitem__(self, field: RankSlot) -> int:
        return self._cells[field]

    def __setitem__(self, field: RankSlot, value: int) -> None:
        self._cells[field] = value

    def add(self, field: RankSlot, delta: int) -> None:
        """Increment; only for fields whose single writer is the calling thread."""
        self._cells[field] += delta


# ---------------------------------------------------------------------- waiting

T = TypeVar("T")


def poll_until(check: Callable[[], T | None], deadline: float,
               first_sleep: float = 0.0002, max_sleep: float = 0.02) -> T | None:
    """Call ``check`` with exponential back-off until it returns non-None or the
    monotonic ``deadline`` passes (then return None).  Never spins a core."""
    sleep = first_sleep
    while True:
        result = check()
        if result is not None:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(sleep, remaining))
        sleep = min(sleep * 2, max_sleep)


def wait_with_abort(ready: Callable[[], T | None], *, deadline: float,
                    wake: posix_ipc.Semaphore, interval_s: float,
                    timed_out: Callable[[], Exception],
                    abort: Callable[[], Exception | None] | None = None,
                    give_up: Callable[[], None] | None = None) -> T:
    """Wait for ``ready()`` to return non-None and return that; the one loop behind every
    wait on other processes that must end early when one of them fails
    (:meth:`Barrier.wait`, ``Agreement.agree``, ``LayerProgress.wait``).

    Each turn, in this order (the order decides which error a turn that meets
    several conditions raises):

    1. ``ready()``: a result ends the wait.  It may raise instead, for what it sees
       while reading (a peer's abort mark, a layer that does not exist).
    2. ``abort()``: the exception to raise now, or None: the caller was cancelled, or
       a participant is FAILED or silent (the exception names it).
    3. the monotonic ``deadline``: once past it, raise ``timed_out()``.

    Whatever ends the wait with an exception, ``give_up()`` runs first (an
    agreement marks its round aborted for its peers).
    Between turns it sleeps on ``wake``, which whoever changes what ``ready`` reads
    posts, so a waiter wakes at once instead of spinning; but at most ``interval_s``,
    so a participant that dies without posting is still noticed.
    """
    while True:
        try:
            result = ready()
            if result is not None:
                return result
            error = abort() if abort is not None else None
            remaining = deadline - time.monotonic()
            if error is None and remaining <= 0:
                error = timed_out()
            if error is not None:
                raise error
        except Exception:
            if give_up is not None:
                give_up()
            raise
        try:
            wake.acquire(min(remaining, interval_s))
        except posix_ipc.BusyError:
            pass


# ---------------------------------------------------------------------- semaphores


def _semaphore_names(names: Names, tp_size: int) -> list[str]:
    return [n for r in range(tp_size) for n in (names.wake_sem(r), names.layer_sem(r))]


def create_semaphores(names: Names, tp_size: int) -> None:
    """Create every semaphore of a namespace (creator: the launcher), mode 0600."""
    for name in _semaphore_names(names, tp_size):
        try:
            posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=SHM_MODE, initial_value=0).close()
        except posix_ipc.ExistentialError:
            raise NamespaceError(
                f"namespace {names.namespace!r} is in use: {name} already exists") from None


def unlink_semaphores(names: Names, tp_size: int) -> None:
    for name in _semaphore_names(names, tp_size):
        try:
            posix_ipc.unlink_semaphore(name)
        except posix_ipc.ExistentialError:
            pass


class Barrier:
    """Reusable, generation-based barrier among ``participants`` of a namespace.

    ``wait`` returns the generation reached (1 for the first barrier).  It raises
    :class:`BarrierTimeout` naming the ranks that never arrived, or
    :class:`BarrierAborted` as soon as a missing participant is FAILED or its
    heartbeat is older than ``stale_after_s``.

    Each rank's ``barrier_arrivals`` is the highest generation it reached, and a
    generation g is passed when every participant's is >= g.  An arrival is never
    withdrawn, not even by a rank that gives up waiting: it states that the rank
    reached the point g stands for, which stays true.  A withdrawn arrival made
    counts lie instead: a rank that gave up g and then entered another barrier
    arrived at g again, so a peer still waiting in the first g passed on an arrival
    at the second, and the second passed on the peer's arrival at the first.  With
    arrivals that stay, a rank that gave up g is at g, and its next barrier is g + 1
    whichever it is.  A caller whose barriers mean different things passes
    ``generation`` so that no generation is shared by two of them (the daemon's
    clear barriers are even, its start-up barriers odd: daemon/startup.py);
    re-entering a generation already reached waits for it without arriving again.
    """

    ABORT_CHECK_S = 0.05

    def __init__(self, seg: SignalSegment, rank: int, participants: Iterable[int] | None = None,
                 stale_after_s: float = 5.0):
        self.seg = seg
        self.rank = rank
        self.participants = sorted(participants if participants is not None
                                   else range(seg.tp_size))
        if rank not in self.participants:
            raise ValueError(f"rank {rank} is not a participant of {self.participants}")
        self.stale_after_s = stale_after_s
        names = seg.names
        try:
            self._own = posix_ipc.Semaphore(names.wake_sem(rank))
            self._others = [posix_ipc.Semaphore(names.wake_sem(p))
                            for p in self.participants if p != rank]
        except posix_ipc.ExistentialError:
            raise NamespaceError(
                f"namespace {names.namespace!r} has no barrier semaphores") from None

    def close(self) -> None:
        for sem in [self._own, *self._others]:
            sem.close()

    def _missing(self, target: int) -> list[int]:
        col = self.seg.ranks[:, RankSlot.BARRIER_ARRIVALS]
        return [p for p in self.participants if int(col[p]) < target]

    @property
    def reached(self) -> int:
        """The highest generation this rank has reached."""
        return int(self.seg.ranks[self.rank, RankSlot.BARRIER_ARRIVALS])

    def arrive(self, generation: int) -> None:
        """Record that this rank reached ``generation`` (a value already higher stays)
        and wake the other participants; :meth:`wait` starts with it, and a rank that
        reached the point without waiting for the others may call it alone."""
        me = self.seg.rank(self.rank)
        if me[RankSlot.BARRIER_ARRIVALS] < generation:
            me[RankSlot.BARRIER_ARRIVALS] = generation
        for sem in self._others:
            sem.release()

    def wait(self, timeout: float, what: str = "barrier",
             cancelled: Callable[[], bool] | None = None, generation: int | None = None) -> int:
        """Arrive at ``generation`` (default: the one after the highest this rank
        reached) and wait for every participant to reach it; ``cancelled`` is polled
        with the abort checks and makes the wait raise :class:`BarrierAborted`.  A
        completed barrier wins over a cancel seen in the same turn.  Giving up leaves
        the arrival in place (class doc)."""
        target = self.reached + 1 if generation is None else generation
        if target < 1:
            raise ValueError(f"barrier generations start at 1, got {target}")
        self.arrive(target)
        missing: list[int] = []  # as of the last check

        def everyone_arrived() -> int | None:
            missing[:] = self._missing(target)
            return None if missing else target

        def abort() -> BarrierAborted | None:
            if cancelled is not None and cancelled():
                return BarrierAborted(f"{what} (generation {target}) on rank {self.rank} "
                                      f"cancelled")
            now = now_ns()
            for p in missing:
                state = self.seg.state_of(p)
                age = self.seg.heartbeat_age_s(p, now)
                if state == RankState.FAILED or (age is not None and age > self.stale_after_s):
                    why = "is FAILED" if state == RankState.FAILED else (
                        f"has not beaten for {age:.1f}s")
                    return BarrierAborted(f"{what} (generation {target}) on rank {self.rank} "
                                          f"aborted: rank {p} {why}")
            return None

        def timed_out() -> BarrierTimeout:
            detail = ", ".join(f"rank {p} ({self.seg.state_of(p).name})" for p in missing)
            return BarrierTimeout(f"{what} (generation {target}) on rank {self.rank} timed out "
                                  f"after {timeout:.1f}s waiting for {detail}")

        return wait_with_abort(everyone_arrived, deadline=time.monotonic() + timeout,
                               wake=self._own, interval_s=self.ABORT_CHECK_S, abort=abort,
                               timed_out=timed_out)


def wait_ranks(seg: SignalSegment, ranks: Iterable[int], want: Callable[[int], bool],
               timeout: float, what: str, describe: Callable[[int], str]) -> None:
    """Wait until ``want(r)`` holds for every rank, or raise :class:`RankTimeout`
    naming each rank that is still missing (``describe(r)`` says why)."""
    ranks = list(ranks)

    def check() -> bool | None:
        return True if all(want(r) for r in ranks) else None

    if poll_until(check, time.monotonic() + timeout) is None:
        missing = [r for r in ranks if not want(r)]
        raise RankTimeout(
            f"timed out after {timeout:.1f}s waiting for {what}: "
            + "; ".join(describe(r) for r in missing)
        )
