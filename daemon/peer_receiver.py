"""The receiving half of a peer transfer: armed receives and their completion listener.

:class:`PeerReceiver` holds the receives armed on this rank (their ``peer_recv``
tasks are held RUNNING in the scheduler) and owns a ZMQ ROUTER on
``tcp://--peer-host:*``, the ticket's ``notify``: the path by which a sender on
another machine says ``begin``, ``done`` or ``abort`` (daemon/peer.py has the
whole exchange).  Its own thread owns the ROUTER; the other threads change the
table of receives under a lock and wake it through an inproc PAIR.

A receive ends exactly once, through ``on_end``: OK after ``done``;
TICKET_EXPIRED when its ticket expires before a sender began; TRANSFER_FAILED
when a sender that began goes silent for ``--peer-timeout`` or aborts; CANCELLED
on ``cancel`` before a sender began; SHUTTING_DOWN when the daemon stops.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq

from kvswap.client.errors import ErrorCode
from kvswap.client.protocol import packb
from kvswap.client.ticket import Ticket, TicketRefused
from kvswap.daemon import crashpoints

MAX_EARLY = 1024  # begins a receiver keeps while their receive has not arrived yet


class RecvState(enum.Enum):
    WAITING = "waiting"  # admitted; earlier tasks on its blocks still run
    ARMED = "armed"  # the blocks are held for it; a sender may begin
    BEGUN = "begun"  # a sender is writing


# on_end(handle, code, message, nbytes): a receive ended (called once per receive).
OnEnd = Callable[[Any, ErrorCode, str, int], None]


@dataclass(eq=False)
class _Pending:
    handle: Any
    ticket: bytes
    expires_at: float  # monotonic
    nbytes: int
    state: RecvState = RecvState.WAITING
    begun_deadline: float = 0.0
    parked: list[bytes] = field(default_factory=list)  # begin idents waiting for ARMED


class PeerReceiver:
    """The receives armed on this rank and their completion listener (own thread)."""

    def __init__(self, ctx: zmq.Context, host: str, rank: int, secret: bytes,
                 timeout_s: float, on_end: OnEnd):
        self.rank = rank
        self._secret = secret
        self._timeout_s = timeout_s
        self._on_end = on_end
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._used: dict[bytes, float] = {}  # nonce -> expiry (monotonic) of armed tickets
        # begins that overtook their peer_recv (receive_into does not wait for it): nonce ->
        # [(ident, ticket, deadline)], answered once it is admitted or at the deadline
        self._early: dict[bytes, list[tuple[bytes, Any, float]]] = {}
        self._refused: list[bytes] = []  # parked begins whose receive ended before ARMED
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
    def expect(self, nonce: bytes, ticket: bytes, expires_ns: int, nbytes: int) -> None:
        """Record an admitted receive (I/O thread); it may not be written before
        :meth:`arm`.  A ticket is armed once: its nonce is remembered until it expires."""
        expires_at = time.monotonic() + (expires_ns - time.time_ns()) / 1e9
        with self._lock:
            if nonce in self._pending or nonce in self._used:
                raise TicketRefused(f"rank {self.rank} has armed this ticket already (a ticket "
                                    f"is used once): ask receive_into for a new one")
            self._pending[nonce] = _Pending(None, ticket, expires_at, nbytes)
            self._used[nonce] = expires_at
        self._wake()  # a begin that overtook this receive may be waiting for it

    def arm(self, nonce: bytes, handle: Any) -> None:
        """The receive's blocks are now held for it (a peer worker); ``handle`` is what
        ``on_end`` is called with when it ends."""
        with self._lock:
            p = self._pending.get(nonce)
            if p is not None:
                p.handle = handle
                p.state = RecvState.ARMED
        self._wake()

    def forget(self, nonce: bytes) -> None:
        """Drop a receive cancelled before it was armed (its task was never started)."""
        with self._lock:
            p = self._pending.pop(nonce, None)
            if p is not None:
                self._refused += p.parked
        self._wake()  # the listener refuses the begins that waited for it

    def cancel(self, nonce: bytes) -> bool:
        """End an armed receive no sender has begun, CANCELLED; False otherwise."""
        with self._lock:
            p = self._pending.get(nonce)
            if p is None or p.state is not RecvState.ARMED:
                return False
            del self._pending[nonce]
            self._refused += p.parked
        self._on_end(p.handle, ErrorCode.CANCELLED, "receive cancelled before a sender began",
                     0)
        return True

    def close(self) -> None:
        """End every receive SHUTTING_DOWN and stop the listener."""
        with self._lock:
            ended, self._pending = list(self._pending.values()), {}
            self._closing = True
        for p in ended:
            if p.state is not RecvState.WAITING:
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
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            with self._lock:
                if self._closing:
                    return
                deadlines = [p.begun_deadline if p.state is RecvState.BEGUN else p.expires_at
                             for p in self._pending.values() if p.state is not RecvState.WAITING]
            deadlines += [d for waiting in self._early.values() for _, _, d in waiting]
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

    def _answer(self, ident: bytes, code: ErrorCode = ErrorCode.OK, message: str = "") -> None:
        self._router.send_multipart([ident, packb({"code": int(code), "message": message})])

    def _on_message(self, ident: bytes, raw: bytes) -> None:
        try:
            m = msgpack.unpackb(raw, raw=False)
            kind, nonce, rank = m["k"], bytes(m["nonce"]), int(m["rank"])
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            self._answer(ident, ErrorCode.PROTOCOL_ERROR, f"unreadable peer message: {exc}")
            return
        if rank != self.rank:
            self._answer(ident, ErrorCode.TICKET_MISMATCH,
                         f"rank {rank}'s push reached rank {self.rank} (rank r sends to rank r)")
            return
        with self._lock:
            p = self._pending.get(nonce)
            used = nonce in self._used
        if p is None and kind == "begin" and not used:
            self._park_early(ident, nonce, m.get("ticket"))
            return
        if p is None:
            self._answer(ident, ErrorCode.TICKET_MISMATCH,
                         f"rank {self.rank} has no receive waiting for this ticket: it was "
                         f"received, cancelled or expired already (a ticket is used once)")
            return
        if kind == "begin":
            self._on_begin(ident, nonce, p, m.get("ticket"))
        elif kind in ("done", "abort"):
            if p.state is not RecvState.BEGUN:
                self._answer(ident, ErrorCode.TICKET_MISMATCH, f"{kind} before begin")
                return
            with self._lock:
                self._pending.pop(nonce, None)
            if kind == "done":
                self._on_end(p.handle, ErrorCode.OK, "", p.nbytes)
            else:
                self._on_end(p.handle, ErrorCode.TRANSFER_FAILED,
                             f"the sender aborted: {m.get('message', '')}", 0)
            self._answer(ident)
        else:
            self._answer(ident, ErrorCode.PROTOCOL_ERROR, f"unknown peer message {kind!r}")

    def _on_begin(self, ident: bytes, nonce: bytes, p: _Pending, ticket: Any) -> None:
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
        with self._lock:
            if p.state is RecvState.BEGUN:
                refusal = "another sender is already writing this ticket's blocks"
            elif p.state is RecvState.WAITING:
                p.parked.append(ident)
                return
            else:
                refusal = ""
                p.state = RecvState.BEGUN
                p.begun_deadline = time.monotonic() + self._timeout_s
        if refusal:
            self._answer(ident, ErrorCode.TICKET_MISMATCH, refusal)
            return
        crashpoints.hit("peer.begun")
        self._answer(ident)

    def _park_early(self, ident: bytes, nonce: bytes, ticket: Any) -> None:
        if sum(len(v) for v in self._early.values()) >= MAX_EARLY:
            self._answer(ident, ErrorCode.TICKET_MISMATCH, f"rank {self.rank} has no receive "
                         f"for this ticket and {MAX_EARLY} begins wait already")
            return
        self._early.setdefault(nonce, []).append(
            (ident, ticket, time.monotonic() + self._timeout_s))

    def _sweep_early(self, now: float) -> None:
        """Begins that arrived before their receive: handle them once it is admitted,
        refuse them at their deadline."""
        for nonce in list(self._early):
            with self._lock:
                p = self._pending.get(nonce)
            waiting = self._early.pop(nonce)
            if p is not None:
                for ident, ticket, _ in waiting:
                    self._on_begin(ident, nonce, p, ticket)
                continue
            for ident, ticket, deadline in waiting:
                if now >= deadline:
                    self._answer(ident, ErrorCode.TICKET_MISMATCH,
                                 f"rank {self.rank} has no receive for this ticket after "
                                 f"{self._timeout_s:.1f}s (--peer-timeout)")
                else:
                    self._early.setdefault(nonce, []).append((ident, ticket, deadline))

    def _sweep(self) -> None:
        """Answer parked begins whose receive is armed or gone; end expired receives."""
        now = time.monotonic()
        self._sweep_early(now)
        with self._lock:
            refused, self._refused = self._refused, []
        for ident in refused:
            self._answer(ident, ErrorCode.TICKET_MISMATCH, "the receive was cancelled")
        ended: list[tuple[_Pending, ErrorCode, str]] = []
        replies: list[tuple[bytes, ErrorCode, str]] = []
        with self._lock:
            for nonce in [n for n, exp in self._used.items() if exp <= now]:
                del self._used[nonce]
            for nonce, p in list(self._pending.items()):
                if p.state is RecvState.ARMED and p.parked:
                    first, *rest = p.parked
                    p.parked = []
                    p.state = RecvState.BEGUN
                    p.begun_deadline = now + self._timeout_s
                    replies.append((first, ErrorCode.OK, ""))
                    replies += [(i, ErrorCode.TICKET_MISMATCH, "another sender is already "
                                 "writing this ticket's blocks") for i in rest]
                elif p.state is RecvState.BEGUN and now >= p.begun_deadline:
                    del self._pending[nonce]
                    ended.append((p, ErrorCode.TRANSFER_FAILED,
                                  f"the sender began writing but was silent for "
                                  f"{self._timeout_s:.1f}s (--peer-timeout); the blocks hold "
                                  f"unknown content"))
                elif p.state is RecvState.ARMED and now >= p.expires_at:
                    del self._pending[nonce]
                    ended.append((p, ErrorCode.TICKET_EXPIRED,
                                  "the ticket expired before a sender began"))
        for p, code, message in ended:
            self._on_end(p.handle, code, message, 0)
        for ident, code, message in replies:
            if code == ErrorCode.OK:
                crashpoints.hit("peer.begun")
            self._answer(ident, code, message)
