"""The completion journal on its own: records, outcomes, replay data, space, marks,
and what a second incarnation (a new Journal over the same segment) sees."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from kvswap.client.errors import ErrorCode
from kvswap.client.protocol import Op
from kvswap.daemon.journal import (
    ARENA_AT,
    CID_AT,
    HEADER,
    RECORD,
    RECORDS_OFFSET,
    STATE_OFFSET,
    Journal,
    JournalFull,
    RecordState,
)
from kvswap.daemon.journal_marks import EVICTED_BYTES, EVICTED_OFFSET, MARK, MARKS_OFFSET, ROWS


@pytest.fixture
def names(namespaces):
    return namespaces.new()


def _ids(*xs):
    return np.array(xs, dtype=np.int64)


def _reopen(j: Journal, names) -> Journal:
    """What the next incarnation sees: the segment as the crashed one left it."""
    j.close(unlink=False)
    return Journal.open(names, 0, capacity=1, arena_bytes=4096)  # sizes come from the segment


def test_layout_drawn_in_the_docstring_holds():
    import kvswap.daemon.journal as mod

    import kvswap.daemon.journal_marks as marks

    assert HEADER.size == 64 and MARK.size == 24 and RECORD.size == 128
    assert MARKS_OFFSET == HEADER.size and EVICTED_OFFSET == MARKS_OFFSET + ROWS * MARK.size
    assert RECORDS_OFFSET == EVICTED_OFFSET + EVICTED_BYTES == 1073216
    assert "1073216 records" in mod.__doc__ and "64      client marks" in mod.__doc__
    assert f"{EVICTED_OFFSET - MARKS_OFFSET}    evicted" in marks.__doc__
    # the state byte sits where finish() writes it last; cid, cs and the arena offset
    # where admission reads them alone
    raw = bytearray(RECORD.size)
    RECORD.pack_into(raw, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xAB, 1, 0, 4, b"")
    assert raw[STATE_OFFSET] == 0xAB
    assert struct.unpack_from("<QQ", raw, CID_AT) == (2, 3)
    assert struct.unpack_from("<Q", raw, ARENA_AT) == (4,)


def test_outcome_survives_a_new_incarnation(names):
    j = Journal.open(names, 0, capacity=8, arena_bytes=1 << 16)
    assert not j.reused
    seq = j.admit(77, Op.EVICT, _ids(1, 2), _ids(3, 4), cid=5, cs=1)
    assert j.lookup(77) == (RecordState.ADMITTED, None)
    j.finish(seq, ErrorCode.OK, fields={"bytes": 4096, "merged": 2})
    j2 = _reopen(j, names)
    try:
        assert j2.reused and j2.capacity == 8
        state, out = j2.lookup(77)
        assert state is RecordState.DONE
        assert out.code == ErrorCode.OK and out.fields == {"bytes": 4096, "merged": 2}
        assert j2.in_doubt() == []
    finally:
        j2.close(unlink=True)
    assert not names.owned_shm()


def test_interrupted_tasks_come_back_in_admission_order_with_their_ids(names):
    j = Journal.open(names, 0, capacity=8, arena_bytes=1 << 16)
    a = j.admit(1, Op.EVICT, _ids(0, 1, 2), _ids(10, 11, 12), cid=9, cs=1)
    j.admit(2, Op.LOAD, _ids(5), _ids(2**40), layerwise=True, cid=9, cs=2)  # int64 ids
    keys = np.arange(64, dtype=np.uint8).reshape(2, 32)
    j.admit(3, Op.BACKUP, np.empty(0, np.int64), _ids(7, 8), keys=keys, cid=9, cs=3)
    j.finish(a, ErrorCode.OK, fields={"bytes": 1, "merged": 1})
    j2 = _reopen(j, names)
    try:
        doubt = j2.in_doubt()
        assert [d.task_id for d in doubt] == [2, 3]
        assert doubt[0].op is Op.LOAD and doubt[0].layerwise
        assert doubt[0].device_ids.tolist() == [5] and doubt[0].host_ids.tolist() == [2**40]
        assert doubt[1].op is Op.BACKUP and doubt[1].host_ids.tolist() == [7, 8]
        assert np.array_equal(doubt[1].keys, keys)
        assert j2.admitted == 2
    finally:
        j2.close(unlink=True)


def test_a_failure_keeps_its_code_and_message(names):
    j = Journal.open(names, 0, capacity=4, arena_bytes=4096)
    try:
        seq = j.admit(1, Op.PREFETCH, np.empty(0, np.int64), _ids(1),
                      keys=np.zeros((1, 32), np.uint8))
        j.finish(seq, ErrorCode.STORAGE_ERROR, "x" * 500)
        j.finish(seq, ErrorCode.OK)  # a second outcome is ignored: the first is what ran
        state, out = j.lookup(1)
        assert out.code == ErrorCode.STORAGE_ERROR and out.message == "x" * 66
        assert out.fields == {"count": 0}
    finally:
        j.close(unlink=True)


def test_full_journal_refuses_and_changes_nothing(names):
    j = Journal.open(names, 0, capacity=2, arena_bytes=4096)
    try:
        first = j.admit(1, Op.EVICT, _ids(1), _ids(1), cid=3, cs=1)
        j.admit(2, Op.EVICT, _ids(2), _ids(2), cid=3, cs=2)
        with pytest.raises(JournalFull) as exc:  # the oldest is still running
            j.admit(3, Op.EVICT, _ids(3), _ids(3), cid=3, cs=3)
        assert exc.value.code == ErrorCode.JOURNAL_FULL and "--journal-records" in str(exc.value)
        assert j.lookup(3) is None and j.admitted == 2
        # ids that fit the arena only once task 2's are gone (it still runs)
        j.finish(first, ErrorCode.OK)
        with pytest.raises(JournalFull, match="retry once tasks finish.*journal-mib"):
            j.admit(4, Op.EVICT, np.arange(512), np.arange(512))
    finally:
        j.close(unlink=True)


def test_arena_space_is_reused_once_tasks_finish(names):
    j = Journal.open(names, 0, capacity=64, arena_bytes=4096)
    try:
        ids = np.arange(200)  # 2 x 200 x 4 = 1600 bytes: two fit, a third does not
        s1 = j.admit(1, Op.EVICT, ids, ids)
        s2 = j.admit(2, Op.EVICT, ids, ids)
        with pytest.raises(JournalFull):
            j.admit(3, Op.EVICT, ids, ids)
        j.finish(s1, ErrorCode.OK)
        j.finish(s2, ErrorCode.OK)
        for task in range(3, 40):  # the ring wraps many times without losing a span
            seq = j.admit(task, Op.LOAD, ids, ids + task)
            (doubt,) = j.in_doubt()
            assert doubt.task_id == task and doubt.host_ids.tolist() == (ids + task).tolist()
            j.finish(seq, ErrorCode.OK)
        # a task that runs long pins its span: later ones may not overwrite it
        j.admit(40, Op.EVICT, ids, ids + 40)
        j.finish(j.admit(41, Op.EVICT, ids, ids), ErrorCode.OK)  # fits beside it
        with pytest.raises(JournalFull):  # would wrap onto task 40's span
            j.admit(42, Op.EVICT, ids, ids)
        (doubt,) = j.in_doubt()
        assert doubt.task_id == 40 and doubt.host_ids.tolist() == (ids + 40).tolist()
    finally:
        j.close(unlink=True)


def test_dropped_records_make_their_resends_unprovable_not_runnable(names):
    j = Journal.open(names, 0, capacity=2, arena_bytes=4096)
    try:
        for cs in (1, 2, 3):  # the third admission drops cs 1's record
            j.finish(j.admit(100 + cs, Op.EVICT, _ids(cs), _ids(cs), cid=42, cs=cs), ErrorCode.OK)
        assert j.lookup(101) is None
        assert j.forgotten(42, 1)  # was admitted: its record is gone
        assert not j.forgotten(42, 4)  # never admitted: may run
        assert not j.forgotten(43, 1)  # another client lost nothing
        assert j.forgotten(0, 0)  # a sender without cid/cs cannot be told apart
        assert j.lookup(103)[0] is RecordState.DONE
    finally:
        j.close(unlink=True)


def _drop_one_record_each(j: Journal, cids) -> None:
    """Each client admits one task (cs 1) and sees its record dropped by the next one's
    (a journal of one record)."""
    for i, cid in enumerate(cids):
        j.finish(j.admit(1000 + i, Op.EVICT, _ids(1), _ids(1), cid=cid, cs=1), ErrorCode.OK)


def test_a_client_never_dropped_stays_runnable_after_many_clients_come_and_go(names):
    """Clients far beyond the rows: a reused row's client is answered "may have run" for
    any cs, every other client exactly.  (Before, the first reused row made every
    client without a row "may have run": a fresh client's re-send of a task that never
    reached the journal got OUTCOME_UNKNOWN, for the rest of the namespace's life.)"""
    j = Journal.open(names, 0, capacity=1, arena_bytes=4096)
    try:
        # each but the last loses its record: ROWS + 300 marks, so 1 to 300 lose their rows
        churned = list(range(1, ROWS + 302))
        _drop_one_record_each(j, churned)
        fresh = 10**15 + 7
        assert not j.forgotten(fresh, 1)  # never lost a record: its re-send may run
        assert j.forgotten(1, 1) and j.forgotten(1, 99)  # row reused: anything may have run
        last = churned[-2]  # dropped by the very last admission; its row is kept
        assert j.forgotten(last, 1) and not j.forgotten(last, 2)
        j = _reopen(j, names)  # the next incarnation rebuilds the same answers
        assert not j.forgotten(fresh, 1)
        assert j.forgotten(300, 5) and not j.forgotten(last, 2)
        # a reused client that loses a record again gets no row: a new one would start
        # from this drop's cs, and an earlier message's re-send (admitted after a restart,
        # so dropped later) could fall above it and run twice
        j.finish(j.admit(5, Op.EVICT, _ids(1), _ids(1), cid=2, cs=40), ErrorCode.OK)
        j.finish(j.admit(6, Op.EVICT, _ids(1), _ids(1), cid=fresh, cs=1), ErrorCode.OK)
        j.finish(j.admit(7, Op.EVICT, _ids(1), _ids(1), cid=3, cs=1), ErrorCode.OK)
        assert all(j.forgotten(2, cs) for cs in (1, 39, 40, 41, 10**6))
        assert j.forgotten(fresh, 1) and not j.forgotten(fresh, 2)  # a row, exact
    finally:
        j.close(unlink=True)


def test_evicted_clients_are_rarely_confused_with_new_ones(names):
    """The evicted set is a Bloom filter: among 20,000 clients that never lost a record,
    after 65,536 rows were reused, almost none is taken for an evicted one (about one in
    a million expected; with 512 Kbit it was one in 42)."""
    j = Journal.open(names, 0, capacity=1, arena_bytes=4096)
    try:
        rng = np.random.default_rng(5)
        _drop_one_record_each(j, (int(c) for c in rng.integers(1, 1 << 62, ROWS + 65_536)))
        fresh = rng.integers(1, 1 << 62, 20_000)
        assert sum(j.forgotten(int(c), 1) for c in fresh) <= 2
    finally:
        j.close(unlink=True)


def test_a_segment_that_is_not_a_journal_is_replaced(names):
    from kvswap.client.shm_region import ShmRegion

    junk = ShmRegion.create(names.journal_segment(0), 8192)
    junk.array(0, (8192,), np.uint8)[:] = 0xFF
    junk.close()
    j = Journal.open(names, 0, capacity=4, arena_bytes=4096)
    try:
        assert not j.reused and j.capacity == 4 and j.in_doubt() == []
        # whatever it recorded is lost: no re-send without a record may run, from any client
        assert j.forgotten(77, 1) and j.forgotten(0, 0)
        j = _reopen(j, names)  # and so for this journal's life
        assert j.reused and j.forgotten(78, 5)
    finally:
        j.close(unlink=True)
    j = Journal.open(names, 0, capacity=4, arena_bytes=4096)  # a fresh segment: exact again
    try:
        assert not j.forgotten(77, 1)
    finally:
        j.close(unlink=True)


def _old_layout_journal(names) -> None:
    """A journal of layout 1 (magic KVSJRNL1: 256 marks, no evicted set) with 3 records,
    as a daemon of an older kvswap leaves it."""
    from kvswap.client.shm_region import ShmRegion

    old = ShmRegion.create(names.journal_segment(0), 4160 + 8 * 128 + 4096)
    HEADER.pack_into(old.array(0, (64,), np.uint8), 0,
                     int.from_bytes(b"KVSJRNL1", "little"), 8, 4096, 3, 0, 24, 0, 0)
    old.close()


def test_a_replacement_cut_short_leaves_the_old_segment_for_the_next_start(names,
                                                                           monkeypatch):
    """The old segment was unlinked before its replacement was whole: a crash (or a full
    /dev/shm) in between left no segment, or one without its magic, and the next start
    took it for a rank that never had a journal, so a finished task's re-send ran again.
    The replacement is now made under another name and renamed over the old one."""
    import os

    _old_layout_journal(names)

    def killed(*_args):
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(RuntimeError, match="before the rename"):
        Journal.open(names, 0, capacity=8, arena_bytes=4096)
    monkeypatch.undo()
    j = Journal.open(names, 0, capacity=8, arena_bytes=4096)  # the next start
    try:
        assert j.forgotten(5, 1)  # it still knows it replaced a journal it could not read
    finally:
        j.close(unlink=True)


def test_a_journal_left_by_the_previous_layout_is_replaced_never_misread(names, caplog):
    """Layout 1 left by a daemon of an older kvswap: replaced with a warning, and
    re-sends are answered OUTCOME_UNKNOWN (a task the old daemon finished would
    otherwise run again)."""
    _old_layout_journal(names)
    with caplog.at_level("WARNING", logger="kvswap.daemon"):
        j = Journal.open(names, 0, capacity=8, arena_bytes=4096)
    try:
        assert not j.reused and j.in_doubt() == [] and j.lookup(1) is None
        assert j.forgotten(5, 1)
        assert "not a whole journal of this version" in caplog.text and "OUTCOME_UNKNOWN" in caplog.text
    finally:
        j.close(unlink=True)


def test_a_task_larger_than_the_whole_arena_is_invalid_not_journal_full(names):
    """JOURNAL_FULL says "retry once tasks finish": for a task that cannot fit even in
    an empty arena, no retry ever would.  Refused INVALID_TASK, naming --journal-mib,
    with nothing recorded."""
    from kvswap.client.errors import InvalidTask

    j = Journal.open(names, 0, capacity=8, arena_bytes=4096)
    try:
        big = np.arange(513, dtype=np.int64)  # 513 pairs of int32 ids: 4104 bytes
        with pytest.raises(InvalidTask, match="--journal-mib") as ei:
            j.admit(1, Op.EVICT, big, big)
        assert ei.value.code == ErrorCode.INVALID_TASK
        assert j.lookup(1) is None and j.admitted == 0
        fits = np.arange(512, dtype=np.int64)  # 4096 bytes: the whole arena, when idle
        j.finish(j.admit(2, Op.EVICT, fits, fits), ErrorCode.OK)
    finally:
        j.close(unlink=True)


def test_lookup_finds_the_newest_record_of_an_id_across_wraps_and_incarnations(names):
    j = Journal.open(names, 0, capacity=4, arena_bytes=4096)
    try:
        assert j.lookup(0) is None  # the young ring's empty slots hold id 0: no record
        # ids 10..19, each finished with its own reply; then 18 comes again (a client
        # may reuse an id after its reply) and is still running: two live records of 18
        for k, task in enumerate([*range(10, 20), 18]):
            seq = j.admit(task, Op.EVICT, _ids(k), _ids(k), cid=7, cs=k + 1)
            if k < 10:
                j.finish(seq, ErrorCode.OK, fields={"bytes": 1000 + task, "merged": 0})
        for gone in range(10, 17):  # dropped as the ring of 4 wrapped
            assert j.lookup(gone) is None
        assert j.lookup(18) == (RecordState.ADMITTED, None)  # the newest, not the one done
        assert j.lookup(19)[1].fields == {"bytes": 1019, "merged": 0}
        j = _reopen(j, names)
        assert j.lookup(18) == (RecordState.ADMITTED, None)
        assert j.lookup(17)[1].fields == {"bytes": 1017, "merged": 0}
        assert j.lookup(16) is None and j.lookup(0) is None and j.lookup(1 << 64) is None
    finally:
        j.close(unlink=True)


def test_recording_tasks_allocates_nothing_that_stays(names):
    """A rank's memory must not creep up as the ring fills: each record costs the
    segment's bytes and 8 bytes of a lookup array allocated up front, nothing more
    (an index by task id grew by ~100 bytes a record: ~1 MB for these 10,000)."""
    j = Journal.open(names, 0, capacity=65536, arena_bytes=1 << 20)
    try:
        ids = _ids(1)
        j.finish(j.admit(1, Op.EVICT, ids, ids, cid=1, cs=1), ErrorCode.OK)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for k in range(2, 10_002):
                j.finish(j.admit(1 << 40 | k, Op.EVICT, ids, ids, cid=1, cs=k), ErrorCode.OK)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 64 << 10, f"{grown} bytes kept after 10,000 records"
        assert j.lookup(1 << 40 | 10_001)[0] is RecordState.DONE
    finally:
        j.close(unlink=True)


def test_a_segment_shorter_than_a_header_is_replaced_as_damage(names):
    """A journal segment shorter than its 64-byte header (outside damage) made every
    start of the rank fail with ValueError; it is replaced, as damage."""
    from kvswap.client.shm_region import ShmRegion

    ShmRegion.create(names.journal_segment(0), 16).close()
    j = Journal.open(names, 0, capacity=4, arena_bytes=4096)
    try:
        assert j.capacity == 4 and j.forgotten(9, 1)  # what it held is lost: cautious
    finally:
        j.close(unlink=True)
