"""Cross-rank agreement: minimum, timeouts, and every rank ending a task the same way."""

from __future__ import annotations

import threading
import time

import pytest

from kvswap.client.errors import BarrierAborted, BarrierTimeout, ErrorCode, KvswapError
from kvswap.client.signals import (
    AgreeSlot,
    AgreeState,
    RankSlot,
    SignalSegment,
    create_semaphores,
    now_ns,
    poll_until,
    unlink_semaphores,
)
from kvswap.daemon.agreement import Agreement


@pytest.fixture
def ranks(namespaces):
    """Two ranks' Agreements on a real signal segment and real semaphores, both ranks
    kept live (heartbeats) however long a test runs."""
    names = namespaces.new()
    seg = SignalSegment.create(names, 2)
    create_semaphores(names, 2)
    for r in range(2):
        seg.rank(r)[RankSlot.HEARTBEAT_NS] = now_ns()
    beating = threading.Event()

    def heartbeat():
        while not beating.wait(0.5):
            for r in range(2):
                seg.rank(r)[RankSlot.HEARTBEAT_NS] = now_ns()

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    ags = [Agreement(seg, r, stale_after_s=60, timeout_s=4.0) for r in range(2)]
    yield seg, ags
    beating.set()
    beat.join(5)
    for a in ags:
        a.close()
    seg.close()
    seg.unlink()
    unlink_semaphores(names, 2)


def _both(fn0, fn1):
    out: dict[int, object] = {}

    def run(r, fn):
        try:
            out[r] = fn()
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r, fn)) for r, fn in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_both_ranks_get_the_minimum(ranks):
    _, (a0, a1) = ranks
    out = _both(lambda: a0.agree(7, 0, 5, 10, last_round=1),
                lambda: a1.agree(7, 0, 3, 10, last_round=1))
    assert out == {0: 3, 1: 3}
    out = _both(lambda: a0.agree(7, 1, 2, 10, last_round=1),
                lambda: a1.agree(7, 1, 9, 10, last_round=1))
    assert out == {0: 2, 1: 2}


def test_timeout_names_the_missing_rank_and_aborts_later_rounds(ranks):
    seg, (a0, _) = ranks
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout, match="rank\\(s\\) 1"):
        a0.agree(11, 0, 4, 0.2, last_round=1)
    assert time.monotonic() - t0 < 5
    rounds = {(int(e[AgreeSlot.TASK_ID]), int(e[AgreeSlot.ROUND])):
              AgreeState(int(e[AgreeSlot.STATE]))
              for e in seg.agree[0] if int(e[AgreeSlot.TASK_ID])}
    assert rounds == {(11, 0): AgreeState.ABORTED, (11, 1): AgreeState.ABORTED}


def test_a_late_rank_sees_the_abort_instead_of_waiting(ranks):
    _, (a0, a1) = ranks
    with pytest.raises(BarrierTimeout):
        a0.agree(12, 0, 4, 0.1, last_round=1)
    t0 = time.monotonic()
    with pytest.raises(BarrierAborted, match="rank 0 gave up"):
        a1.agree(12, 0, 4, 30, last_round=1)
    with pytest.raises(BarrierAborted):  # the later round too: rank 0 will never enter it
        a1.agree(12, 1, 4, 30, last_round=1)
    assert time.monotonic() - t0 < 5


def test_a_rank_that_aborts_before_its_first_round_stops_its_peers_waiting(ranks):
    """A rank that fails before its first round (its store did not answer) aborts
    the task: a peer waiting in any round aborts at once, not at its timeout."""
    _, (a0, a1) = ranks
    t0 = time.monotonic()
    out = _both(lambda: a0.agree(21, 0, 4, 30, last_round=1),
                lambda: a1.abort(21, last_round=1))
    assert isinstance(out[0], BarrierAborted) and "rank 1 gave up" in str(out[0])
    with pytest.raises(BarrierAborted, match="gave up"):  # the later round too
        a0.agree(21, 1, 4, 30, last_round=1)
    assert time.monotonic() - t0 < 5


def test_cancel_while_waiting_aborts_every_rank(ranks):
    _, (a0, a1) = ranks
    flag = threading.Event()
    result: dict[str, BaseException] = {}

    def waiting():
        try:
            a0.agree(13, 0, 1, 30, cancelled=flag.is_set, last_round=1)
        except KvswapError as exc:
            result["r0"] = exc

    t = threading.Thread(target=waiting)
    t.start()
    flag.set()
    t.join(10)
    assert result["r0"].code == ErrorCode.CANCELLED
    with pytest.raises(BarrierAborted):
        a1.agree(13, 0, 1, 30, last_round=1)


def test_cancel_is_ignored_once_the_last_round_is_posted(ranks):
    """Rank 0 cancels after posting its last-round value: rank 1 may already be done,
    so rank 0 must complete too (outcomes never differ between ranks)."""
    seg, (a0, a1) = ranks
    cancel = threading.Event()
    out = {}

    def r0():
        out[0] = a0.agree(14, 1, 6, 10, cancelled=cancel.is_set, last_round=1)

    t = threading.Thread(target=r0)
    t.start()
    assert poll_until(lambda: True if any(int(e[AgreeSlot.TASK_ID]) == 14 for e in seg.agree[0])
                      else None, time.monotonic() + 10)  # rank 0 has posted
    cancel.set()
    out[1] = a1.agree(14, 1, 8, 10, last_round=1)
    t.join(10)
    assert out == {0: 6, 1: 6}


def test_a_cancelled_rank_answers_cancelled_even_when_a_peer_gave_up(ranks):
    """Rank 1 has given up on round 0; rank 0 is cancelled after posting.  Rank 0 reports
    its own cause, CANCELLED, not the peer's abort: the cancel is checked first."""
    _, (a0, a1) = ranks
    with pytest.raises(BarrierTimeout):
        a1.agree(15, 0, 4, 0.05, last_round=1)  # marks (15, 0) and (15, 1) ABORTED
    polls = iter([False])  # not cancelled before posting, cancelled from then on

    with pytest.raises(KvswapError) as ei:
        a0.agree(15, 0, 4, 30, cancelled=lambda: next(polls, True), last_round=1)
    assert ei.value.code == ErrorCode.CANCELLED
