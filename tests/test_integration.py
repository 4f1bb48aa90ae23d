"""End to end on the host backend: `kvswap launch`, CacheWorkers in their own
processes, a threaded TransferClient, `kvswap status`, teardown by SIGTERM."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
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
    InvalidTask,
    RankTimeout,
    TransferClient,
    TransferFailed,
)
from kvswap.client.naming import Names
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import RankSlot, RankState
from kvswap.daemon.demo import pattern

from conftest import SMALL_LAYOUT, wait_for_namespace_state, wait_for_state

ctx = mp.get_context("fork")

TP = 2
NUM_BLOCKS = 48
HOST_BLOCKS = 40
# (name, layer, dtype, block shape): bf16-as-uint16 K/V, an fp8 cache with scales
TENSORS = [("k0", 0, "uint16", (4, 2, 16)), ("v0", 0, "uint16", (4, 2, 16)),
           ("k1", 1, "uint8", (4, 2, 16)), ("k1_scale", 1, "float32", (4, 2))]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvswap.daemon.cli", *args]


def _worker_main(ns: str, root: str, rank: int, registered, release) -> None:
    """An engine TP worker: allocate the caches, register them, wait to be released."""
    with CacheWorker(ns, rank, run_root=root) as worker:
        tensors = []
        for i, (name, layer, dtype, shape) in enumerate(TENSORS):
            arr = worker.alloc_host_tensor(name, (NUM_BLOCKS, *shape), dtype)
            words = arr.view(np.uint8).reshape(NUM_BLOCKS, -1).view("<u8")
            words[:] = pattern(rank, i, np.arange(1, NUM_BLOCKS + 1), words.shape[1])
            tensors.append(CacheTensor(name, layer, arr))
        reply = worker.register(tensors, timeout=30)
        registered.put((rank, reply.fields["num_device_blocks"], reply.fields["num_host_blocks"]))
        release.wait(120)


def _block_bytes() -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, _, d, s in TENSORS)


def _run_workload(client: TransferClient, threads: int, tasks_per_thread: int):
    """Random non-contiguous evicts/loads from several threads over disjoint block
    slices; returns the tag model and the per-direction block counts."""
    dev_tag = np.arange(1, NUM_BLOCKS + 1)
    host_tag = np.zeros(HOST_BLOCKS, dtype=np.int64)
    dev_slices = np.array_split(np.arange(NUM_BLOCKS), threads)
    host_slices = np.array_split(np.arange(HOST_BLOCKS), threads)
    counts = {"evict": 0, "load": 0, "evict_blocks": 0, "load_blocks": 0}
    lock = threading.Lock()
    errors = []

    def run(i: int) -> None:
        rng = random.Random(i)
        pending = []
        try:
            for _ in range(tasks_per_thread):
                k = rng.randint(1, 5)
                dev = np.array(rng.sample(list(dev_slices[i]), k))
                host = rng.sample(list(host_slices[i]), k)  # a plain list on purpose
                if rng.random() < 0.5:
                    pending.append(client.evict(dev, host))
                    host_tag[host] = dev_tag[dev]
                    kind = "evict"
                else:
                    pending.append(client.load(host, dev))
                    dev_tag[dev] = host_tag[host]
                    kind = "load"
                with lock:
                    counts[kind] += 1
                    counts[kind + "_blocks"] += k
                if len(pending) > 3:
                    pending.pop(0).result(timeout=30)
            for f in pending:
                f.result(timeout=30)
        except Exception as exc:
            errors.append(exc)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors
    return dev_tag, host_tag, counts


def _verify_rank(names: Names, rank: int, dev_tag, host_tag) -> int:
    from kvswap.daemon.swap_space import SwapLayout
    from kvswap.client.layout import TensorDesc
    descs = [TensorDesc(n, layer, np.dtype(d).str, (NUM_BLOCKS, *s)) for n, layer, d, s in TENSORS]
    layout = SwapLayout.of(descs, HOST_BLOCKS)
    dev_regions = [ShmRegion.attach(names.device_segment(rank, d.name), readonly=True)
                   for d in descs]
    swap = ShmRegion.attach(names.swap_segment(rank), readonly=True)
    checked = 0
    try:
        for i, (d, reg, off) in enumerate(zip(descs, dev_regions, layout.offsets)):
            words = d.bytes_per_block // 8
            dev = reg.array(0, (NUM_BLOCKS, words), "<u8")
            host = swap.array(off, (HOST_BLOCKS, words), "<u8")
            assert np.array_equal(dev, pattern(rank, i, dev_tag, words)), f"rank {rank} {d.name} device"
            assert np.array_equal(host, pattern(rank, i, host_tag, words)), f"rank {rank} {d.name} host"
            checked += NUM_BLOCKS + HOST_BLOCKS
            del dev, host
    finally:
        for r in (*dev_regions, swap):
            r.close()
    return checked


def test_launch_workers_round_trips_status_and_sigterm(namespaces):
    names = namespaces.new()
    ns, root = names.namespace, str(names.run_root)
    launch = subprocess.Popen(_cli("launch", "--namespace", ns, "--run-root", root, "--tp", str(TP),
                                   "--backend", "host", "--host-blocks", str(HOST_BLOCKS)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    registered, release = ctx.Queue(), ctx.Event()
    workers = []
    try:
        wait_for_namespace_state(names, TP, RankState.ATTACHING)
        workers = [ctx.Process(target=_worker_main, args=(ns, root, r, registered, release))
                   for r in range(TP)]
        for w in workers:
            w.start()
        assert sorted(registered.get(timeout=30) for _ in range(TP)) == [
            (r, NUM_BLOCKS, HOST_BLOCKS) for r in range(TP)]

        with TransferClient(ns, TP, run_root=root) as client:
            client.wait_ready(timeout=30)
            dev_tag, host_tag, counts = _run_workload(client, threads=4, tasks_per_thread=40)
        checked = sum(_verify_rank(names, r, dev_tag, host_tag) for r in range(TP))
        assert checked == TP * len(TENSORS) * (NUM_BLOCKS + HOST_BLOCKS)

        out = subprocess.run(_cli("status", "--namespace", ns, "--run-root", root, "--json"),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["namespace"] == ns and len(status["ranks"]) == TP
        assert status["engine_heartbeat_age_s"] is not None
        bb = _block_bytes()
        for r in status["ranks"]:
            assert r["state"] == "READY"
            assert r["completed"] == counts["evict"] + counts["load"]
            assert r["failed"] == 0 and r["inflight"] == 0
            assert r["bytes_evicted"] == counts["evict_blocks"] * bb
            assert r["bytes_loaded"] == counts["load_blocks"] * bb
            assert r["num_device_blocks"] == NUM_BLOCKS and r["num_host_blocks"] == HOST_BLOCKS
        table = subprocess.run(_cli("status", "--namespace", ns, "--run-root", root),
                               capture_output=True, text=True, timeout=30)
        assert table.returncode == 0 and table.stdout.count("READY") == TP
        daemon_pids = [r["pid"] for r in status["ranks"]]

        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=30) == 0
        for pid in daemon_pids:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"daemon {pid} survived"
        assert not names.run_dir.exists()
        assert names.owned_shm() == []
    finally:
        release.set()
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert [w.exitcode for w in workers] == [0] * TP
    assert names.owned_shm() == []  # the workers' close() tolerated the sweep


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_demo_command_passes(run_root):
    out = subprocess.run(_cli("demo", "--tasks", "120", "--run-root", run_root),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert "120 tasks" in line and "0 mismatches, 0 leaks" in line
    assert "verified 12288 blocks" in line  # 2 ranks x 16 tensors x (128 + 256) blocks


def test_second_launch_is_refused_and_first_undisturbed(namespaces):
    first = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT)
    names = first.names
    out = subprocess.run(_cli("launch", "--namespace", names.namespace, "--run-root",
                              str(names.run_root), "--tp", "1", "--demo-caches"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "in use" in out.stderr and str(os.getpid()) in out.stderr
    assert first.seg.state_of(0) == RankState.READY
    with TransferClient(names.namespace, 1, run_root=str(names.run_root)) as client:
        assert client.evict([1], [2]).result(timeout=10).replies[0].ok


def test_launch_timeout_names_rank_and_log(run_root):
    names = Names.of(f"tmo{os.getpid()}", run_root)
    out = subprocess.run(_cli("launch", "--namespace", names.namespace, "--run-root", run_root, "--tp", "2",
                              "--ready-timeout", "1"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    # each rank named with its state (ATTACHING once up; earlier under heavy load) and log
    assert re.search(r"rank 0 \((ABSENT|STARTING|ATTACHING)", out.stderr), out.stderr
    assert re.search(r"rank 1 \((ABSENT|STARTING|ATTACHING)", out.stderr), out.stderr
    assert "not READY after" in out.stderr and "rank0.log" in out.stderr and "rank1.log" in out.stderr
    assert names.owned_shm() == []


def test_launch_failure_names_rank_and_shows_log(run_root):
    """A daemon that cannot start (here: the cuda backend without cupy) is reported by rank."""
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed: the cuda backend would start")
    except ImportError:
        pass
    names = Names.of(f"bad{os.getpid()}", run_root)
    out = subprocess.run(_cli("launch", "--namespace", names.namespace, "--run-root", run_root, "--tp", "1",
                              "--demo-caches", "--host-blocks", "8",
                              "--backend", "cuda"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "rank 0" in out.stderr and "rank0.log" in out.stderr
    assert names.owned_shm() == []


def test_client_validates_before_sending(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    with TransferClient(ns, 2, run_root=root) as client:
        client.wait_ready(5)
        cases = [((0, [1, 2], [3]), ErrorCode.LENGTH_MISMATCH),
                 ((0, [1, 32], [3, 4]), ErrorCode.ID_OUT_OF_RANGE),
                 ((0, [1, 2], [3, 3]), ErrorCode.DUPLICATE_DESTINATION),
                 ((0, [1.0], [3]), ErrorCode.BAD_ID_DTYPE),
                 ((0, [-1], [3]), ErrorCode.ID_OUT_OF_RANGE)]
        for (_, dev, host), code in cases:
            with pytest.raises(InvalidTask) as ei:
                client.evict(dev, host)
            assert ei.value.code == code
        with pytest.raises(InvalidTask):
            client.load([2, 3], [1, 1])  # load: device blocks are the destination
        # none sent
        assert all(int(launcher.seg.ranks[r, RankSlot.COMPLETED]) == 0 for r in range(2))
        assert client.load(np.array([5, 6], np.int64), np.array([7, 9], np.uint32)).result(10)


def test_failures_name_each_rank(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=None, wait=False)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    wait_for_state(launcher, RankState.ATTACHING)
    with TransferClient(ns, 2, run_root=root) as client:
        with pytest.raises(TransferFailed) as ei:
            client.evict([0], [0]).result(timeout=10)
        err = ei.value
        assert [f.rank for f in err.failures] == [0, 1]
        assert all(f.code == ErrorCode.NOT_READY for f in err.failures)
        with pytest.raises(RankTimeout, match="rank 0 is ATTACHING.*rank 1 is ATTACHING"):
            client.wait_ready(timeout=0.3)


def test_stopped_rank_times_out_by_name_then_recovers(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    with TransferClient(ns, 2, run_root=root, task_timeout=1.0) as client:
        victim = launcher.procs[1]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            fut = client.evict([1], [1])
            with pytest.raises(RankTimeout) as ei:
                fut.result()
            assert time.monotonic() - t0 < 10
            assert "by 1 rank(s): rank 1" in str(ei.value)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert client.evict([2], [2]).result(timeout=10).replies[1].ok


def test_cache_worker_rejects_bad_tensors(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    wait_for_state(launcher, RankState.ATTACHING)
    with CacheWorker(ns, 0, run_root=root) as worker:
        a = worker.alloc_host_tensor("k0", (8, 4), "float16")
        b = worker.alloc_host_tensor("v0", (6, 4), "float16")
        with pytest.raises(InvalidTask, match="same number of blocks") as ei:
            worker.register([CacheTensor("k0", 0, a), CacheTensor("v0", 0, b)])
        assert ei.value.code == ErrorCode.BAD_LAYOUT
        with pytest.raises(InvalidTask, match="alloc_host_tensor"):
            worker.register([CacheTensor("x", 0, np.zeros((8, 4), np.float16))])
        with pytest.raises(InvalidTask, match="does not start"):
            worker.register([CacheTensor("k0", 0, a[1:])])
        with pytest.raises(ValueError, match="already allocated"):
            worker.alloc_host_tensor("k0", (8, 4), "float16")
        # nothing was registered: the daemon still waits for a worker
        assert launcher.seg.state_of(0) == RankState.ATTACHING
