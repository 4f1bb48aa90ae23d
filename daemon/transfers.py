"""Evicts and loads: admission (I/O thread), cancel, batches, and execution.

Admission validates a task completely before any byte moves, journals it and
hands it to the scheduler of the current attachment.  A small task that is
ready with nothing else waiting is *claimed* by the I/O thread, which copies it
itself (two thread hand-offs cost more than the copy); everything else runs on
a transfer worker (:meth:`Transfers.run_batch`), which also hands storage ops
to the storage service.

Claimed tasks are copied at the end of the burst of requests the I/O thread is
serving (:meth:`Transfers.copy_claimed`), all of one direction in one pass, as
a worker copies a merged batch.  That is safe for the same reason: a task that
overlaps a claimed one depends on it and so is never claimed itself (the
scheduler's hazard table), so the claimed tasks of a burst are independent.
Each task is journalled at admission and its outcome recorded before its
dependents are released and before its reply, as on the workers, so a crash
between the two leaves it in doubt and replayed (daemon/exactly_once.py).
The I/O loop copies them before it serves a request of any other op
(``Handler.claims``): a cancel, pause or clear finds them done, as it found a
task copied the moment it was admitted.  A burst of 64 one-block tasks spends
one copy call, one plan and one finish instead of 64.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import (
    Op,
    Request,
    decode_batch,
    decode_id_pair,
    decode_transfer,
    validate_transfer,
)
from kvswap.client.signals import RankSlot
from kvswap.daemon import crashpoints
from kvswap.daemon.attachment import Attachment, AttachmentSlot
from kvswap.daemon.backend import Backend
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.io_loop import IoLoop
from kvswap.daemon.jobs import PEER_OPS, STORAGE_OPS, Completion, Job, Origin
from kvswap.daemon.peer_ops import PeerOps
from kvswap.daemon.rank import RankContext
from kvswap.daemon.scheduler import Task, TaskState, concat_ids
from kvswap.daemon.storage_service import StorageService

log = logging.getLogger("kvswap.daemon")


class Transfers:
    """Admission and execution of evict, load, batch and cancel."""

    def __init__(self, rank: RankContext, backend: Backend, io: IoLoop, slot: AttachmentSlot,
                 exactly: ExactlyOnce, storage: StorageService, peer: PeerOps):
        self._rank = rank
        self._backend = backend
        self._io = io
        self._slot = slot
        self._exactly = exactly
        self._storage = storage
        self._peer = peer
        # I/O thread only: tasks the scheduler returned claimed, not copied yet (one
        # direction, one attachment, at most --max-merge-blocks blocks)
        self._claimed: list[Task] = []
        self._claimed_blocks = 0

    # ---------------------------------------------------------------- I/O thread
    def admit(self, job: Job, req: Request | None) -> None:
        assert req is not None
        origin = self._exactly.begin_admission(job, req.header)
        if origin is None:
            return
        dev, host = decode_transfer(req)
        self._submit(job, dev, host, req.header, origin)

    def run_batch_request(self, job: Job, req: Request | None) -> dict:
        """Admit each task of a batch on its own: each is answered under its own id."""
        assert req is not None
        self._rank.check_epoch(req.header)
        origin = Origin.of(req.header)
        if not origin.resent:
            self._rank.check_serving()
        accepted = 0
        for item in decode_batch(req):
            sub = Job(job.route, item.id, item.op, job.t_recv)
            try:
                if origin.resent:  # recorded outcomes first, in any mode (answer_recorded)
                    if self._exactly.answer_recorded(sub):
                        continue
                    self._rank.check_serving()
                    if self._exactly.answer_resent(sub, origin):
                        continue
                dev, host = decode_id_pair(item.op, req.header["ids"], item.fields["n"],
                                           item.device_frame, item.host_frame)
                self._submit(sub, dev, host, item.fields, origin)
                accepted += 1
            except KvswapError as exc:
                self._io.reject(sub.route, sub.req_id, sub.op.value, exc)
        return {"accepted": accepted}

    def _submit(self, job: Job, dev: np.ndarray, host: np.ndarray, fields: dict,
                origin: Origin) -> None:
        """Validate one transfer, journal it and queue it."""
        att = self._slot.current
        assert att is not None  # READY implies attached
        validate_transfer(job.op, dev, host, att.num_device_blocks, att.num_host_blocks)
        layerwise = bool(fields.get("layerwise", False))
        if layerwise and job.op is not Op.LOAD:
            raise InvalidTask("layerwise applies to load only", ErrorCode.BAD_FIELD)
        self._exactly.admit(job, origin, dev, host, layerwise=layerwise)
        self._rank.sig.add(RankSlot.INFLIGHT, 1)
        blocks = dev.shape[0]
        small = blocks * att.block_bytes <= self._rank.cfg.inline_max_bytes
        if self._claimed and (self._claimed[0].op is not job.op or self._claimed_blocks + blocks
                              > att.scheduler.max_merge_blocks):
            self.copy_claimed()
        task = att.scheduler.submit(job.op, dev, host, priority=int(fields.get("priority", 0)),
                                    layerwise=layerwise, ctx=job,
                                    claim_if_alone=small and not layerwise)
        if task.claimed:
            # Copied by this thread at the end of the burst (or now, with merging off).
            # (``claimed``, not the state: a queued task may already be RUNNING on a worker.)
            self._claimed.append(task)
            self._claimed_blocks += blocks
            if not att.scheduler.merge:
                self.copy_claimed()

    def copy_claimed(self) -> None:
        """Copy the claimed tasks in one pass, journal their outcomes, release their
        dependents and answer them (I/O thread: the end of a burst, and before a
        request of another kind)."""
        batch = self._claimed
        if not batch:
            return
        self._claimed, self._claimed_blocks = [], 0
        att = self._slot.current
        assert att is not None  # nothing that detaches is served while tasks are claimed
        done = self.execute(batch, att)
        for c in done:
            self._exactly.record(c)
        att.scheduler.finish(batch)
        for c in done:
            self._io.deliver(c)

    def cancel(self, job: Job, req: Request | None) -> dict:
        assert req is not None
        target = req.header["target"]
        att = self._slot.current
        if att is None:
            return {"cancelled": False}

        def mine(t: Task) -> bool:
            return t.ctx.route == job.route and t.ctx.req_id == target

        task = att.scheduler.cancel(mine)
        if task is not None and task.op in PEER_OPS:
            self._peer.cancel(task)  # dropped before it started: forget its ticket
        if task is None:
            held = att.scheduler.find(
                lambda t: mine(t) and t.op is Op.PEER_RECV and t.state is TaskState.RUNNING)
            if held is not None:
                cancelled = self._peer.cancel(held)
                self._io.flush_completions()  # its CANCELLED reply precedes the cancel's
                return {"cancelled": cancelled}
            running = att.scheduler.find(
                lambda t: mine(t) and t.op is Op.PREFETCH and t.state is TaskState.RUNNING)
            if running is not None:
                running.cancel_requested = True  # honoured at its next agreement step
                return {"cancelled": True}
            return {"cancelled": False}
        now = time.perf_counter_ns()
        self._exactly.settle(Completion.now(task.ctx, ErrorCode.CANCELLED,
                                            f"task {target} cancelled before it started", now))
        self._io.flush_completions()  # the task's CANCELLED reply precedes the cancel's reply
        return {"cancelled": True}

    # ---------------------------------------------------------------- workers
    def run_batch(self, batch: list[Task]) -> None:
        """The scheduler's ``run_batch`` (a transfer, storage or peer worker thread).

        Each lane's ``execute`` turns a failure into its tasks' outcomes, so what
        raises here is a bug in the bookkeeping (journal, replies).  A worker it killed
        would leave its tasks unanswered and their blocks held while the rank looked
        READY; the rank fails instead (logged with the traceback), so its supervisor
        restarts it and the clients re-send what it owed (docs/protocol.md section 14).
        The worker lives on, so the scheduler still releases the batch."""
        att = self._slot.current
        assert att is not None  # clear drains every task before it unpublishes
        try:
            for c in self.execute(batch, att):
                self._exactly.settle(c)
        except Exception as exc:
            log.exception("rank %d: settling a batch of %d %s task(s) failed", self._rank.index,
                          len(batch), batch[0].op.value)
            self._rank.sm.fail(ErrorCode.INTERNAL_ERROR,
                               f"a worker failed settling {batch[0].op.value} tasks "
                               f"({type(exc).__name__}: {exc}); the rank restarts")

    def execute(self, batch: list[Task], att: Attachment) -> list[Completion]:
        """Copy one batch of tasks; never raises (a failure is every task's outcome)."""
        if batch[0].op in STORAGE_OPS:
            return [self._storage.execute(t, att) for t in batch]
        if batch[0].op in PEER_OPS:
            return self._peer.execute(batch, att)
        t_start = time.perf_counter_ns()
        op = batch[0].op
        crashpoints.hit("copy.before")
        try:
            if batch[0].layerwise:
                self._execute_layerwise(batch[0], att)
            else:
                dev, host = concat_ids(batch)
                if crashpoints.armed("copy.mid"):  # fault injection: half the tensors, then die
                    self._backend.copy(op, dev, host, range(len(att.tensor_spans) // 2))
                    crashpoints.hit("copy.mid")
                self._backend.copy(op, dev, host)
        except Exception as exc:  # a copy that raised: report it on every task, keep serving
            log.exception("%s of %d task(s) failed", op.value, len(batch))
            t_end = time.perf_counter_ns()
            return [Completion(t.ctx, ErrorCode.TRANSFER_FAILED, f"{type(exc).__name__}: {exc}",
                               t_start, t_end) for t in batch]
        t_end = time.perf_counter_ns()
        out = []
        for t in batch:
            nbytes = t.num_blocks * att.block_bytes
            out.append(Completion(t.ctx, ErrorCode.OK, "", t_start, t_end, nbytes,
                                  {"bytes": nbytes, "merged": len(batch)}))
        return out

    def _execute_layerwise(self, task: Task, att: Attachment) -> None:
        layers = self._rank.layers
        entry = layers.begin(task.ctx.req_id, len(att.layer_groups))
        ok = False
        try:
            for i, tensors in enumerate(att.layer_groups):
                self._backend.copy(task.op, task.device_ids, task.host_ids, list(tensors))
                layers.advance(entry, i + 1)
                crashpoints.hit("copy.mid")
            ok = True
        finally:
            layers.finish(entry, ok)
