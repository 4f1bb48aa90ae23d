"""How a daemon enters its namespace: at launch, after a restore, and restarted
(epoch > 1) by the supervisor into a namespace that lives on without it.

A first start waits for its worker's register (or registers its own demo caches)
and meets the other ranks in the start-up barrier.  A restarted daemon must not:
the other ranks passed that barrier and will not enter it again.  It comes back
in the namespace's mode instead (:func:`rejoin_mode`): CLEARED at once, or READY
or PAUSED once it has re-attached its predecessor's caches, from its demo caches
or the register file (``Registrar.register_file``), replaying the tasks the crash
left in doubt.  If it cannot re-attach (the engine that owned the tensors is gone),
the next register joins the serving ranks the same way
(``Registrar._admit_join``).
"""

from __future__ import annotations

import logging
import time

import msgpack
import numpy as np

from kvswap.client.errors import KvswapError
from kvswap.client.layout import TensorDesc, demo_layout, validate_layout
from kvswap.client.protocol import Op
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import Barrier, RankSlot, RankState
from kvswap.daemon.attachment import Registrar
from kvswap.daemon.jobs import Job
from kvswap.daemon.rank import RankContext

log = logging.getLogger("kvswap.daemon")

def startup_generation(reached: int) -> int:
    """The start-up barrier's generation for a rank whose ``barrier_arrivals`` is
    ``reached``.  A namespace's barriers come in one order: the launch's start-up
    barrier, then per weight update a clear barrier and the start-up barrier after
    the restore.  Numbered 1, then 2k and 2k + 1 for the k-th update, start-up
    barriers are odd and clear barriers even, so an arrival at one never counts
    for the other (client/signals.py, Barrier), and every rank computes the same
    number from its own count, whichever barriers it gave up: an arrival is never
    withdrawn.  A rank that re-enters the one it last reached (a restarted daemon
    whose predecessor arrived) waits for it without arriving twice."""
    return reached if reached % 2 else reached + 1


def clear_generation(reached: int) -> int:
    """The clear barrier's generation (even; :func:`startup_generation`)."""
    return reached + 1 if reached % 2 else reached


SERVING = frozenset({RankState.READY, RankState.PAUSED})
CLEARING_OR_CLEARED = frozenset({RankState.CLEARING, RankState.CLEARED})


def rejoin_mode(rank: RankContext) -> RankState | None:
    """The mode a restarted daemon comes back in: READY or PAUSED (the namespace
    serves), CLEARED (a weight update is under way: attach nothing, wait for
    ``restore``), or None (the namespace is attaching itself after a restore: a
    register meets the start-up barrier, as on a first start).

    1. The predecessor's own last state, read from its signal slot before the new
       daemon overwrites it (``RankContext.predecessor``), if it is one a
       namespace settles in: READY, PAUSED, or CLEARING / CLEARED (as CLEARED: its
       caches were being released).  That is exactly what this rank's clients were
       told: every ``pause``, ``resume`` or ``clear`` the predecessor answered had
       changed its state before the answer, and one it did not answer is re-sent
       to the new daemon once it settles (docs/protocol.md section 10), in send
       order, which moves it on.  So a paused rank never comes back READY to run a
       transfer its namespace paused, and a rank that missed a ``pause`` receives it
       before any transfer sent after it.
    2. Otherwise (the predecessor died while it started, attached or stopped, or was
       FAILED, and the supervisor killed it: its state says nothing of the
       namespace) the other ranks' states: a weight update if any is CLEARING or
       CLEARED, else PAUSED if any is PAUSED (never run what part of the namespace
       paused; a ``resume`` this rank missed is re-sent as above), else READY if any
       is READY.  Ranks that are all ATTACHING mean a restore under way: None.
    """
    prev = rank.predecessor
    if prev in CLEARING_OR_CLEARED:
        return RankState.CLEARED
    if prev in SERVING:
        return prev
    others = {rank.seg.state_of(r) for r in range(rank.seg.tp_size) if r != rank.index}
    if others & CLEARING_OR_CLEARED:
        return RankState.CLEARED
    for state in (RankState.PAUSED, RankState.READY):
        if state in others:
            return state
    return None


class Startup:
    """The entry into the namespace (main thread, in ATTACHING, before serving) and
    the daemon's own demo caches, which ``restore`` registers again."""

    def __init__(self, rank: RankContext, registrar: Registrar):
        self._rank = rank
        self._registrar = registrar
        self._demo_regions: dict[str, ShmRegion] = {}  # main thread at start, then I/O (restore)

    def begin(self) -> None:
        """First start: wait for a worker (or create the demo caches).  Restart: come
        back in :func:`rejoin_mode`'s mode."""
        rank = self._rank
        restarted = rank.epoch > 1
        mode = rejoin_mode(rank) if restarted else None
        if mode is RankState.CLEARED:
            log.info("restart (epoch %d): the namespace is in a weight update (this rank was "
                     "%s): back CLEARED, waiting for restore_caches()", rank.epoch,
                     rank.predecessor.name)
            rank.sm.to(RankState.CLEARED, only_from=frozenset({RankState.ATTACHING}))
            # a predecessor that died in the clear before its detach left its register
            # file; a later restart would re-attach the tensors of before the update
            self._registrar.register_file.unlink(missing_ok=True)
            self._align_barrier(mode)
            return
        if mode is not None:
            self._align_barrier(mode)
        layout = None
        path = self._registrar.register_file
        header = None
        if restarted and rank.cfg.demo_caches is None and path.exists():
            try:
                header = msgpack.unpackb(path.read_bytes(), raw=False)
                layout = [TensorDesc.from_wire(t) for t in header["tensors"]]
                validate_layout(layout)
            except (KvswapError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                log.warning("restart: cannot re-attach from %s (%.200r); waiting for the "
                            "worker to register again", path, str(exc))
                header = layout = None
        if mode is not None:  # before any register is admitted
            log.info("restart (epoch %d): the namespace serves; this rank rejoins it %s once "
                     "attached, without the start-up barrier", rank.epoch, mode.name)
            self._registrar.expect_join(mode, layout)
        if rank.cfg.demo_caches is not None:
            self.create_demo_caches(restarted)
        elif header is not None:
            log.info("restart (epoch %d): re-attaching the caches registered before",
                     rank.epoch)
            try:
                self._registrar.admit(Job(None, 0, Op.REGISTER, time.perf_counter_ns(), header,
                                          rejoin=True), None)
            except KvswapError as exc:
                log.warning("restart: re-attach refused (%.200r); waiting for the worker to "
                            "register again", exc.message)

    def _align_barrier(self, mode: RankState) -> None:
        """Take the barrier generation the namespace is at (``barrier_arrivals``, which
        the main thread writes here, before the control thread enters any barrier).

        The predecessor's count is the rank's if its own state gave the mode
        (:func:`rejoin_mode`, rule 1): it was in that very mode.  Otherwise it may be
        ahead of the namespace: a predecessor restored alone attached, arrived at the
        start-up barrier after the clear, and failed there while the other ranks
        stayed CLEARED.  That arrival said "attached", which this daemon is not, and
        left standing it would let those ranks pass their start-up barrier without
        it; so the count is taken from the ranks that are in the mode (the lowest,
        should they differ).  Coming back CLEARED, the rank then arrives at the clear
        barrier (even: :func:`clear_generation`) which the others may be waiting in
        for a predecessor that died before it arrived: it is CLEARED, which is what
        that arrival says."""
        rank, seg = self._rank, self._rank.seg
        if rank.predecessor in CLEARING_OR_CLEARED | SERVING:
            at = int(rank.sig[RankSlot.BARRIER_ARRIVALS])
        else:
            peers = CLEARING_OR_CLEARED if mode is RankState.CLEARED else SERVING
            # The peers' states may have moved since the mode was chosen from them: with
            # none left in the mode, the rank's own count stands.
            at = min((int(seg.ranks[r, RankSlot.BARRIER_ARRIVALS]) for r in range(seg.tp_size)
                      if r != rank.index and seg.state_of(r) in peers),
                     default=int(rank.sig[RankSlot.BARRIER_ARRIVALS]))
        if mode is RankState.CLEARED:
            at = clear_generation(at)
        if at != int(rank.sig[RankSlot.BARRIER_ARRIVALS]):
            log.info("restart: barrier generation %d -> %d (the namespace's)",
                     int(rank.sig[RankSlot.BARRIER_ARRIVALS]), at)
            rank.sig[RankSlot.BARRIER_ARRIVALS] = at
        barrier = Barrier(seg, rank.index)
        try:
            barrier.arrive(at)  # wakes the ranks that may wait for it
        finally:
            barrier.close()

    def create_demo_caches(self, rejoin: bool) -> None:
        """--demo-caches: simulated device tensors owned by this daemon, registered
        through the same path a CacheWorker's register takes.  Opened without
        O_EXCL so a restarted daemon finds its predecessor's tensors, contents intact
        (as GPU memory outlives a crashed transfer daemon)."""
        rank = self._rank
        descs = []
        for t in demo_layout(rank.cfg.demo_caches or None):
            name = rank.names.device_segment(rank.index, t.name)
            if name not in self._demo_regions:
                nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
                self._demo_regions[name] = ShmRegion.create(name, nbytes, exclusive=False)
            descs.append(TensorDesc(t.name, t.layer, t.dtype, t.shape, {"shm": name},
                                    t.replicated))
        header = {"backend": rank.cfg.backend, "tensors": [d.to_wire() for d in descs]}
        self._registrar.admit(Job(None, 0, Op.REGISTER, time.perf_counter_ns(), header,
                                  rejoin=rejoin), None)

    def release(self) -> None:
        """Teardown, after the registrar released the mappings: the demo tensors."""
        for region in self._demo_regions.values():
            region.unlink()
            region.close()
