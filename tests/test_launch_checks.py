"""Failing fast (#14): what `kvswap launch` refuses before it starts anything, what ends
a launch at once when a daemon fails before READY, sizing the host pool in bytes, the
engine heartbeat of a CacheWorker whose register failed, leftover shm segments."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from conftest import SMALL_LAYOUT, wait_for_namespace_state, wait_for_state

from kvswap.client import CacheTensor, CacheWorker, InvalidTask, KvswapError, TransferClient
from kvswap.client.errors import ErrorCode, NamespaceError
from kvswap.client.layout import TensorDesc
from kvswap.client.monitor import format_table, read_status
from kvswap.client.naming import Names
from kvswap.client.shm_region import SegmentExists, ShmRegion, segment_users
from kvswap.client.signals import HeaderSlot, RankState, pid_alive, poll_until
from kvswap.daemon import swap_space
from kvswap.daemon.cli import LaunchProgress, Outlet
from kvswap.daemon.config import LaunchConfig
from kvswap.daemon.launcher import Launcher, error_lines, shm_needs, sweep_namespace
from kvswap.daemon.logs import LINE, formatter
from kvswap.daemon.storage import check_url
from kvswap.daemon.swap_space import HostMemory, HostSwapSpace, SwapLayout, blocks_that_fit

FAST_S = 10.0  # what "ends the launch at once" must stay under, process start-up included


def _launch(names, *flags: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `kvswap launch` for ``names`` to its end; (result, seconds it took)."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace",
                          names.namespace, "--run-root", str(names.run_root), *flags],
                         capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    return res, time.monotonic() - t0


def _nothing_created(names) -> None:
    assert names.owned_shm() == [] and not names.run_dir.exists()


# ------------------------------------------------------------------ refused before anything starts

@pytest.mark.parametrize("flags, cause, status", [
    (["--storage", "ftp://x/y"],
     ["--storage", "unknown scheme 'ftp'", "file://", "redis://"], 2),
    (["--storage", "file:///tmp/kvs-never?capacity=1G"],
     ["--storage", "unknown option 'capacity'", "capacity_bytes"], 2),
    (["--log-level", "LOUD"], ["--log-level", "'LOUD'", "'DEBUG'"], 2),
    (["--host-blocks", "100000000"],  # 12 TiB per rank with the default layout
     ["needs", "of /dev/shm, which has", "free", "--host-size"], 1),
    (["--host-size", "1K"], ["--host-size", "cannot hold one block", "135168 bytes"], 1),
])
def test_bad_option_ends_launch_at_once_with_its_cause(namespaces, flags, cause, status):
    names = namespaces.new()
    res, took = _launch(names, "--tp", "2", "--demo-caches", *flags)
    assert res.returncode == status, res.stderr
    assert took < FAST_S
    for text in cause:
        assert text in res.stderr, res.stderr
    _nothing_created(names)


def test_oversized_host_size_is_refused_without_a_layout(namespaces):
    # Without --demo-caches the launcher does not know the layout, but it knows the bytes.
    names = namespaces.new()
    free = HostMemory.now().shm_free
    res, took = _launch(names, "--tp", "2", "--host-size", str(free))
    assert res.returncode == 1 and took < FAST_S
    assert "2 rank(s)" in res.stderr and "of /dev/shm, which has" in res.stderr
    _nothing_created(names)


def test_storage_urls_are_checked_without_connecting_or_creating(tmp_path):
    missing = tmp_path / "store"
    check_url(f"file://{missing}?capacity_bytes=1G")
    assert not missing.exists()
    if importlib.util.find_spec("redis") is not None:
        check_url("redis://127.0.0.1:1/0?timeout_s=1")  # nobody listens on port 1
    for url, why in (("ftp://x/y", "unknown scheme"), ("relative/dir", "absolute path"),
                     (f"file://{missing}?fsync=maybe", "fsync")):
        with pytest.raises(ValueError, match=why):
            check_url(url)


# ------------------------------------------------------------------ a daemon fails before READY

def test_daemon_that_exits_before_ready_ends_launch_with_its_error_line(namespaces):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("needs a machine without cupy, where a cuda daemon cannot start")
    names = namespaces.new()
    res, took = _launch(names, "--tp", "2", "--backend", "cuda", "--demo-caches",
                        "--ready-timeout", "600")
    assert res.returncode == 1 and took < FAST_S
    assert "exited with status 2 before READY" in res.stderr
    assert "cannot start: [300 NOT_READY]" in res.stderr and "cupy" in res.stderr
    _nothing_created(names)


def test_launch_passes_rank_warnings_on_and_logs_in_one_format(namespaces):
    """A daemon's warnings reach the launch output as they happen, before READY (here:
    a register of other tensors on rank 0 while rank 1 has not registered), and every log line
    of the launcher and of its ranks has the same timestamp format."""
    names = namespaces.new()
    launch = subprocess.Popen(
        [sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace", names.namespace,
         "--run-root", str(names.run_root), "--tp", "2", "--host-blocks", "8",
         "--log-dir", str(names.run_root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_attaching(names)
        with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as worker:
            worker.register([_tensor(worker, "k0")])
            # the same tensors again would be answered OK (register is idempotent)
            with pytest.raises(KvswapError, match="ALREADY_REGISTERED"):
                worker.register([_tensor(worker, "k1")])
            # in the log before the launcher is stopped, so it passes the line on
            assert poll_until(lambda: True if (names.run_root / "rank0.log").read_text().count(
                "rejected register") else None, time.monotonic() + 10)
        launch.send_signal(2)
        out, err = launch.communicate(timeout=30)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode == 0
    assert "rank 0: WARNING rejected register" in err, err
    logged = [ln for ln in err.splitlines() if " kvswap " in ln and not ln.startswith("rank ")]
    rank_log = (names.run_root / "rank0.log").read_text().splitlines()
    assert logged and rank_log
    for line in logged + rank_log:
        assert LINE.match(line), line


def _wait_attaching(names, timeout: float = 30) -> None:
    """Until every rank of a namespace launched by a subprocess is ATTACHING."""
    def attaching():
        try:
            ranks = read_status(names.namespace, str(names.run_root))["ranks"]
        except KvswapError:
            return None
        return True if all(r["state"] == "ATTACHING" for r in ranks) else None

    assert poll_until(attaching, time.monotonic() + timeout), "ranks never reached ATTACHING"


def _tensor(worker: CacheWorker, name: str, shape=(32, 4, 2, 8), dtype="<f2",
            layer: int = 0) -> CacheTensor:
    return CacheTensor(name, layer, worker.alloc_host_tensor(name, shape, dtype))


def test_error_lines_are_the_errors_of_the_log(tmp_path):
    fmt = formatter("rank3")
    import logging

    def line(level: int, msg: str) -> str:
        return fmt.format(logging.LogRecord("kvswap.daemon", level, __file__, 1, msg, (), None))

    log = tmp_path / "rank3.log"
    log.write_text("\n".join([
        line(logging.INFO, "state ABSENT -> STARTING"),
        line(logging.ERROR, "copy failed"),
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in f',
        "OSError: disk on fire",
        line(logging.WARNING, "rejected evict 7"),
        line(logging.ERROR, "FAILED [501 BARRIER_TIMEOUT]: start-up barrier timed out"),
        line(logging.INFO, "stopped"),
        "Traceback (most recent call last):",
        "ValueError: escaped",
    ]) + "\n")
    assert error_lines(log, 3).splitlines() == [
        "rank 3: copy failed",
        "    Traceback (most recent call last):",
        '      File "x.py", line 1, in f',
        "    OSError: disk on fire",
        "rank 3: FAILED [501 BARRIER_TIMEOUT]: start-up barrier timed out",
        "    Traceback (most recent call last):",
        "    ValueError: escaped",
    ]
    assert "rejected evict" not in error_lines(log, 3, most=5)
    quiet = tmp_path / "quiet.log"
    quiet.write_text(line(logging.INFO, "serving") + "\n")
    assert "serving" in error_lines(quiet, 0)  # no error: the log's last lines


# ------------------------------------------------------------------ the host pool

def test_blocks_that_fit_count_header_and_alignment():
    block_bytes = [1000, 3000, 24]  # alignment pads each tensor to 4 KiB
    for nbytes in (4096 + 3 * 4096, 1 << 20, 5 << 20, 123_456_789):
        n = blocks_that_fit(block_bytes, nbytes)
        assert SwapLayout.of_block_bytes(block_bytes, n).size <= nbytes
        assert SwapLayout.of_block_bytes(block_bytes, n + 1).size > nbytes
    assert blocks_that_fit(block_bytes, 4096) == 0


def test_launcher_knows_the_demo_pool_and_the_daemon_makes_the_same(namespaces):
    cfg = dict(demo_caches=SMALL_LAYOUT, host_size=300_000)
    needs = shm_needs(LaunchConfig(namespace="x", tp=1, **cfg))
    launcher = namespaces.launch(tp=1, host_blocks=None, **cfg)
    row = launcher.rank_rows()[0]
    assert row["num_host_blocks"] == needs.pool_blocks > 0
    region = ShmRegion.attach(launcher.names.swap_segment(0))
    try:
        assert region.size == needs.pool <= 300_000
    finally:
        region.close()
    assert row["swap_bytes_pinned"] == row["swap_bytes_total"] > 0


def test_host_size_gives_the_blocks_of_the_registered_layout(namespaces):
    # No --demo-caches: the blocks are worked out when the worker registers.
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=None, host_size=1 << 20,
                                 wait=False)
    names = launcher.names
    wait_for_state(launcher, RankState.ATTACHING)
    with CacheWorker(names.namespace, 0, run_root=namespaces.run_root) as worker:
        tensors = [_tensor(worker, f"{kind}{layer}", layer=layer)
                   for layer in range(2) for kind in "kv"]
        reply = worker.register(tensors)
        launcher.wait_ready(timeout=30)
        block = 4 * 2 * 8 * 2  # (4, 2, 8) float16
        want = blocks_that_fit([block] * 4, 1 << 20)
        assert reply.fields["num_host_blocks"] == want
        assert launcher.rank_rows()[0]["swap_bytes_total"] == 4 * want * block


def test_daemon_refuses_a_pool_that_cannot_fit_and_creates_nothing(namespaces):
    names = namespaces.new()
    descs = [TensorDesc("k0", 0, "<f2", (8, 1024))]
    tight = HostMemory(shm_free=100 << 20, available=1 << 40)
    with pytest.raises(KvswapError, match=r"needs 200\.00 MiB \(\d+ bytes\) of /dev/shm, "
                                          r"which has 100\.00 MiB free") as ei:
        HostSwapSpace.open(names, 0, descs, 102400, memory=tight)  # 2 KiB blocks
    assert ei.value.code == ErrorCode.INVALID_TASK
    low_ram = HostMemory(shm_free=1 << 40, available=10 << 20)
    with pytest.raises(KvswapError, match="this host has 10.00 MiB available"):
        HostSwapSpace.open(names, 0, descs, host_bytes=20 << 20, memory=low_ram)
    assert names.owned_shm() == []


def test_register_of_an_oversized_pool_is_refused_and_the_heartbeat_never_starts(namespaces):
    """The launcher cannot know the layout, so the daemon refuses at register, with the
    numbers; the rank keeps waiting for a register that fits.  The worker whose register
    failed never beats, so the launcher never tears the namespace down for its silence."""
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=1 << 40, wait=False)
    names = launcher.names
    wait_for_state(launcher, RankState.ATTACHING)
    with CacheWorker(names.namespace, 0, run_root=namespaces.run_root,
                     heartbeat_interval_s=0.01) as worker:
        with pytest.raises(InvalidTask, match=r"rank 0's host pool .* of /dev/shm, which has"):
            worker.register([_tensor(worker, "k0")])
        assert not [e for e in names.owned_shm() if ".swap." in e]
        assert launcher.rank_rows()[0]["state"] == "ATTACHING"
        # 50 heartbeat periods without a beat (before the fix the first came at once)
        beat = poll_until(lambda: int(launcher.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS]) or None,
                          time.monotonic() + 0.5)
        assert beat is None


def test_worker_beats_from_its_successful_register(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False)
    names = launcher.names
    wait_for_state(launcher, RankState.ATTACHING)
    with CacheWorker(names.namespace, 0, run_root=namespaces.run_root,
                     heartbeat_interval_s=0.01) as worker:
        assert int(launcher.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS]) == 0
        worker.register([_tensor(worker, "k0")])
        first = int(launcher.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS])
        assert first > 0
        later = poll_until(
            lambda: int(launcher.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS]) > first or None,
            time.monotonic() + 5)
        assert later


def test_status_says_who_a_registered_rank_waits_for(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=None, wait=False)
    names = launcher.names
    wait_for_state(launcher, RankState.ATTACHING)
    with CacheWorker(names.namespace, 0, run_root=namespaces.run_root) as worker:
        worker.register([_tensor(worker, "k0")])
        ranks = read_status(names.namespace, namespaces.run_root)["ranks"]
        assert ranks[0]["state"] == "ATTACHING"
        assert ranks[0]["activity"] == "registered, waiting for rank 1 to register"
        assert ranks[1]["activity"] == "waiting for its caches to be registered"
        with CacheWorker(names.namespace, 1, run_root=namespaces.run_root) as other:
            other.register([_tensor(other, "k0")])
            launcher.wait_ready(timeout=30)
            assert [r["activity"] for r in launcher.rank_rows()] == ["", ""]


def test_populate_reports_progress_chunk_by_chunk(namespaces, monkeypatch):
    monkeypatch.setattr(swap_space, "POPULATE_CHUNK_BYTES", 64 << 10)
    names = namespaces.new()
    swap = HostSwapSpace.open(names, 0, [TensorDesc("k0", 0, "<u1", (1, 4096))], 40)
    try:
        seen: list[int] = []
        swap.populate(seen.append)
        size = swap.region.size  # 4 KiB header + 40 blocks of 4 KiB
        assert seen == [64 << 10, 128 << 10, size] and size == 164 << 10
    finally:
        swap.close(unlink=True)


def _row(rank: int, state: str, ready: int = 0, total: int = 0, cache_ready: int = 0,
         activity: str = "") -> dict:
    return {"rank": rank, "state": state, "swap_bytes_pinned": ready, "swap_bytes_total": total,
            "cache_ready": cache_ready, "swap_ready": 0, "activity": activity}


def test_launch_progress_plain_lines_change_by_state_and_tenth(tmp_path):
    out = (tmp_path / "out").open("w+", newline="")
    err = (tmp_path / "err").open("w+", newline="")
    progress = LaunchProgress(out, err, tty=False)
    gib = 1 << 30
    for ready in (0, gib // 100, gib // 20, gib // 10, gib // 5, gib // 5 + 1):
        progress.update([_row(0, "ATTACHING", ready, gib, activity=f"preparing {ready}")])
    progress.update([_row(0, "READY", gib, gib, cache_ready=1)])
    progress.log(0, "WARNING something")
    progress.done()
    out.seek(0)
    lines = out.read().splitlines()
    # 0 %, then 10 % and 20 % (the steps in between print nothing), then READY
    assert len(lines) == 4 and "preparing 0)" in lines[0] and "READY" in lines[3]
    assert not any("\r" in ln or "\x1b" in ln for ln in lines)
    err.seek(0)
    assert err.read() == "rank 0: WARNING something\n"


def test_launch_progress_on_a_terminal_redraws_one_line_with_a_bar(tmp_path):
    out = (tmp_path / "out").open("w+", newline="")  # "\r" read back as written
    progress = LaunchProgress(out, (tmp_path / "err").open("w"), tty=True)
    progress.update([_row(0, "ATTACHING", 1 << 29, 1 << 30), _row(1, "READY", 1, 1, 1)])
    progress.done()
    out.seek(0)
    text = out.read()
    assert text.startswith("\r\x1b[K[") and text.endswith("\n") and text.count("\n") == 1
    assert "1 ATTACHING, 1 READY" in text and "[############............]" in text
    assert "512.00 MiB / 1.00 GiB" in text


def test_launch_output_is_plain_lines_on_a_pipe(namespaces):
    names = namespaces.new()
    launch = subprocess.Popen(
        [sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace", names.namespace,
         "--run-root", str(names.run_root), "--tp", "1", "--demo-caches", SMALL_LAYOUT,
         "--host-size", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in launch.stdout:
            lines.append(line)
            if "READY on" in line:
                break
        launch.send_signal(2)
        _, err = launch.communicate(timeout=30)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    text = "".join(lines)
    assert "\r" not in text and "\x1b" not in text
    assert lines[-1].startswith(f"kvswap: namespace {names.namespace} READY on 1 rank(s)")
    assert all(ln.startswith("[") and "] waiting: rank 0 " in ln for ln in lines[:-1])
    blocks = blocks_that_fit([128] * 4, 64 << 20)
    assert f"({blocks} blocks per tensor)" in err  # the launcher knew the demo pool


# ------------------------------------------------------------------ leftover segments

def test_unused_leftover_segment_is_swept_and_created_afresh(namespaces):
    names = namespaces.new()
    name = names.device_segment(0, "k0")
    left = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    os.pwrite(left.fd, b"old", 0)
    left.close_fd()  # nobody maps it or holds it open: its creator is gone
    assert segment_users(name) == []
    region = ShmRegion.create(name, 8192)
    try:
        assert region.size == 8192 and bytes(region.array(0, (3,), np.uint8)) == b"\0\0\0"
    finally:
        region.unlink()
        region.close()


def test_leftover_in_use_names_its_user_and_the_command(namespaces):
    names = namespaces.new()
    name = names.device_segment(0, "k0")
    held = ShmRegion.create(name, 4096)  # this process maps it
    try:
        assert segment_users(name) == [os.getpid()]
        with pytest.raises(SegmentExists) as ei:
            ShmRegion.create(name, 4096)
        msg = ei.value.message
        assert f"{name} already exists" in msg and f"pid {os.getpid()} (" in msg
        assert f"rm /dev/shm{name}" in msg
        assert "posix_ipc" not in msg
    finally:
        held.unlink()
        held.close()
    assert Path(f"/dev/shm{name}").exists() is False


def test_status_names_the_leftovers_of_a_launcher_that_is_gone(namespaces):
    names = namespaces.new()
    # A "launcher" that creates the namespace's signal segment and dies without removing it.
    subprocess.run([sys.executable, "-c",
                    "import sys; from kvswap.client.naming import Names; "
                    "from kvswap.client.signals import SignalSegment; "
                    "SignalSegment.create(Names.of(sys.argv[1], sys.argv[2]), 1)",
                    names.namespace, str(names.run_root)], check=True, timeout=30)
    status = read_status(names.namespace, str(names.run_root))
    assert status["launcher_alive"] is False
    table = format_table(status).splitlines()
    assert table[1].startswith("the launcher is gone")
    assert f"'kvswap launch --namespace {names.namespace}' removes it" in table[1]
    # ... and what the line says holds: launching the namespace removes the leftovers
    launcher = Launcher(LaunchConfig(namespace=names.namespace, run_root=namespaces.run_root,
                                     tp=1, demo_caches=SMALL_LAYOUT, host_blocks=8))
    namespaces.launchers.append(launcher)  # stopped, and checked for leaks, by the fixture
    launcher.start()
    launcher.wait_ready(timeout=30)
    assert read_status(names.namespace, namespaces.run_root)["launcher_alive"] is True


@pytest.mark.parametrize("advice", [swap_space.MADV_POPULATE_WRITE, 12345])  # 12345: EINVAL
def test_populating_changes_no_byte(namespaces, advice):
    """MADV_POPULATE_WRITE, or on a kernel that refuses the advice the page-touching
    fallback: an adopted pool keeps its contents."""
    names = namespaces.new()
    region = ShmRegion.create(names.swap_segment(0), 64 << 10)
    try:
        data = region.array(0, (64 << 10,), np.uint8)
        data[:] = np.arange(64 << 10) % 251
        region.populate(0, 64 << 10, advice)
        assert np.array_equal(data, np.arange(64 << 10) % 251)
        del data
    finally:
        region.unlink()
        region.close()


def test_a_stop_interrupted_midway_still_ends_the_daemons_and_removes_the_namespace(
        namespaces, monkeypatch):
    """stop() marked itself done before it began, so a Ctrl-C (or SIGTERM, in kvswap
    bench) during its staged stop left the daemons running and the namespace in
    place, and a second stop() returned at once.  Now the interrupted stop kills
    what is still running and removes the namespace on its way out."""
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT)
    names = launcher.names

    def interrupted(ranks):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "_terminate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launcher.stop()
    assert [p.poll() for p in launcher.procs] == [-9, -9]
    assert names.owned_shm() == [] and not names.run_dir.exists()


def test_the_staged_stop_needs_no_zeromq_context(namespaces, monkeypatch):
    """The stop sent each daemon a shutdown message through a new ZeroMQ context: on
    a host out of threads libzmq could not start its I/O thread and aborted the
    launcher (SIGABRT), leaving daemons, shm and the run dir behind.  The stop now
    signals the daemons; no context is made, and they still stop cleanly (exit 0)."""
    import zmq

    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT)
    names = launcher.names

    def no_context(*args, **kwargs):
        raise AssertionError("the stop made a ZeroMQ context")

    monkeypatch.setattr(zmq, "Context", no_context)
    launcher.stop()
    assert [p.poll() for p in launcher.procs] == [0, 0]  # their clean stop, not SIGKILL
    assert names.owned_shm() == [] and not names.run_dir.exists()


@pytest.mark.parametrize("flag", ["run_root", "log_dir"])
def test_a_directory_that_cannot_be_made_is_a_namespace_error(namespaces, flag):
    """--run-root or --log-dir under /proc (a parent that cannot be created) printed a
    traceback ending in FileNotFoundError; it is a NamespaceError naming the flag."""
    kw = {"run_root": "/proc/kvswap-none"} if flag == "run_root" else {
        "run_root": namespaces.run_root, "log_dir": "/proc/kvswap-none/logs"}
    launcher = Launcher(LaunchConfig(namespace=namespaces.new().namespace, tp=1,
                                     demo_caches=SMALL_LAYOUT, host_blocks=8, **kw))
    with pytest.raises(NamespaceError, match="cannot create the directory /proc/kvswap-none"):
        launcher.start()
    assert launcher.names.owned_shm() == []


def test_a_launcher_starts_once_and_one_per_namespace_in_a_process(namespaces):
    """A second start() of a running Launcher, or a second Launcher of the namespace in
    the same process, is refused and changes nothing: the segment's launcher pid is
    this process either way, which used to read as "a launcher that is gone" and let
    the second sweep the live namespace and spawn a second rank 0."""
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=8)
    pid = launcher.procs[0].pid
    shm = sorted(launcher.names.owned_shm())
    with pytest.raises(NamespaceError, match="already started; each Launcher starts once"):
        launcher.start()
    second = Launcher(LaunchConfig(namespace=launcher.names.namespace, tp=1,
                                   run_root=namespaces.run_root, demo_caches=SMALL_LAYOUT,
                                   host_blocks=8))
    with pytest.raises(NamespaceError, match="in use by another Launcher of this process"):
        second.start()
    assert sorted(launcher.names.owned_shm()) == shm and launcher.procs[0].pid == pid
    assert launcher.procs[0].poll() is None and launcher.seg.state_of(0) == RankState.READY
    with pytest.raises(NamespaceError, match="call start"):
        second.wait_ready(1)
    launcher.stop()
    with pytest.raises(NamespaceError, match="already started"):
        launcher.start()  # stopped for good: a stopped Launcher could not be stopped again
    second.start()  # the namespace is free once the first has stopped
    namespaces.launchers.append(second)
    second.wait_ready(30)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, "30"])
def test_wait_ready_refuses_a_timeout_that_is_not_a_duration(namespaces, timeout):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=8, wait=False)
    with pytest.raises(InvalidTask, match="wait_ready timeout must be"):
        launcher.wait_ready(timeout)  # nan used to wait forever


def test_kvswap_launch_outlives_its_output_reader_and_stops_on_sighup(namespaces):
    """``kvswap launch | head -1``: the reader of stdout goes away and the launcher runs
    on (it used to die of BrokenPipeError and tear the namespace down under the engine).
    Closing its terminal (SIGHUP) stops it like SIGTERM: the namespace is removed, where
    the default action used to kill it and leave the namespace behind."""
    names = namespaces.new()
    launch = subprocess.Popen(
        [sys.executable, "-m", "kvswap.daemon.cli", "launch", "--namespace", names.namespace,
         "--run-root", str(names.run_root), "--tp", "1", "--demo-caches", SMALL_LAYOUT,
         "--host-blocks", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        launch.stdout.close()  # before its first line: every line it writes meets EPIPE
        wait_for_namespace_state(names, 1, RankState.READY)
        launch.send_signal(signal.SIGHUP)
        assert launch.wait(30) == 0, launch.stderr.read().decode()
        assert b"Traceback" not in launch.stderr.read()
        assert names.owned_shm() == [] and not names.run_dir.exists()
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
        launch.stderr.close()


def test_an_outlet_whose_reader_is_gone_swallows_what_it_cannot_write():
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    outlet = Outlet(stream)
    os.close(r)  # the reader is gone
    try:
        print("lost", file=outlet, flush=True)  # EPIPE: the descriptor now goes to /dev/null
        print("also lost", file=outlet, flush=True)
        assert os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
    finally:
        stream.close()


@pytest.mark.parametrize("flag", ["--run-root", "--log-dir"])
def test_a_run_root_or_log_dir_that_is_a_file_is_refused_naming_the_flag(namespaces, flag):
    names = namespaces.new()
    blocker = Path(namespaces.run_root) / "a-file"
    blocker.write_text("")
    cfg = {"run_root": str(blocker)} if flag == "--run-root" else {"log_dir": str(blocker)}
    kw = {"run_root": namespaces.run_root, **cfg}
    launcher = Launcher(LaunchConfig(namespace=names.namespace, tp=1, demo_caches=SMALL_LAYOUT,
                                     host_blocks=8, **kw))
    with pytest.raises(NamespaceError, match=f"cannot create the directory .*a-file.* \\({flag}\\)"):
        launcher.start()
    assert Names.of(names.namespace, kw["run_root"]).owned_shm() == []  # nothing left


def test_with_log_dir_the_log_a_client_names_leads_to_the_log(namespaces, tmp_path,
                                                              monkeypatch):
    """Clients name <run dir>/rank<r>.log in their errors: they do not know --log-dir,
    and with it that path did not exist.  The launcher links it to the real log."""
    monkeypatch.chdir(tmp_path)  # a relative --log-dir is the launcher's cwd's
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=8, log_dir="logs")
    with TransferClient(launcher.names.namespace, 1, run_root=namespaces.run_root) as client:
        named = client._describe(0).rsplit("log ", 1)[1].rstrip(")")
    assert Path(named) == launcher.names.log_path(0) and Path(named).is_symlink()
    assert Path(named).resolve() == (tmp_path / "logs" / "rank0.log").resolve()
    assert "READY" in Path(named).read_text()
    # the run dir itself, spelled another way: the logs go there, no link to themselves
    other = namespaces.new()
    again = Launcher(LaunchConfig(namespace=other.namespace, tp=1, demo_caches=SMALL_LAYOUT,
                                  host_blocks=8, run_root=namespaces.run_root,
                                  log_dir=f"{other.run_dir}/../{other.namespace}"))
    namespaces.launchers.append(again)
    again.start()
    again.wait_ready(timeout=30)
    assert not again.names.log_path(0).is_symlink()
    assert "READY" in again.names.log_path(0).read_text()


def test_wait_ready_returns_when_the_engine_paused_before_it_looked(namespaces):
    """An engine may pause (or clear) the namespace between two of the launcher's polls
    right after READY: the namespace is up, and wait_ready returns, so supervision
    starts (it used to wait for READY until --ready-timeout, then fail)."""
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT, host_blocks=8, wait=False)
    wait_for_state(launcher, RankState.READY, timeout=30)  # not through wait_ready
    with TransferClient(launcher.names.namespace, 2, run_root=namespaces.run_root) as client:
        client.pause().result(10)
        assert [launcher.seg.state_of(r) for r in range(2)] == [RankState.PAUSED] * 2
        launcher.wait_ready(timeout=5)
        assert launcher.supervise_once() is None
        client.resume().result(10)


def test_a_daemon_orphaned_before_its_io_loop_runs_stops_cleanly(namespaces):
    """The launcher dies right after spawning: the daemon's first heartbeat finds it
    orphaned and sends itself SIGTERM, before the I/O loop takes the stop signals.
    That SIGTERM used to kill it where it stood, leaving its completion journal in
    /dev/shm and its rank STARTING; it is now held and raised again once the I/O
    loop runs, so the daemon takes the clean stop and removes what it made."""
    names = namespaces.new()
    code = ("import os, sys\n"
            "from kvswap.daemon.config import LaunchConfig\n"
            "from kvswap.daemon.launcher import Launcher\n"
            f"l = Launcher(LaunchConfig(namespace={names.namespace!r}, "
            f"run_root={str(names.run_root)!r}, tp=1, demo_caches={SMALL_LAYOUT!r}, "
            "host_blocks=8, orphan_timeout_s=0.05))\n"
            "l.start()\n"
            "print(l.procs[0].pid, flush=True)\n"
            "os._exit(0)  # gone without a stop, its daemon left running\n")
    pid = None
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout.split()[-1])
        assert poll_until(lambda: None if pid_alive(pid) else True, time.monotonic() + 30)
        log = names.log_path(0).read_text()
        assert "orphaned: launcher pid" in log and "stopping: signal SIGTERM" in log, log
        assert names.journal_segment(0)[1:] not in names.owned_shm()
        assert read_status(names.namespace, str(names.run_root))["ranks"][0]["state"] == "STOPPED"
    finally:
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        sweep_namespace(names)  # what the dead launcher would have removed
        shutil.rmtree(names.run_dir, ignore_errors=True)
