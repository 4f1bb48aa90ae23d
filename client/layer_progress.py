"""Per-layer progress of layer-wise loads, published in the signal segment.

Each rank has a ring of 64 entries (``SignalSegment.layers[rank]``).  The rank's
daemon claims an entry when a layer-wise load starts, bumps ``layers_done``
after each layer is copied and visible, and posts the rank's layer semaphore
(``/kvswap.<ns>.layer.r<r>``) only when its value is 0, so the count stays
bounded however few waiters there are.  A waiter (the engine's TP worker,
through :meth:`CacheWorker.wait_layer`) re-reads the entry whenever the
semaphore wakes it, and at least every 2 ms, so it never spins a core and never
misses a layer.

An entry is claimed by writing ``task_id`` last and read by checking the
generation before and after, so a reader never mixes two tasks' progress.
Task id 0 is never looked up: it is what an unclaimed entry (or one being
claimed) holds.

**Closing under a waiter.**  :meth:`LayerProgress.close` may run while another
thread waits (an engine closing its CacheWorker while a TP thread waits for a
layer).  The waiter sees the close within one turn (at most ``_WAKE_CHECK_S`` on
the semaphore) and raises SHUTTING_DOWN; ``close`` waits for every waiter to
leave before it closes the semaphore (``sem_close`` unmaps the ``sem_t`` that a
sleeping ``sem_timedwait`` still uses) and drops the table, whose view of the
signal segment keeps the mapping alive until then (``signals._u64_view``).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import posix_ipc

from kvswap.client.errors import (
    ErrorCode,
    KvswapError,
    RankFailure,
    RankTimeout,
    TransferFailed,
)
from kvswap.client.signals import (
    LAYER_SLOTS,
    LayerSlot,
    LayerState,
    SignalSegment,
    wait_with_abort,
)

log = logging.getLogger("kvswap.client")

_WAKE_CHECK_S = 0.002
# close() waits this long for waiters to leave; each leaves within a turn (_WAKE_CHECK_S
# on the semaphore plus one read of the table), so only a stalled process gets near it.
_CLOSE_WAIT_S = 2.0


class LayerProgress:
    """One rank's layer-progress ring: written by its daemon, read by waiters.

    ``owner`` names what closes it, in the error a waiter gets when it does."""

    def __init__(self, seg: SignalSegment, rank: int, owner: str = "LayerProgress"):
        self.seg = seg
        self.rank = rank
        self.owner = owner
        self._table: np.ndarray | None = seg.layers[rank]
        self._sem = posix_ipc.Semaphore(seg.names.layer_sem(rank))
        self._lock = threading.Lock()  # writers: the daemon's transfer workers
        self._next = 0
        # Guards _closed and _waiters: a waiter registers before it touches the
        # semaphore, and close() waits for none to be left before closing it.
        self._state = threading.Condition(threading.Lock())
        self._closed = False
        self._waiters = 0

    @property
    def table(self) -> np.ndarray:
        """The rank's entries; :class:`KvswapError` SHUTTING_DOWN once closed."""
        table = self._table
        if table is None:
            raise self._closed_error("reading the layer-progress table")
        return table

    @property
    def closed(self) -> bool:
        return self._closed

    def _closed_error(self, what: str) -> KvswapError:
        return KvswapError(f"rank {self.rank}: {what}: the {self.owner} is closed",
                           ErrorCode.SHUTTING_DOWN)

    def close(self) -> None:
        """Make every waiter raise SHUTTING_DOWN, wait until they have left (bounded),
        then close the semaphore and drop the table.

        A waiter that has not left after ``_CLOSE_WAIT_S`` (its thread stalled) keeps
        both: closing them would unmap memory it may still touch.  They are then
        released with this object, at the cost of one semaphore handle."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            left = self._state.wait_for(lambda: self._waiters == 0, timeout=_CLOSE_WAIT_S)
            if left:
                self._table = None
        if not left:
            log.warning("rank %d: %d layer waiter(s) still inside wait() %.0fs after close(); "
                        "the layer semaphore is left open", self.rank, self._waiters,
                        _CLOSE_WAIT_S)
            return
        self._sem.close()

    # ------------------------------------------------------------------ writer (daemon)
    def begin(self, task_id: int, num_layers: int) -> int:
        with self._lock:
            idx = self._next % LAYER_SLOTS
            self._next += 1
        e = self.table[idx]
        e[LayerSlot.TASK_ID] = 0
        e[LayerSlot.GENERATION] = int(e[LayerSlot.GENERATION]) + 1
        e[LayerSlot.LAYERS_DONE] = 0
        e[LayerSlot.NUM_LAYERS] = num_layers
        e[LayerSlot.STATE] = LayerState.RUNNING
        e[LayerSlot.TASK_ID] = task_id
        return idx

    def advance(self, idx: int, layers_done: int) -> None:
        self.table[idx, LayerSlot.LAYERS_DONE] = layers_done
        self._notify()

    def finish(self, idx: int, ok: bool) -> None:
        self.table[idx, LayerSlot.STATE] = LayerState.DONE if ok else LayerState.FAILED
        self._notify()

    def _notify(self) -> None:
        if self._sem.value == 0:
            self._sem.release()

    # ------------------------------------------------------------------ reader (worker)
    def status(self, task_id: int) -> tuple[int, int, LayerState] | None:
        """(layers_done, num_layers, state) of ``task_id`` on this rank, or None."""
        return _status(self.table, task_id)

    def wait(self, task_id: int, layer: int, timeout: float, label: int | None = None) -> None:
        """Return once layer index ``layer`` of ``task_id`` is complete on this rank.

        ``label``: what to call the layer in errors (the model's layer number, where
        ``layer`` is its index among the registered layers); the index by default.
        Raises SHUTTING_DOWN at once, or within a turn, when :meth:`close` runs."""
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        if task_id <= 0:
            raise ValueError(f"task_id must be a layer-wise load's task id (>= 1), got "
                             f"{task_id}")
        name = f"layer {layer}" if label is None else f"layer {label}"
        with self._state:
            if self._closed:
                raise self._closed_error(f"wait for {name} of task {task_id}")
            self._waiters += 1
            table = self._table
        assert table is not None  # dropped only once no waiter is left
        try:
            self._wait(table, task_id, layer, timeout, label)
        finally:
            with self._state:
                self._waiters -= 1
                if self._waiters == 0:
                    self._state.notify_all()

    def _wait(self, table: np.ndarray, task_id: int, layer: int, timeout: float,
              label: int | None) -> None:
        name = f"layer {layer}" if label is None else f"layer {label}"
        seen: list[tuple[int, int, LayerState] | None] = [None]  # the last status read

        def layer_done() -> bool | None:
            st = seen[0] = _status(table, task_id)
            if st is None:
                return None
            done, total, _ = st
            if layer >= total:
                where = "" if label is None else f" (index {layer} of the registered layers)"
                raise ValueError(f"task {task_id} loads {total} layers; {name}{where} "
                                 f"does not exist")
            return True if done > layer else None

        def abort() -> KvswapError | None:
            if self._closed:
                return self._closed_error(f"waiting for {name} of task {task_id}")
            st = seen[0]
            if st is None or st[2] is not LayerState.FAILED:
                return None
            return TransferFailed(task_id, "load", [RankFailure(
                self.rank, ErrorCode.TRANSFER_FAILED,
                f"layer-wise load failed after {st[0]} of {st[1]} layers")])

        def timed_out() -> RankTimeout:
            st = seen[0]
            where = "not started" if st is None else f"{st[0]} of {st[1]} layers done"
            return RankTimeout(f"rank {self.rank}: {name} of task {task_id} not ready "
                               f"after {timeout:.3f}s ({where})")

        wait_with_abort(layer_done, deadline=time.monotonic() + timeout, wake=self._sem,
                        interval_s=_WAKE_CHECK_S, abort=abort, timed_out=timed_out)


def _status(table: np.ndarray, task_id: int) -> tuple[int, int, LayerState] | None:
    """(layers_done, num_layers, state) of ``task_id`` in ``table``, or None.  Task id 0
    matches nothing: every unclaimed entry holds it, and so does one being claimed."""
    if task_id <= 0:
        return None
    hits = np.flatnonzero(table[:, LayerSlot.TASK_ID] == task_id)
    if hits.size == 0:
        return None
    # the newest claim of this task (a retried load claims a second entry)
    e = table[int(hits[np.argmax(table[hits, LayerSlot.GENERATION])])]
    gen = int(e[LayerSlot.GENERATION])
    done, total = int(e[LayerSlot.LAYERS_DONE]), int(e[LayerSlot.NUM_LAYERS])
    state = int(e[LayerSlot.STATE])
    if int(e[LayerSlot.TASK_ID]) != task_id or int(e[LayerSlot.GENERATION]) != gen:
        return None  # reclaimed while we read it
    return done, total, LayerState(state)
