"""`kvswap bench control/data/gpu`, `kvswap metrics` and `kvswap status --watch`.

The benches run for real (namespaces, reference processes) but tiny; timings
are never asserted (the machine is shared), only the shape of the results and
that every system ran exactly the work the bench says it ran.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvswap.client import TransferClient
from kvswap.client.monitor import format_table, read_status, transfer_rates
from kvswap.client.signals import poll_until
from kvswap.daemon import bench
from kvswap.daemon.cli import build_parser

from conftest import SMALL_LAYOUT

CONTROL_KEYS = {"tp", "kvswap_p50_us", "kvswap_p99_us", "floor_p50_us", "floor_p99_us",
                "baseline_p50_us", "baseline_p99_us", "kvswap_cpu_us", "floor_cpu_us",
                "baseline_cpu_us", "kvswap_tasks_per_s", "floor_tasks_per_s",
                "baseline_tasks_per_s", "p50_vs_floor", "baseline_vs_kvswap_p50",
                "tasks_per_system", "path", "engine_cpu_us", "engine_cpu_pipelined_us",
                "tasks_vs_floor"}
DATA_KEYS = {"block_bytes", "op", "tp", "blocks", "runs", "task_bytes", "kvswap_gbps",
             "kvswap_exec_gbps", "memcpy_gbps", "ratio", "exec_ratio"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvswap.daemon.cli", *args]


def _leftovers(marker: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if marker in n]


# ---------------------------------------------------------------------- bench control / data


def test_control_bench_schema_and_task_counts():
    proc = subprocess.Popen(_cli("bench", "control", "--tp", "1,2", "--rounds", "2",
                                 "--samples", "10", "--tasks", "20", "--window", "8",
                                 "--warmup", "5", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    rows = json.loads(out)["control"]
    assert [r["tp"] for r in rows] == [1, 2]
    # warm-up (5 + 10 block warm-up, 2 x window pipelined), then per round one latency
    # block (10 warm-up + 10 samples) and one pipelined block (20), for every system;
    # the bench itself fails if any rank of any system served a different count.
    expected = (5 + 10 + 2 * 8) + 2 * (10 + 10 + 20)
    for row in rows:
        assert set(row) == CONTROL_KEYS
        assert row["tasks_per_system"] == expected
        for name in ("kvswap", "floor", "baseline"):
            assert 0 < row[f"{name}_p50_us"] <= row[f"{name}_p99_us"]
            assert row[f"{name}_cpu_us"] >= 0  # clock ticks: may round to 0 on 10 samples
            assert row[f"{name}_tasks_per_s"] > 0
        assert row["path"] == "ring"  # the default on ipc://, every rank on its rings
        assert 0 <= row["engine_cpu_us"] <= row["kvswap_cpu_us"] + 1
        assert row["engine_cpu_pipelined_us"] > 0  # process_time(): no clock ticks to round to 0
        assert row["tasks_vs_floor"] == pytest.approx(
            row["kvswap_tasks_per_s"] / row["floor_tasks_per_s"], abs=0.02)
        assert row["p50_vs_floor"] == pytest.approx(
            row["kvswap_p50_us"] / row["floor_p50_us"], abs=0.02)
        assert row["baseline_vs_kvswap_p50"] == pytest.approx(
            row["baseline_p50_us"] / row["kvswap_p50_us"], abs=0.02)
    # the bench's namespaces and the baseline's flag segment are gone
    assert not _leftovers(f"bench-{proc.pid}")


def test_data_bench_schema_and_bytes():
    proc = subprocess.Popen(_cli("bench", "data", "--sizes", "4096,65536", "--mib", "2",
                                 "--rounds", "2", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    rows = json.loads(out)["data"]
    assert [(r["block_bytes"], r["op"]) for r in rows] == [
        (4096, "evict"), (4096, "load"), (65536, "evict"), (65536, "load")]
    for row in rows:
        assert set(row) == DATA_KEYS
        blocks = (2 << 20) // (2 * row["block_bytes"])
        assert row["blocks"] == blocks
        assert row["task_bytes"] == 2 * blocks * row["block_bytes"]  # K and V, checked per reply
        # random block sets: (almost) no two neighbours continue each other on both sides
        assert 0.9 * blocks <= row["runs"] <= blocks
        for key in ("kvswap_gbps", "kvswap_exec_gbps", "memcpy_gbps", "ratio", "exec_ratio"):
            assert row[key] > 0
        assert row["ratio"] == pytest.approx(row["kvswap_gbps"] / row["memcpy_gbps"], abs=0.02)
    assert not _leftovers(f"bench-{proc.pid}")


@pytest.mark.parametrize("per_task,in_flight", [(1, 320), (12, 320), (40, 80), (51, 80)])
def test_tasks_bench_tasks_in_flight_never_share_a_block(per_task, in_flight):
    """``kvswap bench tasks --blocks-per-task N``: each task is N consecutive blocks,
    and as many tasks as the bench keeps in flight (the window and a batch of 64: 320
    by default, 80 with ``--window 16``) never repeat one, so no task waits for
    another (hazard ordering would otherwise serialise them)."""
    tasks = [bench._task_blocks(i, 4096, per_task) for i in range(1000)]
    assert all(t == list(range(t[0], t[0] + per_task)) for t in tasks)
    for lo in range(0, 1000 - in_flight):
        window = [b for t in tasks[lo:lo + in_flight] for b in t]
        assert len(set(window)) == len(window)


def test_tasks_bench_refuses_tasks_that_would_share_blocks(capsys):
    args = build_parser().parse_args(["bench", "tasks", "--blocks-per-task", "13"])
    assert bench.run(args) == 1
    err = capsys.readouterr().err
    assert "--blocks-per-task 13" in err and "use at most 12" in err


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    args = build_parser().parse_args(["bench", "data", "--plot", "never.png"])
    monkeypatch.setitem(bench.SCENARIOS, "data",
                        (bench._args_data, lambda a: pytest.fail("measured anyway"), ""))
    assert bench.run(args) == 2
    assert "pip install 'kvswap[plot]'" in capsys.readouterr().err
    assert not Path("never.png").exists()


def test_plots_are_small_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    control = {"control": [
        {"tp": tp, "kvswap_p50_us": 500.0, "floor_p50_us": 90.0, "baseline_p50_us": 1500.0,
         "kvswap_tasks_per_s": 3000, "floor_tasks_per_s": 20000, "baseline_tasks_per_s": 1500}
        for tp in (1, 2)]}
    data = {"data": [
        {"block_bytes": bb, "op": op, "kvswap_gbps": 3.0, "kvswap_exec_gbps": 4.0,
         "memcpy_gbps": 5.0}
        for bb in bench.DATA_SIZES for op in ("evict", "load")]}
    for name, result in (("control", control), ("data", data)):
        path = tmp_path / f"{name}.png"
        bench.PLOTS[name](result, str(path))
        raw = path.read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(raw) < 60_000


def test_gpu_bench_without_cuda_exits_2():
    if bench._gpu_unavailable() is None:
        pytest.skip("a CUDA device is present: the GPU bench would run")
    proc = subprocess.run(_cli("bench", "gpu", "--json"), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith(bench.NO_GPU_MESSAGE)
    assert proc.stdout == ""


# ---------------------------------------------------------------------- kvswap metrics


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_equal_the_work_done(namespaces):
    pytest.importorskip("prometheus_client")
    from kvswap.daemon import metrics

    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT, host_blocks=32)
    ns, root = launcher.names.namespace, namespaces.run_root
    server, thread = metrics.serve(ns, 0, "127.0.0.1", root)
    try:
        with TransferClient(ns, 2, run_root=root) as client:
            evicted = sum(client.evict([2 * i, 2 * i + 1], [i, i + 8]).result(10).nbytes
                          for i in range(3))
            loaded = client.load([0], [5]).result(10).nbytes
        sample = _scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    status = read_status(ns, root)
    block = 4 * (4 * 2 * 8 * 2)  # SMALL_LAYOUT: 2 layers x K, V of 4 tokens x 2 heads x 8 fp16
    assert evicted == 2 * 3 * 2 * block and loaded == 2 * block  # summed over both ranks
    assert sample[("kvswap_up", (("namespace", ns),))] == 1
    assert sample[("kvswap_tp_size", (("namespace", ns),))] == 2
    for r in (0, 1):
        lab = (("namespace", ns), ("rank", str(r)))
        assert sample[("kvswap_rank_completed_total", lab)] == 4
        assert sample[("kvswap_rank_failed_total", lab)] == 0
        assert sample[("kvswap_rank_evicted_bytes_total", lab)] == 3 * 2 * block
        assert sample[("kvswap_rank_loaded_bytes_total", lab)] == block
        assert sample[("kvswap_rank_inflight", lab)] == 0
        assert sample[("kvswap_rank_epoch", lab)] == status["ranks"][r]["epoch"]
        assert sample[("kvswap_rank_swap_pool_bytes", lab)] == 4 * 32 * (block // 4)
        assert sample[("kvswap_rank_state", (*lab, ("state", "READY")))] == 1
        assert sample[("kvswap_rank_state", (*lab, ("state", "FAILED")))] == 0
        assert 0 <= sample[("kvswap_rank_heartbeat_age_seconds", lab)] < 5
        for op, tasks in (("evict", 3), ("load", 1)):  # every task timed once per phase
            for phase in ("queued", "exec"):
                h = (*lab, ("op", op), ("phase", phase))
                assert sample[("kvswap_rank_task_seconds_count", tuple(sorted(h)))] == tasks
                inf = tuple(sorted((*h, ("le", "+Inf"))))
                assert sample[("kvswap_rank_task_seconds_bucket", inf)] == tasks


def test_metrics_without_namespace_serves_up_0():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from kvswap.daemon.metrics import registry_for

    text = generate_latest(registry_for("no-such-ns", "/tmp")).decode()
    assert 'kvswap_up{namespace="no-such-ns"} 0.0' in text
    assert "kvswap_build_info{" in text
    assert "kvswap_rank_" not in text


def test_metric_names_follow_the_prometheus_guide(namespaces):
    """The exposition parses with prometheus_client's own parser; counters carry their
    unit before _total; no series says what another says; build info is there."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    import kvswap.client
    from kvswap.client.protocol import PROTOCOL_VERSION
    from kvswap.daemon.metrics import registry_for

    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=8)
    text = generate_latest(registry_for(launcher.names.namespace, namespaces.run_root)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name for f in families.values() for s in f.samples}
    assert {"kvswap_rank_evicted_bytes_total", "kvswap_rank_loaded_bytes_total"} <= samples
    assert not {"kvswap_rank_bytes_evicted_total", "kvswap_rank_bytes_loaded_total",
                "kvswap_rank_state_code"} & samples
    for family in families.values():
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples
                       if not s.name.endswith("_created")), family.name
    (build,) = families["kvswap_build_info"].samples
    assert build.value == 1
    assert build.labels == {"version": kvswap.client.__version__,
                            "protocol_version": "%d.%d" % PROTOCOL_VERSION}


def _first_line(proc: subprocess.Popen, timeout: float = 15.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output"
    return proc.stdout.readline()


WATCH_LAYOUT = "layers=1,block_tokens=16,heads=32,head_dim=128,blocks=64"  # 256 KiB a block


class _Frames:
    """The frames ``kvswap status --watch`` appends to a pipe, a blank line apart; read
    from the raw descriptor, so no buffered byte is hidden from ``select``."""

    def __init__(self, proc: subprocess.Popen):
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self.rest = b""  # read, not yet a whole frame

    def next(self, timeout: float) -> str | None:
        """The next whole frame, or None if none is complete within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while b"\n\n" not in self.rest:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return None
            self.rest += chunk
        frame, self.rest = self.rest.split(b"\n\n", 1)
        return frame.decode()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _evict_rate(frame: str) -> str:
    return frame.splitlines()[2].split()[-3]


def test_metrics_and_status_watch_commands(namespaces):
    """The watch shows no rate in its first frame, then a rate while evicts run.  The
    evicts start after the first frame and go on until a frame shows their rate (30 s
    at most), so how late the watch process starts does not matter."""
    pytest.importorskip("prometheus_client")
    launcher = namespaces.launch(tp=1, demo_caches=WATCH_LAYOUT)
    ns, root = launcher.names.namespace, namespaces.run_root
    # SIGINT at its default in the children, so that Python turns it into Ctrl-C there
    # even when the suite runs as a background job (its children inherit SIGINT
    # ignored, and the watch never ended)
    exporter = subprocess.Popen(_cli("metrics", "--namespace", ns, "--run-root", root,
                                     "--port", "0"), stdout=subprocess.PIPE, text=True,
                                preexec_fn=_sigint_default)
    watch = subprocess.Popen(_cli("status", "--namespace", ns, "--run-root", root, "--watch",
                                  "--interval", "0.2"), stdout=subprocess.PIPE,
                             preexec_fn=_sigint_default)
    frames = _Frames(watch)
    try:
        line = _first_line(exporter)
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        assert line.startswith(f"kvswap: serving metrics of namespace {ns} on http://127.0.0.1:")
        first = frames.next(30)
        assert first is not None, "no first frame from status --watch"
        seen = [first]
        evicts = 0
        deadline = time.monotonic() + 30
        with TransferClient(ns, 1, run_root=root) as client:
            while all(_evict_rate(f) in ("-", "0.00") for f in seen):
                assert time.monotonic() < deadline, f"no frame showed a rate: {seen}"
                i = evicts % 8  # 2 MiB an evict, a few every 0.2 s frame: >= 0.01 GiB/s
                client.evict(list(range(8)), list(range(8 * i, 8 * i + 8))).result(10)
                evicts += 1
                frame = frames.next(0.03)
                if frame is not None:
                    seen.append(frame)
        sample = _scrape(port)
        assert sample[("kvswap_rank_completed_total", (("namespace", ns), ("rank", "0")))] == evicts
    finally:
        for p in (exporter, watch):
            p.send_signal(signal.SIGINT)
        out, _ = watch.communicate(timeout=10)
        exporter.communicate(timeout=10)
    assert exporter.returncode == 0 and watch.returncode == 0
    tail = (frames.rest + out).decode()
    # stdout is a pipe: frames are appended, a blank line apart, never redrawn
    assert "\x1b" not in "".join(seen) + tail
    shown = seen + [f for f in tail.split("\n\n") if f.strip()]
    assert len(shown) >= 2
    assert all("evict GiB/s" in f and "load GiB/s" in f for f in shown)
    # the first frame, before any evict, has no rate yet
    assert first.splitlines()[2].split()[-3:-1] == ["-", "-"]


def test_status_watch_json_into_head_is_three_json_lines_and_exit_0(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT, host_blocks=8)
    ns, root = launcher.names.namespace, namespaces.run_root
    status = subprocess.Popen(_cli("status", "--namespace", ns, "--run-root", root, "--watch",
                                   "--json", "--interval", "0.05"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-n", "3"], stdin=status.stdout, stdout=subprocess.PIPE)
    assert status.stdout is not None
    status.stdout.close()  # head holds the pipe's read end alone: its exit closes the pipe
    try:
        out, _ = head.communicate(timeout=30)
        rc = status.wait(timeout=30)
    finally:
        for p in (status, head):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert status.stderr is not None
    err = status.stderr.read().decode()
    status.stderr.close()
    assert rc == 0 and err == "", err
    lines = out.decode().splitlines()
    assert len(lines) == 3
    for line in lines:
        obj = json.loads(line)  # an escape sequence or a pretty-printed object would fail
        assert obj["namespace"] == ns and [r["state"] for r in obj["ranks"]] == ["READY"] * 2


# ---------------------------------------------------------------------- status --watch rates


def _status(created: int, ranks: list[tuple[int, int, int]]) -> dict:
    return {"namespace": "ns", "tp_size": len(ranks), "launcher_pid": 1,
            "engine_heartbeat_age_s": None, "kvcache_status": "NORMAL",
            "created_unix_ns": created,
            "ranks": [{"rank": r, "pid": 10 + r, "state": "READY", "epoch": 1,
                       "heartbeat_age_s": 0.05, "inflight": 0, "completed": 0, "failed": 0,
                       "bytes_evicted": ev, "bytes_loaded": ld, "last_error": "OK"}
                      for r, ev, ld in ranks]}


def test_transfer_rates():
    # GiB/s, the unit of the table's GiB counters
    prev = _status(7, [(0, 1_000, 0), (1, 5 << 30, 0)])
    cur = _status(7, [(0, (4 << 30) + 1_000, 1 << 30), (1, 4 << 30, 0), (2, 0, 0)])
    assert transfer_rates(prev, cur, 2.0) == {
        0: (pytest.approx(2.0), pytest.approx(0.5)),
        1: (None, 0.0),  # bytes_evicted went back
        2: (None, None),  # a rank that was not there before
    }
    assert transfer_rates(prev, _status(8, [(0, 9, 9)]), 2.0) == {0: (None, None)}  # relaunch
    assert transfer_rates(prev, prev, 0.0) == {0: (None, None), 1: (None, None)}


def test_status_table_has_rate_columns_only_when_watching():
    st = _status(7, [(0, 2 << 30, 0)])
    plain = format_table(st).splitlines()
    assert "GiB/s" not in plain[1]
    first = format_table(st, {}).splitlines()  # first --watch frame: nothing to diff yet
    assert first[1].endswith("evict GiB/s  load GiB/s  last error")
    assert first[2].split()[-3:] == ["-", "-", "-"]
    later = format_table(st, {0: (1.234, 0.001)}).splitlines()
    assert later[2].split()[-3:] == ["1.23", "<0.01", "-"]
    assert plain[2].split()[:-1] == later[2].split()[:-3]  # the other columns are the same


def _of_namespace(prefix: str) -> list[str]:
    """Shared-memory objects, and live processes whose command line names a namespace,
    that start with ``prefix``."""
    left = [n for n in os.listdir("/dev/shm") if n.startswith("kvswap." + prefix)
            or n.startswith("sem.kvswap." + prefix)]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(b"--namespace=" + prefix.encode()) for a in args):
            left.append(f"pid {pid}")
    return left


def test_a_bench_ended_by_sigterm_removes_what_it_launched():
    """SIGTERM used to end `kvswap bench` where it stood: its throw-away namespace's
    daemons, segments and run dir stayed, under a name nobody launches again.  Now it
    ends as on Ctrl-C, through the clean-ups."""
    proc = subprocess.Popen([sys.executable, "-m", "kvswap.daemon.cli", "bench", "tasks",
                             "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    prefix = f"bench-{proc.pid}-"
    try:
        # the daemons are serving once their rings exist
        assert poll_until(lambda: True if any(".ring.r0" in n for n in _of_namespace(prefix))
                          else None, time.monotonic() + 60), "the bench's namespace never started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
        assert "interrupted (SIGTERM); cleaned up" in proc.stderr.read()
        assert _of_namespace(prefix) == []
        assert not list(Path("/tmp").glob(f"kvb-*/{prefix}*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
