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

**The ring is never overrun.**  A rank's ring holds 64 entries, and a peer may
need an entry long after it was posted: a rank whose reads fail at once gives
up task after task without waiting, while its peer, still reading, reaches
those tasks later.  When ``_post`` reused slots in turn, a rank more than about
32 tasks ahead overwrote marks its peer had not read, and the peer waited the
full ``--storage-timeout`` per task.  Two rules now hold, and together they
keep every entry a live peer will read until it has read it:

1. *A slot is reused only when no live peer may still read its entry* (flow
   control, :meth:`Agreement._post`): a post takes the first such slot from the
   ring's position (readers scan every slot, so any will do), and waits only when
   there is none.  A peer may still read our entry for task
   X while its own latest-round entry for X is POSTED (it is inside X: a rank
   marks that entry ABORTED when it gives up and DONE when it completes, before
   it runs anything else), and while it has not reached X at all if we owe it
   the mark (``_owed``: we gave X up before it arrived).  A peer that posted
   nothing for X and is not owed needs nothing: X succeeded (it took part), or
   we saw it reach X, or X was cancelled here (the cancel reaches every rank:
   a peer drops X or honours the cancel in its own round 0, and a peer already
   in X holds a POSTED entry, so the first condition covers it).  Until the
   slot is free the rank waits (20 ms checks, woken by every post); a FAILED or
   silent peer is not waited for.
2. *A rank that gives up a task without a rendezvous waits for its peers to
   reach it* (:meth:`Agreement.abort` with a ``timeout``: a failed read, a peer's
   mark seen before reading).  It returns once every live peer has posted for
   the task, so it is never more than one task ahead of a peer, and rule 1
   rarely has to wait.  Its peers still answer at once: they see the mark the
   moment they reach the task; only this rank's next task waits, and a task's
   reply is the slowest rank's anyway.  Three things end the wait early, each
   leaving the mark owed (rule 1 keeps it): the task is cancelled here (then
   nothing is owed: see rule 1), a peer waits in round 0 of a task this rank
   has queued (crossed: it reaches ours only after we ran its), and the
   timeout.

Why nobody waits forever: every wait ends at its timeout (``--storage-timeout``)
or when the peer is FAILED or silent.  Why rule 1 rarely waits at all: only a
ring of 64 entries every one of which a peer may still read makes it wait.  Why
its wait ends early in practice: the entries it protects belong to tasks the peer is running or has
queued; the peer finds our mark the moment it reaches each one and moves on.
It waits out its timeout only for a peer that never runs an owed task
(cancelled there while queued, after this rank had already left its rule-2
wait through a crossing or a timeout), or that ran it and overwrote its own
entries for it before this rank looked (this rank looks at every post, so that
needs a peer 32 tasks ahead of an owed mark): the mark is then dropped with a
warning, and nobody needs it.  A mark is only ever dropped that way, never by
running ahead, so a peer that reaches a task within the timeout always finds
the mark.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("kvswap.daemon")


class Agreement:
    """Writer of this rank's agreement ring and reader of every rank's."""

    def __init__(self, seg: SignalSegment, rank: int, stale_after_s: float = 5.0,
                 timeout_s: float = 30.0):
        """``timeout_s``: the longest rule 1 waits for a slot (``--storage-timeout``, the
        timeout every agreement of the rank is given)."""
        self.seg = seg
        self.rank = rank
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._next = 0
        # storage worker only: task -> live peers that have not reached it, for which
        # our ABORTED mark is kept (rule 1)
        self._owed: dict[int, set[int]] = {}
        self._timeout_s = timeout_s
        names = seg.names
        self._own = posix_ipc.Semaphore(names.wake_sem(rank))
        self._others = [posix_ipc.Semaphore(names.wake_sem(p))
                        for p in range(seg.tp_size) if p != rank]

    def close(self) -> None:
        for sem in (self._own, *self._others):
            sem.close()

    def _post(self, task_id: int, rnd: int, value: int, state: AgreeState) -> int:
        for owed in list(self._owed):  # look often: a peer's entries do not last for ever
            self._needed_by(owed)
        with self._lock:
            # The first slot from the ring's position that no live peer may still read:
            # any slot will do, as readers scan them all.  Waiting for the one in ring
            # order instead could wait on a peer that reads its mark only after a task
            # it waits in for our post (two clients' tasks in crossed orders).
            start = self._next % AGREE_SLOTS
            self._next += 1
            idx = next((i % AGREE_SLOTS for i in range(start, start + AGREE_SLOTS)
                        if self._reusable(i % AGREE_SLOTS)), start)
        self._free_slot(idx)
        e = self.seg.agree[self.rank, idx]
        e[AgreeSlot.TASK_ID] = 0
        e[AgreeSlot.ROUND] = rnd
        e[AgreeSlot.VALUE] = value
        e[AgreeSlot.STATE] = state
        e[AgreeSlot.TASK_ID] = task_id
        for sem in self._others:
            sem.release()
        return idx

    # ---------------------------------------------------------------- flow control

    def _peers(self) -> list[int]:
        return [p for p in range(self.seg.tp_size) if p != self.rank]

    def _live(self, p: int) -> bool:
        age = self.seg.heartbeat_age_s(p, now_ns())
        return self.seg.state_of(p) != RankState.FAILED and not (
            age is not None and age > self.stale_after_s)

    def _entries(self, p: int, task_id: int) -> list[tuple[int, int]]:
        """(round, state) of each of ``p``'s entries for ``task_id``."""
        table = self.seg.agree[p]
        out = []
        for idx in range(AGREE_SLOTS):
            if int(table[idx, AgreeSlot.TASK_ID]) == task_id:
                rnd, state = int(table[idx, AgreeSlot.ROUND]), int(table[idx, AgreeSlot.STATE])
                if int(table[idx, AgreeSlot.TASK_ID]) == task_id:  # not reclaimed while read
                    out.append((rnd, state))
        return out

    def _inside(self, p: int, task_id: int) -> bool:
        """Whether ``p`` is running ``task_id``'s agreement: its latest-round entry for it is
        POSTED (one that gave up marks it ABORTED, one that completed marks it DONE)."""
        entries = self._entries(p, task_id)
        return bool(entries) and max(entries)[1] == AgreeState.POSTED

    def _needed_by(self, task_id: int) -> set[int]:
        """The live peers that may still read our entries for ``task_id`` (rule 1)."""
        owed = self._owed.get(task_id, set())
        owed -= {p for p in owed if self._entries(p, task_id) or not self._live(p)}
        if not owed:
            self._owed.pop(task_id, None)
        return {p for p in self._peers()
                if p in owed or (self._inside(p, task_id) and self._live(p))}

    def _reusable(self, idx: int) -> bool:
        """Whether no live peer may still read our entry in slot ``idx`` (rule 1)."""
        task_id = int(self.seg.agree[self.rank, idx, AgreeSlot.TASK_ID])
        return not task_id or not self._needed_by(task_id)

    def _free_slot(self, idx: int) -> None:
        """Wait until no live peer may still read the entry in our slot ``idx`` (rule 1),
        at most the storage timeout; then the entry may be overwritten."""
        task_id = int(self.seg.agree[self.rank, idx, AgreeSlot.TASK_ID])
        if not task_id:
            return
        deadline = time.monotonic() + self._timeout_s
        while True:
            needed = self._needed_by(task_id)
            if not needed:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("agreement: rank(s) %s have not read this rank's entry for task %d "
                            "within %.1fs; its slot is reused", ", ".join(map(str, sorted(needed))),
                            task_id, self._timeout_s)
                self._owed.pop(task_id, None)
                return
            try:
                self._own.acquire(min(remaining, _CHECK_S))
            except posix_ipc.BusyError:
                pass

    def _owe(self, task_id: int, seen: set[int] | frozenset[int] = frozenset()) -> None:
        """Remember the live peers that have not reached ``task_id``: our mark is kept for them.
        ``seen``: peers seen to have posted for it (their entries may be gone already)."""
        owed = {p for p in self._peers()
                if p not in seen and self._live(p) and not self._entries(p, task_id)}
        if owed:
            self._owed[task_id] = owed

    def _await_peers(self, task_id: int, timeout: float, cancelled: Callable[[], bool] | None,
                     queued_here: Callable[[], set[int]] | None) -> None:
        """Rule 2: wait until every live peer has posted for ``task_id``, which this rank gave
        up; a cancel, a crossed peer and the timeout end the wait (the mark stays owed)."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            if cancelled is not None and cancelled():
                return  # the cancel reaches every rank: nothing is owed
            seen |= {p for p in self._peers() if self._entries(p, task_id)}
            waiting = [p for p in self._peers() if p not in seen and self._live(p)]
            if not waiting:
                return
            crossed = (self._crossed(waiting, None, queued_here)
                       if queued_here is not None else None)
            remaining = deadline - time.monotonic()
            if crossed is not None or remaining <= 0:
                self._owe(task_id, seen)
                return
            try:
                self._own.acquire(min(remaining, _CHECK_S))
            except posix_ipc.BusyError:
                pass

    # ---------------------------------------------------------------- give up

    def abort(self, task_id: int, last_round: int = 0, *, timeout: float | None = None,
              cancelled: Callable[[], bool] | None = None,
              queued_here: Callable[[], set[int]] | None = None) -> None:
        """Give up a task before posting any round (this rank cannot take part, e.g.
        its store failed): every round is marked ABORTED, so the peers stop waiting
        at once instead of at their timeout.  With ``timeout`` (the storage timeout),
        then wait for every live peer to reach the task ("The ring is never overrun",
        rule 2); ``cancelled`` and ``queued_here`` as for :meth:`agree`."""
        idx = self._post(task_id, 0, 0, AgreeState.ABORTED)
        self._give_up(idx, task_id, 0, last_round)
        if timeout is not None:
            self._await_peers(task_id, timeout, cancelled, queued_here)
        else:
            self._owe(task_id)

    def _give_up(self, idx: int, task_id: int, rnd: int, last_round: int) -> None:
        """Mark this round ABORTED and post ABORTED for every later round, so no peer
        waits for a round this rank will never enter."""
        self.seg.agree[self.rank, idx, AgreeSlot.STATE] = AgreeState.ABORTED
        for later in range(rnd + 1, last_round + 1):
            self._post(task_id, later, 0, AgreeState.ABORTED)
        for sem in self._others:
            sem.release()

    def _read(self, rank: int, task_id: int, rnd: int) -> tuple[int, AgreeState] | None:
        """``rank``'s value and state for (``task_id``, ``rnd``), or None if not posted.
        An ABORTED entry of any round aborts every round of the task (a rank that gives
        up in round 0 never enters round 1); a DONE entry reads as POSTED."""
        found = None
        for got_rnd, state in self._entries(rank, task_id):
            if state == AgreeState.ABORTED:
                return 0, AgreeState.ABORTED
            if got_rnd == rnd:
                found = state
        if found is None:
            return None
        table = self.seg.agree[rank]
        for idx in range(AGREE_SLOTS):
            entry = table[idx]
            if int(entry[AgreeSlot.TASK_ID]) == task_id and int(entry[AgreeSlot.ROUND]) == rnd:
                value = int(table[idx, AgreeSlot.VALUE])
                if int(table[idx, AgreeSlot.TASK_ID]) == task_id:  # not reclaimed while read
                    return value, AgreeState.POSTED
        return None

    def _crossed(self, peers: list[int], task_id: int | None,
                 queued_here: Callable[[], set[int]]) -> tuple[int, int] | None:
        """(peer, task) for a task a peer waits in, in round 0, while this rank has it
        queued (see "Crossed tasks"), or None; with ``task_id``, only tasks of a smaller
        id.  ``queued_here`` (a scan of the rank's scheduler) runs once, and only when a
        peer posted such a candidate."""
        candidates = []
        for p in peers:
            table = self.seg.agree[p]
            for idx in range(AGREE_SLOTS):
                other = int(table[idx, AgreeSlot.TASK_ID])
                if (other and (task_id is None or other < task_id)
                        and int(table[idx, AgreeSlot.ROUND]) == 0
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
            # nothing owed: the cancel reaches every rank ("The ring is never overrun")
            idx = self._post(task_id, rnd, value, AgreeState.ABORTED)
            self._give_up(idx, task_id, rnd, last_round)
            raise KvswapError(f"{what}: cancelled", ErrorCode.CANCELLED)
        idx = self._post(task_id, rnd, value, AgreeState.POSTED)
        missing: list[int] = []  # as of the last read
        seen: set[int] = set()  # peers seen to have posted for the task

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
                if got is not None:
                    seen.add(p)
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

        try:
            result = wait_with_abort(everyone_posted, deadline=time.monotonic() + timeout,
                                     wake=self._own, interval_s=_CHECK_S, abort=abort,
                                     timed_out=timed_out,
                                     give_up=lambda: self._give_up(idx, task_id, rnd,
                                                                   last_round))
        except KvswapError as exc:
            if exc.code != ErrorCode.CANCELLED:  # a cancel reaches every rank by itself
                self._owe(task_id, seen)
            raise
        if rnd == last_round:  # completed: no peer reads this rank as inside the task now
            self.seg.agree[self.rank, idx, AgreeSlot.STATE] = AgreeState.DONE
        return result
