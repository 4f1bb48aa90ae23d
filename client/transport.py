"""How a TransferClient's messages reach each rank: its shared-memory rings or its
ZeroMQ DEALER (docs/protocol.md sections 1 and 15).

:class:`Transport` owns both kinds of channel to every rank.  Sending happens on
whichever thread holds the client's lock (a submitting thread, or the reader
thread pumping a backlog); receiving on the reader thread only, which waits on
:meth:`Transport.fds` with ``select.poll`` and never touches a ZeroMQ socket
while another thread may use it: it polls the socket's ``ZMQ_FD`` and reads
under the lock.  ``ZMQ_FD`` only signals changes, so a send that finds a reply
already waiting says so (``send`` notes it; :meth:`Transport.take_look` tells
the caller to wake the reader).

A message goes over the ring when the client was made with ``path="ring"``, the
rank's daemon serves rings at the rank's epoch, this client owns them, and the
message fits one record; otherwise over ZeroMQ.  Which channel a rank may use
*now* is the dispatcher's choice (it keeps one rank's messages in order across
the two): :meth:`channel` only says which one the message wants.

A request ring whose write raises :data:`RingCorrupt` (another process wrote its
indices, or the daemon shut it) is not written again: the rank's messages want
ZeroMQ until it restarts (:meth:`reconnect`), the one that hit the error included
(:meth:`send` returns False, so the dispatcher keeps it in the rank's backlog), and
the completion ring is still read for the replies the ring owes.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from typing import Callable, Sequence

import zmq

from kvswap.client.auth import AuthFailed, sign, verify
from kvswap.client.errors import KvswapError
from kvswap.client.naming import Names
from kvswap.client.protocol import Reply, decode_reply
from kvswap.client.rings import RingCorrupt, RingPeer, RingUnavailable, fits, owner_token

log = logging.getLogger("kvswap.client")

_RING_RETRY_S = 0.5  # a rank without usable rings is looked at again this often


class Channel(enum.Enum):
    RING = "ring"
    ZMQ = "zmq"


class PathChoice(str, enum.Enum):
    """The ``path`` option of a TransferClient."""

    RING = "ring"  # shared-memory rings where possible, ZeroMQ for the rest
    ZMQ = "zmq"  # ZeroMQ only


class Transport:
    """Every channel of one client to every rank."""

    def __init__(self, names: Names, endpoints: Sequence[str], path: PathChoice, client_id: int,
                 rank_epoch: Callable[[int], int], secret: bytes | None = None):
        self.names = names
        self.path = path
        self._secret = secret
        self._rank_epoch = rank_epoch
        self._token = owner_token(os.getpid(), client_id)
        self.ctx = zmq.Context(1)
        self.dealers: list[zmq.Socket] = []
        for endpoint in endpoints:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            self.dealers.append(s)
        self._zmq_fds = [s.getsockopt(zmq.FD) for s in self.dealers]
        self.rings: list[RingPeer | None] = [None] * len(endpoints)
        self._retry_at = [0.0] * len(endpoints)
        self._why: list[str] = [""] * len(endpoints)  # why a rank has no ring (logged once)
        self._abandoned = [False] * len(endpoints)  # its request ring failed a write (send)
        self._look = False  # see take_look
        # Replies dropped for failing the signature check (tcp://) since the last one
        # that passed it, and the last reason; read by the client for a deadline's error
        # (reader thread, under its lock).  A stray packet is forgotten at the next good
        # reply, so it cannot be blamed for a later, unrelated deadline.
        self.bad_signatures = 0
        self.bad_signature_why = ""

    # ------------------------------------------------------------------ sending
    def channel(self, frames: Sequence[object], rank: int) -> Channel:
        """The channel this message wants to ``rank``."""
        if (self.path is PathChoice.RING and not self._abandoned[rank]
                and self._ring(rank) is not None):
            peer = self.rings[rank]
            assert peer is not None
            if fits(frames, peer.seg.capacity):
                return Channel.RING
        return Channel.ZMQ

    def send(self, frames: list, rank: int, channel: Channel) -> bool:
        """Send on ``channel``; False if not sent now: the ring is full (the daemon
        rings back when it has room), or it failed the write (it is abandoned, and
        :meth:`take_look` makes the reader send the message again, over ZeroMQ)."""
        if channel is Channel.RING:
            peer = self.rings[rank]
            assert peer is not None
            try:
                return peer.send(frames)
            except RingCorrupt as exc:
                self._abandoned[rank] = True
                self._look = True
                log.error("rank %d: its request ring cannot be written (%s): ZeroMQ until "
                          "the rank restarts; requests still in the ring end at their "
                          "deadlines", rank, exc)
                return False
        if self._secret is not None:
            frames = sign(self._secret, frames)
        sock = self.dealers[rank]
        sock.send_multipart(frames, copy=False)
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._look = True  # the send may have consumed the FD's signal
        return True

    def take_look(self) -> bool:
        """True once after a send found a reply waiting that ZMQ_FD may not signal, or
        the channels changed (:meth:`fds`): the reader must look again at once."""
        look, self._look = self._look, False
        return look

    def _ring(self, rank: int) -> RingPeer | None:
        peer = self.rings[rank]
        if peer is not None or time.monotonic() < self._retry_at[rank]:
            return peer
        try:
            peer = RingPeer.open(self.names, rank, self._rank_epoch(rank), self._token)
        except RingUnavailable as exc:
            self._retry_at[rank] = time.monotonic() + _RING_RETRY_S
            if str(exc) != self._why[rank]:
                self._why[rank] = str(exc)
                log.info("rank %d: ZeroMQ instead of shared-memory rings: %s", rank, exc)
            return None
        self._why[rank] = ""
        self.rings[rank] = peer
        self._look = True  # the reader waits on its completion bell from now on
        return peer

    def reconnect(self, rank: int) -> None:
        """The rank restarted: its old rings are gone; the next send opens the new ones."""
        peer, self.rings[rank] = self.rings[rank], None
        if peer is not None:
            peer.close()
            self._look = True
        self._retry_at[rank] = 0.0
        self._abandoned[rank] = False

    # ------------------------------------------------------------------ receiving
    def everything(self) -> set[int]:
        """What the reader treats as ready after :meth:`take_look`."""
        return set(self.fds())

    def fds(self) -> list[int]:
        """What the reader waits on (changes after :meth:`reconnect` and ring opens)."""
        return [*self._zmq_fds, *(p.fileno() for p in self.rings if p is not None)]

    def arm(self) -> bool:
        """Before the reader sleeps: True if no ring holds a completion."""
        return all(p.arm() for p in self.rings if p is not None)

    def receive(self, ready: set[int]) -> list[Reply]:
        """Every reply waiting (reader thread, under the lock).  ``ready``: the
        descriptors poll found readable; a socket whose ZMQ_FD did not signal has
        nothing new (a send that may have taken its signal set :meth:`take_look`,
        which made the reader look at every socket: ``ready`` is then everything)."""
        out = []
        for rank, sock in enumerate(self.dealers):
            if self._zmq_fds[rank] not in ready:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._decode(frames, out, signed=self._secret is not None)
        for rank, peer in enumerate(self.rings):
            if peer is None:
                continue
            try:
                records = peer.receive(peer.fileno() in ready)
            except RingCorrupt as exc:
                log.error("rank %d: malformed completion record, unread replies dropped "
                          "(their deadlines cover them): %s", rank, exc)
                continue
            for frames in records:
                self._decode(frames, out, signed=False)
        return out

    def _decode(self, frames: list, out: list[Reply], signed: bool) -> None:
        """Append the reply in ``frames`` to ``out``, or drop it.

        A reply that fails the signature check is dropped and counted, never acted
        on: its bytes are unauthenticated, and whoever can put packets on the path
        could have written them, so failing or completing the task it names (or
        every task open on its rank) would let any such party end this client's
        tasks, where the signature is meant to let only the daemons do so.  A
        daemon's AUTH_FAILED refusal, the reply a wrong secret gets, names no task
        either (it does not echo an id it could not authenticate).  The tasks end
        at their deadline, whose error says how many replies were dropped and why."""
        try:
            if signed:
                assert self._secret is not None
                frames = verify(self._secret, frames)[1]
                self.bad_signatures = 0
            out.append(decode_reply(frames[0]))
        except AuthFailed as exc:
            self.bad_signatures += 1
            self.bad_signature_why = exc.message
            if self.bad_signatures == 1:
                log.warning("dropping a reply that fails the signature check (%s): the secret "
                            "given to TransferClient(secret=...) probably differs from the "
                            "daemons' (kvswap launch --secret-file); tasks will end at their "
                            "deadline", exc.message)
        except KvswapError as exc:
            log.warning("dropping bad reply: %s", exc)

    def close(self) -> None:
        for rank in range(len(self.rings)):
            self.reconnect(rank)
        for s in self.dealers:
            s.close(linger=0)
        self.ctx.term()
