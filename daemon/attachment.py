"""Registration and attachment: what this rank has attached, as one record.

:class:`Attachment` is frozen and complete: the host swap space, the scheduler
over it, the block counts, the layer groups and the storage tier's entry layout.  The
control thread builds a new one on ``register`` and publishes it, or publishes
None on ``clear``, through :class:`AttachmentSlot` in a single reference
assignment.  Every other thread reads ``slot.current`` once per request and
uses that record throughout, so it never sees half of an old attachment and
half of a new one.

:class:`Registrar` owns the register itself: its admission in the I/O thread,
its repeats (a worker whose register timed out sends it again), the attach on
the control thread, and the register file a restarted daemon re-attaches from.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, NotReady
from kvswap.client.layout import TensorDesc, validate_layout
from kvswap.client.protocol import Request, packb
from kvswap.client.shm_region import unlink_shm
from kvswap.client.signals import RankSlot, RankState, poll_until
from kvswap.daemon.backend import Backend
from kvswap.daemon.io_loop import IoLoop
from kvswap.daemon.jobs import PEER_WORKERS, Completion, Job
from kvswap.daemon.rank import RankContext
from kvswap.daemon.registration import Registration, keep_layout, repeat_refusal
from kvswap.daemon.scheduler import RunBatch, Scheduler
from kvswap.daemon.storage_entries import EntryLayout
from kvswap.daemon.storage_service import StorageService
from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon")


class PoolUser(Protocol):
    """Something that must know the host pool attached (control thread)."""

    def attach(self, swap: HostSwapSpace) -> None: ...

    def detach(self) -> None: ...


@dataclass(frozen=True)
class Attachment:
    """Everything a request needs to know about the attached caches."""

    swap: HostSwapSpace
    scheduler: Scheduler
    num_device_blocks: int
    num_host_blocks: int
    block_bytes: int  # bytes of one block over every tensor
    layer_groups: tuple[tuple[int, ...], ...]  # tensor indices per layer, by layer
    tensor_spans: tuple[tuple[int, int, int], ...]  # (tensor, offset in entry, bytes)
    entries: EntryLayout | None  # how the storage tier stores a block (None without a tier)


class AttachmentSlot:
    """The one published :class:`Attachment` (None while nothing is attached).

    Written only by the control thread (attach, clear), read by any thread; a
    reader takes ``current`` once and keeps the record it got."""

    def __init__(self) -> None:
        self.current: Attachment | None = None  # control thread writes; any thread reads


class Registrar:
    """Register, attach and detach; re-attach after a restart."""

    def __init__(self, rank: RankContext, backend: Backend, io: IoLoop, slot: AttachmentSlot,
                 storage: StorageService, control: queue.SimpleQueue, run_batch: RunBatch,
                 pool_users: Sequence[PoolUser] = ()):
        """``pool_users`` learn of each pool attached and detached, before it is unmapped
        (the storage service registers it with its backend, the peer ops with their
        Transfer Engine)."""
        self._rank = rank
        self._backend = backend
        self._io = io
        self._slot = slot
        self._storage = storage
        self._control = control
        self._run_batch = run_batch
        self._pool_users = tuple(pool_users)
        self._registration: Registration | None = None  # I/O and control, under _lock
        self._lock = threading.Lock()
        self._kept_swap: HostSwapSpace | None = None  # control thread: kept by clear(free_host=False)
        # I/O and control, under _lock: the layout a replacing register took over, from its
        # admission until it attaches.  Set with nothing registered, the replace failed
        # after detaching the old tensors: the next register replaces too (the other
        # ranks are READY) and must keep this layout, which the pool was written under.
        self._replaced_layout: list[TensorDesc] | None = None
        # Under _lock: a restarted daemon's next register joins the serving ranks
        # (expect_join), keeping its predecessor's layout; the state a register that
        # meets no barrier settles in (Lifecycle._settle).
        self.joining = False
        self._predecessor_layout: list[TensorDesc] | None = None
        self.settle_to = RankState.READY
        # the last register's message (_save), which a restarted daemon re-attaches from
        self.register_file: Path = rank.names.run_dir / f"rank{rank.index}.register"

    # ---------------------------------------------------------------- I/O thread
    def admit(self, job: Job, req: Request | None) -> None:
        """Queue a register for the control thread, or answer a repeat of the one in
        effect (:meth:`_answer_repeat`)."""
        rank, cfg = self._rank, self._rank.cfg
        if rank.stopping.is_set():
            raise KvswapError(f"rank {rank.index} is shutting down", ErrorCode.SHUTTING_DOWN)
        hdr = job.header
        with self._lock:
            state = rank.sm.state
            replacing = bool(hdr.get("replace")) and self._registration is not None \
                and state in (RankState.READY, RankState.PAUSED)
            joining = (self.joining and not job.rejoin and self._registration is None
                       and state is RankState.ATTACHING)
            if not replacing and (self._registration is not None
                                  or state is not RankState.ATTACHING):
                self._answer_repeat(job, state)
                return
            if hdr["backend"] != cfg.backend:
                raise InvalidTask(f"rank {rank.index} runs the {cfg.backend} backend, the "
                                  f"worker registered {hdr['backend']} tensors",
                                  ErrorCode.BAD_LAYOUT)
            job.tensors = [TensorDesc.from_wire(t) for t in hdr["tensors"]]
            blocks = validate_layout(job.tensors)
            if blocks > cfg.max_device_blocks:
                raise InvalidTask(
                    f"rank {rank.index}: the tensors have {blocks} blocks, more than kvswapd "
                    f"--max-device-blocks {cfg.max_device_blocks} (it sizes the socket's "
                    f"frame limit); relaunch with a larger --max-device-blocks",
                    ErrorCode.BAD_LAYOUT)
            if replacing:
                self._admit_replace(job, state)
            elif joining:
                self._admit_join(job)
            elif self._replaced_layout is not None:
                keep_layout(self._rank.index, self._replaced_layout, job.tensors,
                            "a replacing register failed on this rank after detaching the "
                            "tensors in effect, and the register that completes it must keep "
                            "their layout")
                job.replace = True
            self._registration = Registration([t.to_wire() for t in job.tensors])
        self._control.put(job)

    def _admit_replace(self, job: Job, state: RankState) -> None:
        """A register with ``replace`` on a rank that has caches attached: a restarted
        engine's worker attaching its new tensors (caller holds the lock).

        The host pool is kept only if its blocks mean the same thing under the new
        tensors, so the layout (names, layers, dtypes, block shapes; ``layout_hash``)
        must be the one in effect; the device block count may differ.  The rank goes
        ATTACHING, which refuses transfers (NOT_READY) until the new tensors are
        attached; the control thread first lets the running tasks finish."""
        assert self._registration is not None
        old = [TensorDesc.from_wire(t) for t in self._registration.tensors]
        keep_layout(self._rank.index, old, job.tensors, "a replacing register must keep the "
                    "layout in effect, so the host pool keeps its meaning")
        if not self._rank.sm.to(RankState.ATTACHING, only_from=frozenset({state})):
            raise NotReady(f"rank {self._rank.index} is {self._rank.sm.state.name}; a "
                           f"replacing register needs READY or PAUSED")
        job.replace = True
        self._replaced_layout = old
        self.settle_to = state  # a paused namespace stays paused across the replacement
        log.info("register %s replaces the attached tensors (engine restart); the host pool "
                 "is kept", job.req_id)

    def _admit_join(self, job: Job) -> None:
        """A register on a restarted daemon of a serving namespace that could not
        re-attach its predecessor's caches (their engine is gone; caller holds the
        lock).  ``replace`` or not, it stands for the predecessor's register, which is
        what ``replace`` means on a rank with nothing attached: no start-up barrier
        (the other ranks will not enter it again: waiting ends in BARRIER_TIMEOUT); the
        layout the other ranks serve and the pool was written under, else BAD_LAYOUT
        and nothing changes; ``host_pool_kept`` says whether the pool was adopted with
        its contents (``HostSwapSpace.reused``); tasks in doubt are abandoned, not
        replayed onto what may be other tensors (Lifecycle's control loop)."""
        if self._predecessor_layout is not None:
            keep_layout(self._rank.index, self._predecessor_layout, job.tensors, "it restarted "
                        "and rejoins ranks that serve its previous register's layout, not this "
                        "one's")
        job.replace = True
        log.info("register %s: this daemon restarted and could not re-attach, so it joins the "
                 "serving ranks without the start-up barrier (the host pool is kept if its "
                 "layout matches)", job.req_id)

    def settled(self) -> None:
        """The rank left ATTACHING for the state :attr:`settle_to` named (control thread):
        from here on a register is a first one again, until the next restart."""
        with self._lock:
            self.joining = False
            self.settle_to = RankState.READY

    def _answer_repeat(self, job: Job, state: RankState) -> None:
        """A register on a rank that has one in effect (caller holds the lock).

        A worker whose register timed out on its side sends it again while the
        daemon has finished the first, or is still running it.  The same
        descriptors (locations included, so the very same memory) get the first
        one's answer: now, or from the control thread when it ends.  Anything else
        is ALREADY_REGISTERED: attached caches are only replaced through
        clear/restore."""
        reg = self._registration
        refusal = repeat_refusal(self._rank.index, state, reg, self._rank.cfg.backend, job.header)
        if refusal is not None:
            raise refusal
        assert reg is not None
        if reg.reply is None:
            reg.waiters.append(job)
            log.info("register %s repeats the one being attached; answered when it ends",
                     job.req_id)
            return
        code, message, fields = reg.reply
        log.info("register %s repeats the one in effect; answered with its reply", job.req_id)
        self._io.reply(job.route, job.req_id, code, message, fields=fields)

    # ---------------------------------------------------------------- control thread
    def run(self, job: Job, req: Request | None) -> dict:
        """Attach the caches; repeats of this register that arrived meanwhile get the
        same answer.  Attaching is all or nothing: a failure leaves nothing
        attached, so a new register may try again.  A replacing register first
        drains the running tasks and detaches the old tensors, keeping the pool."""
        detached = False
        try:
            if job.replace and self._slot.current is not None:
                self._drain("replacing register")
                self.detach(free_host=False)
                detached = True
            fields = self._attach(job)
        except KvswapError as exc:
            if detached:  # the reply says the rank is down, and how it comes back
                exc.message += (f"; the tensors it replaces were detached first, so rank "
                                f"{self._rank.index} serves nothing (NOT_READY) until a "
                                f"register of their layout succeeds")
            self._end(exc.code, exc.message, {}, attached=False, replace=job.replace)
            raise
        except Exception as exc:  # the control loop logs it and answers INTERNAL_ERROR
            self._end(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", {},
                      attached=False, replace=job.replace)
            raise
        self._end(ErrorCode.OK, "", fields, attached=True)
        return fields

    def _drain(self, what: str) -> None:
        """Wait until no accepted task is running or queued on this rank."""
        rank, cfg = self._rank, self._rank.cfg
        if poll_until(lambda: True if rank.sig[RankSlot.INFLIGHT] == 0 else None,
                      time.monotonic() + cfg.drain_timeout_s) is None:
            rank.sm.fail(ErrorCode.RANK_TIMEOUT, f"{what}: tasks did not drain")
            raise KvswapError(f"rank {rank.index}: {rank.sig[RankSlot.INFLIGHT]} task(s) still "
                              f"running after {cfg.drain_timeout_s:.0f}s ({what})",
                              ErrorCode.RANK_TIMEOUT)

    def _end(self, code: ErrorCode, message: str, fields: dict, attached: bool,
             replace: bool = False) -> None:
        """Record how the register ended and answer the repeats that waited for it.
        Nothing attached: forget it, so a new register may try."""
        now = time.perf_counter_ns()
        with self._lock:
            reg = self._registration
            assert reg is not None
            waiters, reg.waiters = reg.waiters, []
            reg.reply = (code, message, fields)
            if not attached:
                self._registration = None
            if attached or not replace:
                self._replaced_layout = None
        for waiter in waiters:
            self._io.complete(Completion.now(waiter, code, message, now, fields))

    def _attach(self, job: Job) -> dict:
        rank, cfg, sig, tensors = self._rank, self._rank.cfg, self._rank.sig, job.tensors
        if cfg.storage_url:
            self._storage.open()
        if self._kept_swap is not None:  # kept across clear(free_host=False): re-adopted below
            self._kept_swap.close(unlink=False)  # its users were detached at the clear
            self._kept_swap = None
        swap = HostSwapSpace.open(rank.names, rank.index, tensors, cfg.pool_blocks,
                                  host_bytes=cfg.host_size)
        sig[RankSlot.SWAP_BYTES_TOTAL] = swap.nbytes  # before attach: pinning reports progress
        try:
            if swap.num_host_blocks > cfg.host_blocks_bound:
                raise InvalidTask(
                    f"--host-size gives {swap.num_host_blocks} host blocks per tensor, more "
                    f"than --max-device-blocks {cfg.max_device_blocks}, which sizes the "
                    f"largest frame the socket accepts; relaunch with a larger "
                    f"--max-device-blocks or a smaller --host-size", ErrorCode.BAD_LAYOUT)
            self._backend.attach(tensors, swap)
            for user in self._pool_users:
                user.attach(swap)
            if job.route is not None:
                self._save(job.header)
        except BaseException:
            for user in self._pool_users:
                user.detach()
            self._backend.detach()
            sig[RankSlot.SWAP_BYTES_TOTAL] = 0
            sig[RankSlot.SWAP_BYTES_PINNED] = 0
            if swap.reused:  # a pool with contents stays for the next register (or teardown)
                self._kept_swap = swap
            else:
                swap.close(unlink=True)
            raise
        layers = sorted({t.layer for t in tensors})
        offsets = np.cumsum([0] + [t.bytes_per_block for t in tensors])
        # The TP size is part of the identity: with replicated KV heads two TP sizes
        # can give the same per-rank layout while rank r holds other heads.
        entries = (EntryLayout.of(tensors, cfg.model_id, cfg.tp_size, rank.index)
                   if cfg.storage_url else None)
        num_device_blocks = tensors[0].num_blocks
        att = Attachment(
            swap=swap,
            scheduler=Scheduler(num_device_blocks, swap.num_host_blocks, self._run_batch,
                                workers=cfg.workers, merge=cfg.merge,
                                max_merge_blocks=cfg.max_merge_blocks,
                                storage_workers=1 if cfg.storage_url else 0,
                                peer_workers=PEER_WORKERS if cfg.peer_transfer else 0),
            num_device_blocks=num_device_blocks,
            num_host_blocks=swap.num_host_blocks,
            block_bytes=sum(t.bytes_per_block for t in tensors),
            layer_groups=tuple(tuple(i for i, t in enumerate(tensors) if t.layer == layer)
                               for layer in layers),
            tensor_spans=tuple((i, int(offsets[i]), t.bytes_per_block)
                               for i, t in enumerate(tensors)),
            entries=entries)
        self._slot.current = att  # published: from here on the caches are attached
        if rank.stopping.is_set():
            # The stop began while this attach ran, so Lifecycle.begin_stop found no
            # scheduler to stop, and nothing else would end these workers: the daemon
            # would wait for them in STOPPING for ever.  (It set ``stopping`` before
            # it looked, so one of the two stops them.)  No task can be in them: a
            # stopping rank admits none.
            att.scheduler.stop()
        sig[RankSlot.NUM_DEVICE_BLOCKS] = att.num_device_blocks
        sig[RankSlot.NUM_HOST_BLOCKS] = att.num_host_blocks
        sig[RankSlot.SWAP_BYTES_TOTAL] = swap.nbytes
        sig[RankSlot.SWAP_BYTES_PINNED] = swap.nbytes
        sig[RankSlot.CACHE_READY] = 1
        sig[RankSlot.SWAP_READY] = 1
        log.info("attached %d tensors in %d layers (%d device blocks, %.1f MiB host swap%s)",
                 len(tensors), len(layers), att.num_device_blocks, swap.nbytes / 2**20,
                 ", re-attached" if swap.reused else "")
        return {"num_device_blocks": att.num_device_blocks,
                "num_host_blocks": att.num_host_blocks, "host_pool_kept": swap.reused}

    def detach(self, free_host: bool) -> None:
        """Clear: unpublish, stop the scheduler, release the device mappings (and the
        pool if asked) and the register file.  Caller has drained the tasks."""
        att, self._slot.current = self._slot.current, None
        assert att is not None
        for user in self._pool_users:
            user.detach()
        att.scheduler.stop()
        att.scheduler.join(self._rank.cfg.drain_timeout_s)
        self._backend.detach()
        self._rank.sig[RankSlot.CACHE_READY] = 0
        self._kept_swap = att.swap
        if free_host:
            self.free_pool()
        self.register_file.unlink(missing_ok=True)

    def free_pool(self) -> None:
        """Release the pool a clear left: kept here, or a dead predecessor's (control)."""
        swap, self._kept_swap = self._kept_swap, None
        if swap is not None:
            swap.close(unlink=False)
        unlink_shm(self._rank.names.swap_segment(self._rank.index))  # kept, or left by it
        for slot in (RankSlot.SWAP_READY, RankSlot.SWAP_BYTES_TOTAL, RankSlot.SWAP_BYTES_PINNED):
            self._rank.sig[slot] = 0

    def forget(self) -> None:
        """Restore: the next register attaches anew."""
        with self._lock:
            self._registration = None

    def release(self) -> None:
        """Teardown, after the control thread and the workers ended: release every
        mapping and everything this rank created."""
        self._backend.detach()
        self._rank.sig[RankSlot.CACHE_READY] = 0
        self._rank.sig[RankSlot.SWAP_READY] = 0
        att = self._slot.current
        swap = att.swap if att is not None else self._kept_swap
        if swap is not None:
            for user in self._pool_users:  # before the pool is unmapped (idempotent)
                user.detach()
            swap.close(unlink=True)
        self.register_file.unlink(missing_ok=True)

    # ---------------------------------------------------------------- start-up / restart
    def expect_join(self, mode: RankState, layout: list[TensorDesc] | None) -> None:
        """A restarted daemon in a serving namespace (main thread, before serving): its
        next register settles in ``mode`` without the start-up barrier, and one not its
        predecessor's re-attach keeps ``layout`` (None: unknown): :meth:`_admit_join`."""
        with self._lock:
            self.joining = True
            self.settle_to = mode
            self._predecessor_layout = layout

    def _save(self, header: dict) -> None:
        """Keep the worker's last register message, so a restarted daemon can re-open
        the same tensors (shm names, or CUDA IPC handles that stay valid while the
        worker lives) without waiting for the worker."""
        tmp = self.register_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(packb({"backend": header["backend"], "tensors": header["tensors"]}))
        os.replace(tmp, self.register_file)
