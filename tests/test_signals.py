"""Signal segment and barrier across real processes."""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from kvswap.client.errors import (
    BarrierAborted,
    BarrierTimeout,
    ErrorCode,
    NamespaceError,
    RankTimeout,
    TransferFailed,
)
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.naming import Names
from kvswap.client import signals
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import (
    HEADER_FIELDS,
    HIST_OPS,
    HIST_PHASES,
    HIST_SLOTS,
    RANK_FIELDS,
    STATS_BYTES,
    AgreeSlot,
    Barrier,
    HeaderSlot,
    LayerSlot,
    RankSlot,
    RankState,
    SignalSegment,
    create_semaphores,
    now_ns,
    poll_until,
    unlink_semaphores,
    wait_with_abort,
)

ctx = mp.get_context("fork")


@pytest.fixture
def segment(namespaces):
    """A tp=3 namespace's signal segment and semaphores, removed afterwards."""
    names = namespaces.new()
    seg = SignalSegment.create(names, 3)
    create_semaphores(names, 3)
    yield seg
    seg.close()
    seg.unlink()
    unlink_semaphores(names, 3)


def _child_writes(names: Names, out) -> None:
    seg = SignalSegment.attach(names)
    r1 = seg.rank(1)
    out.put(int(seg.ranks[0, RankSlot.COMPLETED]))  # what the parent wrote
    r1[RankSlot.STATE] = RankState.READY
    r1[RankSlot.COMPLETED] = 7
    r1.add(RankSlot.BYTES_LOADED, 4096)
    seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS] = 123
    seg.close()


def test_writes_are_visible_across_processes(segment):
    segment.rank(0)[RankSlot.COMPLETED] = 11
    q = ctx.Queue()
    p = ctx.Process(target=_child_writes, args=(segment.names, q))
    p.start()
    p.join(20)
    assert p.exitcode == 0
    assert q.get(timeout=5) == 11
    assert segment.state_of(1) == RankState.READY
    snap = segment.snapshot()
    assert snap["ranks"][1]["completed"] == 7 and snap["ranks"][1]["bytes_loaded"] == 4096
    assert snap["ranks"][1]["state"] == "READY"
    assert int(segment.header[HeaderSlot.ENGINE_HEARTBEAT_NS]) == 123
    assert snap["tp_size"] == 3 and snap["namespace"] == segment.names.namespace


def test_readonly_attach_cannot_write_nor_unlink(segment):
    ro = SignalSegment.attach(segment.names, readonly=True)
    try:
        with pytest.raises(ValueError):
            ro.ranks[0, RankSlot.COMPLETED] = 1
        with pytest.raises(NamespaceError):
            ro.unlink()
    finally:
        ro.close()
    assert int(segment.ranks[0, RankSlot.COMPLETED]) == 0


def test_attach_errors_are_clear(namespaces, segment):
    missing = namespaces.new()
    with pytest.raises(NamespaceError, match="kvswap launch"):
        SignalSegment.attach(missing)
    with pytest.raises(NamespaceError, match="in use"):
        SignalSegment.create(segment.names, 2)
    bogus = namespaces.new()
    region = ShmRegion.create(bogus.signals, 4096)
    try:
        with pytest.raises(NamespaceError, match="magic"):
            SignalSegment.attach(bogus)
    finally:
        region.unlink()
        region.close()


def _child_barrier(names: Names, rank: int, rounds: int, out) -> None:
    seg = SignalSegment.attach(names)
    b = Barrier(seg, rank)
    for _ in range(rounds):
        out.put((rank, b.wait(timeout=20)))
    b.close()
    seg.close()


def test_barrier_with_three_processes_is_reusable(segment):
    q = ctx.Queue()
    early = [ctx.Process(target=_child_barrier, args=(segment.names, r, 2, q)) for r in (0, 1)]
    for p in early:
        p.start()
    try:
        arrived = poll_until(
            lambda: True if all(segment.ranks[r, RankSlot.BARRIER_ARRIVALS] == 1 for r in (0, 1))
            else None, time.monotonic() + 20)
        assert arrived
        # Ranks 0 and 1 have arrived but rank 2 has not: neither may have passed.
        assert q.empty()
        late = ctx.Process(target=_child_barrier, args=(segment.names, 2, 2, q))
        late.start()
        procs = [*early, late]
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        results = sorted(q.get(timeout=5) for _ in range(6))
        assert results == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    finally:
        for p in early:
            if p.is_alive():
                p.kill()


def test_barrier_timeout_names_the_missing_rank_and_keeps_the_arrival(segment):
    """A rank that gives up stays arrived: a withdrawn arrival let a later barrier of
    the same count pass on a peer's arrival at the one given up."""
    seg = segment
    seg.rank(1)[RankSlot.BARRIER_ARRIVALS] = 1  # rank 1 already arrived; rank 2 never will
    b = Barrier(seg, 0)
    try:
        t0 = time.monotonic()
        with pytest.raises(BarrierTimeout) as ei:
            b.wait(timeout=0.3)
        assert time.monotonic() - t0 < 5
        assert int(seg.ranks[0, RankSlot.BARRIER_ARRIVALS]) == 1  # not withdrawn
        seg.rank(2)[RankSlot.BARRIER_ARRIVALS] = 1  # the late rank passes on it
        late = Barrier(seg, 2)
        try:
            assert late.wait(timeout=5, generation=1) == 1
        finally:
            late.close()
        with pytest.raises(BarrierTimeout, match=r"\(generation 2\)"):  # the next is 2
            b.wait(timeout=0.1)
    finally:
        b.close()
    msg = str(ei.value)
    assert "rank 2" in msg and "rank 1 " not in msg


def test_barrier_generations_of_another_kind_never_count(segment):
    """Generations named by the caller: an arrival at an even (clear) generation never
    satisfies an odd (start-up) one; re-entering a generation reached does not arrive
    twice."""
    seg = segment
    for r in (1, 2):
        seg.rank(r)[RankSlot.BARRIER_ARRIVALS] = 2
    b = Barrier(seg, 0)
    try:
        with pytest.raises(BarrierTimeout, match="rank 1 .*rank 2 "):
            b.wait(timeout=0.2, generation=3)
        assert b.reached == 3
        assert b.wait(timeout=0.2, generation=2) == 2  # the others are there
        assert b.reached == 3  # never lowered
        with pytest.raises(ValueError):
            b.wait(timeout=0.2, generation=0)
    finally:
        b.close()


def test_barrier_aborts_when_a_participant_failed(segment):
    seg = segment
    seg.rank(2)[RankSlot.STATE] = RankState.FAILED
    b = Barrier(seg, 0)
    try:
        t0 = time.monotonic()
        with pytest.raises(BarrierAborted, match="rank 2 is FAILED"):
            b.wait(timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        b.close()


def test_barrier_aborts_on_stale_heartbeat(segment):
    seg = segment
    seg.rank(1)[RankSlot.HEARTBEAT_NS] = now_ns() - 10 * 10**9
    b = Barrier(seg, 0, stale_after_s=1.0)
    try:
        with pytest.raises(BarrierAborted, match="rank 1 has not beaten"):
            b.wait(timeout=30)
    finally:
        b.close()


def test_barrier_cancel(segment):
    b = Barrier(segment, 0)
    try:
        with pytest.raises(BarrierAborted, match="cancelled"):
            b.wait(timeout=30, cancelled=lambda: True)
    finally:
        b.close()


def test_barrier_completed_in_the_same_turn_as_a_cancel_is_passed(segment):
    """Every participant has arrived: the barrier is passed, not withdrawn, even though
    the cancel holds (the others may already be past it)."""
    for r in (1, 2):
        segment.rank(r)[RankSlot.BARRIER_ARRIVALS] = 1
    b = Barrier(segment, 0)
    try:
        assert b.wait(timeout=30, cancelled=lambda: True) == 1
    finally:
        b.close()
    assert int(segment.ranks[0, RankSlot.BARRIER_ARRIVALS]) == 1


# ------------------------------------------------------------------ wait_with_abort


class _Boom(Exception):
    pass


def test_wait_with_abort_exits(segment):
    """Its exits and their order: a result, ready() raising, abort(), the deadline; every
    exception runs give_up() once, a result never does."""
    sem = posix_ipc.Semaphore(segment.names.wake_sem(0))
    given_up: list[str] = []

    def wait(ready, abort=None, timeout=30.0):
        return wait_with_abort(ready, deadline=time.monotonic() + timeout, wake=sem,
                               interval_s=0.01, timed_out=lambda: _Boom("timed out"),
                               abort=abort, give_up=lambda: given_up.append("x"))

    try:
        answers = iter([None, None, 7])
        assert wait(lambda: next(answers)) == 7 and given_up == []
        assert wait(lambda: 0, abort=lambda: _Boom("never asked")) == 0  # 0 is a result

        def peer_gave_up():
            raise _Boom("peer gave up")

        with pytest.raises(_Boom, match="peer gave up"):
            wait(peer_gave_up, abort=lambda: _Boom("abort"))  # ready() comes first
        assert given_up == ["x"]
        with pytest.raises(_Boom, match="rank 2 failed"):
            wait(lambda: None, abort=lambda: _Boom("rank 2 failed"), timeout=0)  # before deadline
        assert given_up == ["x", "x"]
        t0 = time.monotonic()
        with pytest.raises(_Boom, match="timed out"):
            wait(lambda: None, abort=lambda: None, timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 5
        assert given_up == ["x", "x", "x"]
    finally:
        sem.close()


def test_wait_with_abort_wakes_on_the_semaphore(segment):
    """A post ends the sleep at once: the interval (60 s here) is only the fallback."""
    waiter_sem = posix_ipc.Semaphore(segment.names.wake_sem(0))
    poster_sem = posix_ipc.Semaphore(segment.names.wake_sem(0))
    checks: list[int] = []
    flag = threading.Event()

    def ready():
        checks.append(1)
        return True if flag.is_set() else None

    def poster():
        poll_until(lambda: True if checks else None, time.monotonic() + 20)
        flag.set()
        poster_sem.release()

    t = threading.Thread(target=poster)
    t.start()
    try:
        t0 = time.monotonic()
        assert wait_with_abort(ready, deadline=time.monotonic() + 120, wake=waiter_sem,
                               interval_s=60, timed_out=lambda: _Boom("timed out")) is True
        assert time.monotonic() - t0 < 30
    finally:
        t.join(30)
        waiter_sem.close()
        poster_sem.close()


def test_layer_wait_outcomes(segment):
    """LayerProgress.wait: done, failed (TransferFailed naming the rank), a layer the load
    does not have, never started; its error messages are part of the contract."""
    writer, reader = LayerProgress(segment, 1), LayerProgress(segment, 1)
    try:
        entry = writer.begin(41, 3)
        writer.advance(entry, 1)
        reader.wait(41, 0, timeout=5)  # layer 0 is done
        with pytest.raises(ValueError, match="task 41 loads 3 layers; layer 3 does not exist"):
            reader.wait(41, 3, timeout=5)
        writer.finish(entry, ok=False)
        with pytest.raises(TransferFailed) as ei:
            reader.wait(41, 1, timeout=30)
        assert ei.value.code == ErrorCode.TRANSFER_FAILED
        assert "rank 1" in str(ei.value) and "failed after 1 of 3 layers" in str(ei.value)
        reader.wait(41, 0, timeout=5)  # a layer finished before the failure stays done
        with pytest.raises(RankTimeout, match=r"rank 1: layer 0 of task 42 not ready after "
                                              r"0\.050s \(not started\)"):
            reader.wait(42, 0, timeout=0.05)
        entry = writer.begin(43, 2)
        with pytest.raises(RankTimeout, match=r"\(0 of 2 layers done\)"):
            reader.wait(43, 1, timeout=0.05)
    finally:
        writer.close()
        reader.close()


def test_teardown_leaves_nothing(namespaces):
    names = namespaces.new()
    seg = SignalSegment.create(names, 2)
    create_semaphores(names, 2)
    assert len(names.owned_shm()) == 5  # segment + 2 x (wake, layer) semaphores
    seg.close()
    seg.unlink()
    unlink_semaphores(names, 2)
    assert names.owned_shm() == []
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.Semaphore(names.wake_sem(0))


def test_segment_mode_is_owner_only(segment):
    import os
    import stat
    mode = os.stat(f"/dev/shm{segment.names.signals}").st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_poll_until_returns_value_or_none():
    box = iter([None, None, 5])
    assert poll_until(lambda: next(box), time.monotonic() + 5) == 5
    t0 = time.monotonic()
    assert poll_until(lambda: None, time.monotonic() + 0.05) is None
    assert time.monotonic() - t0 < 2


def test_rank_views_are_u64_slots(segment):
    r = segment.rank(2)
    r[RankSlot.BYTES_EVICTED] = 2**40
    r.add(RankSlot.BYTES_EVICTED, -1)
    assert r[RankSlot.BYTES_EVICTED] == 2**40 - 1
    assert segment.ranks.dtype == np.dtype("<u8")


def test_histogram_buckets_are_log2_microseconds(segment):
    from kvswap.client.signals import HIST_BUCKETS, hist_bucket
    assert [hist_bucket(x) for x in (0, 0.9, 1, 1.9, 2, 3, 4, 1000)] == [0, 0, 1, 1, 2, 2, 3, 10]
    assert hist_bucket(1e12) == HIST_BUCKETS - 1  # the last bucket is open-ended
    st = segment.stats(1)
    st.record(1, 1, 3.0)
    st.record(1, 1, 5.0)
    snap = segment.snapshot()["ranks"][1]["histograms"]["load"]["exec"]
    assert snap["count"] == 2 and snap["sum_us"] == 8 and snap["buckets"][2:4] == [1, 1]
    assert segment.snapshot()["ranks"][0]["histograms"]["load"]["exec"]["count"] == 0


# ------------------------------------------------------------------ layout drawn = code

SIGNALS_DOC = Path(__file__).resolve().parent.parent / "docs" / "signals.md"


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


def _doc_slot_rows(section: str) -> dict[str, int]:
    """``| slot | `name` | ...`` rows of a field table (reserved slots have no name)."""
    return {name: int(slot) for slot, name in re.findall(r"^\| (\d+) \| `(\w+)` \|", section,
                                                         re.M)}


def _entry_drawing(line: str) -> dict[str, int]:
    """``task_id | round | ...`` as drawn in the module docstring: names by position."""
    cells = [c.split()[0] for c in line.split("|")]
    return {name: i for i, name in enumerate(cells) if not name.isdigit()}


def test_histogram_ops_match_the_documented_layout():
    """HIST_OPS is derived from the op table; its order is part of the shm layout."""
    doc = SIGNALS_DOC.read_text()
    m = re.search(r"histograms for ((?:`\w+`, )*`\w+`), each for two phases", doc)
    assert m, "docs/signals.md section 11 no longer lists the histogram ops"
    documented = tuple(re.findall(r"`(\w+)`", m.group(1)))
    m = re.search(r"latency histograms \(([\w, ]+)\)", signals.__doc__ or "")
    assert m, "client/signals.py no longer draws the histogram ops"
    drawn = tuple(op.strip() for op in m.group(1).split(","))
    assert HIST_OPS == documented == drawn
    assert f"tp x {STATS_BYTES // 8} u64" in doc
    assert f"{len(HIST_OPS)} × {len(HIST_PHASES)} × {HIST_SLOTS} slots" in doc


def test_slot_indexes_match_their_enums_and_the_drawn_layouts():
    header = {m.name.lower(): int(m) for m in HeaderSlot}
    rank = {m.name.lower(): int(m) for m in RankSlot}
    layer = {m.name.lower(): int(m) for m in LayerSlot}
    agree = {m.name.lower(): int(m) for m in AgreeSlot}
    assert {f.name: f.index for f in HEADER_FIELDS} == header
    assert {f.name: f.index for f in RANK_FIELDS} == rank

    # the module docstring: two columns (header, rank block), then the entry layouts
    text = signals.__doc__ or ""
    drawn_header: dict[str, int] = {}
    drawn_rank: dict[str, int] = {}
    for line in _between(text, "    namespace header ", "\nWriters").splitlines()[2:]:
        for m in re.finditer(r"(?<![\d-])(\d+)\s+([a-z_]+)", line):
            (drawn_header if m.start() < 30 else drawn_rank)[m.group(2)] = int(m.group(1))
    assert drawn_header == header and drawn_rank == rank
    lines = text.splitlines()
    layer_line = lines[lines.index("    layer tables: per rank, 64 entries x 8 u64 (4 KiB):") + 1]
    agree_line = lines[lines.index("    then agreement tables: per rank, 64 entries x 4 u64 "
                                   "(2 KiB):") + 1]
    assert _entry_drawing(layer_line) == layer and _entry_drawing(agree_line) == agree

    # docs/signals.md: the drawn boxes and every field table
    doc = SIGNALS_DOC.read_text()
    boxes = _between(doc, "header (16 slots)", "The launcher creates")
    boxed_header: dict[str, int] = {}
    boxed_rank: dict[str, int] = {}
    for line in boxes.splitlines():
        for m in re.finditer(r"\|\s*(\d+)\s*\|\s*([a-z_]+)\s*\|", line):
            (boxed_header if m.start() < 30 else boxed_rank)[m.group(2)] = int(m.group(1))
    assert boxed_header == header and boxed_rank == rank
    assert _doc_slot_rows(_between(doc, "### Namespace header", "### Rank block")) == header
    assert _doc_slot_rows(_between(doc, "### Rank block", "Not reset when")) == rank
    assert _doc_slot_rows(_between(doc, "## 8. Layer-progress", "## 9.")) == layer
    assert _doc_slot_rows(_between(doc, "## 10. Agreement", "## 11.")) == agree


def test_pid_alive_without_a_descriptor_to_spare_says_alive(monkeypatch):
    """A daemon out of descriptors (a connection flood) could not open /proc/PID/stat:
    pid_alive raised EMFILE, which killed the heartbeat thread of the rank's orphan
    check, and the rank stopped beating.  ``kill`` said the process exists: alive."""
    import builtins
    import errno
    import os

    real_open = builtins.open

    def no_descriptors(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_descriptors)
    assert signals.pid_alive(os.getpid())
    assert not signals.pid_alive(2 ** 22 + 12345)  # no such process: kill tells, no open
