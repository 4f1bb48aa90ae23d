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
"""

from __future__ import annotations

import threading
import time

import numpy as np
import posix_ipc

from kvswap.client.errors import ErrorCode, RankFailure, RankTimeout, TransferFailed
from kvswap.client.signals import (
    LAYER_SLOTS,
    LayerSlot,
    LayerState,
    SignalSegment,
    wait_with_abort,
)

_WAKE_CHECK_S = 0.002


class LayerProgress:
    def __init__(self, seg: SignalSegment, rank: int):
        self.seg = seg
        self.rank = rank
        self.table = seg.layers[rank]
        self._sem = posix_ipc.Semaphore(seg.names.layer_sem(rank))
        self._lock = threading.Lock()  # writers: the daemon's transfer workers
        self._next = 0

    def close(self) -> None:
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
        hits = np.flatnonzero(self.table[:, LayerSlot.TASK_ID] == task_id)
        if hits.size == 0:
            return None
        # the newest claim of this task (a retried load claims a second entry)
        e = self.table[int(hits[np.argmax(self.table[hits, LayerSlot.GENERATION])])]
        gen = int(e[LayerSlot.GENERATION])
        done, total = int(e[LayerSlot.LAYERS_DONE]), int(e[LayerSlot.NUM_LAYERS])
        state = int(e[LayerSlot.STATE])
        if int(e[LayerSlot.TASK_ID]) != task_id or int(e[LayerSlot.GENERATION]) != gen:
            return None  # reclaimed while we read it
        return done, total, LayerState(state)

    def wait(self, task_id: int, layer: int, timeout: float) -> None:
        """Return once layer index ``layer`` of ``task_id`` is complete on this rank."""
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        seen: list[tuple[int, int, LayerState] | None] = [None]  # the last status read

        def layer_done() -> bool | None:
            st = seen[0] = self.status(task_id)
            if st is None:
                return None
            done, total, _ = st
            if layer >= total:
                raise ValueError(f"task {task_id} loads {total} layers; layer {layer} "
                                 f"does not exist")
            return True if done > layer else None

        def failed() -> TransferFailed | None:
            st = seen[0]
            if st is None or st[2] is not LayerState.FAILED:
                return None
            return TransferFailed(task_id, "load", [RankFailure(
                self.rank, ErrorCode.TRANSFER_FAILED,
                f"layer-wise load failed after {st[0]} of {st[1]} layers")])

        def timed_out() -> RankTimeout:
            st = seen[0]
            where = "not started" if st is None else f"{st[0]} of {st[1]} layers done"
            return RankTimeout(f"rank {self.rank}: layer {layer} of task {task_id} not ready "
                               f"after {timeout:.3f}s ({where})")

        wait_with_abort(layer_done, deadline=time.monotonic() + timeout, wake=self._sem,
                        interval_s=_WAKE_CHECK_S, abort=failed, timed_out=timed_out)
