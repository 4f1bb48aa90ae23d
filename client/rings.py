"""Shared-memory request and completion rings between a TransferClient and a rank.

Why: a round trip over ZeroMQ costs two ZeroMQ I/O threads and their wake-ups on
each side besides the work itself.  A ring in shared memory costs a copy into
it and, only when the reader sleeps, one byte written to a FIFO (the doorbell).
Protocol: docs/protocol.md section 15.

One segment per rank, ``/kvswap.<ns>.ring.r<rank>`` (mode 0600), created by the
rank's daemon when it binds (a restarted daemon creates it afresh, with its new
epoch) and unlinked when it stops::

    offset     size   field
    0          8      magic b"KVSRING\\x01"
    8          4      u32 layout version (1)
    12         4      u32 rank
    16         8      u64 epoch of the daemon that created it
    24         8      u64 capacity C of each data area (a power of two)
    32         8      u64 owner: pid << 40 | client token, 0 when free (compare-and-swap)
    40         24     reserved
    64         128    request ring control     (client writes records, daemon reads)
    192        128    completion ring control  (daemon writes records, client reads)
    320        3776   reserved (data areas start on a page)
    4096       C      request ring data
    4096 + C   C      completion ring data

    ring control block (128 bytes, head and tail on separate cache lines)
    0    u64  head   bytes ever written          writer: producer
    64   u64  tail   bytes ever consumed         writer: consumer
    72   u32  sleep  1: consumer may be asleep   set: consumer; cleared: producer (CAS)
    76   u32  want   1: producer found it full   set: producer; cleared: consumer (CAS)

    record at data + head % C, 8-byte aligned, never across the end of the area
    u32 size | u16 nframes | u16 kind (0 message, 1 wrap: skip to the start) |
    u32 length x nframes | frames back to back | zero padding to 8 bytes

A record is one ZeroMQ message's frames (a request: header and id frames; a
reply: one frame), at most C / 2 bytes and 512 frames; anything larger goes over
ZeroMQ.  Each ring has one producer and one consumer thread (the single-owner
rule): requests are written by whichever client thread holds the client's lock
and read by the daemon's I/O thread; completions the other way round.  The index
and flag protocol (``client/_ringops.c``, C for its memory fences) never loses a
wake-up: a consumer sets ``sleep`` and looks at ``head`` once more before it
blocks on its bell; a producer publishes ``head`` and then rings if it can clear
``sleep``.  ``want`` does the same for a producer that found the ring full: the
consumer rings the producer's side when it has made room.

Either process can store anything in the segment (same uid), so ``put`` and ``get``
check the indices (multiples of 8, ``0 <= head - tail <= C``) before they touch the
data area and raise :data:`RingCorrupt` otherwise: the consumer drops every unread
byte (``tail = head``), the producer writes nothing.  A producer whose ``put``
raises stops writing to that ring (the client: ZeroMQ for that rank until the
rank restarts; the daemon: it shuts both rings, :meth:`Ring.shut`).  A wake-up
lost to another process's store (``sleep`` cleared, or a client killed between
``put`` and its bell) is found by the daemon's I/O loop, which also looks at the
request ring when its poll times out, at least once a second; and a client that
takes over a dead owner's claim rings the request bell once.

Doorbells are FIFOs in the run dir, ``rank<r>.rq.bell`` (the daemon waits on it)
and ``rank<r>.cq.bell`` (the client waits on it), created by the daemon.  One
client at a time owns a rank's rings: it claims the owner word, and a claim
whose pid is gone is taken over; other clients use ZeroMQ.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import posix_ipc

from kvswap.client import _ringops
from kvswap.client.naming import Names
from kvswap.client.shm_region import ShmRegion, unlink_shm
from kvswap.client.signals import pid_alive

RingCorrupt = _ringops.RingCorrupt  # a record that breaks the format (the ring is emptied)

MAGIC = b"KVSRING\x01"
LAYOUT_VERSION = 1
DEFAULT_CAPACITY = 1 << 20  # bytes of each data area: 1 MiB, records up to 512 KiB
MAX_RECORD_FRAMES = 512
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, rank, epoch, capacity, owner
OWNER_OFFSET = 32
REQUEST_CTL = 64
COMPLETION_CTL = 192
DATA_OFFSET = 4096
CTL_BYTES = 128
_OWNER_BITS = 40


def segment_bytes(capacity: int) -> int:
    return DATA_OFFSET + 2 * capacity


def record_bytes(frames: Sequence[object]) -> int:
    """Bytes a record of these frames takes in a ring (header, lengths, padding)."""
    payload = 4 * len(frames)
    for f in frames:  # a loop, and len() of bytes: this runs for every message and reply
        payload += len(f) if type(f) is bytes else memoryview(f).nbytes
    return (8 + payload + 7) & ~7


def fits(frames: Sequence[object], capacity: int) -> bool:
    """Whether a message can travel as one ring record."""
    return len(frames) <= MAX_RECORD_FRAMES and record_bytes(frames) <= capacity // 2


@dataclass(frozen=True)
class Ring:
    """One direction of a segment: its control block and data area."""

    seg: object  # the writable mapping
    ctl: int
    data: int
    cap: int

    def put(self, frames: Sequence[object]) -> int:
        """Write one record: 1 if the consumer's bell must be rung, 0 if not, -1 if
        the ring is full (nothing written; the consumer rings back when it has room);
        :data:`RingCorrupt` (nothing written) if the indices are invalid or the
        consumer shut the ring: the producer must stop using it."""
        return _ringops.put(self.seg, self.ctl, self.data, self.cap, frames)

    def get(self) -> list[bytes] | None:
        """The next record's frames (copies), or None when the ring is empty;
        :data:`RingCorrupt` for a malformed record (everything unread is dropped)."""
        return _ringops.get(self.seg, self.ctl, self.data, self.cap)

    def arm(self) -> bool:
        """Announce sleep; True if the ring is empty, so the consumer may block."""
        return _ringops.arm(self.seg, self.ctl, self.data, self.cap)

    def wanted(self) -> bool:
        """True once after the producer found the ring full."""
        return _ringops.wanted(self.seg, self.ctl, self.data, self.cap)

    def shut(self) -> None:
        """Consumer: this ring will not be read again.  Every later :meth:`put`
        raises :data:`RingCorrupt` (it stores an unaligned ``tail``), so the producer
        moves to its other channel instead of writing records nobody reads."""
        _ringops.shut(self.seg, self.ctl, self.data, self.cap)


class Bell:
    """A doorbell: a FIFO; one byte in it means "look at your ring"."""

    def __init__(self, fd: int):
        self._fd = fd

    @staticmethod
    def create(path: Path) -> None:
        """Make the FIFO (mode 0600), replacing a leftover of a killed daemon."""
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)

    @classmethod
    def listen(cls, path: Path) -> "Bell":
        """The end that waits (also writable, so the FIFO never reports end-of-file)."""
        return cls(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))

    @classmethod
    def connect(cls, path: Path) -> "Bell":
        """The end that rings; OSError (ENXIO) if nobody listens."""
        return cls(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        try:
            os.write(self._fd, b"\x01")
        except BlockingIOError:
            pass  # bytes are waiting already: the reader will wake
        except OSError as exc:  # EPIPE: the listener is gone (a daemon that died)
            if exc.errno != errno.EPIPE:
                raise

    def drain(self) -> None:
        try:
            while len(os.read(self._fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RingSegment:
    """A rank's mapped ring segment: its header and both rings."""

    def __init__(self, region: ShmRegion):
        self.region = region
        buf = region._buf
        magic, version, self.rank, self.epoch, self.capacity, _ = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise ValueError(f"{region.name} is not a kvswap ring segment of layout "
                             f"{LAYOUT_VERSION} (magic {magic!r}, version {version})")
        if region.size < segment_bytes(self.capacity):
            raise ValueError(f"{region.name}: {region.size} bytes cannot hold two rings of "
                             f"{self.capacity}")
        self.request = Ring(buf, REQUEST_CTL, DATA_OFFSET, self.capacity)
        self.completion = Ring(buf, COMPLETION_CTL, DATA_OFFSET + self.capacity, self.capacity)

    @classmethod
    def create(cls, names: Names, rank: int, epoch: int,
               capacity: int = DEFAULT_CAPACITY) -> "RingSegment":
        if capacity < 4096 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= 4096, got {capacity}")
        # The rank's name is this daemon's: a predecessor's segment (kill -9) may still
        # be mapped by its client, which keeps its mapping; the name is taken over.
        unlink_shm(names.ring_segment(rank))
        region = ShmRegion.create(names.ring_segment(rank), segment_bytes(capacity),
                                  exclusive=True, populate=True)
        HEADER.pack_into(region._buf, 0, MAGIC, LAYOUT_VERSION, rank, epoch, capacity, 0)
        seg = cls(region)
        for ring in (seg.request, seg.completion):
            ring.arm()  # an idle consumer starts asleep: the first record rings
        return seg

    @classmethod
    def attach(cls, names: Names, rank: int) -> "RingSegment":
        """Map the rank's segment; posix_ipc.ExistentialError if it has none."""
        return cls(ShmRegion.attach(names.ring_segment(rank), min_size=DATA_OFFSET))

    def owner(self) -> int:
        return HEADER.unpack_from(self.region._buf, 0)[5]

    def claim(self, token: int) -> bool:
        """Own the rings (``token`` from :func:`owner_token`); a claim whose process
        is gone is taken over.  False while another live client owns them."""
        buf = self.region._buf
        for _ in range(2):
            held = self.owner()
            if held == token:
                return True
            if held and pid_alive(held >> _OWNER_BITS):
                return False
            if _ringops.swap_owner(buf, OWNER_OFFSET, held, token):
                return True
        return False

    def release(self, token: int) -> None:
        if self.region._buf is not None:
            _ringops.swap_owner(self.region._buf, OWNER_OFFSET, token, 0)

    def close(self) -> None:
        self.request = self.completion = None  # type: ignore[assignment]
        self.region.close()

    def unlink(self) -> None:
        unlink_shm(self.region.name)


def owner_token(pid: int, client_id: int) -> int:
    """A ring owner word: the pid (to detect a dead owner) and a per-client part
    (two clients of one process are different owners)."""
    return (pid << _OWNER_BITS) | (client_id & ((1 << _OWNER_BITS) - 1)) | 1


class RingUnavailable(Exception):
    """Why a client cannot use a rank's rings (it uses ZeroMQ instead)."""


class RingPeer:
    """The client's end of one rank's rings (used under the client's lock and by
    its reader thread: one producer, one consumer)."""

    def __init__(self, seg: RingSegment, token: int, tx: Bell, rx: Bell):
        self.seg = seg
        self.epoch = seg.epoch
        self._token = token
        self._tx = tx  # rings the daemon (request bell)
        self._rx = rx  # the client waits on it (completion bell)
        self._rq = seg.request
        self._cq = seg.completion

    @classmethod
    def open(cls, names: Names, rank: int, epoch: int, token: int) -> "RingPeer":
        """Attach and claim the rings of ``rank`` served at ``epoch``;
        :class:`RingUnavailable` names why not."""
        try:
            seg = RingSegment.attach(names, rank)
        except (posix_ipc.ExistentialError, ValueError) as exc:
            raise RingUnavailable(f"rank {rank} has no ring segment ({exc})") from None
        try:
            if seg.epoch != epoch:
                raise RingUnavailable(f"rank {rank}'s rings are of epoch {seg.epoch}, the "
                                      f"rank is at epoch {epoch}")
            if not seg.claim(token):
                raise RingUnavailable(f"rank {rank}'s rings are owned by pid "
                                      f"{seg.owner() >> _OWNER_BITS}")
            try:
                tx = Bell.connect(names.ring_bell(rank, "rq"))
                rx = Bell.listen(names.ring_bell(rank, "cq"))
            except OSError as exc:
                seg.release(token)
                raise RingUnavailable(f"rank {rank}'s doorbells: {exc}") from None
        except RingUnavailable:
            seg.close()
            raise
        rx.drain()
        # A previous owner killed between its put() (which cleared ``sleep``) and its
        # bell left the daemon asleep with ``sleep`` 0: none of our puts would ring.
        # One bell now makes the daemon read the ring and arm it again.
        tx.ring()
        return cls(seg, token, tx, rx)

    def fileno(self) -> int:
        return self._rx.fileno()

    def send(self, frames: Sequence[object]) -> bool:
        """Write a request; False if the ring is full (the daemon rings back);
        :data:`RingCorrupt` (nothing written) if the request ring must not be used
        again (the caller moves to ZeroMQ)."""
        rc = self._rq.put(frames)
        if rc > 0:
            self._tx.ring()
        return rc >= 0

    def receive(self, rung: bool) -> list[list[bytes]]:
        """Every completion waiting, in order (:data:`RingCorrupt` if one is malformed);
        ``rung``: the bell is readable (it is emptied)."""
        if rung:
            self._rx.drain()
        out = []
        while True:
            frames = self._cq.get()
            if frames is None:
                break
            out.append(frames)
        if out and self._cq.wanted():
            self._tx.ring()  # the daemon found the completion ring full: room now
        return out

    def arm(self) -> bool:
        """Before the reader sleeps: True if no completion is waiting."""
        return self._cq.arm()

    def close(self) -> None:
        self.seg.release(self._token)
        self._tx.close()
        self._rx.close()
        self.seg.close()
