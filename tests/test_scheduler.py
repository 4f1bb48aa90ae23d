"""Scheduler unit tests: a fake executor gated by events makes every ordering
question deterministic (no timing assumptions)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvswap.client.protocol import Op
from kvswap.client.signals import poll_until
from kvswap.daemon.scheduler import Scheduler, Task, TaskState

WAIT = 10.0


class Gate:
    """run_batch that records batches and blocks each until released."""

    def __init__(self):
        self.started: list[list[int]] = []  # ctx of each batch, in start order
        self.cv = threading.Condition()
        self.released: set[int] = set()  # ctx values allowed to finish

    def __call__(self, batch: list[Task]) -> None:
        ids = [t.ctx for t in batch]
        with self.cv:
            self.started.append(ids)
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: all(i in self.released for i in ids), WAIT)

    def wait_started(self, n: int) -> list[list[int]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.started) >= n, WAIT), self.started
            return list(self.started)

    def release(self, *ids: int) -> None:
        with self.cv:
            self.released.update(ids)
            self.cv.notify_all()


def ids(*x):
    return np.array(x, dtype=np.int64)


@pytest.fixture
def make():
    made = []

    def _make(workers=2, merge=False, gate=None, blocks=16):
        gate = gate or Gate()
        s = Scheduler(blocks, blocks, gate, workers=workers, merge=merge)
        made.append((s, gate))
        return s, gate

    yield _make
    for s, gate in made:
        gate.release(*range(1000))
        s.stop()
        assert s.join(WAIT)


def test_overlapping_tasks_wait_independent_ones_run(make):
    s, gate = make(workers=2)
    s.submit(Op.EVICT, ids(1, 2), ids(1, 2), ctx=0)
    late = s.submit(Op.LOAD, ids(2), ids(9), ctx=1)  # device block 2: depends on task 0
    s.submit(Op.LOAD, ids(5), ids(5), ctx=2)  # independent: runs beside task 0
    assert sorted(map(tuple, gate.wait_started(2))) == [(0,), (2,)]
    assert late.state is TaskState.WAITING and late.deps == 1
    gate.release(2)
    gate.release(0)
    assert gate.wait_started(3)[2] == [1]
    gate.release(1)


@pytest.mark.parametrize("first, second", [
    ((ids(1), ids(1)), (ids(1), ids(2))),  # same device block (read then write)
    ((ids(1), ids(1)), (ids(2), ids(1))),  # same host block
])
def test_any_overlap_orders_whatever_the_direction(make, first, second):
    s, gate = make(workers=2)
    s.submit(Op.LOAD, *first, ctx=0)
    t = s.submit(Op.EVICT, *second, ctx=1)
    assert gate.wait_started(1) == [[0]]
    assert t.state is TaskState.WAITING
    gate.release(0)
    assert gate.wait_started(2)[1] == [1]
    gate.release(1)


def test_large_and_small_tasks_see_each_others_blocks(make):
    """Tasks of more than 32 ids take the array path of the hazard table, smaller ones
    the scalar path: each sees the blocks the other wrote, either way round."""
    s, gate = make(workers=4, blocks=256)
    s.submit(Op.EVICT, np.arange(40), np.arange(40), ctx=0)  # large
    small = s.submit(Op.LOAD, ids(39), ids(100), ctx=1)  # device 39: after 0
    s.submit(Op.EVICT, ids(200), ids(200), ctx=2)  # small, independent
    large = s.submit(Op.LOAD, np.arange(60, 100), np.arange(100, 140), ctx=3)  # host 100
    after = s.submit(Op.LOAD, np.arange(60, 100), np.arange(41, 81), ctx=4)  # large
    assert (small.deps, large.deps) == (1, 1)
    assert after.deps == 1  # device 60..99: task 3 writes them
    assert sorted(map(tuple, gate.wait_started(2))) == [(0,), (2,)]
    gate.release(0, 2)
    assert gate.wait_started(3)[2] == [1]
    gate.release(1)
    assert gate.wait_started(4)[3] == [3]
    gate.release(3)
    assert gate.wait_started(5)[4] == [4]
    gate.release(4)


def test_claimed_is_the_submitters_answer_whatever_the_workers_do(make):
    """A task queued because another is ready can be taken by a worker (RUNNING) by the
    time its submitter looks: only ``claimed`` says whether the submitter must run it.
    (The I/O thread once read ``state`` and copied such a task a second time.)"""
    s, gate = make(workers=1)
    mine = s.submit(Op.EVICT, ids(1), ids(1), ctx=0, claim_if_alone=True)
    assert mine.claimed and mine.state is TaskState.RUNNING and gate.started == []
    s.submit(Op.EVICT, ids(2), ids(2), ctx=1)  # the worker takes it and holds
    assert gate.wait_started(1) == [[1]]
    s.submit(Op.EVICT, ids(3), ids(3), ctx=2)  # ready, waiting for the worker
    queued = s.submit(Op.EVICT, ids(4), ids(4), ctx=3, claim_if_alone=True)
    assert not queued.claimed and queued.state is TaskState.READY
    gate.release(1, 2)
    assert gate.wait_started(3)[2] == [3]
    assert queued.state is TaskState.RUNNING and not queued.claimed
    s.finish([mine])
    gate.release(3)


def test_claimed_tasks_never_overlap_and_release_their_dependents_together(make):
    """The I/O thread claims every small ready task of a burst and copies them in one
    pass (daemon/transfers.py): that is sound only because a task overlapping a
    claimed one depends on it, so is never claimed beside it."""
    s, gate = make(workers=1)
    a = s.submit(Op.EVICT, ids(1), ids(1), ctx=0, claim_if_alone=True)
    b = s.submit(Op.EVICT, ids(2), ids(2), ctx=1, claim_if_alone=True)
    after_a = s.submit(Op.LOAD, ids(3), ids(1), ctx=2, claim_if_alone=True)  # host 1
    c = s.submit(Op.EVICT, ids(4), ids(4), ctx=3, claim_if_alone=True)
    assert [t.claimed for t in (a, b, after_a, c)] == [True, True, False, True]
    assert after_a.state is TaskState.WAITING and after_a.deps == 1
    s.finish([a, b, c])
    assert gate.wait_started(1) == [[2]]  # released to a worker by the group's finish
    gate.release(2)


def test_chain_of_three_is_transitive(make):
    s, gate = make(workers=3)
    s.submit(Op.EVICT, ids(1), ids(1), ctx=0)
    s.submit(Op.LOAD, ids(2), ids(1), ctx=1)  # host 1: after 0
    t2 = s.submit(Op.EVICT, ids(2), ids(3), ctx=2)  # device 2: after 1 (and so after 0)
    assert t2.deps == 1
    gate.wait_started(1)
    gate.release(0)
    assert gate.wait_started(2)[1] == [1]
    assert t2.state is TaskState.WAITING
    gate.release(1, 2)
    assert gate.wait_started(3)[2] == [2]


def test_loads_before_evicts_then_priority_then_order(make):
    s, gate = make(workers=1)
    s.submit(Op.EVICT, ids(0), ids(0), ctx=100)  # occupies the only worker
    gate.wait_started(1)
    s.submit(Op.EVICT, ids(1), ids(1), ctx=1)
    s.submit(Op.EVICT, ids(2), ids(2), priority=5, ctx=2)
    s.submit(Op.LOAD, ids(3), ids(3), ctx=3)
    s.submit(Op.LOAD, ids(4), ids(4), priority=1, ctx=4)
    s.submit(Op.EVICT, ids(5), ids(5), priority=5, ctx=5)
    gate.release(100, 1, 2, 3, 4, 5)
    order = [b[0] for b in gate.wait_started(6)[1:]]
    assert order == [4, 3, 2, 5, 1]


def test_ready_tasks_of_one_direction_merge(make):
    s, gate = make(workers=1, merge=True)
    s.submit(Op.LOAD, ids(0), ids(0), ctx=100)
    gate.wait_started(1)
    for i in range(1, 5):
        s.submit(Op.EVICT, ids(i), ids(i), ctx=i)
    s.submit(Op.LOAD, ids(9), ids(9), layerwise=True, ctx=9)  # never merged
    s.submit(Op.LOAD, ids(8), ids(8), ctx=8)
    gate.release(100, 1, 2, 3, 4, 8, 9)
    batches = gate.wait_started(4)[1:]
    assert batches == [[9], [8], [1, 2, 3, 4]]
    assert s.merged_batches == 1


def test_merge_respects_block_budget(make):
    gate = Gate()
    s = Scheduler(16, 16, gate, workers=1, merge=True, max_merge_blocks=3)
    try:
        s.submit(Op.LOAD, ids(0), ids(0), ctx=100)
        gate.wait_started(1)
        s.submit(Op.EVICT, ids(1, 2), ids(1, 2), ctx=1)
        s.submit(Op.EVICT, ids(3), ids(3), ctx=2)
        s.submit(Op.EVICT, ids(4), ids(4), ctx=3)
        gate.release(100, 1, 2, 3)
        assert gate.wait_started(3)[1:] == [[1, 2], [3]]
    finally:
        gate.release(*range(200))
        s.stop()
        s.join(WAIT)


def test_cancel_waiting_task_releases_dependents(make):
    s, gate = make(workers=2)
    s.submit(Op.EVICT, ids(1), ids(1), ctx=0)
    s.submit(Op.LOAD, ids(1), ids(2), ctx=1)  # waits for 0
    s.submit(Op.EVICT, ids(1), ids(3), ctx=2)  # waits for 1
    assert gate.wait_started(1) == [[0]]
    assert s.cancel(lambda t: t.ctx == 0) is None  # running: cannot be cancelled
    cancelled = s.cancel(lambda t: t.ctx == 1)
    assert cancelled is not None and cancelled.state is TaskState.CANCELLED
    gate.release(0, 2)
    assert gate.wait_started(2)[1] == [2]  # task 2 ran without task 1
    assert all(b != [1] for b in gate.started)


@pytest.mark.parametrize("later_first", [False, True])
def test_a_cancelled_waiting_task_keeps_later_tasks_behind_what_it_waited_for(make,
                                                                              later_first):
    """A evicts into host 1 (running), X loads host 1 (waits for A), Y evicts into
    host 1 again: Y's last toucher of host 1 is X.  Cancelling X released Y at once,
    so Y wrote host 1 before A did and A's bytes won (black-box attack: ten of ten
    runs).  X, cancelled while it waited, stays in the order as a no-op until A has
    finished: Y waits for A, whether it came before the cancel or after."""
    s, gate = make(workers=2)
    s.submit(Op.EVICT, ids(1), ids(1), ctx=0)  # A
    assert gate.wait_started(1) == [[0]]
    x = s.submit(Op.LOAD, ids(3), ids(1), ctx=1)  # X: reads host 1, waits for A
    y = s.submit(Op.EVICT, ids(5), ids(1), ctx=2) if later_first else None
    assert s.cancel(lambda t: t.ctx == 1) is x and x.state is TaskState.CANCELLED
    if y is None:
        y = s.submit(Op.EVICT, ids(5), ids(1), ctx=2)  # Y: writes host 1
    assert y.state is TaskState.WAITING and s.pending == 2  # A and Y; X is answered
    gate.release(0)
    assert gate.wait_started(2) == [[0], [2]]  # Y after A; X never ran
    gate.release(2)


def test_stop_returns_unstarted_tasks(make):
    s, gate = make(workers=1)
    s.submit(Op.EVICT, ids(1), ids(1), ctx=0)
    gate.wait_started(1)
    s.submit(Op.EVICT, ids(1), ids(2), ctx=1)
    s.submit(Op.LOAD, ids(5), ids(5), ctx=2)
    dropped = s.stop()
    assert [t.ctx for t in dropped] == [1, 2]
    with pytest.raises(RuntimeError):
        s.submit(Op.LOAD, ids(6), ids(6), ctx=3)
    gate.release(0)
    assert s.join(WAIT)
    assert gate.started == [[0]]


def test_prefetches_run_in_admission_order_whatever_their_blocks_and_priorities():
    """Agreed ops (prefetch) wait for the previous one: a later prefetch that is ready
    first, with a higher priority, still runs second, so every rank enters the
    agreements in the same order (without it, two ranks can each wait in the other's
    agreement until the storage timeout: fuzz finding)."""
    gate = Gate()
    s = Scheduler(16, 16, gate, workers=1, storage_workers=2)
    try:
        s.submit(Op.EVICT, ids(1), ids(1), ctx=0)  # holds host block 1
        first = s.submit(Op.PREFETCH, ids(), ids(1), ctx=1)  # waits for the evict
        second = s.submit(Op.PREFETCH, ids(), ids(2), priority=9, ctx=2)  # no block overlap
        s.submit(Op.EXISTS, ids(), ids(), ctx=3)  # not agreed: runs at once
        assert sorted(map(tuple, gate.wait_started(2))) == [(0,), (3,)]
        assert first.state is TaskState.WAITING and second.state is TaskState.WAITING
        gate.release(0, 3)
        assert gate.wait_started(3)[2] == [1]
        assert second.state is TaskState.WAITING
        gate.release(1)
        assert gate.wait_started(4)[3] == [2]
        gate.release(2)
    finally:
        gate.release(*range(10))
        s.stop()
        assert s.join(WAIT)


class _CountingScheduler(Scheduler):
    """Counts each lane's looks at the ready heaps (a worker looks once before it
    waits, and once each time it is woken)."""

    def __init__(self, *args, **kwargs):
        self.looks: dict[str, int] = {"transfer": 0, "storage": 0, "peer": 0}
        super().__init__(*args, **kwargs)

    def _take(self, lane: str) -> list[Task]:
        self.looks[lane] += 1
        return super()._take(lane)


def test_a_ready_task_wakes_one_worker_of_its_lane():
    """Two copy workers, a storage and a peer worker, all waiting: one evict wakes one
    copy worker, no other thread (each woken thread costs the daemon the GIL: with one
    condition for every worker, all four woke for every task)."""
    ran = threading.Event()
    s = _CountingScheduler(16, 16, lambda batch: ran.set(), workers=2, storage_workers=1,
                           peer_workers=1)
    try:
        def all_waiting() -> bool:  # CPython's Condition keeps its waiters in _waiters
            with s._lock:
                return sum(len(cv._waiters) for cv in s._wake.values()) == 4

        def settle() -> None:
            assert poll_until(lambda: True if all_waiting() else None,
                              time.monotonic() + WAIT), "the workers never all waited"

        settle()
        assert s.looks == {"transfer": 2, "storage": 1, "peer": 1}
        s.submit(Op.EVICT, ids(1), ids(2))
        assert ran.wait(WAIT)
        settle()
        # the woken copy worker: one look that took the task, one after it finished
        assert s.looks == {"transfer": 4, "storage": 1, "peer": 1}
    finally:
        s.stop()
        assert s.join(WAIT)
