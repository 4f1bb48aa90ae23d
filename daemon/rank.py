"""This rank's identity and the shared-memory state every part of the daemon
writes through: the rank's slot in the signal segment, its state machine, its
statistics, layer progress and agreement slots, and the heartbeat thread.

:class:`RankContext` is opened once at start and closed last; every attribute
is set in ``__init__`` and never rebound, so any thread may read it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from kvswap.client.errors import ErrorCode, KvswapError, NotReady
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.naming import Names
from kvswap.client.signals import (
    HeaderSlot,
    RankSignals,
    RankSlot,
    RankState,
    SignalSegment,
    now_ns,
    pid_alive,
)
from kvswap.daemon.agreement import Agreement
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon.jobs import DaemonError
from kvswap.daemon.malloc_tuning import Trimmer
from kvswap.daemon.state import StateMachine

log = logging.getLogger("kvswap.daemon")

# Exit status of a daemon whose stop did not finish by its deadline (Heartbeat).
EXIT_STOP_STUCK = 3

_LIVE_STATES = frozenset({RankState.STARTING, RankState.ATTACHING, RankState.READY,
                          RankState.PAUSED, RankState.CLEARING, RankState.CLEARED,
                          RankState.STOPPING})


class RankContext:
    """What every part of one rank's daemon shares (all threads; none rebound)."""

    def __init__(self, cfg: DaemonConfig, seg: SignalSegment, sig: RankSignals,
                 predecessor: RankState = RankState.ABSENT):
        self.cfg = cfg
        self.names = Names.of(cfg.namespace, cfg.run_root)
        self.index = cfg.rank
        self.seg = seg
        self.sig = sig
        self.epoch = int(sig[RankSlot.EPOCH])
        # The state the previous daemon of this rank last published (ABSENT on a first
        # start): which mode a restarted daemon comes back in (startup.rejoin_mode).
        self.predecessor = predecessor
        self.sm = StateMachine(sig)  # any thread; serialised by its own lock
        self.layers = LayerProgress(seg, cfg.rank)  # transfer workers (layer-wise loads)
        self.stats = seg.stats(cfg.rank)  # I/O thread (the single writer of task statistics)
        self.agreement = Agreement(seg, cfg.rank, cfg.stale_after_s,  # storage worker
                                   cfg.storage_timeout_s)
        self.stopping = threading.Event()  # set once by the I/O thread (Lifecycle.begin_stop)

    @classmethod
    def open(cls, cfg: DaemonConfig) -> "RankContext":
        """Claim this rank's slot: refuse a rank another live daemon serves, start a
        new epoch, reset what the previous incarnation left."""
        seg = SignalSegment.attach(Names.of(cfg.namespace, cfg.run_root))
        if seg.tp_size != cfg.tp_size:
            raise DaemonError(f"namespace {cfg.namespace!r} has tp_size {seg.tp_size}, "
                              f"daemon started with --tp {cfg.tp_size}")
        if not 0 <= cfg.rank < cfg.tp_size:
            raise DaemonError(f"rank {cfg.rank} out of range for tp {cfg.tp_size}")
        sig = seg.rank(cfg.rank)
        other = sig[RankSlot.PID]
        if (seg.state_of(cfg.rank) in _LIVE_STATES and other and other != os.getpid()
                and pid_alive(other)):
            raise DaemonError(f"rank {cfg.rank} of namespace {cfg.namespace!r} is already "
                              f"served by pid {other}")
        predecessor = seg.state_of(cfg.rank)  # read before it is overwritten
        sig[RankSlot.STATE] = RankState.ABSENT
        sig[RankSlot.PID] = os.getpid()
        sig.add(RankSlot.EPOCH, 1)
        for f in (RankSlot.CACHE_READY, RankSlot.SWAP_READY, RankSlot.INFLIGHT, RankSlot.LAST_ERROR,
                  RankSlot.SWAP_BYTES_TOTAL, RankSlot.SWAP_BYTES_PINNED, RankSlot.CONN_REFUSED):
            sig[f] = 0
        sig[RankSlot.HEARTBEAT_NS] = now_ns()
        return cls(cfg, seg, sig, predecessor)

    def check_serving(self) -> None:
        """Refuse a task unless this rank is READY and not stopping."""
        if self.stopping.is_set():
            raise KvswapError(f"rank {self.index} is shutting down", ErrorCode.SHUTTING_DOWN)
        state = self.sm.state
        if state is RankState.PAUSED:
            raise KvswapError(f"rank {self.index} is PAUSED: resume() first", ErrorCode.PAUSED)
        if state in (RankState.CLEARING, RankState.CLEARED):
            raise KvswapError(f"rank {self.index} is {state.name}: caches were cleared for a "
                              f"weight update; restore_caches() and re-register first",
                              ErrorCode.CLEARED)
        if state is not RankState.READY:
            raise NotReady(f"rank {self.index} is {state.name}, not READY")

    def check_epoch(self, header: dict) -> None:
        """Refuse what was addressed to an earlier incarnation of this rank."""
        ep = header.get("ep")
        if ep is not None and len(ep) > self.index and ep[self.index] != self.epoch:
            raise KvswapError(f"rank {self.index} restarted: it is at epoch {self.epoch}, the "
                              f"task was addressed to epoch {ep[self.index]}",
                              ErrorCode.RANK_RESTARTED)

    def on_pin_progress(self, pinned: int) -> None:
        """Host swap space pinning progress (control thread, during attach)."""
        self.sig[RankSlot.SWAP_BYTES_PINNED] = pinned

    def orphaned(self) -> str | None:
        """Why this daemon has nobody left to serve, or None.

        Orphaned = the launcher is gone AND the engine's heartbeat is older than
        ``orphan_timeout_s`` (or never came).  Either one alone is not enough: an
        engine may outlive a crashed launcher, and a launcher may wait for an
        engine that is still loading."""
        launcher = int(self.seg.header[HeaderSlot.LAUNCHER_PID])
        if pid_alive(launcher):
            return None
        beat = int(self.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS])
        age = (now_ns() - beat) / 1e9 if beat else None
        if age is not None and age <= self.cfg.orphan_timeout_s:
            return None
        engine = "never beat" if age is None else f"silent for {age:.0f}s"
        return f"launcher pid {launcher} is gone and the engine heartbeat {engine}"

    def close(self) -> None:
        """Release the shared-memory views (last, after every thread has stopped)."""
        self.layers.close()
        self.agreement.close()
        self.seg.close()


class Heartbeat:
    """The heartbeat thread: ``heartbeat_ns`` every ``heartbeat_interval_s``, a clean
    stop (SIGTERM to itself) once the daemon is orphaned, free heap memory returned
    to the system every few seconds (:mod:`~kvswap.daemon.malloc_tuning`), and the
    stop's deadline.

    A stop waits for running tasks, and a thread stuck for good (a storage call on a
    hung file system, a copy that never completes, a teardown step that blocks) would
    hold the daemon in STOPPING forever; an orphan has nobody left to kill it.  So
    once ``--drain-timeout`` has passed since this thread first saw the stop, it
    ends the process the way ``kill -9`` would (:meth:`_abandon`).  This thread is
    the one to do it because it runs nothing else that could be stuck."""

    def __init__(self, rank: RankContext):
        self._rank = rank
        self._trimmer = Trimmer()  # heartbeat thread
        self._stop = threading.Event()  # set by the thread that stops the daemon
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        rank = self._rank
        next_orphan_check = 0.0
        stop_seen: float | None = None  # when this thread first saw the stop
        while not self._stop.is_set():
            rank.sig[RankSlot.HEARTBEAT_NS] = now_ns()
            self._trimmer.maybe()
            now = time.monotonic()
            if stop_seen is not None:
                if now - stop_seen > rank.cfg.drain_timeout_s:
                    self._abandon(now - stop_seen)
            elif rank.stopping.is_set():
                stop_seen = now
            elif now >= next_orphan_check:
                next_orphan_check = now + 1.0
                why = rank.orphaned()
                if why:
                    log.warning("orphaned: %s; exiting", why)
                    os.kill(os.getpid(), signal.SIGTERM)  # the normal, clean stop path
                    stop_seen = now  # sent once; due even if the I/O thread never gets it
            self._stop.wait(rank.cfg.heartbeat_interval_s)

    def _abandon(self, waited: float) -> NoReturn:
        """Exit now, releasing nothing: a stuck thread may still use the pool and the
        mappings.  As after ``kill -9``, the journal stays for the next incarnation
        (the tasks in doubt are settled there) and the launcher removes what is left."""
        rank = self._rank
        me = threading.current_thread()
        running = sorted(t.name for t in threading.enumerate() if t is not me)
        rank.sm.fail(ErrorCode.RANK_TIMEOUT,
                     f"the stop has not finished {waited:.1f}s after it began "
                     f"(--drain-timeout {rank.cfg.drain_timeout_s:g}); threads still "
                     f"running: {', '.join(running)}; exiting with status {EXIT_STOP_STUCK} "
                     f"without releasing anything, as a kill -9 would (their stacks follow)")
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_STOP_STUCK)
