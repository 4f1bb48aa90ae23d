"""Node-to-node transfer of host blocks (prefill -> decode) over the Mooncake Transfer Engine.

One :class:`PeerRuntime` per rank daemon started with ``--peer-transfer``:

* :class:`PeerEngine` wraps one ``mooncake.engine.TransferEngine`` in P2P
  handshake mode (no metadata server) and registers the rank's host pool with
  it once, at register (the pool is one shm mapping; every block of every
  tensor lies inside it): the pool is what this rank *sends* from.
* :class:`~kvswap.daemon.peer_windows.PeerWindows`: what a sender writes
  *into* here.  Each begun receive gets a window of its own (another mapping
  of the pool, registered), fenced off before the blocks are released when
  the receive ends without ``done`` (daemon/peer_windows.py says why).
* :class:`~kvswap.daemon.peer_receiver.PeerReceiver` holds the receives armed on
  this rank and owns a ZMQ
  ROUTER on ``tcp://--peer-host:*`` (the ticket's ``notify``): the path by
  which a sender on another machine tells this daemon that its bytes landed.
* :class:`PeerSender` pushes this rank's host blocks into the blocks a ticket
  names on the peer rank, bracketed by that completion path.

One push, rank r of the sender to rank r of the receiver::

    sender daemon                                   receiver daemon
      begin {nonce, rank, ticket, v}  ------------->  receive armed (its blocks are held
                                                      in the hazard table)? else parked
                                   <----------------  ok {bases: its window} (or a refusal:
                                                      unknown nonce, bad HMAC, other ticket)
      batch_transfer_sync_write (Transfer Engine, through the window into the pool)
      done {nonce}                 ---------------->  journal, answer peer_recv OK,
                                   <----------------  release the blocks; ok
      (a failed write: abort {nonce, message} -> fence, peer_recv TRANSFER_FAILED)

A receive is answered once (daemon/peer_receiver.py lists how).  A sender that
began owns the blocks until then, so a block is never reported received unless
the sender said every byte of it was written (a write returns 0 only once the
receiver acknowledged every byte applied); a receive that ends otherwise fences
its window first, so no later byte of that sender reaches a block.

The nonce is the ticket's bearer credential on the completion path (16 random
bytes, known only to holders of the ticket); the ticket's HMAC, when the
receiving namespace has a secret, is checked again at ``begin``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import msgpack
import numpy as np
import zmq

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.layout import TensorDesc, layout_hash
from kvswap.client.protocol import PROTOCOL_VERSION
from kvswap.client.shm_region import ShmRegion
from kvswap.client.ticket import INT64_END, RankEndpoint, Ticket
from kvswap.daemon import crashpoints
from kvswap.daemon.peer_receiver import PeerReceiver, packb
from kvswap.daemon.peer_table import OnEnd
from kvswap.daemon.peer_windows import FenceLedger, OnUnsafe, PeerWindows

log = logging.getLogger("kvswap.daemon.peer")



_STOP_CHECK_S = 0.1  # how often a push waiting for an answer looks for a stop


class PeerFailed(KvswapError):
    default_code = ErrorCode.TRANSFER_FAILED


class PeerUnavailable(KvswapError):
    """The Transfer Engine cannot be started here (start-up failure of the daemon)."""

    default_code = ErrorCode.PEER_DISABLED


# =========================================================================== engine


class PeerEngine:
    """One Transfer Engine in P2P handshake mode (no metadata server) and the regions
    registered with it."""

    def __init__(self, host: str, protocol: str):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise PeerUnavailable(
                f"--peer-transfer needs the Mooncake Transfer Engine, which cannot be imported "
                f"({exc}): pip install 'kvswap[mooncake]' and, on Debian/Ubuntu, apt-get install "
                f"libibverbs1") from None
        if protocol == "tcp" and os.environ.get("MC_TCP_PROTO") == "1":
            raise PeerUnavailable("MC_TCP_PROTO=1 makes Transfer Engine TCP writes "
                                  "unacknowledged (a write would return before its bytes "
                                  "landed, and done would not prove them received): unset it")
        self._te = TransferEngine()
        rc = self._te.initialize(f"{host}:0", "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise PeerUnavailable(f"the Transfer Engine did not start on {host} over {protocol} "
                                  f"(initialize returned {rc}; see the daemon log)")
        self.endpoint = f"{host}:{self._te.get_rpc_port()}"
        self._regions: list[int] = []  # registered addresses

    def register(self, addr: int, nbytes: int) -> None:
        """Make ``nbytes`` at ``addr`` readable and writable by peers."""
        rc = self._te.register_memory(addr, nbytes)
        if rc != 0:
            raise PeerUnavailable(f"the Transfer Engine refused to register {nbytes} bytes "
                                  f"(register_memory returned {rc})")
        self._regions.append(addr)

    def unregister_all(self) -> None:
        for addr in self._regions:
            self._te.unregister_memory(addr)
        self._regions = []

    def register_window(self, addr: int, nbytes: int) -> None:
        """A receive's write window (daemon/peer_windows.py owns and unregisters it)."""
        rc = self._te.register_memory(addr, nbytes)
        if rc != 0:
            raise PeerFailed(f"the Transfer Engine refused to register a write window of "
                             f"{nbytes} bytes (register_memory returned {rc})")

    def unregister_window(self, addr: int) -> None:
        rc = self._te.unregister_memory(addr)
        if rc != 0:
            log.error("unregister_memory of a write window returned %d", rc)

    def write(self, target: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        """Write local ``srcs`` to the peer's ``dsts`` (both registered); all or raise."""
        rc = self._te.batch_transfer_sync_write(target, srcs, dsts, lengths)
        if rc != 0:
            raise PeerFailed(f"Transfer Engine write of {len(srcs)} span(s) to {target} failed "
                             f"(batch_transfer_sync_write returned {rc})")


@dataclass(frozen=True)
class PoolView:
    """The registered host pool as a ticket describes it."""

    bases: tuple[int, ...]  # address of block 0 of each tensor
    block_bytes: tuple[int, ...]
    layout: bytes
    num_host_blocks: int


def plan_spans(src_bases: Sequence[int], dst_bases: Sequence[int], block_bytes: Sequence[int],
               src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) for copying block ``src_ids[k]``
    to block ``dst_ids[k]`` of every tensor; runs that are consecutive on both sides
    become one span (fewer, larger writes)."""
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        return [], [], []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    runs = np.diff(np.concatenate((starts, [src.size])))
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for sb, db, bpb in zip(src_bases, dst_bases, block_bytes):
        srcs += (sb + src[starts] * bpb).tolist()
        dsts += (db + dst[starts] * bpb).tolist()
        lens += (runs * bpb).tolist()
    return srcs, dsts, lens


# =========================================================================== sender


class PeerSender:
    """Pushes host blocks to a peer rank (called by the peer worker threads; each
    thread keeps its own DEALER per receiver endpoint)."""

    def __init__(self, ctx: zmq.Context, engine: PeerEngine, timeout_s: float):
        self._ctx = ctx
        self._engine = engine
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []  # every socket made, closed at close()
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # the daemon stops: stop waiting for answers

    def stop(self) -> None:
        """The daemon stops (any thread): a push waiting for the receiver's answer gives
        up within :data:`_STOP_CHECK_S`, so the stop does not wait out --peer-timeout
        (30 s by default, past --stop-timeout) to be killed."""
        self._stopping.set()

    def push(self, rank: int, ticket: Ticket, raw_ticket: bytes, pool: PoolView,
             src_ids: np.ndarray) -> int:
        """Write host blocks ``src_ids`` into the ticket's blocks on rank ``rank`` of the
        receiver; return the bytes written.  Raises :class:`KvswapError` on any failure
        (the receiver then fails its receive, by ``abort`` or its own timeout)."""
        peer = ticket.ranks[rank]
        ticket.check_expiry()  # a push that waited behind others: the receive is gone
        # wait: how long this push waits for the answer, so that a receiver parking the
        # begin (its receive not armed yet) refuses it before this side gives up
        reply = self._ask(peer.notify, {"k": "begin", "nonce": ticket.nonce, "rank": rank,
                                        "ticket": raw_ticket, "v": list(PROTOCOL_VERSION),
                                        "wait": self._timeout_s})
        dst_ids = np.asarray(ticket.block_ids, dtype=np.int64)
        dst_bases = _window(reply, peer.bases)
        _check_reach(dst_bases, pool.block_bytes, dst_ids)
        srcs, dsts, lens = plan_spans(pool.bases, dst_bases, pool.block_bytes, src_ids, dst_ids)
        try:
            self._engine.write(peer.te, srcs, dsts, lens)
        except PeerFailed as exc:
            self._tell(peer.notify, {"k": "abort", "nonce": ticket.nonce, "rank": rank,
                                     "message": exc.message})
            raise
        crashpoints.hit("peer.written")
        self._ask(peer.notify, {"k": "done", "nonce": ticket.nonce, "rank": rank})
        return int(sum(lens))

    def _socket(self, endpoint: str) -> zmq.Socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:  # the ticket's entry was checked; ZMQ has the last word
                sock.close(linger=0)
                raise PeerFailed(f"the ticket's notify endpoint {endpoint!r:.80} cannot be "
                                 f"connected to ({exc}); ask the receiver for a new ticket",
                                 ErrorCode.TICKET_MISMATCH) from None
            socks[endpoint] = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def _drop(self, endpoint: str) -> None:
        """Forget a socket whose peer did not answer: a late answer must not be read as
        the answer to the next message."""
        sock = self._local.socks.pop(endpoint)
        with self._lock:
            self._sockets.remove(sock)
        sock.close(linger=0)

    def _tell(self, endpoint: str, msg: dict) -> None:
        """Best effort: the receiver's own timeout covers a lost abort."""
        try:
            self._ask(endpoint, msg)
        except KvswapError as exc:
            log.warning("abort to %s not acknowledged: %s", endpoint, exc)

    def _ask(self, endpoint: str, msg: dict) -> dict:
        sock = self._socket(endpoint)
        sock.send(packb(msg))
        deadline = time.monotonic() + self._timeout_s
        while not sock.poll(int(min(_STOP_CHECK_S, max(0.0, deadline - time.monotonic()))
                                * 1000) + 1):
            if self._stopping.is_set():
                self._drop(endpoint)
                raise PeerFailed(f"this rank is shutting down while waiting for the answer "
                                 f"to {msg['k']}", ErrorCode.SHUTTING_DOWN)
            if time.monotonic() >= deadline:
                self._drop(endpoint)
                raise PeerFailed(f"the receiver at {endpoint} did not answer {msg['k']} "
                                 f"within {self._timeout_s:.1f}s (--peer-timeout): it may "
                                 f"have died; the receive there fails",
                                 ErrorCode.TRANSFER_FAILED)
        try:
            code, message, reply = _read_reply(sock.recv_multipart())
        except ValueError as exc:
            self._drop(endpoint)
            raise PeerFailed(f"the receiver at {endpoint} answered {msg['k']} with {exc}: it "
                             f"is not a kvswap receiver this one can read (a newer version?); "
                             f"the send failed", ErrorCode.PROTOCOL_ERROR) from None
        if code != ErrorCode.OK:
            # a fresh socket for the next message: should the receiver answer this one
            # twice, the second answer must not be read as the next message's
            self._drop(endpoint)
            raise KvswapError(f"the receiver refused {msg['k']}: {message}", code)
        return reply

    def close(self) -> None:
        with self._lock:
            socks, self._sockets = self._sockets, []
        for s in socks:
            s.close(linger=0)


def _read_reply(frames: list[bytes]) -> tuple[ErrorCode, str, dict]:
    """(code, message, the whole map) of a receiver's answer; ValueError saying what is
    wrong with it.  The answer comes from whatever listens at the ticket's ``notify``
    (another version of kvswap, or not kvswap at all): an unknown code or a body that
    is not a map raised in the peer worker and killed it, leaving the send unanswered
    and its blocks held."""
    if len(frames) != 1:
        raise ValueError(f"a reply of {len(frames)} frames (one expected)")
    try:
        reply = msgpack.unpackb(frames[0], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"a reply that is not msgpack ({exc!r:.120})") from None
    if not isinstance(reply, dict):
        raise ValueError(f"a reply that is a {type(reply).__name__}, not a map")
    code, message = reply.get("code"), reply.get("message", "")
    if isinstance(code, bool) or not isinstance(code, int):
        raise ValueError(f"a reply whose code is {code!r:.40}, not an integer")
    if not isinstance(message, str):
        raise ValueError(f"a reply whose message is a {type(message).__name__}, not a string")
    try:
        return ErrorCode(code), message, reply
    except ValueError:
        raise ValueError(f"error code {code}, which this kvswap does not know (its message: "
                         f"{message!r:.200})") from None


def _window(reply: dict, ticket_bases: Sequence[int]) -> Sequence[int]:
    """Where to write: the window ``begin``'s answer names (a receiver before protocol
    1.9 names none: its pool, as the ticket says)."""
    bases = reply.get("bases")
    if bases is None:
        return ticket_bases
    if (not isinstance(bases, list) or len(bases) != len(ticket_bases)
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b < INT64_END
                       for b in bases)):
        raise PeerFailed(f"the receiver answered begin with bad window bases {bases!r:.200}",
                         ErrorCode.PROTOCOL_ERROR)
    return bases


def _check_reach(dst_bases: Sequence[int], block_bytes: Sequence[int], dst_ids: np.ndarray
                 ) -> None:
    """Every destination address must fit the int64 the spans are planned in: past it
    numpy wraps silently into a wrong address (ids, bases and block bytes are each
    bounded, their sum is not).  The ticket's ids are non-negative (client/ticket.py)."""
    if dst_ids.size == 0:
        return
    top = int(dst_ids.max()) + 1
    for base, bpb in zip(dst_bases, block_bytes):
        if base + top * bpb >= INT64_END:
            raise PeerFailed(f"the ticket's block ids (up to {top - 1}) at window base "
                             f"{base:#x} reach past 2**63: not a ticket of a kvswap receiver",
                             ErrorCode.TICKET_MISMATCH)


# =========================================================================== runtime


class PeerRuntime:
    """Everything ``--peer-transfer`` adds to one rank daemon."""

    def __init__(self, rank: int, host: str, protocol: str, timeout_s: float, secret: bytes,
                 on_end: OnEnd, on_unsafe: OnUnsafe, on_stale: Callable[[bytes], None]):
        self.engine = PeerEngine(host, protocol)
        self._protocol = protocol
        self._fences = FenceLedger()  # outlives each pool's windows: the scratch does
        self._on_unsafe = on_unsafe
        self._ctx = zmq.Context(1)
        self.receiver = PeerReceiver(self._ctx, host, rank, secret, timeout_s, on_end,
                                     on_unsafe, on_stale)
        self.sender = PeerSender(self._ctx, self.engine, timeout_s)
        self.pool: PoolView | None = None
        log.info("peer transfer over %s: Transfer Engine %s, completions on %s", protocol,
                 self.engine.endpoint, self.receiver.endpoint)

    def attach(self, tensors: Sequence[TensorDesc], blocks: Sequence[np.ndarray],
               region: ShmRegion, region_addr: int) -> None:
        """Register the host pool (one mapping holding every tensor's blocks) and open
        its write windows."""
        self.detach()
        self.engine.register(region_addr, region.size)
        pool = PoolView(tuple(int(b.ctypes.data) for b in blocks),
                        tuple(t.bytes_per_block for t in tensors), layout_hash(tensors),
                        int(blocks[0].shape[0]))
        self.receiver.windows = PeerWindows(self.engine, region.name, region.inode, region_addr,
                                            region.size, pool.bases, pool.block_bytes,
                                            accept_late=self._protocol == "tcp",
                                            ledger=self._fences, on_unsafe=self._on_unsafe)
        self.pool = pool
        self.receiver.reopen()

    def detach(self) -> None:
        """No peer may write the pool any more: the windows of receives still begun are
        fenced."""
        self.pool = None
        windows, self.receiver.windows = self.receiver.windows, None
        if windows is not None:
            windows.close()
        self.engine.unregister_all()

    def endpoint(self, epoch: int) -> RankEndpoint:
        if self.pool is None:
            raise KvswapError("no host pool is registered yet", ErrorCode.NOT_READY)
        return RankEndpoint(self.engine.endpoint, self.receiver.endpoint, self.pool.bases,
                            self.pool.block_bytes, epoch)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
        self.detach()
        self._ctx.term()
