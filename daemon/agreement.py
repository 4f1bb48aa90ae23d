"""Cross-rank agreement on a minimum, through the signal segment (no NCCL, no gloo).

A prefetch must load the same number of blocks on every rank, or the engine
would see a prefix that exists on some ranks only.  Each rank posts its value
for (task id, round) in its own ring of agreement entries, wakes the other
ranks (their wake semaphores), and waits until every rank has posted for the
same (task id, round); the result is the minimum.

Nobody waits forever: a rank that times out, sees a participant FAILED or
silent, or is cancelled marks its entry ABORTED before raising, and every rank
waiting on that (task id, round) aborts as soon as it sees the mark.

**Crossed tasks.**  A rank runs its agreed tasks one at a time, in the order it
admitted them, and one client's tasks reach every rank in one order; two
clients' tasks need not.  Rank 0 may then wait in task A's agreement for rank 1
while rank 1 waits in task B's for rank 0, each with the other's task queued
behind its own: neither moves until ``--storage-timeout``, and both fail.  A
rank waiting in round 0 looks at the peers it waits for: one that posted for
another task this rank has queued (``queued_here``) is in such a cycle, and the
task with the larger id gives way (marked ABORTED, naming the cause; a peer
that reaches it later fails it before reading, :meth:`Agreement.gave_up`), so
the other completes.  Each rank decides by the same two ids, so exactly one of
a crossed pair gives way; in a longer cycle every task that waits on a smaller
one does, and the smallest completes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import posix_ipc

from kvswap.client.errors import BarrierAborted, BarrierTimeout, ErrorCode, KvswapError
from kvswap.client.signals import (
    AGREE_SLOTS,
    AgreeSlot,
    AgreeState,
    RankState,
    SignalSegment,
    now_ns,
    wait_with_abort,
)

_CHECK_S = 0.02


class Agreement:
    """Writer of this rank's agreement ring and reader of every rank's."""

    def __init__(self, seg: SignalSegment, rank: int, stale_after_s: float = 5.0):
        self.seg = seg
        self.rank = rank
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._next = 0
        names = seg.names
        self._own = posix_ipc.Semaphore(names.wake_sem(rank))
        self._others = [posix_ipc.Semaphore(names.wake_sem(p))
                        for p in range(seg.tp_size) if p != rank]

    def close(self) -> None:
        for sem in (self._own, *self._others):
            sem.close()

    def _post(self, task_id: int, rnd: int, value: int, state: AgreeState) -> int:
        with self._lock:
            idx = self._next % AGREE_SLOTS
            self._next += 1
        e = self.seg.agree[self.rank, idx]
        e[AgreeSlot.TASK_ID] = 0
        e[AgreeSlot.ROUND] = rnd
        e[AgreeSlot.VALUE] = value
        e[AgreeSlot.STATE] = state
        e[AgreeSlot.TASK_ID] = task_id
        for sem in self._others:
            sem.release()
        return idx

    def abort(self, task_id: int, last_round: int = 0) -> None:
        """Give up a task before posting any round (this rank cannot take part, e.g.
        its store failed): every round is marked ABORTED, so the peers stop waiting
        at once instead of at their timeout."""
        idx = self._post(task_id, 0, 0, AgreeState.ABORTED)
        self._give_up(idx, task_id, 0, last_round)

    def _give_up(self, idx: int, task_id: int, rnd: int, last_round: int) -> None:
        """Mark this round ABORTED and post ABORTED for every later round, so no peer
        waits for a round this rank will never enter."""
        self.seg.agree[self.rank, idx, AgreeSlot.STATE] = AgreeState.ABORTED
        for later in range(rnd + 1, last_round + 1):
            self._post(task_id, later, 0, AgreeState.ABORTED)
        for sem in self._others:
            sem.release()

    def _read(self, rank: int, task_id: int, rnd: int) -> tuple[int, AgreeState] | None:
        table = self.seg.agree[rank]
        for idx in range(AGREE_SLOTS):
            entry = table[idx]
            if int(entry[AgreeSlot.TASK_ID]) == task_id and int(entry[AgreeSlot.ROUND]) == rnd:
                value, state = int(table[idx, AgreeSlot.VALUE]), int(table[idx, AgreeSlot.STATE])
                if int(table[idx, AgreeSlot.TASK_ID]) == task_id:  # not reclaimed while read
                    return value, AgreeState(state)
        return None

    def _crossed(self, peers: list[int], task_id: int,
                 queued_here: Callable[[], set[int]]) -> tuple[int, int] | None:
        """(peer, task) for a smaller task id a peer waits in, in round 0, while this rank
        has it queued (see "Crossed tasks"), or None.  ``queued_here`` (a scan of the
        rank's scheduler) runs once, and only when a peer posted such a candidate."""
        candidates = []
        for p in peers:
            table = self.seg.agree[p]
            for idx in range(AGREE_SLOTS):
                other = int(table[idx, AgreeSlot.TASK_ID])
                if (other and other < task_id and int(table[idx, AgreeSlot.ROUND]) == 0
                        and int(table[idx, AgreeSlot.STATE]) == AgreeState.POSTED
                        and int(table[idx, AgreeSlot.TASK_ID]) == other):  # not rewritten
                    candidates.append((p, other))
        if not candidates:
            return None
        queued = queued_here()
        return next(((p, other) for p, other in candidates if other in queued), None)

    def gave_up(self, task_id: int) -> int | None:
        """A peer that marked ``task_id`` ABORTED already (it gave way, or its store
        failed): checked before reading, so this rank fails at once instead of after
        reading every entry."""
        for p in range(self.seg.tp_size):
            got = self._read(p, task_id, 0) if p != self.rank else None
            if got is not None and got[1] is AgreeState.ABORTED:
                return p
        return None

    def agree(self, task_id: int, rnd: int, value: int, timeout: float,
              cancelled: Callable[[], bool] | None = None, last_round: int = 0,
              queued_here: Callable[[], set[int]] | None = None) -> int:
        """Post ``value`` for round ``rnd`` of ``last_round`` and return the minimum over
        every rank's value.

        Every rank ends a task the same way: a rank that gives up (timeout, failed
        or silent peer, a peer's abort, or a cancel) aborts this and all later rounds
        for everyone.  A cancel is honoured before posting any round and while
        waiting in any round but the last: once a rank has posted its last-round
        value, a peer may already have completed, so the task completes here too.
        ``queued_here()``: the ids of the agreed tasks admitted here and not yet run
        (round 0 gives way to a crossed task of a smaller id: "Crossed tasks" above)."""
        what = f"agreement on task {task_id} round {rnd}"
        if cancelled is not None and cancelled():
            idx = self._post(task_id, rnd, value, AgreeState.ABORTED)
            self._give_up(idx, task_id, rnd, last_round)
            raise KvswapError(f"{what}: cancelled", ErrorCode.CANCELLED)
        idx = self._post(task_id, rnd, value, AgreeState.POSTED)
        missing: list[int] = []  # as of the last read

        def everyone_posted() -> int | None:
            # The cancel is checked here, before the read, rather than in abort(): a
            # rank that was cancelled answers CANCELLED even when, in the same turn, a
            # peer's abort mark is visible.
            if rnd < last_round and cancelled is not None and cancelled():
                raise KvswapError(f"{what}: cancelled", ErrorCode.CANCELLED)
            values: list[int] = []
            missing.clear()
            for p in range(self.seg.tp_size):
                got = self._read(p, task_id, rnd)
                if got is None:
                    missing.append(p)
                elif got[1] is AgreeState.ABORTED:
                    raise BarrierAborted(f"{what}: rank {p} gave up")
                else:
                    values.append(got[0])
            return None if missing else min(values)

        def abort() -> BarrierAborted | None:
            now = now_ns()
            for p in missing:
                age = self.seg.heartbeat_age_s(p, now)
                if self.seg.state_of(p) == RankState.FAILED or (
                        age is not None and age > self.stale_after_s):
                    return BarrierAborted(f"{what}: rank {p} is FAILED or silent")
            crossed = (self._crossed(missing, task_id, queued_here)
                       if missing and rnd == 0 < last_round and queued_here is not None
                       else None)
            if crossed is not None:
                return BarrierAborted(
                    f"{what}: rank {crossed[0]} waits in the agreement of task {crossed[1]}, "
                    f"which this rank runs after this one (two clients' prefetches reached "
                    f"the ranks in opposite orders); the larger task id gives way: prefetch "
                    f"again, or send prefetches from one client")
            return None

        def timed_out() -> BarrierTimeout:
            return BarrierTimeout(f"{what} timed out after {timeout:.1f}s waiting for rank(s) "
                                  f"{', '.join(map(str, missing))}")

        return wait_with_abort(everyone_posted, deadline=time.monotonic() + timeout,
                               wake=self._own, interval_s=_CHECK_S, abort=abort,
                               timed_out=timed_out,
                               give_up=lambda: self._give_up(idx, task_id, rnd, last_round))
