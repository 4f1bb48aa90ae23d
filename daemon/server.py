"""The per-rank transfer daemon (``kvswapd``).

Threads and what each one owns:

* **I/O thread** (the main thread): the ZMQ ROUTER socket, the completion PAIR's
  receiving end and the signal wake-up fd.  It decodes every request, answers
  INLINE ops at once, validates SERIAL and TRANSFER ops completely (before any
  byte moves), hands them on, sends every reply, and is the single writer of
  the task counters in the signal segment.
* **control thread**: runs SERIAL jobs (``register``) in arrival order.
* **transfer workers** (:class:`~kvswap.daemon.scheduler.Scheduler`): run
  evicts and loads concurrently under hazard ordering, loads first, merging
  independent tasks of one direction into one copy pass.
* **heartbeat**: writes ``heartbeat_ns`` every ``heartbeat_interval_s``.

Workers hand completions back through a deque plus a wake-up on an inproc
PAIR, so only the I/O thread ever touches the ROUTER.

Shutdown (``shutdown`` op, SIGTERM or SIGINT): state STOPPING, new requests get
SHUTTING_DOWN, tasks that have not started are answered SHUTTING_DOWN, running
ones finish and are answered, then everything this daemon created is released
and it exits 0.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zmq

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, NotReady
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.layout import TensorDesc, demo_layout, validate_layout
from kvswap.client.naming import Names
from kvswap.client.protocol import (
    OPS,
    HandlerKind,
    Op,
    Request,
    RequestError,
    decode_batch,
    decode_id_pair,
    decode_request,
    decode_transfer,
    encode_reply,
    validate_transfer,
)
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import Barrier, R, RankState, SignalSegment, now_ns
from kvswap.daemon.backend import Backend, make_backend
from kvswap.daemon.scheduler import Scheduler, Task, concat_ids
from kvswap.daemon.state import StateMachine
from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon")

_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
_LIVE_STATES = frozenset({RankState.STARTING, RankState.ATTACHING, RankState.READY,
                          RankState.PAUSED, RankState.CLEARING, RankState.CLEARED,
                          RankState.STOPPING})


@dataclass
class DaemonConfig:
    namespace: str
    rank: int
    tp_size: int
    backend: str = "host"
    run_root: str | None = None
    host_blocks: int = 1024
    demo_caches: str | None = None  # demo layout spec ("" = defaults); None = wait for a worker
    attach_timeout_s: float = 300.0  # start-up barrier: all ranks attached
    heartbeat_interval_s: float = 0.1
    stale_after_s: float = 5.0
    max_message_bytes: int = 64 << 20
    device: int | None = None
    workers: int = 2  # transfer worker threads
    merge: bool = True  # merge independent queued tasks of one direction
    max_merge_blocks: int = 4096


@dataclass
class Job:
    ident: bytes | None  # ROUTER identity of the requester; None for internal jobs
    req_id: int
    op: Op
    t_recv: int
    header: dict = field(default_factory=dict)
    tensors: list[TensorDesc] = field(default_factory=list)


@dataclass
class Completion:
    job: Job
    code: ErrorCode
    message: str
    t_start: int
    t_end: int
    nbytes: int = 0
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Handler:
    """``run`` answers an INLINE op in the I/O thread (returning reply fields) or
    executes a SERIAL job on the control thread; TRANSFER ops have ``admit`` only,
    which validates in the I/O thread and hands the task to the scheduler."""

    run: Callable[[Job, Request | None], dict] | None = None
    admit: Callable[[Job, Request | None], None] | None = None


class DaemonError(Exception):
    """Start-up failure; the daemon exits with status 2."""


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.names = Names.of(cfg.namespace, cfg.run_root)
        self.rank = cfg.rank
        self._control: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: collections.deque[Completion] = collections.deque()
        self._done_lock = threading.Lock()
        self._stopping = False
        self._register_pending = False
        self._hb_stop = threading.Event()
        self._swap: HostSwapSpace | None = None
        self._scheduler: Scheduler | None = None
        self._demo_regions: list[ShmRegion] = []
        self._num_device_blocks = 0
        self._num_host_blocks = 0
        self._block_bytes = 0  # bytes of one block over every tensor
        self._layer_groups: list[list[int]] = []  # tensor indices per layer, by layer
        self._handlers: dict[Op, Handler] = {
            Op.REGISTER: Handler(run=self._run_register, admit=self._admit_register),
            Op.EVICT: Handler(admit=self._admit_transfer),
            Op.LOAD: Handler(admit=self._admit_transfer),
            Op.BATCH: Handler(run=self._run_batch),
            Op.CANCEL: Handler(run=self._run_cancel),
            Op.PING: Handler(run=self._run_ping),
            Op.STATS: Handler(run=self._run_stats),
            Op.SHUTDOWN: Handler(run=self._run_shutdown),
        }
        for op, spec in OPS.items():
            h = self._handlers.get(op)
            shape = {HandlerKind.INLINE: (True, False), HandlerKind.SERIAL: (True, True),
                     HandlerKind.TRANSFER: (False, True)}[spec.kind]
            if h is None or (h.run is not None, h.admit is not None) != shape:
                raise AssertionError(f"handler table does not match the op table for {op}")

    # ================================================================ life cycle
    def run(self) -> int:
        self._open_signals()
        self.backend: Backend = make_backend(self.cfg.backend, self.names, self.rank)
        self.sm = StateMachine(self.sig)
        self.sm.to(RankState.STARTING)
        self._hb_thread = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        self._hb_thread.start()
        self.ctx = zmq.Context(1)
        try:
            self._bind()
        except zmq.ZMQError as exc:
            self.sm.fail(ErrorCode.NAMESPACE_ERROR,
                         f"cannot bind {self.names.endpoint(self.rank)}: {exc}")
            self._close_process_resources()
            return 2
        self._control_thread = threading.Thread(target=self._control_loop, name="control",
                                                daemon=True)
        self._control_thread.start()
        self.sm.to(RankState.ATTACHING)
        log.info("serving %s (backend %s, tp %d, host blocks %d, epoch %d, pid %d)",
                 self.names.endpoint(self.rank), self.cfg.backend, self.cfg.tp_size,
                 self.cfg.host_blocks, self.sig[R.EPOCH], os.getpid())
        if self.cfg.demo_caches is not None:
            self._create_demo_caches()
        status = 0
        try:
            self._io_loop()
        except BaseException:
            log.exception("I/O loop crashed; stopping")
            status = 1
            raise
        finally:
            self._begin_stop("teardown")
            self._teardown()
        return status

    def _open_signals(self) -> None:
        self.seg = SignalSegment.attach(self.names)
        if self.seg.tp_size != self.cfg.tp_size:
            raise DaemonError(f"namespace {self.cfg.namespace!r} has tp_size {self.seg.tp_size}, "
                              f"daemon started with --tp {self.cfg.tp_size}")
        if not 0 <= self.rank < self.cfg.tp_size:
            raise DaemonError(f"rank {self.rank} out of range for tp {self.cfg.tp_size}")
        sig = self.seg.rank(self.rank)
        other = sig[R.PID]
        if (self.seg.state_of(self.rank) in _LIVE_STATES and other and other != os.getpid()
                and _pid_alive(other)):
            raise DaemonError(f"rank {self.rank} of namespace {self.cfg.namespace!r} is already "
                              f"served by pid {other}")
        self.sig = sig
        sig[R.STATE] = RankState.ABSENT
        sig[R.PID] = os.getpid()
        sig.add(R.EPOCH, 1)
        for f in (R.CACHE_READY, R.SWAP_READY, R.INFLIGHT, R.LAST_ERROR, R.SWAP_BYTES_TOTAL,
                  R.SWAP_BYTES_PINNED):
            sig[f] = 0
        sig[R.HEARTBEAT_NS] = now_ns()
        self.layers = LayerProgress(self.seg, self.rank)

    def _bind(self) -> None:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        self.router.setsockopt(zmq.LINGER, 2000)
        self.router.bind(self.names.endpoint(self.rank))
        os.chmod(self.names.endpoint_path(self.rank), 0o600)
        addr = f"inproc://kvswap-done-{id(self)}"
        self._done_rx = self.ctx.socket(zmq.PAIR)
        self._done_rx.bind(addr)
        self._done_tx = self.ctx.socket(zmq.PAIR)
        self._done_tx.connect(addr)
        # Signals arrive as bytes on a socketpair the poller watches, so the I/O
        # thread wakes at once without polling on a timer.
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for s in _STOP_SIGNALS:
            signal.signal(s, lambda *_: None)

    def _heartbeat(self) -> None:
        while not self._hb_stop.is_set():
            self.sig[R.HEARTBEAT_NS] = now_ns()
            self._hb_stop.wait(self.cfg.heartbeat_interval_s)

    def _begin_stop(self, why: str) -> None:
        if self._stopping:
            return
        log.info("stopping: %s", why)
        self._stopping = True
        if self.sm.state is not RankState.STOPPING:
            self.sm.to(RankState.STOPPING)
        self._control.put(None)
        if self._scheduler is not None:
            now = time.perf_counter_ns()
            for task in self._scheduler.stop():
                self._complete(Completion(task.ctx, ErrorCode.SHUTTING_DOWN,
                                          f"rank {self.rank} is shutting down", now, now))

    def _workers_done(self) -> bool:
        if self._control_thread.is_alive():
            return False
        return self._scheduler is None or self._scheduler.join(0)

    def _teardown(self) -> None:
        self._control_thread.join(timeout=60)
        if self._scheduler is not None and not self._scheduler.join(60):
            log.error("transfer workers did not finish within 60s")
        self.backend.detach()
        self.sig[R.CACHE_READY] = 0
        self.sig[R.SWAP_READY] = 0
        if self._swap is not None:
            self._swap.close(unlink=True)
            self._swap = None
        for region in self._demo_regions:
            region.unlink()
            region.close()
        self._demo_regions = []
        signal.set_wakeup_fd(-1)
        self._sig_r.close()
        self._sig_w.close()
        for s in (self._done_tx, self._done_rx, self.router):
            s.close()
        if self.sm.state is RankState.STOPPING:
            self.sm.to(RankState.STOPPED)
        self._close_process_resources()
        log.info("stopped")

    def _close_process_resources(self) -> None:
        self._hb_stop.set()
        self._hb_thread.join(timeout=5)
        self.ctx.term()
        self.layers.close()
        self.seg.close()

    # ================================================================ I/O thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._done_rx, zmq.POLLIN)
        poller.register(self._sig_r, zmq.POLLIN)
        while True:
            if self._stopping and self._workers_done():
                self._flush_completions()
                return
            events = dict(poller.poll(100 if self._stopping else 1000))
            if self._sig_r.fileno() in events:
                stops = [signal.Signals(s).name for s in self._sig_r.recv(64)
                         if s in _STOP_SIGNALS]
                if stops:
                    self._begin_stop(f"signal {', '.join(stops)}")
            if self._done_rx in events:
                self._flush_completions()
            if self.router in events:
                for _ in range(256):  # bounded, so completions are not starved
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_request(frames)

    def _reply(self, ident: bytes | None, req_id: int | None, code: ErrorCode, message: str = "",
               queued_us: float = 0.0, exec_us: float = 0.0, fields: dict | None = None) -> None:
        if ident is None:
            return
        body = encode_reply(req_id, self.rank, code, message, queued_us, exec_us, **(fields or {}))
        self.router.send_multipart([ident, body], copy=False)

    def _reject(self, ident: bytes | None, req_id: int | None, op: str, exc: KvswapError) -> None:
        log.warning("rejected %s %s: %s", op, req_id, exc)
        self.sig.add(R.FAILED, 1)
        self._reply(ident, req_id, exc.code, exc.message)

    def _on_request(self, frames: list) -> None:
        t_recv = time.perf_counter_ns()
        ident = frames[0].bytes
        try:
            req = decode_request([f.buffer for f in frames[1:]])
        except RequestError as exc:
            self._reject(ident, exc.req_id, "request", exc)
            return
        job = Job(ident, req.id, req.op, t_recv, req.header)
        handler = self._handlers[req.op]
        try:
            if handler.admit is None:
                assert handler.run is not None
                self._reply(ident, req.id, ErrorCode.OK, fields=handler.run(job, req))
            else:
                handler.admit(job, req)
        except KvswapError as exc:
            self._reject(ident, req.id, req.op.value, exc)

    def _complete(self, c: Completion) -> None:
        """Hand a completion to the I/O thread (any thread)."""
        self._done.append(c)
        with self._done_lock:
            self._done_tx.send(b"")

    def _flush_completions(self) -> None:
        while True:
            try:
                self._done_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self._done:
            c = self._done.popleft()
            job = c.job
            if job.ident is not None or job.op is not Op.REGISTER:
                self.sig.add(R.INFLIGHT, -1)
            if job.op in (Op.EVICT, Op.LOAD):
                if c.code == ErrorCode.OK:
                    self.sig.add(R.COMPLETED, 1)
                    self.sig.add(R.BYTES_EVICTED if job.op is Op.EVICT else R.BYTES_LOADED,
                                 c.nbytes)
                elif c.code != ErrorCode.CANCELLED:
                    self.sig.add(R.FAILED, 1)
            self._reply(job.ident, job.req_id, c.code, c.message,
                        queued_us=(c.t_start - job.t_recv) / 1e3,
                        exec_us=(c.t_end - c.t_start) / 1e3, fields=c.fields)

    # ================================================================ transfers
    def _check_serving(self) -> None:
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        state = self.sm.state
        if state is not RankState.READY:
            raise NotReady(f"rank {self.rank} is {state.name}, not READY")

    def _submit(self, job: Job, dev: np.ndarray, host: np.ndarray, fields: dict) -> None:
        """Validate one transfer and queue it (I/O thread)."""
        validate_transfer(job.op, dev, host, self._num_device_blocks, self._num_host_blocks)
        layerwise = bool(fields.get("layerwise", False))
        if layerwise and job.op is not Op.LOAD:
            raise InvalidTask("layerwise applies to load only", ErrorCode.BAD_FIELD)
        assert self._scheduler is not None
        self.sig.add(R.INFLIGHT, 1)
        self._scheduler.submit(job.op, dev, host, priority=int(fields.get("priority", 0)),
                               layerwise=layerwise, ctx=job)

    def _admit_transfer(self, job: Job, req: Request | None) -> None:
        self._check_serving()
        dev, host = decode_transfer(req)
        self._submit(job, dev, host, req.header)

    def _run_batch(self, job: Job, req: Request | None) -> dict:
        """Admit each task of a batch on its own: each is answered under its own id."""
        self._check_serving()
        accepted = 0
        for item in decode_batch(req):
            sub = Job(job.ident, item.id, item.op, job.t_recv)
            try:
                dev, host = decode_id_pair(item.op, req.header["ids"], item.fields["n"],
                                           item.device_frame, item.host_frame)
                self._submit(sub, dev, host, item.fields)
                accepted += 1
            except KvswapError as exc:
                self._reject(sub.ident, sub.req_id, sub.op.value, exc)
        return {"accepted": accepted}

    def _run_cancel(self, job: Job, req: Request | None) -> dict:
        target = req.header["target"]
        task = None
        if self._scheduler is not None:
            task = self._scheduler.cancel(
                lambda t: t.ctx.ident == job.ident and t.ctx.req_id == target)
        if task is None:
            return {"cancelled": False}
        now = time.perf_counter_ns()
        self._complete(Completion(task.ctx, ErrorCode.CANCELLED,
                                  f"task {target} cancelled before it started", now, now))
        return {"cancelled": True}

    def _execute(self, batch: list[Task]) -> None:
        """Run one batch of tasks (a transfer worker thread); never raises."""
        t_start = time.perf_counter_ns()
        op = batch[0].op
        try:
            if batch[0].layerwise:
                self._execute_layerwise(batch[0])
            else:
                dev, host = concat_ids(batch)
                self.backend.copy(op, dev, host)
        except Exception as exc:  # a copy that raised: report it on every task, keep serving
            log.exception("%s of %d task(s) failed", op.value, len(batch))
            t_end = time.perf_counter_ns()
            for t in batch:
                self._complete(Completion(t.ctx, ErrorCode.TRANSFER_FAILED,
                                          f"{type(exc).__name__}: {exc}", t_start, t_end))
            return
        t_end = time.perf_counter_ns()
        for t in batch:
            nbytes = t.num_blocks * self._block_bytes
            self._complete(Completion(t.ctx, ErrorCode.OK, "", t_start, t_end, nbytes,
                                      {"bytes": nbytes, "merged": len(batch)}))

    def _execute_layerwise(self, task: Task) -> None:
        entry = self.layers.begin(task.ctx.req_id, len(self._layer_groups))
        ok = False
        try:
            for i, tensors in enumerate(self._layer_groups):
                self.backend.copy(task.op, task.device_ids, task.host_ids, tensors)
                self.layers.advance(entry, i + 1)
            ok = True
        finally:
            self.layers.finish(entry, ok)

    # ================================================================ control
    def _control_loop(self) -> None:
        while True:
            job = self._control.get()
            if job is None:
                break
            t_start = time.perf_counter_ns()
            if self._stopping:
                self._complete(Completion(job, ErrorCode.SHUTTING_DOWN,
                                          f"rank {self.rank} is shutting down", t_start, t_start))
                continue
            handler = self._handlers[job.op]
            assert handler.run is not None
            try:
                fields = handler.run(job, None)
                c = Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(),
                               fields=fields)
            except KvswapError as exc:
                c = Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
            self._complete(c)
            if job.op is Op.REGISTER and c.code == ErrorCode.OK:
                self._startup_barrier()

    def _admit_register(self, job: Job, req: Request | None) -> None:
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        if self._register_pending or self.sm.state is not RankState.ATTACHING:
            raise KvswapError(f"rank {self.rank} already has caches registered "
                              f"(state {self.sm.state.name})", ErrorCode.ALREADY_REGISTERED)
        hdr = job.header
        if hdr["backend"] != self.cfg.backend:
            raise InvalidTask(f"rank {self.rank} runs the {self.cfg.backend} backend, the worker "
                              f"registered {hdr['backend']} tensors", ErrorCode.BAD_LAYOUT)
        job.tensors = [TensorDesc.from_wire(t) for t in hdr["tensors"]]
        validate_layout(job.tensors)
        self._register_pending = True
        if job.ident is not None:
            self.sig.add(R.INFLIGHT, 1)
        self._control.put(job)

    def _run_register(self, job: Job, req: Request | None) -> dict:
        tensors = job.tensors
        try:
            swap = HostSwapSpace.open(self.names, self.rank, tensors, self.cfg.host_blocks)
            try:
                self.backend.attach(tensors, swap)
            except BaseException:
                swap.close(unlink=not swap.reused)
                raise
        except BaseException:
            self._register_pending = False
            raise
        self._swap = swap
        self._num_device_blocks = tensors[0].num_blocks
        self._num_host_blocks = swap.num_host_blocks
        self._block_bytes = sum(t.bytes_per_block for t in tensors)
        layers = sorted({t.layer for t in tensors})
        self._layer_groups = [[i for i, t in enumerate(tensors) if t.layer == layer]
                              for layer in layers]
        self._scheduler = Scheduler(self._num_device_blocks, self._num_host_blocks, self._execute,
                                    workers=self.cfg.workers, merge=self.cfg.merge,
                                    max_merge_blocks=self.cfg.max_merge_blocks)
        self.sig[R.NUM_DEVICE_BLOCKS] = self._num_device_blocks
        self.sig[R.NUM_HOST_BLOCKS] = self._num_host_blocks
        self.sig[R.SWAP_BYTES_TOTAL] = swap.nbytes
        self.sig[R.SWAP_BYTES_PINNED] = swap.nbytes
        self.sig[R.CACHE_READY] = 1
        self.sig[R.SWAP_READY] = 1
        log.info("attached %d tensors in %d layers (%d device blocks, %.1f MiB host swap%s)",
                 len(tensors), len(layers), self._num_device_blocks, swap.nbytes / 2**20,
                 ", re-attached" if swap.reused else "")
        return {"num_device_blocks": self._num_device_blocks,
                "num_host_blocks": self._num_host_blocks}

    def _startup_barrier(self) -> None:
        """All ranks attached before any reports READY."""
        barrier = Barrier(self.seg, self.rank, stale_after_s=self.cfg.stale_after_s)
        try:
            barrier.wait(self.cfg.attach_timeout_s, what="start-up barrier",
                         cancelled=lambda: self._stopping)
        except KvswapError as exc:
            if not self._stopping:
                self.sm.fail(exc.code, exc.message)
            return
        finally:
            barrier.close()
        self.sm.to(RankState.READY, only_from=frozenset({RankState.ATTACHING}))

    def _create_demo_caches(self) -> None:
        """--demo-caches: create simulated device tensors here and register them
        through the same path a CacheWorker's register takes."""
        descs = []
        for t in demo_layout(self.cfg.demo_caches or None):
            nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
            region = ShmRegion.create(self.names.device_segment(self.rank, t.name), nbytes)
            self._demo_regions.append(region)
            descs.append(TensorDesc(t.name, t.layer, t.dtype, t.shape, {"shm": region.name}))
        header = {"backend": self.cfg.backend, "tensors": [d.to_wire() for d in descs]}
        self._admit_register(Job(None, 0, Op.REGISTER, time.perf_counter_ns(), header), None)

    # ================================================================ inline ops
    def _run_ping(self, job: Job, req: Request | None) -> dict:
        return {"state": self.sm.state.name, "epoch": self.sig[R.EPOCH], "pid": os.getpid()}

    def _run_stats(self, job: Job, req: Request | None) -> dict:
        counters = self.seg.snapshot()["ranks"][self.rank]
        if self._scheduler is not None:
            counters["merged_batches"] = self._scheduler.merged_batches
            counters["queued"] = self._scheduler.pending
        return {"counters": counters}

    def _run_shutdown(self, job: Job, req: Request | None) -> dict:
        self._begin_stop(f"shutdown requested (request {job.req_id})")
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
