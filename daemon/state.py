"""The rank daemon's state machine, published in its signal slot.

Transitions (anything else is a bug and raises):

    STARTING  -> ATTACHING | STOPPING | FAILED
    ATTACHING -> READY | PAUSED | CLEARED | STOPPING | FAILED
                 (PAUSED, CLEARED: a restarted daemon comes back in the mode its
                 namespace is in, startup.rejoin_mode)
    READY     -> PAUSED | CLEARING | ATTACHING | STOPPING | FAILED
    PAUSED    -> READY | CLEARING | ATTACHING | STOPPING | FAILED
    CLEARING  -> CLEARED | FAILED | STOPPING
    CLEARED   -> ATTACHING | STOPPING | FAILED
    STOPPING  -> STOPPED | FAILED
    FAILED    -> STOPPING   (a failed daemon can still be shut down cleanly)
"""

from __future__ import annotations

import logging
import threading

from kvswap.client.errors import ErrorCode
from kvswap.client.signals import RankSignals, RankSlot, RankState

log = logging.getLogger("kvswap.daemon.state")

S = RankState
TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    S.ABSENT: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.ATTACHING, S.STOPPING, S.FAILED}),
    S.ATTACHING: frozenset({S.READY, S.PAUSED, S.CLEARED, S.STOPPING, S.FAILED}),
    S.READY: frozenset({S.PAUSED, S.CLEARING, S.ATTACHING, S.STOPPING, S.FAILED}),
    S.PAUSED: frozenset({S.READY, S.CLEARING, S.ATTACHING, S.STOPPING, S.FAILED}),
    S.CLEARING: frozenset({S.CLEARED, S.STOPPING, S.FAILED}),
    S.CLEARED: frozenset({S.ATTACHING, S.STOPPING, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.STOPPING}),
    S.STOPPED: frozenset(),
}


class StateMachine:
    def __init__(self, signals: RankSignals):
        self._sig = signals
        self._lock = threading.Lock()
        self._state = RankState.ABSENT

    @property
    def state(self) -> RankState:
        return self._state

    def to(self, new: RankState, *, only_from: frozenset[RankState] | None = None) -> bool:
        """Move to ``new``.  With ``only_from``, do nothing (return False) unless the
        current state is in it; otherwise an illegal transition raises."""
        with self._lock:
            cur = self._state
            if only_from is not None and cur not in only_from:
                return False
            if new not in TRANSITIONS[cur]:
                raise RuntimeError(f"illegal rank state transition {cur.name} -> {new.name}")
            self._state = new
            self._sig[RankSlot.STATE] = new
        log.info("state %s -> %s", cur.name, new.name)
        return True

    def note_error(self, code: ErrorCode) -> None:
        """Record the code of a failed request in ``last_error``; the state stays.  A
        FAILED rank keeps the code it failed with, which is what an operator needs."""
        with self._lock:
            if self._state is not RankState.FAILED:
                self._sig[RankSlot.LAST_ERROR] = int(code)

    def fail(self, code: ErrorCode, why: str) -> None:
        with self._lock:
            self._sig[RankSlot.LAST_ERROR] = int(code)
            cur = self._state
            if cur not in (RankState.FAILED, RankState.STOPPED):
                self._state = RankState.FAILED
                self._sig[RankSlot.STATE] = RankState.FAILED
        log.error("FAILED [%d %s]: %s", int(code), code.name, why)
