"""The prefetch agreement ring is never overrun (daemon/agreement.py, "The ring is never
overrun"): a rank that gives up task after task without waiting (its reads fail at
once, or it is cancelled) must not overwrite a mark a peer has yet to read, or that
peer waits the full storage timeout for each such task.

Two ranks are two :class:`Agreement` objects on a real signal segment and real
semaphores (test_agreement's ``ranks``), each driven by its own thread, as the
daemons' storage threads drive them.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvswap.client.errors import BarrierAborted, ErrorCode, KvswapError
from kvswap.client.signals import AGREE_SLOTS, AgreeSlot, AgreeState, RankSlot, RankState, poll_until
from kvswap.daemon.agreement import Agreement

import test_agreement

ranks = test_agreement.ranks  # the fixture: two ranks' Agreements, both kept live

TASKS = 2 * AGREE_SLOTS  # 2 entries each: the ring would wrap 4 times over
TIMEOUT = 4.0  # a peer that misses a mark waits this long: the failure being tested


class _Runner(threading.Thread):
    """Runs ``fn`` on a thread of its own (a rank's storage thread), keeping what it
    raised; joined with a deadline by :meth:`finish`."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn = fn
        self.error: BaseException | None = None

    def run(self):
        try:
            self.fn()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "the rank running ahead never finished"
        if self.error is not None:
            raise self.error


def _ran_ahead(ahead: _Runner, ag: Agreement) -> None:
    """Wait until the rank running ahead has finished, or has posted more entries than
    its ring holds (it then reuses slots, or waits to)."""
    assert poll_until(lambda: True if not ahead.is_alive() or ag._next > AGREE_SLOTS
                      else None, time.monotonic() + 10)


def _expect_aborted(ag: Agreement, task: int) -> None:
    with pytest.raises(BarrierAborted, match="rank 1 gave up"):
        ag.agree(task, 0, 4, TIMEOUT, last_round=1)


def test_a_rank_whose_reads_fail_cannot_overwrite_marks_its_peer_has_not_read(ranks):
    """Rank 1 gives up TASKS tasks at once (its store fails) while rank 0 has not started:
    rank 0 then reaches each and must find the mark, answering BARRIER_ABORTED at once.
    Before, rank 1 overwrote its 64-entry ring and rank 0 waited the timeout for the
    earliest tasks."""
    _, (a0, a1) = ranks
    ahead = _Runner(lambda: [a1.abort(t, last_round=1) for t in range(1, TASKS + 1)])
    ahead.start()
    _ran_ahead(ahead, a1)
    for task in range(1, TASKS + 1):  # a missed mark is a BarrierTimeout after TIMEOUT
        t0 = time.monotonic()
        _expect_aborted(a0, task)
        assert time.monotonic() - t0 < TIMEOUT, f"rank 0 waited for the mark of task {task}"
    ahead.finish(10)


def test_rank_that_gave_up_waits_for_its_peer_to_reach_the_task(ranks):
    """Rule 2: with the storage timeout, a rank that gave up returns only once its peer
    has reached the task (so it never runs ahead); the peer still answers at once."""
    _, (a0, a1) = ranks
    done = threading.Event()

    def give_up():
        a1.abort(5, last_round=1, timeout=30)
        done.set()

    ahead = _Runner(give_up)
    ahead.start()
    assert not done.wait(0.3), "rank 1 moved on before rank 0 reached the task"
    t0 = time.monotonic()
    _expect_aborted(a0, 5)
    assert done.wait(5), "rank 1 still waits although rank 0 reached the task"
    assert time.monotonic() - t0 < 5
    ahead.finish(5)


def test_a_cancelled_wait_for_the_peer_ends_at_once_and_owes_nothing(ranks):
    """A cancel reaches every rank, so a rank that gave up a task and is then cancelled
    stops waiting for its peer to reach it (the peer drops or cancels it itself)."""
    _, (_, a1) = ranks
    t0 = time.monotonic()
    a1.abort(6, last_round=1, timeout=30, cancelled=lambda: True)
    assert time.monotonic() - t0 < 2
    assert 6 not in a1._owed


def test_cancels_cannot_overwrite_the_mark_of_a_peer_inside_the_task(ranks):
    """Rank 0 has posted round 0 of task 1 and is descheduled before it reads; rank 1 is
    cancelled in task 1 and then in TASKS more.  The cancel marks owe nothing to a peer
    that has not reached their task (its own cancel stops it), but rank 0 is inside
    task 1: its mark must survive until rank 0 has read it."""
    seg, (a0, a1) = ranks
    a0._post(1, 0, 4, AgreeState.POSTED)  # inside task 1, round 0, not reading yet

    def cancel_all():
        for task in range(1, TASKS + 2):
            with pytest.raises(KvswapError) as ei:
                a1.agree(task, 0, 4, TIMEOUT, cancelled=lambda: True, last_round=1)
            assert ei.value.code == ErrorCode.CANCELLED

    ahead = _Runner(cancel_all)
    ahead.start()
    _ran_ahead(ahead, a1)
    t0 = time.monotonic()
    _expect_aborted(a0, 1)  # rank 0 wakes up and reads
    assert time.monotonic() - t0 < TIMEOUT
    ahead.finish(10)


def test_a_failed_peer_is_not_waited_for(ranks):
    """Marks owed to a FAILED rank are dropped: the rank ahead is not held up by it."""
    seg, (_, a1) = ranks
    seg.rank(0)[RankSlot.STATE] = RankState.FAILED
    t0 = time.monotonic()
    for task in range(1, TASKS + 1):
        a1.abort(task, last_round=1, timeout=30)
    assert time.monotonic() - t0 < 5
    tasks = {int(e[AgreeSlot.TASK_ID]) for e in seg.agree[1]}
    assert max(tasks) == TASKS  # it ran through every task


def test_a_post_takes_another_slot_than_a_mark_its_peer_reads_only_later(ranks):
    """Two clients' tasks in crossed orders: rank 1 gave task 7 up (its mark owed to
    rank 0, which reaches 7 only after task 9) and now takes part in 9, whose ring
    slot in turn is the one holding that mark.  Waiting for the slot, rank 1 could not
    post 9 until rank 0 had read 7, which it does only after 9: both waited out the
    timeout.  Any slot will do, so rank 1 posts into a free one."""
    _, (a0, a1) = ranks
    a1.abort(7, last_round=1)  # rounds 0 and 1 marked, in slots 0 and 1; owed to rank 0
    a1._next = 0  # the next post's place in ring order: the owed mark
    peer = _Runner(lambda: a0.agree(9, 0, 5, TIMEOUT, last_round=0))
    peer.start()
    t0 = time.monotonic()
    assert a1.agree(9, 0, 3, TIMEOUT, last_round=0) == 3
    assert time.monotonic() - t0 < TIMEOUT / 2, "rank 1 waited for the owed mark's slot"
    peer.finish(TIMEOUT)
    _expect_aborted(a0, 7)  # the mark is still there for rank 0
