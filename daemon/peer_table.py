"""The receive table of a rank's peer receiver: each receive's state, and what its
listener must do about them when time passes (daemon/peer_receiver.py owns the
table under its lock and acts on :func:`due_now`'s answer outside it).

A receive is WAITING (admitted; earlier tasks on its blocks still run), ARMED (its
blocks held for it; a sender may begin) or BEGUN (a sender writes through its
window).  A ``begin`` that reaches a WAITING receive is parked with a deadline:
the sender waits for begin's answer only ``--peer-timeout``, so one past it has
given up, and taking it when the receive arms would open a window nobody writes,
fail the receive a timeout later and leave that window fenced for good.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from kvswap.client.errors import ErrorCode
from kvswap.daemon.peer_windows import Window

TAKEN = "another sender is already writing this ticket's blocks"
UNARMED = ("rank {rank}'s receive did not arm within {s:.1f}s (--peer-timeout): earlier tasks "
           "on its blocks still run; the sender gave up waiting for begin's answer")

# on_end(handle, code, message, nbytes[, hold]): a receive ended (called once per receive);
# hold: its window could not be fenced, keep its blocks held.
OnEnd = Callable[..., None]


class RecvState(enum.Enum):
    WAITING = "waiting"  # admitted; earlier tasks on its blocks still run
    ARMED = "armed"  # the blocks are held for it; a sender may begin
    BEGUN = "begun"  # a sender is writing


@dataclass(eq=False)
class Pending:
    handle: Any
    ticket: bytes
    expires_at: float  # monotonic
    nbytes: int
    ids: Any  # its host blocks (np.ndarray)
    state: RecvState = RecvState.WAITING
    window: Window | None = None
    begun_deadline: float = 0.0
    # begins waiting for ARMED: (ident, deadline); past it the sender has given up
    parked: list[tuple[bytes, float]] = field(default_factory=list)


@dataclass
class Due:
    """What the listener does now, outside the lock."""

    expired: list[bytes] = field(default_factory=list)  # ARMED past the ticket's expiry
    stale: list[bytes] = field(default_factory=list)  # WAITING past it: drop the queued task
    failed: list[tuple[bytes, Pending]] = field(default_factory=list)  # BEGUN, silent: fence
    begun: list[tuple[bytes, bytes, Pending]] = field(default_factory=list)  # (ident, nonce, p)
    replies: list[tuple[bytes, ErrorCode, str]] = field(default_factory=list)  # to begins


def due_now(pending: dict[bytes, Pending], used: dict[bytes, float], now: float,
            timeout_s: float, rank: int) -> Due:
    """Advance the table to ``now`` (the caller holds its lock): forget used nonces past
    their expiry; refuse parked begins past their deadline; hand an armed receive to
    the first parked begin still waiting (refusing the others); take silent begun
    receives out of the table as failed; name the armed receives whose ticket expired
    (the caller ends them, as a cancel would), and the waiting ones (the caller drops
    their queued task: TICKET_EXPIRED now, not when the blocks free up)."""
    due = Due()
    for nonce in [n for n, exp in used.items() if exp <= now]:
        del used[nonce]
    for nonce, p in list(pending.items()):
        if p.parked and p.state is not RecvState.BEGUN:
            stale = [i for i, deadline in p.parked if deadline <= now]
            p.parked = [(i, d) for i, d in p.parked if d > now]
            due.replies += [(i, ErrorCode.TICKET_MISMATCH, UNARMED.format(rank=rank, s=timeout_s))
                            for i in stale]
        if p.state is RecvState.ARMED and p.parked:
            (first, _), *rest = p.parked
            p.parked = []
            p.state = RecvState.BEGUN
            p.begun_deadline = now + timeout_s
            due.begun.append((first, nonce, p))
            due.replies += [(i, ErrorCode.TICKET_MISMATCH, TAKEN) for i, _ in rest]
        elif p.state is RecvState.BEGUN and now >= p.begun_deadline:
            del pending[nonce]
            due.failed.append((nonce, p))
        elif p.state is RecvState.ARMED and now >= p.expires_at:
            due.expired.append(nonce)
        elif p.state is RecvState.WAITING and now >= p.expires_at:
            due.stale.append(nonce)
    return due


def deadline_of(p: Pending, now: float) -> float | None:
    """When the listener must look at ``p`` next: a begun receive's silence, an armed
    or waiting one's expiry (a waiting one past it: never again, its task is being
    dropped), its parked begins' deadlines."""
    if p.state is RecvState.BEGUN:
        mine: float | None = p.begun_deadline
    else:
        mine = None if p.state is RecvState.WAITING and p.expires_at <= now else p.expires_at
    return min([d for _, d in p.parked] + ([] if mine is None else [mine]), default=None)
