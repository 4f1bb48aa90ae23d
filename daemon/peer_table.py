"""The receive table of a rank's peer receiver: each receive's state, and what its
listener must do about them when time passes (daemon/peer_receiver.py owns the
table under its lock and acts on :func:`due_now`'s answer outside it); and the
messages that drive it, read and checked field by field (:func:`read_message`).

A receive is WAITING (admitted; earlier tasks on its blocks still run), ARMED (its
blocks held for it; a sender may begin) or BEGUN (a sender writes through its
window).  A ``begin`` that reaches a WAITING receive is parked with a deadline
(:func:`park`): its sender waits for begin's answer only so long, so one past it
has given up, and taking it when the receive arms would open a window nobody
writes, fail the receive a timeout later and leave that window fenced for good.
The deadline falls a margin *before* the sender gives up, so the sender reads the
refusal, which names the cause ("did not arm within"), rather than its own
timeout, which reads as a dead receiver.  So a begin says how long its sender
waits (``wait``; an older sender sends none): the sender's clock starts when it
sends the begin, before this rank's can, so parking for this rank's own
``--peer-timeout`` from arrival always ended after the sender, with equal
timeouts, had given up.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from kvswap.client.errors import ErrorCode
from kvswap.client.ticket import NONCE_BYTES
from kvswap.daemon.peer_windows import Window

TAKEN = "another sender is already writing this ticket's blocks"
UNARMED = ("rank {rank}'s receive did not arm within {s:.1f}s ({why}): earlier tasks on its "
           "blocks still run; the receive stays for a sender once they end (send again)")
# How much earlier than its sender gives up a parked begin is refused (at most a quarter
# of the sender's wait): the refusal must cross the network and reach it in time.
PARK_MARGIN_S = 0.5


@dataclass(frozen=True)
class Park:
    """How long a parked begin may wait for its receive, and why that long (for the
    refusal's message)."""

    deadline: float  # monotonic
    limit_s: float
    why: str


def park(now: float, timeout_s: float, wait_s: float | None) -> Park:
    """The place of a begin parked at ``now``: this rank's ``--peer-timeout``, or less
    when its sender said it waits ``wait_s`` for the answer (the refusal must reach it
    before it gives up; a begin without ``wait``, from an older sender, waits
    ``--peer-timeout`` as before)."""
    if wait_s is not None:
        limit = wait_s - min(PARK_MARGIN_S, wait_s / 4)
        if limit < timeout_s:
            return Park(now + limit, limit, f"its sender waits {wait_s:.1f}s for begin's answer")
    return Park(now + timeout_s, timeout_s, "--peer-timeout")


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
    # begins waiting for ARMED: (ident, place); past its deadline the sender gives up
    parked: list[tuple[bytes, Park]] = field(default_factory=list)


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
            stale = [(i, place) for i, place in p.parked if place.deadline <= now]
            p.parked = [(i, place) for i, place in p.parked if place.deadline > now]
            due.replies += [(i, ErrorCode.TICKET_MISMATCH,
                             UNARMED.format(rank=rank, s=place.limit_s, why=place.why))
                            for i, place in stale]
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
    return min([place.deadline for _, place in p.parked] + ([] if mine is None else [mine]),
               default=None)


# =========================================================================== messages

KINDS = ("begin", "done", "abort")
MAX_ABORT_TEXT = 2000  # characters of an abort's message kept (it goes into the receive's error)


@dataclass(frozen=True)
class PeerMessage:
    """One message on the completion listener, its fields checked (:func:`read_message`)."""

    kind: str
    nonce: bytes
    rank: int
    ticket: Any = None  # begin: the ticket presented (Ticket.from_bytes checks it)
    version: tuple[int, int] | None = None  # begin: the sender's protocol version
    wait_s: float | None = None  # begin: how long its sender waits for the answer
    text: str = ""  # abort: why the write failed


def read_message(raw: bytes) -> PeerMessage:
    """Decode and check one message; ValueError naming the field if anything is off.

    Anyone who reaches the listener's port can send it anything, before any nonce or
    ticket is checked, so every field is checked here, once, for its type and range:
    a value that reached the code unchecked (``v: [inf, 0]``: ``int(inf)`` raised
    OverflowError) killed the listener thread and with it the rank.  The fields of
    a kind this rank does not know are not read (it is refused after the rank)."""
    try:
        m = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"not msgpack ({exc!r:.200})") from None
    if not isinstance(m, dict):
        raise ValueError(f"a {type(m).__name__}, not a map")
    missing = [f for f in ("k", "nonce", "rank") if f not in m]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    kind, nonce, rank = m["k"], m["nonce"], m["rank"]
    if not isinstance(kind, str):
        raise ValueError(f"k must be a string ({', '.join(KINDS)})")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError("rank must be an integer")
    if kind == "begin":
        return PeerMessage(kind, nonce, rank, m.get("ticket"), _version(m.get("v")),
                           _wait(m.get("wait")))
    if kind == "abort":
        text = m.get("message", "")
        if not isinstance(text, str):
            raise ValueError("message must be a string")
        return PeerMessage(kind, nonce, rank, text=text[:MAX_ABORT_TEXT])
    return PeerMessage(kind, nonce, rank)


def _version(v: Any) -> tuple[int, int] | None:
    """``v`` of a begin: absent (a sender before 1.9) or [major, minor], two integers."""
    if v is None:
        return None
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise ValueError(f"v must be the sender's protocol version [major, minor] (two "
                         f"integers), got {v!r:.60}")
    return int(v[0]), int(v[1])


def _wait(w: Any) -> float | None:
    """``wait`` of a begin: absent (an older sender) or the seconds its sender waits for
    the answer, a positive finite number."""
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
        raise ValueError(f"wait must be the seconds the sender waits for begin's answer (a "
                         f"positive finite number), got {w!r:.60}")
    return float(w)
