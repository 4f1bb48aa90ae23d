"""``kvswap bench``: benchmarks, each against a reference measured in the same run.

These machines are shared and noisy, so every figure is reported next to a
baseline taken seconds apart by the same command; compare ratios, not absolutes.

Scenarios (``kvswap bench <name> [--json]``):

* ``tasks``: many small independent tasks, pipelined: tasks/s with merging
  on, with merging off (the reference), and through the batch API.
* ``layerwise``: a layer-wise load of L layers: time until layer 0 is ready
  (seen by a waiter, as a TP worker sees it) against the time of the whole load.
* ``control``: round-trip latency and pipelined tasks/s of 1-block evicts
  through the whole stack, against a bare ZeroMQ echo floor and a re-creation of
  the reference design's manager-queue control plane (``bench_refs``).
* ``data``: GB/s of scattered-block evicts and loads on the host backend against
  a single-thread ``numpy.copyto`` of the same bytes.
* ``gpu``: runs ``scripts/bench_gpu.py`` when cupy and a CUDA device are present.
* ``trace`` and ``hostcache``: the engine-side host tier (``bench_trace``).

``control``, ``data``, ``trace`` and ``hostcache`` take ``--plot FILE.png`` (needs
the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kvswap.client.block_keys import block_hashes
from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.layout import demo_layout
from kvswap.client.signals import RankSlot
from kvswap.client.transfer_client import TransferClient, TransferSpec
from kvswap.daemon import bench_peer, bench_trace
from kvswap.daemon.bench_refs import (
    REPLY_TIMEOUT_S,
    BaselineRef,
    BenchError,
    FloorRef,
    cpu_seconds,
    measure_latencies_us,
)
from kvswap.daemon.config import MAX_RANKS
from kvswap.daemon.launcher import LaunchConfig, Launcher
from kvswap.daemon.options import HelpFormatter, at_least, between, value_type
from kvswap.daemon.storage.local_servers import MooncakeMaster, RedisServer, find_master
from kvswap.kernels.planner import plan_copy


class _Namespace:
    """A throw-away launched namespace for one measurement."""

    def __init__(self, tp: int, layout: str, host_blocks: int, path: str | None = None,
                 **options: Any):
        """``path``: the client's ``path`` option; ``options``: more :class:`LaunchConfig`
        fields (kvswapd options included)."""
        self.path = path
        self.run_root = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
        ns = f"bench-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        try:
            self.launcher = Launcher(LaunchConfig(namespace=ns, tp=tp, run_root=self.run_root,
                                                  demo_caches=layout, host_blocks=host_blocks,
                                                  log_level="WARNING", **options))
        except BaseException:
            os.rmdir(self.run_root)
            raise

    def __enter__(self) -> TransferClient:
        try:
            self.launcher.start()
            self.launcher.wait_ready(timeout=60)
            self.client = TransferClient(self.launcher.names.namespace, self.launcher.cfg.tp,
                                         run_root=self.run_root, task_timeout=120,
                                         path=self.path)
        except BaseException:  # __exit__ does not run: tear down here, run dir included
            self.launcher.stop()
            os.rmdir(self.run_root)
            raise
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.launcher.stop()
        os.rmdir(self.run_root)


# ------------------------------------------------------------------ tasks

TASKS_LAYOUT = "layers=8,block_tokens=16,heads=1,head_dim=128,dtype=float16,blocks=4096"


def _task_blocks(i: int, blocks: int, per_task: int) -> list[int]:
    """The blocks of the ``i``-th task of ``per_task`` consecutive blocks: tasks take
    the ``blocks // per_task`` slots in turn, so a window of fewer tasks never repeats
    a block (each task independent of the others in flight)."""
    start = (i % (blocks // per_task)) * per_task
    return [start] if per_task == 1 else list(range(start, start + per_task))


def _pipelined(client: TransferClient, n: int, window: int, blocks: int,
               per_task: int = 1) -> float:
    """Tasks/s of ``n`` evicts of ``per_task`` blocks (distinct blocks inside the window)."""
    inflight: deque = deque()
    t0 = time.perf_counter()
    for i in range(n):
        ids = _task_blocks(i, blocks, per_task)
        inflight.append(client.evict(ids, ids))
        if len(inflight) >= window:
            inflight.popleft().result(60)
    for f in inflight:
        f.result(60)
    return n / (time.perf_counter() - t0)


def _batched(client: TransferClient, n: int, per_batch: int, blocks: int, window: int,
             per_task: int = 1) -> float:
    """Tasks/s of ``n`` evicts sent ``per_batch`` per ``submit_batch``, at most ``window``
    in flight before a batch is sent (so ``window + per_batch`` after it)."""
    t0 = time.perf_counter()
    pending: deque = deque()
    for start in range(0, n, per_batch):
        specs = [TransferSpec.evict(ids, ids) for ids in (
            _task_blocks(i, blocks, per_task) for i in range(start, min(n, start + per_batch)))]
        pending.extend(client.submit_batch(specs))
        while len(pending) > window:
            pending.popleft().result(60)
    for f in pending:
        f.result(60)
    return n / (time.perf_counter() - t0)


def path_used(client: TransferClient) -> str:
    """Which channel the client's small tasks took: "ring" when every rank's rings
    were in use, "zmq" when none was, "mixed" otherwise."""
    rings = sum(p is not None for p in client._wire.rings)
    return "ring" if rings == client.tp_size else "zmq" if rings == 0 else "mixed"


def bench_tasks(args: argparse.Namespace) -> dict:
    """Merging off (the reference), on, and ``submit_batch``: both namespaces up at
    once and measured in turns, each round in a rotated order, so that the machine's
    load between rows moves every row alike.  Tasks of ``--blocks-per-task`` blocks
    (64 KiB each at this layout): above ``--inline-max-bytes`` (256 KiB, so from 5
    blocks on) the copy workers run them, not the I/O thread."""
    blocks = 4096
    per_task = args.blocks_per_task
    in_flight = args.window + 64  # batch64: the window, then the batch sent after it
    if in_flight * per_task > blocks:
        raise BenchError(f"--blocks-per-task {per_task}: {in_flight} tasks in flight (--window "
                         f"{args.window}, and a batch of 64) would repeat blocks of the "
                         f"{blocks}; use at most {blocks // in_flight}, or a smaller --window")
    merged = 0  # merged passes of the "merge" rows alone (batch64 runs in that namespace too)

    def merged_passes(client: TransferClient) -> int:
        return sum(r.fields["counters"]["merged_batches"]
                   for r in client.stats().result(10).replies.values())

    def merging(client: TransferClient) -> float:
        nonlocal merged
        before = merged_passes(client)
        rate = _pipelined(client, args.tasks, args.window, blocks, per_task)
        merged += merged_passes(client) - before
        return rate

    with _Namespace(args.tp, TASKS_LAYOUT, blocks, path=args.path, merge=False) as off, \
            _Namespace(args.tp, TASKS_LAYOUT, blocks, path=args.path, merge=True) as on:
        runs: list[tuple[str, Callable[[], float]]] = [
            ("no_merge", lambda: _pipelined(off, args.tasks, args.window, blocks, per_task)),
            ("merge", lambda: merging(on)),
            ("batch64", lambda: _batched(on, args.tasks, 64, blocks, args.window, per_task)),
        ]
        for client in (off, on):
            _pipelined(client, 500, args.window, blocks, per_task)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name, _ in runs}
        for k in range(args.repeat):
            for name, run in _rotated(runs, k):
                rates[name].append(run())
        paths = {"no_merge": path_used(off), "merge": path_used(on), "batch64": path_used(on)}
    base = statistics.median(rates["no_merge"])
    rows = []
    for name, _ in runs:
        rate = statistics.median(rates[name])
        row = {"mode": name, "tp": args.tp, "path": paths[name], "blocks_per_task": per_task,
               "tasks_per_s": round(rate), "vs_no_merge": round(rate / base, 2)}
        if name == "merge":
            row["merged_batches"] = merged
        rows.append(row)
    return {"tasks": rows}


# ------------------------------------------------------------------ layer-wise


def bench_layerwise(args: argparse.Namespace) -> dict:
    layers = args.layers
    layout = f"layers={layers},block_tokens=16,heads=8,head_dim=128,dtype=float16,blocks=128"
    nblocks = args.blocks
    first, full = [], []
    with _Namespace(1, layout, 128, path=args.path) as client:
        progress = LayerProgress(client.seg, 0)
        try:
            client.evict(list(range(nblocks)), list(range(nblocks))).result(60)
            for i in range(args.repeat + 2):
                dev = [(j + (i % 2) * nblocks) % 128 for j in range(nblocks)]
                t0 = time.perf_counter()
                fut = client.load(list(range(nblocks)), dev, layerwise=True)
                progress.wait(fut.task_id, 0, timeout=60)
                t_first = time.perf_counter() - t0
                fut.result(60)
                t_full = time.perf_counter() - t0
                if i >= 2:  # the first two warm the pages and the code paths
                    first.append(t_first)
                    full.append(t_full)
            path = path_used(client)
        finally:
            progress.close()
    f50, t50 = statistics.median(first), statistics.median(full)
    target = t50 / layers + 200e-6
    bytes_moved = nblocks * layers * 2 * 16 * 8 * 128 * 2
    return {"layerwise": {
        "layers": layers, "blocks": nblocks, "bytes": bytes_moved,
        "first_layer_us": round(f50 * 1e6, 1), "full_load_us": round(t50 * 1e6, 1),
        "target_us": round(target * 1e6, 1), "meets_target": f50 <= target,
        "first_over_full": round(f50 / t50, 4), "path": path,
    }}


# ------------------------------------------------------------------ control plane

_TOKEN_HEAD_BYTES = 16 * 128 * 2  # block_tokens=16, head_dim=128, float16: one head


def _kv_layout(block_bytes: int, blocks: int) -> str:
    """One layer, K and V, ``block_bytes`` per block and tensor (a multiple of
    :data:`_TOKEN_HEAD_BYTES`, made of whole heads)."""
    return (f"layers=1,block_tokens=16,heads={block_bytes // _TOKEN_HEAD_BYTES},head_dim=128,"
            f"dtype=float16,blocks={blocks}")


# One layer, K and V of 4 KiB per block: a 1-block evict copies 8 KiB (about a
# microsecond), so the round trip measures the control plane, not the copy.
CONTROL_BLOCKS = 1024
CONTROL_BLOCK_BYTES = _TOKEN_HEAD_BYTES
CONTROL_LAYOUT = _kv_layout(CONTROL_BLOCK_BYTES, CONTROL_BLOCKS)
_BLOCK_WARMUP = 10  # untimed round trips at the start of every timed block


class _ControlSystem(Protocol):
    """What the control bench drives: kvswap and each reference of ``bench_refs``."""

    name: str

    def roundtrip(self, i: int) -> None: ...

    def tasks_per_s(self, start: int, n: int, window: int) -> float: ...

    def server_pids(self) -> list[int]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class _KvswapControl:
    """kvswap through its public client: 1-block evicts, waited for on every rank."""

    name = "kvswap"

    def __init__(self, client: TransferClient, blocks: int):
        self.client = client
        self.blocks = blocks

    def roundtrip(self, i: int) -> None:
        b = i % self.blocks
        self.client.evict([b], [b]).result(REPLY_TIMEOUT_S)

    def tasks_per_s(self, start: int, n: int, window: int) -> float:
        return _pipelined(self.client, n, window, self.blocks)

    def server_pids(self) -> list[int]:
        return [int(self.client.seg.ranks[r, RankSlot.PID]) for r in range(self.client.tp_size)]

    def pause(self) -> None:
        """Idle daemons sleep in their poller: nothing to park."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def served(self) -> list[int]:
        """Tasks each rank completed, from the signal segment."""
        ranks = self.client.seg.ranks
        return [int(ranks[r, RankSlot.COMPLETED]) for r in range(self.client.tp_size)]


def _rotated(items: Sequence, k: int) -> list:
    """``items`` starting at ``k``: each round changes who runs first, so a burst
    of noise does not always hit the same system."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def _control_row(tp: int, args: argparse.Namespace) -> dict:
    """Measure kvswap, the floor and the baseline at one TP size, interleaved."""
    run_dir = tempfile.mkdtemp(prefix="kvb-ref-", dir="/tmp")
    try:
        with _Namespace(tp, CONTROL_LAYOUT, CONTROL_BLOCKS, path=args.path) as client, \
                FloorRef(tp, run_dir, CONTROL_BLOCKS) as floor, \
                BaselineRef(tp, run_dir, CONTROL_BLOCKS, CONTROL_BLOCK_BYTES) as baseline:
            kvswap = _KvswapControl(client, CONTROL_BLOCKS)
            systems: list[_ControlSystem] = [kvswap, floor, baseline]
            sent = {s.name: 0 for s in systems}
            p50: dict[str, list[float]] = {s.name: [] for s in systems}
            p99: dict[str, list[float]] = {s.name: [] for s in systems}
            rate: dict[str, list[float]] = {s.name: [] for s in systems}
            cpu: dict[str, list[float]] = {s.name: [] for s in systems}
            engine_cpu: list[float] = []  # the bench process alone, in kvswap's blocks
            engine_cpu_pipelined: list[float] = []  # ... in kvswap's pipelined blocks

            def latency_block(s: _ControlSystem, n: int) -> list[float]:
                """Round trips; also CPU per round trip of every process of the system.
                The bench process counts whole: the other systems' threads in it idle."""
                s.resume()
                try:
                    measure_latencies_us(s.roundtrip, sent[s.name], _BLOCK_WARMUP)
                    pids = s.server_pids()
                    e0 = time.process_time()
                    c0 = e0 + cpu_seconds(pids)
                    lat = measure_latencies_us(s.roundtrip, sent[s.name] + _BLOCK_WARMUP, n)
                    e1 = time.process_time()
                    cpu[s.name].append((e1 + cpu_seconds(pids) - c0) / n * 1e6)
                    if s is kvswap:
                        engine_cpu.append((e1 - e0) / n * 1e6)
                finally:
                    s.pause()
                sent[s.name] += _BLOCK_WARMUP + n
                return lat

            def pipelined_block(s: _ControlSystem, n: int) -> float:
                s.resume()
                try:
                    e0 = time.process_time()
                    r = s.tasks_per_s(sent[s.name], n, args.window)
                    if s is kvswap:
                        engine_cpu_pipelined.append((time.process_time() - e0) / n * 1e6)
                finally:
                    s.pause()
                sent[s.name] += n
                return r

            for s in systems:  # warm-up: code paths, sockets, page tables
                latency_block(s, args.warmup)
                pipelined_block(s, 2 * args.window)
            for k in range(args.rounds):
                for s in _rotated(systems, k):
                    lat = latency_block(s, args.samples)
                    p50[s.name].append(statistics.median(lat))
                    p99[s.name].append(_p99(lat))
                for s in _rotated(systems, k):
                    rate[s.name].append(pipelined_block(s, args.tasks))
            served = {"kvswap": kvswap.served(), "floor": floor.close(),
                      "baseline": baseline.close()}
            path = path_used(client)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    for name, counts in served.items():
        if any(c != sent[name] for c in counts):
            raise BenchError(f"tp {tp}: {name} ranks served {counts} tasks, "
                             f"the bench sent {sent[name]}")
    med = {name: statistics.median(v) for name, v in p50.items()}
    return {
        "tp": tp,
        "path": path,
        "kvswap_p50_us": round(med["kvswap"], 1),
        "kvswap_p99_us": round(statistics.median(p99["kvswap"]), 1),
        "floor_p50_us": round(med["floor"], 1),
        "floor_p99_us": round(statistics.median(p99["floor"]), 1),
        "baseline_p50_us": round(med["baseline"], 1),
        "baseline_p99_us": round(statistics.median(p99["baseline"]), 1),
        "kvswap_cpu_us": round(statistics.median(cpu["kvswap"])),
        "engine_cpu_us": round(statistics.median(engine_cpu)),
        "engine_cpu_pipelined_us": round(statistics.median(engine_cpu_pipelined)),
        "floor_cpu_us": round(statistics.median(cpu["floor"])),
        "baseline_cpu_us": round(statistics.median(cpu["baseline"])),
        "kvswap_tasks_per_s": round(statistics.median(rate["kvswap"])),
        "floor_tasks_per_s": round(statistics.median(rate["floor"])),
        "baseline_tasks_per_s": round(statistics.median(rate["baseline"])),
        "p50_vs_floor": round(med["kvswap"] / med["floor"], 2),
        "tasks_vs_floor": round(statistics.median(rate["kvswap"])
                                / statistics.median(rate["floor"]), 2),
        "baseline_vs_kvswap_p50": round(med["baseline"] / med["kvswap"], 2),
        "tasks_per_system": sent["kvswap"],  # the same schedule for every system
    }


def bench_control(args: argparse.Namespace) -> dict:
    return {"control": [_control_row(tp, args) for tp in args.tp]}


# ------------------------------------------------------------------ data plane

DATA_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)


def _data_rows(block_bytes: int, args: argparse.Namespace) -> list[dict]:
    """Scattered evicts and loads of one block size against ``numpy.copyto``, interleaved."""
    n = max(1, (args.mib << 20) // (2 * block_bytes))  # blocks per task (K and V each)
    pool = 2 * n  # ids drawn from twice as many blocks: random, non-contiguous sets
    task_bytes = 2 * n * block_bytes  # per rank
    src = np.ones(task_bytes, dtype=np.uint8)
    dst = np.zeros(task_bytes, dtype=np.uint8)  # both written once: no page faults timed
    rng = np.random.default_rng(args.seed)
    wall: dict[str, list[float]] = {"memcpy": [], "evict": [], "load": []}
    busy: dict[str, list[float]] = {"evict": [], "load": []}
    runs: list[int] = []
    with _Namespace(args.tp, _kv_layout(block_bytes, pool), pool) as client:
        every = np.arange(pool)
        client.evict(every, every).result(REPLY_TIMEOUT_S)  # fault in every page once
        client.load(every, every).result(REPLY_TIMEOUT_S)
        for k in range(args.rounds):
            dev = rng.permutation(pool)[:n]
            host = rng.permutation(pool)[:n]
            runs.append(plan_copy(dev, host).num_runs)
            for what in _rotated(("memcpy", "evict", "load"), k):
                t0 = time.perf_counter()
                if what == "memcpy":
                    np.copyto(dst, src)
                    wall[what].append(time.perf_counter() - t0)
                    continue
                fut = client.evict(dev, host) if what == "evict" else client.load(host, dev)
                res = fut.result(REPLY_TIMEOUT_S)
                wall[what].append(time.perf_counter() - t0)
                moved = [int(r.fields["bytes"]) for r in res.replies.values()]
                if any(m != task_bytes for m in moved):
                    raise BenchError(f"{what} of {n} blocks of {block_bytes} B: ranks report "
                                     f"{moved} bytes, expected {task_bytes} each")
                busy[what].append(max(r.exec_us for r in res.replies.values()) / 1e6)
    memcpy = task_bytes / statistics.median(wall["memcpy"]) / 1e9
    rows = []
    for op in ("evict", "load"):
        e2e = task_bytes / statistics.median(wall[op]) / 1e9
        exe = task_bytes / statistics.median(busy[op]) / 1e9
        rows.append({"block_bytes": block_bytes, "op": op, "tp": args.tp, "blocks": n,
                     "runs": int(statistics.median(runs)), "task_bytes": task_bytes,
                     "kvswap_gbps": round(e2e, 2), "kvswap_exec_gbps": round(exe, 2),
                     "memcpy_gbps": round(memcpy, 2), "ratio": round(e2e / memcpy, 2),
                     "exec_ratio": round(exe / memcpy, 2)})
    return rows


def bench_data(args: argparse.Namespace) -> dict:
    return {"data": [row for bb in args.sizes for row in _data_rows(bb, args)]}


# ------------------------------------------------------------------ plots

_PLOT_SIZE_IN = (6.0, 3.0)
_PLOT_DPI = 100
_COLORS = {"kvswap": "#1f77b4", "floor": "#7f7f7f", "baseline": "#d62728", "memcpy": "#7f7f7f",
           "exec": "#aec7e8"}


def _require_matplotlib() -> str | None:
    """None when matplotlib can be imported, else the error to print."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'kvswap[plot]'"
    return None


def _bars(ax, groups: list[str], series: dict[str, list[float]], colors: list[str]) -> None:
    """Grouped bars: one group per x label, one bar per series."""
    width = 0.8 / len(series)
    xs = np.arange(len(groups))
    for k, ((label, values), color) in enumerate(zip(series.items(), colors)):
        ax.bar(xs + (k - (len(series) - 1) / 2) * width, values, width, label=label, color=color)
    ax.set_xticks(xs, groups)
    ax.tick_params(labelsize=7)


def _save(fig, ax, path: str) -> None:
    """One legend under both panels (inside, it would hide a bar), then the PNG."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=_PLOT_DPI)


def plot_control(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    rows = result["control"]
    groups = [f"tp {r['tp']}" for r in rows]
    names = ("kvswap", "floor", "baseline")
    colors = [_COLORS[n] for n in names]
    fig = Figure(figsize=_PLOT_SIZE_IN, dpi=_PLOT_DPI)
    lat, thr = fig.subplots(1, 2)
    _bars(lat, groups, {n: [r[f"{n}_p50_us"] for r in rows] for n in names}, colors)
    lat.set_title("1-block evict round trip, p50 (µs)", fontsize=8)
    _bars(thr, groups, {n: [r[f"{n}_tasks_per_s"] for r in rows] for n in names}, colors)
    thr.set_title("pipelined tasks/s", fontsize=8)
    _save(fig, lat, path)


def plot_data(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    rows = result["data"]
    fig = Figure(figsize=_PLOT_SIZE_IN, dpi=_PLOT_DPI)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, op in zip(axes, ("evict", "load")):
        mine = [r for r in rows if r["op"] == op]
        groups = [f"{r['block_bytes'] >> 10} KiB" for r in mine]
        _bars(ax, groups, {"kvswap": [r["kvswap_gbps"] for r in mine],
                           "kvswap exec": [r["kvswap_exec_gbps"] for r in mine],
                           "memcpy": [r["memcpy_gbps"] for r in mine]},
              [_COLORS["kvswap"], _COLORS["exec"], _COLORS["memcpy"]])
        ax.set_title(f"scattered {op}, GB/s per rank", fontsize=8)
    _save(fig, axes[0], path)


# ------------------------------------------------------------------ gpu

GPU_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"
NO_GPU_MESSAGE = "no CUDA device: kvswap bench gpu needs cupy and a GPU"


def _gpu_unavailable() -> str | None:
    """Why the GPU bench cannot run here, or None."""
    try:
        import cupy
    except ImportError as exc:
        return f"cupy cannot be imported: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"CUDA runtime: {exc}"
    return None if count > 0 else "cupy sees no device"


def run_gpu(args: argparse.Namespace) -> int:
    """Run ``scripts/bench_gpu.py`` with this interpreter; exit 2 without a GPU."""
    why = _gpu_unavailable()
    if why is not None:
        print(f"{NO_GPU_MESSAGE} ({why})", file=sys.stderr)
        return 2
    if not GPU_SCRIPT.is_file():
        print(f"kvswap bench gpu: {GPU_SCRIPT} not found (it ships with a source checkout)",
              file=sys.stderr)
        return 2
    return subprocess.run(gpu_command(args.json), check=False).returncode


def gpu_command(as_json: bool) -> list[str]:
    """``scripts/bench_gpu.py``'s command line; ``--json -`` puts its JSON on stdout."""
    return [sys.executable, str(GPU_SCRIPT), *(["--json", "-"] if as_json else [])]


# ------------------------------------------------------------------ CLI

SCENARIOS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                           Callable[[argparse.Namespace], dict], str]] = {}
PLOTS: dict[str, Callable[[dict, str], None]] = {"control": plot_control, "data": plot_data}
# Subcommands of ``kvswap bench`` that are not one measurement of SCENARIOS: they
# print their own output and return the exit status.  ``all``: kvswap.daemon.bench_all.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"gpu": run_gpu}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _block_sizes(text: str) -> list[int]:
    sizes = _int_list(text)
    bad = [s for s in sizes if s % _TOKEN_HEAD_BYTES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"block sizes must be multiples of {_TOKEN_HEAD_BYTES} bytes, got {bad}")
    return sizes


# ------------------------------------------------------------------ storage

STORAGE_LAYOUT = "layers=4,block_tokens=16,heads=8,head_dim=128,dtype=float16,blocks=32"


def _redis_server() -> RedisServer:
    """``--redis auto``: a throw-away redis-server, started."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise KvswapError("--redis auto needs redis-server on PATH", ErrorCode.STORAGE_ERROR)
    server = RedisServer(binary)
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        raise KvswapError(f"redis-server did not start: {exc}", ErrorCode.STORAGE_ERROR) from None
    return server


def _drop_cache(root: str) -> None:
    """Write back and drop from the page cache every file under ``root`` (no root
    privileges needed), so the next read comes from the device."""
    os.sync()
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _file_reference(payloads: list[bytes], root: str, cold: bool) -> tuple[float, float]:
    """Plain file I/O of the same payloads: one file each, written then read back."""
    ref = os.path.join(root, "ref")
    os.makedirs(ref, exist_ok=True)
    paths = [os.path.join(ref, f"ref{i}") for i in range(len(payloads))]
    t0 = time.perf_counter()
    for p, data in zip(paths, payloads):
        with open(p, "wb") as f:
            f.write(data)
    t1 = time.perf_counter()
    if cold:
        _drop_cache(ref)
        t1 = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            f.read()
    t2 = time.perf_counter()
    for p in paths:
        os.unlink(p)
    return t1 - t0, t2 - t1


def _redis_reference(payloads: list[bytes], url: str, salt: int) -> tuple[float, float]:
    """Raw pipelined SET / MGET of the same payloads."""
    import redis

    conn = redis.Redis.from_url(url)
    names = [f"kvswap-bench-ref.{salt}.{i}" for i in range(len(payloads))]
    try:
        t0 = time.perf_counter()
        pipe = conn.pipeline(transaction=False)
        for n, data in zip(names, payloads):
            pipe.set(n, data)
        pipe.execute()
        t1 = time.perf_counter()
        conn.mget(names)
        t2 = time.perf_counter()
        conn.delete(*names)
    finally:
        conn.close()
    return t1 - t0, t2 - t1


class _MooncakeRef:
    """``--mooncake``: the store for the daemons and the raw reference client.

    With ``auto``: a throw-away ``mooncake_master`` and, in this process, the only
    segment (a client that mounts ``segment_bytes``), so the daemon's, the
    backend's and the reference's objects all cross the transfer engine to the
    same memory.  The reference client mounts nothing and moves the same bytes
    with raw ``batch_put_from`` / ``batch_get_into`` from one registered buffer."""

    def __init__(self, spec: str, segment_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        from kvswap.daemon.storage.mooncake import MooncakeSettings

        self.master: MooncakeMaster | None = None
        self.holder: MooncakeDistributedStore | None = None
        if spec == "auto":
            binary = find_master()
            if binary is None:
                raise BenchError("--mooncake auto needs mooncake_master: pip install "
                                 "'kvswap[mooncake]'")
            self.master = MooncakeMaster(binary)
            try:
                self.master.start()
            except BaseException:
                self.master.close()  # its directory (and the process, if it runs)
                raise
            self.url = self.master.url(segment="0", timeout_s=30)
        else:
            self.url = spec
        settings = MooncakeSettings.parse(self.url)
        try:
            if self.master is not None:
                self.holder = self._client(settings, segment_bytes)
            self.ref = self._client(settings, 0)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _client(settings, segment: int):
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        rc = client.setup(settings.local_hostname or "127.0.0.1", settings.metadata, segment,
                          settings.buffer, settings.protocol, settings.device, settings.master)
        if rc != 0:
            raise BenchError(f"mooncake store client setup failed ({rc}) for {settings.master}")
        return client

    def raw(self, buf: np.ndarray, out: np.ndarray, salt: int) -> tuple[float, float]:
        """Raw batch_put_from / batch_get_into of ``buf``'s rows (both buffers registered)."""
        n, size = buf.shape
        names = [f"kvswap-bench-ref.{salt}.{i}" for i in range(n)]
        t0 = time.perf_counter()
        put = self.ref.batch_put_from(names, [buf.ctypes.data + i * size for i in range(n)],
                                      [size] * n)
        t1 = time.perf_counter()
        got = self.ref.batch_get_into(names, [out.ctypes.data + i * size for i in range(n)],
                                      [size] * n)
        t2 = time.perf_counter()
        self.ref.batch_remove(names, True)
        if any(put) or any(g != size for g in got):
            raise BenchError(f"raw mooncake reference failed: put {set(put)}, get {set(got)}")
        return t1 - t0, t2 - t1

    def close(self) -> None:
        for client in (getattr(self, "ref", None), self.holder):
            if client is not None:
                client.close()
        if self.master is not None:
            self.master.close()


def _mooncake_backend_row(store: _MooncakeRef, payloads: np.ndarray, repeat: int) -> dict:
    """The backend alone (no daemon): put / get of packed entries from a registered pool
    into registered staging, against the raw calls of the same bytes."""
    from kvswap.daemon.storage import HEADER_BYTES, pack_entry
    from kvswap.daemon.storage.mooncake import MooncakeBackend

    n, block_bytes = payloads.shape
    backend = MooncakeBackend.from_url(store.url)
    stage = np.zeros((n, HEADER_BYTES + block_bytes), np.uint8)
    out = np.zeros_like(payloads)
    backend.register_buffers("host", [payloads])
    backend.register_buffers("staging", [stage])
    for buf in (payloads, out):
        store.ref.register_buffer(buf.ctypes.data, buf.nbytes)
    samples: dict[str, list[float]] = {k: [] for k in ("put", "get", "ref_w", "ref_r")}
    fp = bytes(16)
    try:
        for rnd in range(repeat + 1):
            names = [f"kvswap.bench.r0.{rnd}.{i}" for i in range(n)]
            t0 = time.perf_counter()
            backend.put([(name, pack_entry(fp, name, [payloads[i]]))
                         for i, name in enumerate(names)])
            t1 = time.perf_counter()
            got = backend.get(names, [memoryview(row) for row in stage])
            t2 = time.perf_counter()
            if any(g is None or len(g) != HEADER_BYTES + block_bytes for g in got):
                raise BenchError("mooncake backend: an entry did not come back whole")
            backend.delete(names)
            ref = store.raw(payloads, out, 10**6 + rnd)
            if rnd:
                samples["put"].append(t1 - t0)
                samples["get"].append(t2 - t1)
                samples["ref_w"].append(ref[0])
                samples["ref_r"].append(ref[1])
        bounced = backend.bounced_bytes // (repeat + 1)
    finally:
        backend.close()
        for buf in (payloads, out):
            store.ref.unregister_buffer(buf.ctypes.data)
    return _storage_row("mooncake-backend", False, n, block_bytes, samples["put"],
                        samples["get"], samples["ref_w"], samples["ref_r"],
                        copied_per_entry=bounced // n)


def _storage_row(kind: str, cold: bool, n: int, block_bytes: int, backup: list[float],
                 prefetch: list[float], ref_w: list[float], ref_r: list[float],
                 **extra: Any) -> dict:
    total = n * block_bytes
    med = {k: statistics.median(v) for k, v in (("backup", backup), ("prefetch", prefetch),
                                                 ("ref_w", ref_w), ("ref_r", ref_r))}
    return {
        "backend": kind, "cold": cold, "blocks": n, "block_bytes": block_bytes,
        "backup_gbps": round(total / med["backup"] / 1e9, 3),
        "reference_write_gbps": round(total / med["ref_w"] / 1e9, 3),
        "backup_ratio": round(med["ref_w"] / med["backup"], 2),
        "prefetch_gbps": round(total / med["prefetch"] / 1e9, 3),
        "reference_read_gbps": round(total / med["ref_r"] / 1e9, 3),
        "prefetch_ratio": round(med["ref_r"] / med["prefetch"], 2),
        **extra,
    }


def bench_storage(args: argparse.Namespace) -> dict:
    """Backup and prefetch GB/s through kvswap vs the same bytes through the bare store."""
    n = args.blocks
    tensors = demo_layout(STORAGE_LAYOUT)
    block_bytes = sum(int(np.prod(t.shape[1:])) * np.dtype(t.dtype).itemsize for t in tensors)
    rng = np.random.default_rng(0)
    payload_rows = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    payloads = [row.tobytes() for row in payload_rows]
    store_dir = tempfile.mkdtemp(prefix="kvb-store-", dir=args.dir)
    redis_server: RedisServer | None = None
    mooncake: _MooncakeRef | None = None
    rows = []
    try:
        targets = [("file", f"file://{store_dir}/kv")]
        if args.redis:
            redis_server = _redis_server() if args.redis == "auto" else None
            targets.append(("redis", redis_server.url if redis_server else args.redis))
        if args.mooncake:
            # every round's entries stay (daemon) or are deleted (backend, reference)
            room = (args.repeat + 4) * n * (block_bytes + 4096) + (64 << 20)
            mooncake = _MooncakeRef(args.mooncake, room)
            targets.append(("mooncake", mooncake.url))
        for kind, url in targets:
            samples: dict[str, list[float]] = {k: [] for k in ("backup", "prefetch", "ref_w",
                                                             "ref_r")}
            out = np.zeros_like(payload_rows)
            if mooncake is not None and kind == "mooncake":
                for buf in (payload_rows, out):
                    mooncake.ref.register_buffer(buf.ctypes.data, buf.nbytes)
            with _Namespace(1, STORAGE_LAYOUT, n, storage_url=url) as client:
                client.evict(list(range(min(n, 32))), list(range(min(n, 32)))).result(60)
                for rnd in range(args.repeat + 1):
                    keys = block_hashes(list(range(rnd * 10**6, rnd * 10**6 + 16 * n)), 16)
                    t0 = time.perf_counter()
                    client.backup(list(range(n)), keys).result(120)
                    t1 = time.perf_counter()
                    if args.cold and kind == "file":
                        _drop_cache(store_dir)
                        t1 = time.perf_counter()
                    got = client.prefetch(keys, list(range(n))).result(120)
                    t2 = time.perf_counter()
                    if got.count != n:
                        raise KvswapError(f"prefetch loaded {got.count} of {n} blocks",
                                          ErrorCode.STORAGE_ERROR)
                    if kind == "file":
                        ref = _file_reference(payloads, store_dir, args.cold)
                    elif kind == "redis":
                        ref = _redis_reference(payloads, url, rnd)
                    else:
                        assert mooncake is not None
                        ref = mooncake.raw(payload_rows, out, rnd)
                    if rnd:  # the first round warms caches and connections
                        samples["backup"].append(t1 - t0)
                        samples["prefetch"].append(t2 - t1)
                        samples["ref_w"].append(ref[0])
                        samples["ref_r"].append(ref[1])
            if mooncake is not None and kind == "mooncake":
                for buf in (payload_rows, out):
                    mooncake.ref.unregister_buffer(buf.ctypes.data)
            rows.append(_storage_row(kind, bool(args.cold and kind == "file"), n, block_bytes,
                                     samples["backup"], samples["prefetch"], samples["ref_w"],
                                     samples["ref_r"]))
        if mooncake is not None:
            rows.append(_mooncake_backend_row(mooncake, payload_rows, args.repeat))
    finally:
        if redis_server is not None:
            redis_server.close()
        if mooncake is not None:
            mooncake.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return {"storage": rows, "replication": _replication(args)}


REPLICATION_LAYOUT = "layers=4,block_tokens=16,heads=1,head_dim=576,dtype=float16,mla=1"


def _replication(args: argparse.Namespace) -> list[dict]:
    """Bytes the file store holds per block for an MLA cache at TP=2, its latent tensors
    registered as replicated (one copy, written by rank 0) and not (one per rank)."""
    n, tp = args.blocks, 2
    rows = []
    for replicated in (0, 1):
        layout = f"{REPLICATION_LAYOUT},blocks={n},replicated={replicated}"
        store_dir = tempfile.mkdtemp(prefix="kvb-store-", dir=args.dir)
        try:
            with _Namespace(tp, layout, n, storage_url=f"file://{store_dir}/kv") as client:
                keys = block_hashes(list(range(16 * n)), 16)
                client.evict(list(range(n)), list(range(n))).result(60)
                client.backup(list(range(n)), keys).result(120)
                if client.prefetch(keys, list(range(n))).result(120).count != n:
                    raise KvswapError("prefetch of the backed-up blocks came up short",
                                      ErrorCode.STORAGE_ERROR)
            files = [os.path.join(d, f) for d, _, fs in os.walk(store_dir) for f in fs]
            stored = sum(os.path.getsize(f) for f in files)
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
        rows.append({"tp": tp, "replicated": bool(replicated), "blocks": n,
                     "entries": len(files), "stored_bytes_per_block": stored // n})
    rows[1]["ratio"] = round(rows[0]["stored_bytes_per_block"]
                             / rows[1]["stored_bytes_per_block"], 2)
    rows[0]["ratio"] = 1.0
    return rows


_COUNT = value_type(int, at_least(1))
_TP = value_type(int, between(1, MAX_RANKS))


def _args_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=_COUNT, default=128, metavar="N",
                   help="blocks per backup / prefetch")
    p.add_argument("--repeat", type=_COUNT, default=5, metavar="N",
                   help="measurements per figure (the median is reported)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="where the file store's temporary directory goes (default: the system's "
                        "temporary directory)")
    p.add_argument("--cold", action="store_true",
                   help="file store: drop the store's and the reference's files from the page "
                        "cache before reading (the data a storage tier holds is not in memory)")
    p.add_argument("--redis", default=None, metavar="URL|auto",
                   help="also measure Redis at URL, or 'auto' to start a throw-away "
                        "redis-server (default: file store only)")
    p.add_argument("--mooncake", default=None, metavar="URL|auto",
                   help="also measure Mooncake Store at a mooncake:// URL, or 'auto' to start "
                        "a throw-away mooncake_master (needs kvswap[mooncake]): through the "
                        "daemon and the backend alone, against raw batch_put_from / "
                        "batch_get_into of the same bytes")


def _arg_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", choices=("ring", "zmq"), default="ring",
                   help="the client's channel to the daemons: shared-memory rings (what "
                        "fits; the default) or ZeroMQ only")


def _args_tasks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_TP, default=1, metavar="N", help="number of ranks")
    p.add_argument("--tasks", type=_COUNT, default=5000, metavar="N",
                   help="tasks per measurement")
    p.add_argument("--window", type=_COUNT, default=256, metavar="N", help="tasks in flight")
    p.add_argument("--repeat", type=_COUNT, default=3, metavar="N",
                   help="measurements per figure (the median is reported)")
    p.add_argument("--blocks-per-task", type=_COUNT, default=1, metavar="N",
                   help="blocks of each evict, 64 KiB each: from 5 on (above "
                        "--inline-max-bytes) the copy workers run them")
    _arg_path(p)


def _args_layerwise(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=_COUNT, default=32, metavar="N",
                   help="layers of the simulated cache")
    p.add_argument("--blocks", type=_COUNT, default=32, metavar="N", help="blocks per load")
    p.add_argument("--repeat", type=_COUNT, default=15, metavar="N",
                   help="loads measured (the median is reported)")
    _arg_path(p)


def _args_control(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_int_list, default=[1, 2], metavar="N,...",
                   help="TP sizes, e.g. 1,2,4 (default: 1,2)")
    p.add_argument("--rounds", type=_COUNT, default=5, metavar="N",
                   help="rounds; each measures every system once, in rotating order")
    p.add_argument("--samples", type=_COUNT, default=200, metavar="N",
                   help="round trips per system and round")
    p.add_argument("--tasks", type=_COUNT, default=1000, metavar="N",
                   help="pipelined tasks per system and round")
    p.add_argument("--window", type=_COUNT, default=64, metavar="N",
                   help="pipelined tasks in flight")
    p.add_argument("--warmup", type=value_type(int, at_least(0)), default=100, metavar="N",
                   help="untimed round trips first")
    _arg_path(p)


def _args_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=_block_sizes, default=list(DATA_SIZES), metavar="BYTES,...",
                   help="bytes per block and tensor (multiples of 4096), e.g. 4096,65536 "
                        f"(default: {','.join(map(str, DATA_SIZES))})")
    p.add_argument("--mib", type=_COUNT, default=64, metavar="N",
                   help="MiB moved per task and rank")
    p.add_argument("--tp", type=_TP, default=1, metavar="N", help="number of ranks")
    p.add_argument("--rounds", type=_COUNT, default=5, metavar="N",
                   help="rounds per block size; each times the reference copy, an evict and a "
                        "load, in rotating order")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random block sets")


SCENARIOS["tasks"] = (_args_tasks, bench_tasks, "tasks/s of small tasks: merging, batching")
SCENARIOS["storage"] = (_args_storage, bench_storage,
                        "backup / prefetch GB/s vs plain file I/O, raw Redis SET/GET and raw "
                        "Mooncake batch_put_from/batch_get_into; bytes stored per block of an "
                        "MLA cache at TP=2, replicated or not")
SCENARIOS["layerwise"] = (_args_layerwise, bench_layerwise,
                          "time to the first layer vs the whole layer-wise load")
SCENARIOS["control"] = (_args_control, bench_control,
                        "1-block evict round trip and tasks/s vs a ZeroMQ floor and the "
                        "reference design's manager queue")
SCENARIOS["data"] = (_args_data, bench_data,
                     "GB/s of scattered-block evicts and loads vs numpy.copyto")
SCENARIOS["trace"] = (bench_trace.add_trace_args, bench_trace.bench_trace,
                      "replay a request trace through device, host (HostCache) and storage "
                      "tiers, with daemons and as bookkeeping only")
SCENARIOS["hostcache"] = (bench_trace.add_hostcache_args, bench_trace.bench_hostcache,
                          "ns per block of HostCache's bookkeeping vs a plain OrderedDict LRU")
SCENARIOS["peer"] = (bench_peer.add_args, bench_peer.bench_peer,
                     "node-to-node send_to / receive_into GB/s and one-block latency vs raw "
                     "Transfer Engine writes (needs the [mooncake] extra)")
PLOTS["trace"] = bench_trace.plot_trace
PLOTS["hostcache"] = bench_trace.plot_hostcache


def add_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add ``kvswap bench`` and a subcommand per scenario; return its subparsers, where
    commands built on the scenarios (``bench all``) register themselves."""
    bp = sub.add_parser("bench", help="benchmarks against baselines measured in the same run",
                        formatter_class=HelpFormatter)
    bsub = bp.add_subparsers(dest="scenario", required=True)
    for name, (add_args, _, help_text) in SCENARIOS.items():
        sp = bsub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        add_args(sp)
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        if name in PLOTS:
            sp.add_argument("--plot", metavar="FILE.png", default=None,
                            help="also draw the result as a small PNG (needs matplotlib)")
    gp = bsub.add_parser("gpu", help="run scripts/bench_gpu.py (needs cupy and a CUDA device; "
                                     "exit status 2 without one)",
                         formatter_class=HelpFormatter)
    gp.add_argument("--json", action="store_true", help="print one JSON object")
    return bsub


def _table(result: dict) -> str:
    lines = []
    for section, rows in result.items():
        rows = rows if isinstance(rows, list) else [rows]
        cols = list(rows[0])
        widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
        lines.append(f"[{section}]")
        lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.scenario in COMMANDS:
        return COMMANDS[args.scenario](args)
    plot_path = getattr(args, "plot", None)
    if plot_path is not None:
        missing = _require_matplotlib()
        if missing is not None:  # before minutes of measuring, not after
            print(f"kvswap bench {args.scenario}: {missing}", file=sys.stderr)
            return 2
    try:
        result = SCENARIOS[args.scenario][1](args)
    except BenchError as exc:
        print(f"kvswap bench {args.scenario}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else _table(result), flush=True)
    if plot_path is not None:
        PLOTS[args.scenario](result, plot_path)
    return 0
