"""Fault injection on the host backend: crashes under load, silent daemons, dead
engines and launchers, pause/resume, clear/restore."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvswap.client import (
    CacheTensor,
    CacheWorker,
    ErrorCode,
    NamespaceError,
    TransferClient,
    TransferFailed,
)
from kvswap.client.layout import TensorDesc, demo_layout
from kvswap.client.naming import Names
from kvswap.client.signals import (
    HeaderSlot,
    KvCacheStatus,
    RankSlot,
    RankState,
    SignalSegment,
    now_ns,
    pid_alive,
    poll_until,
)
from kvswap.daemon.config import LaunchConfig
from kvswap.daemon.demo import RankView, pattern
from kvswap.daemon.launcher import Launcher, sweep_namespace
from kvswap.daemon.supervisor import ProcState, Supervisor, SupervisorConfig

from conftest import wait_for_namespace_state, wait_for_state

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=64"
HOST = 64


def _until(pred, timeout=30.0, what="condition"):
    ok = poll_until(lambda: True if pred() else None, time.monotonic() + timeout)
    assert ok, f"timed out waiting for {what}"


class Supervising:
    """Runs launcher.supervise_once() on a thread, as `kvswap launch` does."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.stop = threading.Event()
        self.reasons: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.05):
            end = self.launcher.supervise_once()
            if end is not None:
                self.reasons.append(end.why)
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def _client(launcher, **kw):
    c = TransferClient(launcher.names.namespace, launcher.cfg.tp,
                       run_root=str(launcher.names.run_root), **kw)
    c.wait_ready(20)
    return c


def test_kill_9_under_load_loses_nothing(namespaces):
    """Four threads run evicts and loads on disjoint blocks while daemons are killed
    with SIGKILL at random points; every task completes (re-sent after the restart)
    and every device and host block ends as the sequential model says.

    The workers run at most 40 tasks past the point of the next kill: they keep the
    daemons loaded while it happens, but cannot finish all their work before the
    four kills, however slowly this thread is scheduled."""
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
    views = [RankView(launcher.names, r, tensors, HOST) for r in range(2)]
    dev_tag = np.arange(1, 65)
    host_tag = np.zeros(HOST, dtype=np.int64)
    for rank, view in enumerate(views):
        for ti, t in enumerate(tensors):
            view.device[ti][:] = pattern(rank, ti, dev_tag, t.bytes_per_block // 8)
    client = _client(launcher, task_timeout=60)
    done = [0]
    allowed = [0]  # tasks that may complete before the next kill (gate)
    gate = threading.Condition()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        rng = random.Random(i)
        dev_slice, host_slice = list(range(16 * i, 16 * i + 16)), list(range(16 * i, 16 * i + 16))
        try:
            for _ in range(120):
                with gate:
                    if not gate.wait_for(lambda: done[0] < allowed[0], 60):
                        raise TimeoutError(f"gate shut at {allowed[0]} tasks for 60 s")
                k = rng.randint(1, 4)
                dev, host = rng.sample(dev_slice, k), rng.sample(host_slice, k)
                if rng.random() < 0.5:
                    client.evict(dev, host).result(60)
                    host_tag[host] = dev_tag[dev]
                else:
                    client.load(host, dev).result(60)
                    dev_tag[dev] = host_tag[host]
                done[0] += 1
        except BaseException as exc:
            errors.append(exc)

    crashes = 0
    rng = random.Random(7)
    try:
        with Supervising(launcher) as sup:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for _ in range(4):
                target = done[0] + rng.randint(10, 40)
                with gate:
                    allowed[0] = target + 40
                    gate.notify_all()
                _until(lambda: done[0] >= target or errors, 60, "workload progress")
                assert not errors, errors
                rank = rng.randrange(2)
                epoch = int(launcher.seg.ranks[rank, RankSlot.EPOCH])
                os.kill(launcher.procs[rank].pid, signal.SIGKILL)
                crashes += 1
                _until(lambda: int(launcher.seg.ranks[rank, RankSlot.EPOCH]) > epoch
                       and launcher.seg.state_of(rank) == RankState.READY, 30, "restart")
            with gate:
                allowed[0] = 480
                gate.notify_all()
            for t in threads:
                t.join(120)
            assert not sup.reasons
        assert not errors, errors
        assert done[0] == 480 and crashes == 4
        for rank, view in enumerate(views):
            for ti, t in enumerate(tensors):
                w = t.bytes_per_block // 8
                assert np.array_equal(view.device[ti], pattern(rank, ti, dev_tag, w))
                assert np.array_equal(view.host[ti], pattern(rank, ti, host_tag, w))
        assert launcher.supervisor.restarts == crashes
        print(f"\ncrashes injected {crashes}, tasks {done[0]}, re-sent {client.retried}, "
              f"blocks verified {2 * len(tensors) * (64 + HOST)}")
    finally:
        client.close()
        for v in views:
            v.close()


# Silent for 3 s = stale: 30 missed heartbeats, so a loaded machine that delays a live
# daemon's beats (a successor starting up among them) does not make a second restart.
SILENT = SupervisorConfig(stale_after_s=3.0, backoff_s=0.05)


def test_silent_daemon_is_replaced_and_every_inflight_task_is_resent_in_order(namespaces):
    """Tasks the silent daemon never answered, overlapping ones included, are re-sent
    to its successor in their first-send order (protocol 1.4: marked ``re``)."""
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST, supervision=SILENT)
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
    view = RankView(launcher.names, 0, tensors, HOST)
    for ti, t in enumerate(tensors):
        view.device[ti][:] = pattern(0, ti, np.arange(1, 65), t.bytes_per_block // 8)
    client = _client(launcher, task_timeout=30)
    try:
        with Supervising(launcher):
            os.kill(launcher.procs[0].pid, signal.SIGSTOP)  # silent, not dead
            a = client.evict([1, 2], [1, 2])
            b = client.load([2], [5])  # overlaps a (host block 2): must run after it
            c = client.evict([9], [9])  # independent
            assert all(f.result(30).replies[0].ok for f in (a, b, c))
        assert int(launcher.seg.ranks[0, RankSlot.EPOCH]) == 2
        assert client.retried == 3
        for ti in range(len(tensors)):  # b loaded what a evicted: device block 5 = block 2
            assert np.array_equal(view.device[ti][5], view.device[ti][2])
        assert client.evict([3], [3]).result(10).replies[0].ok
    finally:
        client.close()
        view.close()


def test_batch_in_flight_at_a_restart_is_resent_whole(namespaces):
    from kvswap.client import TransferSpec
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST, supervision=SILENT)
    client = _client(launcher, task_timeout=30)
    try:
        with Supervising(launcher):
            os.kill(launcher.procs[0].pid, signal.SIGSTOP)  # the batch is never answered
            futs = client.submit_batch([TransferSpec.evict([1], [1]), TransferSpec.evict([2], [2]),
                                        TransferSpec.load([3], [4])])
            results = [f.result(30) for f in futs]  # re-sent inside the batch after restart
        assert all(r.replies[0].ok for r in results)
        assert int(launcher.seg.ranks[0, RankSlot.EPOCH]) == 2
        assert client.retried == 1  # the batch message, once
    finally:
        client.close()


def test_a_rank_killed_after_it_served_is_restarted_even_before_the_launch_saw_ready(namespaces):
    """Every rank was READY (one had served clients) when rank 0 was killed, before
    the launch's wait for READY looked again: it reported "exited with status -9
    before READY" and tore the namespace down.  A rank that served is the
    supervisor's to restart; the wait returns and rank 0 comes back."""
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST, wait=False,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    seg = launcher.seg
    _until(lambda: all(seg.state_of(r) is RankState.READY for r in range(2)), 30, "READY")
    os.kill(launcher.procs[0].pid, signal.SIGKILL)
    launcher.procs[0].wait(10)
    launcher.wait_ready(10)  # no NotReady: rank 0 had served
    with Supervising(launcher) as sup:
        _until(lambda: int(seg.ranks[0, RankSlot.EPOCH]) == 2
               and seg.state_of(0) is RankState.READY, 30, "rank 0's restart")
        assert sup.reasons == []


def test_rank_is_fatal_after_retry_limit(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST,
                                 supervision=SupervisorConfig(max_retries=0))
    os.kill(launcher.procs[0].pid, signal.SIGKILL)
    launcher.procs[0].wait(10)
    end = launcher.supervise_once()
    assert end.failed and "rank 0 is FATAL" in end.why and "rank0.log" in end.why
    assert launcher.supervisor.ranks[0].state is ProcState.FATAL


def test_restarted_daemon_reattaches_worker_caches_without_the_worker(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False, host_blocks=8,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    wait_for_state(launcher, RankState.ATTACHING)
    names = launcher.names
    with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as w:
        k = w.alloc_host_tensor("k0", (8, 32), "uint8")
        k[:] = np.arange(8, dtype=np.uint8)[:, None]
        w.register([CacheTensor("k0", 0, k)])
        client = _client(launcher)
        try:
            client.evict([3], [5]).result(10)
            with Supervising(launcher):
                os.kill(launcher.procs[0].pid, signal.SIGKILL)
                _until(lambda: int(launcher.seg.ranks[0, RankSlot.EPOCH]) == 2
                       and launcher.seg.state_of(0) == RankState.READY, 30, "restart")
            client.load([5], [0]).result(10)  # host block 5 survived the crash
            assert (k[0] == 3).all()
        finally:
            client.close()


# ------------------------------------------------------------------ engine and launcher death

def _engine(ns, root, registered, tp):
    with CacheWorker(ns, 0, run_root=root, heartbeat_interval_s=0.1) as w:
        arr = w.alloc_host_tensor("k0", (8, 64), "uint8")
        w.register([CacheTensor("k0", 0, arr)])
        registered.set()
        threading.Event().wait(120)  # killed by the test


def test_dead_engine_tears_down_everything(run_root):
    names = Names.of(f"eng{os.getpid()}", run_root)
    launch = subprocess.Popen([sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace",
                               names.namespace, "--run-root", run_root, "--tp", "1", "--host-blocks", "8",
                               "--engine-timeout", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = mp.get_context("fork")
    registered = ctx.Event()
    engine = None
    try:
        wait_for_namespace_state(names, 1, RankState.ATTACHING)
        engine = ctx.Process(target=_engine, args=(names.namespace, run_root, registered, 1))
        engine.start()
        assert registered.wait(30)
        os.kill(engine.pid, signal.SIGKILL)
        engine.join(10)
        t0 = time.monotonic()
        assert launch.wait(timeout=30) == 1
        assert time.monotonic() - t0 < 15
        err = launch.stderr.read()
        assert "engine stopped beating" in err
        assert names.owned_shm() == []  # the dead worker's tensors were swept too
        assert not names.run_dir.exists()
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        if engine is not None and engine.is_alive():
            engine.kill()
        sweep_namespace(names)


def _launch_ready(names: Names, tp: int, orphan_timeout: str) -> subprocess.Popen:
    """`kvswap launch` of ``names`` as a process of its own (a test may kill it),
    returned once it printed READY."""
    launch = subprocess.Popen([sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace",
                               names.namespace, "--run-root", str(names.run_root), "--tp",
                               str(tp), "--demo-caches", LAYOUT, "--host-blocks", "8",
                               "--orphan-timeout", orphan_timeout],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert launch.stdout is not None
    for line in launch.stdout:  # progress lines, then "... READY on N rank(s)"
        if "READY on" in line:
            return launch
    launch.wait(10)
    pytest.fail("kvswap launch exited before READY")


def test_a_client_shutdown_ends_the_supervised_namespace_without_a_restart(run_root, tmp_path):
    """A client's ``shutdown()`` stops every daemon cleanly (pools and journals
    unlinked).  The supervisor used to restart them as if they had crashed, with
    empty pools, so the namespace never ended.  Now `kvswap launch` sees ranks that
    stopped on request, tears the namespace down and exits 0, restarting nothing."""
    names = Names.of(f"shut{os.getpid()}", run_root)
    err_path = tmp_path / "launch.err"
    with open(err_path, "w") as err:
        launch = subprocess.Popen(
            [sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace", names.namespace,
             "--run-root", run_root, "--tp", "2", "--demo-caches", LAYOUT, "--host-blocks", "8"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert launch.stdout is not None
        assert any("READY on" in line for line in launch.stdout)
        client = TransferClient(names.namespace, 2, run_root=run_root)
        try:
            client.wait_ready(20)
            assert all(r.ok for r in client.shutdown().result(20).replies.values())
        finally:
            client.close()
        assert launch.wait(timeout=30) == 0
        text = err_path.read_text()
        assert "stopped on request" in text and "restarting" not in text
        assert names.owned_shm() == [] and not names.run_dir.exists()
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        sweep_namespace(names)


class _FakeSeg:
    """The slots the supervisor reads, settable by a test."""

    def __init__(self, pid: int):
        self.ranks = np.zeros((1, max(RankSlot) + 1), dtype=np.int64)
        self.ranks[0, RankSlot.PID] = pid
        self.state = RankState.READY

    def state_of(self, r: int) -> RankState:
        return self.state

    def heartbeat_age_s(self, r: int) -> float:
        return 0.0


class _FakeProc:
    def __init__(self, pid: int):
        self.pid, self.rc, self.killed = pid, None, False

    def poll(self):
        return self.rc

    def kill(self):
        self.killed, self.rc = True, -9

    def wait(self, timeout=None):
        return self.rc


@pytest.mark.parametrize("case", ["failed_in_stop", "nonzero_after_stop", "failed", "crashed"])
def test_a_rank_is_restarted_unless_its_stop_was_asked_for(case):
    """A rank that published STOPPING may go FAILED on the way (a fence at its cap):
    it is left to end its stop, and its exit 0 is a stop on request, not restarted
    (it used to be killed and respawned).  FAILED without a stop begun, or any exit
    but 0, STOPPING or not (a crashed I/O loop stops with 1, a stop that did not
    drain ends with 3), is a failure: restarted."""
    proc = _FakeProc(4242)
    seg = _FakeSeg(proc.pid)
    spawned: list[int] = []
    sup = Supervisor(seg, [proc], lambda r: spawned.append(r) or _FakeProc(4243),
                     SupervisorConfig(backoff_s=0.0))
    sup.step()
    assert sup.ranks[0].state is ProcState.RUNNING
    if case in ("failed_in_stop", "nonzero_after_stop"):
        seg.state = RankState.STOPPING
        sup.step()
    if case in ("failed_in_stop", "failed"):
        seg.state = RankState.FAILED
        sup.step()
        assert proc.killed is (case == "failed")
    if not proc.killed:
        proc.rc = 0 if case == "failed_in_stop" else 3
    sup.step()
    sup.step()
    stopped = case == "failed_in_stop"
    assert sup.ranks[0].state is (ProcState.STOPPED if stopped else ProcState.STARTING)
    assert spawned == ([] if stopped else [0])
    assert sup.stopped() == ([sup.ranks[0]] if stopped else [])


def test_orphaned_daemons_exit_cleanly(run_root):
    names = Names.of(f"orph{os.getpid()}", run_root)
    launch = None
    try:
        launch = _launch_ready(names, 2, "1")
        seg = SignalSegment.attach(names, readonly=True)
        pids = [int(seg.ranks[r, RankSlot.PID]) for r in range(2)]
        os.kill(launch.pid, signal.SIGKILL)
        launch.wait(10)
        _until(lambda: all(seg.state_of(r) == RankState.STOPPED for r in range(2)), 20,
               "orphans to stop")
        seg.close()
        for pid in pids:
            _until(lambda: not os.path.exists(f"/proc/{pid}") or
                   open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] == "Z",
                   10, f"pid {pid} to exit")
        for r in range(2):
            log = (names.run_dir / f"rank{r}.log").read_text()
            assert log.count("orphaned: launcher pid") == 1
        # what the daemons owned is gone; only the dead launcher's objects remain
        left = names.owned_shm()
        assert not [e for e in left if ".swap." in e or ".dev." in e]
    finally:
        if launch is not None and launch.poll() is None:
            launch.kill()
        sweep_namespace(names)


def test_a_relaunch_while_a_dead_launchers_daemons_still_run_is_refused(run_root):
    """The launcher dies while an engine still beats, so its daemons keep serving.
    A new launch of the namespace must not sweep it and start beside them (once
    stopped, they would unlink the new incarnation's segments, which reuse their
    names): it is refused, naming their pids, and changes nothing."""
    names = Names.of(f"relaunch{os.getpid()}", run_root)
    launch, pid, seg = None, None, None
    try:
        launch = _launch_ready(names, 1, "120")
        seg = SignalSegment.attach(names)
        seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS] = now_ns()  # an engine that still beats
        pid = int(seg.ranks[0, RankSlot.PID])
        os.kill(launch.pid, signal.SIGKILL)
        launch.wait(10)
        before = sorted(names.owned_shm())
        again = Launcher(LaunchConfig(namespace=names.namespace, tp=1, run_root=run_root,
                                      demo_caches=LAYOUT, host_blocks=8))
        with pytest.raises(NamespaceError) as ei:
            again.start()
        assert f"rank 0 pid {pid}" in str(ei.value) and "launcher" in str(ei.value)
        assert sorted(names.owned_shm()) == before  # nothing swept
        assert pid_alive(pid) and seg.state_of(0) == RankState.READY
    finally:
        if seg is not None:
            seg.close()
        if launch is not None and launch.poll() is None:
            launch.kill()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            _until(lambda: not pid_alive(pid), 20, f"pid {pid} to exit")
        sweep_namespace(names)


def test_a_daemon_stopped_while_it_attaches_exits_cleanly(namespaces):
    """A stop that began while the control thread attached (here its own demo caches
    and a 1 GiB pool) found no scheduler to stop; the attachment published next
    started workers that nothing ended, and the daemon waited for them in STOPPING
    until the launcher's SIGKILL.  Now it stops them and exits 0."""
    launcher = namespaces.launch(tp=1, demo_caches="layers=8,block_tokens=16,heads=1,"
                                 "head_dim=128,dtype=float16,blocks=64", host_blocks=16384,
                                 wait=False)
    slots = launcher.seg.ranks

    def populating() -> bool | None:
        # the control thread states the pool's size as the attach begins, then reports
        # it populated 256 MiB at a time: between the two, the attach runs.  (The ring
        # files appear before the attach begins: a stop then skips the attach.)
        total = int(slots[0, RankSlot.SWAP_BYTES_TOTAL])
        return True if 0 < total and int(slots[0, RankSlot.SWAP_BYTES_PINNED]) < total else None

    assert poll_until(populating, time.monotonic() + 30, max_sleep=0.001)
    daemon = launcher.procs[0]
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(20) == 0
    log = launcher.names.log_path(0, launcher.log_dir).read_text()
    # the stop came first, so this exercised the stop-during-attach path
    assert log.index("stopping: signal SIGTERM") < log.index("attached 16 tensors")


# ------------------------------------------------------------------ pause / clear / restore

def test_pause_drains_then_refuses_and_resume_reverses(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST)
    with _client(launcher) as client:
        inflight = [client.evict([i], [i]) for i in range(20)]
        client.pause().result(20)
        assert all(f.done() for f in inflight)  # drained before the pause answered
        assert all(launcher.seg.state_of(r) == RankState.PAUSED for r in range(2))
        with pytest.raises(TransferFailed) as ei:
            client.evict([30], [30]).result(10)
        assert {f.code for f in ei.value.failures} == {ErrorCode.PAUSED}
        client.resume().result(10)
        assert client.evict([30], [30]).result(10)


def _worker_cycle(ns, root, rank, q_in, q_out):
    """Register, then on each command re-register (after a restore)."""
    with CacheWorker(ns, rank, run_root=root) as w:
        arr = w.alloc_host_tensor("k0", (16, 64), "uint8")
        arr[:] = (np.arange(16, dtype=np.uint8) + 10 * rank)[:, None]
        w.register([CacheTensor("k0", 0, arr)])
        q_out.put("registered")
        while (cmd := q_in.get(timeout=60)) != "exit":
            if cmd == "wipe":
                arr[:] = 0
            elif cmd == "register":
                w.register([CacheTensor("k0", 0, arr)])
            elif cmd == "check":
                q_out.put(arr[:, 0].tolist())
                continue
            q_out.put("ok")


@pytest.mark.parametrize("free_host", [False, True])
def test_clear_and_restore_for_a_weight_update(namespaces, free_host):
    launcher = namespaces.launch(tp=2, demo_caches=None, wait=False, host_blocks=16)
    wait_for_state(launcher, RankState.ATTACHING)
    names = launcher.names
    ctx = mp.get_context("fork")
    qs = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    workers = [ctx.Process(target=_worker_cycle, args=(names.namespace, str(names.run_root), r,
                                                       *qs[r])) for r in range(2)]
    for w in workers:
        w.start()
    try:
        for _, out in qs:
            assert out.get(timeout=30) == "registered"
        client = _client(launcher)
        try:
            client.evict([1, 2], [7, 8]).result(10)
            client.clear_caches(free_host=free_host).result(30)
            assert all(launcher.seg.state_of(r) == RankState.CLEARED for r in range(2))
            assert int(launcher.seg.header[HeaderSlot.KVCACHE_STATUS]) == KvCacheStatus.CLEARED
            assert all(int(launcher.seg.ranks[r, RankSlot.CACHE_READY]) == 0 for r in range(2))
            with pytest.raises(TransferFailed) as ei:
                client.load([7], [3]).result(10)
            assert {f.code for f in ei.value.failures} == {ErrorCode.CLEARED}
            client.restore_caches().result(10)
            for q_in, out in qs:  # the engine's new weights; then re-register
                q_in.put("wipe")
                assert out.get(timeout=10) == "ok"
                q_in.put("register")
                assert out.get(timeout=30) == "ok"
            client.wait_ready(20)
            assert int(launcher.seg.header[HeaderSlot.KVCACHE_STATUS]) == KvCacheStatus.NORMAL
            client.load([7, 8], [3, 4]).result(10)
            for r, (q_in, out) in enumerate(qs):
                q_in.put("check")
                col = out.get(timeout=10)
                expected = [0, 0] if free_host else [1 + 10 * r, 2 + 10 * r]
                assert col[3:5] == expected, (r, col)
        finally:
            client.close()
    finally:
        for q_in, _ in qs:
            q_in.put("exit")
        for w in workers:
            w.join(20)
            if w.is_alive():
                w.kill()


def test_ready_is_published_after_the_cache_status(namespaces):
    """After a restore, a client that sees every rank READY must also see the
    namespace's KvCacheStatus NORMAL (rank 0 used to publish READY first).  A reader
    spinning on the segment catches the order of the two writes on each cycle."""
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST)
    seg = launcher.seg
    with _client(launcher) as client:
        for cycle in range(5):
            client.clear_caches().result(30)
            restored = client.restore_caches()
            deadline = time.monotonic() + 20
            while seg.state_of(0) != RankState.READY:  # no sleep: the window is microseconds
                assert time.monotonic() < deadline, "rank 0 did not become READY again"
            status = KvCacheStatus(int(seg.header[HeaderSlot.KVCACHE_STATUS]))
            assert status == KvCacheStatus.NORMAL, f"cycle {cycle}: READY while {status.name}"
            assert restored.result(10).replies[0].ok


# ------------------------------------------------------------------ restarts in a namespace's mode

SETTLING = (RankState.ABSENT, RankState.STARTING, RankState.ATTACHING)


def _kill_and_wait_respawn(launcher, rank: int) -> None:
    """SIGKILL ``rank``'s daemon (under supervision) and wait for its successor to settle."""
    seg = launcher.seg
    epoch = int(seg.ranks[rank, RankSlot.EPOCH])
    launcher.procs[rank].kill()
    _until(lambda: int(seg.ranks[rank, RankSlot.EPOCH]) == epoch + 1
           and seg.state_of(rank) not in SETTLING, 30, f"rank {rank}'s respawn to settle")


def _bare_client(launcher) -> TransferClient:
    """A client that knows the ranks' current epochs (no wait_ready: not every rank is
    READY)."""
    return TransferClient(launcher.names.namespace, launcher.cfg.tp,
                          run_root=str(launcher.names.run_root), task_timeout=20)


def test_a_rank_restarted_while_paused_comes_back_paused(namespaces):
    """Both ranks PAUSED, rank 1 killed: its successor used to come back READY, so an
    evict sent during the pause was refused by rank 0 only and ran on rank 1.  It
    comes back PAUSED (its predecessor's state, read from the signal segment before
    it is overwritten): the evict is refused PAUSED by both ranks and changes nothing,
    and a resume brings both back, sent by the client that was open across the
    restart (it holds a restarted rank's traffic until the rank serves, and a PAUSED
    rank serves: waiting for READY held the resume that would end the pause)."""
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    seg = launcher.seg
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
    views = [RankView(launcher.names, r, tensors, HOST) for r in range(2)]
    try:
        for rank, view in enumerate(views):
            for ti, t in enumerate(tensors):
                view.device[ti][:] = pattern(rank, ti, np.arange(1, 65), t.bytes_per_block // 8)
        with _client(launcher) as client:  # open across the restart: it holds rank 1's
            client.pause().result(20)     # traffic until the rank serves (PAUSED counts)
            with Supervising(launcher) as sup:
                _kill_and_wait_respawn(launcher, 1)
                assert sup.reasons == []
            assert [seg.state_of(r) for r in range(2)] == [RankState.PAUSED] * 2
            with pytest.raises(TransferFailed) as ei:
                client.evict([1, 2], [5, 6]).result(20)
            assert [(f.rank, f.code) for f in ei.value.failures] == [
                (0, ErrorCode.PAUSED), (1, ErrorCode.PAUSED)]
            for view in views:  # the evict ran nowhere
                assert not any(view.host[ti][5:7].any() for ti in range(len(tensors)))
            client.resume().result(10)
            assert [seg.state_of(r) for r in range(2)] == [RankState.READY] * 2
            client.evict([1, 2], [5, 6]).result(20)
        for rank, view in enumerate(views):
            for ti, t in enumerate(tensors):
                assert np.array_equal(view.host[ti][5], view.device[ti][1])
    finally:
        for view in views:
            view.close()


def _register_all(workers, arrays):
    for w, arr in zip(workers, arrays):
        assert w.register([CacheTensor("k0", 0, arr)], timeout=30).ok


@pytest.mark.parametrize("caches", ["demo", "workers"])
def test_a_rank_restarted_while_cleared_comes_back_cleared(namespaces, caches):
    """Both ranks CLEARED (a weight update), rank 1 killed.  Its successor used to come
    back READY with its old demo caches (then restore failed NOT_READY on it and left
    rank 0 ATTACHING), or ATTACHING without its worker's (then restore waited for a
    rank that could not take it).  It comes back CLEARED, attaching nothing; restore,
    re-register and wait_ready complete, and the host pool kept by the clear survived
    the restart."""
    demo = caches == "demo"
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT if demo else None, host_blocks=HOST,
                                 wait=demo, supervision=SupervisorConfig(backoff_s=0.05))
    seg, names = launcher.seg, launcher.names
    workers, arrays, views = [], [], []
    try:
        if demo:
            tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
            views = [RankView(names, r, tensors, HOST) for r in range(2)]
            arrays = [view.device[0] for view in views]
        else:
            for r in range(2):
                w = CacheWorker(names.namespace, r, run_root=str(names.run_root))
                workers.append(w)
                arrays.append(w.alloc_host_tensor("k0", (16, 64), "uint8"))
        for r, arr in enumerate(arrays):
            arr[:] = 0
            arr[1] = 100 + r
        if not demo:
            _register_all(workers, arrays)
        with _client(launcher) as client:
            client.evict([1], [5]).result(20)
            client.clear_caches(free_host=False).result(30)
        with Supervising(launcher) as sup:
            _kill_and_wait_respawn(launcher, 1)
            assert [seg.state_of(r) for r in range(2)] == [RankState.CLEARED] * 2
            assert int(seg.ranks[1, RankSlot.CACHE_READY]) == 0
            with _bare_client(launcher) as client:
                client.restore_caches().result(10)
                if not demo:
                    _register_all(workers, arrays)
                client.wait_ready(20)
                assert int(seg.header[HeaderSlot.KVCACHE_STATUS]) == KvCacheStatus.NORMAL
                client.load([5], [9]).result(20)
            assert sup.reasons == []
        assert int(seg.ranks[1, RankSlot.EPOCH]) == 2
        for r, arr in enumerate(arrays):  # host block 5 kept device block 1's bytes
            assert (arr[9] == 100 + r).all(), (r, arr[9][:4])
    finally:
        for view in views:
            view.close()
        for w in workers:
            w.close()


def test_a_clear_whose_rank_died_in_it_is_answered_once_every_rank_cleared(namespaces,
                                                                          monkeypatch):
    """clear_caches(free_host=True), and one rank is SIGKILLed inside it (crash point
    ``clear.drained``: drained, nothing released).  Its successor comes back CLEARED and
    the client re-sends the clear, which used to be refused NOT_READY ("clear needs
    READY or PAUSED"): a clear every rank carried out failed, and clearing again was
    refused the same way.  It is answered OK on every rank, and the pool the dead rank
    left in shm is freed as asked.  A clear that is not a re-send is still refused by a
    CLEARED rank, and the namespace restores and serves."""
    from conftest import RawPeer
    from kvswap.client.errors import ErrorCode
    from kvswap.client.protocol import Op, encode_request

    monkeypatch.setenv("KVSWAP_CRASH_AT", "clear.drained:1")
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    monkeypatch.delenv("KVSWAP_CRASH_AT")
    seg, names = launcher.seg, launcher.names
    pools = [f"/dev/shm/{names.swap_segment(r).lstrip('/')}" for r in range(2)]
    assert all(os.path.exists(p) for p in pools)
    with Supervising(launcher) as sup:
        with _client(launcher) as client:
            done = client.clear_caches(free_host=True).result(60)
            assert [done.replies[r].code for r in range(2)] == [ErrorCode.OK] * 2, done.replies
            assert client.retried == 1
        dead = [r for r in range(2) if int(seg.ranks[r, RankSlot.EPOCH]) == 2]
        assert len(dead) == 1 and (names.run_dir / "crashed-at-clear.drained").exists()
        assert [seg.state_of(r) for r in range(2)] == [RankState.CLEARED] * 2
        assert int(seg.header[HeaderSlot.KVCACHE_STATUS]) == KvCacheStatus.CLEARED
        assert not any(os.path.exists(p) for p in pools), "a pool survived free_host=True"
        peer = RawPeer(names.endpoint(dead[0]))
        try:
            again = peer.ask(encode_request(Op.CLEAR, 1, {"free_host": True}))
            assert again.code == ErrorCode.NOT_READY and "clear needs READY" in again.message
        finally:
            peer.close()
        with _bare_client(launcher) as client:
            client.restore_caches().result(10)
            client.wait_ready(20)
            client.evict([1], [1]).result(20)
        assert sup.reasons == []
    assert launcher.supervisor.restarts == 1


def test_a_rank_that_died_in_a_clear_leaves_no_register_file_behind(namespaces, monkeypatch):
    """A rank SIGKILLed inside a clear, before its detach, left its register file (what
    it re-attaches after a crash).  Its successor comes back CLEARED; had it kept the
    file, a second crash after the restore would re-attach the tensors of before the
    weight update.  The successor removes it; the workers register anew and serve."""
    monkeypatch.setenv("KVSWAP_CRASH_AT", "clear.drained:1")
    launcher = namespaces.launch(tp=2, demo_caches=None, host_blocks=HOST, wait=False,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    monkeypatch.delenv("KVSWAP_CRASH_AT")
    names = launcher.names
    workers = [CacheWorker(names.namespace, r, run_root=str(names.run_root)) for r in range(2)]
    try:
        arrays = [w.alloc_host_tensor("k0", (16, 64), "uint8") for w in workers]
        _register_all(workers, arrays)
        files = [names.run_dir / f"rank{r}.register" for r in range(2)]
        assert all(f.exists() for f in files)
        with Supervising(launcher) as sup:
            with _client(launcher) as client:
                client.clear_caches().result(60)
            assert not any(f.exists() for f in files), [f for f in files if f.exists()]
            with _bare_client(launcher) as client:
                client.restore_caches().result(10)
                _register_all(workers, arrays)
                client.wait_ready(20)
                client.evict([1], [1]).result(20)
            assert sup.reasons == []
        assert launcher.supervisor.restarts == 1
    finally:
        for w in workers:
            w.close()


def test_a_failed_rank_is_killed_and_restarted(namespaces, caplog):
    """A rank that goes FAILED while its process lives used to stay FAILED until a
    relaunch: the supervisor restarted only dead or silent daemons.  Here rank 1 alone
    is restored after a clear; it re-attaches and waits in the start-up barrier for
    rank 0, which stays CLEARED, so after --attach-timeout it is FAILED
    BARRIER_TIMEOUT.  The supervisor kills it, says why, and respawns it; the new
    daemon comes back CLEARED like its peer, and a restore brings the namespace
    back."""
    from conftest import RawPeer
    from kvswap.client.protocol import Op, encode_request

    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST,
                                 attach_timeout_s=2.0,
                                 supervision=SupervisorConfig(backoff_s=0.05))
    seg = launcher.seg
    caplog.set_level("WARNING", logger="kvswap.supervisor")
    assert launcher.supervise_once() is None  # the supervisor sees every rank serve
    with Supervising(launcher) as sup:
        with _client(launcher) as client:
            client.clear_caches().result(30)
        peer = RawPeer(launcher.names.endpoint(1))
        try:
            assert peer.ask(encode_request(Op.RESTORE, 1)).ok
        finally:
            peer.close()
        _until(lambda: int(seg.ranks[1, RankSlot.EPOCH]) == 2
               and seg.state_of(1) not in SETTLING, 30, "rank 1's restart")
        assert [seg.state_of(r) for r in range(2)] == [RankState.CLEARED] * 2
        with _bare_client(launcher) as client:
            client.restore_caches().result(10)
            client.wait_ready(20)
            client.evict([1], [1]).result(20)
        assert sup.reasons == []
    assert launcher.supervisor.ranks[1].restarts == 1
    assert "rank 1 (pid" in caplog.text and "is FAILED [501 BARRIER_TIMEOUT]" in caplog.text


def test_a_rank_stalled_through_a_clear_barrier_does_not_split_the_next_one(namespaces):
    """Rank 1 is stopped (SIGSTOP) while a clear runs: rank 0 clears, waits in the clear
    barrier, and gives up when rank 1's heartbeat goes stale.  Rank 0 used to withdraw
    its arrival; then, after the restore, its start-up barrier passed on rank 1's
    late clear-barrier arrival (same count, another barrier), rank 0 went READY with
    rank 1 not re-registered, and rank 1's start-up barrier waited for a rank that
    would never enter it again: FAILED BARRIER_TIMEOUT.

    An arrival now stands for the state its barrier asserts (every rank CLEARED,
    every rank attached) and is never withdrawn; clear barriers have even
    generations, start-up ones odd.  Rank 1's clear passes on rank 0's standing
    arrival (rank 0 is CLEARED), and the start-up barrier after the restore is met
    by both ranks' registers."""
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST,
                                 stale_after_s=3.0, attach_timeout_s=8.0)
    seg = launcher.seg
    log0 = launcher.names.log_path(0, launcher.log_dir)
    daemon1 = launcher.procs[1]
    with _client(launcher) as client:
        daemon1.send_signal(signal.SIGSTOP)
        try:
            cleared = client.clear_caches()
            _until(lambda: "clear barrier" in log0.read_text()
                   and "rank 1 has not beaten" in log0.read_text(), 30, "rank 0 to give up")
        finally:
            daemon1.send_signal(signal.SIGCONT)
        with pytest.raises(TransferFailed) as ei:
            cleared.result(30)
        assert [(f.rank, f.code) for f in ei.value.failures] == [(0, ErrorCode.BARRIER_ABORTED)]
        assert [seg.state_of(r) for r in range(2)] == [RankState.CLEARED] * 2
        client.restore_caches().result(10)
        client.wait_ready(20)
        assert int(seg.header[HeaderSlot.KVCACHE_STATUS]) == KvCacheStatus.NORMAL
        client.evict([1], [1]).result(20)
    assert [int(seg.ranks[r, RankSlot.BARRIER_ARRIVALS]) for r in range(2)] == [3, 3]


def test_a_worker_whose_bookkeeping_raises_fails_the_rank_not_the_worker(namespaces, tmp_path,
                                                                         monkeypatch):
    """A bug while settling a batch (journal, reply; injected through a sitecustomize)
    killed the worker thread: its tasks were never answered and their blocks stayed
    held while the rank looked READY, until every client's deadline.  The rank fails
    instead, naming the cause, and its supervisor restarts it."""
    from test_peer import _with_site

    _with_site(tmp_path, monkeypatch, (
        "import kvswap.daemon.exactly_once as e\n"
        "_settle = e.ExactlyOnce.settle\n"
        "def settle(self, c):\n"
        "    if c.job.op.value == 'evict':\n"
        "        raise RuntimeError('injected settle fault')\n"
        "    return _settle(self, c)\n"
        "e.ExactlyOnce.settle = settle\n"))
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, inline_max_bytes=0)  # a worker
    monkeypatch.delenv("PYTHONPATH")
    with _client(launcher, task_timeout=30) as client:
        client.evict([1], [1])
        wait_for_state(launcher, RankState.FAILED, timeout=10)
    log = launcher.names.log_path(0).read_text()
    assert "settling a batch of 1 evict task(s) failed" in log
    assert "RuntimeError: injected settle fault" in log
