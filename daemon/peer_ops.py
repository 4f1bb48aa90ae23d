"""The peer ops of a rank daemon: ``peer_info``, ``peer_recv``, ``peer_send``.

* ``peer_info`` (INLINE): this rank's Transfer Engine endpoint, completion
  listener, pool base addresses, block bytes, layout fingerprint and epoch: the
  ticket's rank entry (client/ticket.py).
* ``peer_recv`` (TRANSFER, lane peer, held): checks the ticket against this
  rank (its own entry, layout, TP size, expiry, HMAC when the namespace has a
  secret, ids in range and unique), journals it and submits a task that
  *writes* the named host blocks.  When the scheduler runs it (every earlier
  task on those blocks has finished) the receive is armed and the task stays
  RUNNING: the rank's own evicts, loads and backups touching the blocks wait
  until it ends (daemon/peer_receiver.py says how it ends).
* ``peer_send`` (TRANSFER, lane peer): checks the pairing again (the client did
  in the caller's thread), journals it and submits a task that *reads* the named
  host blocks, so it runs after the evicts that fill them; a peer worker pushes
  them (daemon/peer.py).

Without ``--peer-transfer`` every peer op is refused PEER_DISABLED, naming the flag.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvswap.client.auth import load_secret
from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import Op, Request, check_ids, decode_id_frame
from kvswap.client.signals import RankSlot
from kvswap.client.ticket import Ticket, TicketRefused
from kvswap.daemon.attachment import Attachment, AttachmentSlot
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.jobs import Completion, Job
from kvswap.daemon.peer import PeerRuntime, PoolView
from kvswap.daemon.rank import RankContext
from kvswap.daemon.scheduler import Task, TaskState
from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon.peer")


@dataclass(frozen=True)
class _Recv:
    nonce: bytes


@dataclass(frozen=True)
class _Send:
    ticket: Ticket
    raw: bytes


_NO_DEVICE = np.empty(0, dtype=np.int64)


class PeerOps:
    """The peer ops of one rank (its Transfer Engine, receiver and sender when
    ``--peer-transfer`` is given; refusals otherwise)."""

    def __init__(self, rank: RankContext, slot: AttachmentSlot, exactly: ExactlyOnce):
        """Starts the Transfer Engine with ``--peer-transfer``: a :class:`KvswapError`
        here is a start-up failure."""
        self._rank = rank
        self._slot = slot
        self._exactly = exactly
        cfg = rank.cfg
        # The namespace's secret signs tickets whether or not it has a tcp:// listener.
        self._secret = load_secret(cfg.secret_file) if cfg.secret_file else b""
        self._lock = threading.Lock()  # _work: I/O thread, peer workers, receiver thread
        self._work: dict[Task, _Recv | _Send] = {}
        self._runtime = (PeerRuntime(rank.index, cfg.peer_address, cfg.peer_transfer,
                                     cfg.peer_timeout_s, self._secret, self._on_end,
                                     self._on_unsafe, self._on_stale)
                         if cfg.peer_transfer else None)

    # ------------------------------------------------------------------ control thread
    def attach(self, swap: HostSwapSpace) -> None:
        """Register the pool just attached with the Transfer Engine (register)."""
        if self._runtime is not None:
            base = swap.region.array(0, (swap.region.size,), np.uint8)
            self._runtime.attach(swap.tensors, swap.blocks, swap.region, int(base.ctypes.data))

    def end_armed(self, why: str) -> None:
        """A clear begins (control thread, before it drains): end the receives no sender
        has begun, CLEARED, and those armed until the next attach."""
        if self._runtime is not None:
            self._runtime.receiver.end_armed(why)

    def detach(self) -> None:
        """The pool is released or kept unattached (clear): no peer may write it."""
        if self._runtime is not None:
            self._runtime.detach()

    # ------------------------------------------------------------------ I/O thread
    def info(self, job: Job, req: Request | None) -> dict:
        runtime = self._enabled()
        pool = self._pool(runtime)
        return {**runtime.endpoint(self._rank.epoch).to_wire(), "layout": pool.layout.hex()}

    def admit(self, job: Job, req: Request | None) -> None:
        """Check, journal and queue a ``peer_recv`` or ``peer_send``; a refusal changes
        nothing."""
        assert req is not None
        origin = self._exactly.begin_admission(job, req.header)
        if origin is None:
            return
        runtime = self._enabled()
        pool = self._pool(runtime)
        work: _Recv | _Send
        if req.op is Op.PEER_RECV:
            raw = bytes(memoryview(req.frames[0]))
            ticket = self._own_ticket(runtime, raw, pool)
            host = np.asarray(ticket.block_ids, dtype=np.int64)
            check_ids("peer_recv", "host", host, pool.num_host_blocks, unique=True)
            runtime.receiver.expect(ticket.nonce, raw, ticket.expires_ns,
                                    host.size * sum(pool.block_bytes), host)
            try:
                self._exactly.admit(job, origin, _NO_DEVICE, host)
            except KvswapError:
                runtime.receiver.forget(ticket.nonce)
                raise
            work = _Recv(ticket.nonce)
        else:
            raw = bytes(memoryview(req.frames[1]))
            ticket = Ticket.from_bytes(raw)
            host = decode_id_frame(req.frames[0], req.header["ids"], "host ids")
            if host.shape[0] != req.header["n"]:
                raise InvalidTask(f"peer_send: header says n={req.header['n']} but the frame "
                                  f"holds {host.shape[0]} ids", ErrorCode.BAD_FIELD)
            ticket.check_pairing(self._rank.cfg.tp_size, pool.layout, host.shape[0])
            theirs = ticket.ranks[self._rank.index].block_bytes
            if theirs != pool.block_bytes:
                raise TicketRefused(f"block bytes differ on rank {self._rank.index}: this pool "
                                    f"{list(pool.block_bytes)}, the ticket {list(theirs)}")
            check_ids("peer_send", "host", host, pool.num_host_blocks, unique=False)
            self._exactly.admit(job, origin, _NO_DEVICE, host)
            work = _Send(ticket, raw)
        att = self._slot.current
        assert att is not None  # READY implies attached
        self._rank.sig.add(RankSlot.INFLIGHT, 1)
        try:
            with self._lock:  # a peer worker may take the task at once: it looks it up here
                task = att.scheduler.submit(job.op, _NO_DEVICE, host,
                                            priority=int(req.header.get("priority", 0)),
                                            ctx=job)
                self._work[task] = work
        except Exception:
            # not queued (the scheduler is stopping): nothing will answer or end it, so
            # undo what admission did here, or a receive's nonce would wait for a task
            # that does not exist until the process ends
            self._rank.sig.add(RankSlot.INFLIGHT, -1)
            if isinstance(work, _Recv):
                runtime.receiver.forget(work.nonce)
            raise

    def cancel(self, task: Task) -> bool:
        """``cancel`` of a peer task.  One the scheduler dropped before it started, a
        send or a receive: forget it, and a receive's ticket (True; a send kept its
        ticket here for as long as the process lived).  A receive armed and held, no
        sender begun: it ends CANCELLED (True).  Anything else runs on (False)."""
        with self._lock:
            work = self._work.get(task)
            dropped = task.state is TaskState.CANCELLED
            if dropped:
                self._work.pop(task, None)
        if work is None or self._runtime is None:
            return False
        if isinstance(work, _Recv):
            if dropped:
                self._runtime.receiver.forget(work.nonce)
                return True
            return self._runtime.receiver.cancel(work.nonce)
        return dropped

    def stop(self) -> None:
        """The daemon stops: armed receives end SHUTTING_DOWN while the I/O loop still
        answers them, and pushes stop waiting for their receivers."""
        if self._runtime is not None:
            self._runtime.sender.stop()  # pushes waiting for an answer give up
            self._runtime.receiver.close()

    # ------------------------------------------------------------------ peer workers
    def execute(self, batch: list[Task], att: Attachment) -> list[Completion]:
        """Run peer tasks (a peer worker; never raises).  A receive is armed and held:
        no completion now, it ends through the receiver.  A send pushes its blocks.

        A send runs on what another node wrote (its ticket, its receiver's answers),
        which the ticket and the sender check, so it fails with a KvswapError naming
        the cause.  Anything else is a bug: as on the other lanes (a copy's failure,
        a storage backend's), it costs that task, answered INTERNAL_ERROR with its
        traceback in the log, never the worker: a dead peer worker left its send
        unanswered with its blocks held, and two of them every later send."""
        assert self._runtime is not None  # peer tasks are admitted only with a runtime
        out = []
        for task in batch:
            with self._lock:
                work = self._work.get(task)
                if isinstance(work, _Send):
                    del self._work[task]
            t_start = time.perf_counter_ns()
            try:
                if isinstance(work, _Recv):
                    self._runtime.receiver.arm(work.nonce, task)
                    continue
                assert isinstance(work, _Send) and self._runtime.pool is not None
                nbytes = self._runtime.sender.push(self._rank.index, work.ticket, work.raw,
                                                   self._runtime.pool, task.host_ids)
            except KvswapError as exc:
                out.append(Completion(task.ctx, exc.code, exc.message, t_start,
                                      time.perf_counter_ns()))
                continue
            except Exception as exc:  # a bug must cost one task, never the peer lane
                log.exception("%s %s failed unexpectedly", task.op.value, task.ctx.req_id)
                message = (f"{type(exc).__name__}: {exc} (unexpected: rank "
                           f"{self._rank.index}'s log has the traceback)")
                if task.op is Op.PEER_RECV:
                    # held: the worker does not finish it; end it here unless it ended
                    if not isinstance(work, _Recv) or self._runtime.receiver.forget(work.nonce):
                        self._on_end(task, ErrorCode.INTERNAL_ERROR, message, 0)
                    continue
                out.append(Completion(task.ctx, ErrorCode.INTERNAL_ERROR, message, t_start,
                                      time.perf_counter_ns()))
                continue
            out.append(Completion(task.ctx, ErrorCode.OK, "", t_start, time.perf_counter_ns(),
                                  nbytes, {"bytes": nbytes}))
        return out

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """After the workers ended: stop the engine and the listener."""
        if self._runtime is not None:
            self._runtime.close()

    # ------------------------------------------------------------------ internals
    def _on_end(self, task: Task, code: ErrorCode, message: str, nbytes: int,
                hold: bool = False) -> None:
        """A held receive ended (receiver thread, or the I/O thread for a cancel or a
        stop): journal and answer it, then release its blocks -- unless ``hold``: its
        write window could not be fenced, so its sender may still write them; they
        stay held (tasks touching them wait) and the rank has failed (:meth:`_on_unsafe`),
        so its supervisor restarts it."""
        with self._lock:
            self._work.pop(task, None)
        fields = {"bytes": nbytes} if code == ErrorCode.OK else {}
        self._exactly.settle(Completion.now(task.ctx, code, message, time.perf_counter_ns(),
                                            fields))
        att = self._slot.current
        if att is not None and not hold:
            att.scheduler.finish([task])

    def _on_unsafe(self, why: str) -> None:
        """Peer transfer can no longer be kept safe or live here (any thread): the
        windows cannot fence off a stalled sender, or the receiver thread died.
        FAILED, so the supervisor restarts the rank; the process's end ends it all."""
        self._rank.sm.fail(ErrorCode.INTERNAL_ERROR, why)

    def _on_stale(self, nonce: bytes) -> None:
        """A receive still waiting for earlier tasks on its blocks outlived its ticket
        (receiver thread): drop its queued task, answered TICKET_EXPIRED now.  One that
        started meanwhile is armed and expires as such."""
        att = self._slot.current
        with self._lock:
            task = next((t for t, w in self._work.items()
                         if isinstance(w, _Recv) and w.nonce == nonce), None)
        if att is None or task is None or att.scheduler.cancel(lambda t: t is task) is None:
            return
        with self._lock:
            self._work.pop(task, None)
        assert self._runtime is not None  # receives exist only with a runtime
        self._runtime.receiver.forget(nonce)
        self._exactly.settle(Completion.now(
            task.ctx, ErrorCode.TICKET_EXPIRED, "the ticket expired while the receive waited "
            "for earlier tasks on its blocks", time.perf_counter_ns()))

    def _enabled(self) -> PeerRuntime:
        if self._runtime is None:
            raise KvswapError(f"rank {self._rank.index} was launched without peer transfer: "
                              f"relaunch with kvswap launch --peer-transfer tcp (or rdma)",
                              ErrorCode.PEER_DISABLED)
        return self._runtime

    def _pool(self, runtime: PeerRuntime) -> PoolView:
        pool = runtime.pool
        if pool is None:
            raise KvswapError(f"rank {self._rank.index} has no host pool yet (no register)",
                              ErrorCode.NOT_READY)
        return pool

    def _own_ticket(self, runtime: PeerRuntime, raw: bytes, pool: PoolView) -> Ticket:
        """A ticket this rank may arm: signed when the namespace has a secret, for this
        TP size, its entry naming this daemon, this layout, not expired."""
        ticket = Ticket.from_bytes(raw)
        if self._secret:
            ticket.verify(self._secret)
        index = self._rank.index
        if ticket.tp_size != self._rank.cfg.tp_size:
            raise TicketRefused(f"the ticket is for TP size {ticket.tp_size}, this namespace "
                                f"has {self._rank.cfg.tp_size}")
        mine = ticket.ranks[index]
        own = runtime.endpoint(mine.epoch)
        if (mine.te, mine.notify, mine.bases, mine.block_bytes) != \
                (own.te, own.notify, own.bases, own.block_bytes):
            raise TicketRefused(f"the ticket's rank {index} entry is not this daemon's "
                                f"(endpoint {mine.te} vs {own.te}); issue it with "
                                f"receive_into on this namespace")
        if ticket.layout != pool.layout:
            raise TicketRefused("the ticket's layout fingerprint is not this rank's")
        ticket.check_expiry()
        return ticket

