"""The completion journal: exactly-once execution of transfers across daemon crashes.

Why it exists
-------------
The host swap pool and the device tensors both outlive a crashed daemon, so the
record of which tasks changed them must outlive it too.  Without one, a client
that never saw a task's reply re-sends it after the restart, and a task that
ran already runs again -- after later tasks may have overwritten its source.
It is then acknowledged OK with wrong bytes (issue #12's reproduction: an evict
whose reply was lost re-reads a device block that a later load had replaced).

The rule
--------
Every evict, load, backup and prefetch a rank admits gets a record here
(state ADMITTED) *before* it can run, holding what is needed to run it again:
op, block ids, storage keys.  When it finishes, its outcome is written (state
DONE, code, reply fields) *before* its dependents are released and before its
reply is sent.  Three facts follow:

1. A task whose record is DONE is never executed again: a re-send (``re``) is
   answered from the record.
2. A task whose record is ADMITTED at a crash may have run partly, but nothing
   that depends on it has run (dependents wait for the DONE record), and every
   task it depended on is DONE.  Running it again therefore reads the same
   source and writes the same destination: the restarted daemon replays every
   ADMITTED record, in admission order, before it reports READY.  Nothing new
   is admitted before the replay ends, so no task of any client can come in
   between.  (Not a prefetch or peer transfer -- other ranks or nodes took part --
   nor a backup -- its model version is not journaled: they end OUTCOME_UNKNOWN.)
3. A re-sent task with no record was never admitted (or was rejected, which
   changed nothing): it is admitted now like a new one.  The exception is a
   record that was dropped to make room, which would look the same; the
   journal remembers, per client, the highest message sequence number ``cs``
   whose record it dropped (records leave in admission order, and one client's
   messages arrive in ``cs`` order), and a re-send at or below it is answered
   OUTCOME_UNKNOWN instead of being run again.  (Rows of clients long gone are
   reused; a client whose row was reused is then answered OUTCOME_UNKNOWN for any
   re-send without a record: daemon/journal_marks.py.)

Layout (one POSIX shm segment per rank, ``/kvswap.<ns>.journal.r<rank>``)
---------------------------------------------------------------------------
::

    0       header     8 x u64: magic, capacity, arena bytes, head, tail,
                       arena head, unprovable, reserved
    64      client marks  the highest dropped cs of each client (daemon/journal_marks.py)
    1073216 records    capacity x RECORD (128 bytes), slot = seq % capacity
    ...     arena      ids and keys of ADMITTED records, a byte ring

``head`` counts records ever admitted, ``tail`` is the oldest one kept;
``unprovable`` is 1 in a journal that replaced a segment it could not read (left
by another kvswap version, or damaged): whatever that one recorded is lost, so
every re-send without a record is answered OUTCOME_UNKNOWN for this journal's
life (until a clean stop removes it);
``arena head`` counts arena bytes ever handed out.  A record's arena span is
``[arena_off, arena_off + arena_len)`` in that virtual count, stored at
``arena_off % arena bytes`` (a span never wraps: the ring skips to its start).
Only records still ADMITTED hold arena space, so the space in use runs from
the oldest ADMITTED record's span to ``arena head``.

Crash consistency: fields are written first and the ``state`` byte last, and
``head``/``tail`` move only after the record they cover is complete.  A
SIGKILL loses no store already made to shared memory, so a reader after a
crash sees each record either before or after its last update.

Who writes: the daemon's I/O thread admits and answers re-sends; the threads
that finish tasks (transfer and storage workers, the I/O thread for inline
copies, the control thread for the replay) write outcomes.  One lock
serialises them; it is never held across a copy.  Readers in other processes:
none but the daemon's next incarnation.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np
import posix_ipc

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.naming import Names
from kvswap.client.protocol import Op
from kvswap.client.shm_region import SHM_DIR, ShmRegion, unlink_shm
from kvswap.daemon.journal_marks import END as MARKS_END
from kvswap.daemon.journal_marks import MARKS_OFFSET, ClientMarks

log = logging.getLogger("kvswap.daemon")

MAGIC = int.from_bytes(b"KVSJRNL2", "little")  # 1: 256 marks of 2 fields, no evicted set
HEADER = struct.Struct("<8Q")  # magic, capacity, arena bytes, head, tail, arena head,
#                                unprovable, -
_PAIR = struct.Struct("<QQ")  # two adjacent u64 fields: head and tail; a record's cid and cs
assert MARKS_OFFSET == HEADER.size
RECORDS_OFFSET = MARKS_END

# One record.  ``state`` is written last, on its own (see "Crash consistency").
RECORD = struct.Struct(
    "<q"   # task id
    "Q"    # client id (cid), 0 = none
    "Q"    # the message's sequence number in its client (cs), 0 = none
    "Q"    # arena offset (virtual)
    "Q"    # reply field a: bytes (evict/load), count (backup/prefetch)
    "Q"    # reply field b: merged (evict/load), skipped (backup)
    "I"    # arena length
    "I"    # n: block pairs (evict/load) or keys (backup/prefetch)
    "H"    # code
    "B"    # state (RecordState)
    "B"    # op
    "B"    # layerwise
    "B"    # id width in bytes (4 or 8)
    "66s"  # failure message, truncated (MESSAGE_BYTES)
)
assert RECORD.size == 128, RECORD.size
STATE_OFFSET = 8 * 6 + 4 + 4 + 2  # byte offset of ``state`` inside a record
# finish() writes in place: reply fields a, b (QQ at 32), code (H at 56), the message
OUTCOME_AT, CODE_AT, OP_AT, MESSAGE_BYTES = 8 * 4, STATE_OFFSET - 2, STATE_OFFSET + 1, 66
CID_AT, ARENA_AT = 8, 8 * 3  # a record's cid (cs follows it) and arena offset

# Header slots.
_MAGIC, _CAPACITY, _ARENA, _HEAD, _TAIL, _ARENA_HEAD, _UNPROVABLE = range(7)

JOURNALED_OPS = (Op.EVICT, Op.LOAD, Op.BACKUP, Op.PREFETCH, Op.PEER_RECV, Op.PEER_SEND)
HOST_ONLY_OPS = frozenset({Op.BACKUP, Op.PREFETCH, Op.PEER_RECV, Op.PEER_SEND})  # no device ids
# Not run again after a crash: other ranks (a prefetch's agreed count) or another node took part.
UNREPLAYABLE_OPS = frozenset({Op.PREFETCH, Op.PEER_RECV, Op.PEER_SEND})
_OP_CODE = {op: i + 1 for i, op in enumerate(JOURNALED_OPS)}
_CODE_OP = {i: op for op, i in _OP_CODE.items()}
KEY_BYTES = 32


class RecordState(enum.IntEnum):
    EMPTY = 0
    ADMITTED = 1  # may run or have run partly; dependents not yet released
    DONE = 2  # outcome below is final


@dataclass(frozen=True)
class Outcome:
    """What a finished task answered; replayed as the reply to a re-send."""

    code: ErrorCode
    message: str
    fields: dict


@dataclass(frozen=True)
class InDoubt:
    """A task admitted by an earlier incarnation that had not finished at its crash."""

    seq: int
    task_id: int
    op: Op
    layerwise: bool
    device_ids: np.ndarray
    host_ids: np.ndarray
    keys: np.ndarray | None  # (n, 32) uint8 for backup / prefetch


def reply_fields(op: Op, a: int, b: int) -> dict:
    """The reply fields of ``op`` rebuilt from a record's two numbers."""
    if op in (Op.EVICT, Op.LOAD):
        return {"bytes": a, "merged": b}
    if op is Op.BACKUP:
        return {"count": a, "skipped": b}
    return {"bytes": a} if op in (Op.PEER_RECV, Op.PEER_SEND) else {"count": a}


def split_fields(op: Op, fields: dict) -> tuple[int, int]:
    if op in (Op.EVICT, Op.LOAD, Op.PEER_RECV, Op.PEER_SEND):
        return int(fields.get("bytes", 0)), int(fields.get("merged", 0))
    return int(fields.get("count", 0)), int(fields.get("skipped", 0))


class JournalFull(KvswapError):
    default_code = ErrorCode.JOURNAL_FULL


class Journal:
    """One rank's completion journal (see the module docstring for the rules)."""

    def __init__(self, region: ShmRegion, reused: bool):
        self._region = region
        self.reused = reused
        whole = region.array(0, (region.size,), np.uint8)
        self._buf = memoryview(whole)  # struct and bytes: ~2x faster than via the ndarray
        hdr = HEADER.unpack_from(self._buf, 0)
        self.capacity = int(hdr[_CAPACITY])
        self.arena_bytes = int(hdr[_ARENA])
        self._arena_offset = RECORDS_OFFSET + self.capacity * RECORD.size
        self._arena = whole[self._arena_offset:self._arena_offset + self.arena_bytes]
        # lookup()'s: each record's task id (its first int64), ~30 µs a search at 65,536
        # records; an index by task id grew ~100 bytes a record (6.7 MiB) as the ring filled
        self._task_ids = whole[RECORDS_OFFSET:self._arena_offset].view("<i8")[
            ::RECORD.size // 8].copy()
        self._lock = threading.Lock()
        self._marks = ClientMarks(self._buf, whole)
        self._oldest_live = self._get(_TAIL)  # the oldest maybe ADMITTED: it pins the arena

    # ------------------------------------------------------------------ open / close
    @staticmethod
    def segment_bytes(capacity: int, arena_bytes: int) -> int:
        return RECORDS_OFFSET + capacity * RECORD.size + arena_bytes

    @classmethod
    def open(cls, names: Names, rank: int, capacity: int, arena_bytes: int) -> "Journal":
        """Adopt the journal an earlier incarnation of this rank left, or create one.

        An existing journal keeps its own capacity and arena size (its records are
        laid out for them); a segment that is not a whole journal is replaced.  A new
        journal is made whole under a temporary name and renamed over the old one, so
        a crash (or a full ``/dev/shm``) while it is made leaves the old segment as it
        was, and the next start decides again: a replacement is never lost, nor its
        ``unprovable`` mark."""
        if capacity < 1 or arena_bytes < 4096:
            raise ValueError(f"journal needs >= 1 record and >= 4096 arena bytes, got "
                             f"{capacity} and {arena_bytes}")
        name = names.journal_segment(rank)
        try:
            region = ShmRegion.attach(name, min_size=HEADER.size, populate=True)  # no faults later
        except posix_ipc.ExistentialError:
            region, unprovable = None, 0
        except ValueError:  # shorter than a header: damage
            region, unprovable = None, 1
        if region is not None:
            magic, cap, arena = HEADER.unpack_from(region.array(0, (HEADER.size,), np.uint8))[:3]
            if magic == MAGIC and region.size >= cls.segment_bytes(cap, arena):
                return cls(region, reused=True)
            unprovable = int(magic != 0)  # another version's layout, or damage
            region.close()
        if unprovable:
            log.warning("rank %d: journal segment %s is not a whole journal of this version "
                        "(another kvswap's, or damaged); replaced: nothing it held is replayed, "
                        "and every re-send without a record is answered OUTCOME_UNKNOWN until "
                        "a clean stop of the rank", rank, name)
        making = name + ".new"
        unlink_shm(making)  # a crash's half-made one: start from zeros
        region = ShmRegion.create(making, cls.segment_bytes(capacity, arena_bytes))
        try:
            buf = region.array(0, (HEADER.size,), np.uint8)
            HEADER.pack_into(buf, 0, MAGIC, capacity, arena_bytes, 0, 0, 0, unprovable, 0)
            del buf
        finally:
            region.close()
        os.rename(f"{SHM_DIR}/{making.lstrip('/')}", f"{SHM_DIR}/{name.lstrip('/')}")
        region = ShmRegion.attach(name, populate=True)  # as the pool: no page fault later
        return cls(region, reused=False)

    def close(self, unlink: bool) -> None:
        """Unmap (and remove the segment on a clean stop: nothing is in doubt then)."""
        with self._lock:
            self._buf.release()
            self._buf = self._arena = None  # type: ignore[assignment]
            self._region.close()
            if unlink:
                unlink_shm(self._region.name)

    # ------------------------------------------------------------------ admission
    def admit(self, task_id: int, op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
              keys: np.ndarray | None = None, layerwise: bool = False, cid: int = 0,
              cs: int = 0) -> int:
        """Record an admitted task; return its sequence number.  Raises
        :class:`JournalFull` (changing nothing) if no record or arena space is free.
        Ids are kept as int32 when every one fits (they are validated block ids)."""
        wide = ((device_ids.dtype.itemsize > 4 or host_ids.dtype.itemsize > 4)
                and any(a.size and int(a.max()) > 0x7FFFFFFF for a in (device_ids, host_ids)))
        width, dtype = (8, "<i8") if wide else (4, "<i4")
        n = int(host_ids.shape[0])  # block pairs, or keys (one host block each)
        length = (device_ids.size + host_ids.size) * width + (keys.size if keys is not None
                                                              else 0)
        if length > self.arena_bytes:  # not JOURNAL_FULL: no retry can ever make room
            raise InvalidTask(
                f"{op.value} of {n} blocks needs {length} bytes of the completion journal's "
                f"arena for its ids and keys, and the whole arena holds {self.arena_bytes}: "
                f"split the task, or relaunch with a larger --journal-mib")
        with self._lock:
            head, tail = _PAIR.unpack_from(self._buf, _HEAD * 8)
            if head - tail == self.capacity and not self._retire_oldest(tail):
                raise JournalFull(
                    f"the completion journal holds {self.capacity} tasks and the oldest is "
                    f"still running; retry once tasks finish (or raise --journal-records)")
            off = self._arena_alloc(length, head)
            if off is None:
                raise JournalFull(
                    f"the completion journal's arena ({self.arena_bytes} bytes) has no room "
                    f"for the {length} bytes of ids and keys of this task while earlier tasks "
                    f"run; retry once tasks finish (or raise --journal-mib)")
            pos = self._arena_offset + off % self.arena_bytes
            self._buf[pos:pos + length] = b"".join(
                [a.astype(dtype, copy=False).tobytes() for a in (device_ids, host_ids)]
                + ([keys.tobytes()] if keys is not None else []))
            seq, at = head, self._at(head)
            RECORD.pack_into(self._buf, at, task_id, cid, cs, off, 0, 0, length, n, 0,
                             RecordState.EMPTY, _OP_CODE[op], layerwise, width, b"")
            self._buf[at + STATE_OFFSET] = RecordState.ADMITTED
            self._task_ids[seq % self.capacity] = task_id
            self._set(_ARENA_HEAD, off + length)
            self._set(_HEAD, head + 1)  # after the record it covers (crash consistency)
            return seq

    def finish(self, seq: int, code: ErrorCode, message: str = "",
               fields: dict | None = None) -> None:
        """Record the outcome of the task admitted as ``seq`` (any thread).  A second
        outcome for the same record is ignored: the first one is what ran."""
        with self._lock:
            if (self._buf is None or seq < self._get(_TAIL)
                    or self._state(seq) != RecordState.ADMITTED):
                return
            at = self._at(seq)
            a, b = split_fields(_CODE_OP[self._buf[at + OP_AT]], fields or {})
            text = message.encode("utf-8", "replace")[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
            struct.pack_into("<QQ", self._buf, at + OUTCOME_AT, a, b)
            struct.pack_into("<H", self._buf, at + CODE_AT, int(code))
            self._buf[at + RECORD.size - MESSAGE_BYTES:at + RECORD.size] = text
            self._buf[at + STATE_OFFSET] = RecordState.DONE

    # ------------------------------------------------------------------ re-sends
    def lookup(self, task_id: int) -> tuple[RecordState, Outcome | None] | None:
        """The state of ``task_id``'s newest record, and its outcome once DONE.  A slot
        holds the latest seq below ``head`` that maps to it; seqs before ``tail`` were
        dropped, and a young ring's slots past ``head`` map below seq 0."""
        with self._lock:  # (an id past int64 compares unequal to every slot)
            head, tail = self._get(_HEAD), self._get(_TAIL)
            seqs = [head - 1 - (head - 1 - slot) % self.capacity
                    for slot in np.flatnonzero(self._task_ids == task_id).tolist()]
            seq = max((seq for seq in seqs if seq >= tail), default=None)
            if seq is None:
                return None
            rec = RECORD.unpack_from(self._buf, self._at(seq))
            state = RecordState(rec[9])
            if state is not RecordState.DONE:
                return state, None
            msg = rec[13].rstrip(b"\0").decode("utf-8", "replace")
            return state, Outcome(ErrorCode(rec[8]), msg, reply_fields(_CODE_OP[rec[10]],
                                                                        rec[4], rec[5]))

    def forgotten(self, cid: int, cs: int) -> bool:
        """True if the record of client ``cid``'s message ``cs`` may have been dropped."""
        with self._lock:
            if self._get(_UNPROVABLE):
                return True
            if not cid or not cs:  # an anonymous sender: any drop makes it unprovable
                return self._get(_TAIL) > 0
            return self._marks.forgotten(cid, cs)

    # ------------------------------------------------------------------ replay
    def in_doubt(self) -> list[InDoubt]:
        """Records still ADMITTED, oldest first: the tasks a crash interrupted."""
        out = []
        with self._lock:
            for seq in range(self._get(_TAIL), self._get(_HEAD)):
                if self._state(seq) != RecordState.ADMITTED:
                    continue
                rec = RECORD.unpack_from(self._buf, self._at(seq))
                op, n, width = _CODE_OP[rec[10]], rec[7], rec[12]
                dtype = "<i8" if width == 8 else "<i4"
                storage = op in (Op.BACKUP, Op.PREFETCH)
                pos = rec[3] % self.arena_bytes
                n_dev = 0 if op in HOST_ONLY_OPS else n
                dev = self._arena[pos:pos + n_dev * width].view(dtype).astype(np.int64)
                pos += n_dev * width
                host = self._arena[pos:pos + n * width].view(dtype).astype(np.int64)
                pos += n * width
                keys = (self._arena[pos:pos + n * KEY_BYTES].reshape(n, KEY_BYTES).copy()
                        if storage else None)
                out.append(InDoubt(seq, rec[0], op, bool(rec[11]), dev, host, keys))
        return out

    @property
    def admitted(self) -> int:
        """Records still ADMITTED (tests and stats)."""
        with self._lock:
            return sum(1 for seq in range(self._get(_TAIL), self._get(_HEAD))
                       if self._state(seq) == RecordState.ADMITTED)

    # ------------------------------------------------------------------ internals (lock held)
    def _get(self, slot: int) -> int:
        return struct.unpack_from("<Q", self._buf, slot * 8)[0]

    def _set(self, slot: int, value: int) -> None:
        struct.pack_into("<Q", self._buf, slot * 8, value)

    def _at(self, seq: int) -> int:
        return RECORDS_OFFSET + (seq % self.capacity) * RECORD.size

    def _state(self, seq: int) -> int:
        return int(self._buf[self._at(seq) + STATE_OFFSET])

    def _retire_oldest(self, tail: int) -> bool:
        """Drop the oldest record (``tail``) if DONE, raising its client's mark to its cs."""
        if self._state(tail) == RecordState.ADMITTED:
            return False
        cid, cs = _PAIR.unpack_from(self._buf, self._at(tail) + CID_AT)
        if cid and cs:
            self._marks.raise_mark(cid, cs, tail)
        self._set(_TAIL, tail + 1)
        self._oldest_live = max(self._oldest_live, tail + 1)
        return True

    def _arena_alloc(self, length: int, end: int) -> int | None:  # end: the journal's head
        """Virtual offset of ``length`` free arena bytes that do not wrap, or None."""
        if length > self.arena_bytes:
            return None
        head = self._get(_ARENA_HEAD)
        phys = head % self.arena_bytes
        if phys + length > self.arena_bytes:
            head += self.arena_bytes - phys  # skip the end: spans never wrap
        while self._oldest_live < end and self._state(self._oldest_live) != RecordState.ADMITTED:
            self._oldest_live += 1
        used_from = (struct.unpack_from("<Q", self._buf, self._at(self._oldest_live) + ARENA_AT)[0]
                     if self._oldest_live < end else head)
        if head + length - used_from > self.arena_bytes:
            return None
        return head
