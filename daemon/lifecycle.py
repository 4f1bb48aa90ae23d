"""The rank's life cycle: the control thread (SERIAL jobs: register, clear), the
start-up barrier and READY, pause/resume, clear/restore for a weight update,
ping/stats, and the start of a stop.

Shutdown (``shutdown`` op, SIGTERM or SIGINT): state STOPPING, new requests get
SHUTTING_DOWN, tasks that have not started are answered SHUTTING_DOWN, running
ones finish and are answered; the daemon then releases what it created
(daemon/server.py) and exits 0.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from functools import partial

from kvswap.client.errors import ErrorCode, KvswapError, NotReady
from kvswap.client.protocol import Op, Request
from kvswap.client.signals import (
    Barrier,
    HeaderSlot,
    KvCacheStatus,
    RankSlot,
    RankState,
    poll_until,
)
from kvswap.daemon import crashpoints
from kvswap.daemon.attachment import AttachmentSlot, Registrar
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.io_loop import IoLoop
from kvswap.daemon.jobs import Completion, Handler, Job, Origin
from kvswap.daemon.peer_ops import PeerOps
from kvswap.daemon.rank import RankContext
from kvswap.daemon.startup import Startup, clear_generation, startup_generation
from kvswap.daemon.transfers import Transfers

log = logging.getLogger("kvswap.daemon")


class Lifecycle:
    """State changes of the rank and the control thread that runs the slow ones."""

    def __init__(self, rank: RankContext, io: IoLoop, slot: AttachmentSlot,
                 registrar: Registrar, startup: Startup, exactly: ExactlyOnce,
                 transfers: Transfers, peer: PeerOps, control: queue.SimpleQueue):
        self._rank = rank
        self._io = io
        self._slot = slot
        self._registrar = registrar
        self._startup = startup
        self._exactly = exactly
        self._transfers = transfers
        self._peer = peer
        self._control = control  # SERIAL jobs, in arrival order; None ends the thread
        self._thread: threading.Thread | None = None  # main thread: started, joined

    # ---------------------------------------------------------------- control thread
    def start(self, handlers: dict[Op, Handler]) -> None:
        self._thread = threading.Thread(target=self._loop, args=(handlers,), name="control",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, handlers: dict[Op, Handler]) -> None:
        rank = self._rank
        while True:
            job = self._control.get()
            if job is None:
                break
            t_start = time.perf_counter_ns()
            if rank.stopping.is_set():
                self._io.complete(Completion.now(job, ErrorCode.SHUTTING_DOWN,
                                                 f"rank {rank.index} is shutting down", t_start))
                continue
            run = handlers[job.op].run
            assert run is not None
            try:
                fields = run(job, None)
                c = Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(),
                               fields=fields or {})
            except KvswapError as exc:
                c = Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
            except Exception as exc:  # a bug must cost one request, never the daemon
                log.exception("%s failed unexpectedly", job.op.value)
                c = Completion(job, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}",
                               t_start, time.perf_counter_ns())
            if c.code != ErrorCode.OK:
                log.warning("%s%s %s failed: [%d] %.200r", "internal " if job.route is None else "",
                            job.op.value, job.req_id, c.code, c.message)
                if job.op is Op.REGISTER and job.route is None and rank.cfg.demo_caches is not None:
                    # Nobody else will register the daemon's own caches: ATTACHING forever
                    # would only end at the launcher's timeout, without the reason.
                    rank.sm.fail(c.code, f"attaching the demo caches failed: {c.message}")
            self._io.complete(c)
            if job.op is Op.REGISTER and c.code == ErrorCode.OK:
                if job.rejoin:  # the predecessor's caches: finish what its crash cut short
                    att = self._slot.current
                    assert att is not None
                    self._exactly.replay_in_doubt(att.num_device_blocks, att.num_host_blocks,
                                                  partial(self._transfers.execute, att=att))
                    if self._registrar.joining:  # the other ranks serve: no barrier to meet
                        self._settle()
                    else:  # a restore under way: the other ranks meet the start-up barrier
                        self._startup_barrier()
                elif job.replace:  # the other ranks serve on: no barrier to meet
                    # A replace drained first, so nothing is in doubt; a restarted daemon
                    # joining with new tensors (Registrar._admit_join) may have tasks its
                    # predecessor left, which cannot be replayed onto them.
                    self._exactly.abandon_in_doubt()
                    self._settle()
                else:
                    self._exactly.abandon_in_doubt()
                    self._startup_barrier()

    def _startup_barrier(self) -> None:
        """All ranks attached before any reports READY (an odd generation:
        :func:`~kvswap.daemon.startup.startup_generation`)."""
        rank = self._rank
        barrier = Barrier(rank.seg, rank.index, stale_after_s=rank.cfg.stale_after_s)
        try:
            barrier.wait(rank.cfg.attach_timeout_s, what="start-up barrier",
                         cancelled=rank.stopping.is_set,
                         generation=startup_generation(barrier.reached))
        except KvswapError as exc:
            if not rank.stopping.is_set():
                rank.sm.fail(exc.code, exc.message)
            return
        finally:
            barrier.close()
        self._become_ready()

    def _become_ready(self) -> None:
        """ATTACHING -> READY after the start-up barrier."""
        self._settle(RankState.READY)

    def _settle(self, state: RankState | None = None) -> None:
        """ATTACHING -> ``state`` (default: the one the registrar names, READY or the
        mode the rank was in before it re-attached: PAUSED after a restart or a
        replacing register of a paused namespace).  Rank 0 writes the namespace's
        KvCacheStatus first, so a client that sees every rank READY (wait_ready) also
        sees NORMAL."""
        rank = self._rank
        if state is None:
            state = self._registrar.settle_to
        if rank.index == 0 and rank.sm.state is RankState.ATTACHING:
            rank.seg.header[HeaderSlot.KVCACHE_STATUS] = KvCacheStatus.NORMAL
        if rank.sm.to(state, only_from=frozenset({RankState.ATTACHING})):
            self._registrar.settled()

    def run_clear(self, job: Job, req: Request | None) -> dict:
        """Drain, release the device mappings (and the pool if asked), barrier: every
        rank reports CLEARED before any answers.  A rank that gives up the barrier
        (a stalled or dead peer) stays arrived: it is CLEARED, which is what its
        arrival says, so a peer that clears later passes on it.

        A rank already CLEARED runs a clear re-sent after its restart
        (:meth:`admit_clear`): its predecessor died during that clear, or before it,
        in a namespace that was clearing.  It has nothing to drain or detach; it
        frees the pool its predecessor left if the clear asks, and waits in the same
        barrier, which it arrived at when it came back (without arriving twice), so
        the clear is answered as it would have been: once every rank is CLEARED."""
        rank, cfg = self._rank, self._rank.cfg
        free_host = bool(job.header.get("free_host"))
        state = rank.sm.state
        if state is RankState.CLEARED:
            if free_host:
                self._registrar.free_pool()
        elif state is not RankState.CLEARING:
            raise NotReady(f"rank {rank.index} is {state.name}: it left CLEARING before its "
                           f"clear ran (a failure, a stop, or a restore after a re-sent clear)")
        else:
            self._peer.end_armed(f"rank {rank.index} is clearing its caches: the receive "
                                 f"ended before a sender began; after restore_caches() and "
                                 f"register, ask receive_into for a new ticket")
            drained = poll_until(lambda: True if rank.sig[RankSlot.INFLIGHT] == 0 else None,
                                 time.monotonic() + cfg.drain_timeout_s)
            if drained is None:
                rank.sm.fail(ErrorCode.RANK_TIMEOUT, "clear: tasks did not drain")
                raise KvswapError(f"rank {rank.index}: {rank.sig[RankSlot.INFLIGHT]} task(s) "
                                  f"still running after {cfg.drain_timeout_s:.0f}s",
                                  ErrorCode.RANK_TIMEOUT)
            crashpoints.hit("clear.drained")
            self._registrar.detach(free_host=free_host)
            if not rank.sm.to(RankState.CLEARED, only_from=frozenset({RankState.CLEARING})):
                raise KvswapError(f"rank {rank.index} went {rank.sm.state.name} during the "
                                  f"clear (see its log); a FAILED rank is restarted and comes "
                                  f"back CLEARED", ErrorCode.INTERNAL_ERROR)
        barrier = Barrier(rank.seg, rank.index, stale_after_s=cfg.stale_after_s)
        try:
            barrier.wait(cfg.attach_timeout_s, what="clear barrier",
                         cancelled=rank.stopping.is_set,
                         generation=clear_generation(barrier.reached))
        finally:
            barrier.close()
        if rank.index == 0:
            rank.seg.header[HeaderSlot.KVCACHE_STATUS] = KvCacheStatus.CLEARED
        return {}

    # ---------------------------------------------------------------- I/O thread
    def admit_clear(self, job: Job, req: Request | None) -> None:
        """READY or PAUSED -> CLEARING, then the control thread runs the clear.  A clear
        re-sent after a restart to a rank that came back CLEARED is run too (as the
        clear it is: :meth:`run_clear`); refusing it would fail a clear that every rank
        carried out."""
        rank = self._rank
        if rank.sm.state is RankState.CLEARED and Origin.of(job.header).resent:
            self._control.put(job)
            return
        if not rank.sm.to(RankState.CLEARING,
                          only_from=frozenset({RankState.READY, RankState.PAUSED})):
            raise NotReady(f"rank {rank.index} is {rank.sm.state.name}; clear needs READY or "
                           f"PAUSED")
        if rank.index == 0:
            rank.seg.header[HeaderSlot.KVCACHE_STATUS] = KvCacheStatus.CLEARING
        self._control.put(job)

    def restore(self, job: Job, req: Request | None) -> dict:
        """CLEARED -> ATTACHING: the worker registers its (new) tensors next."""
        sm = self._rank.sm
        if not sm.to(RankState.ATTACHING, only_from=frozenset({RankState.CLEARED})):
            raise NotReady(f"rank {self._rank.index} is {sm.state.name}, not CLEARED")
        self._registrar.forget()
        if self._rank.cfg.demo_caches is not None:
            self._startup.create_demo_caches(rejoin=False)
        return {}

    def pause(self, job: Job, req: Request | None) -> dict | None:
        """READY -> PAUSED; answered once every accepted transfer has finished."""
        sm = self._rank.sm
        if sm.state is not RankState.PAUSED:
            if not sm.to(RankState.PAUSED, only_from=frozenset({RankState.READY})):
                raise NotReady(f"rank {self._rank.index} is {sm.state.name}; only a READY rank "
                               f"can pause")
        self._io.answer_when_drained(job)
        return None

    def resume(self, job: Job, req: Request | None) -> dict:
        sm = self._rank.sm
        if sm.state is RankState.READY:
            return {}
        if not sm.to(RankState.READY, only_from=frozenset({RankState.PAUSED})):
            raise NotReady(f"rank {self._rank.index} is {sm.state.name}, not PAUSED")
        return {}

    def ping(self, job: Job, req: Request | None) -> dict:
        return {"state": self._rank.sm.state.name, "epoch": self._rank.sig[RankSlot.EPOCH],
                "pid": os.getpid()}

    def stats(self, job: Job, req: Request | None) -> dict:
        counters = self._rank.seg.rank_snapshot(self._rank.index)
        att = self._slot.current
        if att is not None:
            counters["merged_batches"] = att.scheduler.merged_batches
            counters["queued"] = att.scheduler.pending
        return {"counters": counters}

    def shutdown(self, job: Job, req: Request | None) -> dict:
        self.begin_stop(f"shutdown requested (request {job.req_id})")
        return {}

    def begin_stop(self, why: str) -> None:
        """Refuse new work, end the control thread, answer every task that has not
        started SHUTTING_DOWN; running ones finish (I/O thread)."""
        rank = self._rank
        if rank.stopping.is_set():
            return
        log.info("stopping: %s", why)
        rank.stopping.set()
        if rank.sm.state is not RankState.STOPPING:
            rank.sm.to(RankState.STOPPING)
        self._control.put(None)
        att = self._slot.current
        if att is not None:
            now = time.perf_counter_ns()
            for task in att.scheduler.stop():
                self._exactly.settle(Completion.now(task.ctx, ErrorCode.SHUTTING_DOWN,
                                                    f"rank {rank.index} is shutting down", now))
        self._peer.stop()  # held receives end SHUTTING_DOWN too

    def workers_done(self) -> bool:
        if self._thread is not None and self._thread.is_alive():
            return False
        att = self._slot.current
        return att is None or att.scheduler.join(0)
