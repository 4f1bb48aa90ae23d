"""Permissions of every namespace object, and signed tcp:// traffic."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from kvswap.client import TransferClient
from kvswap.client.auth import AuthFailed, ReplayGuard, load_secret, sign, verify
from kvswap.client.errors import ErrorCode
from kvswap.client.protocol import Op, decode_reply, encode_request, transfer_message
from kvswap.daemon.storage.local_servers import free_port

from test_daemon import RawPeer

LAYOUT = "layers=1,block_tokens=4,heads=2,head_dim=8,blocks=16"
SECRET = b"0123456789abcdef-kvswap-test-secret"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def test_every_namespace_object_is_owner_only(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=8)
    names = launcher.names
    assert stat.S_IMODE(names.run_dir.stat().st_mode) == 0o700
    for r in range(2):
        assert stat.S_IMODE(names.endpoint_path(r).stat().st_mode) == 0o600
    entries = names.owned_shm()
    p = names.prefix
    for expected in (f"{p}signals", f"{p}swap.r0", f"{p}swap.r1", f"{p}dev.r0.k0",
                     f"sem.{p}wake.r1", f"sem.{p}layer.r0"):
        assert expected in entries, (expected, entries)
    for e in entries:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{e}").st_mode) == 0o600, e


class Peer(RawPeer):
    """A raw DEALER on the tcp:// listener; replies are signed, so verify them."""

    def ask(self, frames, timeout_s: float = 10.0):
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(timeout_s * 1000)), "no reply"
        _, body = verify(SECRET, self.sock.recv_multipart())
        return decode_reply(body[0])


def test_tcp_requires_signed_fresh_unreplayed_messages(namespaces, secret_file):
    port = free_port()
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=8,
                                 tcp=f"127.0.0.1:{port}", secret_file=str(secret_file))
    names = launcher.names
    with TransferClient(names.namespace, 1, run_root=str(names.run_root),
                        tcp=f"127.0.0.1:{port}", secret=SECRET) as client:
        client.wait_ready(10)
        assert client.evict([1, 2], [3, 4]).result(10).replies[0].ok
        assert client.ping().result(10).replies[0].fields["state"] == "READY"

    msg = transfer_message(Op.EVICT, 7, np.array([1], "<i4"), np.array([1], "<i4"))
    good = sign(SECRET, msg.frames(ts=time.time_ns()))
    tampered = sign(SECRET, msg.frames(ts=time.time_ns()))
    tampered[-1] = np.array([2], "<i4").tobytes()  # change an id after signing
    refused = {  # each on a connection of its own: a connection is answered once
        "unsigned": msg.frames(ts=time.time_ns()),
        "bad signature": sign(b"not-the-secret-at-all-000000", msg.frames(ts=time.time_ns())),
        "tampered": tampered,
        "stale": sign(SECRET, msg.frames(ts=time.time_ns() - 3600 * 10**9)),
        "no ts": sign(SECRET, encode_request(Op.PING, 9)),
    }
    peers = [Peer(f"tcp://127.0.0.1:{port}") for _ in range(len(refused) + 1)]
    try:
        for peer, (what, frames) in zip(peers, refused.items()):
            r = peer.ask(frames)
            assert r.code == ErrorCode.AUTH_FAILED and r.id is None, what
            if what in ("unsigned", "bad signature"):
                assert what in r.message
        last = peers[-1]
        assert last.ask(good).ok
        r = last.ask(good)  # the very same bytes again
        assert r.code == ErrorCode.AUTH_FAILED and "replayed" in r.message
        # A connection already refused is not answered again (a peer that sends and
        # never reads would make the daemon queue a reply per message): the next
        # reply it reads is the one to a good request sent after the refused one.
        last.sock.send_multipart(refused["unsigned"])
        assert last.ask(sign(SECRET, encode_request(Op.PING, 11, {"ts": time.time_ns()}))).id == 11
        # the ipc:// socket stays unsigned for local clients
        with TransferClient(names.namespace, 1, run_root=str(names.run_root)) as local:
            assert local.evict([5], [5]).result(10).replies[0].ok
    finally:
        for peer in peers:
            peer.close()


def test_a_restarted_daemon_refuses_replays_of_what_its_predecessor_received(namespaces,
                                                                              secret_file):
    """The replay memory lived in the daemon alone: after a kill -9 and restart, a
    captured signed pause sent again inside the window paused the rank (and so any
    unstamped op: resume, clear, shutdown...).  A request signed before the daemon
    started is refused; a fresh one is served."""
    from kvswap.client.signals import RankSlot, RankState, poll_until
    from test_faults import Supervising

    port = free_port()
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=8,
                                 tcp=f"127.0.0.1:{port}", secret_file=str(secret_file))
    assert launcher.supervise_once() is None
    captured = sign(SECRET, encode_request(Op.PAUSE, 21, {"ts": time.time_ns()}))
    peer = Peer(f"tcp://127.0.0.1:{port}")
    try:
        assert peer.ask(captured).ok
        assert peer.ask(sign(SECRET, encode_request(Op.RESUME, 22, {"ts": time.time_ns()}))).ok
    finally:
        peer.close()
    with Supervising(launcher):
        os.kill(launcher.procs[0].pid, 9)
        seg = launcher.seg
        assert poll_until(lambda: True if int(seg.ranks[0, RankSlot.EPOCH]) == 2
                          and seg.state_of(0) is RankState.READY else None,
                          time.monotonic() + 30), launcher.progress()
    peer = Peer(f"tcp://127.0.0.1:{port}")
    try:
        r = peer.ask(captured)
        assert r.code == ErrorCode.AUTH_FAILED and "before this daemon started" in r.message
        fresh = sign(SECRET, encode_request(Op.PING, 23, {"ts": time.time_ns()}))
        assert peer.ask(fresh).fields["state"] == "READY"
    finally:
        peer.close()


def test_a_secret_file_that_is_not_a_small_regular_file_is_refused_unread(tmp_path):
    """A FIFO blocked the read for ever and a symlink to /dev/zero read until memory
    ran out: what is not a regular file of at most 64 KiB is refused before it is read."""
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big"
    big.write_bytes(b"x" * (64 * 1024 + 1))
    big.chmod(0o600)
    for path in (fifo, zero, big):
        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(AuthFailed, load_secret,
                                                                        path)), daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), f"load_secret({path.name}) blocked"
        assert errors and "not a regular file of at most 65536 bytes" in str(errors[0].value)


def test_secret_file_must_be_private(namespaces, tmp_path):
    loose = tmp_path / "loose"
    loose.write_bytes(SECRET)
    loose.chmod(0o644)
    with pytest.raises(AuthFailed, match="chmod 600"):
        load_secret(loose)
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    short.chmod(0o600)
    with pytest.raises(AuthFailed, match="shorter"):
        load_secret(short)
    # refused by the launcher before it starts anything
    with pytest.raises(AuthFailed, match="chmod 600"):
        namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=8,
                          tcp=f"127.0.0.1:{free_port()}", secret_file=str(loose))
    assert namespaces.launchers[-1].procs == []


class _Clock:
    """Wall-clock ns that a test moves by hand."""

    def __init__(self) -> None:
        self.ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.ns


def test_replay_guard_refuses_repeats_and_forgets_once_the_ts_left_the_window():
    clock = _Clock()
    g = ReplayGuard(window_s=2, clock=clock)
    sent = clock.ns
    g.check(b"a" * 32, sent)
    with pytest.raises(AuthFailed, match="replayed"):
        g.check(b"a" * 32, sent)
    g.check(b"b" * 32, sent)  # another mac: accepted
    assert len(g) == 2
    clock.ns = sent + 2 * 10**9  # ts still inside the window: still a replay
    with pytest.raises(AuthFailed, match="replayed"):
        g.check(b"a" * 32, sent)
    clock.ns = sent + 3 * 10**9 + 1  # past ts + window (and the second it ends in)
    with pytest.raises(AuthFailed, match="away from the daemon's clock"):
        g.check(b"a" * 32, sent)  # the old message: stale
    g.check(b"a" * 32, clock.ns)  # the same mac with a fresh ts: the old one was forgotten
    assert len(g) == 1


def test_replay_guard_remembers_a_ts_ahead_of_its_clock_until_that_ts_leaves_the_window():
    """A request stamped 1.5 s ahead (the client's clock runs fast) passes the ts check
    until ts + window, 3.5 s after it arrived: its replay is refused until then, not
    only for a window after arrival."""
    clock = _Clock()
    g = ReplayGuard(window_s=2, clock=clock)
    arrived = clock.ns
    ahead = arrived + 1_500_000_000
    g.check(b"f" * 32, ahead)
    clock.ns = arrived + 3_000_000_000  # a window after arrival; the ts is 1.5 s old
    with pytest.raises(AuthFailed, match="replayed"):
        g.check(b"f" * 32, ahead)
    clock.ns = ahead + 3 * 10**9 + 1
    g.check(os.urandom(32), clock.ns)  # any request: the guard forgets as it goes
    assert len(g) == 1  # the fast-stamped mac is gone, the new one is kept


def test_replay_guard_refuses_what_was_signed_before_the_daemon_started():
    clock = _Clock()
    g = ReplayGuard(window_s=60, clock=clock, not_before_ns=clock.ns)
    with pytest.raises(AuthFailed, match="before this daemon started"):
        g.check(b"a" * 32, clock.ns - 10**6)  # inside the window, before the start
    g.check(b"b" * 32, clock.ns)
