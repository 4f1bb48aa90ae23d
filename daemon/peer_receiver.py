"""The receiving half of a peer transfer: armed receives and their completion listener.

:class:`PeerReceiver` holds the receives armed on this rank (their ``peer_recv``
tasks are held RUNNING in the scheduler) and owns a ZMQ ROUTER on
``tcp://--peer-host:*``, the ticket's ``notify``: the path by which a sender on
another machine says ``begin``, ``done`` or ``abort`` (daemon/peer.py has the
whole exchange).  Its own thread owns the ROUTER; the other threads change the
table of receives under a lock and wake it through an inproc PAIR.

A receive ends exactly once, through ``on_end``: OK after ``done``;
TICKET_EXPIRED when its ticket expires before a sender began (one still waiting
for earlier tasks on its blocks: its queued task is dropped); TRANSFER_FAILED
when a sender that began goes silent for ``--peer-timeout`` or aborts; CANCELLED
on ``cancel`` before a sender began; CLEARED when a clear begins before a sender
began; SHUTTING_DOWN when the daemon stops.  Should the listener thread die, the
rank fails (``on_dead``): its receives could no longer end.

A begun receive writes through a window of its own (daemon/peer_windows.py),
named in ``begin``'s answer.  ``done`` returns it clean; any other end of a begun
receive fences it *before* ``on_end`` releases the blocks, so a sender that was
only stalled cannot write them once the engine reuses them.  A fenced receive is
kept until its sender's ``done`` (its write is over: the scratch is unmapped,
the sender told the receive had failed) or ``abort``.  A sender before protocol
1.9 would write the pool itself: its ``begin`` is refused VERSION_MISMATCH.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import zmq

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.protocol import packb
from kvswap.client.ticket import Ticket, TicketRefused
from kvswap.daemon import crashpoints
from kvswap.daemon.peer_early import EarlyBegins
from kvswap.daemon.peer_table import (KINDS, TAKEN, OnEnd, Park, Pending, RecvState, deadline_of,
                                      due_now, park, read_message)
from kvswap.daemon.peer_windows import FENCED_SINCE, OnUnsafe, PeerWindows, Window, fences

log = logging.getLogger("kvswap.daemon.peer")

class PeerReceiver:
    """The receives armed on this rank and their completion listener (own thread)."""

    def __init__(self, ctx: zmq.Context, host: str, rank: int, secret: bytes,
                 timeout_s: float, on_end: OnEnd, on_dead: OnUnsafe,
                 on_stale: Callable[[bytes], None]):
        self.rank = rank
        self._secret = secret
        self._timeout_s = timeout_s
        self._on_end = on_end
        self._on_dead = on_dead  # the listener thread died: the rank must fail
        self._on_stale = on_stale  # a waiting receive's ticket expired: drop its task
        self._clearing = ""  # set by end_armed (a clear): receives armed now end at once
        self._lock = threading.Lock()
        self._pending: dict[bytes, Pending] = {}
        self._used: dict[bytes, float] = {}  # nonce -> expiry (monotonic) of armed tickets
        self._early = EarlyBegins(rank, timeout_s, secret, self._answer)  # begins before receives
        self._refused: list[bytes] = []  # parked begins whose receive ended before ARMED
        self.windows: PeerWindows | None = None  # set while a pool is attached
        self._fenced: dict[bytes, Window] = {}  # failed receives whose sender may still write
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        self._router.bind(f"tcp://{host}:*")
        port = self._router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.endpoint = f"tcp://{host}:{port}"
        addr = f"inproc://kvswap-peer-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(addr)
        self._wake_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="peer-recv", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def expect(self, nonce: bytes, ticket: bytes, expires_ns: int, nbytes: int,
               ids: Any) -> None:
        """Record an admitted receive (I/O thread); it may not be written before
        :meth:`arm`.  A ticket is armed once: its nonce is remembered until it expires."""
        expires_at = time.monotonic() + (expires_ns - time.time_ns()) / 1e9
        with self._lock:
            if nonce in self._pending or nonce in self._used:
                raise TicketRefused(f"rank {self.rank} has armed this ticket already (a ticket "
                                    f"is used once): ask receive_into for a new one")
            self._pending[nonce] = Pending(None, ticket, expires_at, nbytes, ids)
            self._used[nonce] = expires_at
        self._wake()  # a begin that overtook this receive may be waiting for it

    def arm(self, nonce: bytes, handle: Any) -> None:
        """The receive's blocks are now held for it (a peer worker); ``handle`` is what
        ``on_end`` is called with when it ends.  During a clear it ends at once."""
        with self._lock:
            p = self._pending.get(nonce)
            clearing = self._clearing
            if p is not None:
                p.handle = handle
                p.state = RecvState.ARMED
                if clearing:  # ended before anyone can see it armed (a begin, the sweep)
                    del self._pending[nonce]
                    self._refused += [i for i, _ in p.parked]
                    p.parked = []
        if p is not None and clearing:
            self._on_end(handle, ErrorCode.CLEARED, clearing, 0)
        self._wake()

    def forget(self, nonce: bytes) -> bool:
        """Drop a receive cancelled before it was armed (its task was never started), or
        one whose admission or arming failed.  False if it had ended already."""
        with self._lock:
            p = self._pending.pop(nonce, None)
            if p is not None:
                self._refused += [i for i, _ in p.parked]
                p.parked = []
        self._wake()  # the listener refuses the begins that waited for it
        return p is not None

    def end_armed(self, why: str) -> None:
        """A clear begins (control thread): end CLEARED every receive no sender has begun,
        now and as they arm until :meth:`reopen` (each would hold the clear's drain for
        as long as its ticket lives); a begun one ends by ``done`` or --peer-timeout."""
        with self._lock:
            self._clearing = why
            armed = [n for n, p in self._pending.items() if p.state is RecvState.ARMED]
        self._end_armed(armed, ErrorCode.CLEARED, why)

    def reopen(self) -> None:
        """A pool is attached again (register after restore): receives arm as before."""
        with self._lock:
            self._clearing = ""

    def cancel(self, nonce: bytes) -> bool:
        """End an armed receive no sender has begun, CANCELLED; False otherwise."""
        return self._end_armed([nonce], ErrorCode.CANCELLED,
                               "receive cancelled before a sender began") == 1

    def _end_armed(self, nonces: list[bytes], code: ErrorCode, why: str) -> int:
        ended = []
        with self._lock:
            for nonce in nonces:
                p = self._pending.get(nonce)
                if p is not None and p.state is RecvState.ARMED:
                    del self._pending[nonce]
                    self._refused += [i for i, _ in p.parked]
                    p.parked = []
                    ended.append(p)
        for p in ended:
            self._on_end(p.handle, code, why, 0)
        if ended:
            self._wake()
        return len(ended)

    def close(self) -> None:
        """End every receive SHUTTING_DOWN and stop the listener."""
        with self._lock:
            ended, self._pending = list(self._pending.values()), {}
            self._closing = True
            for p in ended:
                p.parked = []  # the listener stops: no sender waits for an answer from it
        for p in ended:
            if p.state is RecvState.BEGUN:
                self._end_begun(None, p, ErrorCode.SHUTTING_DOWN,
                                f"rank {self.rank} is shutting down")
            elif p.state is RecvState.ARMED:
                self._on_end(p.handle, ErrorCode.SHUTTING_DOWN,
                             f"rank {self.rank} is shutting down", 0)
        self._wake()
        self._thread.join(10)
        with self._wake_lock:
            for s in (self._router, self._wake_rx, self._wake_tx):
                s.close(linger=0)

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the PAIR already holds wake-ups

    # ------------------------------------------------------------------ its thread
    def _loop(self) -> None:
        """The listener; if it ever dies, every receive of the rank would hang with its
        blocks held while the rank looked READY, so the rank fails instead."""
        try:
            self._serve()
        except BaseException as exc:
            log.exception("rank %d: the peer receiver thread died", self.rank)
            self._on_dead(f"the peer receiver thread died ({exc!r}): its receives can no "
                          f"longer end; the rank restarts")
            raise

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            with self._lock:
                if self._closing:
                    return
                now = time.monotonic()
                deadlines = [d for p in self._pending.values()
                             if (d := deadline_of(p, now)) is not None]
            deadlines += self._early.deadlines()
            wait = min(deadlines, default=time.monotonic() + 1.0) - time.monotonic()
            events = dict(poller.poll(max(0, int(wait * 1000)) + 1))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._router in events:
                for _ in range(256):
                    try:
                        ident, raw = self._router.recv_multipart(zmq.NOBLOCK)[:2]
                    except zmq.Again:
                        break
                    except ValueError:
                        continue  # a message without a body: nothing to answer
                    self._on_message(ident, raw)
            self._sweep()

    def _answer(self, ident: bytes, code: ErrorCode = ErrorCode.OK, message: str = "",
                **fields: Any) -> None:
        self._router.send_multipart([ident, packb({"code": int(code), "message": message,
                                                   **fields})])

    def _end_begun(self, nonce: bytes | None, p: Pending, code: ErrorCode, message: str) -> None:
        """End a begun receive other than by ``done``: fence its window, then release its
        blocks (kept held if the fence failed).  With ``nonce``, remember it for the
        sender's late ``done`` or ``abort``."""
        hold = False
        if p.window is not None:
            try:
                p.window.fence()
            except OSError as exc:
                hold = True
                message += (f"; its write window could not be fenced ({exc}), so its blocks "
                            f"stay held and the rank failed, to be restarted")
                log.error("rank %d: %s", self.rank, message)
            if nonce is not None and not hold:
                self._fenced[nonce] = p.window
        self._on_end(p.handle, code, message, 0, hold)

    def _late(self, ident: bytes, kind: str, nonce: bytes) -> None:
        """``done`` or ``abort`` of a receive that had failed: its sender's write is over
        (``done``: every request was applied, to scratch), tell it so."""
        w = self._fenced.pop(nonce)
        if kind == "abort":
            self._answer(ident)
            return
        w.drop()
        self._answer(ident, ErrorCode.TRANSFER_FAILED,
                     f"rank {self.rank}'s receive had already failed (the sender was silent "
                     f"for {self._timeout_s:.1f}s, --peer-timeout): its write was fenced off, "
                     f"no byte of it reached the receiver's blocks")

    def _open(self, ident: bytes, nonce: bytes, p: Pending) -> None:
        """A receive just began: give it a window, answer ``begin`` with its bases."""
        windows = self.windows
        try:
            if windows is None:
                raise OSError("no host pool is attached")
            p.window = windows.take(p.ids)
        except (OSError, KvswapError) as exc:
            with self._lock:
                mine = self._pending.pop(nonce, None) is not None
            message = f"rank {self.rank} has no write window for the receive: {exc}"
            if mine:
                self._on_end(p.handle, ErrorCode.TRANSFER_FAILED, message, 0)
            self._answer(ident, ErrorCode.TRANSFER_FAILED, message)
            return
        with self._lock:
            alive = self._pending.get(nonce) is p
        if not alive:  # close() ended it meanwhile; nobody was told the window
            p.window.release()
            self._answer(ident, ErrorCode.SHUTTING_DOWN, f"rank {self.rank} is shutting down")
            return
        crashpoints.hit("peer.begun")
        self._answer(ident, bases=p.window.bases)

    def _on_message(self, ident: bytes, raw: bytes) -> None:
        """A message from anyone who reaches the port; a malformed one is refused (its
        fields are all checked first), so only a bug raises here: it fails the rank."""
        try:
            m = read_message(raw)
        except ValueError as exc:
            self._answer(ident, ErrorCode.PROTOCOL_ERROR,
                         f"unreadable peer message: {exc} (expected a map with k, nonce, "
                         f"rank and the fields of its kind, as a kvswap sender sends)")
            return
        kind, nonce, rank = m.kind, m.nonce, m.rank
        if rank != self.rank:
            self._answer(ident, ErrorCode.TICKET_MISMATCH,
                         f"rank {rank}'s push reached rank {self.rank} (rank r sends to rank r)")
            return
        if kind not in KINDS:
            self._answer(ident, ErrorCode.PROTOCOL_ERROR, f"unknown peer message {kind!r:.40} "
                         f"(this rank knows {', '.join(KINDS)})")
            return
        if kind == "begin" and not fences(m.version):
            self._answer(ident, ErrorCode.VERSION_MISMATCH,
                         f"rank {self.rank} gives each receive a write window it can fence "
                         f"(protocol {FENCED_SINCE[0]}.{FENCED_SINCE[1]}); this sender is "
                         f"older and would write the pool itself: upgrade kvswap there")
            return
        with self._lock:
            p = self._pending.get(nonce)
            used = nonce in self._used
        if p is None and kind == "begin" and not used:
            self._early.park(ident, nonce, m.ticket, m.wait_s)
            return
        if p is None and kind in ("done", "abort") and nonce in self._fenced:
            self._late(ident, kind, nonce)
            return
        if p is None:
            self._answer(ident, ErrorCode.TICKET_MISMATCH,
                         f"rank {self.rank} has no receive waiting for this ticket: it was "
                         f"received, cancelled or expired already (a ticket is used once)")
            return
        if kind == "begin":
            self._on_begin(ident, nonce, p, m.ticket, m.wait_s)
        else:  # done or abort
            if p.state is not RecvState.BEGUN:
                self._answer(ident, ErrorCode.TICKET_MISMATCH, f"{kind} before begin")
                return
            with self._lock:
                if self._pending.pop(nonce, None) is None:  # close() ended it meanwhile
                    self._answer(ident, ErrorCode.SHUTTING_DOWN,
                                 f"rank {self.rank} is shutting down")
                    return
            if kind == "abort":
                self._end_begun(None, p, ErrorCode.TRANSFER_FAILED,
                                f"the sender aborted: {m.text}")
            elif p.window is None or p.window.release():
                self._on_end(p.handle, ErrorCode.OK, "", p.nbytes)
            else:  # fenced by a detach while the sender wrote
                message = (f"rank {self.rank}'s host pool was released (clear) while the "
                           f"sender wrote: the write was fenced off")
                self._on_end(p.handle, ErrorCode.TRANSFER_FAILED, message, 0)
                self._answer(ident, ErrorCode.TRANSFER_FAILED, message)
                return
            self._answer(ident)

    def _on_begin(self, ident: bytes, nonce: bytes, p: Pending, ticket: Any,
                  wait_s: float | None = None, place: Park | None = None) -> None:
        """A begin for receive ``p`` (looked up before this): refused, parked until the
        receive arms (until just before its sender, waiting ``wait_s`` when it said so,
        gives up: :func:`park`; an early begin keeps the ``place`` it arrived with) or
        taking it.  ``p`` may have left the table since (a cancel, a clear): then it is
        refused, never parked where no sweep looks."""
        try:
            presented = Ticket.from_bytes(ticket)
            if self._secret:
                presented.verify(self._secret)
            if bytes(ticket) != p.ticket:
                raise TicketRefused(f"the ticket presented to rank {self.rank} differs from the "
                                    f"one its receive was armed with")
        except TicketRefused as exc:
            self._answer(ident, exc.code, exc.message)
            return
        orphans: list[tuple[bytes, Park]] = []
        with self._lock:
            if self._pending.get(nonce) is not p:
                refusal = "the receive ended (cancelled, cleared or expired) before this begin"
            elif p.state is RecvState.BEGUN:
                refusal = TAKEN
            elif p.state is RecvState.WAITING:
                p.parked.append((ident, park(time.monotonic(), self._timeout_s, wait_s)
                                 if place is None else place))
                log.info("rank %d: a begin waits for its receive (earlier tasks on its blocks "
                         "still run)", self.rank)
                return
            else:  # ARMED: this begin takes it; begins parked before it lost the race
                refusal = ""
                orphans, p.parked = p.parked, []
                p.state = RecvState.BEGUN
                p.begun_deadline = time.monotonic() + self._timeout_s
        for other, _ in orphans:
            self._answer(other, ErrorCode.TICKET_MISMATCH, TAKEN)
        if refusal:
            self._answer(ident, ErrorCode.TICKET_MISMATCH, refusal)
            return
        self._open(ident, nonce, p)

    def _admitted(self, nonce: bytes) -> Pending | None:
        with self._lock:
            return self._pending.get(nonce)

    def _sweep(self) -> None:
        """Answer parked begins whose receive is armed or gone; end expired receives."""
        now = time.monotonic()
        for ident, nonce, ticket, p, place in self._early.due(self._admitted, now):
            self._on_begin(ident, nonce, p, ticket, place=place)
        with self._lock:
            refused, self._refused = self._refused, []
        for ident in refused:
            self._answer(ident, ErrorCode.TICKET_MISMATCH, "the receive was cancelled")
        with self._lock:
            due = due_now(self._pending, self._used, now, self._timeout_s, self.rank)
        self._end_armed(due.expired, ErrorCode.TICKET_EXPIRED,
                        "the ticket expired before a sender began")
        for nonce in due.stale:
            self._on_stale(nonce)
        for nonce, p in due.failed:
            self._end_begun(nonce, p, ErrorCode.TRANSFER_FAILED,
                            f"the sender began writing but was silent for "
                            f"{self._timeout_s:.1f}s (--peer-timeout); the blocks hold unknown "
                            f"content, and no later byte of that sender can reach them (its "
                            f"write window is fenced)")
        for ident, nonce, p in due.begun:
            self._open(ident, nonce, p)
        for ident, code, message in due.replies:
            self._answer(ident, code, message)

