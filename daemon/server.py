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
* **connection guard** (:mod:`kvswap.daemon.connections`): refuses connections
  before they use up the file descriptors.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import zmq

from kvswap.client.auth import AuthFailed, ReplayGuard, load_secret, sign, verify
from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, NotReady
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash, validate_layout
from kvswap.client.naming import Names
from kvswap.client.protocol import (
    MAX_FRAMES,
    OPS,
    HandlerKind,
    Lane,
    Op,
    Request,
    RequestError,
    decode_batch,
    decode_id_frame,
    decode_id_pair,
    decode_keys,
    decode_request,
    decode_transfer,
    encode_reply,
    max_frame_bytes,
    packb,
    validate_storage,
    validate_transfer,
)
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import (
    HIST_OPS,
    H,
    Barrier,
    KvCacheStatus,
    R,
    RankState,
    SignalSegment,
    now_ns,
    pid_alive,
    poll_until,
)
from kvswap.daemon import crashpoints
from kvswap.daemon.agreement import Agreement
from kvswap.daemon.backend import Backend, make_backend
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon.connections import ConnectionGuard
from kvswap.daemon.journal import JOURNALED_OPS, Journal
from kvswap.daemon.scheduler import Scheduler, Task, TaskState, concat_ids
from kvswap.daemon.state import StateMachine
from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon")

_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
STORAGE_OPS = frozenset(op for op, spec in OPS.items() if spec.lane is Lane.STORAGE)
_HIST_INDEX = {Op(name): i for i, name in enumerate(HIST_OPS)}


def _leading(flags: list[bool]) -> int:
    """Length of the prefix of True values."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
_LIVE_STATES = frozenset({RankState.STARTING, RankState.ATTACHING, RankState.READY,
                          RankState.PAUSED, RankState.CLEARING, RankState.CLEARED,
                          RankState.STOPPING})


@dataclass(frozen=True)
class Route:
    """Where a request came from: the socket, the peer's ROUTER identity, and whether
    the channel is signed (tcp://) so the reply must be too."""

    sock: zmq.Socket
    ident: bytes
    signed: bool = False


@dataclass
class Job:
    route: Route | None  # where the reply goes; None for internal jobs
    req_id: int
    op: Op
    t_recv: int
    header: dict = field(default_factory=dict)
    tensors: list[TensorDesc] = field(default_factory=list)
    rejoin: bool = False  # re-attach after a restart: the other ranks are READY, no barrier
    keys: np.ndarray | None = None  # storage ops: (n, 32) block keys
    jseq: int | None = None  # the task's completion-journal record, once admitted


@dataclass(frozen=True)
class Origin:
    """Who sent a message and whether it is a re-send (protocol fields cid, cs, re)."""

    cid: int = 0
    cs: int = 0
    resent: bool = False

    @classmethod
    def of(cls, header: dict) -> "Origin":
        return cls(header.get("cid", 0), header.get("cs", 0), header.get("re", False))


@dataclass
class Registration:
    """The register this rank is running or has run (see
    ``Daemon._answer_repeat_register``)."""

    tensors: list[dict]  # canonical descriptors (TensorDesc.to_wire), locations included
    reply: tuple[ErrorCode, str, dict] | None = None  # (code, message, fields) once it ended
    waiters: list[Job] = field(default_factory=list)  # repeats answered when it ends

    def difference(self, backend: str, header: dict) -> str:
        """How a register's header differs from this one ("" when it is the same)."""
        if header["backend"] != backend:
            return f"backend {header['backend']!r}, not {backend!r}"
        try:
            tensors = [TensorDesc.from_wire(t).to_wire() for t in header["tensors"]]
        except InvalidTask as exc:
            return f"its descriptors are invalid: {exc.message}"
        if len(tensors) != len(self.tensors):
            return f"{len(tensors)} tensors, not {len(self.tensors)}"
        for new, old in zip(tensors, self.tensors):
            if new != old:
                what = [k for k in old if new.get(k) != old[k]]
                return f"tensor {old['name']!r} differs in {', '.join(what)}"
        return ""


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
    """``run`` answers an INLINE op in the I/O thread (returning reply fields, or None
    when the reply comes later) or executes a SERIAL job on the control thread;
    TRANSFER ops have ``admit`` only, which validates in the I/O thread and hands the
    task to the scheduler."""

    run: Callable[[Job, Request | None], dict | None] | None = None
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
        self._registration: Registration | None = None  # guarded by _registration_lock
        self._registration_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._swap: HostSwapSpace | None = None
        self._scheduler: Scheduler | None = None
        self._demo_regions: dict[str, ShmRegion] = {}
        self._pause_waiters: list[Job] = []  # pause requests answered once drained
        if cfg.listen_tcp and not cfg.secret_file:
            raise DaemonError("a tcp:// listener needs --secret-file (HMAC-SHA256 shared secret)")
        self._secret = load_secret(cfg.secret_file) if cfg.listen_tcp else b""
        self._storage: Any = None  # a kvswap.daemon.storage.StorageBackend once registered
        self._journal: Journal | None = None  # opened in run(); outlives a crash
        self._fingerprint = b""
        self._tensor_spans: list[tuple[int, int, int]] = []  # (tensor, offset in entry, bytes)
        self._reported_corrupt: set[str] = set()
        self._stage: np.ndarray | None = None  # prefetch staging (storage thread)
        self._verifier = ThreadPoolExecutor(2, thread_name_prefix="kvswap-verify")
        self._replays = ReplayGuard(cfg.replay_window_s)
        self._num_device_blocks = 0
        self._num_host_blocks = 0
        self._block_bytes = 0  # bytes of one block over every tensor
        self._layer_groups: list[list[int]] = []  # tensor indices per layer, by layer
        self._handlers: dict[Op, Handler] = {
            Op.REGISTER: Handler(run=self._run_register, admit=self._admit_register),
            Op.EVICT: Handler(admit=self._admit_transfer),
            Op.LOAD: Handler(admit=self._admit_transfer),
            Op.BACKUP: Handler(admit=self._admit_storage),
            Op.PREFETCH: Handler(admit=self._admit_storage),
            Op.EXISTS: Handler(admit=self._admit_storage),
            Op.BATCH: Handler(run=self._run_batch),
            Op.CANCEL: Handler(run=self._run_cancel),
            Op.PAUSE: Handler(run=self._run_pause),
            Op.RESUME: Handler(run=self._run_resume),
            Op.CLEAR: Handler(run=self._run_clear, admit=self._admit_clear),
            Op.RESTORE: Handler(run=self._run_restore),
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
        crashpoints.configure(self.names.run_dir)
        self._journal = Journal.open(self.names, self.rank, self.cfg.journal_records,
                                     self.cfg.journal_mib << 20)
        if self._journal.reused:
            log.info("completion journal adopted (%d task(s) in doubt)", self._journal.admitted)
        self.backend: Backend = make_backend(self.cfg.backend, self.names, self.rank,
                                             device=self.cfg.device,
                                             on_pin_progress=self._on_pin_progress)
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
        log.info("serving %s (backend %s, tp %d, host pool %s, epoch %d, pid %d)",
                 self.names.endpoint(self.rank), self.cfg.backend, self.cfg.tp_size,
                 self.cfg.pool_text(), self.sig[R.EPOCH], os.getpid())
        self._attach_on_start()
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
                and pid_alive(other)):
            raise DaemonError(f"rank {self.rank} of namespace {self.cfg.namespace!r} is already "
                              f"served by pid {other}")
        self.sig = sig
        sig[R.STATE] = RankState.ABSENT
        sig[R.PID] = os.getpid()
        sig.add(R.EPOCH, 1)
        self._epoch = sig[R.EPOCH]
        for f in (R.CACHE_READY, R.SWAP_READY, R.INFLIGHT, R.LAST_ERROR, R.SWAP_BYTES_TOTAL,
                  R.SWAP_BYTES_PINNED):
            sig[f] = 0
        sig[R.HEARTBEAT_NS] = now_ns()
        self.layers = LayerProgress(self.seg, self.rank)
        self.stats = self.seg.stats(self.rank)
        self.agreement = Agreement(self.seg, self.rank, self.cfg.stale_after_s)

    def _bind(self) -> None:
        """Bind the ROUTER(s), each limited to frames a valid request can carry, and
        start the guard that refuses connections before file descriptors run out.

        libzmq 4.3.5 checks ``MAXMSGSIZE`` per frame, on the frame's length prefix
        (measured): a frame over it closes the connection before its body is
        buffered, while a message of many frames each under it passes.  libzmq
        delivers a multipart message only once all of it has arrived and sets no
        limit on the number of frames; :meth:`_recv` bounds what the daemon keeps
        of it.  docs/protocol.md section 2 states the resulting bounds."""
        self.max_frame_bytes = max_frame_bytes(self.cfg.max_device_blocks,
                                               self.cfg.host_blocks_bound)
        self.tcp_router: zmq.Socket | None = None
        self.router = self.ctx.socket(zmq.ROUTER)
        try:
            self.router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
            self.router.setsockopt(zmq.LINGER, 2000)
            self.router.bind(self.names.endpoint(self.rank))
            os.chmod(self.names.endpoint_path(self.rank), 0o600)
            if self.cfg.listen_tcp:
                self.tcp_router = self.ctx.socket(zmq.ROUTER)
                self.tcp_router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
                self.tcp_router.setsockopt(zmq.LINGER, 2000)
                self.tcp_router.bind(self.cfg.listen_tcp)
                log.info("also listening on %s (HMAC-SHA256 signed messages only)",
                         self.cfg.listen_tcp)
            self._guard = ConnectionGuard(self.ctx, [s for s in (self.router, self.tcp_router)
                                                     if s is not None])
        except zmq.ZMQError:
            for sock in (self.router, self.tcp_router):
                if sock is not None:
                    sock.close(linger=0)
            raise
        log.info("frames up to %d bytes (--max-device-blocks %d, at most %d host blocks); at "
                 "most %d frames kept per request; connections refused from file descriptor %d "
                 "of %d", self.max_frame_bytes, self.cfg.max_device_blocks,
                 self.cfg.host_blocks_bound, MAX_FRAMES, self._guard.threshold, self._guard.limit)
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
        next_orphan_check = 0.0
        while not self._hb_stop.is_set():
            self.sig[R.HEARTBEAT_NS] = now_ns()
            if time.monotonic() >= next_orphan_check:
                next_orphan_check = time.monotonic() + 1.0
                why = self._orphaned()
                if why:
                    log.warning("orphaned: %s; exiting", why)
                    os.kill(os.getpid(), signal.SIGTERM)  # the normal, clean stop path
                    return
            self._hb_stop.wait(self.cfg.heartbeat_interval_s)

    def _orphaned(self) -> str | None:
        """Why this daemon has nobody left to serve, or None.

        Orphaned = the launcher is gone AND the engine's heartbeat is older than
        ``orphan_timeout_s`` (or never came).  Either one alone is not enough: an
        engine may outlive a crashed launcher, and a launcher may wait for an
        engine that is still loading."""
        launcher = int(self.seg.header[H.LAUNCHER_PID])
        if pid_alive(launcher):
            return None
        beat = int(self.seg.header[H.ENGINE_HEARTBEAT_NS])
        age = (now_ns() - beat) / 1e9 if beat else None
        if age is not None and age <= self.cfg.orphan_timeout_s:
            return None
        engine = "never beat" if age is None else f"silent for {age:.0f}s"
        return f"launcher pid {launcher} is gone and the engine heartbeat {engine}"

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
                self._settle(Completion(task.ctx, ErrorCode.SHUTTING_DOWN,
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
        for region in self._demo_regions.values():
            region.unlink()
            region.close()
        self._demo_regions = {}
        self._registration_path().unlink(missing_ok=True)
        if self._storage is not None:
            self._storage.close()
            self._storage = None
        self._verifier.shutdown(wait=True)
        if self._journal is not None:
            in_doubt = self._journal.admitted
            if in_doubt:
                log.error("%d task(s) never finished; keeping the completion journal for the "
                          "next incarnation", in_doubt)
            self._journal.close(unlink=not in_doubt)
            self._journal = None
        self._guard.close()
        signal.set_wakeup_fd(-1)
        self._sig_r.close()
        self._sig_w.close()
        for s in (self._done_tx, self._done_rx, self.router, self.tcp_router):
            if s is not None:
                s.close()
        if self.sm.state is RankState.STOPPING:
            self.sm.to(RankState.STOPPED)
        self._close_process_resources()
        log.info("stopped")

    def _close_process_resources(self) -> None:
        if self._journal is not None:  # a failed start: keep it for the next incarnation
            self._journal.close(unlink=False)
            self._journal = None
        self._hb_stop.set()
        self._hb_thread.join(timeout=5)
        self.ctx.term()
        self.layers.close()
        self.agreement.close()
        self.seg.close()

    # ================================================================ I/O thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._done_rx, zmq.POLLIN)
        poller.register(self._sig_r, zmq.POLLIN)
        if self.tcp_router is not None:
            poller.register(self.tcp_router, zmq.POLLIN)
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
            for sock, signed in ((self.router, False), (self.tcp_router, True)):
                if sock is None or sock not in events:
                    continue
                for _ in range(256):  # bounded, so completions are not starved
                    message = self._recv(sock, signed)
                    if message is None:
                        break
                    self._on_request(*message, sock, signed)

    @staticmethod
    def _recv(sock: zmq.Socket, signed: bool) -> tuple[list, int] | None:
        """One message, read part by part: (its leading frames, the number of frames
        discarded past the limit), or None when none is waiting.

        At most the identity, the MAC (tcp://) and :data:`MAX_FRAMES` frames are
        kept; each later frame is released as soon as it is read, so an over-long
        message never makes the daemon hold more than that (libzmq still buffers
        the whole message before the first frame can be read: _bind)."""
        try:
            first = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        keep = 1 + int(signed) + MAX_FRAMES
        frames = [first]
        dropped = 0
        more = first.more
        while more:  # the rest is there already: libzmq delivers a message whole
            part = sock.recv(copy=False)
            more = part.more
            if len(frames) < keep:
                frames.append(part)
            else:
                dropped += 1
        return frames, dropped

    def _reply(self, route: Route | None, req_id: int | None, code: ErrorCode, message: str = "",
               queued_us: float = 0.0, exec_us: float = 0.0, fields: dict | None = None) -> None:
        if route is None:
            return
        body = encode_reply(req_id, self.rank, code, message, queued_us, exec_us, **(fields or {}))
        frames = sign(self._secret, [body]) if route.signed else [body]
        route.sock.send_multipart([route.ident, *frames], copy=False)

    def _reject(self, route: Route | None, req_id: int | None, op: str, exc: KvswapError) -> None:
        log.warning("rejected %s %s: %s", op, req_id, exc)
        self.sig.add(R.FAILED, 1)
        self.stats.error(exc.code)
        self._reply(route, req_id, exc.code, exc.message)

    def _on_request(self, frames: list, dropped: int, sock: zmq.Socket, signed: bool) -> None:
        t_recv = time.perf_counter_ns()
        route = Route(sock, frames[0].bytes, signed)
        if dropped:
            self._reject(route, None, "request", KvswapError(
                f"message of {len(frames) - 1 + dropped} frames; a request has at most "
                f"{MAX_FRAMES} (a header and two id frames per batch task"
                f"{', after the MAC' if signed else ''}), the rest were discarded unread",
                ErrorCode.MESSAGE_TOO_LARGE))
            return
        body = [f.buffer for f in frames[1:]]
        try:
            if signed:
                digest, body = verify(self._secret, body)
            req = decode_request(body)
            if signed:
                self._replays.check(digest, req.header.get("ts"))
        except RequestError as exc:
            self._reject(route, exc.req_id, "request", exc)
            return
        except AuthFailed as exc:
            self._reject(route, None, "request", exc)
            return
        job = Job(route, req.id, req.op, t_recv, req.header)
        handler = self._handlers[req.op]
        try:
            if handler.admit is None:
                assert handler.run is not None
                fields = handler.run(job, req)
                if fields is not None:
                    self._reply(route, req.id, ErrorCode.OK, fields=fields)
            else:
                handler.admit(job, req)
        except KvswapError as exc:
            self._reject(route, req.id, req.op.value, exc)
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("%s %s failed unexpectedly", req.op.value, req.id)
            self._reject(route, req.id, req.op.value,
                         KvswapError(f"{type(exc).__name__}: {exc}", ErrorCode.INTERNAL_ERROR))

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
            self._deliver(self._done.popleft())
        self._answer_pause_waiters()

    def _deliver(self, c: Completion) -> None:
        """Count a finished job and answer it (I/O thread)."""
        job = c.job
        if OPS[job.op].kind is HandlerKind.TRANSFER:
            self.sig.add(R.INFLIGHT, -1)
            if c.code == ErrorCode.OK:
                self.sig.add(R.COMPLETED, 1)
                if job.op in (Op.EVICT, Op.LOAD):
                    self.sig.add(R.BYTES_EVICTED if job.op is Op.EVICT else R.BYTES_LOADED,
                                 c.nbytes)
            elif c.code != ErrorCode.CANCELLED:
                self.sig.add(R.FAILED, 1)
            if c.code != ErrorCode.OK:
                self.stats.error(c.code)
            timed = _HIST_INDEX.get(job.op)
            if timed is not None:
                self.stats.record(timed, 0, (c.t_start - job.t_recv) / 1e3)
                self.stats.record(timed, 1, (c.t_end - c.t_start) / 1e3)
            crashpoints.hit("reply.before")
        self._reply(job.route, job.req_id, c.code, c.message,
                    queued_us=(c.t_start - job.t_recv) / 1e3,
                    exec_us=(c.t_end - c.t_start) / 1e3, fields=c.fields)
        if job.jseq is not None:
            crashpoints.hit("reply.after")

    def _answer_pause_waiters(self) -> None:
        if self._pause_waiters and self.sig[R.INFLIGHT] == 0:
            for job in self._pause_waiters:
                self._reply(job.route, job.req_id, ErrorCode.OK)
            self._pause_waiters = []

    # ================================================================ transfers
    def _check_serving(self) -> None:
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        state = self.sm.state
        if state is RankState.PAUSED:
            raise KvswapError(f"rank {self.rank} is PAUSED: resume() first", ErrorCode.PAUSED)
        if state in (RankState.CLEARING, RankState.CLEARED):
            raise KvswapError(f"rank {self.rank} is {state.name}: caches were cleared for a "
                              f"weight update; restore_caches() and re-register first",
                              ErrorCode.CLEARED)
        if state is not RankState.READY:
            raise NotReady(f"rank {self.rank} is {state.name}, not READY")

    def _check_epoch(self, header: dict) -> None:
        """Refuse what was addressed to an earlier incarnation of this rank."""
        ep = header.get("ep")
        if ep is not None and len(ep) > self.rank and ep[self.rank] != self._epoch:
            raise KvswapError(f"rank {self.rank} restarted: it is at epoch {self._epoch}, the "
                              f"task was addressed to epoch {ep[self.rank]}",
                              ErrorCode.RANK_RESTARTED)

    def _submit(self, job: Job, dev: np.ndarray, host: np.ndarray, fields: dict,
                origin: Origin) -> None:
        """Validate one transfer, journal it and queue it (I/O thread)."""
        validate_transfer(job.op, dev, host, self._num_device_blocks, self._num_host_blocks)
        layerwise = bool(fields.get("layerwise", False))
        if layerwise and job.op is not Op.LOAD:
            raise InvalidTask("layerwise applies to load only", ErrorCode.BAD_FIELD)
        assert self._scheduler is not None and self._journal is not None
        job.jseq = self._journal.admit(job.req_id, job.op, dev, host, layerwise=layerwise,
                                       cid=origin.cid, cs=origin.cs)
        self.sig.add(R.INFLIGHT, 1)
        small = dev.shape[0] * self._block_bytes <= self.cfg.inline_max_bytes
        task = self._scheduler.submit(job.op, dev, host, priority=int(fields.get("priority", 0)),
                                      layerwise=layerwise, ctx=job,
                                      claim_if_alone=small and not layerwise)
        if task.state is TaskState.RUNNING:
            # Small, ready, nothing else waiting: copy here and save two thread hand-offs.
            (done,) = self._execute([task])
            self._record(done)
            self._scheduler.finish([task])
            self._deliver(done)

    # ---------------------------------------------------------------- exactly once
    def _record(self, c: Completion) -> None:
        """Journal a task's outcome.  Called before its dependents are released and
        before its reply is sent: that order is what makes re-sends safe
        (daemon/journal.py)."""
        if c.job.jseq is not None:
            crashpoints.hit("record.before")
            assert self._journal is not None
            self._journal.finish(c.job.jseq, c.code, c.message, c.fields)

    def _settle(self, c: Completion) -> None:
        """Journal a completion and hand it to the I/O thread (any thread)."""
        self._record(c)
        self._complete(c)

    def _answer_resent(self, job: Job, origin: Origin) -> bool:
        """A re-sent task (I/O thread): answer it from the journal if an earlier
        incarnation admitted it and return True; False if it was never admitted
        here, so it runs now like a new task."""
        assert self._journal is not None
        found = self._journal.lookup(job.req_id)
        if found is None:
            if self._journal.forgotten(origin.cid, origin.cs):
                raise KvswapError(
                    f"task {job.req_id} was re-sent after a restart, and rank {self.rank}'s "
                    f"completion journal no longer holds records that old, so whether it ran "
                    f"cannot be proved; its destination blocks hold unknown content: submit a "
                    f"new task if its source still holds what you want", ErrorCode.OUTCOME_UNKNOWN)
            return False
        state, outcome = found
        if outcome is None:
            raise InvalidTask(f"task {job.req_id} was re-sent while it is still running on rank "
                              f"{self.rank}; it is answered once", ErrorCode.INVALID_TASK)
        fields = outcome.fields if outcome.code == ErrorCode.OK else {}
        self._reply(job.route, job.req_id, outcome.code, outcome.message,
                    fields={**fields, "journal": True})
        return True

    def _replay_in_doubt(self) -> None:
        """Control thread, after re-attaching and before READY: finish the tasks a
        crash interrupted, in admission order (why that is safe: daemon/journal.py)."""
        assert self._journal is not None
        for d in self._journal.in_doubt():
            job = Job(None, d.task_id, d.op, time.perf_counter_ns(), keys=d.keys)
            job.jseq = d.seq
            now = time.perf_counter_ns()
            if d.op is Op.PREFETCH:
                done = Completion(job, ErrorCode.OUTCOME_UNKNOWN,
                                  "a daemon crash interrupted this prefetch after the ranks "
                                  "agreed on it; its host blocks hold unknown content: "
                                  "prefetch again", now, now)
            else:
                try:
                    validate_transfer(d.op, d.device_ids, d.host_ids, self._num_device_blocks,
                                      self._num_host_blocks)
                except KvswapError as exc:
                    done = Completion(job, ErrorCode.OUTCOME_UNKNOWN,
                                      f"cannot replay after a crash: {exc.message}", now, now)
                else:
                    task = Task(-1, d.op, d.device_ids, d.host_ids, layerwise=d.layerwise,
                                ctx=job)
                    (done,) = self._execute([task])
            self._record(done)
            log.warning("replayed %s %d, interrupted by a crash: [%d] %s", d.op.value, d.task_id,
                        done.code, done.message or "OK")

    def _abandon_in_doubt(self) -> None:
        """A register of new tensors: tasks a crash interrupted cannot be replayed onto
        them; each is recorded OUTCOME_UNKNOWN so a re-send gets a clear answer."""
        assert self._journal is not None
        for d in self._journal.in_doubt():
            self._journal.finish(d.seq, ErrorCode.OUTCOME_UNKNOWN,
                                 "interrupted by a daemon crash; the caches were registered "
                                 "anew, so it was not replayed")
            log.warning("%s %d, interrupted by a crash, not replayed onto new caches",
                        d.op.value, d.task_id)

    def _admit_transfer(self, job: Job, req: Request | None) -> None:
        self._check_epoch(req.header)
        self._check_serving()
        origin = Origin.of(req.header)
        if origin.resent and self._answer_resent(job, origin):
            return
        dev, host = decode_transfer(req)
        self._submit(job, dev, host, req.header, origin)

    def _run_batch(self, job: Job, req: Request | None) -> dict:
        """Admit each task of a batch on its own: each is answered under its own id."""
        self._check_epoch(req.header)
        self._check_serving()
        origin = Origin.of(req.header)
        accepted = 0
        for item in decode_batch(req):
            sub = Job(job.route, item.id, item.op, job.t_recv)
            try:
                if origin.resent and self._answer_resent(sub, origin):
                    continue
                dev, host = decode_id_pair(item.op, req.header["ids"], item.fields["n"],
                                           item.device_frame, item.host_frame)
                self._submit(sub, dev, host, item.fields, origin)
                accepted += 1
            except KvswapError as exc:
                self._reject(sub.route, sub.req_id, sub.op.value, exc)
        return {"accepted": accepted}

    def _run_cancel(self, job: Job, req: Request | None) -> dict:
        target = req.header["target"]
        task = None
        if self._scheduler is not None:
            task = self._scheduler.cancel(
                lambda t: t.ctx.route == job.route and t.ctx.req_id == target)
        if task is None and self._scheduler is not None:
            running = self._scheduler.find(
                lambda t: t.ctx.route == job.route and t.ctx.req_id == target
                and t.op is Op.PREFETCH and t.state is TaskState.RUNNING)
            if running is not None:
                running.cancel_requested = True  # honoured at its next agreement step
                return {"cancelled": True}
        if task is None:
            return {"cancelled": False}
        now = time.perf_counter_ns()
        self._settle(Completion(task.ctx, ErrorCode.CANCELLED,
                                f"task {target} cancelled before it started", now, now))
        self._flush_completions()  # the task's CANCELLED reply precedes the cancel's reply
        return {"cancelled": True}

    def _run_batch_on_worker(self, batch: list[Task]) -> None:
        """The scheduler's ``run_batch`` (a transfer worker thread)."""
        for c in self._execute(batch):
            self._settle(c)

    def _execute(self, batch: list[Task]) -> list[Completion]:
        """Copy one batch of tasks; never raises (a failure is every task's outcome)."""
        if batch[0].op in STORAGE_OPS:
            return [self._execute_storage(t) for t in batch]
        t_start = time.perf_counter_ns()
        op = batch[0].op
        crashpoints.hit("copy.before")
        try:
            if batch[0].layerwise:
                self._execute_layerwise(batch[0])
            else:
                dev, host = concat_ids(batch)
                if crashpoints.armed("copy.mid"):  # fault injection: half the tensors, then die
                    self.backend.copy(op, dev, host, range(len(self._tensor_spans) // 2))
                    crashpoints.hit("copy.mid")
                self.backend.copy(op, dev, host)
        except Exception as exc:  # a copy that raised: report it on every task, keep serving
            log.exception("%s of %d task(s) failed", op.value, len(batch))
            t_end = time.perf_counter_ns()
            return [Completion(t.ctx, ErrorCode.TRANSFER_FAILED, f"{type(exc).__name__}: {exc}",
                               t_start, t_end) for t in batch]
        t_end = time.perf_counter_ns()
        out = []
        for t in batch:
            nbytes = t.num_blocks * self._block_bytes
            out.append(Completion(t.ctx, ErrorCode.OK, "", t_start, t_end, nbytes,
                                  {"bytes": nbytes, "merged": len(batch)}))
        return out

    def _execute_layerwise(self, task: Task) -> None:
        entry = self.layers.begin(task.ctx.req_id, len(self._layer_groups))
        ok = False
        try:
            for i, tensors in enumerate(self._layer_groups):
                self.backend.copy(task.op, task.device_ids, task.host_ids, tensors)
                self.layers.advance(entry, i + 1)
                crashpoints.hit("copy.mid")
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
                               fields=fields or {})
            except KvswapError as exc:
                c = Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
            except Exception as exc:  # a bug must cost one request, never the daemon
                log.exception("%s failed unexpectedly", job.op.value)
                c = Completion(job, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}",
                               t_start, time.perf_counter_ns())
            if job.route is None and c.code != ErrorCode.OK:
                log.warning("internal %s failed: [%d] %s", job.op.value, c.code, c.message)
            self._complete(c)
            if job.op is Op.REGISTER and c.code == ErrorCode.OK:
                if job.rejoin:
                    self._replay_in_doubt()
                    self._become_ready()
                else:
                    self._abandon_in_doubt()
                    self._startup_barrier()

    def _admit_register(self, job: Job, req: Request | None) -> None:
        """Queue a register for the control thread, or answer a repeat of the one in
        effect (:meth:`_answer_repeat_register`)."""
        if self._stopping:
            raise KvswapError(f"rank {self.rank} is shutting down", ErrorCode.SHUTTING_DOWN)
        hdr = job.header
        with self._registration_lock:
            state = self.sm.state
            if self._registration is not None or state is not RankState.ATTACHING:
                self._answer_repeat_register(job, state)
                return
            if hdr["backend"] != self.cfg.backend:
                raise InvalidTask(f"rank {self.rank} runs the {self.cfg.backend} backend, the "
                                  f"worker registered {hdr['backend']} tensors",
                                  ErrorCode.BAD_LAYOUT)
            job.tensors = [TensorDesc.from_wire(t) for t in hdr["tensors"]]
            blocks = validate_layout(job.tensors)
            if blocks > self.cfg.max_device_blocks:
                raise InvalidTask(
                    f"rank {self.rank}: the tensors have {blocks} blocks, more than kvswapd "
                    f"--max-device-blocks {self.cfg.max_device_blocks} (it sizes the socket's "
                    f"frame limit); relaunch with a larger --max-device-blocks",
                    ErrorCode.BAD_LAYOUT)
            self._registration = Registration([t.to_wire() for t in job.tensors])
        self._control.put(job)

    def _answer_repeat_register(self, job: Job, state: RankState) -> None:
        """A register on a rank that has one in effect (caller holds the lock).

        A worker whose register timed out on its side sends it again while the
        daemon has finished the first, or is still running it.  The same
        descriptors (locations included, so the very same memory) get the first
        one's answer: now, or from the control thread when it ends.  Anything else
        is ALREADY_REGISTERED: attached caches are only replaced through
        clear/restore."""
        reg = self._registration
        if state in (RankState.CLEARING, RankState.CLEARED):
            raise KvswapError(f"rank {self.rank} is {state.name}: its caches were released; "
                              f"call restore_caches() on the TransferClient, then register",
                              ErrorCode.ALREADY_REGISTERED)
        differs = "no register" if reg is None else reg.difference(self.cfg.backend, job.header)
        if differs:
            raise KvswapError(
                f"rank {self.rank} already has caches registered (state {state.name}) and this "
                f"register is not the same ({differs}); to attach other tensors call "
                f"clear_caches() then restore_caches() on the TransferClient and register "
                f"again, or relaunch the namespace", ErrorCode.ALREADY_REGISTERED)
        assert reg is not None
        if reg.reply is None:
            reg.waiters.append(job)
            log.info("register %s repeats the one being attached; answered when it ends",
                     job.req_id)
            return
        code, message, fields = reg.reply
        log.info("register %s repeats the one in effect; answered with its reply", job.req_id)
        self._reply(job.route, job.req_id, code, message, fields=fields)

    def _end_registration(self, code: ErrorCode, message: str, fields: dict,
                          attached: bool) -> None:
        """Record how the register ended and answer the repeats that waited for it
        (control thread).  Nothing attached: forget it, so a new register may try."""
        now = time.perf_counter_ns()
        with self._registration_lock:
            reg = self._registration
            assert reg is not None
            waiters, reg.waiters = reg.waiters, []
            reg.reply = (code, message, fields)
            if not attached:
                self._registration = None
        for waiter in waiters:
            self._complete(Completion(waiter, code, message, now, now, fields=fields))

    def _on_pin_progress(self, pinned: int) -> None:
        """Host swap space pinning progress (control thread, during attach)."""
        self.sig[R.SWAP_BYTES_PINNED] = pinned

    def _run_register(self, job: Job, req: Request | None) -> dict:
        """Attach the caches (control thread); repeats of this register that arrived
        meanwhile get the same answer."""
        try:
            fields = self._attach_caches(job)
        except KvswapError as exc:
            self._end_registration(exc.code, exc.message, {}, attached=self._swap is not None)
            raise
        except Exception as exc:  # the control loop logs it and answers INTERNAL_ERROR
            self._end_registration(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", {},
                                   attached=self._swap is not None)
            raise
        self._end_registration(ErrorCode.OK, "", fields, attached=True)
        return fields

    def _attach_caches(self, job: Job) -> dict:
        tensors = job.tensors
        if self._swap is not None:  # kept across clear(free_host=False): re-adopted below
            self._swap.close(unlink=False)
            self._swap = None
        swap = HostSwapSpace.open(self.names, self.rank, tensors, self.cfg.pool_blocks,
                                  host_bytes=self.cfg.host_size)
        self.sig[R.SWAP_BYTES_TOTAL] = swap.nbytes  # before attach: pinning reports progress
        try:
            if swap.num_host_blocks > self.cfg.host_blocks_bound:
                raise InvalidTask(
                    f"--host-size gives {swap.num_host_blocks} host blocks per tensor, more "
                    f"than --max-device-blocks {self.cfg.max_device_blocks}, which sizes the "
                    f"largest frame the socket accepts; relaunch with a larger "
                    f"--max-device-blocks or a smaller --host-size", ErrorCode.BAD_LAYOUT)
            self.backend.attach(tensors, swap)
        except BaseException:
            self.sig[R.SWAP_BYTES_TOTAL] = 0
            self.sig[R.SWAP_BYTES_PINNED] = 0
            swap.close(unlink=not swap.reused)
            raise
        self._swap = swap  # from here on the caches are attached (_run_register)
        self._num_device_blocks = tensors[0].num_blocks
        self._num_host_blocks = swap.num_host_blocks
        self._block_bytes = sum(t.bytes_per_block for t in tensors)
        layers = sorted({t.layer for t in tensors})
        self._layer_groups = [[i for i, t in enumerate(tensors) if t.layer == layer]
                              for layer in layers]
        if self.cfg.storage_url and self._storage is None:
            from kvswap.daemon.storage import open_backend

            self._storage = open_backend(self.cfg.storage_url)
            log.info("storage tier %s (model id %r)", self.cfg.storage_url, self.cfg.model_id)
        if self._storage is not None:
            from kvswap.client.block_keys import model_fingerprint

            # The TP size is part of the identity: with replicated KV heads two TP sizes
            # can give the same per-rank layout while rank r holds other heads.
            self._fingerprint = model_fingerprint(layout_hash(tensors),
                                                  f"{self.cfg.model_id}|tp={self.cfg.tp_size}")
        offsets = np.cumsum([0] + [t.bytes_per_block for t in tensors])
        self._tensor_spans = [(i, int(offsets[i]), t.bytes_per_block)
                              for i, t in enumerate(tensors)]
        self._scheduler = Scheduler(self._num_device_blocks, self._num_host_blocks,
                                    self._run_batch_on_worker,
                                    workers=self.cfg.workers, merge=self.cfg.merge,
                                    max_merge_blocks=self.cfg.max_merge_blocks,
                                    storage_workers=1 if self._storage is not None else 0)
        self.sig[R.NUM_DEVICE_BLOCKS] = self._num_device_blocks
        self.sig[R.NUM_HOST_BLOCKS] = self._num_host_blocks
        self.sig[R.SWAP_BYTES_TOTAL] = swap.nbytes
        self.sig[R.SWAP_BYTES_PINNED] = swap.nbytes
        self.sig[R.CACHE_READY] = 1
        self.sig[R.SWAP_READY] = 1
        if job.route is not None:
            self._save_registration(job.header)
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
        self._become_ready()

    def _become_ready(self) -> None:
        """ATTACHING -> READY; rank 0 writes the namespace's KvCacheStatus first, so a
        client that sees every rank READY (wait_ready) also sees NORMAL."""
        if self.rank == 0 and self.sm.state is RankState.ATTACHING:
            self.seg.header[H.KVCACHE_STATUS] = KvCacheStatus.NORMAL
        self.sm.to(RankState.READY, only_from=frozenset({RankState.ATTACHING}))

    # ---------------------------------------------------------------- start-up / restart
    def _registration_path(self) -> Path:
        return self.names.run_dir / f"rank{self.rank}.register"

    def _save_registration(self, header: dict) -> None:
        """Keep the worker's last register message, so a restarted daemon can re-open
        the same tensors (shm names, or CUDA IPC handles that stay valid while the
        worker lives) without waiting for the worker."""
        path = self._registration_path()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(packb({"backend": header["backend"], "tensors": header["tensors"]}))
        os.replace(tmp, path)

    def _attach_on_start(self) -> None:
        """First start: wait for a worker (or create demo caches).  Restart (epoch > 1):
        re-attach what the previous incarnation had, then go READY without the
        start-up barrier, which the other (READY) ranks will not enter again."""
        rejoin = self._epoch > 1
        if self.cfg.demo_caches is not None:
            self._create_demo_caches(rejoin)
            return
        path = self._registration_path()
        if not (rejoin and path.exists()):
            return
        try:
            header = msgpack.unpackb(path.read_bytes(), raw=False)
            job = Job(None, 0, Op.REGISTER, time.perf_counter_ns(), header, rejoin=True)
            self._admit_register(job, None)
            log.info("restart (epoch %d): re-attaching the caches registered before", self._epoch)
        except (KvswapError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            log.warning("restart: cannot re-attach from %s (%s); waiting for the worker to "
                        "register again", path, exc)

    def _create_demo_caches(self, rejoin: bool) -> None:
        """--demo-caches: simulated device tensors owned by this daemon, registered
        through the same path a CacheWorker's register takes.  Opened without
        O_EXCL so a restarted daemon finds its predecessor's tensors, contents intact
        (as GPU memory outlives a crashed transfer daemon)."""
        descs = []
        for t in demo_layout(self.cfg.demo_caches or None):
            name = self.names.device_segment(self.rank, t.name)
            if name not in self._demo_regions:
                nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
                self._demo_regions[name] = ShmRegion.create(name, nbytes, exclusive=False)
            descs.append(TensorDesc(t.name, t.layer, t.dtype, t.shape, {"shm": name}))
        header = {"backend": self.cfg.backend, "tensors": [d.to_wire() for d in descs]}
        self._admit_register(Job(None, 0, Op.REGISTER, time.perf_counter_ns(), header,
                                 rejoin=rejoin), None)

    # ================================================================ storage tier
    def _admit_storage(self, job: Job, req: Request | None) -> None:
        assert req is not None
        self._check_epoch(req.header)
        self._check_serving()
        origin = Origin.of(req.header)
        if req.op in JOURNALED_OPS and origin.resent and self._answer_resent(job, origin):
            return
        if self._storage is None:
            raise KvswapError(f"rank {self.rank} has no storage tier (kvswapd --storage URL)",
                              ErrorCode.STORAGE_ERROR)
        n = req.header["n"]
        if req.op is Op.EXISTS:
            host = np.empty(0, dtype=np.int64)
            job.keys = decode_keys(req.frames[0], n)
        else:
            if "ids" not in req.header or not isinstance(req.header["ids"], str):
                raise InvalidTask(f"{req.op.value}: missing field 'ids'", ErrorCode.BAD_FIELD)
            host = decode_id_frame(req.frames[0], req.header["ids"], "host ids")
            job.keys = decode_keys(req.frames[1], n)
            validate_storage(req.op, host, n, self._num_host_blocks)
        assert self._scheduler is not None and self._journal is not None
        if req.op in JOURNALED_OPS:  # exists changes nothing: running it twice is harmless
            job.jseq = self._journal.admit(job.req_id, req.op, np.empty(0, dtype=np.int64),
                                           host, keys=job.keys, cid=origin.cid, cs=origin.cs)
        self.sig.add(R.INFLIGHT, 1)
        self._scheduler.submit(req.op, np.empty(0, dtype=np.int64), host,
                               priority=int(req.header.get("priority", 0)), ctx=job)

    def _staging(self, n: int) -> list[memoryview]:
        """Reusable buffers for ``n`` entries (storage thread only): reading into
        memory already faulted in is several times faster than a fresh buffer each."""
        from kvswap.daemon.storage import HEADER_BYTES

        size = HEADER_BYTES + self._block_bytes
        if self._stage is None or self._stage.shape[0] < n or self._stage.shape[1] != size:
            self._stage = np.empty((max(n, 1), size), dtype=np.uint8)
        return [memoryview(self._stage[i]) for i in range(n)]

    def _entry_names(self, keys: np.ndarray) -> list[str]:
        from kvswap.client.block_keys import entry_name

        return [entry_name(k.tobytes(), self.rank, self._fingerprint) for k in keys]

    def _execute_storage(self, task: Task) -> Completion:
        """Run one backup / prefetch / exists (the storage worker); never raises."""
        job = task.ctx
        assert job.keys is not None and self._storage is not None
        t_start = time.perf_counter_ns()
        try:
            names = self._entry_names(job.keys)
            if task.op is Op.EXISTS:
                fields = {"count": _leading(self._storage.contains(names))}
            elif task.op is Op.BACKUP:
                stored = self._backup(task.host_ids, names)
                fields = {"count": stored, "skipped": len(names) - stored}
            else:
                fields = {"count": self._prefetch(task, names)}
        except KvswapError as exc:
            return Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
        except Exception as exc:  # a backend bug must cost one task, never the daemon
            log.exception("%s %s failed", task.op.value, job.req_id)
            return Completion(job, ErrorCode.STORAGE_ERROR, f"{type(exc).__name__}: {exc}",
                              t_start, time.perf_counter_ns())
        return Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(), fields=fields)

    def _backup(self, host_ids: np.ndarray, names: list[str]) -> int:
        from kvswap.daemon.storage import pack_entry

        assert self._storage is not None and self._swap is not None
        present = self._storage.contains(names)
        blocks = self._swap.blocks
        items = [(name, pack_entry(self._fingerprint, [b[h] for b in blocks]))
                 for name, h, there in zip(names, host_ids.tolist(), present) if not there]
        return sum(self._storage.put(items)) if items else 0

    def _prefetch(self, task: Task, names: list[str]) -> int:
        """Load the longest prefix every rank holds intact; return its length.

        Each rank reads and verifies its leading entries into a staging area,
        stopping at the first missing or corrupt one (never used).  Round 0 agrees
        on the minimum verified count; round 1 commits it (a rank may still cancel
        or give up while waiting in round 0, never after posting round 1).  Only
        then does each rank copy exactly that many into its host blocks."""
        from kvswap.daemon.storage import CorruptEntry, unpack_entry

        assert self._storage is not None and self._swap is not None
        task_id = task.ctx.req_id

        def cancelled() -> bool:
            return task.cancel_requested or self._stopping

        timeout = self.cfg.storage_timeout_s
        raws = self._storage.get(names, self._staging(len(names))) if names else []
        end = next((i for i, raw in enumerate(raws) if raw is None), len(raws))

        def check(raw: Any) -> memoryview | CorruptEntry:
            try:
                return unpack_entry(raw, self._fingerprint, self._block_bytes)
            except CorruptEntry as exc:
                return exc

        # checksums on two threads (zlib releases the GIL); keep the intact prefix
        verified = []
        for name, result in zip(names, self._verifier.map(check, raws[:end])):
            if isinstance(result, CorruptEntry):
                exc = result
                if name not in self._reported_corrupt and len(self._reported_corrupt) < 100_000:
                    self._reported_corrupt.add(name)
                    log.warning("storage entry %s is unusable (%s); treated as a miss and "
                                "deleted", name, exc)
                # stores never overwrite (a backup skips existing names): remove it so
                # the block can be backed up again
                self._storage.delete([name])
                break
            verified.append(result)
        agreed = self.agreement.agree(task_id, 0, len(verified), timeout, cancelled, last_round=1)
        final = self.agreement.agree(task_id, 1, agreed, timeout, cancelled, last_round=1)
        for host, payload in zip(task.host_ids.tolist()[:final], verified):
            for i, off, nbytes in self._tensor_spans:
                self._swap.blocks[i][host] = np.frombuffer(payload, np.uint8, nbytes, off)
        return final

    # ================================================================ pause / clear
    def _run_pause(self, job: Job, req: Request | None) -> dict | None:
        """READY -> PAUSED; answered once every accepted transfer has finished."""
        if self.sm.state is not RankState.PAUSED:
            if not self.sm.to(RankState.PAUSED, only_from=frozenset({RankState.READY})):
                raise NotReady(f"rank {self.rank} is {self.sm.state.name}; only a READY rank "
                               f"can pause")
        self._pause_waiters.append(job)
        self._answer_pause_waiters()
        return None

    def _run_resume(self, job: Job, req: Request | None) -> dict:
        if self.sm.state is RankState.READY:
            return {}
        if not self.sm.to(RankState.READY, only_from=frozenset({RankState.PAUSED})):
            raise NotReady(f"rank {self.rank} is {self.sm.state.name}, not PAUSED")
        return {}

    def _admit_clear(self, job: Job, req: Request | None) -> None:
        if not self.sm.to(RankState.CLEARING,
                          only_from=frozenset({RankState.READY, RankState.PAUSED})):
            raise NotReady(f"rank {self.rank} is {self.sm.state.name}; clear needs READY or "
                           f"PAUSED")
        if self.rank == 0:
            self.seg.header[H.KVCACHE_STATUS] = KvCacheStatus.CLEARING
        self._control.put(job)

    def _run_clear(self, job: Job, req: Request | None) -> dict:
        """Drain, release the device mappings (and the pool if asked), barrier: every
        rank reports CLEARED before any answers."""
        drained = poll_until(lambda: True if self.sig[R.INFLIGHT] == 0 else None,
                             time.monotonic() + self.cfg.drain_timeout_s)
        if drained is None:
            self.sm.fail(ErrorCode.RANK_TIMEOUT, "clear: tasks did not drain")
            raise KvswapError(f"rank {self.rank}: {self.sig[R.INFLIGHT]} task(s) still running "
                              f"after {self.cfg.drain_timeout_s:.0f}s", ErrorCode.RANK_TIMEOUT)
        assert self._scheduler is not None
        self._scheduler.stop()
        self._scheduler.join(self.cfg.drain_timeout_s)
        self._scheduler = None
        self.backend.detach()
        self.sig[R.CACHE_READY] = 0
        if job.header.get("free_host"):
            assert self._swap is not None
            self._swap.close(unlink=True)
            self._swap = None
            self.sig[R.SWAP_READY] = 0
            self.sig[R.SWAP_BYTES_TOTAL] = 0
            self.sig[R.SWAP_BYTES_PINNED] = 0
        self._registration_path().unlink(missing_ok=True)
        self.sm.to(RankState.CLEARED)
        barrier = Barrier(self.seg, self.rank, stale_after_s=self.cfg.stale_after_s)
        try:
            barrier.wait(self.cfg.attach_timeout_s, what="clear barrier",
                         cancelled=lambda: self._stopping)
        finally:
            barrier.close()
        if self.rank == 0:
            self.seg.header[H.KVCACHE_STATUS] = KvCacheStatus.CLEARED
        return {}

    def _run_restore(self, job: Job, req: Request | None) -> dict:
        """CLEARED -> ATTACHING: the worker registers its (new) tensors next."""
        if not self.sm.to(RankState.ATTACHING, only_from=frozenset({RankState.CLEARED})):
            raise NotReady(f"rank {self.rank} is {self.sm.state.name}, not CLEARED")
        with self._registration_lock:
            self._registration = None
        if self.cfg.demo_caches is not None:
            self._create_demo_caches(rejoin=False)
        return {}

    # ================================================================ inline ops
    def _run_ping(self, job: Job, req: Request | None) -> dict:
        return {"state": self.sm.state.name, "epoch": self.sig[R.EPOCH], "pid": os.getpid()}

    def _run_stats(self, job: Job, req: Request | None) -> dict:
        counters = self.seg.rank_snapshot(self.rank)
        if self._scheduler is not None:
            counters["merged_batches"] = self._scheduler.merged_batches
            counters["queued"] = self._scheduler.pending
        return {"counters": counters}

    def _run_shutdown(self, job: Job, req: Request | None) -> dict:
        self._begin_stop(f"shutdown requested (request {job.req_id})")
        return {}
