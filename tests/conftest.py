"""Shared fixtures: short run roots, unique namespaces, launched namespaces, leak checks,
a real Redis server for the storage tier.

Every namespace a test creates is checked after the test: nothing of it may be
left in /dev/shm, and no daemon process may survive.  Whatever is found is
removed anyway, so one failing test cannot cascade into others.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvswap.client.naming import Names
from kvswap.client.protocol import Reply, decode_reply
from kvswap.daemon.demo import RankView, pattern
from kvswap.daemon.launcher import LaunchConfig, Launcher, sweep_namespace
from kvswap.daemon.storage.local_servers import MooncakeMaster, RedisServer, find_master

_counter = itertools.count()


@pytest.fixture
def run_root():
    # pytest's tmp_path can exceed the 107-byte limit of ipc:// socket paths.
    path = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class NamespaceFactory:
    def __init__(self, run_root: str):
        self.run_root = run_root
        self.created: list[Names] = []
        self.launchers: list[Launcher] = []

    def new(self) -> Names:
        names = Names.of(f"t{os.getpid()}-{next(_counter)}", self.run_root)
        self.created.append(names)
        return names

    def launch(self, tp: int = 2, demo_caches: str | None = "", host_blocks: int = 64,
               wait: bool = True, **kw) -> Launcher:
        names = self.new()
        launcher = Launcher(LaunchConfig(namespace=names.namespace, tp=tp, run_root=self.run_root,
                                         demo_caches=demo_caches, host_blocks=host_blocks,
                                         stop_timeout_s=kw.pop("stop_timeout_s", 6.0), **kw))
        self.launchers.append(launcher)
        launcher.start()
        if wait:
            launcher.wait_ready(timeout=30)
        return launcher


@pytest.fixture
def namespaces(run_root):
    factory = NamespaceFactory(run_root)
    yield factory
    for launcher in factory.launchers:
        launcher.stop()
    survivors = [p.pid for launcher in factory.launchers for p in launcher.procs
                 if p.poll() is None]
    leaks = {n.namespace: n.owned_shm() for n in factory.created}
    for n in factory.created:
        sweep_namespace(n)
    assert not survivors, f"daemon processes survived teardown: {survivors}"
    assert not any(leaks.values()), f"shm objects left behind: {leaks}"
    for n in factory.created:
        assert not Path(n.run_dir).exists(), f"run dir left behind: {n.run_dir}"


SMALL_LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"


class RawPeer:
    """A bare DEALER to one rank, for requests a TransferClient would never send:
    one request at a time, its reply."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, frames, timeout_s: float = 10.0) -> Reply:
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(timeout_s * 1000)), "daemon did not answer"
        return decode_reply(self.sock.recv_multipart()[0])

    def close(self):
        self.sock.close()
        self.ctx.term()


def wait_for_state(launcher: Launcher, state, timeout: float = 20.0) -> None:
    """Wait until every rank of ``launcher`` publishes ``state``."""
    from kvswap.client.signals import poll_until

    seg = launcher.seg
    ok = poll_until(lambda: True if all(seg.state_of(r) == state
                                        for r in range(launcher.cfg.tp)) else None,
                    time.monotonic() + timeout)
    assert ok, f"ranks never reached {state.name}: {launcher.progress()}"


def wait_for_namespace_state(names: Names, tp: int, state, timeout: float = 30.0) -> None:
    """Wait until a namespace launched elsewhere (e.g. by a `kvswap launch` subprocess)
    exists and every rank publishes ``state``."""
    from kvswap.client.errors import NamespaceError
    from kvswap.client.signals import SignalSegment, poll_until

    def check():
        try:
            seg = SignalSegment.attach(names, readonly=True)
        except NamespaceError:
            return None
        try:
            return True if all(seg.state_of(r) == state for r in range(tp)) else None
        finally:
            seg.close()

    assert poll_until(check, time.monotonic() + timeout), f"ranks never reached {state.name}"


class SessionRedis(RedisServer):
    """The session's redis-server; ``start_another`` runs a second, independent one (for
    a test that kills its server without disturbing the shared one)."""

    def __init__(self, binary: str):
        super().__init__(binary)
        self._another: RedisServer | None = None

    def start_another(self) -> str:
        """Start a second server (replacing a previous one); return its URL."""
        self.stop_another()
        self._another = RedisServer(self.binary)
        self._another.start()
        return self._another.url

    def stop_another(self) -> None:
        if self._another is not None:
            self._another.close()
            self._another = None

    def close(self) -> None:
        self.stop_another()
        super().close()


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server for the session; skips when the binary is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH (.ci/run installs it: apt-get install "
                    "redis-server)")
    pytest.importorskip("redis", reason="the redis package is missing (pip install "
                        "'kvswap[test]')")
    server = SessionRedis(binary)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The URL of the session's Redis, running (restarted if a test stopped it) and empty."""
    if not redis_server.running:
        redis_server.start()
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture
def mooncake_master():
    """A fresh mooncake_master for the test, stopped (and its directory removed) after it;
    skips when kvswap[mooncake] is not installed."""
    pytest.importorskip("mooncake.store", reason="kvswap[mooncake] is not installed (pip "
                        "install 'kvswap[mooncake]')")
    binary = find_master()
    if binary is None:
        pytest.skip("mooncake_master is not installed (pip install 'kvswap[mooncake]')")
    master = MooncakeMaster(binary)
    try:
        master.start()
        yield master
    finally:
        master.close()


class DeviceTags:
    """Which content tag each device block holds, written into and compared against
    every rank's demo caches (``kvswap.daemon.demo.pattern`` of rank, tensor and tag)."""

    def __init__(self, names: Names, tp: int, tensors: list, host_blocks: int):
        self.tensors = tensors
        self.views = [RankView(names, r, tensors, host_blocks) for r in range(tp)]

    def fill(self, blocks, tags) -> None:
        for rank, view in enumerate(self.views):
            for ti, t in enumerate(self.tensors):
                view.device[ti][blocks] = pattern(rank, ti, np.asarray(tags),
                                                  t.bytes_per_block // 8)

    def has(self, blocks, tags) -> bool:
        return all(np.array_equal(view.device[ti][blocks],
                                  pattern(rank, ti, np.asarray(tags), t.bytes_per_block // 8))
                   for rank, view in enumerate(self.views) for ti, t in enumerate(self.tensors))

    def close(self) -> None:
        for v in self.views:
            v.close()
