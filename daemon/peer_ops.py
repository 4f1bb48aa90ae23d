"""The daemon's handlers of the peer ops: ``peer_info``, ``peer_recv``, ``peer_send``.

They take the daemon's parts as arguments (the journal, a submit callable, the
job and request) so that the server module only routes to them; the wiring a
daemon needs is listed in docs/pd.md ("Daemon wiring").

* ``peer_info`` (INLINE): this rank's Transfer Engine endpoint, completion
  listener, pool base addresses, block bytes, layout fingerprint and epoch: the
  ticket's rank entry (client/ticket.py).
* ``peer_recv`` (TRANSFER, lane peer, held): checks the ticket against this
  rank (its own entry, layout, TP size, expiry, HMAC when the namespace has a
  secret, ids in range and unique), journals it and submits a task that
  *writes* the named host blocks.  When the scheduler runs it (every earlier
  task on those blocks has finished) the receive is armed and the task stays
  RUNNING: later evicts, loads, backups touching the blocks wait until it ends
  (daemon/peer.py lists how).
* ``peer_send`` (TRANSFER, lane peer): checks the pairing again (the client did
  in the caller's thread), journals it and submits a task that *reads* the named
  host blocks, so it runs after the evicts that fill them; a peer worker pushes
  them (daemon/peer.py PeerSender).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import Op, Request, decode_id_frame, first_duplicate
from kvswap.client.ticket import Ticket, TicketRefused
from kvswap.daemon.peer import PeerRuntime, PoolView
from kvswap.daemon.scheduler import Task, TaskState

PEER_OPS = frozenset({Op.PEER_RECV, Op.PEER_SEND})
PEER_WORKERS = 2  # peer-lane threads per rank: one push may wait on the network while another runs

# end(task, code, message, reply fields): the daemon journals and answers the task and,
# for a held receive, finishes it in the scheduler.
End = Callable[[Task, ErrorCode, str, dict], None]
# submit(job, host ids) -> the scheduled task (the daemon counts it in flight).
Submit = Callable[[Any, np.ndarray], Task]


class JournalLike(Protocol):
    def admit(self, task_id: int, op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
              keys: np.ndarray | None = None, layerwise: bool = False, cid: int = 0,
              cs: int = 0) -> int: ...


def disabled(rank: int) -> KvswapError:
    return KvswapError(f"rank {rank} was launched without peer transfer: relaunch with "
                       f"kvswap launch --peer-transfer tcp (or rdma)", ErrorCode.PEER_DISABLED)


@dataclass(frozen=True)
class _Recv:
    nonce: bytes


@dataclass(frozen=True)
class _Send:
    ticket: Ticket
    raw: bytes


_NO_DEVICE = np.empty(0, dtype=np.int64)


class PeerOps:
    """Peer-op handlers of one rank daemon started with ``--peer-transfer``."""

    def __init__(self, rank: int, tp_size: int, secret: bytes, host: str, protocol: str,
                 timeout_s: float, end: End):
        self.rank = rank
        self.tp_size = tp_size
        self._secret = secret
        self._end = end
        self._lock = threading.Lock()
        self._work: dict[Task, _Recv | _Send] = {}
        self.runtime = PeerRuntime(rank, host, protocol, timeout_s, secret, self._on_end)

    # ------------------------------------------------------------------ life cycle
    def attach(self, swap: Any) -> None:
        """Register a rank's host pool (a daemon.swap_space.HostSwapSpace) at register."""
        base = swap.region.array(0, (swap.region.size,), np.uint8)
        self.runtime.attach(swap.tensors, swap.blocks, int(base.ctypes.data), swap.region.size)

    def detach(self) -> None:
        self.runtime.detach()

    def stop(self) -> None:
        """The daemon stops: armed receives end SHUTTING_DOWN (before the I/O loop ends)."""
        self.runtime.receiver.close()

    def close(self) -> None:
        self.runtime.close()

    # ------------------------------------------------------------------ I/O thread
    def info(self, epoch: int) -> dict:
        pool = self._pool()
        return {**self.runtime.endpoint(epoch).to_wire(), "layout": pool.layout.hex()}

    def admit(self, job: Any, req: Request, journal: JournalLike, submit: Submit,
              cid: int = 0, cs: int = 0) -> None:
        """Check and queue a ``peer_recv`` or ``peer_send`` (after the daemon's epoch,
        state and re-send checks); raises :class:`KvswapError` changing nothing."""
        pool = self._pool()
        if req.op is Op.PEER_RECV:
            raw = bytes(memoryview(req.frames[0]))
            ticket = self._own_ticket(raw, pool)
            host = np.asarray(ticket.block_ids, dtype=np.int64)
            self._check_ids(host, pool, unique=True)
            self.runtime.receiver.expect(ticket.nonce, raw, ticket.expires_ns,
                                         host.size * sum(pool.block_bytes))
            try:
                job.jseq = journal.admit(job.req_id, Op.PEER_RECV, _NO_DEVICE, host, cid=cid,
                                         cs=cs)
            except KvswapError:
                self.runtime.receiver.forget(ticket.nonce)
                raise
            work: _Recv | _Send = _Recv(ticket.nonce)
        else:
            raw = bytes(memoryview(req.frames[1]))
            ticket = Ticket.from_bytes(raw)
            host = decode_id_frame(req.frames[0], req.header["ids"], "host ids")
            if host.shape[0] != req.header["n"]:
                raise InvalidTask(f"peer_send: header says n={req.header['n']} but the frame "
                                  f"holds {host.shape[0]} ids", ErrorCode.BAD_FIELD)
            ticket.check_pairing(self.tp_size, pool.layout, host.shape[0])
            if ticket.ranks[self.rank].block_bytes != pool.block_bytes:
                raise TicketRefused(f"block bytes differ on rank {self.rank}: this pool "
                                    f"{list(pool.block_bytes)}, the ticket "
                                    f"{list(ticket.ranks[self.rank].block_bytes)}")
            self._check_ids(host, pool, unique=False)
            job.jseq = journal.admit(job.req_id, Op.PEER_SEND, _NO_DEVICE, host, cid=cid, cs=cs)
            work = _Send(ticket, raw)
        task = submit(job, host)
        with self._lock:
            self._work[task] = work

    def cancel(self, task: Task) -> bool:
        """``cancel`` of a peer task: one not started yet was dropped by the scheduler
        (forget it here, True); an armed receive no sender has begun ends CANCELLED."""
        with self._lock:
            work = self._work.get(task)
        if not isinstance(work, _Recv):
            return False
        if task.state is TaskState.CANCELLED:
            with self._lock:
                self._work.pop(task, None)
            self.runtime.receiver.forget(work.nonce)
            return True
        return self.runtime.receiver.cancel(work.nonce)

    # ------------------------------------------------------------------ peer workers
    def execute(self, task: Task) -> tuple[ErrorCode, str, dict] | None:
        """Run a peer task (a peer worker).  A receive is armed and held: None, its end
        comes later through ``end``.  A send returns its outcome; never raises."""
        with self._lock:
            work = self._work.get(task)
        if isinstance(work, _Recv):
            self.runtime.receiver.arm(work.nonce, task)
            return None
        assert isinstance(work, _Send)
        with self._lock:
            del self._work[task]
        pool = self.runtime.pool
        if pool is None:
            return ErrorCode.NOT_READY, "the host pool was released", {}
        try:
            nbytes = self.runtime.sender.push(self.rank, work.ticket, work.raw, pool,
                                              task.host_ids)
        except KvswapError as exc:
            return exc.code, exc.message, {}
        return ErrorCode.OK, "", {"bytes": nbytes}

    # ------------------------------------------------------------------ internals
    def _on_end(self, task: Task, code: ErrorCode, message: str, nbytes: int) -> None:
        with self._lock:
            self._work.pop(task, None)
        self._end(task, code, message, {"bytes": nbytes} if code == ErrorCode.OK else {})

    def _pool(self) -> PoolView:
        pool = self.runtime.pool
        if pool is None:
            raise KvswapError(f"rank {self.rank} has no host pool yet (no register)",
                              ErrorCode.NOT_READY)
        return pool

    def _own_ticket(self, raw: bytes, pool: PoolView) -> Ticket:
        """A ticket this rank may arm: signed when the namespace has a secret, this
        rank's entry naming this rank, this layout, not expired."""
        ticket = Ticket.from_bytes(raw)
        if self._secret:
            ticket.verify(self._secret)
        if ticket.tp_size != self.tp_size:
            raise TicketRefused(f"the ticket is for TP size {ticket.tp_size}, this namespace "
                                f"has {self.tp_size}")
        mine = ticket.ranks[self.rank]
        own = self.runtime.endpoint(mine.epoch)
        if (mine.te, mine.notify, mine.bases, mine.block_bytes) != \
                (own.te, own.notify, own.bases, own.block_bytes):
            raise TicketRefused(f"the ticket's rank {self.rank} entry is not this daemon's "
                                f"(endpoint {mine.te} vs {own.te}); issue it with "
                                f"receive_into on this namespace")
        if ticket.layout != pool.layout:
            raise TicketRefused("the ticket's layout fingerprint is not this rank's")
        ticket.check_expiry()
        return ticket

    @staticmethod
    def _check_ids(host: np.ndarray, pool: PoolView, unique: bool) -> None:
        if host.size and (int(host.min()) < 0 or int(host.max()) >= pool.num_host_blocks):
            bad = int(host.min()) if int(host.min()) < 0 else int(host.max())
            raise InvalidTask(f"host block id {bad} out of range [0, {pool.num_host_blocks})",
                              ErrorCode.ID_OUT_OF_RANGE)
        dup = first_duplicate(host) if unique else None
        if dup is not None:
            raise InvalidTask(f"peer_recv: destination host block {dup} named more than once",
                              ErrorCode.DUPLICATE_DESTINATION)
