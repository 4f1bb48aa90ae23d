"""The completion journal's client marks: which re-sends a dropped record makes unprovable.

A re-sent task with no record in the journal was either never admitted (it may
run now) or admitted and its record dropped to make room (it must not run
again: OUTCOME_UNKNOWN).  Records leave in admission order and one client's
messages arrive in ``cs`` order, so one number per client tells the two apart:
the highest ``cs`` whose record was dropped.  A re-send at or below it may have
run; one above it cannot have (daemon/journal.py, rule 3).

Clients come and go (engine restarts, tools), and nothing tells the journal
that one is gone, so its rows are reused, the one whose mark was raised longest
ago first (most likely a client that left).  A reused row's client then has no
mark, and must not look like a client that never lost a record: its cid goes
into the *evicted* set first, a Bloom filter.  A client without a row whose cid
the filter may hold is answered "may have run" for any ``cs``, for good: it never
gets a row again (a new row would start from its next drop's ``cs``, and after a
restart one client's records need not leave in ``cs`` order, so a re-send of an
earlier message could fall above it).  A false positive errs the same safe way
(never run twice), and one client's eviction no longer changes the answer for
every other client.  A client new to the journal is taken for an evicted one
about once in a million after 65,536 evictions, once in 5,000 after 262,144,
once in 42 after a million (8 Mbit, 4 bits a client; the set is never emptied:
the journal goes at the namespace's teardown or a clean stop of the rank).

Layout (inside the journal segment, at :data:`MARKS_OFFSET`)::

    0        rows     ROWS x (cid u64, highest dropped cs u64, tail when raised u64)
    24576    evicted  EVICTED_BYTES: Bloom filter of reused rows' cids, HASHES bits each

A row with cid 0 is free.  Crash consistency: an evicted cid's bits are set
before its row is overwritten, and a row is only ever given to a client that
never had one (so none of its records was dropped before: mark 0 is exact until
the record being dropped leaves, and the journal moves its tail only after the
mark is raised).  A crash between any two stores leaves answers that are exact
or too cautious, never ones that would run a task twice.  Only the journal
touches this, under its lock; the index by cid is rebuilt from the rows when a
segment is adopted.
"""

from __future__ import annotations

import struct

import numpy as np

MARKS_OFFSET = 64  # after the journal's header
ROWS = 1024
MARK = struct.Struct("<QQQ")  # client id, highest cs whose record was dropped, tail then
EVICTED_OFFSET = MARKS_OFFSET + ROWS * MARK.size
EVICTED_BYTES = 1 << 20
HASHES = 4
END = EVICTED_OFFSET + EVICTED_BYTES  # where the journal's records start
_BITS = EVICTED_BYTES * 8
# odd 64-bit multipliers: each gives one bit position from the high bits of cid * k
_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
assert len(_MULTIPLIERS) == HASHES and _BITS & (_BITS - 1) == 0
_SHIFT = 64 - (_BITS.bit_length() - 1)


def _bits(cid: int) -> list[int]:
    return [((cid * k) & 0xFFFFFFFFFFFFFFFF) >> _SHIFT for k in _MULTIPLIERS]


class ClientMarks:
    """The marks of one journal segment (``buf``: the whole segment)."""

    def __init__(self, buf: memoryview, whole: np.ndarray):
        self._buf = buf
        rows = whole[MARKS_OFFSET:EVICTED_OFFSET].view("<u8").reshape(ROWS, 3)
        self._raised = rows[:, 2]  # argmin picks the row to reuse
        self._evicted = whole[EVICTED_OFFSET:END]
        cids = rows[:, 0].tolist()
        self._row = {cid: row for row, cid in enumerate(cids) if cid}
        self._free = [row for row, cid in enumerate(cids) if not cid][::-1]

    def raise_mark(self, cid: int, cs: int, tail: int) -> None:
        """Client ``cid``'s record of message ``cs`` is dropped (``tail``: the journal's
        tail as it drops it, which orders the rows by how recently they were raised)."""
        row = self._row.get(cid)
        if row is None:
            if self._maybe_evicted(cid):
                return  # answered "may have run" for any cs already, and for good
            row = self._claim(cid)
        at = MARKS_OFFSET + row * MARK.size
        MARK.pack_into(self._buf, at, cid, max(cs, MARK.unpack_from(self._buf, at)[1]), tail)

    def forgotten(self, cid: int, cs: int) -> bool:
        """True if client ``cid``'s message ``cs`` may have had its record dropped."""
        row = self._row.get(cid)
        if row is not None:
            return cs <= MARK.unpack_from(self._buf, MARKS_OFFSET + row * MARK.size)[1]
        return self._maybe_evicted(cid)

    def _maybe_evicted(self, cid: int) -> bool:
        ev = self._evicted
        return all(ev[b >> 3] >> (b & 7) & 1 for b in _bits(cid))

    def _claim(self, cid: int) -> int:
        if self._free:
            row = self._free.pop()
        else:
            row = int(np.argmin(self._raised))
            old = MARK.unpack_from(self._buf, MARKS_OFFSET + row * MARK.size)[0]
            for b in _bits(old):  # before the row forgets it
                self._evicted[b >> 3] |= 1 << (b & 7)
            del self._row[old]
        MARK.pack_into(self._buf, MARKS_OFFSET + row * MARK.size, cid, 0, 0)
        self._row[cid] = row
        return row
