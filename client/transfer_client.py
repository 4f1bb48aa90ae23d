"""``TransferClient``: the engine scheduler's handle on every rank daemon.

One I/O thread owns every ZMQ socket of the client: a DEALER per rank and the
receiving end of an inproc PAIR.  Submitting threads encode their request,
append it to an outbox (a deque, so per-rank send order is the order of
submission) and wake the I/O thread through the PAIR's sending end, which they
share under a lock.  The I/O thread sends each request to every rank, matches
replies to futures by task id, and fails any future whose deadline passes with
:class:`RankTimeout` naming the ranks that did not answer.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from kvswap.client.errors import (
    ErrorCode,
    KvswapError,
    NamespaceError,
    NotReady,
    RankFailure,
    RankTimeout,
    TransferFailed,
)
from kvswap.client.naming import Names
from kvswap.client.protocol import (
    Op,
    Reply,
    as_block_ids,
    decode_reply,
    encode_request,
    encode_transfer,
    validate_transfer,
)
from kvswap.client.signals import R, RankState, SignalSegment, wait_ranks

log = logging.getLogger("kvswap.client")


@dataclass(frozen=True)
class TaskResult:
    """A task every rank acknowledged: the per-rank replies (timings, reply fields)."""

    task_id: int
    op: str
    replies: dict[int, Reply]

    @property
    def nbytes(self) -> int:
        return sum(int(r.fields.get("bytes", 0)) for r in self.replies.values())


class TransferFuture:
    """Completes when every rank of the task has answered (or at its deadline)."""

    def __init__(self, task_id: int, op: Op, ranks: Sequence[int], deadline: float):
        self.task_id = task_id
        self.op = op
        self.ranks = tuple(ranks)
        self.deadline = deadline
        self.submitted = time.perf_counter()
        self.completed: float | None = None
        self._replies: dict[int, Reply] = {}
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: KvswapError | None = None
        self._result: TaskResult | None = None
        self._callbacks: list[Callable[["TransferFuture"], None]] = []

    # -- called by the I/O thread -------------------------------------------------
    def _on_reply(self, reply: Reply) -> bool:
        """Record one rank's reply; True once the future is complete."""
        if reply.rank not in self.ranks or reply.rank in self._replies:
            log.warning("task %d: unexpected reply from rank %d", self.task_id, reply.rank)
            return False
        self._replies[reply.rank] = reply
        if len(self._replies) < len(self.ranks):
            return False
        failures = [RankFailure(r.rank, r.code, r.message)
                    for r in self._replies.values() if not r.ok]
        if failures:
            self._finish(error=TransferFailed(self.task_id, self.op.value, failures))
        else:
            self._finish(result=TaskResult(self.task_id, self.op.value, dict(self._replies)))
        return True

    def missing_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self._replies]

    def _finish(self, result: TaskResult | None = None, error: KvswapError | None = None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self.completed = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # a user callback must not kill the I/O thread
                log.exception("done-callback of task %d raised", self.task_id)

    # -- public ------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, fn: Callable[["TransferFuture"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = None) -> TaskResult:
        """Wait for every rank; raise :class:`TransferFailed` naming failing ranks and
        codes, or :class:`RankTimeout` naming the ranks that have not answered."""
        wait = max(0.0, self.deadline - time.monotonic()) + 1.0 if timeout is None else timeout
        if not self._event.wait(wait):
            missing = ", ".join(map(str, self.missing_ranks()))
            raise RankTimeout(f"task {self.task_id} ({self.op.value}): rank(s) {missing} have not "
                              f"answered after {wait:.1f}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> KvswapError | None:
        try:
            self.result(timeout)
        except KvswapError as exc:
            return exc
        return None

    @property
    def latency_s(self) -> float | None:
        return None if self.completed is None else self.completed - self.submitted


class TransferClient:
    """Submit evict/load/control tasks to every rank of a namespace.

    Thread-safe.  ``task_timeout`` is every task's deadline: no future waits past it.
    """

    def __init__(self, namespace: str, tp_size: int, run_root: str | None = None,
                 task_timeout: float = 60.0):
        self.names = Names.of(namespace, run_root)
        self.tp_size = tp_size
        self.task_timeout = task_timeout
        self.seg = SignalSegment.attach(self.names, readonly=True)
        if self.seg.tp_size != tp_size:
            tp = self.seg.tp_size
            self.seg.close()
            raise NamespaceError(f"namespace {namespace!r} has tp_size {tp}, client asked {tp_size}")
        self._ids = itertools.count(1)
        self._pending: dict[int, TransferFuture] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap, I/O thread only
        self._outbox: collections.deque[tuple[TransferFuture, list]] = collections.deque()
        self._closed = False
        self._ctx = zmq.Context(1)
        addr = f"inproc://kvswap-client-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)
        self._wake_tx.connect(addr)
        self._wake_lock = threading.Lock()
        self._dealers = []
        for r in range(tp_size):
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.names.endpoint(r))
            self._dealers.append(s)
        self._thread = threading.Thread(target=self._io_loop, name="kvswap-client-io",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ readiness
    def _describe(self, r: int) -> str:
        state = self.seg.state_of(r)
        age = self.seg.heartbeat_age_s(r)
        beat = "no heartbeat" if age is None else f"heartbeat {age:.1f}s ago"
        err = self.seg.ranks[r, R.LAST_ERROR]
        extra = f", last error {int(err)}" if err else ""
        return (f"rank {r} is {state.name} ({beat}{extra}; log "
                f"{self.names.log_path(r)})")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every rank is READY, or raise :class:`RankTimeout` naming each
        rank that is not, with its state and log file."""
        def ready(r: int) -> bool:
            state = self.seg.state_of(r)
            if state in (RankState.FAILED, RankState.STOPPED, RankState.STOPPING):
                raise NotReady(f"waiting for all ranks READY: {self._describe(r)}")
            return state == RankState.READY

        wait_ranks(self.seg, range(self.tp_size), ready, timeout, "all ranks READY",
                   self._describe)

    def _block_limits(self) -> tuple[int, int] | None:
        """Smallest device/host block counts over ranks, once every rank has published them."""
        dev = int(self.seg.ranks[:, R.NUM_DEVICE_BLOCKS].min())
        host = int(self.seg.ranks[:, R.NUM_HOST_BLOCKS].min())
        return (dev, host) if dev and host else None

    # ------------------------------------------------------------------ submission
    def evict(self, device_blocks: Any, host_blocks: Any) -> TransferFuture:
        """Copy device blocks to host blocks (pairwise) for every tensor on every rank."""
        return self._transfer(Op.EVICT, device_blocks, host_blocks)

    def load(self, host_blocks: Any, device_blocks: Any) -> TransferFuture:
        """Copy host blocks to device blocks (pairwise) for every tensor on every rank."""
        return self._transfer(Op.LOAD, device_blocks, host_blocks)

    def ping(self) -> TransferFuture:
        return self._submit(Op.PING, lambda tid: encode_request(Op.PING, tid))

    def stats(self) -> TransferFuture:
        return self._submit(Op.STATS, lambda tid: encode_request(Op.STATS, tid))

    def shutdown(self) -> TransferFuture:
        """Ask every daemon to stop (normally the launcher's job)."""
        return self._submit(Op.SHUTDOWN, lambda tid: encode_request(Op.SHUTDOWN, tid))

    def _transfer(self, op: Op, device_blocks: Any, host_blocks: Any) -> TransferFuture:
        dev = as_block_ids(device_blocks, "device_blocks")
        host = as_block_ids(host_blocks, "host_blocks")
        limits = self._block_limits()
        big = np.iinfo(np.int64).max
        validate_transfer(op, dev, host, *(limits or (big, big)))
        return self._submit(op, lambda tid: encode_transfer(op, tid, dev, host))

    def _submit(self, op: Op, encode: Callable[[int], list]) -> TransferFuture:
        if self._closed:
            raise KvswapError("TransferClient is closed", ErrorCode.SHUTTING_DOWN)
        tid = next(self._ids)
        fut = TransferFuture(tid, op, range(self.tp_size), time.monotonic() + self.task_timeout)
        frames = encode(tid)
        self._pending[tid] = fut
        self._outbox.append((fut, frames))
        self._wake()
        return fut

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already queued; the I/O thread drains the whole outbox

    # ------------------------------------------------------------------ I/O thread
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for s in self._dealers:
            poller.register(s, zmq.POLLIN)
        while True:
            timeout_ms = None
            if self._deadlines:
                timeout_ms = max(0, int((self._deadlines[0][0] - time.monotonic()) * 1000) + 1)
            events = dict(poller.poll(timeout_ms))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._send_outbox()
            for s in self._dealers:
                if s in events:
                    self._drain_replies(s)
            self._expire()
            if self._closed:
                break
        for fut in list(self._pending.values()):
            fut._finish(error=KvswapError(f"task {fut.task_id} ({fut.op.value}): client closed",
                                          ErrorCode.SHUTTING_DOWN))
        self._pending.clear()
        for s in (*self._dealers, self._wake_rx):
            s.close()

    def _send_outbox(self) -> None:
        while self._outbox:
            fut, frames = self._outbox.popleft()
            heapq.heappush(self._deadlines, (fut.deadline, fut.task_id))
            for r in fut.ranks:
                self._dealers[r].send_multipart(frames, copy=False)

    def _drain_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frames[0])
            except KvswapError as exc:
                log.warning("dropping bad reply: %s", exc)
                continue
            fut = self._pending.get(reply.id) if isinstance(reply.id, int) else None
            if fut is None:
                log.debug("reply for unknown task %r from rank %d", reply.id, reply.rank)
                continue
            if fut._on_reply(reply):
                del self._pending[reply.id]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tid = heapq.heappop(self._deadlines)
            fut = self._pending.pop(tid, None)
            if fut is None:
                continue
            missing = fut.missing_ranks()
            detail = "; ".join(self._describe(r) for r in missing)
            fut._finish(error=RankTimeout(
                f"task {tid} ({fut.op.value}) not acknowledged within {self.task_timeout:.1f}s "
                f"by {len(missing)} rank(s): {detail}"))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the I/O thread; pending futures fail with SHUTTING_DOWN."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=10)
        with self._wake_lock:
            self._wake_tx.close()
        self._ctx.term()
        self.seg.close()

    def __enter__(self) -> "TransferClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
