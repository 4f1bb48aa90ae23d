"""The daemon's end of a rank's shared-memory rings (client/rings.py, protocol section 15).

Owned by the daemon's I/O thread, like its ROUTER: the loop registers
:meth:`RingServer.fileno` (the request doorbell) in its poller and calls
:meth:`drain` when it is readable.  Each request read off the ring goes to the
same handler as a ZeroMQ message, ``on_request(frames, dropped, sock, signed)``,
with frames shaped like ZeroMQ's (``frames[0].bytes`` is the peer identity, the
others have ``.buffer``) and, as ``sock``, an object whose ``send_multipart``
writes the reply to the completion ring.  So validation, the journal, epochs and
replies are one code path for both transports.

A reply that finds the completion ring full waits in order in a local queue and
goes out at the next :meth:`drain`, which the client's reader triggers by ringing
the request bell once it has made room: no reply is dropped.

The loop also calls :meth:`drain` when its poll times out (at least once a second),
so a wake-up lost to another process's store costs at most that.  A completion
ring whose ``put`` raises :data:`RingCorrupt` cannot be written again by this
daemon: it shuts both rings (:meth:`RingServer._shut`) rather than retry; the
client's next ring write then fails and it uses ZeroMQ.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Sequence

from kvswap.client.errors import ErrorCode
from kvswap.client.naming import Names
from kvswap.client.protocol import encode_reply
from kvswap.client.rings import DEFAULT_CAPACITY, Bell, RingCorrupt, RingSegment, fits
from kvswap.daemon import crashpoints

log = logging.getLogger("kvswap.daemon")

RING_IDENTITY = b"\x00ring"  # the peer identity of ring requests (scopes cancel)
OnRequest = Callable[[list, int, object, bool], None]
BURST = 256  # requests served per drain() before the I/O loop looks at everything else


class _Frame:
    """A request frame read off the ring, shaped like a ``zmq.Frame``."""

    __slots__ = ("bytes",)

    def __init__(self, data: bytes):
        self.bytes = data

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.bytes)


class _CompletionSender:
    """The ``sock`` of a ring request's route: replies go to the completion ring."""

    def __init__(self, server: "RingServer"):
        self._server = server

    def send_multipart(self, frames: Sequence[object], copy: bool = False) -> None:
        self._server.send(list(frames[1:]))  # frames[0] is the identity


class RingServer:
    """Creates the rank's ring segment and doorbells; serves requests from them."""

    def __init__(self, names: Names, rank: int, epoch: int, on_request: OnRequest,
                 capacity: int = DEFAULT_CAPACITY):
        self.rank = rank
        self._on_request = on_request
        self._rq_path = names.ring_bell(rank, "rq")
        self._cq_path = names.ring_bell(rank, "cq")
        self._seg = RingSegment.create(names, rank, epoch, capacity)
        try:
            Bell.create(self._rq_path)
            Bell.create(self._cq_path)
            self._rx = Bell.listen(self._rq_path)
            self._self_ring = Bell.connect(self._rq_path)
            self._tx = Bell.listen(self._cq_path)  # read/write: writable with no client
        except BaseException:
            self._unlink()
            raise
        self._sender = _CompletionSender(self)
        self._backlog: collections.deque[list] = collections.deque()  # replies not written yet
        self._bell_owed = False  # a reply was written while the client's reader slept
        self.read = 0  # requests read (for tests and stats)
        self.shut_why: str | None = None  # set once the rings are shut (_shut)
        self.dropped = 0  # replies dropped because the rings are shut

    def fileno(self) -> int:
        """The request doorbell: readable when the client rang."""
        return self._rx.fileno()

    def drain(self) -> None:
        """Serve the requests on the ring, then sleep-arm it (I/O thread).  At most
        :data:`BURST` per call, like the ROUTER's reads, so replies and the other
        sockets are not starved; with more waiting it rings its own bell, so the
        loop comes back at once.  Once the rings are shut it reads nothing."""
        self._rx.drain()
        self._flush()
        rq = self._seg.request
        for _ in range(BURST):
            if self.shut_why is not None:  # a reply just shut them: read no further
                return
            try:
                frames = rq.get()
            except RingCorrupt as exc:
                log.error("rank %d: malformed record on the request ring: %s", self.rank, exc)
                self.send([encode_reply(None, self.rank, ErrorCode.PROTOCOL_ERROR,
                                        f"malformed ring record: {exc}")])
                continue
            if frames is None:
                if rq.wanted():
                    self._tx.ring()  # the client found the request ring full: room now
                if rq.arm():
                    return
                continue
            self.read += 1
            crashpoints.hit("ring.read")
            self._on_request([_Frame(RING_IDENTITY), *map(_Frame, frames)], 0, self._sender,
                             False)
        self._self_ring.ring()

    def send(self, frames: list) -> None:
        """Write one reply, or queue it behind those waiting for room."""
        if not fits(frames, self._seg.capacity):  # no reply is near half a ring
            log.error("rank %d: a reply of %d bytes does not fit the completion ring; "
                      "dropped (the request's deadline covers it)", self.rank,
                      sum(len(memoryview(f)) for f in frames))
            return
        if self._backlog or not self._put(frames):
            self._backlog.append(frames)

    def _put(self, frames: list) -> bool:
        """Write one reply; False if the completion ring is full.  True also when the
        reply is dropped because the rings are shut: nothing then waits for room
        that would never come."""
        if self.shut_why is None:
            try:
                rc = self._seg.completion.put(frames)
            except RingCorrupt as exc:
                self._shut(f"the completion ring is corrupt ({exc})")
            else:
                if rc > 0:
                    self._bell_owed = True
                return rc >= 0
        self.dropped += 1
        return True

    def _shut(self, why: str) -> None:
        """Stop serving the rings, for good (until this daemon is replaced).

        Another process wrote the completion ring's indices, so this daemon cannot
        write a reply there without trusting them (the producer never repairs an
        index the consumer may also have seen).  Retrying would fail at every
        reply; serving requests whose replies are dropped would leave the client
        waiting out every deadline.  So the request ring is shut too: the client's
        next write fails and it moves to ZeroMQ (docs/protocol.md section 15).
        Requests left in the ring and replies not written end at their deadlines."""
        self.shut_why = why
        self._seg.request.shut()
        log.error("rank %d: %s; both shared-memory rings are shut: replies to ring "
                  "requests are dropped (their deadlines cover them) and the client "
                  "moves to ZeroMQ at its next request", self.rank, why)

    def publish(self) -> None:
        """Ring the completion bell if a reply written since the last call found the
        client's reader asleep (the I/O loop calls this once per round)."""
        if self._bell_owed:
            self._bell_owed = False
            self._tx.ring()

    def _flush(self) -> None:
        while self._backlog and self._put(self._backlog[0]):
            self._backlog.popleft()

    def close(self) -> None:
        """Release the segment and the doorbells (teardown)."""
        if self._backlog:
            log.warning("rank %d: %d ring replies never found room", self.rank,
                        len(self._backlog))
        if self.dropped:
            log.warning("rank %d: %d ring replies dropped after the rings were shut",
                        self.rank, self.dropped)
        for bell in (self._rx, self._self_ring, self._tx):
            bell.close()
        self._unlink()

    def _unlink(self) -> None:
        self._seg.unlink()
        self._seg.close()
        for path in (self._rq_path, self._cq_path):
            path.unlink(missing_ok=True)
