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
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from kvswap.client.auth import sign, verify
from kvswap.client.errors import (
    ErrorCode,
    InvalidTask,
    KvswapError,
    NamespaceError,
    NotReady,
    RankFailure,
    RankRestarted,
    RankTimeout,
    TransferFailed,
)
from kvswap.client.naming import Names, tcp_endpoints
from kvswap.client.protocol import (
    BatchItem,
    Message,
    Op,
    Reply,
    as_block_ids,
    as_keys,
    batch_message,
    decode_reply,
    request_header,
    storage_message,
    transfer_message,
    validate_storage,
    validate_transfer,
)
from kvswap.client.signals import R, RankState, SignalSegment, wait_ranks

log = logging.getLogger("kvswap.client")

_WATCH_MS = 20  # how often the I/O thread looks for restarted ranks while work is pending


@dataclass(frozen=True)
class TransferSpec:
    """One evict or load, for :meth:`TransferClient.submit_batch`."""

    op: Op
    device_blocks: Any
    host_blocks: Any
    priority: int = 0
    layerwise: bool = False

    @classmethod
    def evict(cls, device_blocks: Any, host_blocks: Any, priority: int = 0) -> "TransferSpec":
        return cls(Op.EVICT, device_blocks, host_blocks, priority)

    @classmethod
    def load(cls, host_blocks: Any, device_blocks: Any, priority: int = 0,
             layerwise: bool = False) -> "TransferSpec":
        return cls(Op.LOAD, device_blocks, host_blocks, priority, layerwise)


@dataclass(frozen=True)
class TaskResult:
    """A task every rank acknowledged: the per-rank replies (timings, reply fields)."""

    task_id: int
    op: str
    replies: dict[int, Reply]

    @property
    def nbytes(self) -> int:
        return sum(int(r.fields.get("bytes", 0)) for r in self.replies.values())

    @property
    def count(self) -> int:
        """The op's count, agreed over ranks (the minimum): blocks a prefetch loaded,
        leading keys ``exists`` found, entries a backup stored."""
        return min(int(r.fields.get("count", 0)) for r in self.replies.values())


class TransferFuture:
    """Completes when every rank of the task has answered (or at its deadline)."""

    def __init__(self, task_id: int, op: Op, ranks: Sequence[int], deadline: float,
                 client: "TransferClient | None" = None):
        self.task_id = task_id
        self._client = client
        self.message: Message | None = None  # what to send (again, after a restart)
        self.blocks: tuple[np.ndarray, np.ndarray] | None = None  # (device, host) ids
        self.retried: set[int] = set()  # ranks this task was re-sent to
        self.backup: TransferFuture | None = None  # evict(..., backup_keys=...)
        self.batch_id: int | None = None  # the batch message that carries this task
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
            cls = (RankRestarted if any(f.code == ErrorCode.RANK_RESTARTED for f in failures)
                   else TransferFailed)
            self._finish(error=cls(self.task_id, self.op.value, failures))
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

    def cancel(self) -> "TransferFuture":
        """Ask every rank to drop this task if it has not started there.

        Returns the future of the ``cancel`` request (each rank's reply says
        ``cancelled`` true or false).  This future then completes with
        :class:`TransferFailed` code CANCELLED on the ranks that dropped it; a rank
        where the task had already started completes it normally (never
        half-applied on a rank).  Check :meth:`cancelled` and
        ``TransferFailed.failures`` to see which ranks applied it.
        """
        if self._client is None:
            raise KvswapError(f"task {self.task_id} cannot be cancelled", ErrorCode.INVALID_TASK)
        return self._client._cancel(self)

    def cancelled(self) -> bool:
        """True once every rank dropped the task before starting it."""
        return (self.done() and isinstance(self._error, TransferFailed)
                and all(f.code == ErrorCode.CANCELLED for f in self._error.failures)
                and len(self._error.failures) == len(self.ranks))

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
                 task_timeout: float = 60.0, tcp: str | None = None,
                 secret: bytes | None = None):
        """``tcp="HOST:BASEPORT"`` talks to the ranks' tcp:// listeners instead of their
        ipc:// sockets, signing every message with ``secret`` (the signal segment is
        still read from this node's /dev/shm)."""
        self.names = Names.of(namespace, run_root)
        self.tp_size = tp_size
        self.task_timeout = task_timeout
        self.seg = SignalSegment.attach(self.names, readonly=True)
        if self.seg.tp_size != tp_size:
            tp = self.seg.tp_size
            self.seg.close()
            raise NamespaceError(f"namespace {namespace!r} has tp_size {tp}, client asked {tp_size}")
        # Task ids are unique across clients (they key the layer-progress table):
        # a random 31-bit prefix, then a counter.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)
        self._cid = secrets.randbits(62) or 1
        self._cs = itertools.count(1)
        self._pending: dict[int, TransferFuture] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap, I/O thread only
        self._outbox: collections.deque[
            tuple[TransferFuture, Sequence[TransferFuture]]] = collections.deque()
        # I/O thread only: the epoch each rank had when we last addressed it, ranks
        # that restarted and are not READY again (their traffic waits in _held).
        self._epochs = [int(e) for e in self.seg.ranks[:, R.EPOCH]]
        self._frozen: set[int] = set()
        self._held: dict[int, list[TransferFuture]] = {r: [] for r in range(tp_size)}
        self.retried = 0  # tasks re-sent after a rank restart (for operators and tests)
        self._closed = False
        self._ctx = zmq.Context(1)
        addr = f"inproc://kvswap-client-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)
        self._wake_tx.connect(addr)
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        if tcp is not None and not secret:
            raise ValueError("a tcp:// client needs the shared secret")
        self._secret = secret if tcp is not None else None
        endpoints = (tcp_endpoints(tcp, tp_size) if tcp is not None
                     else [self.names.endpoint(r) for r in range(tp_size)])
        self._dealers = []
        for endpoint in endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
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
    def evict(self, device_blocks: Any, host_blocks: Any, *, priority: int = 0,
              backup_keys: Sequence[bytes] | None = None) -> TransferFuture:
        """Copy device blocks to host blocks (pairwise) for every tensor on every rank.

        ``backup_keys`` (write-through to storage): also back the host blocks up under
        these keys; the backup runs after the evict on every rank (hazard ordering)
        and its future is the returned future's ``backup``."""
        fut = self._transfer(TransferSpec(Op.EVICT, device_blocks, host_blocks, priority))
        if backup_keys is not None:
            fut.backup = self.backup(host_blocks, backup_keys, priority=priority)
        return fut

    def load(self, host_blocks: Any, device_blocks: Any, *, priority: int = 0,
             layerwise: bool = False) -> TransferFuture:
        """Copy host blocks to device blocks (pairwise) for every tensor on every rank.

        ``layerwise=True``: each rank copies layer by layer and publishes progress,
        so a TP worker can start on layer 0 with ``CacheWorker.wait_layer(
        future.task_id, 0, timeout)`` before the last layer has arrived."""
        return self._transfer(TransferSpec(Op.LOAD, device_blocks, host_blocks, priority,
                                           layerwise))

    # ------------------------------------------------------------------ storage tier
    def backup(self, host_blocks: Any, keys: Sequence[bytes], *,
               priority: int = 0) -> TransferFuture:
        """Host swap space -> storage: host block i is stored under ``keys[i]`` (from
        :func:`block_hashes`) on every rank.  Keys already stored are skipped; each
        reply says how many were stored (``count``) and ``skipped``."""
        return self._storage(Op.BACKUP, host_blocks, keys, priority)

    def prefetch(self, keys: Sequence[bytes], host_blocks: Any, *,
                 priority: int = 0) -> TransferFuture:
        """Storage -> host swap space for the longest prefix of ``keys`` that every rank
        holds and can read intact; ``result().count`` is that prefix length (the ranks
        agree on it through shared memory).  Host blocks past it hold nothing usable."""
        return self._storage(Op.PREFETCH, host_blocks, keys, priority)

    def exists(self, keys: Sequence[bytes]) -> TransferFuture:
        """``result().count``: how many leading keys are stored on every rank."""
        return self._storage(Op.EXISTS, None, keys, 0)

    def _storage(self, op: Op, host_blocks: Any, keys: Sequence[bytes],
                 priority: int) -> TransferFuture:
        k = as_keys(keys)
        host = None if host_blocks is None else as_block_ids(host_blocks, "host_blocks")
        limits = self._block_limits()
        validate_storage(op, host, k.shape[0], limits[1] if limits else np.iinfo(np.int64).max)
        fut = self._new_future(op)
        if host is not None:
            fut.blocks = (np.empty(0, dtype=host.dtype), host)
        self._enqueue(fut, storage_message(op, fut.task_id, host, k, priority))
        return fut

    def submit_batch(self, tasks: Sequence["TransferSpec"]) -> list[TransferFuture]:
        """Submit many tasks in one message per rank; one future per task, in order.
        Every task is validated before anything is sent."""
        items = [self._check(t) for t in tasks]
        if not items:
            return []
        futures = [self._new_future(t.op) for t in tasks]
        batch = [BatchItem(f.task_id, t.op, dev, host, t.priority, t.layerwise)
                 for f, t, (dev, host) in zip(futures, tasks, items)]
        carrier = self._new_future(Op.BATCH)
        for f in futures:
            f.batch_id = carrier.task_id
        carrier.add_done_callback(lambda c: self._fail_batch(c, futures))
        self._enqueue(carrier, batch_message(carrier.task_id, batch), extra=futures)
        return futures

    def submit_swap(self, evict: tuple[Any, Any], load: tuple[Any, Any],
                    policy: str = "write_through") -> tuple[TransferFuture, TransferFuture]:
        """An evict ``(device, host)`` and a load ``(host, device)`` under a write policy.

        ``write_through``: both are submitted now; the daemons' hazard ordering
        still runs them in order wherever their blocks overlap.
        ``write_back``: the load is submitted only once the evict has completed on
        every rank; if the evict fails the load is never sent and its future fails
        with CANCELLED.
        """
        ev = TransferSpec(Op.EVICT, evict[0], evict[1])
        ld = TransferSpec(Op.LOAD, load[1], load[0])
        if policy == "write_through":
            return self._transfer(ev), self._transfer(ld)
        if policy != "write_back":
            raise ValueError(f"policy must be write_through or write_back, got {policy!r}")
        dev, host = self._check(ld)
        ev_fut = self._transfer(ev)
        ld_fut = self._new_future(Op.LOAD)
        ld_fut.blocks = (dev, host)

        def after_evict(done: TransferFuture) -> None:
            err = done._error
            if err is None:
                ld_fut.deadline = time.monotonic() + self.task_timeout  # counts from sending
                self._enqueue(ld_fut, transfer_message(Op.LOAD, ld_fut.task_id, dev, host))
                return
            self._pending.pop(ld_fut.task_id, None)
            ld_fut._finish(error=TransferFailed(ld_fut.task_id, "load", [
                RankFailure(r, ErrorCode.CANCELLED,
                            f"not submitted: write-back evict {done.task_id} failed ({err})")
                for r in ld_fut.ranks]))

        self._pending[ld_fut.task_id] = ld_fut
        ev_fut.add_done_callback(after_evict)
        return ev_fut, ld_fut

    def ping(self) -> TransferFuture:
        return self._control(Op.PING)

    def stats(self) -> TransferFuture:
        return self._control(Op.STATS)

    def shutdown(self) -> TransferFuture:
        """Ask every daemon to stop (normally the launcher's job)."""
        return self._control(Op.SHUTDOWN)

    def pause(self) -> TransferFuture:
        """Every rank refuses new transfers (code PAUSED); completes once every task
        accepted before has finished on every rank."""
        return self._control(Op.PAUSE)

    def resume(self) -> TransferFuture:
        return self._control(Op.RESUME)

    def clear_caches(self, free_host: bool = False) -> TransferFuture:
        """For a weight update: every rank drains, releases its device mappings (and
        its host swap pool if ``free_host``), and reports CLEARED through the shm
        barrier; the future completes when every rank has.  Transfers meanwhile
        get code CLEARED."""
        return self._control(Op.CLEAR, {"free_host": True} if free_host else None)

    def restore_caches(self) -> TransferFuture:
        """After :meth:`clear_caches`: every rank accepts a new register.  Then each
        TP worker registers its tensors again and :meth:`wait_ready` returns once
        every rank has re-attached."""
        return self._control(Op.RESTORE)

    def _control(self, op: Op, fields: dict | None = None) -> TransferFuture:
        fut = self._new_future(op)
        self._enqueue(fut, Message(request_header(op, fut.task_id, fields), []))
        return fut

    def _cancel(self, target: TransferFuture) -> TransferFuture:
        return self._control(Op.CANCEL, {"target": target.task_id})

    def _check(self, spec: "TransferSpec") -> tuple[np.ndarray, np.ndarray]:
        dev = as_block_ids(spec.device_blocks, "device_blocks")
        host = as_block_ids(spec.host_blocks, "host_blocks")
        limits = self._block_limits()
        big = np.iinfo(np.int64).max
        validate_transfer(spec.op, dev, host, *(limits or (big, big)))
        if spec.layerwise and spec.op is not Op.LOAD:
            raise InvalidTask("layerwise applies to load only", ErrorCode.BAD_FIELD)
        return dev, host

    def _transfer(self, spec: "TransferSpec") -> TransferFuture:
        dev, host = self._check(spec)
        fut = self._new_future(spec.op)
        fut.blocks = (dev, host)
        self._enqueue(fut, transfer_message(spec.op, fut.task_id, dev, host, spec.priority,
                                            spec.layerwise))
        return fut

    def _new_future(self, op: Op) -> TransferFuture:
        if self._closed:
            raise KvswapError("TransferClient is closed", ErrorCode.SHUTTING_DOWN)
        return TransferFuture(next(self._ids), op, range(self.tp_size),
                              time.monotonic() + self.task_timeout, self)

    def _enqueue(self, fut: TransferFuture, message: Message,
                 extra: Sequence[TransferFuture] = ()) -> None:
        """Register ``fut`` (and the futures of a batch's tasks) and hand the message
        to the I/O thread, which sends it to every rank in enqueue order."""
        fut.message = message
        for f in extra:
            self._pending[f.task_id] = f
        self._pending[fut.task_id] = fut
        self._outbox.append((fut, extra))
        self._wake()

    def _fail_batch(self, carrier: TransferFuture, futures: Sequence[TransferFuture]) -> None:
        """A batch refused whole by a rank: its tasks will get no reply of their own."""
        err = carrier._error
        if err is None:
            return
        refused = (err.failures if isinstance(err, TransferFailed)
                   else [RankFailure(r, err.code, err.message) for r in carrier.ranks])
        for f in futures:
            if self._pending.pop(f.task_id, None) is not None:
                f._finish(error=TransferFailed(f.task_id, f.op.value, [
                    RankFailure(x.rank, x.code, f"batch {carrier.task_id} refused: {x.message}")
                    for x in refused]))

    def _wake(self) -> None:
        """Make the I/O thread drain the outbox.  Skipped while a wake-up is already
        pending: the I/O thread clears ``_wake_pending`` *before* it drains, so an
        item appended before that is drained, and one appended after finds the flag
        clear and sends a new wake-up."""
        if self._wake_pending:
            return
        with self._wake_lock:
            self._wake_pending = True
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the PAIR already holds a wake-up

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
            if self._pending or self._frozen:
                # watch for rank restarts while anything is outstanding
                timeout_ms = min(timeout_ms if timeout_ms is not None else _WATCH_MS, _WATCH_MS)
            events = dict(poller.poll(timeout_ms))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._wake_pending = False
            self._watch_ranks()
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

    def _send(self, fut: TransferFuture, ranks: Sequence[int], re: bool = False) -> None:
        assert fut.message is not None
        if "cs" not in fut.message.header:
            fut.message.header.update(cid=self._cid, cs=next(self._cs))
        fut.message.header["re"] = re
        epochs = self._epochs if fut.message.epoch_stamped else None
        if self._secret is None:
            frames = fut.message.frames(epochs)
        else:  # signed, with a fresh timestamp: a re-send is a new message, not a replay
            frames = sign(self._secret, fut.message.frames(epochs, ts=time.time_ns()))
        for r in ranks:
            self._dealers[r].send_multipart(frames, copy=False)

    def _send_outbox(self) -> None:
        while self._outbox:
            fut, extra = self._outbox.popleft()
            for f in (fut, *extra):
                heapq.heappush(self._deadlines, (f.deadline, f.task_id))
            for r in self._frozen.intersection(fut.ranks):
                self._held[r].append(fut)
            self._send(fut, [r for r in fut.ranks if r not in self._frozen])

    # ------------------------------------------------------------------ restarts
    def _watch_ranks(self) -> None:
        """Notice restarted ranks (a new epoch in the signal segment); once such a rank
        is READY again, re-send what it never answered, then what was held back."""
        for r in range(self.tp_size):
            epoch = int(self.seg.ranks[r, R.EPOCH])
            if epoch != self._epochs[r] and r not in self._frozen:
                log.warning("rank %d restarted (epoch %d -> %d); holding its traffic until it "
                            "is READY", r, self._epochs[r], epoch)
                self._frozen.add(r)
            if r in self._frozen and self.seg.state_of(r) == RankState.READY:
                self._epochs[r] = epoch
                self._frozen.discard(r)
                self._resend_after_restart(r)

    def _resend_after_restart(self, r: int) -> None:
        held = {f.task_id for f in self._held[r]}
        lost = sorted((f for f in self._pending.values()
                       if r in f.ranks and r not in f._replies and f.task_id not in held),
                      key=lambda f: f.task_id)
        resent_batches = {f.task_id for f in lost if f.op is Op.BATCH
                          and r not in f.retried}
        for fut in lost:
            if fut.batch_id in resent_batches:
                continue  # travels again inside its re-sent batch message
            if fut.message is None:  # a task of a batch: its batch message was answered
                why = "its batch was accepted before the restart"
            else:
                fut.retried.add(r)
                self.retried += 1
                self._send(fut, [r], re=True)
                continue
            if fut._on_reply(Reply(fut.task_id, r, False, ErrorCode.RANK_RESTARTED,
                                   f"rank {r} restarted with task {fut.task_id} in flight; "
                                   f"not retried: {why}")):
                self._pending.pop(fut.task_id, None)
        for fut in self._held[r]:
            if fut.task_id in self._pending:
                self._send(fut, [r])
        self._held[r] = []

    def _drain_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if self._secret is not None:
                    frames = verify(self._secret, frames)[1]
                reply = decode_reply(frames[0])
            except KvswapError as exc:
                log.warning("dropping bad reply: %s", exc)
                continue
            if reply.code == ErrorCode.RANK_RESTARTED:
                continue  # addressed to a dead incarnation: _watch_ranks re-sends it
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
