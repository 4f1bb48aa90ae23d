"""A real daemon process, driven over a raw ZMQ socket: every bad request is rejected
with its code, changes nothing, and the daemon keeps serving."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvswap.client.errors import ErrorCode
from kvswap.client.layout import TensorDesc, demo_layout
from kvswap.client.protocol import (
    PROTOCOL_VERSION,
    Op,
    encode_request,
    encode_transfer,
    packb,
)
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import RankSlot, RankState
from kvswap.daemon.swap_space import SwapLayout

from conftest import SMALL_LAYOUT, RawPeer, wait_for_state

HOST_BLOCKS = 64


@pytest.fixture
def daemon(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=HOST_BLOCKS)
    peer = RawPeer(launcher.names.endpoint(0))
    yield launcher, peer
    peer.close()


def _hdr(op: str, **fields) -> bytes:
    h = {"v": list(PROTOCOL_VERSION), "id": 77, "op": op}
    h.update(fields)
    return packb(h)


def _i4(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _valid_evict(peer: RawPeer, req_id: int = 1000):
    r = peer.ask(encode_transfer(Op.EVICT, req_id, np.array([1, 2], "<i4"),
                                 np.array([3, 4], "<i4")))
    assert r.ok and r.code == ErrorCode.OK and r.id == req_id
    return r


BAD_REQUESTS = [
    ("unknown op", [_hdr("explode")], ErrorCode.UNKNOWN_OP),
    ("wrong major version", [packb({"v": [PROTOCOL_VERSION[0] + 1, 0], "id": 1, "op": "ping"})],
     ErrorCode.VERSION_MISMATCH),
    ("malformed msgpack", [b"\xc1\x00\xff"], ErrorCode.PROTOCOL_ERROR),
    ("header not a map", [packb("evict")], ErrorCode.PROTOCOL_ERROR),
    ("missing id frames", [_hdr("evict", ids="<i4", n=1), _i4([1])], ErrorCode.BAD_FRAMES),
    ("extra frame", [_hdr("evict", ids="<i4", n=1), _i4([1]), _i4([1]), b"x"],
     ErrorCode.BAD_FRAMES),
    ("device id out of range", [_hdr("evict", ids="<i4", n=2), _i4([1, 32]), _i4([0, 1])],
     ErrorCode.ID_OUT_OF_RANGE),
    ("host id out of range", [_hdr("evict", ids="<i4", n=2), _i4([1, 2]), _i4([0, HOST_BLOCKS])],
     ErrorCode.ID_OUT_OF_RANGE),
    ("negative id", [_hdr("load", ids="<i4", n=2), _i4([1, -2]), _i4([0, 1])],
     ErrorCode.ID_OUT_OF_RANGE),
    ("duplicate destination", [_hdr("evict", ids="<i4", n=2), _i4([1, 2]), _i4([5, 5])],
     ErrorCode.DUPLICATE_DESTINATION),
    ("mismatched lengths", [_hdr("load", ids="<i4", n=2), _i4([1, 2]), _i4([5])],
     ErrorCode.LENGTH_MISMATCH),
    ("wrong id dtype", [_hdr("evict", ids="<f8", n=1), np.array([1.0]).tobytes(),
                        np.array([1.0]).tobytes()], ErrorCode.BAD_ID_DTYPE),
    ("ragged id frame", [_hdr("evict", ids="<i8", n=1), b"\x01\x02\x03", b"\x01\x02\x03"],
     ErrorCode.BAD_ID_DTYPE),
    ("n disagrees with frames", [_hdr("evict", ids="<i4", n=5), _i4([1]), _i4([1])],
     ErrorCode.BAD_FIELD),
    ("n of wrong type", [_hdr("evict", ids="<i4", n="1"), _i4([1]), _i4([1])],
     ErrorCode.BAD_FIELD),
    ("register twice", [_hdr("register", backend="host", tensors=[])],
     ErrorCode.ALREADY_REGISTERED),
]


@pytest.mark.parametrize("what, frames, code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_rejected_then_daemon_serves(daemon, what, frames, code):
    launcher, peer = daemon
    seg = launcher.seg
    failed_before = int(seg.ranks[0, RankSlot.FAILED])
    by_code_before = seg.snapshot()["ranks"][0]["errors"].get(code.name, 0)
    r = peer.ask(frames)
    assert not r.ok
    assert r.code == code, f"{what}: got {r.code.name}: {r.message}"
    assert r.rank == 0 and r.message
    assert int(seg.ranks[0, RankSlot.FAILED]) == failed_before + 1
    assert seg.snapshot()["ranks"][0]["errors"][code.name] == by_code_before + 1
    _valid_evict(peer)
    assert seg.state_of(0) == RankState.READY
    assert int(seg.ranks[0, RankSlot.COMPLETED]) >= 1


def test_reply_keeps_the_request_id_when_readable(daemon):
    _, peer = daemon
    r = peer.ask([_hdr("explode")])
    assert r.id == 77
    r = peer.ask([b"\xc1"])
    assert r.id is None


def test_rejected_task_changes_nothing(daemon):
    launcher, peer = daemon
    names = launcher.names
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(SMALL_LAYOUT)]
    dev = [ShmRegion.attach(names.device_segment(0, t.name)) for t in tensors]
    swap = ShmRegion.attach(names.swap_segment(0), readonly=True)
    layout = SwapLayout.of(tensors, HOST_BLOCKS)
    try:
        dev_views = [reg.array(0, (t.num_blocks, t.bytes_per_block), np.uint8)
                     for reg, t in zip(dev, tensors)]
        host_views = [swap.array(off, (HOST_BLOCKS, t.bytes_per_block), np.uint8)
                      for off, t in zip(layout.offsets, tensors)]
        for i, v in enumerate(dev_views):
            v[:] = (np.arange(v.size, dtype=np.uint64).reshape(v.shape) * (i + 3) % 251)
        before = [h.copy() for h in host_views]
        # two valid ids and one out of range: the whole task must be refused
        r = peer.ask(encode_transfer(Op.EVICT, 5, np.array([1, 2, 99], "<i4"),
                                     np.array([10, 11, 12], "<i4")))
        assert r.code == ErrorCode.ID_OUT_OF_RANGE
        assert all(np.array_equal(b, h) for b, h in zip(before, host_views))
        # the same task, valid, moves exactly those blocks
        r = peer.ask(encode_transfer(Op.EVICT, 6, np.array([1, 2, 30], "<i4"),
                                     np.array([10, 11, 12], "<i4")))
        assert r.ok
        assert r.fields["bytes"] == 3 * sum(t.bytes_per_block for t in tensors)
        for d, h in zip(dev_views, host_views):
            assert np.array_equal(h[[10, 11, 12]], d[[1, 2, 30]])
            assert not h[:10].any() and not h[13:].any()
        del dev_views, host_views
    finally:
        for reg in (*dev, swap):
            reg.close()


def test_ping_stats_and_timings(daemon):
    launcher, peer = daemon
    r = peer.ask(encode_request(Op.PING, 1))
    assert r.ok and r.fields["state"] == "READY" and r.fields["epoch"] == 1
    assert r.fields["pid"] == launcher.procs[0].pid
    ev = _valid_evict(peer, 2)
    assert ev.exec_us > 0 and ev.queued_us >= 0
    st = peer.ask(encode_request(Op.STATS, 3))
    assert st.fields["counters"]["completed"] == 1
    assert st.fields["counters"]["bytes_evicted"] == ev.fields["bytes"]
    hist = st.fields["counters"]["histograms"]["evict"]
    assert hist["exec"]["count"] == 1 and sum(hist["exec"]["buckets"]) == 1
    # the reply's timing, in the histogram (whole µs there; the reply keeps 0.1 µs)
    assert abs(hist["exec"]["sum_us"] - ev.exec_us) <= 1
    assert hist["queued"]["count"] == 1 and st.fields["counters"]["histograms"]["load"][
        "exec"]["count"] == 0


def test_shutdown_op_stops_daemon_cleanly(daemon):
    launcher, peer = daemon
    r = peer.ask(encode_request(Op.SHUTDOWN, 9))
    assert r.ok
    assert launcher.procs[0].wait(timeout=20) == 0
    assert launcher.seg.state_of(0) == RankState.STOPPED
    # the daemon removed what it created: its swap pool and its demo caches
    left = [e for e in launcher.names.owned_shm() if ".swap." in e or ".dev." in e]
    assert left == []


def test_transfer_before_register_is_not_ready(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False)
    wait_for_state(launcher, RankState.ATTACHING)
    peer = RawPeer(launcher.names.endpoint(0))
    try:
        r = peer.ask(encode_transfer(Op.LOAD, 1, np.array([0], "<i4"), np.array([0], "<i4")))
        assert r.code == ErrorCode.NOT_READY and "ATTACHING" in r.message
        bad = peer.ask([_hdr("register", backend="host",
                             tensors=[{"name": "k0", "layer": 0, "dtype": "<f2",
                                       "shape": [4, 8], "location": {"shm": "/elsewhere"}}])])
        assert bad.code == ErrorCode.BAD_LAYOUT and "location.shm" in bad.message
        bad = peer.ask([_hdr("register", backend="cuda", tensors=[])])
        assert bad.code == ErrorCode.BAD_LAYOUT
        bad = peer.ask([_hdr("register", backend="host", tensors=[{"name": "k0"}])])
        assert bad.code == ErrorCode.BAD_LAYOUT
        # numpy raises SyntaxError for this dtype: once answered INTERNAL_ERROR
        bad = peer.ask([_hdr("register", backend="host",
                             tensors=[{"name": "k0", "layer": 0, "dtype": ",f2",
                                       "shape": [4, 8], "location": {"shm": "/elsewhere"}}])])
        assert bad.code == ErrorCode.BAD_LAYOUT and "numpy scalar type" in bad.message
        # still waiting for a worker, still serving
        assert peer.ask(encode_request(Op.PING, 2)).fields["state"] == "ATTACHING"
    finally:
        peer.close()


def test_unsupported_message_does_not_kill_a_busy_daemon(daemon):
    """Interleave garbage with valid work; every valid task still completes."""
    launcher, peer = daemon
    rng = np.random.default_rng(1)
    garbage = [rng.bytes(int(n)) for n in rng.integers(1, 200, size=50)]
    for i, g in enumerate(garbage):
        r = peer.ask([g])
        assert not r.ok
        _valid_evict(peer, 2000 + i)
    assert launcher.procs[0].poll() is None
    assert int(launcher.seg.ranks[0, RankSlot.COMPLETED]) == len(garbage)


def test_msgpack_reply_is_a_map(daemon):
    _, peer = daemon
    peer.sock.send_multipart(encode_request(Op.PING, 4))
    assert peer.sock.poll(10000)
    body = msgpack.unpackb(peer.sock.recv_multipart()[0])
    assert {"v", "id", "rank", "ok", "code", "message", "tq", "tx"} <= set(body)
