"""Node-to-node transfer (prefill -> decode) with real Mooncake Transfer Engines.

Two namespaces on loopback TCP stand for the two nodes: ``pre`` (prefill) and
``dec`` (decode), each with its own daemons, host pools and Transfer Engines.
Bytes are verified end to end: device -> host (evict) on ``pre``, host -> peer
host (send_to / receive_into), host -> device (load) on ``dec``.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvswap.client.errors import ErrorCode, KvswapError, RankRestarted, TransferFailed
from kvswap.client.layout import demo_layout
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import RankSlot, RankState, poll_until
from kvswap.client.ticket import RankEndpoint, Ticket, TicketRefused
from kvswap.client.transfer_client import TransferClient
from kvswap.daemon.supervisor import SupervisorConfig

pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not installed "
                    "(pip install 'kvswap[mooncake]'; apt-get install libibverbs1)")

from test_faults import Supervising  # noqa: E402

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=16,blocks=16"
OTHER_LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=16"
HOST = 32


def _launch(namespaces, tp: int, layout: str = LAYOUT, **kw):
    kw.setdefault("peer_transfer", "tcp")
    return namespaces.launch(tp=tp, demo_caches=layout, host_blocks=HOST,
                             supervision=SupervisorConfig(backoff_s=0.05, reset_after_s=0.2),
                             **kw)


class Device:
    """The simulated device tensors of one rank, writable from the test."""

    def __init__(self, launcher, rank: int, layout: str = LAYOUT):
        self.regions = [ShmRegion.attach(launcher.names.device_segment(rank, t.name))
                        for t in demo_layout(layout)]
        self.arrays = [r.array(0, (t.shape[0], int(np.prod(t.shape[1:])) *
                                   np.dtype(t.dtype).itemsize), np.uint8)
                       for r, t in zip(self.regions, demo_layout(layout))]

    def fill(self, blocks, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for a in self.arrays:
            a[blocks] = rng.integers(0, 256, (len(blocks), a.shape[1]), dtype=np.uint8)

    def read(self, blocks) -> list[np.ndarray]:
        return [a[blocks].copy() for a in self.arrays]

    def close(self) -> None:
        self.arrays = []
        for r in self.regions:
            r.close()


def _client(launcher, **kw) -> TransferClient:
    c = TransferClient(launcher.names.namespace, launcher.cfg.tp,
                       run_root=str(launcher.names.run_root), **kw)
    c.wait_ready(timeout=30)
    return c


def _completed(launcher) -> list[int]:
    ranks = launcher.seg.ranks
    return [int(ranks[r, RankSlot.COMPLETED]) + int(ranks[r, RankSlot.FAILED])
            for r in range(launcher.cfg.tp)]


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_verifies_every_byte(namespaces, tp):
    pre, dec = _launch(namespaces, tp), _launch(namespaces, tp)
    a, b = _client(pre), _client(dec)
    devs_a = [Device(pre, r) for r in range(tp)]
    devs_b = [Device(dec, r) for r in range(tp)]
    try:
        src_dev, src_host = [3, 4, 5, 9, 0], [7, 8, 9, 20, 1]
        dst_host, dst_dev = [30, 31, 2, 3, 11], [1, 2, 3, 4, 15]
        for r, d in enumerate(devs_a):
            d.fill(src_dev, seed=100 + r)
        a.evict(src_dev, src_host).result(timeout=30)
        ticket, received = b.receive_into(dst_host)
        sent = a.send_to(ticket, src_host)
        assert sent.result(timeout=30).nbytes == received.result(timeout=30).nbytes > 0
        b.load(dst_host, dst_dev).result(timeout=30)
        for r in range(tp):
            for want, got in zip(devs_a[r].read(src_dev), devs_b[r].read(dst_dev)):
                assert np.array_equal(want, got), f"rank {r}: bytes differ"

        # the same ticket again: refused by the receiver, nothing written
        again = a.send_to(ticket, src_host)
        with pytest.raises(TransferFailed) as exc:
            again.result(timeout=30)
        assert exc.value.code == ErrorCode.TICKET_MISMATCH and "used once" in str(exc.value)

        # two transfers in flight to the same receiver
        for r, d in enumerate(devs_a):
            d.fill([6, 7, 8, 10], seed=200 + r)
        a.evict([6, 7, 8, 10], [10, 11, 12, 13]).result(timeout=30)
        t1, rec1 = b.receive_into([4, 5])
        t2, rec2 = b.receive_into([6, 7])
        s2 = a.send_to(t2, [12, 13])
        s1 = a.send_to(t1, [10, 11])
        for f in (s1, s2, rec1, rec2):
            f.result(timeout=30)
        b.load([4, 5, 6, 7], [5, 6, 7, 8]).result(timeout=30)
        for r in range(tp):
            for want, got in zip(devs_a[r].read([6, 7, 8, 10]), devs_b[r].read([5, 6, 7, 8])):
                assert np.array_equal(want, got), f"rank {r}: bytes differ (two in flight)"
    finally:
        for d in (*devs_a, *devs_b):
            d.close()
        a.close()
        b.close()


def test_refusals_are_immediate_and_send_nothing(namespaces, run_root):
    secret_file = os.path.join(run_root, "secret")
    with open(secret_file, "wb") as f:
        f.write(b"0123456789abcdef-peer-secret")
    os.chmod(secret_file, 0o600)
    secret = open(secret_file, "rb").read()
    pre = _launch(namespaces, 2)
    dec = _launch(namespaces, 2, secret_file=secret_file)
    dec1 = _launch(namespaces, 1)
    dec_other = _launch(namespaces, 2, layout=OTHER_LAYOUT)
    a = _client(pre)
    clients = [_client(d) for d in (dec, dec1, dec_other)]
    b, b1, b_other = clients
    try:
        before = _completed(pre)
        ticket, received = b.receive_into([1, 2, 3], secret=secret)
        cases = [
            (lambda: a.send_to(b1.receive_into([1, 2, 3])[0], [1, 2, 3]), "TP size differs",
             ErrorCode.TICKET_MISMATCH),
            (lambda: a.send_to(b_other.receive_into([1, 2, 3])[0], [1, 2, 3]),
             "block layout differs", ErrorCode.TICKET_MISMATCH),
            (lambda: a.send_to(ticket, [1, 2]), "count differs", ErrorCode.LENGTH_MISMATCH),
            (lambda: a.send_to(b"not a ticket", [1, 2, 3]), "not msgpack",
             ErrorCode.TICKET_MISMATCH),
        ]
        tampered = Ticket.from_bytes(ticket)
        tampered = Ticket(tampered.namespace, tampered.tp_size, tampered.layout, (4, 5, 6),
                          tampered.expires_ns, tampered.nonce, tampered.ranks, tampered.mac)
        cases.append((lambda: a.send_to(tampered.to_bytes(), [1, 2, 3], secret=secret),
                      "bad HMAC", ErrorCode.AUTH_FAILED))
        short, _ = b.receive_into([9], ttl_s=0.05, secret=secret)
        assert poll_until(lambda: True if time.time_ns() > Ticket.from_bytes(short).expires_ns
                          else None, time.monotonic() + 5)
        cases.append((lambda: a.send_to(short, [1]), "expired", ErrorCode.TICKET_EXPIRED))
        for call, words, code in cases:
            with pytest.raises(TicketRefused) as exc:
                call()
            assert exc.value.code == code and words in exc.value.message, exc.value
        assert _completed(pre) == before, "a refused send_to reached the sending daemons"

        # without the secret the sender cannot tell; the receiving daemon refuses it
        sent = a.send_to(tampered.to_bytes(), [1, 2, 3])
        with pytest.raises(TransferFailed) as exc:
            sent.result(timeout=30)
        assert exc.value.code == ErrorCode.AUTH_FAILED
        # an unsigned ticket for a namespace with a secret: refused at peer_recv
        _, unsigned = b.receive_into([4])
        with pytest.raises(TransferFailed) as exc:
            unsigned.result(timeout=30)
        assert exc.value.code == ErrorCode.AUTH_FAILED and "not signed" in str(exc.value)
        cancel = received.cancel().result(timeout=30)
        assert all(r.fields["cancelled"] for r in cancel.replies.values())
        with pytest.raises(TransferFailed) as exc:
            received.result(timeout=30)
        assert exc.value.code == ErrorCode.CANCELLED
    finally:
        for c in (a, *clients):
            c.close()


def test_without_the_flag_both_calls_name_it(namespaces):
    plain = _launch(namespaces, 1, peer_transfer=None)
    c = _client(plain)
    try:
        with pytest.raises(KvswapError) as exc:
            c.receive_into([1])
        assert exc.value.code == ErrorCode.PEER_DISABLED and "--peer-transfer" in str(exc.value)
        with pytest.raises(KvswapError) as exc:
            c.send_to(b"\x80", [1])
        assert exc.value.code == ErrorCode.TICKET_MISMATCH  # not a ticket: refused first
    finally:
        c.close()


def test_receivers_own_tasks_wait_for_the_receive(namespaces):
    """An evict into a block a receive holds runs after the peer write (hazard
    ordering): the block ends with the evict's bytes, never the sender's."""
    pre, dec = _launch(namespaces, 1), _launch(namespaces, 1)
    a, b = _client(pre), _client(dec)
    dev_a, dev_b = Device(pre, 0), Device(dec, 0)
    try:
        dev_a.fill([1, 2], seed=1)
        dev_b.fill([5, 6], seed=2)
        a.evict([1, 2], [1, 2]).result(timeout=30)
        ticket, received = b.receive_into([10, 11])
        evict = b.evict([5], [10])  # writes a block the receive holds
        load = b.load([11], [7])  # reads one
        b.ping().result(timeout=30)  # both admitted
        stats = b.stats().result(timeout=30).replies[0].fields["counters"]
        assert stats["queued"] == 3 and not evict.done() and not load.done()
        a.send_to(ticket, [1, 2]).result(timeout=30)
        received.result(timeout=30)
        evict.result(timeout=30)
        load.result(timeout=30)
        b.load([10], [8]).result(timeout=30)
        assert all(np.array_equal(x, y) for x, y in zip(dev_b.read([8]), dev_b.read([5])))
        assert all(np.array_equal(x, y) for x, y in zip(dev_b.read([7]), dev_a.read([2])))

        # cancelled: the held blocks are released, nothing was written
        ticket, received = b.receive_into([12])
        evict = b.evict([6], [12])
        b.ping().result(timeout=30)
        assert not evict.done()
        received.cancel().result(timeout=30)
        evict.result(timeout=30)
        with pytest.raises(TransferFailed) as exc:
            received.result(timeout=30)
        assert exc.value.code == ErrorCode.CANCELLED
        with pytest.raises(TransferFailed):  # the ticket died with its receive
            a.send_to(ticket, [1]).result(timeout=30)
    finally:
        dev_a.close()
        dev_b.close()
        a.close()
        b.close()


def _wait_restarted(launcher, rank: int, epoch: int) -> None:
    ok = poll_until(lambda: True if (int(launcher.seg.ranks[rank, RankSlot.EPOCH]) > epoch and
                                     launcher.seg.state_of(rank) == RankState.READY) else None,
                    time.monotonic() + 30)
    assert ok, f"rank {rank} did not come back READY: {launcher.progress()}"


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_a_daemon_killed_mid_transfer_fails_both_sides(namespaces, monkeypatch, side):
    """receiver killed once a sender began: ``sent`` fails within --peer-timeout and
    ``received`` fails RankRestarted; sender killed after writing, before done: the
    receive fails once the sender is silent for --peer-timeout, ``sent`` RankRestarted."""
    point = "peer.begun" if side == "receiver" else "peer.written"
    launched = {}
    for role in ("pre", "dec"):
        victim = (role == "dec") == (side == "receiver")
        if victim:
            monkeypatch.setenv("KVSWAP_CRASH_AT", f"{point}:1")
        launched[role] = _launch(namespaces, 2, peer_timeout_s=3.0)
        monkeypatch.delenv("KVSWAP_CRASH_AT", raising=False)
    pre, dec = launched["pre"], launched["dec"]
    victim = dec if side == "receiver" else pre
    a, b = _client(pre), _client(dec)
    try:
        with Supervising(pre), Supervising(dec):
            a.evict([1, 2], [1, 2]).result(timeout=30)
            epochs = [int(victim.seg.ranks[r, RankSlot.EPOCH]) for r in range(2)]
            ticket, received = b.receive_into([3, 4])
            t0 = time.monotonic()
            sent = a.send_to(ticket, [1, 2])
            dead = []
            assert poll_until(lambda: dead.extend(r for r in range(2) if int(
                victim.seg.ranks[r, RankSlot.EPOCH]) > epochs[r]) or (True if dead else None),
                time.monotonic() + 30), "no daemon was killed"
            rank = dead[0]
            _wait_restarted(victim, rank, epochs[rank])
            with pytest.raises(TransferFailed) as sent_exc:
                sent.result(timeout=30)
            with pytest.raises(TransferFailed) as recv_exc:
                received.result(timeout=30)
            assert time.monotonic() - t0 < 30
            if side == "receiver":
                assert isinstance(recv_exc.value, RankRestarted), recv_exc.value
                assert any(f.rank == rank and f.code == ErrorCode.TRANSFER_FAILED
                           for f in sent_exc.value.failures), sent_exc.value
            else:
                assert isinstance(sent_exc.value, RankRestarted), sent_exc.value
                assert any(f.rank == rank and f.code == ErrorCode.TRANSFER_FAILED
                           and "silent" in f.message for f in recv_exc.value.failures), \
                    recv_exc.value
    finally:
        a.close()
        b.close()


def _wait_log(launcher, rank: int, words: str) -> None:
    path = launcher.names.run_dir / f"rank{rank}.log"
    assert poll_until(lambda: True if words in path.read_text() else None,
                      time.monotonic() + 30), f"rank {rank} never logged {words!r}"


def test_a_stalled_senders_late_write_never_reaches_reused_blocks(namespaces):
    """The sender is stopped (SIGSTOP) holding the receiver's OK to ``begin`` and
    not having written a byte; the receive fails after the receiver's --peer-timeout
    and the engine evicts into its blocks (answered OK).  Resumed, the sender writes:
    its bytes land in the scratch its fenced window became, the blocks keep the
    evict's bytes, it is told the receive had failed, and the same blocks receive
    correctly right afterwards."""
    pre = _launch(namespaces, 1, peer_timeout_s=60.0)  # waits long for begin's answer
    dec = _launch(namespaces, 1, peer_timeout_s=2.0)
    a, b = _client(pre), _client(dec)
    dev_a, dev_b = Device(pre, 0), Device(dec, 0)
    sender = int(pre.seg.ranks[0, RankSlot.PID])
    try:
        dev_a.fill([1, 2], seed=1)
        dev_b.fill([5, 6], seed=2)
        a.evict([1, 2], [1, 2]).result(timeout=30)
        _, holder = b.receive_into([10, 11])  # armed first: the next receive waits behind it
        ticket, received = b.receive_into([10, 11])
        sent = a.send_to(ticket, [1, 2])
        _wait_log(dec, 0, "a begin waits for its receive")  # the sender waits for the OK
        os.kill(sender, signal.SIGSTOP)
        try:
            holder.cancel().result(timeout=30)  # the receive is armed, begin answered OK
            with pytest.raises(TransferFailed) as exc:
                received.result(timeout=30)
            assert exc.value.code == ErrorCode.TRANSFER_FAILED and "silent" in str(exc.value)
            b.evict([5, 6], [10, 11]).result(timeout=30)  # the engine reuses the blocks
        finally:
            os.kill(sender, signal.SIGCONT)
        with pytest.raises(TransferFailed) as exc:  # resumed: its write goes to scratch
            sent.result(timeout=60)
        b.load([10, 11], [7, 8]).result(timeout=30)
        for want, got in zip(dev_b.read([5, 6]), dev_b.read([7, 8])):
            assert np.array_equal(want, got), "a late write reached blocks the engine reused"
        assert exc.value.code == ErrorCode.TRANSFER_FAILED, exc.value
        assert "had already failed" in str(exc.value), exc.value

        ticket, received = b.receive_into([10, 11])  # the blocks receive as before
        a.send_to(ticket, [1, 2]).result(timeout=30)
        received.result(timeout=30)
        b.load([10, 11], [12, 13]).result(timeout=30)
        for want, got in zip(dev_a.read([1, 2]), dev_b.read([12, 13])):
            assert np.array_equal(want, got)
    finally:
        dev_a.close()
        dev_b.close()
        a.close()
        b.close()


_SENDER = """
import sys
import numpy as np
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
n = int(sys.argv[1])
src = np.full(n, 0x5A, np.uint8)
assert te.register_memory(src.ctypes.data, n) == 0
print("ready", flush=True)
for line in sys.stdin:
    target, dst = line.split()
    print(te.batch_transfer_sync_write(target, [src.ctypes.data], [int(dst)], [n]), flush=True)
"""


def _stopped(pid: int) -> bool | None:
    with open(f"/proc/{pid}/stat") as f:
        return True if f.read().rsplit(")", 1)[1].split()[0] == "T" else None


def _line(proc, timeout: float = 30.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the sending process did not answer"
    return proc.stdout.readline().strip()


def test_a_fence_stops_a_write_already_in_flight():
    """The Transfer Engine checks a request's destination once, when it starts:
    unregistering alone does not stop a stalled request.  A fenced window does: the
    sender is stopped in the middle of a 128 MiB request, the window is fenced, the
    pool reused; resumed, the rest of its bytes land in scratch, never in the pool,
    and so does a new request through the window."""
    from kvswap.daemon.peer import PeerEngine
    from kvswap.daemon.peer_windows import FenceLedger, PeerWindows

    n, mib = 128 << 20, 1 << 20
    region = ShmRegion.create(f"kvs-test-window-{os.getpid()}", n)
    pool = region.array(0, (n,), np.uint8)
    addr = int(pool.ctypes.data)
    engine = PeerEngine("127.0.0.1", "tcp")
    engine.register(addr, n)
    unsafe: list[str] = []
    windows = PeerWindows(engine, region.name, region.inode, addr, n, (addr,), (mib,),
                          accept_late=True, ledger=FenceLedger(), on_unsafe=unsafe.append)
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert _line(sender) == "ready"
        for _ in range(3):  # the stop must catch the write in flight
            pool[:] = 0
            w = windows.take(np.arange(n // mib))
            sender.stdin.write(f"{engine.endpoint} {w.bases[0]}\n")
            sender.stdin.flush()
            assert poll_until(lambda: True if pool[:4096].all() else None,
                              time.monotonic() + 30), "the write never began"
            os.kill(sender.pid, signal.SIGSTOP)
            assert poll_until(lambda: _stopped(sender.pid), time.monotonic() + 10)
            in_flight = np.count_nonzero(pool) < n
            w.fence()
            landed = np.count_nonzero(pool)
            pool[:] = 0x11  # the blocks are reused
            os.kill(sender.pid, signal.SIGCONT)
            assert _line(sender) == "0"  # accepted before the fence: it completes, to scratch
            if in_flight:
                break
            w.drop()
        else:
            pytest.skip("the sender finished its write before it could be stopped, 3 times")
        assert (pool == 0x11).all(), "bytes of a fenced write reached the pool"
        tail = ctypes.string_at(w.kept[0][0] + n - 4096, 4096)
        assert tail == b"\x5a" * 4096 and landed < n, "the rest did not land in scratch"
        sender.stdin.write(f"{engine.endpoint} {w.bases[0]}\n")
        sender.stdin.flush()
        assert _line(sender) == "0"  # accepted, into scratch
        assert (pool == 0x11).all(), "a request through a fenced window reached the pool"
        w.drop()
        assert unsafe == [] and windows.ledger.maps == 0
    finally:
        if sender.poll() is None:
            os.kill(sender.pid, signal.SIGCONT)
            sender.kill()
        sender.wait(10)
        windows.close()
        engine.unregister_all()
        pool = None  # the mapping closes with its last array
        region.close()
        region.unlink()


class _Engine:
    """The two calls a PeerWindows makes of its Transfer Engine, recorded."""

    def __init__(self):
        self.registered: set[int] = set()

    def register_window(self, addr: int, length: int) -> None:
        self.registered.add(addr)

    def unregister_window(self, addr: int) -> None:
        self.registered.discard(addr)


def test_scratch_past_the_cap_or_a_failed_fence_makes_the_rank_unsafe(monkeypatch):
    """Scratch a sender never releases (it died, or aborted) is freed only when the
    process ends; each extent is a mapping, and the process may hold only
    vm.max_map_count of them.  The ledger counts them across the pools a rank
    attaches (a clear makes a new PeerWindows), ``on_unsafe`` is called once the
    fences hold MAX_FENCED_MAPS, and a ``done`` gives them back.  A fence whose mmap
    fails raises, leaves the window in the sender's reach (its blocks must stay
    held) and is unsafe too.  A write through a fenced window lands in scratch."""
    from kvswap.daemon import peer_windows
    from kvswap.daemon.peer_windows import PAGE, FenceLedger, PeerWindows

    monkeypatch.setattr(peer_windows, "MAX_FENCED_MAPS", 3)
    blocks, bpb = 8, PAGE  # two tensors of 8 one-page blocks: one extent each per fence
    region = ShmRegion.create(f"kvs-test-ledger-{os.getpid()}", 2 * blocks * bpb)
    pool = region.array(0, (2 * blocks * bpb,), np.uint8)
    addr = int(pool.ctypes.data)
    ledger, unsafe, engine = FenceLedger(), [], _Engine()

    def windows() -> PeerWindows:
        return PeerWindows(engine, region.name, region.inode, addr, pool.size,
                           (addr, addr + blocks * bpb), (bpb, bpb), accept_late=True,
                           ledger=ledger, on_unsafe=unsafe.append)

    first = windows()
    try:
        pool[:] = 7
        w1 = first.take(np.array([2]))
        w1.fence()
        ctypes.memset(w1.bases[0] + 2 * bpb, 0x5A, bpb)  # a late write: scratch, not pool
        assert (pool == 7).all()
        assert (ledger.maps, ledger.bytes, unsafe) == (2, 2 * bpb, [])
        first.close()  # a clear: the pool detached, the scratch stays
        second = windows()
        w2 = second.take(np.array([5]))
        w2.fence()
        assert ledger.maps == 4 and len(unsafe) == 1, (ledger.maps, unsafe)
        assert "4 scratch mappings" in unsafe[0] and "restarting the rank" in unsafe[0]
        w1.drop()  # its sender said done: the first pool's scratch is given back
        assert (ledger.maps, ledger.bytes) == (2, 2 * bpb)

        w3 = second.take(np.array([1]))
        real_map = peer_windows._map

        def refuse(at, length, flags, fd):
            if at is not None:  # the fence's MAP_FIXED over the window
                raise OSError(12, "Cannot allocate memory")
            return real_map(at, length, flags, fd)
        monkeypatch.setattr(peer_windows, "_map", refuse)
        with pytest.raises(OSError):
            w3.fence()
        assert not w3.fenced and len(unsafe) == 2 and "could not be fenced" in unsafe[1]
        assert w3.addr in engine.registered  # still the sender's to write: keep the blocks
        monkeypatch.setattr(peer_windows, "_map", real_map)
        w2.drop()
        assert ledger.maps == 0
    finally:
        second.close()
        pool = None
        region.close()
        region.unlink()


class _RawSender:
    """A bare DEALER on a receiver's completion listener: the messages a sender sends,
    or ones no kvswap sender would."""

    def __init__(self, notify: str):
        import zmq

        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(notify)

    def send(self, msg: dict) -> None:
        import msgpack

        self.sock.send(msgpack.packb(msg))

    def answer(self, timeout_s: float = 30.0) -> dict:
        import msgpack

        assert self.sock.poll(int(timeout_s * 1000)), "the receiver did not answer"
        return msgpack.unpackb(self.sock.recv())

    def ask(self, msg: dict, timeout_s: float = 30.0) -> dict:
        self.send(msg)
        return self.answer(timeout_s)

    def begin(self, raw: bytes, ticket: Ticket | None = None) -> dict:
        from kvswap.client.protocol import PROTOCOL_VERSION

        ticket = ticket or Ticket.from_bytes(raw)
        return {"k": "begin", "nonce": ticket.nonce, "rank": 0, "ticket": raw,
                "v": list(PROTOCOL_VERSION)}

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


def _with_site(tmp_path, monkeypatch, code: str) -> None:
    """Daemons launched until ``monkeypatch.delenv("PYTHONPATH")`` run ``code`` first
    (a sitecustomize): a limit lowered, a fault injected, no hook in the daemon."""
    (tmp_path / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _restarted(launcher) -> None:
    assert poll_until(lambda: True if int(launcher.seg.ranks[0, RankSlot.EPOCH]) == 2
                      and launcher.seg.state_of(0) == RankState.READY else None,
                      time.monotonic() + 30), launcher.progress()


def test_a_rank_whose_fences_hold_too_much_scratch_fails_and_is_restarted(namespaces, tmp_path,
                                                                           monkeypatch):
    """A sender that begins then aborts leaves its window fenced for good (an abort
    proves nothing).  With the cap at one fence (set in the daemons through a
    sitecustomize), the first such abort makes the rank FAILED, naming the scratch;
    its supervisor restarts it, and the namespace serves again."""
    _with_site(tmp_path, monkeypatch,
               "import kvswap.daemon.peer_windows as w\nw.MAX_FENCED_MAPS = 1\n")
    dec = _launch(namespaces, 1)
    monkeypatch.delenv("PYTHONPATH")
    assert dec.supervise_once() is None  # the supervisor has seen the rank serve
    with Supervising(dec) as sup, _client(dec) as client:
        raw, received = client.receive_into([3])
        ticket = Ticket.from_bytes(raw)
        sender = _RawSender(ticket.ranks[0].notify)
        try:
            begun = sender.ask(sender.begin(raw))
            assert begun["code"] == 0 and len(begun["bases"]) == len(demo_layout(LAYOUT))
            assert sender.ask({"k": "abort", "nonce": ticket.nonce, "rank": 0,
                               "message": "test"})["code"] == 0
        finally:
            sender.close()
        with pytest.raises(TransferFailed):
            received.result(timeout=30)
        _restarted(dec)
        client.evict([1], [1]).result(timeout=30)
        assert sup.reasons == []
    log = (dec.names.run_dir / "rank0.log").read_text()
    assert "FAILED [402 INTERNAL_ERROR]" in log and "scratch mappings" in log, log[-2000:]
    assert dec.supervisor.restarts == 1


def test_a_send_whose_receiver_answers_what_it_cannot_read_fails_and_frees_its_blocks(
        namespaces):
    """A receiver answering begin with an error code this build does not know (99999),
    a list, or bytes that are not msgpack killed the sending daemon's peer worker: the
    send was never answered (RankTimeout), its source block stayed held, and after
    two of them every later send hung.  Each send fails PROTOCOL_ERROR at once, an
    evict into its source block runs, and no thread died.  A ticket naming a notify
    endpoint nobody can connect to ("bogus") is refused in the caller's thread.  The
    tickets are the sending namespace's own entries with notify pointed elsewhere."""
    import msgpack
    from dataclasses import replace

    from kvswap.client.peer_client import peer_infos
    from test_peer_wire import _FakeReceiver

    pre = _launch(namespaces, 1)
    fake = _FakeReceiver([[msgpack.packb({"code": 99999, "message": "a newer code"})],
                          [msgpack.packb(["not", "a", "map"])], [b"\xc1"]])
    try:
        with _client(pre, task_timeout=10) as client:
            client.evict([1], [1]).result(timeout=30)
            ranks, layout = peer_infos(client)
            for words in ("error code 99999", "a list, not a map", "not msgpack"):
                ticket = Ticket.issue(pre.names.namespace, layout, [5],
                                      [replace(ranks[0], notify=fake.endpoint)], 60.0, None)
                sent = client.send_to(ticket.to_bytes(), [1])
                with pytest.raises(TransferFailed) as exc:
                    sent.result(timeout=30)
                assert exc.value.code == ErrorCode.PROTOCOL_ERROR, exc.value
                assert words in str(exc.value), exc.value
            client.evict([2], [1]).result(timeout=30)  # the sends' source block is free
            body = ticket.body()
            body["ranks"][0]["notify"] = "bogus"
            with pytest.raises(TicketRefused, match="notify .* must be 'tcp://HOST:PORT'"):
                client.send_to(msgpack.packb(body), [1])
    finally:
        fake.close()
    log = (pre.names.run_dir / "rank0.log").read_text()
    assert "Exception in thread" not in log, log[-2000:]


def test_a_begin_that_cannot_be_read_is_refused_and_the_listener_goes_on(namespaces):
    """A begin whose ticket held an infinite expiry raised OverflowError in the
    listener thread, which died: every receive of the rank then hung with its blocks
    held while the rank looked READY.  It is refused TICKET_MISMATCH, and so is a
    message whose nonce is not 16 bytes (an int nonce made bytes() allocate that many);
    the same receive then begins and completes."""
    dec = _launch(namespaces, 1)
    with _client(dec) as client:
        raw, received = client.receive_into([3])
        ticket = Ticket.from_bytes(raw)
        bad = ticket.body()
        bad["exp"] = float("inf")
        sender = _RawSender(ticket.ranks[0].notify)
        try:
            import msgpack

            refused = sender.ask(sender.begin(msgpack.packb(bad), ticket))
            assert refused["code"] == ErrorCode.TICKET_MISMATCH, refused
            assert "malformed" in refused["message"], refused
            odd = sender.ask({"k": "begin", "nonce": 10**9, "rank": 0})
            assert odd["code"] == ErrorCode.PROTOCOL_ERROR and "16 bytes" in odd["message"]
            assert sender.ask(sender.begin(raw))["code"] == 0
            assert sender.ask({"k": "done", "nonce": ticket.nonce, "rank": 0})["code"] == 0
        finally:
            sender.close()
        received.result(timeout=30)
        assert dec.seg.state_of(0) == RankState.READY


def test_a_dead_listener_thread_fails_the_rank(namespaces, tmp_path, monkeypatch):
    """Should the listener thread die anyway (a fault injected through a sitecustomize),
    the rank goes FAILED naming it, and its supervisor restarts it: before, it stayed
    READY with every receive hung."""
    _with_site(tmp_path, monkeypatch, (
        "import msgpack\nimport kvswap.daemon.peer_receiver as r\n"
        "real = r.PeerReceiver._on_message\n"
        "def on_message(self, ident, raw):\n"
        "    if msgpack.unpackb(raw).get('k') == 'boom':\n"
        "        raise RuntimeError('injected')\n"
        "    return real(self, ident, raw)\n"
        "r.PeerReceiver._on_message = on_message\n"))
    dec = _launch(namespaces, 1)
    monkeypatch.delenv("PYTHONPATH")
    assert dec.supervise_once() is None  # the supervisor has seen the rank serve
    with Supervising(dec) as sup, _client(dec) as client:
        notify = Ticket.from_bytes(client.receive_into([3], ttl_s=1.0)[0]).ranks[0].notify
        sender = _RawSender(notify)
        try:
            sender.send({"k": "boom"})
            _restarted(dec)
        finally:
            sender.close()
        client.evict([1], [1]).result(timeout=30)
        assert sup.reasons == []
    log = (dec.names.run_dir / "rank0.log").read_text()
    assert "the peer receiver thread died (RuntimeError('injected'))" in log, log[-2000:]


def test_a_begin_with_an_expired_ticket_is_refused_at_once(namespaces):
    """Its nonce left the used set at its expiry, so the begin looked early and was
    kept for the whole --peer-timeout; it is answered TICKET_EXPIRED now."""
    dec = _launch(namespaces, 1, peer_timeout_s=20.0)
    with _client(dec) as client:
        raw, received = client.receive_into([3], ttl_s=0.3)
        with pytest.raises(KvswapError) as exc:
            received.result(timeout=30)
        assert exc.value.code == ErrorCode.TICKET_EXPIRED
        sender = _RawSender(Ticket.from_bytes(raw).ranks[0].notify)
        try:
            t0 = time.monotonic()
            late = sender.ask(sender.begin(raw))
            assert late["code"] == ErrorCode.TICKET_EXPIRED, late
            assert time.monotonic() - t0 < 10, "kept for --peer-timeout"
        finally:
            sender.close()


def test_a_begin_parked_past_the_peer_timeout_is_refused_not_taken(namespaces):
    """A begin for a receive that waits behind another on its blocks is parked.  Its
    sender gives up after --peer-timeout; the parked begin used to be taken when the
    receive armed, so the receive failed another timeout later ("the sender began
    writing but was silent") and left a fenced window for good.  It is refused at
    its deadline, and the receive stays armed for a sender (here: cancelled)."""
    dec = _launch(namespaces, 1, peer_timeout_s=2.0)
    with _client(dec) as client:
        _, holder = client.receive_into([3])
        raw, second = client.receive_into([3])  # waits for the holder's blocks
        sender = _RawSender(Ticket.from_bytes(raw).ranks[0].notify)
        try:
            t0 = time.monotonic()
            refused = sender.ask(sender.begin(raw), timeout_s=20)
            assert refused["code"] == ErrorCode.TICKET_MISMATCH, refused
            assert "did not arm within 2.0s" in refused["message"], refused
            assert time.monotonic() - t0 < 10
        finally:
            sender.close()
        holder.cancel().result(timeout=30)
        second.cancel().result(timeout=30)  # armed or waiting, never begun: cancellable
        with pytest.raises(TransferFailed) as exc:
            second.result(timeout=30)
        assert exc.value.code == ErrorCode.CANCELLED, exc.value


def test_a_begin_parked_before_another_took_the_receive_is_answered():
    """Begin A waits (parked) while its receive is not armed yet; the receive arms,
    and begin B reaches the listener before its sweep hands the receive to A: B takes
    it, and A was never answered (its sender waited for its whole timeout).  A is
    refused at once.  In process: the listener's sweep is held while B arrives."""
    import zmq

    from kvswap.daemon.peer_receiver import PeerReceiver
    from kvswap.daemon.peer_table import RecvState

    ended: list = []
    ctx = zmq.Context()
    receiver = PeerReceiver(ctx, "127.0.0.1", 0, b"", 30.0, lambda *a: ended.append(a),
                            on_dead=ended.append, on_stale=ended.append)
    ticket = Ticket.issue("ns", bytes(32), [3], [RankEndpoint("127.0.0.1:1", receiver.endpoint,
                                                             (1,), (4096,), 1)], 60.0, None)
    raw = ticket.to_bytes()
    a, b = _RawSender(receiver.endpoint), _RawSender(receiver.endpoint)
    try:
        receiver.expect(ticket.nonce, raw, ticket.expires_ns, 4096, np.array([3]))
        a.send(a.begin(raw))
        assert poll_until(lambda: True if receiver._pending[ticket.nonce].parked else None,
                          time.monotonic() + 10)
        receiver._sweep = lambda: None  # the listener reads B before it sweeps
        receiver.arm(ticket.nonce, "handle")
        assert receiver._pending[ticket.nonce].state is RecvState.ARMED
        b.send(b.begin(raw))
        lost = a.answer(timeout_s=10)
        assert lost["code"] == ErrorCode.TICKET_MISMATCH and "already writing" in lost["message"]
        assert b.answer(timeout_s=10)["code"] == ErrorCode.TRANSFER_FAILED  # no pool here
    finally:
        del receiver._sweep
        receiver.close()
        a.close()
        b.close()
        ctx.term()


def test_a_daemon_whose_push_waits_for_an_answer_stops_cleanly(namespaces):
    """A push waits up to --peer-timeout (30 s) for the receiver's answer to begin; a
    stop could not interrupt it, so the staged stop (10 s) ended in SIGKILL.  The
    push gives up at the stop, and the daemon exits 0 within a few seconds."""
    pre = _launch(namespaces, 1, peer_timeout_s=30.0)
    dec = _launch(namespaces, 1, peer_timeout_s=30.0)
    a, b = _client(pre), _client(dec)
    try:
        a.evict([1], [1]).result(timeout=30)
        _, holder = b.receive_into([3])
        ticket, _ = b.receive_into([3])  # waits behind the holder: its begin is parked
        sent = a.send_to(ticket, [1])
        _wait_log(dec, 0, "a begin waits for its receive")
        t0 = time.monotonic()
        pre.stop()
        assert time.monotonic() - t0 < 8, "the stop waited for the push"
        assert pre.procs[0].returncode == 0, pre.procs[0].returncode
        with pytest.raises(KvswapError):
            sent.result(timeout=30)
        holder.cancel().result(timeout=30)
    finally:
        a.close()
        b.close()


def test_a_receive_still_waiting_for_its_blocks_expires_with_its_ticket(namespaces):
    """A receive queued behind another on its blocks kept its task queued past its
    ticket's expiry: the engine got a RankTimeout naming no cause, ttl + task timeout
    later.  It ends TICKET_EXPIRED at the expiry and leaves the queue, and the
    receive ahead of it is untouched."""
    dec = _launch(namespaces, 1)
    with _client(dec) as client:
        _, holder = client.receive_into([3], ttl_s=120.0)
        _, waiting = client.receive_into([3], ttl_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(KvswapError) as exc:
            waiting.result(timeout=30)
        assert exc.value.code == ErrorCode.TICKET_EXPIRED, exc.value
        assert "waited for earlier tasks" in str(exc.value)
        assert time.monotonic() - t0 < 10
        assert not holder.done()
        holder.cancel().result(timeout=30)
        with pytest.raises(TransferFailed) as exc:
            holder.result(timeout=30)
        assert exc.value.code == ErrorCode.CANCELLED
        client.evict([1], [3]).result(timeout=30)  # nothing left holding block 3


@pytest.mark.parametrize("ended_by", ["cancel", "forget"])
def test_a_begin_for_a_receive_that_ended_meanwhile_is_answered_once(ended_by):
    """The listener looks a receive up, then handles the begin; a cancel (armed) or a
    forget (a queued task dropped) may end the receive in between.  A begin parked
    on the forgotten receive was never answered (its sender waited its whole
    timeout), and a begin parked before the cancel was answered twice (the second
    answer then read by that sender as the answer to its next message).  Each gets
    one answer: the next one its socket reads answers its probe.  In process, the
    end injected between the lookup and the begin."""
    import zmq

    from kvswap.daemon.peer_receiver import PeerReceiver

    ctx = zmq.Context()
    receiver = PeerReceiver(ctx, "127.0.0.1", 0, b"", 30.0, lambda *a: None,
                            on_dead=print, on_stale=print)
    ticket = Ticket.issue("ns", bytes(32), [3], [RankEndpoint("127.0.0.1:1", receiver.endpoint,
                                                             (1,), (4096,), 1)], 60.0, None)
    raw, nonce = ticket.to_bytes(), ticket.nonce
    a, b = _RawSender(receiver.endpoint), _RawSender(receiver.endpoint)
    real = receiver._on_begin

    def end_first(*args, **kw):  # the end lands between the lookup and the begin
        del receiver._on_begin
        if ended_by == "cancel":
            assert receiver.cancel(nonce)
        else:
            receiver.forget(nonce)
        return real(*args, **kw)

    try:
        receiver.expect(nonce, raw, ticket.expires_ns, 4096, np.array([3]))
        if ended_by == "cancel":  # A parked while waiting, then the receive armed
            a.send(a.begin(raw))
            assert poll_until(lambda: True if receiver._pending[nonce].parked else None,
                              time.monotonic() + 10)
            receiver._sweep = lambda: None  # B is read before a sweep hands it to A
            receiver.arm(nonce, "handle")
        receiver._on_begin = end_first
        b.send(b.begin(raw))
        refused = b.answer(timeout_s=10)
        assert refused["code"] == ErrorCode.TICKET_MISMATCH and "ended" in refused["message"]
        if ended_by == "cancel":
            del receiver._sweep
            assert a.answer(timeout_s=10)["code"] == ErrorCode.TICKET_MISMATCH
        for s in (a, b):  # nothing more was sent to either: the next answer is the probe's
            probe = s.ask({"k": "probe", "nonce": nonce, "rank": 1}, timeout_s=10)
            assert "rank 1's push reached rank 0" in probe["message"], probe
    finally:
        receiver.close()
        a.close()
        b.close()
        ctx.term()


def test_a_clear_ends_the_receives_no_sender_began(namespaces):
    """An armed receive holds its blocks until a sender comes or its ticket expires;
    a clear's drain waited for it and then failed the rank (RANK_TIMEOUT).  The clear
    ends it CLEARED at once, and after the restore receives arm again."""
    dec = _launch(namespaces, 1, drain_timeout_s=10.0)
    with _client(dec) as client:
        _, received = client.receive_into([3], ttl_s=120.0)
        _, waiting = client.receive_into([3], ttl_s=120.0)  # armed during the drain
        t0 = time.monotonic()
        client.clear_caches().result(timeout=30)
        assert time.monotonic() - t0 < 8
        for fut in (received, waiting):
            with pytest.raises(KvswapError) as exc:
                fut.result(timeout=30)
            assert exc.value.code == ErrorCode.CLEARED and "clearing" in str(exc.value)
        client.restore_caches().result(timeout=30)
        client.wait_ready(timeout=30)
        raw, again = client.receive_into([3])  # arms as before the clear: a sender begins
        sender = _RawSender(Ticket.from_bytes(raw).ranks[0].notify)
        try:
            assert sender.ask(sender.begin(raw))["code"] == 0
            assert sender.ask({"k": "done", "nonce": Ticket.from_bytes(raw).nonce,
                               "rank": 0})["code"] == 0
        finally:
            sender.close()
        again.result(timeout=30)


def test_a_sender_that_would_write_the_pool_itself_is_refused(namespaces, monkeypatch):
    """A begin without a version (a sender before protocol 1.9 writes the pool, past
    any fence) is refused and the receive stays armed; unacknowledged TCP writes
    (MC_TCP_PROTO=1: done would not prove the bytes landed) refuse to start."""
    import msgpack
    import zmq

    from kvswap.client.protocol import packb
    from kvswap.daemon.peer import PeerEngine, PeerUnavailable

    dec = _launch(namespaces, 1)
    b = _client(dec)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        raw, received = b.receive_into([3])
        ticket = Ticket.from_bytes(raw)
        sock.connect(ticket.ranks[0].notify)
        sock.send(packb({"k": "begin", "nonce": ticket.nonce, "rank": 0, "ticket": raw}))
        assert sock.poll(10_000), "no answer to begin"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["code"] == ErrorCode.VERSION_MISMATCH and "1.9" in reply["message"]
        received.cancel().result(timeout=30)  # nothing began
        with pytest.raises(TransferFailed) as exc:
            received.result(timeout=30)
        assert exc.value.code == ErrorCode.CANCELLED
    finally:
        sock.close()
        ctx.term()
        b.close()
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(PeerUnavailable, match="MC_TCP_PROTO"):
        PeerEngine("127.0.0.1", "tcp")
