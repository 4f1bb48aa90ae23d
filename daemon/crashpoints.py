"""Fault injection: SIGKILL the daemon at a named point of a task's life.

The crash-point tests (``tests/test_exactly_once.py``) need a ``kill -9`` at an
exact moment -- after a copy but before its journal record, between two
replies -- which no outside signal can hit reliably.  A daemon started with

    KVSWAP_CRASH_AT=<point>:<n>

kills itself with SIGKILL the ``n``-th time a transfer passes ``<point>``.  It
fires once per namespace: the rank that first creates the marker file
``<run dir>/crashed-at-<point>`` dies, and every other rank and every restarted
daemon (which inherits the environment) runs on.  Without the variable every
call is one global test and a return.

Points, in the order a task passes them:

==============  =====================================================
ring.read       taken off the shared-memory request ring, not yet decoded
copy.before     admitted and journaled, no byte copied yet
copy.mid        half of the task's tensors copied
record.before   copied, outcome not yet in the journal
reply.before    outcome journaled, reply not yet sent
reply.after     reply sent (n = 2: between the first and second reply)
peer.begun      receiver: a sender's ``begin`` accepted, before answering it
peer.written    sender: the bytes written to the peer, ``done`` not yet sent
clear.drained   a clear: its rank drained, nothing released yet (n counts clears)
==============  =====================================================
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = ("ring.read", "copy.before", "copy.mid", "record.before", "reply.before", "reply.after")
PEER_POINTS = ("peer.begun", "peer.written")  # passed by peer transfers only (tests/test_peer.py)
CLEAR_POINTS = ("clear.drained",)  # passed by clears only (tests/test_faults.py)

_armed: tuple[str, int, Path] | None = None
_hits = 0


def configure(run_dir: Path) -> None:
    """Read ``KVSWAP_CRASH_AT`` (daemon start-up).  A bad value is a start-up error."""
    global _armed, _hits
    spec = os.environ.get("KVSWAP_CRASH_AT")
    _armed, _hits = None, 0
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point not in POINTS + PEER_POINTS + CLEAR_POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"KVSWAP_CRASH_AT must be POINT:N with POINT one of "
                         f"{', '.join(POINTS + PEER_POINTS + CLEAR_POINTS)} and N >= 1, got {spec!r}")
    marker = run_dir / f"crashed-at-{point}"
    if not marker.exists():
        _armed = (point, int(count), marker)


def armed(point: str) -> bool:
    return _armed is not None and _armed[0] == point


def hit(point: str) -> None:
    """Count a pass through ``point``; die on the configured one."""
    global _hits
    if _armed is None or _armed[0] != point:
        return
    _hits += 1
    if _hits != _armed[1]:
        return
    try:  # the first rank of the namespace to get here dies; the others run on
        _armed[2].touch(exist_ok=False)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
