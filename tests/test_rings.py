"""Shared-memory rings (client/rings.py, daemon/ring_server.py): layout, order across
wrap-around, backpressure without loss, doorbells, malformed records, cleanup."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import select
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvswap.client import InvalidTask, RankTimeout, TransferClient, rings
from kvswap.client.errors import ErrorCode
from kvswap.client.naming import Names
from kvswap.client.protocol import Op, Reply, decode_reply, encode_reply, transfer_message
from kvswap.client.rings import (
    Bell,
    RingCorrupt,
    RingPeer,
    RingSegment,
    RingUnavailable,
    owner_token,
)
from kvswap.client.signals import poll_until
from kvswap.client.transfer_client import TransferFuture, _Dispatcher, _Envelope
from kvswap.client.transport import Channel, PathChoice, Transport
from kvswap.daemon.ring_server import RingServer

from conftest import SMALL_LAYOUT


@pytest.fixture
def names(run_root):
    n = Names.of(f"ring{os.getpid()}", run_root)
    n.run_dir.mkdir(mode=0o700)
    yield n
    for name in n.owned_shm():
        os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def seg(names):
    """A rank-0 ring segment of 4096-byte rings (epoch 1), unlinked after the test."""
    segment = RingSegment.create(names, 0, 1, capacity=4096)
    yield segment
    segment.unlink()
    segment.close()


def _segment_table() -> dict[str, tuple[str, str]]:
    """field -> (offset, size) from the segment table of the module docstring."""
    lines = rings.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["offset", "size", "field"])
    out = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        offset, size, field = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        out[field] = (offset, size)
    return out


def test_layout_matches_the_docstring(names):
    table = _segment_table()
    assert table['magic b"KVSRING\\x01"'] == ("0", "8")
    assert table["u32 layout version (1)"] == ("8", "4")
    assert table["u64 owner: pid << 40 | client token, 0 when free (compare-and-swap)"] == (
        str(rings.OWNER_OFFSET), "8")
    assert table["request ring control     (client writes records, daemon reads)"] == (
        str(rings.REQUEST_CTL), str(rings.CTL_BYTES))
    assert table["completion ring control  (daemon writes records, client reads)"] == (
        str(rings.COMPLETION_CTL), str(rings.CTL_BYTES))
    assert table["request ring data"] == (str(rings.DATA_OFFSET), "C")
    assert rings.HEADER.size == 40 and rings.DATA_OFFSET == 4096
    seg = RingSegment.create(names, 3, 7, capacity=4096)
    try:
        buf = seg.region._buf
        assert buf[:8] == rings.MAGIC
        assert struct.unpack_from("<IIQQQ", buf, 8) == (1, 3, 7, 4096, 0)
        assert seg.request.put([b"abc", b"0123456789"]) == 1  # consumer starts asleep
        ctl, data = rings.REQUEST_CTL, rings.DATA_OFFSET
        head, = struct.unpack_from("<Q", buf, ctl)
        tail, = struct.unpack_from("<Q", buf, ctl + 64)
        sleep, want = struct.unpack_from("<II", buf, ctl + 72)
        assert (head, tail, sleep, want) == (32, 0, 0, 0)
        # u32 size | u16 nframes | u16 kind | u32 lengths | frames | padding
        size, nframes, kind = struct.unpack_from("<IHH", buf, data)
        assert (size, nframes, kind) == (4 * 2 + 13, 2, 0)
        assert struct.unpack_from("<II", buf, data + 8) == (3, 10)
        assert bytes(buf[data + 16:data + 29]) == b"abc0123456789"
        assert bytes(buf[data + 29:data + 32]) == bytes(3)
        assert rings.record_bytes([b"abc", b"0123456789"]) == 32
    finally:
        seg.unlink()
        seg.close()


def test_order_kept_across_wrap_around(seg):
    """Records of many sizes through a small ring, far past its end, many times."""
    ring = seg.request
    sent = received = 0
    wraps = 0
    while received < 3000:
        while True:
            body = struct.pack("<Q", sent) * (1 + sent % 37)
            if ring.put([body, struct.pack("<I", sent)]) < 0:
                break
            sent += 1
        while (frames := ring.get()) is not None:
            body, seq = frames
            n, = struct.unpack("<I", seq)
            assert n == received, "lost, duplicated or reordered"
            assert body == struct.pack("<Q", n) * (1 + n % 37)
            received += 1
        wraps += 1
    head, = struct.unpack_from("<Q", seg.region._buf, rings.REQUEST_CTL)
    assert head > 50 * 4096  # wrapped many times over
    assert ring.get() is None


_PRODUCER = textwrap.dedent("""
    import struct, select, sys
    from kvswap.client.naming import Names
    from kvswap.client.rings import Bell, RingSegment
    names = Names.of(sys.argv[1], sys.argv[2])
    n = int(sys.argv[3])
    seg = RingSegment.attach(names, 0)
    rx = Bell.listen(names.ring_bell(0, "cq"))   # rung when the consumer made room
    tx = Bell.connect(names.ring_bell(0, "rq"))  # rung when the consumer sleeps
    full = 0
    for i in range(n):
        frames = [struct.pack("<Q", i) * (1 + i % 61)]
        while True:
            rc = seg.request.put(frames)
            if rc >= 0:
                break
            full += 1
            select.select([rx], [], [], 5.0)  # a lost wake-up fails the test by its timeout
            rx.drain()
        if rc > 0:
            tx.ring()
    print(full)
""")


def test_full_ring_backpressure_between_processes(names):
    """A producer process that outruns the consumer blocks on a full ring and is
    woken by the consumer's bell; every record arrives once, in order."""
    seg = RingSegment.create(names, 0, 1, capacity=4096)
    for which in ("rq", "cq"):
        Bell.create(names.ring_bell(0, which))
    rx = Bell.listen(names.ring_bell(0, "rq"))
    tx = Bell.listen(names.ring_bell(0, "cq"))
    n = 20000
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, names.namespace,
                             str(names.run_root), str(n)], stdout=subprocess.PIPE, text=True)
    try:
        # read nothing until the producer has found the ring full: backpressure is then
        # exercised whichever process the machine runs faster
        assert poll_until(lambda: True if seg.request.wanted() else None,
                          time.monotonic() + 30), "the producer never filled the ring"
        tx.ring()
        got = 0
        while got < n:
            rx.drain()
            while (frames := seg.request.get()) is not None:
                assert frames == [struct.pack("<Q", got) * (1 + got % 61)]
                got += 1
                if got % 50 == 0 and seg.request.wanted():
                    tx.ring()
            if seg.request.wanted():
                tx.ring()
            if got < n and seg.request.arm():
                ready, _, _ = select.select([rx], [], [], 10.0)
                assert ready, f"no doorbell after {got} records: a lost wake-up"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert int(out) > 0  # times it found the ring full and waited for the bell
        assert seg.request.get() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rx.close()
        tx.close()
        seg.unlink()
        seg.close()


def test_doorbell_only_when_the_consumer_sleeps(seg):
    ring = seg.completion
    assert ring.put([b"a"]) == 1  # asleep since creation: ring
    assert ring.put([b"b"]) == 0  # already rung, not re-armed: no second bell
    assert ring.arm() is False  # records waiting: the consumer must not sleep
    assert ring.put([b"c"]) == 0
    assert [ring.get(), ring.get(), ring.get(), ring.get()] == [[b"a"], [b"b"], [b"c"], None]
    assert ring.arm() is True
    assert ring.put([b"d"]) == 1


def test_records_too_large_are_refused(seg):
    with pytest.raises(ValueError, match="exceeds half the ring"):
        seg.request.put([bytes(2048)])
    with pytest.raises(ValueError, match="1 to 512 frames"):
        seg.request.put([b"x"] * 513)
    assert not rings.fits([bytes(2048)], 4096) and rings.fits([bytes(2000)], 4096)
    assert seg.request.get() is None  # nothing was written


@pytest.mark.parametrize("corrupt", ["size", "kind", "lengths", "head"])
def test_malformed_records_are_refused_and_the_ring_recovers(seg, corrupt):
    ring = seg.request
    ring.put([b"first", b"frame"])
    buf, data, ctl = seg.region._buf, rings.DATA_OFFSET, rings.REQUEST_CTL
    if corrupt == "size":
        struct.pack_into("<I", buf, data, 10_000)
    elif corrupt == "kind":
        struct.pack_into("<H", buf, data + 6, 9)
    elif corrupt == "lengths":
        struct.pack_into("<I", buf, data + 8, 1)
    else:
        struct.pack_into("<Q", buf, ctl, 1 << 40)
    with pytest.raises(RingCorrupt):
        ring.get()
    assert ring.get() is None  # everything unread was dropped
    assert ring.put([b"next"]) >= 0
    assert ring.get() == [b"next"]  # and the ring works again


def test_one_owner_at_a_time(seg):
    me, other = owner_token(os.getpid(), 1), owner_token(os.getpid(), 2)
    assert seg.claim(me) and seg.claim(me)
    assert not seg.claim(other)
    seg.release(me)
    assert seg.claim(other)
    seg.release(other)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert seg.claim(owner_token(dead.pid, 3))
    assert seg.claim(me), "a claim whose process is gone is taken over"


def test_server_serves_a_peer_and_leaves_nothing(names):
    """RingServer end to end with a stand-in handler: requests in order, replies
    through the completion ring, a bad record answered PROTOCOL_ERROR, and after
    close no segment and no doorbell is left."""
    seen = []

    def on_request(frames, dropped, sock, signed):
        seen.append((frames[0].bytes, [bytes(f.buffer) for f in frames[1:]], dropped, signed))
        sock.send_multipart([frames[0], frames[1].bytes[::-1]])

    server = RingServer(names, 0, 5, on_request, capacity=4096)
    try:
        with pytest.raises(RingUnavailable, match="epoch 5"):
            RingPeer.open(names, 0, 4, owner_token(os.getpid(), 1))
        peer = RingPeer.open(names, 0, 5, owner_token(os.getpid(), 1))
        with pytest.raises(RingUnavailable, match="owned by pid"):
            RingPeer.open(names, 0, 5, owner_token(os.getpid(), 2))
        sent, full, replies = 0, 0, []
        while len(replies) < 200:  # far more than either ring holds at once
            while sent < 200 and peer.send([f"req{sent:03d}".encode(), b"ids"]):
                sent += 1
            full += sent < 200
            assert select.select([server], [], [], 5)[0], "the daemon's bell never rang"
            server.drain()
            server.publish()  # as the I/O loop does once per round
            replies += peer.receive(True)  # rings the daemon when it waits for room
        assert full > 0
        assert [r[0] for r in replies] == [f"req{i:03d}".encode()[::-1] for i in range(200)]
        assert [s[1][0] for s in seen] == [f"req{i:03d}".encode() for i in range(200)]
        assert all(s[0] == b"\x00ring" and s[2] == 0 and s[3] is False for s in seen)
        names_buf = peer.seg.region._buf
        head, = struct.unpack_from("<Q", names_buf, rings.REQUEST_CTL)
        peer.send([b"x"])  # then corrupt the record just written (16 bytes)
        pos = head % 4096 if 4096 - head % 4096 >= 16 else 0
        struct.pack_into("<I", names_buf, rings.DATA_OFFSET + pos, 99_999)
        assert peer.arm(), "the reader goes to sleep with nothing waiting"
        server.drain()
        # the reply is written, the sleeping reader not woken yet: the bell waits for
        # the end of the I/O loop's round, so one wake-up takes a whole burst
        assert not select.select([peer], [], [], 0)[0]
        server.publish()
        assert select.select([peer], [], [], 5)[0]
        (bad,) = peer.receive(True)
        reply = decode_reply(bad[0])
        assert reply.code == ErrorCode.PROTOCOL_ERROR and "malformed ring record" in reply.message
        peer.close()
    finally:
        server.close()
    assert names.owned_shm() == []
    assert sorted(p.name for p in names.run_dir.iterdir()) == []


# ---------------------------------------------------------------- two channels, one order


class TwoChannels:
    """A fake wire: messages with more than 8 ids want ZeroMQ, the others the ring,
    which takes ``room`` more messages (then it is full)."""

    def __init__(self):
        self.sent: list[tuple[int, int, Channel]] = []  # (rank, request id, channel)
        self.room = 1 << 30

    def channel(self, frames, rank):
        return Channel.ZMQ if len(frames) > 1 and len(frames[1]) > 8 * 4 else Channel.RING

    def send(self, frames, rank, channel):
        if channel is Channel.RING:
            if self.room == 0:
                return False
            self.room -= 1
        self.sent.append((rank, msgpack.unpackb(frames[0])["id"], channel))
        return True

    def reconnect(self, rank):
        pass

    def take(self) -> list[tuple[int, Channel]]:
        out = [(i, c) for r, i, c in self.sent if r == 0]
        self.sent = []
        return out


_tids = itertools.count(1)


def _env(blocks: int) -> _Envelope:
    fut = TransferFuture(next(_tids), Op.EVICT, range(1), time.monotonic() + 30)
    ids = np.arange(blocks, dtype="<i4")
    return _Envelope(fut, transfer_message(Op.EVICT, fut.task_id, ids, ids))


def _answer(d: _Dispatcher, env: _Envelope) -> None:
    d.on_reply(Reply(env.carrier.task_id, 0, True, ErrorCode.OK, ""))
    d.pump()


def test_one_rank_is_sent_on_one_channel_at_a_time():
    """The daemon reads its ring and its socket each in order, not against each other:
    a large message waits until the ring owes nothing, small ones follow the channel
    that still owes replies, and the ring is used again once ZeroMQ owes none."""
    wire = TwoChannels()
    d = _Dispatcher(1, 5, wire, 30.0, lambda r: 1, lambda r: True, lambda r: "rank 0")
    a, big, c = _env(1), _env(100), _env(1)
    for env in (a, big, c):
        d.post(env)
    ring, zmq = Channel.RING, Channel.ZMQ
    assert wire.take() == [(a.carrier.task_id, ring)]  # big waits for a's reply
    _answer(d, a)
    assert wire.take() == [(big.carrier.task_id, zmq), (c.carrier.task_id, zmq)]
    e = _env(1)
    d.post(e)
    assert wire.take() == [(e.carrier.task_id, zmq)]  # ZeroMQ still owes big, c
    for env in (big, c, e):
        _answer(d, env)
    f = _env(1)
    d.post(f)
    assert wire.take() == [(f.carrier.task_id, ring)]
    _answer(d, f)
    assert d._owing == [0] and d._ring_owing == [0]
    assert all(env.carrier.result(0) for env in (a, big, c, e, f))


def test_a_full_ring_keeps_messages_in_order_in_the_backlog():
    wire = TwoChannels()
    wire.room = 2
    d = _Dispatcher(1, 5, wire, 30.0, lambda r: 1, lambda r: True, lambda r: "rank 0")
    envs = [_env(1) for _ in range(5)]
    for env in envs:
        d.post(env)
    ids = [e.carrier.task_id for e in envs]
    assert [i for i, _ in wire.take()] == ids[:2]
    d.pump()
    assert wire.take() == []  # still full: nothing lost, nothing out of order
    wire.room = 10
    d.pump()  # the daemon rang back: room
    assert [i for i, _ in wire.take()] == ids[2:]
    for env in envs:
        _answer(d, env)
    assert d._owing == [0] and all(e.carrier.result(0) for e in envs)


# ---------------------------------------------------------------- the client's path option


def test_path_option_is_checked_before_anything_is_created(run_root):
    with pytest.raises(InvalidTask, match="path must be 'ring' or 'zmq'"):
        TransferClient("nosuchns", 1, run_root=run_root, path="shm")
    with pytest.raises(InvalidTask, match="tcp:// client uses path='zmq'"):
        TransferClient("nosuchns", 1, run_root=run_root, path="ring", tcp="127.0.0.1:7000",
                       secret=b"s")


def test_one_client_owns_the_rings_others_use_zeromq(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    first = TransferClient(ns, 2, run_root=root)
    second = TransferClient(ns, 2, run_root=root)
    try:
        for c in (first, second):
            c.wait_ready(20)
            assert c.evict([1], [1]).result(10) and c.load([1], [2]).result(10)
        assert [p is not None for p in first._wire.rings] == [True, True]
        assert [p is not None for p in second._wire.rings] == [False, False]
        first.close()
        second._wire._retry_at = [0.0, 0.0]  # look again now, not in half a second
        assert second.ping().result(10)
        assert [p is not None for p in second._wire.rings] == [True, True]
        assert second.evict([2], [2]).result(10)
    finally:
        first.close()
        second.close()


def test_a_flood_is_served_in_bursts_without_losing_the_rest(names):
    served = []
    server = RingServer(names, 0, 1, lambda frames, *_: served.append(frames[1].bytes),
                        capacity=1 << 16)
    try:
        peer = RingPeer.open(names, 0, 1, owner_token(os.getpid(), 1))
        n = 300  # more than one burst
        for i in range(n):
            assert peer.send([struct.pack("<I", i)])
        bursts = 0
        while len(served) < n:
            assert select.select([server], [], [], 5)[0], "the rest was left without a bell"
            server.drain()
            bursts += 1
        assert bursts == 2 and served == [struct.pack("<I", i) for i in range(n)]
        peer.close()
    finally:
        server.close()


# ---------------------------------------------------------------- indices another process wrote
#
# Every process of the namespace's uid can store anything in a ring segment.  A bad
# index must cost the ring (and the requests in it, covered by their deadlines), never
# a write outside the data area, a daemon, or the rank's later requests.


def _ctl(seg, ctl: int) -> tuple[int, int]:
    head, = struct.unpack_from("<Q", seg.region._buf, ctl)
    tail, = struct.unpack_from("<Q", seg.region._buf, ctl + 64)
    return head, tail


def _set(seg, ctl: int, head: int | None = None, tail: int | None = None,
         sleep: int | None = None) -> None:
    """Store indices as a hostile or buggy process would: plain stores."""
    buf = seg.region._buf
    if head is not None:
        struct.pack_into("<Q", buf, ctl, head)
    if tail is not None:
        struct.pack_into("<Q", buf, ctl + 64, tail)
    if sleep is not None:
        struct.pack_into("<I", buf, ctl + 72, sleep)


@pytest.mark.parametrize("head, tail", [
    (4096 - 4, 4096 - 4),  # unaligned, 4 bytes before the end: the wrap marker overran it
    (12, 12),  # unaligned: every later record off the 8-byte grid
    (16, 12),  # unaligned tail
    (3 * 4096, 0),  # more written than the ring holds
])
def test_put_refuses_indices_it_did_not_make_and_writes_nothing(seg, head, tail):
    _set(seg, rings.REQUEST_CTL, head, tail)
    before = bytes(seg.region._buf)
    with pytest.raises(RingCorrupt, match="nothing was written"):
        seg.request.put([b"abc", b"0123456789"])
    assert bytes(seg.region._buf) == before  # not a byte, in the ring or beyond it


_WRITE_AT_THE_END = textwrap.dedent("""
    import struct, sys
    from kvswap.client.naming import Names
    from kvswap.client.rings import COMPLETION_CTL, RingCorrupt, RingSegment
    seg = RingSegment.attach(Names.of(sys.argv[1], sys.argv[2]), 0)
    cap = seg.capacity
    # the completion area ends where the mapping ends: head = tail = C - 4
    struct.pack_into("<Q", seg.region._buf, COMPLETION_CTL, cap - 4)
    struct.pack_into("<Q", seg.region._buf, COMPLETION_CTL + 64, cap - 4)
    try:
        print("written", seg.completion.put([b"reply"]))
    except RingCorrupt as exc:
        print("refused", exc)
""")


def test_a_bad_index_at_the_end_of_the_segment_never_crashes_the_writer(names, seg):
    """The daemon's reply after a hostile ``head = tail = C - 4`` wrote its wrap
    marker 4 bytes past the segment (SIGSEGV, the rank gone).  In a child process,
    since that write may kill whoever makes it."""
    child = subprocess.run([sys.executable, "-c", _WRITE_AT_THE_END, names.namespace,
                            str(names.run_root)], capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, f"the writer died: {child.returncode} {child.stderr[-400:]}"
    assert child.stdout.startswith("refused ring indices out of bounds"), child.stdout


def test_get_refuses_an_unaligned_tail(seg):
    """A record at an unaligned tail is never read (its header could lie past the
    area): everything unread is dropped, and the ring works again."""
    buf, data = seg.region._buf, rings.DATA_OFFSET
    # a well-formed record at offset 4: size 8, one frame, kind 0, length 4, b"evil"
    struct.pack_into("<IHHI4s", buf, data + 4, 8, 1, 0, 4, b"evil")
    _set(seg, rings.REQUEST_CTL, head=24, tail=4)
    with pytest.raises(RingCorrupt, match="out of bounds"):
        seg.request.get()
    assert _ctl(seg, rings.REQUEST_CTL) == (24, 24)
    assert seg.request.get() is None
    assert seg.request.put([b"next"]) >= 0 and seg.request.get() == [b"next"]


def test_an_unaligned_head_costs_one_error_and_the_writer_stops(seg):
    """After ``head += 4`` the reader drops what is unread and then sees an empty ring
    (it raised at every look, and the daemon answered PROTOCOL_ERROR 256 times per
    round); the writer's next put fails instead of writing off the grid forever."""
    ring = seg.request
    assert ring.put([b"lost"]) == 1
    head, _ = _ctl(seg, rings.REQUEST_CTL)
    _set(seg, rings.REQUEST_CTL, head=head + 4)
    with pytest.raises(RingCorrupt):
        ring.get()
    assert ring.get() is None and ring.get() is None  # one error, not one per look
    assert ring.arm() is True  # empty: the reader may sleep
    with pytest.raises(RingCorrupt):
        ring.put([b"next"])
    assert _ctl(seg, rings.REQUEST_CTL) == (head + 4, head + 4)


def test_shut_makes_every_later_put_fail(seg):
    ring = seg.request
    assert ring.put([b"a"]) == 1
    ring.shut()
    for _ in range(2):
        with pytest.raises(RingCorrupt):
            ring.put([b"b"])


def _echo_server(names: Names, seen: list):
    """A RingServer at epoch 5 whose handler records each request and answers OK."""

    def on_request(frames, dropped, sock, signed):
        seen.append(frames[1].bytes)
        sock.send_multipart([frames[0], encode_reply(len(seen), 0, ErrorCode.OK)])

    return RingServer(names, 0, 5, on_request, capacity=4096)


def test_a_daemon_that_cannot_write_its_replies_shuts_both_rings(names):
    """A completion ring with indices the daemon did not make: the reply is dropped
    (not retried at every round), no further request is read, and the client's next
    write fails, so it moves to ZeroMQ rather than wait out every deadline."""
    seen: list = []
    server = _echo_server(names, seen)
    try:
        peer = RingPeer.open(names, 0, 5, owner_token(os.getpid(), 1))
        _set(peer.seg, rings.COMPLETION_CTL, head=12, tail=12)
        assert peer.send([b"first"])
        server.drain()  # the handler's reply finds the completion ring corrupt
        assert seen == [b"first"]
        with pytest.raises(RingCorrupt):
            peer.send([b"second"])
        assert server.shut_why is not None and "completion ring is corrupt" in server.shut_why
        assert server.dropped == 1
        server.drain()
        server.send([b"late reply"])  # a worker's completion after the shut
        assert seen == [b"first"] and server.dropped == 2
        peer.close()
    finally:
        server.close()


def test_a_client_whose_ring_write_fails_uses_zeromq_and_keeps_the_message(names):
    """Transport level: the failed write is not an exception for the dispatcher but
    "not sent now" (it stays in the rank's backlog), the reader is told to look
    again, the rank's messages want ZeroMQ from then on, and the completion ring is
    still read for what the ring owes."""
    seen: list = []
    server = _echo_server(names, seen)
    wire = Transport(names, [names.endpoint(0)], PathChoice.RING, 1, lambda r: 5)
    try:
        frames = [b"request"]
        assert wire.channel(frames, 0) is Channel.RING
        head, _ = _ctl(wire.rings[0].seg, rings.REQUEST_CTL)
        _set(wire.rings[0].seg, rings.REQUEST_CTL, head=head + 4)
        wire.take_look()
        assert wire.send(frames, 0, Channel.RING) is False
        assert wire.take_look() is True  # the reader pumps the backlog again
        assert wire.channel(frames, 0) is Channel.ZMQ
        server.drain()  # finds the bad head: drops the ring's bytes, PROTOCOL_ERROR
        server.publish()
        (reply,) = wire.receive(wire.everything())
        assert reply.code == ErrorCode.PROTOCOL_ERROR and reply.id is None
        assert seen == []
        wire.reconnect(0)  # the rank restarted: its new rings may be used again
        assert wire.channel(frames, 0) is Channel.RING
    finally:
        wire.close()
        server.close()


_KILLED_AFTER_PUT = textwrap.dedent("""
    import os, signal, sys
    from kvswap.client.naming import Names
    from kvswap.client.rings import RingSegment, owner_token
    seg = RingSegment.attach(Names.of(sys.argv[1], sys.argv[2]), 0)
    assert seg.claim(owner_token(os.getpid(), 7))
    assert seg.request.put([b"left behind"]) == 1  # it cleared sleep: it owes the bell
    os.kill(os.getpid(), signal.SIGKILL)  # killed before it rang
""")


def test_a_new_owner_is_heard_after_its_predecessor_died_before_ringing(names):
    seen: list = []
    server = _echo_server(names, seen)
    try:
        child = subprocess.run([sys.executable, "-c", _KILLED_AFTER_PUT, names.namespace,
                                str(names.run_root)], capture_output=True, timeout=30)
        assert child.returncode == -9, child.stderr
        assert not select.select([server], [], [], 0)[0]  # nobody rang: the daemon sleeps
        peer = RingPeer.open(names, 0, 5, owner_token(os.getpid(), 1))  # takes the claim over
        assert select.select([server], [], [], 0)[0], "the new owner did not ring"
        server.drain()
        assert seen == [b"left behind"]
        assert peer.send([b"mine"])
        assert select.select([server], [], [], 0)[0]  # re-armed: our writes ring again
        server.drain()
        assert seen == [b"left behind", b"mine"]
        peer.close()
    finally:
        server.close()


# ---------------------------------------------------------------- against a real daemon


def _launch_one(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT)
    return launcher, launcher.names.namespace, str(launcher.names.run_root)


@contextlib.contextmanager
def _ring_client(namespaces, task_timeout: float):
    """A client of a one-rank namespace, served over its rings, and its ring segment."""
    _, ns, root = _launch_one(namespaces)
    c = TransferClient(ns, 1, run_root=root, task_timeout=task_timeout)
    try:
        c.wait_ready(20)
        assert c.ping().result(5)
        yield c, c._wire.rings[0].seg
    finally:
        c.close()


def test_daemon_reads_its_ring_without_a_doorbell(namespaces):
    """Another process clears the request ring's ``sleep`` while the daemon sleeps:
    the client's writes no longer ring, and the daemon must find them on its own
    (its I/O loop's timeout, at most a second), not never."""
    with _ring_client(namespaces, 2.5) as (c, seg):
        sleep_word = rings.REQUEST_CTL + 72
        assert poll_until(lambda: True if struct.unpack_from("<I", seg.region._buf,
                                                             sleep_word)[0] else None,
                          time.monotonic() + 5), "the daemon never went to sleep"
        _set(seg, rings.REQUEST_CTL, sleep=0)
        assert c.ping().result(5)  # within its 2.5 s deadline: not never
        assert c._wire.rings[0] is not None and c._wire.channel([b"x"], 0) is Channel.RING


def test_client_moves_to_zeromq_when_its_request_ring_is_corrupt(namespaces):
    """End to end: an unaligned request-ring head made every later ring request of
    the client vanish (answered PROTOCOL_ERROR without an id); now the request that
    finds it goes over ZeroMQ, and so do the rank's later ones."""
    with _ring_client(namespaces, 1.5) as (c, seg):
        head, _ = _ctl(seg, rings.REQUEST_CTL)
        _set(seg, rings.REQUEST_CTL, head=head + 4)
        assert c.evict([1], [1]).result(5)  # the message that hit the error
        assert c.load([1], [2]).result(5)
        assert c._wire.channel([b"x"], 0) is Channel.ZMQ


def test_a_corrupt_completion_ring_costs_one_reply_not_the_daemon(namespaces):
    """End to end: ``head = tail = C - 4`` in the completion ring made the daemon's
    next reply kill it (SIGSEGV).  Now that reply is lost, the daemon lives, and
    the client's next request goes over ZeroMQ."""
    launcher, ns, root = _launch_one(namespaces)
    seg = RingSegment.attach(launcher.names, 0)
    try:
        _set(seg, rings.COMPLETION_CTL, head=seg.capacity - 4, tail=seg.capacity - 4)
        c = TransferClient(ns, 1, run_root=root, task_timeout=1.0)
        try:
            c.wait_ready(20)
            with pytest.raises(RankTimeout):
                c.ping().result(5)
            assert c.ping().result(5)
            assert c._wire.channel([b"x"], 0) is Channel.ZMQ
        finally:
            c.close()
        assert launcher.procs[0].poll() is None, "the daemon died"
    finally:
        seg.close()


def test_signals_doc_lists_the_ring_segment():
    docs = Path(__file__).resolve().parent.parent / "docs"
    objects = (docs / "signals.md").read_text().split("## 9.")[1].split("\n## ")[0]
    assert "`/kvswap.<ns>.ring.r<r>`" in objects
