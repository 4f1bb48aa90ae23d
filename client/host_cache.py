"""``HostCache``: the engine scheduler's index of the host tier (block hash -> host block).

The daemons move bytes; which block lives in which host block is the scheduler's
business.  ``HostCache`` keeps that index for host block ids 0..N-1: a prefix
lookup, protection of blocks while loads or stores are in flight, an eviction
policy ("lru" or "arc"), events for an engine's KV-event stream and hit
statistics.  It is pure bookkeeping (no I/O) with the semantics of vLLM's CPU
offloading manager, so an engine can switch between the two without surprises:

    n = cache.lookup(hashes)            # leading hashes ready in host memory
    ids = cache.prepare_load(hashes[:n])   # protected until complete_load
    cache.touch(hashes[:n])
    ...copy host ids -> device...
    cache.complete_load(hashes[:n])
    out = cache.prepare_store(new_hashes)  # None: no room (nothing changed)
    ...copy device -> out.host_blocks...
    cache.complete_store(out.hashes)       # lookup-able from now on

The wired calls (:meth:`HostCache.offload`, :meth:`~HostCache.fetch`,
:meth:`~HostCache.prefetch`) do the same through a :class:`TransferClient`.

**Which thread applies a transfer's completion.**  ``HostCache`` is not
thread-safe: it belongs to the scheduler thread, as vLLM's manager does
(schedulers are single-threaded), and it takes no lock, because the cycle it
serves costs a few hundred ns per block.  A transfer, however, ends on the
client's I/O thread, where ``TransferFuture`` done-callbacks run.  So the
callback never touches the index: it appends ``(complete_store or
complete_load, hashes, success)`` to a ``collections.deque`` (``append`` and
``popleft`` are atomic and documented thread-safe) and only then completes the
:class:`CacheFuture` the wired call returned.  Every public method of
``HostCache`` starts by draining that queue on the calling thread, which is the
scheduler thread.  Hence:

* the index is only ever changed by the scheduler thread; no lock, no torn
  state, and the I/O thread is never slowed by bookkeeping;
* once a ``CacheFuture`` is done, the very next ``HostCache`` call sees its
  bookkeeping applied (the entry is queued before the future completes), so
  ``fut.result(); cache.lookup(h)`` finds the stored blocks without a race;
* completions are applied in the order the transfers ended, and between two
  public calls the index does not change under the scheduler's feet (a
  ``lookup`` followed by ``prepare_load`` sees the same blocks).

The alternative, applying the bookkeeping in the callback under a lock, would
put a lock on every call of the hot path and let the index change between a
``lookup`` and the ``prepare_load`` that trusts it.  What each public call does
take is a non-blocking try of a re-entrant lock (:func:`_one_thread`, 0.3 to
0.6 us a call on the 2-vCPU development VM, where a call costs about 1 us per
block): it never waits, and a call made while another thread is inside the
cache is refused with a ``ValueError`` naming the misuse before it touches
anything (two threads interleaving in the index handed one host block to
several hashes and lost others, with no error naming the cause).  :meth:`HostCache.poll`
drains explicitly, for a scheduler that waits for futures and wants the
statistics updated without another call.

**Reusing host blocks while transfers run.**  A block is evictable as soon as
its store completed and no load protects it; its id may be handed to a new
store at once, while e.g. a write-through backup still reads it.  That is safe
because every transfer goes through the same ``TransferClient`` and the daemons
order tasks that share a host block in submission order (read-after-write,
write-after-read: ``daemon/scheduler.py``): the later evict into that block
waits for the backup.  The same holds after a failed or timed-out task whose
blocks are released: anything sent later into its blocks runs after it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from kvswap.client.block_keys import storage_key
from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, RankTimeout
from kvswap.client.host_cache_arc import ArcIndex
from kvswap.client.host_cache_index import BlockIndex, LruIndex, show
from kvswap.client.host_cache_persist import KEY_BYTES, PersistedIndex
from kvswap.client.protocol import (
    PrefetchOptions,
    as_block_ids,
    check_flag,
    check_seconds,
    first_duplicate,
)
from kvswap.client.signals import HeaderSlot, RankSlot

if TYPE_CHECKING:
    from kvswap.client.host_cache_stats import HostCacheStatsWriter
    from kvswap.client.transfer_client import TaskResult, TransferClient, TransferFuture

log = logging.getLogger("kvswap.client")

POLICIES: dict[str, Callable[[int], BlockIndex]] = {"lru": LruIndex, "arc": ArcIndex}

_STORE, _LOAD = 0, 1  # kinds of queued completions
_NO_IDS = np.empty(0, dtype=np.int64)
# The index keeps about 40 bytes of Python objects per block (its free list alone is
# an int per block): 2**26 blocks is some 2.7 GB in the scheduler's process, and at
# the usual hundreds of KiB per block a host tier of many TiB.
MAX_BLOCKS = 1 << 26
_AFTER_CLOSE = frozenset({"close", "stats", "take_events"})  # calls a closed cache serves


def _one_thread(method: Callable) -> Callable:
    """Refuse a call made while another thread is inside this cache, and any call
    but :data:`_AFTER_CLOSE` once it is closed (before anything changes).  The lock
    is re-entrant (a wired call runs public ones) and never waited for."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self: "HostCache", *args: Any, **kwargs: Any) -> Any:
        if not self._entry.acquire(False):
            raise ValueError(f"HostCache.{name} called from thread "
                             f"{threading.current_thread().name!r} while another thread is "
                             f"inside this HostCache: it is not thread-safe; call it from one "
                             f"thread (the scheduler's)")
        try:
            if self._closed and name not in _AFTER_CLOSE:
                raise ValueError(f"HostCache.{name}: this HostCache is closed; create a new "
                                 f"one (with persist=, it adopts the blocks this one left)")
            return method(self, *args, **kwargs)
        finally:
            self._entry.release()

    return guarded


@dataclass(frozen=True)
class CacheEvent:
    """Blocks that became lookup-able (``removed=False``) or left host memory."""

    hashes: list
    removed: bool


class StoreOutput(NamedTuple):
    """What :meth:`HostCache.prepare_store` decided (a tuple: cheap to build)."""

    hashes: list  # not yet stored, in call order, duplicates once
    host_blocks: np.ndarray  # int64, the host block of each of ``hashes``
    evicted: list  # hashes evicted to make room, oldest first


@dataclass(frozen=True)
class CacheTransfer:
    """The outcome of a wired call (:meth:`CacheFuture.result`)."""

    hashes: list  # offload: stored; fetch: loaded; prefetch: the agreed prefix now in host memory
    host_blocks: np.ndarray  # their host blocks
    dropped: list = field(default_factory=list)  # offload: found no host room (prepare_store
    # refused, the data is not kept); prefetch: asked for but not loaded from storage
    tasks: list = field(default_factory=list)  # TaskResult of each task sent

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)


class CacheFuture:
    """Completes once the transfers of a wired call have ended *and* their bookkeeping
    is queued for the scheduler thread (see the module docstring): from then on,
    the next ``HostCache`` call sees it applied.  ``transfers`` are the underlying
    TransferFutures (e.g. for ``cancel()``)."""

    def __init__(self, limit_s: float):
        self.transfers: list[TransferFuture] = []
        self._limit_s = limit_s
        self._event = threading.Event()
        self._result: CacheTransfer | None = None
        self._error: KvswapError | None = None

    @classmethod
    def finished(cls, result: CacheTransfer) -> "CacheFuture":
        fut = cls(0.0)
        fut._finish(result)
        return fut

    def _finish(self, result: CacheTransfer | None = None,
                error: KvswapError | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> CacheTransfer:
        """Wait (``None``: until the tasks' deadlines, which always come) and return the
        :class:`CacheTransfer`, or raise the transfer's error.  ``timeout`` is checked
        as ``TransferFuture.result`` checks it (:func:`_wait_seconds`)."""
        wait = self._limit_s + 5.0 if timeout is None else _wait_seconds(timeout)
        if not self._event.wait(min(wait, threading.TIMEOUT_MAX)):
            ids = ", ".join(str(f.task_id) for f in self.transfers)
            raise RankTimeout(f"host-tier transfer (task {ids}) not finished after {wait:.1f}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> KvswapError | None:
        """The transfer's error, or None once it succeeded.  A bad ``timeout`` raises
        (checked before the wait): returning it would read as the transfer's error."""
        if timeout is not None:
            _wait_seconds(timeout)
        try:
            self.result(timeout)
        except KvswapError as exc:
            return exc
        return None


def _wait_seconds(timeout: object) -> float:
    """A wait in seconds: a finite number >= 0, as for ``TransferFuture.result``.  The
    check comes first because ``threading.Event.wait`` overflows on ``inf`` and huge
    values, raises a bare TypeError on a string and returns at once on ``nan``."""
    try:
        return check_seconds(timeout, "timeout", positive=False)
    except InvalidTask as exc:
        raise InvalidTask(f"{exc.message}; pass None to wait until the transfers' deadlines "
                          f"(they always come)", exc.code) from None


def _as_hashes(hashes: Iterable[Hashable], call: str) -> Sequence[Hashable]:
    """The call's hashes as a list or tuple, taken in full before the index is touched.

    The index walks a call's hashes more than once (to undo the steps of a refused
    ``prepare_load``, or to check ``persist=`` keys before ``prepare_store``); a
    one-shot iterator would be empty the second time, leaving a protection that
    nothing can release or a store of nothing.  Lists and tuples, the usual case,
    pass as they are (no copy on the hot path); other iterables are read once.  A
    single str/bytes value is refused (its characters would be taken as hashes), and
    so is a set (the order of the hashes is their meaning: prefix, recency)."""
    if isinstance(hashes, (list, tuple)):
        return hashes
    t = type(hashes)
    if isinstance(hashes, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{call}: hashes must be a sequence of hashes, got one {t.__name__} "
                         f"value; pass a list, e.g. [h]")
    if isinstance(hashes, (set, frozenset)):
        raise ValueError(f"{call}: hashes must be in block order, got a {t.__name__} (no "
                         f"order); pass a list")
    try:
        it = iter(hashes)
    except TypeError:
        raise ValueError(f"{call}: hashes must be a sequence of hashes, got {t.__name__} "
                         f"{hashes!r:.60}; pass a list in block order") from None
    return list(it)


def _ended(f: "TransferFuture") -> tuple["TaskResult | None", KvswapError | None]:
    """Result or error of a TransferFuture that is done (never waits)."""
    err = f.exception(0)
    return (None, err) if err is not None else (f.result(0), None)


class HostCache:
    """Index of the host tier: block hash -> host block id in 0..num_blocks-1.

    Not thread-safe: call it from one thread (the scheduler's).  Transfers started
    by the wired calls complete on the client's I/O thread, which only queues
    their bookkeeping; it is applied by the next call on the scheduler thread.

    ``policy``: "lru" or "arc".  ``events=False`` records no events (an engine
    that never calls :meth:`take_events` must say so, or they accumulate).

    Hashes are any hashable values (ints, the bytes of ``block_hashes()``), passed
    as a list or tuple in block order (any other iterable is read once into a list;
    one str/bytes value or a set is refused).  Errors (a hash not ready for
    ``prepare_load``, a ``complete_load`` without a load, an argument of the wrong
    type) are ``ValueError`` naming the cause, raised before anything changed; an
    unhashable hash raises ``TypeError``, also with nothing changed.
    """

    def __init__(self, num_blocks: int, policy: str = "lru", *, events: bool = True,
                 persist: str | None = None, run_root: str | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r:.60}")
        if num_blocks > MAX_BLOCKS:
            raise ValueError(f"num_blocks {num_blocks} is over {MAX_BLOCKS} (2**26): the index "
                             f"keeps about 40 bytes per block in this process; use larger "
                             f"blocks for a host tier this large")
        if not isinstance(policy, str) or policy not in POLICIES:  # a list is unhashable
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r:.60}")
        # a truthy non-bool would record events an engine that passed "no" never takes
        events = check_flag(events, "events")
        self._index = POLICIES[policy](num_blocks)
        self._entry = threading.RLock()  # _one_thread's: tried, never waited for
        self._closed = False
        # persist=namespace: the index is mirrored in the namespace's shm and a successor
        # engine starts with the blocks still good (host_cache_persist, engine restarts)
        self._persist: PersistedIndex | None = None
        self._recovered = 0
        self._record = events
        self._events: list[CacheEvent] = []
        self._done: collections.deque = collections.deque()  # appended by I/O threads
        self._publisher: HostCacheStatsWriter | None = None
        self._lookups = 0  # lookup calls
        self._lookup_blocks = 0  # hashes passed to lookup
        self._hits = 0  # hashes lookup found ready
        self._loads = 0  # blocks prepared for loading
        self._stores = 0  # blocks whose store completed
        self._store_failures = 0
        self._store_refusals = 0  # prepare_store calls that found no room
        self._evictions = 0
        if persist is not None:
            self._persist = PersistedIndex(persist, num_blocks, run_root)
            recovered = self._persist.recovered
            try:  # PersistedIndex checked them: unique keys and ids, ids in range
                self._index.adopt(recovered, self._persist.quarantined)
            except BaseException:
                self._persist.close()
                raise
            self._recovered = len(recovered)
            if recovered and self._record:
                self._events.append(CacheEvent([k for k, _ in recovered], False))

    @property
    def capacity(self) -> int:
        return self._index.capacity

    def _check_client(self, client: "TransferClient") -> None:
        """A client that can carry this cache's transfers: open, and of a namespace whose
        host pools hold every block id this cache hands out (checked before the index
        changes: a refusal there would come after an eviction)."""
        if client.closed:
            raise KvswapError("TransferClient is closed", ErrorCode.SHUTTING_DOWN)
        pool = int(client.seg.ranks[:, RankSlot.NUM_HOST_BLOCKS].min())
        if pool and pool < self.capacity:
            raise KvswapError(f"this HostCache has {self.capacity} blocks but the namespace's "
                              f"host pools have {pool} per rank: create it with "
                              f"HostCache({pool}, ...) (its capacity is --host-blocks)",
                              ErrorCode.ID_OUT_OF_RANGE)

    @property
    def policy(self) -> str:
        return self._index.policy

    # ------------------------------------------------------------------ contract
    @_one_thread
    def lookup(self, hashes: Iterable[Hashable]) -> int:
        """How many leading ``hashes`` are ready in host memory (stops at the first
        one that is missing or whose store has not completed)."""
        hashes = _as_hashes(hashes, "lookup")
        if self._done:
            self._drain()
        n = self._index.lookup(hashes)
        self._lookups += 1
        self._lookup_blocks += len(hashes)
        self._hits += n
        if self._publisher is not None:
            self._publisher.maybe_write(self)
        return n

    @_one_thread
    def prepare_load(self, hashes: Iterable[Hashable]) -> np.ndarray:
        """Host block ids of ``hashes`` (int64, same order), protected from eviction
        until :meth:`complete_load`.  Every hash must be ready (``lookup``)."""
        hashes = _as_hashes(hashes, "prepare_load")
        if self._done:
            self._drain()
        ids = self._index.prepare_load(hashes)
        self._loads += len(ids)
        return np.array(ids, dtype=np.int64)

    @_one_thread
    def complete_load(self, hashes: Iterable[Hashable]) -> None:
        """End one load of each of ``hashes`` (its :meth:`prepare_load` protection)."""
        hashes = _as_hashes(hashes, "complete_load")
        if self._done:
            self._drain()
        self._index.complete_load(hashes)

    @_one_thread
    def touch(self, hashes: Iterable[Hashable]) -> None:
        """Mark ``hashes`` used: afterwards ``hashes[0]`` is the most recent, then
        ``hashes[1]``, ...  Hashes not in the index are ignored.  ("arc": a ready
        block of T1 moves to T2, the most recent end.)"""
        hashes = _as_hashes(hashes, "touch")
        if self._done:
            self._drain()
        self._index.touch(hashes)

    @_one_thread
    def prepare_store(self, hashes: Iterable[Hashable]) -> StoreOutput | None:
        """Give host blocks to the hashes not stored yet (ready or pending), free ids
        first, evicting only what must go: ready blocks that no load protects and
        that are not among ``hashes``.  New blocks are the most recent, the last one
        newest; they cannot be looked up or evicted until :meth:`complete_store`.
        None, with nothing changed, when they cannot all get a block."""
        hashes = _as_hashes(hashes, "prepare_store")
        if self._done:
            self._drain()
        if self._persist is not None:
            _check_persistable(hashes)
        planned = self._index.prepare_store(hashes)
        if planned is None:
            self._store_refusals += 1
            return None
        new, ids, evicted = planned
        if self._persist is not None:
            self._persist.unready(ids)  # before the engine can send the evict into them
        if evicted:
            self._evictions += len(evicted)
            if self._record:
                self._events.append(CacheEvent(list(evicted), True))
        return StoreOutput(new, np.array(ids, dtype=np.int64), evicted)

    @_one_thread
    def complete_store(self, hashes: Iterable[Hashable], success: bool = True) -> None:
        """End the pending stores among ``hashes`` (others are ignored, so the list
        given to prepare_store may be passed as is): ``success`` makes them ready and
        lookup-able, else their host blocks are freed for reuse.  ``success`` must be
        True or False: a truthy "no" would make blocks whose store failed lookup-able."""
        hashes = _as_hashes(hashes, "complete_store")
        success = check_flag(success, "complete_store: success")
        if self._done:
            self._drain()
        self._complete_store(hashes, success)

    def _complete_store(self, hashes: Sequence[Hashable], success: bool) -> None:
        done = self._index.complete_store(hashes, success)
        if not success:
            self._store_failures += len(done)
        elif done:
            self._stores += len(done)
            if self._persist is not None:
                host_id = self._index.host_id
                self._persist.ready(done, [host_id(h) for h in done])
            if self._record:
                self._events.append(CacheEvent(list(done), False))

    @_one_thread
    def __contains__(self, h: Hashable) -> bool:
        """True while ``h`` has a host block (ready, or its store pending)."""
        if self._done:
            self._drain()
        return self._index.host_id(h) is not None

    @_one_thread
    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, in order: stored (``removed=False``) when a
        store completes, removed when blocks are evicted or cleared."""
        if self._done:
            self._drain()
        events, self._events = self._events, []
        return events

    @_one_thread
    def stats(self) -> dict[str, Any]:
        """Sizes and counters (see ``host_cache_stats.FIELDS``), plus the ARC lists."""
        if self._done:
            self._drain()
        return self.counts()

    def counts(self) -> dict[str, Any]:
        """:meth:`stats` without applying queued completions first (for the publisher,
        which runs inside lookup() and must not change the index there)."""
        ix = self._index
        return {"policy": ix.policy, "capacity": ix.capacity, "used": ix.used,
                "ready": ix.used - ix.pending, "pending": ix.pending,
                "protected": ix.protected, "lookups": self._lookups,
                "lookup_blocks": self._lookup_blocks, "hits": self._hits,
                "hit_ratio": self._hits / self._lookup_blocks if self._lookup_blocks else None,
                "loads": self._loads, "stores": self._stores,
                "store_failures": self._store_failures, "store_refusals": self._store_refusals,
                "evictions": self._evictions, "recovered": self._recovered,
                "quarantined": len(ix.withheld),
                **ix.extra_stats()}

    @_one_thread
    def clear(self) -> None:
        """Forget every block (a weight update made them stale); a removed event
        names the ready ones.  Refused while loads or stores are in flight: their
        transfers would land in blocks the index no longer knows."""
        if self._done:
            self._drain()
        ix = self._index
        if ix.pending or ix.protected:
            raise ValueError(f"clear: {ix.pending} store(s) pending and {ix.protected} "
                             f"block(s) being loaded; complete them first (wired calls: "
                             f"wait for their futures, then poll())")
        ready = ix.clear()
        if self._persist is not None:
            self._persist.clear()
        if ready and self._record:
            self._events.append(CacheEvent(ready, True))

    @_one_thread
    def poll(self) -> int:
        """Apply the bookkeeping of transfers that have ended; return how many."""
        n = self._drain()
        if self._publisher is not None:
            self._publisher.maybe_write(self)
        return n

    def _drain(self) -> int:
        done = self._done
        n = 0
        while done:
            kind, hashes, ok = done.popleft()
            if kind == _LOAD:
                self._index.complete_load(hashes)
            else:
                self._complete_store(hashes, ok)
            n += 1
        return n

    # ------------------------------------------------------------------ publishing
    @_one_thread
    def publish(self, namespace: str, run_root: str | None = None,
                interval_s: float = 0.1) -> None:
        """Publish this cache's statistics for ``kvswap status`` and ``kvswap metrics``
        in ``/kvswap.<ns>.hostcache`` (``docs/signals.md``), refreshed at most every
        ``interval_s`` by lookup() and poll().  One publisher per namespace; the
        segment is removed by :meth:`close` (or with the namespace).  ``interval_s``:
        seconds, finite, >= 0 (0: every call), at most a year."""
        from kvswap.client.host_cache_stats import HostCacheStatsWriter, check_interval

        check_interval(interval_s)  # before the segment exists: a refusal leaves none
        if self._publisher is not None:
            raise ValueError("this HostCache already publishes its statistics")
        self._publisher = HostCacheStatsWriter.create(namespace, run_root, interval_s)
        self._publisher.write(self)

    @_one_thread
    def close(self) -> None:
        """Stop publishing (removes the statistics segment) and unmap the persisted
        index, which stays in the namespace for the next engine.  From then on every
        call but ``close``, ``stats`` and ``take_events`` is refused (``ValueError``):
        a closed cache that went on handing out blocks would leave the persisted
        index describing blocks it had since given to other hashes."""
        self._closed = True
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._persist is not None:
            self._persist.close()
            self._persist = None

    def __enter__(self) -> "HostCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ wired to the daemons
    @_one_thread
    def offload(self, client: "TransferClient", hashes: Iterable[Hashable], device_blocks: Any,
                *, backup: bool = False) -> CacheFuture:
        """Store device blocks in the host tier: ``prepare_store(hashes)``, then evict
        only the device blocks of ``out.hashes`` (``device_blocks[i]`` holds
        ``hashes[i]``) into ``out.host_blocks``; ``complete_store`` follows when the
        evict ends (success or not).  Already stored hashes move nothing: the future
        is done at once if nothing needs storing.  If ``prepare_store`` finds no room
        the future is done too, with the hashes in ``dropped`` (not kept).

        ``backup=True`` (write-through): once the evict has succeeded, the stored
        blocks are also backed up to the storage tier under :func:`storage_key`;
        the future then completes after the backup, and raises its error if it
        failed (the blocks stay in host memory either way).  The backup is sent only
        after a successful evict, so a failed evict never backs up stale host data.

        The engine must have finished writing the device blocks (its compute stream
        is done with them) before calling this."""
        backup = check_flag(backup, "offload: backup")
        hashes = list(_as_hashes(hashes, "offload"))
        dev = as_block_ids(device_blocks, "device_blocks")
        self._check_client(client)
        _check_pairs(client, hashes, dev, unique=False)
        keys = {h: storage_key(h) for h in hashes} if backup else {}
        out = self.prepare_store(hashes)
        if out is None:
            new = [h for h in dict.fromkeys(hashes) if h not in self]
            return CacheFuture.finished(CacheTransfer([], _NO_IDS, dropped=new))
        if not out.hashes:
            return CacheFuture.finished(CacheTransfer([], _NO_IDS))
        first = {}
        for i, h in enumerate(hashes):
            first.setdefault(h, i)
        src = dev[[first[h] for h in out.hashes]]
        try:
            evict = client.evict(src, out.host_blocks)
        except BaseException:
            self._complete_store(out.hashes, False)
            raise
        cf = CacheFuture(client.task_timeout * (2 if backup else 1))
        cf.transfers.append(evict)

        def on_evict(f: "TransferFuture") -> None:  # client I/O thread
            task, err = _ended(f)
            copy = None
            if err is None and backup:
                try:  # sent before the completion is queued: see "Reusing host blocks"
                    copy = client.backup(out.host_blocks, [keys[h] for h in out.hashes])
                except Exception as exc:  # this offload's failure, reported by its future
                    log.exception("write-through backup of evict %d not sent", f.task_id)
                    err = exc if isinstance(exc, KvswapError) else KvswapError(
                        f"write-through backup not sent: {exc!r}", ErrorCode.STORAGE_ERROR)
            self._done.append((_STORE, out.hashes, task is not None))
            if copy is None:
                cf._finish(CacheTransfer(list(out.hashes), out.host_blocks.copy(), tasks=[task])
                           if err is None else None, err)
                return
            cf.transfers.append(copy)

            def on_backup(b: "TransferFuture") -> None:  # client I/O thread
                stored, berr = _ended(b)
                cf._finish(CacheTransfer(list(out.hashes), out.host_blocks.copy(),
                                         tasks=[task, stored]) if berr is None else None, berr)

            copy.add_done_callback(on_backup)

        evict.add_done_callback(on_evict)
        return cf

    @_one_thread
    def fetch(self, client: "TransferClient", hashes: Iterable[Hashable], device_blocks: Any,
              *, prepared: bool = False) -> CacheFuture:
        """Load host blocks into device blocks: ``prepare_load(hashes)``, the load,
        ``touch(hashes)``, and ``complete_load`` when the load ends (success or not).
        Every hash must be ready (``lookup``); otherwise ``ValueError`` names the
        first one that is not, and nothing is sent.

        ``prepared=True``: the caller already called ``prepare_load`` (and ``touch``),
        e.g. to protect the hits before evicting device blocks to make room for
        them; fetch then only loads and completes the load."""
        prepared = check_flag(prepared, "fetch: prepared")
        hashes = list(_as_hashes(hashes, "fetch"))
        dev = as_block_ids(device_blocks, "device_blocks")
        self._check_client(client)
        _check_pairs(client, hashes, dev, unique=True)
        if prepared:
            ids = np.array(self._index.loading_ids(hashes), dtype=np.int64)
        else:
            ids = self.prepare_load(hashes)
        try:
            load = client.load(ids, dev)
        except BaseException:
            if not prepared:  # undo prepare_load, its count included
                self._index.complete_load(hashes)
                self._loads -= len(ids)
            raise
        if not prepared:
            self._index.touch(hashes)
        cf = CacheFuture(client.task_timeout)
        cf.transfers.append(load)

        def on_load(f: "TransferFuture") -> None:  # client I/O thread
            task, err = _ended(f)
            self._done.append((_LOAD, hashes, True))
            cf._finish(CacheTransfer(list(hashes), ids.copy(), tasks=[task])
                       if err is None else None, err)

        load.add_done_callback(on_load)
        return cf

    @_one_thread
    def prefetch(self, client: "TransferClient", hashes: Iterable[Hashable], *,
                 policy: str = "wait_complete", timeout: float | None = None,
                 min_blocks: int = 0) -> CacheFuture:
        """Storage tier -> host tier (a namespace launched with ``--storage``): the
        hashes not in host memory get host blocks (``prepare_store``, evicting if it
        must), the daemons prefetch them under :func:`storage_key`, and when the
        prefetch ends the agreed prefix (every rank read it intact) is completed as
        stored, the rest released.  The result's ``hashes`` is that prefix,
        ``dropped`` the rest.  Done at once if every hash is in host memory already,
        or with everything in ``dropped`` if ``prepare_store`` finds no room.

        ``policy``, ``timeout``, ``min_blocks``: as :meth:`TransferClient.prefetch`
        (checked before anything changes); fewer than ``min_blocks`` hashes missing
        from host memory are not prefetched at all (all in ``dropped``, nothing
        evicted to make room)."""
        PrefetchOptions.of(policy, timeout, min_blocks)
        self._check_client(client)
        if not int(client.seg.header[HeaderSlot.STORAGE_TIER]):  # before anything is evicted
            raise KvswapError(f"prefetch: namespace {client.names.namespace!r} was launched "
                              f"without --storage, so it has no storage tier to prefetch from; "
                              f"launch it with --storage URL (docs/storage.md)",
                              ErrorCode.STORAGE_ERROR)
        hashes = list(_as_hashes(hashes, "prefetch"))
        keys = {h: storage_key(h) for h in hashes}
        if min_blocks:
            new = [h for h in dict.fromkeys(hashes) if h not in self]
            if len(new) < min_blocks:
                return CacheFuture.finished(CacheTransfer([], _NO_IDS, dropped=new))
        out = self.prepare_store(hashes)
        if out is None:
            new = [h for h in dict.fromkeys(hashes) if h not in self]
            return CacheFuture.finished(CacheTransfer([], _NO_IDS, dropped=new))
        if not out.hashes:
            return CacheFuture.finished(CacheTransfer([], _NO_IDS))
        try:
            pf = client.prefetch([keys[h] for h in out.hashes], out.host_blocks, policy=policy,
                                 timeout=timeout, min_blocks=min_blocks)
        except BaseException:
            self._complete_store(out.hashes, False)
            raise
        cf = CacheFuture(client.task_timeout)
        cf.transfers.append(pf)

        def on_prefetch(f: "TransferFuture") -> None:  # client I/O thread
            task, err = _ended(f)
            n = 0 if task is None else task.count
            self._done.append((_STORE, out.hashes[:n], True))
            self._done.append((_STORE, out.hashes[n:], False))
            cf._finish(CacheTransfer(out.hashes[:n], out.host_blocks[:n].copy(),
                                     dropped=out.hashes[n:], tasks=[task])
                       if err is None else None, err)

        pf.add_done_callback(on_prefetch)
        return cf


def _check_persistable(hashes: Sequence[Hashable]) -> None:
    """A persisted index stores keys as bytes: only block_hashes()'s 32-byte hashes."""
    for i, h in enumerate(hashes):
        if type(h) is not bytes or len(h) != KEY_BYTES:
            raise ValueError(f"prepare_store: hash #{i} ({show(h)}) is not {KEY_BYTES} bytes; a "
                             f"HostCache with persist= keeps the 32-byte hashes block_hashes() "
                             f"returns")


def _check_pairs(client: "TransferClient", hashes: list, dev: np.ndarray,
                 unique: bool) -> None:
    """One device block per hash, each inside the namespace's device cache and, where
    they are written (``unique``: a fetch), none named twice: checked before the index
    changes, so a bad call is refused with nothing changed."""
    if len(hashes) != len(dev):
        raise ValueError(f"{len(hashes)} hashes but {len(dev)} device blocks; give one device "
                         f"block per hash")
    dup = first_duplicate(dev) if unique else None
    if dup is not None:
        raise InvalidTask(f"device block {dup} is named more than once: a load writes each "
                          f"destination once", ErrorCode.DUPLICATE_DESTINATION)
    limit = int(client.seg.ranks[:, RankSlot.NUM_DEVICE_BLOCKS].min())
    if limit and len(dev) and int(dev.max()) >= limit:
        raise InvalidTask(f"device block {int(dev.max())} is out of range: the namespace's "
                          f"device caches have {limit} blocks", ErrorCode.ID_OUT_OF_RANGE)
