"""Shared fixtures: short run roots, unique namespaces, launched namespaces, leak checks.

Every namespace a test creates is checked after the test: nothing of it may be
left in /dev/shm, and no daemon process may survive.  Whatever is found is
removed anyway, so one failing test cannot cascade into others.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvswap.client.naming import Names
from kvswap.daemon.launcher import LaunchConfig, Launcher, sweep_namespace

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


def wait_for_state(launcher: Launcher, state, timeout: float = 20.0) -> None:
    """Wait until every rank of ``launcher`` publishes ``state``."""
    import time

    from kvswap.client.signals import poll_until

    seg = launcher.seg
    ok = poll_until(lambda: True if all(seg.state_of(r) == state
                                        for r in range(launcher.cfg.tp)) else None,
                    time.monotonic() + timeout)
    assert ok, f"ranks never reached {state.name}: {launcher.progress()}"


def wait_for_namespace_state(names: Names, tp: int, state, timeout: float = 30.0) -> None:
    """Wait until a namespace launched elsewhere (e.g. by a `kvswap launch` subprocess)
    exists and every rank publishes ``state``."""
    import time

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
