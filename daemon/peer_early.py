"""Begins that overtook their receive: a receiver's waiting room, owned by its listener
thread alone (daemon/peer_receiver.py).

``receive_into`` hands out a ticket without waiting for the receive's admission,
so a sender's ``begin`` may reach the receiver first.  Such a begin is kept until
its receive is admitted, then handled like any begin, or refused just before its
sender gives up waiting for the answer (daemon/peer_table.py :func:`park`).  A begin whose ticket
cannot be used is refused at once: not a ticket, not this nonce's, or expired (a
ticket's nonce leaves the receiver's used set at its expiry, so its late begin
looks early), or, in a namespace with a secret, not signed with it.  At most
:data:`MAX_EARLY` wait, holding at most :data:`MAX_EARLY_BYTES` of tickets: a
peer cannot make the daemon keep more, and where the namespace has a secret a
peer without it cannot take those places from real senders.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from kvswap.client.errors import ErrorCode
from kvswap.client.ticket import Ticket, TicketRefused
from kvswap.daemon.peer_table import Park, park

MAX_EARLY = 1024  # begins kept while their receive has not arrived yet
MAX_EARLY_BYTES = 64 << 20  # their tickets' bytes (a ticket is KiBs; the listener takes 16 MiB)

Answer = Callable[[bytes, ErrorCode, str], None]  # (ident, code, message)


class EarlyBegins:
    """The begins waiting for their receive (the listener thread's; no lock)."""

    def __init__(self, rank: int, timeout_s: float, secret: bytes, answer: Answer):
        self._rank = rank
        self._secret = secret
        self._timeout_s = timeout_s
        self._answer = answer
        self._waiting: dict[bytes, list[tuple[bytes, Any, Park]]] = {}  # nonce -> begins
        self._bytes = 0  # of the tickets kept

    def park(self, ident: bytes, nonce: bytes, ticket: Any, wait_s: float | None = None
             ) -> None:
        """Keep a begin until its receive is admitted, or refuse it now.  ``wait_s``: how
        long its sender waits for the answer, when the begin said so."""
        try:
            presented = Ticket.from_bytes(ticket)
            if presented.nonce != nonce:
                raise TicketRefused("the begin's nonce is not its ticket's")
            if self._secret:
                presented.verify(self._secret)
            presented.check_expiry()
        except TicketRefused as exc:
            self._answer(ident, exc.code, exc.message)
            return
        if (sum(len(v) for v in self._waiting.values()) >= MAX_EARLY
                or self._bytes + len(ticket) > MAX_EARLY_BYTES):
            self._answer(ident, ErrorCode.TICKET_MISMATCH, f"rank {self._rank} has no receive "
                         f"for this ticket, and {MAX_EARLY} begins or {MAX_EARLY_BYTES} bytes "
                         f"of tickets wait already")
            return
        self._bytes += len(ticket)
        self._waiting.setdefault(nonce, []).append(
            (ident, ticket, park(time.monotonic(), self._timeout_s, wait_s)))

    def deadlines(self) -> list[float]:
        return [place.deadline for waiting in self._waiting.values() for _, _, place in waiting]

    def due(self, admitted: Callable[[bytes], Any], now: float
            ) -> Iterator[tuple[bytes, bytes, Any, Any, Park]]:
        """The begins whose receive is now admitted, as (ident, nonce, ticket, what
        ``admitted(nonce)`` returned, place), for the caller to handle; those past
        their deadline are refused, admitted or not (their sender gives up now)."""
        for nonce in list(self._waiting):
            waiting = self._waiting.pop(nonce)
            self._bytes -= sum(len(ticket) for _, ticket, _ in waiting)
            receive = admitted(nonce)
            for ident, ticket, place in waiting:
                if receive is not None and now < place.deadline:
                    yield ident, nonce, ticket, receive, place
                elif now >= place.deadline:
                    self._answer(ident, ErrorCode.TICKET_MISMATCH,
                                 f"rank {self._rank} has no receive for this ticket after "
                                 f"{place.limit_s:.1f}s ({place.why}): no peer_recv with it "
                                 f"was admitted here (not sent yet, or refused)")
                else:
                    self._bytes += len(ticket)
                    self._waiting.setdefault(nonce, []).append((ident, ticket, place))
