"""The I/O thread: the only thread that touches the ROUTER socket(s).

It reads each request (bounded: :meth:`IoLoop._recv`), verifies and decodes it,
routes it through the handler table built from the op table, sends every reply,
and counts finished tasks in the signal segment (it is their single writer).
Other threads hand their completions over with :meth:`IoLoop.complete`
(:class:`CompletionQueue`: a deque plus a wake-up on an inproc PAIR the poller
watches, which never blocks).  Stop signals arrive as
bytes on a socketpair the poller also watches, so the thread wakes at once
without a timer.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import threading
import time
from typing import Callable

import zmq

from kvswap.client.auth import AuthFailed, ReplayGuard, sign, verify
from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.protocol import (
    MAX_FRAMES,
    OPS,
    HandlerKind,
    Op,
    RequestError,
    decode_request,
    encode_reply,
    max_frame_bytes,
    peek_request_id,
)
from kvswap.client.signals import HIST_OPS, RankSlot
from kvswap.daemon import crashpoints
from kvswap.daemon.connections import ConnectionGuard
from kvswap.daemon.jobs import Completion, Handler, Job, Route
from kvswap.daemon.rank import RankContext
from kvswap.daemon.ring_server import RingServer

log = logging.getLogger("kvswap.daemon")

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# The request ring is read at least this often without a doorbell (serve()).
RING_LOOK_S = 1.0
_HIST_INDEX = {Op(name): i for i, name in enumerate(HIST_OPS)}


def _nothing() -> None:
    """No claimed tasks to copy (before :meth:`IoLoop.serve` installs the real step)."""


class CompletionQueue:
    """Completions on their way to the I/O thread: a deque, plus a wake-up byte on an
    inproc PAIR that the I/O thread's poller watches.

    :meth:`put` never blocks, whichever thread calls it, the I/O thread included
    (cancel, shutdown).  At most one wake-up is pending between two :meth:`take`
    calls (the ``_wake_pending`` flag), so the PAIR's queue never fills; a blocking
    send on a full PAIR while holding the lock, by the very thread that would
    drain it, was a deadlock."""

    def __init__(self, ctx: zmq.Context):
        self._items: collections.deque[Completion] = collections.deque()  # any thread
        self._lock = threading.Lock()  # guards _wake_pending and sends on _tx
        self._wake_pending = False  # under _lock: a wake-up byte is sent and not yet taken
        addr = f"inproc://kvswap-done-{id(self)}"
        self.rx = ctx.socket(zmq.PAIR)  # I/O thread: poll it, then call take()
        self.rx.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)  # any thread, under _lock
        self._tx.connect(addr)

    def put(self, c: Completion) -> None:
        """Queue a completion and wake the I/O thread (any thread; never blocks)."""
        self._items.append(c)
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the pipe holds unread wake-ups already: the I/O thread wakes
                pass

    def take(self) -> list[Completion]:
        """Every completion queued so far (I/O thread).

        Order matters: read the wake-ups, then clear the flag, then empty the deque.
        A completion queued before the flag is cleared is in the deque when it is
        emptied; one queued after sees the flag clear and sends a wake-up.  (Clearing
        the flag before reading could swallow a wake-up sent in between, leaving the
        flag set with no wake-up pending: no completion would wake this thread again.)"""
        while True:
            try:
                self.rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            self._wake_pending = False
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def close(self) -> None:
        self._tx.close()
        self.rx.close()


class IoLoop:
    """Sockets, routing, replies and completions of one rank (I/O thread unless a
    method says otherwise).  Constructing it binds the sockets."""

    def __init__(self, rank: RankContext, secret: bytes):
        self._rank = rank
        self._secret = secret
        cfg = rank.cfg
        # I/O thread: no request to this daemon was signed before it started
        self._replays = ReplayGuard(cfg.replay_window_s, not_before_ns=time.time_ns())
        # I/O thread: tcp:// peers already refused unauthenticated, each answered once
        self._refused_peers: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._pause_waiters: list[Job] = []  # I/O thread: pause requests answered once drained
        self.max_frame_bytes = max_frame_bytes(cfg.max_device_blocks, cfg.host_blocks_bound)
        self.ctx = zmq.Context(1)
        self.router: zmq.Socket = self.ctx.socket(zmq.ROUTER)  # I/O thread
        self.tcp_router: zmq.Socket | None = None  # I/O thread
        try:
            self._guard = self._bind()  # connection-guard thread
        except zmq.ZMQError:
            for sock in (self.router, self.tcp_router):
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            raise
        log.info("frames up to %d bytes (--max-device-blocks %d, at most %d host blocks); at "
                 "most %d frames kept per request; connections refused from file descriptor %d "
                 "of %d", self.max_frame_bytes, cfg.max_device_blocks,
                 cfg.host_blocks_bound, MAX_FRAMES, self._guard.threshold, self._guard.limit)
        self._done = CompletionQueue(self.ctx)  # any thread puts; the I/O thread takes
        self._sig_r, self._sig_w = socket.socketpair()  # the signal wake-up fd (I/O thread)
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for s in STOP_SIGNALS:
            signal.signal(s, lambda *_: None)
        self._handlers: dict[Op, Handler] = {}  # serve()'s table; ring requests use it too
        self._copy_claimed: Callable[[], None] = _nothing  # serve()'s end of a burst
        # the shared-memory rings beside the ipc:// socket (docs/protocol.md section 15)
        self._rings = RingServer(rank.names, rank.index, rank.epoch,
                                 lambda *message: self._on_request(self._handlers, *message))

    def _bind(self) -> ConnectionGuard:
        """Bind the ROUTER(s), each limited to frames a valid request can carry, and
        start the guard that refuses connections before file descriptors run out.

        libzmq 4.3.5 checks ``MAXMSGSIZE`` per frame, on the frame's length prefix
        (measured): a frame over it closes the connection before its body is
        buffered, while a message of many frames each under it passes.  libzmq
        delivers a multipart message only once all of it has arrived and sets no
        limit on the number of frames; :meth:`_recv` bounds what the daemon keeps
        of it.  docs/protocol.md section 2 states the resulting bounds.

        ``SNDHWM`` 0 (no limit): a ROUTER silently drops a reply to a peer whose
        queue is at its high-water mark (1000 by default), and a dropped reply
        leaves a future waiting for its whole timeout.  Every reply answers a
        request the peer sent, and each client bounds its requests in flight,
        so the client is what bounds this queue."""
        cfg, names = self._rank.cfg, self._rank.names
        self._limit(self.router)
        self.router.bind(names.endpoint(self._rank.index))
        os.chmod(names.endpoint_path(self._rank.index), 0o600)
        if cfg.listen_tcp:
            self.tcp_router = self.ctx.socket(zmq.ROUTER)
            self._limit(self.tcp_router)
            self.tcp_router.bind(cfg.listen_tcp)
            log.info("also listening on %s (HMAC-SHA256 signed messages only)", cfg.listen_tcp)
        return ConnectionGuard(self.ctx, [s for s in (self.router, self.tcp_router)
                                          if s is not None], self._rank.sig)

    def _limit(self, router: zmq.Socket) -> None:
        router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.LINGER, 2000)

    def serve(self, handlers: dict[Op, Handler], begin_stop: Callable[[str], None],
              workers_done: Callable[[], bool], copy_claimed: Callable[[], None]) -> None:
        """The loop, until a stop has begun and every worker has finished.

        ``copy_claimed`` copies the tasks this thread claimed while it served a burst
        (daemon/transfers.py); it runs at the end of every round, before this thread
        can sleep, and before a request whose handler does not claim.

        The completion doorbell is rung once per round of the loop, after every reply of
        the round is written: a reader woken by the first reply of a burst would take it
        alone and sleep again before the next.

        The request ring is also read when the poll times out and at least every
        :data:`RING_LOOK_S` while other sockets keep the loop busy: its doorbell
        rings only if the writer cleared the ``sleep`` flag, and a flag another
        process cleared, or a client killed between its write and its bell, would
        otherwise leave the ring unread for good.  It costs one clock read per round
        (no system call), and one look at an idle ring per timeout."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._done.rx, zmq.POLLIN)
        poller.register(self._sig_r, zmq.POLLIN)
        if self.tcp_router is not None:
            poller.register(self.tcp_router, zmq.POLLIN)
        self._handlers = handlers
        self._copy_claimed = copy_claimed
        ring_bell = self._rings.fileno()
        poller.register(ring_bell, zmq.POLLIN)
        ring_due = time.monotonic() + RING_LOOK_S
        stopping = self._rank.stopping
        while True:
            if stopping.is_set() and workers_done():
                self.flush_completions()
                self._rings.publish()
                return
            events = dict(poller.poll(100 if stopping.is_set() else 1000))
            if self._sig_r.fileno() in events:
                stops = [signal.Signals(s).name for s in self._sig_r.recv(64)
                         if s in STOP_SIGNALS]
                if stops:
                    begin_stop(f"signal {', '.join(stops)}")
            if self._done.rx in events:
                self.flush_completions()
            now = time.monotonic()
            if ring_bell in events or not events or now >= ring_due:
                ring_due = now + RING_LOOK_S
                self._rings.drain()
            for sock, signed in ((self.router, False), (self.tcp_router, True)):
                if sock is None or sock not in events:
                    continue
                for _ in range(256):  # bounded, so completions are not starved
                    message = self._recv(sock, signed)
                    if message is None:
                        break
                    self._on_request(handlers, *message, sock, signed)
            copy_claimed()
            self._rings.publish()

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

    def reply(self, route: Route | None, req_id: int | None, code: ErrorCode, message: str = "",
              queued_us: float = 0.0, exec_us: float = 0.0, fields: dict | None = None) -> None:
        if route is None:
            return
        body = encode_reply(req_id, self._rank.index, code, message, queued_us, exec_us,
                            **(fields or {}))
        frames = sign(self._secret, [body]) if route.signed else [body]
        route.sock.send_multipart([route.ident, *frames], copy=False)

    def reject(self, route: Route | None, req_id: int | None, op: str, exc: KvswapError) -> None:
        # %.200r: the message quotes what a peer sent; repr escapes line breaks and the
        # precision cuts it, so no value can forge or flood a log line.
        log.warning("rejected %s %.200r: [%d] %.200r", op, req_id, exc.code, exc.message)
        self._rank.sm.note_error(exc.code)
        self._rank.sig.add(RankSlot.FAILED, 1)
        self._rank.stats.error(exc.code)
        self.reply(route, req_id, exc.code, exc.message)

    def _refuse_unauthenticated(self, route: Route, exc: KvswapError) -> None:
        """Refuse a tcp:// message that did not authenticate (unsigned, a bad MAC, a
        replay, a stale ``ts``, too many frames), answering each peer connection once.

        Every answer is queued for the peer (``SNDHWM`` 0: _bind), so a peer without
        the secret that sends and never reads would make the daemon hold a reply per
        message, without bound (measured: 240 MB in 100 s).  One answer tells a
        client with a wrong secret or clock what is wrong; later ones are counted
        and logged, not sent.  The set of refused peers is bounded above the number
        of connections the guard lets in, so a live connection is never forgotten."""
        peers = self._refused_peers
        if route.ident in peers:
            log.warning("refused again, not answered: %.200r", exc.message)
            self._rank.stats.error(exc.code)
            return
        peers[route.ident] = None
        if len(peers) > 2 * self._guard.threshold:
            peers.popitem(last=False)
        self.reject(route, None, "request", exc)

    def _on_request(self, handlers: dict[Op, Handler], frames: list, dropped: int,
                    sock: zmq.Socket, signed: bool) -> None:
        t_recv = time.perf_counter_ns()
        route = Route(sock, frames[0].bytes, signed)
        if dropped:
            # Under its id on ipc://; on tcp:// the MAC covers frames never read, so the
            # header is not authenticated and its id is not echoed (as for a bad MAC).
            exc = KvswapError(
                f"message of {len(frames) - 1 + dropped} frames; a request has at most "
                f"{MAX_FRAMES} (a header and two id frames per batch task"
                f"{', after the MAC' if signed else ''}), the rest were discarded unread",
                ErrorCode.MESSAGE_TOO_LARGE)
            if signed:
                self._refuse_unauthenticated(route, exc)
            else:
                self.reject(route, peek_request_id(frames[1].buffer), "request", exc)
            return
        body = [f.buffer for f in frames[1:]]
        try:
            if signed:
                digest, body = verify(self._secret, body)
            req = decode_request(body)
            if signed:
                self._replays.check(digest, req.header.get("ts"))
        except RequestError as exc:  # signed: the MAC checked out, the peer holds the secret
            self.reject(route, exc.req_id, "request", exc)
            return
        except AuthFailed as exc:
            self._refuse_unauthenticated(route, exc)
            return
        job = Job(route, req.id, req.op, t_recv, req.header)
        handler = handlers[req.op]
        if not handler.claims:
            self._copy_claimed()  # a cancel, pause or clear finds the claimed tasks done
        try:
            if handler.admit is None:
                assert handler.run is not None
                fields = handler.run(job, req)
                if fields is not None:
                    self.reply(route, req.id, ErrorCode.OK, fields=fields)
            else:
                handler.admit(job, req)
        except KvswapError as exc:
            self.reject(route, req.id, req.op.value, exc)
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("%s %s failed unexpectedly", req.op.value, req.id)
            self.reject(route, req.id, req.op.value,
                        KvswapError(f"{type(exc).__name__}: {exc}", ErrorCode.INTERNAL_ERROR))

    def complete(self, c: Completion) -> None:
        """Hand a completion to the I/O thread (any thread)."""
        self._done.put(c)

    def flush_completions(self) -> None:
        for c in self._done.take():
            self.deliver(c)
        self._answer_pause_waiters()

    def deliver(self, c: Completion) -> None:
        """Count a finished job and answer it."""
        job = c.job
        sig, stats = self._rank.sig, self._rank.stats
        if OPS[job.op].kind is HandlerKind.TRANSFER:
            sig.add(RankSlot.INFLIGHT, -1)
            if c.code == ErrorCode.OK:
                sig.add(RankSlot.COMPLETED, 1)
                if job.op in (Op.EVICT, Op.LOAD):
                    sig.add(RankSlot.BYTES_EVICTED if job.op is Op.EVICT
                            else RankSlot.BYTES_LOADED, c.nbytes)
            elif c.code != ErrorCode.CANCELLED:
                sig.add(RankSlot.FAILED, 1)
            if c.code != ErrorCode.OK:
                stats.error(c.code)
            timed = _HIST_INDEX.get(job.op)
            if timed is not None:
                stats.record(timed, 0, (c.t_start - job.t_recv) / 1e3)
                stats.record(timed, 1, (c.t_end - c.t_start) / 1e3)
            crashpoints.hit("reply.before")
        if c.code not in (ErrorCode.OK, ErrorCode.CANCELLED):
            self._rank.sm.note_error(c.code)
        self.reply(job.route, job.req_id, c.code, c.message,
                   queued_us=(c.t_start - job.t_recv) / 1e3,
                   exec_us=(c.t_end - c.t_start) / 1e3, fields=c.fields)
        if job.jseq is not None:
            crashpoints.hit("reply.after")

    def answer_when_drained(self, job: Job) -> None:
        """Answer ``job`` OK once no accepted transfer is in flight (pause)."""
        self._pause_waiters.append(job)
        self._answer_pause_waiters()

    def _answer_pause_waiters(self) -> None:
        if self._pause_waiters and self._rank.sig[RankSlot.INFLIGHT] == 0:
            for job in self._pause_waiters:
                self.reply(job.route, job.req_id, ErrorCode.OK)
            self._pause_waiters = []

    def close(self) -> None:
        """Close every socket and the context (after the loop and every worker ended)."""
        self._guard.close()
        self._rings.close()
        signal.set_wakeup_fd(-1)
        self._sig_r.close()
        self._sig_w.close()
        self._done.close()
        for s in (self.router, self.tcp_router):
            if s is not None:
                s.close()
        self.ctx.term()
