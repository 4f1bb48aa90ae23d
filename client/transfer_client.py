"""``TransferClient``: the engine scheduler's handle on every rank daemon.

Threads::

    submitting threads (any number)          reader thread "kvswap-client-io" (one)
    -------------------------------          -------------------------------------
    check every argument; a bad one          poll: completion bells, the DEALERs'
      raises InvalidTask, nothing created      ZMQ_FD, a wake pipe (no socket is
    futures + the message answering them       touched outside the lock)
      (an envelope)                          under _lock: watch ranks (freeze,
    under _lock: the _Dispatcher assigns       queue re-sends); read every reply
      cs and sends: encode, write to the       and match it; expire deadlines;
      rank's ring or DEALER (Transport),       pump backlogs
      or queue behind its backlog            then run the done-callbacks
    return the future(s)

One lock covers the dispatcher (pending futures, the deadline heap, open
envelopes by cs; per rank: epoch, frozen, backlog, replies owed) and every
channel: the caller's thread sends its own message, with no hand-off on the way
out, and one reader thread completes futures.  Done-callbacks run outside the
lock, on the reader (a write-back load waiting for its evict is the
dispatcher's state, not a callback).

Every unit of work (sending one envelope, handling one reply, watching one
rank, expiring one future) is guarded: an unexpected exception is logged with
its traceback and fails that unit's futures with INTERNAL_ERROR, and the
reader carries on.  The deadline of every future still holds whatever happens.

Re-sends after a rank restart (docs/protocol.md section 10): every message
carries the client's id ``cid`` and its sequence number ``cs`` (assigned when
it is first sent); when a restarted rank serves again, whatever it owes is
sent to it again in ``cs`` order, marked ``re``, so its daemon can answer from
its completion journal instead of running a task twice.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import secrets
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
from kvswap.client.errors import (
    ErrorCode,
    InvalidTask,
    KvswapError,
    NamespaceError,
    NotReady,
    ProtocolError,
    RankFailure,
    RankRestarted,
    RankTimeout,
    TransferFailed,
    code_name,
)
from kvswap.client.naming import Names, tcp_endpoints
from kvswap.client.protocol import (
    CID_LIMIT,
    MAX_BATCH_TASKS,
    MAX_SECONDS,
    BatchItem,
    Message,
    Op,
    PrefetchOptions,
    Reply,
    as_block_ids,
    as_keys,
    batch_message,
    check_flag,
    check_int,
    check_model_version,
    check_priority,
    check_seconds,
    request_header,
    storage_message,
    transfer_message,
    validate_storage,
    validate_transfer,
)
from kvswap.client.signals import (
    RankSlot,
    RankState,
    SegmentClosed,
    SignalSegment,
    wait_ranks,
)
from kvswap.client.transport import Channel, PathChoice, Transport

log = logging.getLogger("kvswap.client")

_WATCH_MS = 20  # how often the reader looks for restarted ranks while work is pending
_LINGER_S = 1.0  # ... and for this long after the last reply (a post then needs no wake-up)
_CLOSE_JOIN_S = 10.0  # close() waits this long for the reader thread, never longer
_POLICIES = ("write_through", "write_back")
_NO_BOUND = int(np.iinfo(np.int64).max)  # block limits before every rank published them
# Flow control (see _Dispatcher): replies a rank may owe this client at once, and
# the tasks of one batch message (small enough that a window holds a few).
WINDOW = 384
BATCH_CHUNK = min(MAX_BATCH_TASKS, 128)
_HEAP_SLACK = 1024  # stale deadline entries always tolerated (see _compact_deadlines)


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


_pending_callbacks = threading.local()  # .calls: done-callbacks held until the lock is free


class _CallbacksDeferred:
    """``with _CallbacksDeferred():`` -- done-callbacks of futures completed inside
    run on leaving, in completion order, so the client's lock is never held while
    user code runs.  (A class, not a generator: it is on every call's path.)"""

    __slots__ = ("_outer", "_calls")

    def __enter__(self) -> None:
        self._outer = getattr(_pending_callbacks, "calls", None)
        self._calls: list[tuple[Callable[["TransferFuture"], None], "TransferFuture"]] = []
        _pending_callbacks.calls = self._calls

    def __exit__(self, *exc: object) -> None:
        _pending_callbacks.calls = self._outer
        for cb, fut in self._calls:
            _run_callback(cb, fut)


def _run_callback(cb: Callable[["TransferFuture"], None], fut: "TransferFuture") -> None:
    """Run a done-callback; whatever it raises is logged, never passed on: on the
    reader thread even a SystemExit or KeyboardInterrupt would end the thread and
    with it the client, whose futures would all fail SHUTTING_DOWN though nobody
    closed it.  Only a KeyboardInterrupt of the main thread (Ctrl-C while a caller
    ran callbacks) goes on."""
    try:
        cb(fut)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is \
                threading.main_thread():
            raise
        log.exception("done-callback of task %d raised", fut.task_id)


class TransferFuture:
    """Completes when every rank of the task has answered (or at its deadline)."""

    def __init__(self, task_id: int, op: Op, ranks: Sequence[int], deadline: float,
                 client: "TransferClient | None" = None):
        self.task_id = task_id
        self._client = client
        self.backup: TransferFuture | None = None  # evict(..., backup_keys=...)
        self.op = op
        self.ranks = tuple(ranks)
        self.deadline = deadline  # moved under the client's lock (a write-back load's sending)
        self.submitted = time.perf_counter()
        self.completed: float | None = None
        self._replies: dict[int, Reply] = {}
        self._done = False
        # Held until the future completes: a waiter acquires it (with a timeout) and
        # passes it on.  Two plain locks cost a fraction of an Event (a Condition).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._lock = threading.Lock()
        self._error: KvswapError | None = None
        self._result: TaskResult | None = None
        self._callbacks: list[Callable[["TransferFuture"], None]] = []
        # Runs once if the task succeeds on every rank, before anyone can see the future
        # done (so before result() returns): what must hold for whoever acts on the
        # result (clear_caches' model version).  Never on an error or a timeout.
        self._on_success: Callable[[], None] | None = None

    # -- called under the client's lock --------------------------------------------
    def _on_reply(self, reply: Reply) -> bool:
        """Record one rank's reply; True once the future is complete."""
        if reply.rank not in self.ranks or reply.rank in self._replies:
            # a re-send the old incarnation had answered too, or a stray reply
            log.debug("task %d: reply from rank %d ignored (already answered or not a rank "
                      "of the task)", self.task_id, reply.rank)
            return False
        self._replies[reply.rank] = reply
        if len(self._replies) < len(self.ranks):
            return False
        failures = [RankFailure(r.rank, r.code, r.message)
                    for r in self._replies.values() if not r.ok]
        if failures:
            cls = (RankRestarted if any(f.code == ErrorCode.OUTCOME_UNKNOWN for f in failures)
                   else TransferFailed)
            self._finish(error=cls(self.task_id, self.op.value, failures))
        else:
            self._finish(result=TaskResult(self.task_id, self.op.value, dict(self._replies)))
        return True

    def missing_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self._replies]

    def _finish(self, result: TaskResult | None = None, error: KvswapError | None = None) -> None:
        with self._lock:
            if self._done:
                return
            if result is not None and self._on_success is not None:
                self._on_success()
            self._result, self._error = result, error
            self.completed = time.perf_counter()
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        self._gate.release()
        deferred = getattr(_pending_callbacks, "calls", None)
        if deferred is not None:  # under the client's lock: run once it is released
            deferred.extend((cb, self) for cb in callbacks)
            return
        for cb in callbacks:
            _run_callback(cb, self)

    # -- public ------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

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
        if not callable(fn):  # refused now, not when the reader thread would call it
            raise InvalidTask(f"add_done_callback needs a callable, got {type(fn).__name__} "
                              f"{fn!r:.60}", ErrorCode.BAD_FIELD)
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = None) -> TaskResult:
        """Wait for every rank; raise :class:`TransferFailed` naming failing ranks and
        codes, or :class:`RankTimeout` naming the ranks that have not answered.

        ``timeout=None`` waits until a second past the deadline (the reader fails
        the future at the deadline itself; the deadline of a write-back load moves
        to its sending)."""
        if timeout is None:
            t0 = time.monotonic()
            while not self._wait(max(0.0, self.deadline - time.monotonic()) + 1.0):
                if time.monotonic() >= self.deadline + 1.0:
                    self._raise_timeout(time.monotonic() - t0)
        elif not self._wait(check_seconds(timeout, "timeout", positive=False)):
            self._raise_timeout(timeout)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for completion; True once complete."""
        if self._done:
            return True
        if not self._gate.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            return self._done
        self._gate.release()  # for the next waiter
        return True

    def _raise_timeout(self, waited: float) -> None:
        missing = ", ".join(map(str, self.missing_ranks()))
        why = self._client._why_silent() if self._client is not None else ""
        raise RankTimeout(f"task {self.task_id} ({self.op.value}): rank(s) {missing} have not "
                          f"answered after {waited:.1f}s" + (f". {why}" if why else ""))

    def exception(self, timeout: float | None = None) -> KvswapError | None:
        if timeout is not None:  # a bad timeout is the caller's error, not the task's
            check_seconds(timeout, "timeout", positive=False)
        try:
            self.result(timeout)
        except KvswapError as exc:
            return exc
        return None

    @property
    def latency_s(self) -> float | None:
        return None if self.completed is None else self.completed - self.submitted


# ====================================================================== dispatcher state

class Wire(Protocol):
    """How the dispatcher reaches a rank (:class:`~kvswap.client.transport.Transport`)."""

    def channel(self, frames: Sequence[object], rank: int) -> Channel: ...

    def send(self, frames: list, rank: int, channel: Channel) -> bool: ...

    def reconnect(self, rank: int) -> None: ...


@dataclass(eq=False)
class _Envelope:
    """One message of this client and the futures it answers: a single request
    (``carrier`` alone) or a batch (``carrier`` answered under the batch id, one
    future per task; ``items`` are kept so that a re-send can rebuild the batch
    with only the tasks a rank still owes)."""

    carrier: TransferFuture
    message: Message
    tasks: tuple[TransferFuture, ...] = ()
    items: tuple[BatchItem, ...] = ()
    after: TransferFuture | None = None  # write_back: sent once this evict succeeded
    cs: int = 0  # the client sequence number, assigned at the first send
    sent: set[int] = field(default_factory=set)  # ranks whose current daemon got it
    via: dict[int, Channel] = field(default_factory=dict)  # rank -> channel it went on
    first_ep: dict[int, int] = field(default_factory=dict)  # rank -> epoch of its first send
    open: int = 0  # futures not complete yet

    @property
    def futures(self) -> tuple[TransferFuture, ...]:
        return (self.carrier, *self.tasks)


class _Dispatcher:
    """The client's state, apart from its channels.

    Every call is made under the client's lock (submitting threads post, the
    reader thread does the rest); ``wire`` is its only way out.  Every envelope
    with a future still open stays in ``_open``, keyed and ordered by ``cs``;
    each rank has a FIFO ``_backlog`` of envelopes not sent to it yet.

    * An envelope gets its ``cs`` when it is posted, and goes to each rank at
      once or, if that rank's backlog is not empty, behind it: every rank
      receives the client's messages in ``cs`` order.
    * Flow control: a rank is sent a message only while the replies it owes
      (one per future of each message sent to it and not answered yet) stay
      within :data:`WINDOW`, or when it owes none.  A daemon's ROUTER queues at
      most 1000 replies per peer and silently drops the rest; with at most
      WINDOW outstanding (plus ZMQ's lag in counting what was read, under 500)
      none is ever dropped, however slowly this thread reads.
    * Two channels, one order: a rank's messages go over its shared-memory ring
      or its ZeroMQ socket (``wire.channel``), and the daemon reads each in order
      but not the two against each other.  So a rank is sent on one channel only
      while the other owes it no reply: a small message follows the channel that
      still owes replies, a message the ring cannot carry waits in the backlog
      until the ring owes none, and a full ring keeps the message in the backlog
      until the daemon rings back.
    * A rank whose epoch changes is *frozen*: its backlog is not sent.  When it
      serves again (SERVING), every envelope its old daemon was sent and still owes an
      answer for is put in front of its backlog, in ``cs`` order, to go marked
      ``re`` (the old daemon may have run it: the new one answers it from the
      completion journal); what had never reached the rank follows unmarked.
      Everything sent to a rank has a smaller ``cs`` than everything in its
      backlog, so the rank still receives everything in ``cs`` order.  What is
      owed is computed when it is sent: a batch goes as a batch of the tasks
      the rank has not answered (same id, same ``cs``).
    """

    def __init__(self, tp_size: int, cid: int, wire: Wire, task_timeout: float,
                 rank_epoch: Callable[[int], int], rank_ready: Callable[[int], bool],
                 describe: Callable[[int], str], signed: bool = False,
                 why_silent: Callable[[], str] = lambda: ""):
        """``rank_epoch`` / ``rank_ready`` / ``describe`` read a rank's slots of the
        signal segment; ``wire`` sends; ``why_silent`` says what else may explain a
        deadline's missing answers (said once, after the ranks')."""
        self.tp_size = tp_size
        self.cid = cid
        self.task_timeout = task_timeout
        self.retried = 0  # messages re-sent to a restarted rank
        self._wire = wire
        self._rank_epoch = rank_epoch
        self._rank_ready = rank_ready
        self._describe = describe
        self._why_silent = why_silent
        self._signed = signed
        self._cs = itertools.count(1)
        self._epochs = [rank_epoch(r) for r in range(tp_size)]  # as we last addressed them
        self._frozen: set[int] = set()  # restarted ranks not serving again (SERVING)
        self._owing = [0] * tp_size  # replies each rank owes on what it was sent
        self._ring_owing = [0] * tp_size  # ... of them, on what went over its ring
        self._backlog: list[collections.deque[tuple[_Envelope, bool]]] = [
            collections.deque() for _ in range(tp_size)]  # (envelope, re) not sent yet
        self._pending: dict[int, tuple[TransferFuture, _Envelope]] = {}  # task id ->
        self._open: dict[int, _Envelope] = {}  # cs -> envelope, in cs order
        self._batches: dict[int, _Envelope] = {}  # batch id -> its open envelope
        self._waiting: dict[int, list[_Envelope]] = {}  # evict id -> write-back loads
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, task id)
        self._closed = False

    # ------------------------------------------------------------------ queries
    def busy(self) -> bool:
        """Anything that needs the restart watch: futures waiting, or a frozen rank."""
        return bool(self._pending or self._frozen or self._waiting)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a future still open (completed ones are dropped)."""
        heap = self._deadlines
        while heap and heap[0][1] not in self._pending:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # ------------------------------------------------------------------ entry points
    def post(self, env: _Envelope) -> None:
        """Send a new envelope to every rank (or queue it behind that rank's backlog)."""
        try:
            self._post(env)
        except Exception as exc:
            self.internal_error(f"sending task {env.carrier.task_id}", exc, env.futures)

    def on_reply(self, reply: Reply) -> None:
        try:
            self._on_reply(reply)
        except Exception as exc:
            env = self._batches.get(reply.id) if isinstance(reply.id, int) else None
            entry = self._pending.get(reply.id) if isinstance(reply.id, int) else None
            affected = env.futures if env else (entry[0],) if entry else ()
            self.internal_error(f"handling rank {reply.rank}'s reply to {reply.id}", exc,
                                affected)

    def watch(self) -> None:
        """Freeze ranks whose epoch changed; re-send to frozen ranks that serve again
        (:data:`SERVING`)."""
        for r in range(self.tp_size):
            try:
                epoch = self._rank_epoch(r)
                if epoch != self._epochs[r] and r not in self._frozen:
                    log.warning("rank %d restarted (epoch %d -> %d); holding its traffic until "
                                "it serves again", r, self._epochs[r], epoch)
                    self._frozen.add(r)
                if r in self._frozen and self._rank_ready(r):
                    self._unfreeze(r, epoch)
            except Exception as exc:
                owed = [f for env in self._open.values() for f in env.futures
                        if not f.done() and r not in f._replies]
                self.internal_error(f"watching rank {r}", exc, owed)

    def pump(self) -> None:
        """Send what each rank's backlog holds, as far as its window allows."""
        for r in range(self.tp_size):
            q = self._backlog[r]
            while q and r not in self._frozen:
                env, re = q[0]
                try:
                    owed = self._owed(env, r)
                    if owed is not None and not self._room(r, owed[1]):
                        break
                    q.popleft()
                    if owed is not None:
                        if self._send(env, owed[0], owed[1], [r], re):
                            q.appendleft((env, re))  # not now: the ring is full, or in use
                            break
                        if re:
                            self.retried += 1
                except Exception as exc:
                    if q and q[0][0] is env:
                        q.popleft()
                    self.internal_error(f"sending task {env.carrier.task_id} to rank {r}", exc,
                                        env.futures)

    def expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tid = heapq.heappop(self._deadlines)
            entry = self._pending.get(tid)
            if entry is None:
                continue
            fut = entry[0]
            try:
                missing = fut.missing_ranks()
                detail = "; ".join(self._describe(r) for r in missing)
                why = self._why_silent()
                error = RankTimeout(
                    f"task {tid} ({fut.op.value}) not acknowledged within "
                    f"{self.task_timeout:.1f}s by {len(missing)} rank(s): {detail}"
                    + (f". {why}" if why else ""))
            except Exception as exc:
                self.internal_error(f"expiring task {tid}", exc, [fut])
                continue
            self._complete(fut, error=error)

    def close(self) -> None:
        """Fail every future with SHUTTING_DOWN; later posts fail the same way."""
        self._closed = True
        waiting = [env for deps in self._waiting.values() for env in deps]
        self._waiting.clear()
        for fut, _ in list(self._pending.values()):
            self._complete(fut, error=_closed_error(fut))
        for env in waiting:
            for f in env.futures:
                f._finish(error=_closed_error(f))
        for q in self._backlog:
            q.clear()

    def drop_waiting(self, task_id: int) -> bool:
        """Cancel the write-back load ``task_id`` if it is still held for its evict:
        never sent, no rank knows its id, so a ``cancel`` would answer false and the
        load would run later.  It fails CANCELLED on every rank here; False if it is
        not held (sent already, or not a write-back load)."""
        for evict_id, envs in self._waiting.items():
            for env in envs:
                if env.carrier.task_id == task_id:
                    envs.remove(env)
                    if not envs:
                        del self._waiting[evict_id]
                    f = env.carrier
                    f._finish(error=TransferFailed(f.task_id, f.op.value, [
                        RankFailure(r, ErrorCode.CANCELLED, f"write-back load {f.task_id} "
                                    f"cancelled before it was sent (its evict had not "
                                    f"completed): nothing was copied") for r in f.ranks]))
                    return True
        return False

    def internal_error(self, where: str, exc: BaseException,
                       futures: Iterable[TransferFuture]) -> None:
        """A bug costs the futures it touched, never the client."""
        hit = [f for f in futures if not f.done()]
        log.error("client: unexpected error while %s; failing %d task(s) with "
                  "INTERNAL_ERROR", where, len(hit), exc_info=exc)
        for f in hit:
            self._complete(f, error=KvswapError(
                f"task {f.task_id} ({f.op.value}): the client failed while "
                f"{where}: {type(exc).__name__}: {exc} (the client log has the traceback)",
                ErrorCode.INTERNAL_ERROR))

    # ------------------------------------------------------------------ internals
    def _post(self, env: _Envelope) -> None:
        if env.carrier._done and all(f._done for f in env.tasks):
            return  # failed while it waited (an internal error, a close)
        if self._closed:
            for f in env.futures:
                f._finish(error=_closed_error(f))
            return
        if env.after is not None:
            if not env.after.done():
                self._waiting.setdefault(env.after.task_id, []).append(env)
                return
            err = env.after._error
            if err is not None:
                f = env.carrier
                f._finish(error=TransferFailed(f.task_id, f.op.value, [
                    RankFailure(r, ErrorCode.CANCELLED, f"not submitted: write-back evict "
                                f"{env.after.task_id} failed ({err})") for r in f.ranks]))
                return
            env.carrier.deadline = time.monotonic() + self.task_timeout  # counts from sending
        env.cs = next(self._cs)
        env.open = len(env.futures)
        self._open[env.cs] = env
        if env.tasks:
            self._batches[env.carrier.task_id] = env
        for f in env.futures:
            self._pending[f.task_id] = (f, env)
            heapq.heappush(self._deadlines, (f.deadline, f.task_id))
        if len(self._deadlines) > 2 * len(self._pending) + _HEAP_SLACK:
            self._compact_deadlines()
        cost = len(env.futures)
        now = []
        for r in env.carrier.ranks:
            if self._backlog[r] or not self._room(r, cost):
                self._backlog[r].append((env, False))
            else:
                now.append(r)
        if now:
            for r in self._send(env, env.message, cost, now, re=False):
                self._backlog[r].append((env, False))

    def _compact_deadlines(self) -> None:
        """Keep only open futures' deadlines.  A completed future's entry leaves the
        heap when it reaches the top, so one future open for long (a ``receive_into``
        waiting for its sender, a task stuck until its deadline) keeps the entry of
        every task completed after it: 390,000 at 6.5k tasks/s for the default 60 s,
        45 MB, then popped in one go under the lock (1-2 s here).  Rebuilt when stale
        entries outnumber open ones, the cost is O(1) a post, amortised."""
        self._deadlines = [(f.deadline, tid) for tid, (f, _) in self._pending.items()]
        heapq.heapify(self._deadlines)

    def _room(self, r: int, cost: int) -> bool:
        return r not in self._frozen and (self._owing[r] == 0
                                          or self._owing[r] + cost <= WINDOW)

    def _send(self, env: _Envelope, message: Message, cost: int, ranks: Sequence[int],
              re: bool) -> list[int]:
        """Send ``message`` (answering ``cost`` futures of ``env``) to ``ranks``; returns
        the ranks it could not go to now (their backlog keeps it)."""
        epochs = self._epochs if message.epoch_stamped else None
        ts = time.time_ns() if self._signed else None  # a re-send is a new message, not a replay
        try:
            frames = message.frames(epochs, ts=ts, cid=self.cid, cs=env.cs, re=re)
        except ProtocolError as exc:  # too large: a daemon could not say which request failed
            for f in env.futures:
                self._complete(f, error=TransferFailed(f.task_id, f.op.value, [
                    RankFailure(r, exc.code, exc.message) for r in ranks]))
            return []
        later = []
        for r in ranks:
            channel = self._channel(frames, r)
            if channel is None or not self._wire.send(frames, r, channel):
                later.append(r)
                continue
            env.sent.add(r)
            env.via[r] = channel
            self._owing[r] += cost
            if channel is Channel.RING:
                self._ring_owing[r] += cost
            if message.epoch_stamped:
                env.first_ep.setdefault(r, self._epochs[r])
        return later

    def _channel(self, frames: list, r: int) -> Channel | None:
        """The channel rank ``r`` may be sent ``frames`` on now, or None (class doc)."""
        wanted = self._wire.channel(frames, r)
        if wanted is Channel.RING:
            return Channel.ZMQ if self._owing[r] > self._ring_owing[r] else Channel.RING
        return None if self._ring_owing[r] else Channel.ZMQ

    def _release(self, env: _Envelope, r: int) -> None:
        """Rank ``r`` owes one reply less on ``env``."""
        self._owing[r] -= 1
        if env.via.get(r) is Channel.RING:
            self._ring_owing[r] -= 1

    def _on_reply(self, reply: Reply) -> None:
        if reply.code == ErrorCode.RANK_RESTARTED:
            return  # addressed to a dead incarnation: the re-send after the restart covers it
        if not isinstance(reply.id, int):
            log.warning("dropping a reply without a task id from rank %d: [%d %s] %s",
                        reply.rank, int(reply.code), reply.code.name, reply.message)
            return
        batch = self._batches.get(reply.id)
        entry = self._pending.get(reply.id)
        env = batch if batch is not None else entry[1] if entry is not None else None
        if env is not None and reply.code == ErrorCode.NOT_READY and self._stale(env, reply.rank):
            log.debug("NOT_READY from rank %d for %d, sent to an earlier epoch: the re-send "
                      "after the restart answers it", reply.rank, reply.id)
            return
        if batch is not None and not reply.ok:
            self._refuse_batch(batch, reply)
        if entry is None:
            log.debug("reply for unknown or finished task %d from rank %d", reply.id, reply.rank)
            return
        self._record(*entry, reply)

    def _stale(self, env: _Envelope, r: int) -> bool:
        """Was ``env`` first sent to rank ``r`` stamped with an epoch it has since left?

        A restarted daemon that is not READY yet checks its state before the stamp,
        so it answers a message addressed to its dead predecessor NOT_READY, not
        RANK_RESTARTED; such a reply is dropped like RANK_RESTARTED."""
        first = env.first_ep.get(r)
        return first is not None and 0 <= r < self.tp_size and first != self._rank_epoch(r)

    def _record(self, fut: TransferFuture, env: _Envelope, reply: Reply) -> None:
        r = reply.rank
        if r in fut.ranks and r not in fut._replies and r in env.sent:
            self._release(env, r)
        if fut._on_reply(reply):
            self._settle(fut, env)

    def _refuse_batch(self, env: _Envelope, reply: Reply) -> None:
        """A rank refused a batch whole: its tasks there get no reply of their own."""
        for t in env.tasks:
            if not t.done() and reply.rank not in t._replies:
                self._record(t, env, Reply(t.task_id, reply.rank, False, reply.code,
                                           f"batch {env.carrier.task_id} refused: "
                                           f"{reply.message}"))

    def _unfreeze(self, r: int, epoch: int) -> None:
        """The restarted rank ``r`` is READY: what its old daemon was sent and never
        answered goes first (marked ``re``), then its backlog."""
        self._epochs[r] = epoch
        self._frozen.discard(r)
        self._owing[r] = 0  # the old daemon's answers are not coming
        self._ring_owing[r] = 0
        self._wire.reconnect(r)  # its rings are the new daemon's
        resend = []
        for env in self._open.values():
            if r in env.sent:
                env.sent.discard(r)
                env.via.pop(r, None)
                resend.append((env, True))
        self._backlog[r].extendleft(reversed(resend))

    def _owed(self, env: _Envelope, r: int) -> tuple[Message, int] | None:
        """What rank ``r`` still owes an answer for, as (message, futures it answers);
        None if nothing."""
        if not env.tasks:
            f = env.carrier
            return None if f.done() or r in f._replies else (env.message, 1)
        owed = [i for i, t in enumerate(env.tasks) if not t.done() and r not in t._replies]
        carrier = int(not env.carrier.done() and r not in env.carrier._replies)
        if not owed and not carrier:
            return None
        if len(owed) == len(env.tasks):
            return env.message, carrier + len(owed)
        return (batch_message(env.carrier.task_id, [env.items[i] for i in owed]),
                carrier + len(owed))

    def _complete(self, fut: TransferFuture, error: KvswapError) -> None:
        if fut.done():
            return
        fut._finish(error=error)
        entry = self._pending.get(fut.task_id)
        if entry is not None:
            self._settle(*entry)

    def _settle(self, fut: TransferFuture, env: _Envelope) -> None:
        """``fut`` has completed: free the window slots of ranks that had not answered
        it, forget it (and its envelope once all of it has), and post the write-back
        loads that waited for it."""
        self._pending.pop(fut.task_id, None)
        for r in env.sent:
            if r not in fut._replies:
                self._release(env, r)
        env.open -= 1
        if env.open <= 0:
            self._open.pop(env.cs, None)
            self._batches.pop(env.carrier.task_id, None)
        for dep in self._waiting.pop(fut.task_id, ()):
            self.post(dep)


# The states in which a restarted rank takes its held traffic again: READY, or the
# namespace's mode it came back into (a paused or cleared namespace), where it answers
# transfers PAUSED / CLEARED and the resume() or restore_caches() that ends the mode.
SERVING = frozenset({RankState.READY, RankState.PAUSED, RankState.CLEARED})


def _client_closed() -> KvswapError:
    return KvswapError("TransferClient is closed", ErrorCode.SHUTTING_DOWN)


def _closed_error(fut: TransferFuture) -> KvswapError:
    return KvswapError(f"task {fut.task_id} ({fut.op.value}): client closed",
                       ErrorCode.SHUTTING_DOWN)


# ====================================================================== the client


class TransferClient:
    """Submit evict/load/control tasks to every rank of a namespace.

    Thread-safe.  ``task_timeout`` is every task's deadline: no future waits past it.
    Every argument of every call is checked in the calling thread, before anything
    is created or sent; a bad one raises :class:`InvalidTask` (also a ``ValueError``)
    naming the argument and what it may be.
    """

    def __init__(self, namespace: str, tp_size: int, run_root: str | None = None,
                 task_timeout: float = 60.0, tcp: str | None = None,
                 secret: bytes | None = None, path: str | None = None):
        """``tcp="HOST:BASEPORT"`` talks to the ranks' tcp:// listeners instead of their
        ipc:// sockets, signing every message with ``secret`` (the signal segment is
        still read from this node's /dev/shm).

        ``path``: ``"ring"`` (the default on ipc://) sends what fits through each
        rank's shared-memory rings and the rest over ZeroMQ; ``"zmq"`` (the default
        and the only choice with ``tcp``) uses ZeroMQ alone.  A rank whose rings are
        owned by another client, or whose daemon has none, is served over ZeroMQ."""
        tp_size = check_int(tp_size, "tp_size", 1, sys.maxsize)
        task_timeout = check_seconds(task_timeout, "task_timeout", positive=True, most=MAX_SECONDS)
        if path is None:
            path = "zmq" if tcp is not None else "ring"
        if path not in (p.value for p in PathChoice):
            raise InvalidTask(f"path must be 'ring' or 'zmq', got {path!r:.60}",
                              ErrorCode.BAD_FIELD)
        if path == PathChoice.RING.value and tcp is not None:
            raise InvalidTask("path='ring' needs this node's ipc:// sockets; a tcp:// client "
                              "uses path='zmq'", ErrorCode.BAD_FIELD)
        if tcp is not None:
            if not isinstance(tcp, str):
                raise InvalidTask(f"tcp must be 'HOST:BASEPORT', got {type(tcp).__name__}",
                                  ErrorCode.BAD_FIELD)
            if not isinstance(secret, (bytes, bytearray)) or not secret:
                raise InvalidTask("a tcp:// client needs the shared secret (non-empty bytes)",
                                  ErrorCode.BAD_FIELD)
        self.names = Names.of(namespace, run_root)
        self.tp_size = tp_size
        self.task_timeout = task_timeout
        endpoints = (tcp_endpoints(tcp, tp_size) if tcp is not None
                     else [self.names.endpoint(r) for r in range(tp_size)])
        self.seg = SignalSegment.attach(self.names, readonly=True)
        if self.seg.tp_size != tp_size:
            tp = self.seg.tp_size
            self.seg.close()
            raise NamespaceError(f"namespace {namespace!r} has tp_size {tp}, client asked {tp_size}")
        # Task ids are unique across clients (they key the layer-progress table):
        # a random 31-bit prefix, then a counter.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)
        self.cid = secrets.randbelow(CID_LIMIT - 1) + 1  # 1 <= cid < CID_LIMIT
        # The model version storage requests carry (set_model_version); None: the
        # daemons' --model-version.  Read once per request by the submitting thread.
        self._model_version: str | None = None
        self._secret = bytes(secret) if tcp is not None else None
        self.path = PathChoice(path)
        self._wire = Transport(self.names, endpoints, self.path, self.cid,
                               lambda r: int(self.seg.ranks[r, RankSlot.EPOCH]), self._secret)
        self._ctx = self._wire.ctx
        self._io = _Dispatcher(tp_size, self.cid, self._wire, task_timeout,
                               rank_epoch=lambda r: int(self.seg.ranks[r, RankSlot.EPOCH]),
                               rank_ready=lambda r: self.seg.state_of(r) in SERVING,
                               describe=self._describe, why_silent=self._why_silent,
                               signed=self._secret is not None)
        # Under _lock: the dispatcher, every send, _closed, _idle.  Re-entrant: a
        # done-callback (run under it by the reader) may submit.
        self._lock = threading.RLock()
        self._closed = False
        self._idle = False  # the reader sleeps longer than _WATCH_MS: a post must wake it
        self._linger_until = 0.0  # the reader sleeps at most _WATCH_MS until then
        self._next_watch = 0.0  # the reader looks for restarted ranks from then on
        self._look_all = False  # the reader must read every channel, signalled or not
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._io_loop, name="kvswap-client-io",
                                        daemon=True)
        self._thread.start()

    @property
    def retried(self) -> int:
        """Messages re-sent to a restarted rank (for operators and tests)."""
        return self._io.retried

    # ------------------------------------------------------------------ readiness
    def _describe(self, r: int) -> str:
        """A rank's state, heartbeat, last error and log, for errors that name it."""
        state = self.seg.state_of(r)
        age = self.seg.heartbeat_age_s(r)
        beat = "no heartbeat" if age is None else f"heartbeat {age:.1f}s ago"
        err = int(self.seg.ranks[r, RankSlot.LAST_ERROR])
        extra = f", last error {err} {code_name(err)}" if err else ""
        return f"rank {r} is {state.name} ({beat}{extra}; log {self.names.log_path(r)})"

    def _why_silent(self) -> str:
        """What explains unanswered tasks besides each rank's state, for a timeout's
        error: replies dropped because they failed the signature check (under the lock);
        connections a rank refused for want of file descriptors (a refused client's
        messages never reach it, and libzmq retries the connection silently)."""
        why = []
        bad = self._wire.bad_signatures
        if bad:
            why.append(f"{bad} repl{'y' if bad == 1 else 'ies'} to this client failed the "
                       f"signature check ({self._wire.bad_signature_why}) and were dropped "
                       f"unread: the secret given to TransferClient(secret=...) probably "
                       f"differs from the daemons' (kvswap launch --secret-file)")
        try:
            refused = {r: int(self.seg.ranks[r, RankSlot.CONN_REFUSED])
                       for r in range(self.tp_size)}
        except SegmentClosed:
            refused = {}
        for r, n in refused.items():
            if n:
                why.append(f"rank {r} has refused {n} connection(s) since it started because "
                           f"its share of file descriptors was used up (its log names the "
                           f"limit): if this client's was one, its messages never reached the "
                           f"rank; close idle clients, or raise the daemon's hard open-file "
                           f"limit (ulimit -Hn, systemd LimitNOFILE=) and relaunch")
        return ". ".join(why)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every rank is READY, or raise :class:`RankTimeout` naming each
        rank that is not, with its state and log file.

        Another thread's :meth:`close` ends the wait with the closed client's error
        (SHUTTING_DOWN) within one poll (at most 20 ms)."""
        timeout = check_seconds(timeout, "timeout", positive=False)
        self._check_open()

        def ready(r: int) -> bool:
            self._check_open()
            state = self.seg.state_of(r)
            if state in (RankState.FAILED, RankState.STOPPED, RankState.STOPPING):
                raise NotReady(f"waiting for all ranks READY: {self._describe(r)}")
            return state == RankState.READY

        try:
            wait_ranks(self.seg, range(self.tp_size), ready, timeout, "all ranks READY",
                       self._describe)
        except SegmentClosed:  # close() ran between _check_open and the read
            raise _client_closed() from None

    def _block_limits(self) -> tuple[int, int]:
        """Smallest device/host block counts over ranks; no bound while a rank has not
        published them yet."""
        self._check_open()
        try:
            ranks = self.seg.ranks
        except SegmentClosed:  # close() ran since _check_open
            raise _client_closed() from None
        dev = min(ranks[:, RankSlot.NUM_DEVICE_BLOCKS].tolist())  # a few ranks: no numpy reduction
        host = min(ranks[:, RankSlot.NUM_HOST_BLOCKS].tolist())
        if dev and host:
            return dev, host
        return _NO_BOUND, _NO_BOUND

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: every later call is refused."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise _client_closed()

    # ------------------------------------------------------------------ submission
    def evict(self, device_blocks: Any, host_blocks: Any, *, priority: int = 0,
              backup_keys: Sequence[bytes] | None = None) -> TransferFuture:
        """Copy device blocks to host blocks (pairwise) for every tensor on every rank.

        ``backup_keys`` (write-through to storage): also back the host blocks up under
        these keys; its future is the returned future's ``backup``.  Sent with the
        evict, so that every later task on these host blocks runs after it on every
        rank (hazard ordering), it names the evict (``after``) and each rank runs it
        only if the evict succeeded there: an evict cancelled or failed on a rank left
        that rank's host blocks holding their old bytes, which must never be stored
        under these keys; the backup is then CANCELLED on that rank."""
        dev, host, prio, _ = self._check_transfer(Op.EVICT, device_blocks, host_blocks,
                                                  priority, False, self._block_limits())
        backup = None
        if backup_keys is not None:
            backup = self._check_storage(Op.BACKUP, host_blocks, backup_keys, priority)
        fut, env = self._transfer_envelope(Op.EVICT, dev, host, prio, False)
        envelopes = [env]
        if backup is not None:
            fut.backup, backup_env = self._storage_envelope(Op.BACKUP, *backup,
                                                            after=fut.task_id)
            envelopes.append(backup_env)
        self._submit(envelopes)
        return fut

    def load(self, host_blocks: Any, device_blocks: Any, *, priority: int = 0,
             layerwise: bool = False) -> TransferFuture:
        """Copy host blocks to device blocks (pairwise) for every tensor on every rank.

        ``layerwise=True``: each rank copies layer by layer and publishes progress,
        so a TP worker can start on layer 0 with ``CacheWorker.wait_layer(
        future.task_id, 0, timeout)`` before the last layer has arrived."""
        checked = self._check_transfer(Op.LOAD, device_blocks, host_blocks, priority,
                                       layerwise, self._block_limits())
        fut, env = self._transfer_envelope(Op.LOAD, *checked)
        self._submit([env])
        return fut

    # ------------------------------------------------------------------ storage tier
    def backup(self, host_blocks: Any, keys: Sequence[bytes], *,
               priority: int = 0) -> TransferFuture:
        """Host swap space -> storage: host block i is stored under ``keys[i]`` (from
        :func:`block_hashes`) on every rank.  Keys already stored are skipped; each
        reply says how many were stored (``count``) and ``skipped``."""
        return self._storage(Op.BACKUP, host_blocks, keys, priority)

    def prefetch(self, keys: Sequence[bytes], host_blocks: Any, *, priority: int = 0,
                 policy: str = "wait_complete", timeout: float | None = None,
                 min_blocks: int = 0) -> TransferFuture:
        """Storage -> host swap space for the longest prefix of ``keys`` that every rank
        holds and can read intact; ``result().count`` is that prefix length (the ranks
        agree on it through shared memory).  Host blocks past it hold nothing usable.

        ``policy`` says when reading stops (docs/storage.md "Prefetch policies"):
        ``"wait_complete"`` reads every key; ``"timeout"`` stops ``timeout`` seconds
        after the request reached each daemon; ``"best_effort"`` stops there too if
        ``timeout`` is given, and at a store error instead of failing.  Either way
        every rank commits the same prefix: the shortest any rank completed in time.
        An agreed prefix shorter than ``min_blocks`` loads nothing (count 0)."""
        opts = PrefetchOptions.of(policy, timeout, min_blocks)
        return self._storage(Op.PREFETCH, host_blocks, keys, priority, opts)

    def exists(self, keys: Sequence[bytes]) -> TransferFuture:
        """``result().count``: how many leading keys are stored on every rank."""
        return self._storage(Op.EXISTS, None, keys, 0)

    def set_model_version(self, version: str) -> None:
        """Name the weights every later backup, prefetch and exists works under, on every
        rank: entry names and fingerprints change with it, so entries written under
        another version are never matched (left to the store's LRU/TTL).  ``""`` is
        no version; until called, the daemons' ``--model-version`` applies.  After a
        weight update, prefer ``clear_caches(model_version=...)``, which also drops
        the host swap space's contents."""
        self._model_version = check_model_version(version)

    def _storage(self, op: Op, host_blocks: Any, keys: Sequence[bytes], priority: int,
                 prefetch: PrefetchOptions | None = None) -> TransferFuture:
        fut, env = self._storage_envelope(op, *self._check_storage(op, host_blocks, keys,
                                                                   priority), prefetch)
        self._submit([env])
        return fut

    def _check_storage(self, op: Op, host_blocks: Any, keys: Sequence[bytes],
                       priority: int) -> tuple[np.ndarray | None, np.ndarray, int]:
        prio = check_priority(priority)
        k = as_keys(keys)
        host = None if host_blocks is None else as_block_ids(host_blocks, "host_blocks")
        validate_storage(op, host, k.shape[0], self._block_limits()[1])
        return host, k, prio

    def _storage_envelope(self, op: Op, host: np.ndarray | None, keys: np.ndarray,
                          priority: int, prefetch: PrefetchOptions | None = None,
                          after: int | None = None) -> tuple[TransferFuture, _Envelope]:
        fut = self._new_future(op)
        return fut, _Envelope(fut, storage_message(op, fut.task_id, host, keys, priority,
                                                   self._model_version, prefetch, after))

    def submit_batch(self, tasks: Sequence["TransferSpec"]) -> list[TransferFuture]:
        """Submit many tasks; one future per task, in order.  Every task is validated
        before anything is sent.  Tasks travel in ``batch`` messages of at most
        :data:`BATCH_CHUNK` tasks each (a longer list becomes several messages, sent
        in order), well within the protocol's ``MAX_BATCH_TASKS`` and the client's
        flow-control window, so any number of tasks is answered."""
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
            raise InvalidTask(f"tasks must be a sequence of TransferSpec, got "
                              f"{type(tasks).__name__}", ErrorCode.BAD_FIELD)
        limits = self._block_limits()
        checked = [self._check(t, limits, f"tasks[{i}]: ") for i, t in enumerate(tasks)]
        futures = [self._new_future(t.op) for t in tasks]
        envelopes = []
        for lo in range(0, len(futures), BATCH_CHUNK):
            chunk = range(lo, min(lo + BATCH_CHUNK, len(futures)))
            items = tuple(BatchItem(futures[i].task_id, tasks[i].op, *checked[i]) for i in chunk)
            carrier = self._new_future(Op.BATCH)
            envelopes.append(_Envelope(carrier, batch_message(carrier.task_id, items),
                                       tuple(futures[i] for i in chunk), items))
        self._submit(envelopes)
        return futures

    def submit_swap(self, evict: tuple[Any, Any], load: tuple[Any, Any],
                    policy: str = "write_through") -> tuple[TransferFuture, TransferFuture]:
        """An evict ``(device, host)`` and a load ``(host, device)`` under a write policy.

        ``write_through``: both are submitted now; the daemons' hazard ordering
        still runs them in order wherever their blocks overlap.
        ``write_back``: the load is submitted only once the evict has completed on
        every rank; if the evict fails the load is never sent and its future fails
        with CANCELLED.  Both are checked before either is submitted.
        """
        if policy not in _POLICIES:
            raise InvalidTask(f"policy must be one of {', '.join(_POLICIES)}, got {policy!r:.60}")
        for what, pair in (("evict", evict), ("load", load)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                order = "(device_blocks, host_blocks)" if what == "evict" else \
                    "(host_blocks, device_blocks)"
                raise InvalidTask(f"{what} must be a pair {order}, got {type(pair).__name__}",
                                  ErrorCode.BAD_FIELD)
        limits = self._block_limits()
        ev_checked = self._check_transfer(Op.EVICT, evict[0], evict[1], 0, False, limits,
                                          "evict: ")
        ld_checked = self._check_transfer(Op.LOAD, load[1], load[0], 0, False, limits, "load: ")
        ev_fut, ev_env = self._transfer_envelope(Op.EVICT, *ev_checked)
        ld_fut, ld_env = self._transfer_envelope(Op.LOAD, *ld_checked)
        if policy == "write_back":
            ld_env.after = ev_fut
        self._submit([ev_env, ld_env])
        return ev_fut, ld_fut

    # ------------------------------------------------------------------ peer transfer
    def receive_into(self, host_blocks: Any, *, ttl_s: float | None = None,
                     secret: bytes | None = None) -> tuple[bytes, TransferFuture]:
        """Decode side of a node-to-node transfer (docs/pd.md): hold ``host_blocks`` on
        every rank for a sender and return ``(ticket, received)``.  Hand the ticket
        (msgpack bytes) to the prefill side's :meth:`send_to`; ``received`` completes
        once every rank's blocks have landed (then load them as usual), or fails:
        TICKET_EXPIRED after ``ttl_s`` (default: the task timeout) without a sender,
        CANCELLED by ``received.cancel()`` before a sender began.  The ticket is
        signed with this client's secret (a tcp client) or ``secret``."""
        from kvswap.client.peer_client import receive_into

        return receive_into(self, host_blocks, ttl_s, secret)

    def send_to(self, ticket: bytes, host_blocks: Any, *, secret: bytes | None = None,
                priority: int = 0) -> TransferFuture:
        """Prefill side: push ``host_blocks`` (already evicted; the push runs after those
        evicts on every rank) into the blocks ``ticket`` names, rank r to rank r.  A
        ticket that does not pair (TP size, layout, count, expired, and with the
        receiving namespace's ``secret`` its HMAC) raises :class:`TicketRefused` here,
        before anything is sent."""
        from kvswap.client.peer_client import send_to

        return send_to(self, ticket, host_blocks, secret, priority)

    def ping(self) -> TransferFuture:
        return self._control(Op.PING)

    def stats(self) -> TransferFuture:
        return self._control(Op.STATS)

    def shutdown(self) -> TransferFuture:
        """Ask every daemon to stop (normally the launcher's job).  Under `kvswap launch`
        this ends the namespace: a daemon stopped on request is not restarted, and the
        launcher tears the namespace down (docs/operations.md section 7)."""
        return self._control(Op.SHUTDOWN)

    def pause(self) -> TransferFuture:
        """Every rank refuses new transfers (code PAUSED); completes once every task
        accepted before has finished on every rank."""
        return self._control(Op.PAUSE)

    def resume(self) -> TransferFuture:
        return self._control(Op.RESUME)

    def clear_caches(self, free_host: bool = False,
                     model_version: str | None = None) -> TransferFuture:
        """For a weight update: every rank drains, releases its device mappings (and
        its host swap pool if ``free_host``), and reports CLEARED through the shm
        barrier; the future completes when every rank has.  Transfers meanwhile
        get code CLEARED.

        ``model_version``: the new weights' version.  The host swap pool is freed as
        with ``free_host=True``, and once every rank has cleared, every storage
        request uses the new version (:meth:`set_model_version`): the switch happens
        before the future is seen done, so storage requests sent after ``result()``
        returns use it.  Nothing of the old weights is then loaded from host memory
        or from storage (a HostCache must also ``clear()``).

        The version changes only if every rank cleared, and only if
        :meth:`set_model_version` did not change it while the clear ran (that later
        call wins).  If any rank refused (e.g.
        NOT_READY: it was not READY or PAUSED) or failed, or the future timed out,
        the client keeps its version: a rank that did not clear still holds the old
        weights' blocks, and a backup under the new version would store them as new.
        Ranks that did clear have freed their pools; the error names the ranks that
        refused, failed or did not answer.
        Bring every rank to READY or PAUSED (``restore_caches()``, re-register,
        ``wait_ready()``) and clear again; only if you know every pool was freed,
        :meth:`set_model_version` instead."""
        free = check_flag(free_host, "free_host")
        version = None if model_version is None else check_model_version(model_version)
        if version is not None:
            free = True
        fut = self._new_future(Op.CLEAR)
        if version is not None:
            before = self._model_version

            def switch() -> None:  # unless set_model_version() changed it meanwhile
                if self._model_version == before:
                    self._model_version = version
            fut._on_success = switch
        self._submit([_Envelope(fut, Message(request_header(
            Op.CLEAR, fut.task_id, {"free_host": True} if free else None), []))])
        return fut

    def restore_caches(self) -> TransferFuture:
        """After :meth:`clear_caches`: every rank accepts a new register.  Then each
        TP worker registers its tensors again and :meth:`wait_ready` returns once
        every rank has re-attached."""
        return self._control(Op.RESTORE)

    def _control(self, op: Op, fields: dict | None = None) -> TransferFuture:
        fut = self._new_future(op)
        self._submit([_Envelope(fut, Message(request_header(op, fut.task_id, fields), []))])
        return fut

    def _cancel(self, target: TransferFuture) -> TransferFuture:
        """A ``cancel`` to every rank, or, for a write-back load still held for its evict,
        done here: the load fails CANCELLED on every rank, and so does the returned
        future's every reply say ``cancelled`` true."""
        with _CallbacksDeferred(), self._lock:
            self._check_open()
            if self._io.drop_waiting(target.task_id):
                fut = self._new_future(Op.CANCEL)
                fut._finish(result=TaskResult(fut.task_id, Op.CANCEL.value, {
                    r: Reply(fut.task_id, r, True, ErrorCode.OK, "", fields={"cancelled": True})
                    for r in range(self.tp_size)}))
                return fut
        return self._control(Op.CANCEL, {"target": target.task_id})

    def _check(self, spec: Any, limits: tuple[int, int], where: str
               ) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """:meth:`_check_transfer` of one task of a batch (``where`` names it)."""
        if not isinstance(spec, TransferSpec):
            raise InvalidTask(f"{where}expected a TransferSpec (TransferSpec.evict(...) or "
                              f".load(...)), got {type(spec).__name__}", ErrorCode.BAD_FIELD)
        if not isinstance(spec.op, Op) or spec.op not in (Op.EVICT, Op.LOAD):
            raise InvalidTask(f"{where}op must be Op.EVICT or Op.LOAD (build it with "
                              f"TransferSpec.evict(...) or .load(...)), got "
                              f"{type(spec.op).__name__} {spec.op!r:.40}", ErrorCode.BAD_FIELD)
        return self._check_transfer(spec.op, spec.device_blocks, spec.host_blocks,
                                    spec.priority, spec.layerwise, limits, where)

    def _check_transfer(self, op: Op, device_blocks: Any, host_blocks: Any, priority: Any,
                        layerwise: Any, limits: tuple[int, int], where: str = ""
                        ) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """Every field of one evict/load: ids, ranges, duplicates, priority, layerwise
        (``where`` prefixes each message).  Returns (device ids, host ids, priority,
        layerwise) ready for the wire."""
        try:
            dev = as_block_ids(device_blocks, "device_blocks")
            host = as_block_ids(host_blocks, "host_blocks")
            validate_transfer(op, dev, host, *limits)
            priority = check_priority(priority)
            layerwise = check_flag(layerwise, "layerwise")
        except InvalidTask as exc:
            if not where:
                raise
            raise InvalidTask(where + exc.message, exc.code) from None
        if layerwise and op is not Op.LOAD:
            raise InvalidTask(f"{where}layerwise applies to load only", ErrorCode.BAD_FIELD)
        return dev, host, priority, layerwise

    def _transfer_envelope(self, op: Op, dev: np.ndarray, host: np.ndarray, priority: int,
                           layerwise: bool) -> tuple[TransferFuture, _Envelope]:
        fut = self._new_future(op)
        return fut, _Envelope(fut, transfer_message(op, fut.task_id, dev, host, priority,
                                                    layerwise))

    def _new_future(self, op: Op) -> TransferFuture:
        return TransferFuture(next(self._ids), op, range(self.tp_size),
                              time.monotonic() + self.task_timeout, self)

    def _submit(self, envelopes: Sequence[_Envelope]) -> None:
        """Send envelopes, in this order, from the calling thread (under the lock)."""
        with _CallbacksDeferred(), self._lock:
            self._check_open()
            for env in envelopes:
                self._io.post(env)
            if self._wire.take_look():
                self._look_all = True
            if self._idle or self._look_all:
                self._wake()

    def _wake(self) -> None:
        """Wake the reader (under the lock)."""
        self._idle = False
        try:
            os.write(self._wake_w, b"\x01")
        except BlockingIOError:
            pass  # bytes are waiting: it wakes

    # ------------------------------------------------------------------ reader thread
    def _io_loop(self) -> None:
        poller = select.poll()
        fds: list[int] = []
        try:
            while True:
                with self._lock:
                    timeout_ms = self._sleep_ms()
                    if fds != (now := [self._wake_r, *self._wire.fds()]):
                        for fd in fds:
                            poller.unregister(fd)
                        fds = now
                        for fd in fds:
                            poller.register(fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll(timeout_ms)}
                if self._io_step(ready):
                    return
        finally:
            self._io_teardown()

    def _sleep_ms(self) -> int | None:
        """How long the reader may sleep (under the lock): until the next deadline, at
        most _WATCH_MS while anything is outstanding, not at all if a ring holds a
        completion or a channel changed; with nothing to wait for, until a post wakes
        it (a post wakes a reader that sleeps longer than _WATCH_MS)."""
        if self._wire.take_look():
            self._look_all = True
        if self._closed or self._look_all or not self._wire.arm():
            return 0
        timeout_ms = None
        deadline = self._io.next_deadline()
        if deadline is not None:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
        if self._io.busy() or time.monotonic() < self._linger_until:
            # watch for rank restarts while anything is outstanding; and keep waking at
            # that pace for a while after the last reply, so that a busy engine's next
            # post finds the reader on a short sleep and need not wake it
            timeout_ms = min(timeout_ms if timeout_ms is not None else _WATCH_MS, _WATCH_MS)
        self._idle = timeout_ms is None or timeout_ms > _WATCH_MS
        return timeout_ms

    def _io_step(self, ready: set[int]) -> bool:
        """One round of the reader (``ready``: the descriptors poll found readable);
        True once the client is closed and drained.  Done-callbacks run after it lets
        go of the lock."""
        with _CallbacksDeferred(), self._lock:
            try:
                self._idle = False
                if self._look_all:
                    self._look_all = False
                    ready = ready | self._wire.everything()
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                closed = self._closed
                if closed:
                    self._io.close()
                now = time.monotonic()
                if now >= self._next_watch:
                    self._next_watch = now + _WATCH_MS / 1000
                    self._io.watch()
                replies = self._wire.receive(ready)
                if replies:
                    self._linger_until = time.monotonic() + _LINGER_S
                for reply in replies:
                    self._io.on_reply(reply)
                self._io.expire(time.monotonic())
                self._io.pump()
                return closed
            except Exception:  # nothing above is expected to raise: each unit guards itself
                log.exception("client reader thread: unexpected error outside any task; "
                              "continuing")
                return self._closed

    def _io_teardown(self) -> None:
        """Last act of the reader thread: fail what is left, close the channels, end
        the context (every socket has LINGER 0, so term() returns at once)."""
        with self._lock:
            self._closed = True  # also when the reader ends on an error of its own
            self._io.close()
            self._wire.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the reader thread; pending futures fail with SHUTTING_DOWN.

        Never hangs: the reader is joined for at most 10 s.  If it is still
        inside a done-callback by then (or close() is called from one), it
        finishes the teardown itself when the callback returns, and the signal
        segment is left to the garbage collector."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout=_CLOSE_JOIN_S)
        if self._thread.is_alive():
            log.warning("TransferClient.close(): the reader thread is still busy after %.0fs "
                        "(a slow done-callback?); it tears down when that returns",
                        _CLOSE_JOIN_S)
            return
        self.seg.close()

    def __enter__(self) -> "TransferClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
