"""The per-rank transfer daemon (``kvswapd``).

Threads and what each one owns:

* **I/O thread** (the main thread): the ZMQ ROUTER socket, the completion PAIR's
  receiving end and the signal wake-up fd.  It decodes every request, answers
  INLINE ops at once, validates SERIAL ops completely (before any byte moves),
  queues them, sends every reply, and is the single writer of the task counters
  in the signal segment.
* **executor**: runs SERIAL jobs (register, evict, load) one at a time in
  submission order, then hands a completion back through an inproc PAIR.
* **heartbeat**: writes ``heartbeat_ns`` every ``heartbeat_interval_s``.

Shutdown (``shutdown`` op, SIGTERM or SIGINT): state STOPPING, new requests get
SHUTTING_DOWN, queued jobs are answered SHUTTING_DOWN, the running job finishes
and is answered, then everything this daemon created is released and it exits 0.
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
from typing import Callable

import numpy as np
import zmq

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, NotReady
from kvswap.client.layout import TensorDesc, demo_layout, validate_layout
from kvswap.client.naming import Names
from kvswap.client.protocol import (
    OPS,
    HandlerKind,
    Op,
    Request,
    RequestError,
    decode_request,
    decode_transfer,
    encode_reply,
    validate_transfer,
)
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import Barrier, R, RankState, SignalSegment, now_ns
from kvswap.daemon.backend import Backend, make_backend
from kvswap.daemon.state import StateMachine
from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon")

_LIVE_STATES = frozenset({RankState.STARTING, RankState.ATTACHING, RankState.READY,
                          RankState.PAUSED, RankState.CLEARING, RankState.CLEARED,
                          RankState.STOPPING})


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


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


@dataclass
class Job:
    ident: bytes | None  # ROUTER identity of the requester; None for internal jobs
    req: Request
    t_recv: int
    device_ids: np.ndarray | None = None
    host_ids: np.ndarray | None = None
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
    """``run`` executes the op (I/O thread for INLINE ops, executor for SERIAL ones)
    and returns extra reply fields; ``admit`` (SERIAL only) validates a job in the
    I/O thread and raises :class:`KvswapError` to reject it before it is queued."""

    run: Callable[[Job], dict]
    admit: Callable[[Job], None] | None = None


class DaemonError(Exception):
    """Start-up failure; the daemon exits with status 2."""


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.names = Names.of(cfg.namespace, cfg.run_root)
        self.rank = cfg.rank
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: collections.deque[Completion] = collections.deque()
        self._stopping = False
        self._register_pending = False
        self._hb_stop = threading.Event()
        self._swap: HostSwapSpace | None = None
        self._demo_regions: list[ShmRegion] = []
        self._num_device_blocks = 0
        self._num_host_blocks = 0
        self._handlers: dict[Op, Handler] = {
            Op.REGISTER: Handler(self._run_register, self._admit_register),
            Op.EVICT: Handler(self._run_transfer, self._admit_transfer),
            Op.LOAD: Handler(self._run_transfer, self._admit_transfer),
            Op.PING: Handler(self._run_ping),
            Op.STATS: Handler(self._run_stats),
            Op.SHUTDOWN: Handler(self._run_shutdown),
        }
        for op, spec in OPS.items():
            h = self._handlers.get(op)
            if h is None or (h.admit is None) != (spec.kind is HandlerKind.INLINE):
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
            self.sm.fail(ErrorCode.NAMESPACE_ERROR, f"cannot bind {self.names.endpoint(self.rank)}: "
                                                     f"{exc}")
            self._close_process_resources()
            return 2
        self._executor = threading.Thread(target=self._execute_loop, name="executor",
                                          daemon=True)
        self._executor.start()
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
        self._jobs.put(None)

    def _teardown(self) -> None:
        self._executor.join(timeout=60)
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
        self.seg.close()

    # ================================================================ I/O thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._done_rx, zmq.POLLIN)
        poller.register(self._sig_r, zmq.POLLIN)
        while True:
            if self._stopping and not self._executor.is_alive():
                self._flush_completions()
                return
            events = dict(poller.poll(1000))
            if self._sig_r.fileno() in events:
                stops = [signal.Signals(s).name for s in self._sig_r.recv(64) if s in _STOP_SIGNALS]
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

    def _on_request(self, frames: list) -> None:
        t_recv = time.perf_counter_ns()
        ident = frames[0].bytes
        try:
            req = decode_request([f.buffer for f in frames[1:]])
        except RequestError as exc:
            log.warning("rejected malformed request: %s", exc)
            self.sig.add(R.FAILED, 1)
            self._reply(ident, exc.req_id, exc.code, exc.message)
            return
        job = Job(ident, req, t_recv)
        handler = self._handlers[req.op]
        try:
            if handler.admit is None:
                fields = handler.run(job)
                self._reply(ident, req.id, ErrorCode.OK, fields=fields)
                return
            handler.admit(job)
        except KvswapError as exc:
            log.warning("rejected %s %d: %s", req.op.value, req.id, exc)
            self.sig.add(R.FAILED, 1)
            self._reply(ident, req.id, exc.code, exc.message)
            return
        self.sig.add(R.INFLIGHT, 1)
        self._jobs.put(job)

    def _flush_completions(self) -> None:
        while True:
            try:
                self._done_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self._done:
            c = self._done.popleft()
            job = c.job
            if job.req.op in (Op.EVICT, Op.LOAD):
                self.sig.add(R.INFLIGHT, -1)
                if c.code == ErrorCode.OK:
                    self.sig.add(R.COMPLETED, 1)
                    self.sig.add(R.BYTES_EVICTED if job.req.op is Op.EVICT else R.BYTES_LOADED,
                                 c.nbytes)
                else:
                    self.sig.add(R.FAILED, 1)
            elif job.ident is not None:
                self.sig.add(R.INFLIGHT, -1)
            self._reply(job.ident, job.req.id, c.code, c.message,
                        queued_us=(c.t_start - job.t_recv) / 1e3,
                        exec_us=(c.t_end - c.t_start) / 1e3, fields=c.fields)

    # ================================================================ executor
    def _execute_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            t_start = time.perf_counter_ns()
            if self._stopping:
                self._complete(Completion(job, ErrorCode.SHUTTING_DOWN,
                                          f"rank {self.rank} is shutting down", t_start, t_start))
                continue
            handler = self._handlers[job.req.op]
            try:
                fields = handler.run(job)
                nbytes = fields.get("bytes", 0)
                c = Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(), nbytes,
                               fields)
            except KvswapError as exc:
                c = Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
            except Exception as exc:  # a copy that raised: report it, keep serving
                log.exception("%s %s failed", job.req.op.value, job.req.id)
                c = Completion(job, ErrorCode.TRANSFER_FAILED, f"{type(exc).__name__}: {exc}",
                               t_start, time.perf_counter_ns())
            self._complete(c)
            if job.req.op is Op.REGISTER and c.code == ErrorCode.OK:
                self._startup_barrier()
        self._done_tx.send(b"")

    def _complete(self, c: Completion) -> None:
        self._done.append(c)
        self._done_tx.send(b"")

    # ================================================================ handlers
    def _run_ping(self, job: Job) -> dict:
        return {"state": self.sm.state.name, "epoch": self.sig[R.EPOCH], "pid": os.getpid()}

    def _run_stats(self, job: Job) -> dict:
        snap = self.seg.snapshot()["ranks"][self.rank]
        return {"counters": snap}

    def _run_shutdown(self, job: Job) -> dict:
        self._begin_stop(f"shutdown requested (request {job.req.id})")
        return {}

    def _check_serving(self) -> None:
        state = self.sm.state
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        if state is not RankState.READY:
            raise NotReady(f"rank {self.rank} is {state.name}, not READY")

    def _admit_transfer(self, job: Job) -> None:
        self._check_serving()
        dev, host = decode_transfer(job.req)
        validate_transfer(job.req.op, dev, host, self._num_device_blocks, self._num_host_blocks)
        job.device_ids, job.host_ids = dev, host

    def _run_transfer(self, job: Job) -> dict:
        assert job.device_ids is not None and job.host_ids is not None
        return {"bytes": self.backend.copy(job.req.op, job.device_ids, job.host_ids)}

    def _admit_register(self, job: Job) -> None:
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        if self._register_pending or self.sm.state is not RankState.ATTACHING:
            raise KvswapError(f"rank {self.rank} already has caches registered "
                              f"(state {self.sm.state.name})", ErrorCode.ALREADY_REGISTERED)
        hdr = job.req.header
        if hdr["backend"] != self.cfg.backend:
            raise InvalidTask(f"rank {self.rank} runs the {self.cfg.backend} backend, the worker "
                              f"registered {hdr['backend']} tensors", ErrorCode.BAD_LAYOUT)
        job.tensors = [TensorDesc.from_wire(t) for t in hdr["tensors"]]
        validate_layout(job.tensors)
        self._register_pending = True

    def _run_register(self, job: Job) -> dict:
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
        self.sig[R.NUM_DEVICE_BLOCKS] = self._num_device_blocks
        self.sig[R.NUM_HOST_BLOCKS] = self._num_host_blocks
        self.sig[R.SWAP_BYTES_TOTAL] = swap.nbytes
        self.sig[R.SWAP_BYTES_PINNED] = swap.nbytes
        self.sig[R.CACHE_READY] = 1
        self.sig[R.SWAP_READY] = 1
        log.info("attached %d tensors (%d device blocks, %.1f MiB host swap%s)", len(tensors),
                 self._num_device_blocks, swap.nbytes / 2**20,
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
        wire = {"backend": self.cfg.backend, "tensors": [d.to_wire() for d in descs]}
        job = Job(None, Request(0, Op.REGISTER, wire, []), time.perf_counter_ns())
        self._admit_register(job)
        self._jobs.put(job)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
