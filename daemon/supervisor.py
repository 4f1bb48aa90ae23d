"""Per-rank process supervision: restart dead, silent or FAILED daemons with back-off.

Each rank's process moves through these states (after supervisord's):

    STARTING --(rank publishes READY, PAUSED, CLEARING or CLEARED)--> RUNNING
    STARTING/RUNNING --(process exited, heartbeat stale, or FAILED)--> BACKOFF
    STARTING/RUNNING --(exited 0: a stop it was asked for)-----------> STOPPED
    BACKOFF --(delay elapsed, retries left)--------------------------> STARTING (respawn)
    BACKOFF --(retries exhausted)------------------------------------> FATAL
    RUNNING --(up for reset_after_s)-----------------------------------> (retry count reset)

A daemon asked to stop (a client's ``shutdown``, SIGTERM or SIGINT sent to it) is
not restarted: its clean stop unlinked the host pool and the journal, and a
restart would undo what was asked.  The supervisor tells it by the exit status 0,
which only a clean stop gives; any other status is a failure, also after the rank
published STOPPING (the I/O loop's crash stops the daemon too, with status 1, and
a stop still draining at ``--drain-timeout`` ends with status 3: what it left is
not known, and a restart re-adopts and replays it).  While the rank is STOPPING
it is neither killed for going silent nor for going FAILED (STOPPING -> FAILED:
a fence at its cap, say): its stop is left to finish.  A rank STOPPED leaves its
namespace unable to serve, so the launcher then tears the namespace down
(``Launcher.supervise_once``).

A silent daemon (heartbeat older than ``stale_after_s`` while its process is
still there: wedged, or SIGSTOPped) is killed with SIGKILL first, so there is
never more than one daemon per rank.

So is a daemon that published FAILED while its process lives (a barrier that
timed out or aborted, tasks that did not drain): it would refuse every task
NOT_READY until a relaunch, and nothing in it recovers (FAILED only leads to
STOPPING).  SIGKILL, not a clean stop: a clean stop unlinks the host pool and
the completion journal, which its successor adopts instead (contents intact,
tasks in doubt replayed), and it comes back in its namespace's mode
(``startup.rejoin_mode``).  Only once the rank has served (reached READY or a
later state) under this supervisor: before that, the launcher's ``wait_ready``
fails the launch fast on a FAILED rank, with its reason.  The back-off doubles from
``backoff_s`` up to ``backoff_max_s``; ``max_retries`` consecutive failures
make the rank FATAL, which the launcher turns into a full teardown.  Each
respawned daemon increments the rank's epoch in the signal segment itself.
"""

from __future__ import annotations

import enum
import logging
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from kvswap.client.errors import code_name
from kvswap.client.signals import RankSlot, RankState, SignalSegment
from kvswap.daemon.options import Options, at_least, option, seconds, seconds_or_zero

log = logging.getLogger("kvswap.supervisor")

# States a rank settles in once attached: the process serves its namespace.
SERVED = frozenset({RankState.READY, RankState.PAUSED, RankState.CLEARING, RankState.CLEARED})


class ProcState(enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    STOPPED = "STOPPED"  # stopped on request, not restarted


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    state: ProcState = ProcState.STARTING
    retries: int = 0  # consecutive failed starts
    restarts: int = 0  # total respawns
    since: float = 0.0  # when the current state began (monotonic)
    retry_at: float = 0.0
    served: bool = False  # a daemon of this rank has served (any incarnation): FAILED restarts
    stopping: bool = False  # this process published STOPPING: left to end its stop


@dataclass
class SupervisorConfig(Options):
    """restarts of dead or silent daemons"""

    max_retries: int = option(
        5, flag="--max-restarts", parse=int, check=at_least(0),
        help="consecutive failed restarts of a rank before it is FATAL and the namespace is "
             "torn down (0: never restart)")
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stale_after_s: float = option(
        10.0, flag="--restart-stale-after", parse=float, check=seconds,
        help="a daemon whose heartbeat is older than this many seconds is killed (SIGKILL) "
             "and restarted (not kvswapd's --stale-after, which aborts barriers)")
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("backoff_s", "backoff_max_s", "reset_after_s"):  # set from Python only
            value = getattr(self, name)
            problem = (f"must be a number, got {value!r:.60}"
                       if isinstance(value, bool) or not isinstance(value, (int, float))
                       else seconds_or_zero(value))
            if problem:
                raise ValueError(f"SupervisorConfig.{name} {problem}")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"SupervisorConfig.backoff_max_s ({self.backoff_max_s}) must be at "
                             f"least backoff_s ({self.backoff_s}): the back-off only grows")


class Supervisor:
    def __init__(self, seg: SignalSegment, procs: list[subprocess.Popen],
                 spawn: Callable[[int], subprocess.Popen], cfg: SupervisorConfig):
        self.seg = seg
        self.spawn = spawn
        self.cfg = cfg
        now = time.monotonic()
        self.ranks = [RankProcess(r, p, since=now) for r, p in enumerate(procs)]

    @property
    def restarts(self) -> int:
        return sum(rp.restarts for rp in self.ranks)

    def fatal(self) -> list[RankProcess]:
        return [rp for rp in self.ranks if rp.state is ProcState.FATAL]

    def stopped(self) -> list[RankProcess]:
        return [rp for rp in self.ranks if rp.state is ProcState.STOPPED]

    def _to(self, rp: RankProcess, state: ProcState, now: float) -> None:
        log.info("rank %d: %s -> %s", rp.rank, rp.state.value, state.value)
        rp.state, rp.since = state, now

    def _failed(self, rp: RankProcess, now: float, why: str) -> None:
        if rp.retries >= self.cfg.max_retries:
            log.error("rank %d %s; %d restarts failed in a row: FATAL", rp.rank, why, rp.retries)
            self._to(rp, ProcState.FATAL, now)
            return
        delay = min(self.cfg.backoff_s * (2 ** rp.retries), self.cfg.backoff_max_s)
        log.warning("rank %d %s; restarting in %.1fs (retry %d of %d)", rp.rank, why, delay,
                    rp.retries + 1, self.cfg.max_retries)
        rp.retry_at = now + delay
        self._to(rp, ProcState.BACKOFF, now)

    def _kill(self, rp: RankProcess, why: str) -> None:
        """SIGKILL the rank's daemon and reap it, so a rank never has two daemons."""
        log.error("rank %d (pid %d) %s: killing it", rp.rank, rp.proc.pid, why)
        rp.proc.kill()
        try:
            rp.proc.wait(10)
        except subprocess.TimeoutExpired:  # stuck in the kernel: poll() reaps it later
            log.error("rank %d (pid %d) did not die within 10s of SIGKILL", rp.rank, rp.proc.pid)

    def step(self) -> None:
        """One supervision pass; cheap enough to run every 100-200 ms."""
        now = time.monotonic()
        for rp in self.ranks:
            if rp.state in (ProcState.STARTING, ProcState.RUNNING):
                # The slot is this process's only once it published its pid (until
                # then its heartbeat and state are the dead predecessor's).
                own = int(self.seg.ranks[rp.rank, RankSlot.PID]) == rp.proc.pid
                state = self.seg.state_of(rp.rank) if own else None
                if state in (RankState.STOPPING, RankState.STOPPED):
                    rp.stopping = True
                rc = rp.proc.poll()
                if rc is not None:
                    if rc == 0:
                        log.warning("rank %d stopped on request: not restarted", rp.rank)
                        self._to(rp, ProcState.STOPPED, now)
                    else:
                        self._failed(rp, now, f"exited with status {rc}")
                    continue
                age = self.seg.heartbeat_age_s(rp.rank) if own else None
                if age is not None and age > self.cfg.stale_after_s and not rp.stopping:
                    self._kill(rp, f"has not beaten for {age:.1f}s")
                    self._failed(rp, now, f"was silent for {age:.1f}s")
                    continue
                if state is RankState.FAILED and rp.served and not rp.stopping:
                    code = int(self.seg.ranks[rp.rank, RankSlot.LAST_ERROR])
                    why = f"is FAILED [{code} {code_name(code)}] (see its log)"
                    self._kill(rp, why)
                    self._failed(rp, now, why)
                    continue
                if state in SERVED:
                    rp.served = True
                    if rp.state is ProcState.STARTING:
                        self._to(rp, ProcState.RUNNING, now)
                if (rp.state is ProcState.RUNNING and rp.retries
                        and now - rp.since > self.cfg.reset_after_s):
                    rp.retries = 0
            elif rp.state is ProcState.BACKOFF and now >= rp.retry_at:
                rp.retries += 1
                rp.restarts += 1
                rp.proc = self.spawn(rp.rank)
                rp.stopping = False
                self._to(rp, ProcState.STARTING, now)

