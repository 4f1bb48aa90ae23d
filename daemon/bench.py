"""``kvswap bench``: benchmarks, each against a reference measured in the same run.

These machines are shared and noisy, so every figure is reported next to a
baseline taken seconds apart by the same command; compare ratios, not absolutes.

Scenarios (``kvswap bench <name> [--json]``):

* ``tasks``: many small independent tasks, pipelined: tasks/s with merging
  on, with merging off (the reference), and through the batch API.
* ``layerwise``: a layer-wise load of L layers: time until layer 0 is ready
  (seen by a waiter, as a TP worker sees it) against the time of the whole load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import deque
from typing import Callable

from kvswap.client.layer_progress import LayerProgress
from kvswap.client.transfer_client import TransferClient, TransferSpec
from kvswap.daemon.launcher import LaunchConfig, Launcher


class _Namespace:
    """A throw-away launched namespace for one measurement."""

    def __init__(self, tp: int, layout: str, host_blocks: int, daemon_args: list[str]):
        self.run_root = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
        ns = f"bench-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.launcher = Launcher(LaunchConfig(namespace=ns, tp=tp, run_root=self.run_root,
                                              demo_caches=layout, host_blocks=host_blocks,
                                              daemon_args=daemon_args, log_level="WARNING"))

    def __enter__(self) -> TransferClient:
        self.launcher.start()
        try:
            self.launcher.wait_ready(timeout=60)
            self.client = TransferClient(self.launcher.names.namespace, self.launcher.cfg.tp,
                                         run_root=self.run_root, task_timeout=120)
        except BaseException:
            self.launcher.stop()
            raise
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.launcher.stop()
        os.rmdir(self.run_root)


# ------------------------------------------------------------------ tasks

TASKS_LAYOUT = "layers=8,block_tokens=16,heads=1,head_dim=128,dtype=float16,blocks=4096"


def _pipelined(client: TransferClient, n: int, window: int, blocks: int) -> float:
    """Tasks/s of ``n`` one-block evicts (distinct blocks inside the window)."""
    inflight: deque = deque()
    t0 = time.perf_counter()
    for i in range(n):
        b = i % blocks
        inflight.append(client.evict([b], [b]))
        if len(inflight) >= window:
            inflight.popleft().result(60)
    for f in inflight:
        f.result(60)
    return n / (time.perf_counter() - t0)


def _batched(client: TransferClient, n: int, per_batch: int, blocks: int) -> float:
    t0 = time.perf_counter()
    pending: deque = deque()
    for start in range(0, n, per_batch):
        specs = [TransferSpec.evict([b % blocks], [b % blocks])
                 for b in range(start, min(n, start + per_batch))]
        pending.extend(client.submit_batch(specs))
        while len(pending) > 4 * per_batch:
            pending.popleft().result(60)
    for f in pending:
        f.result(60)
    return n / (time.perf_counter() - t0)


def bench_tasks(args: argparse.Namespace) -> dict:
    blocks = 4096
    rows = []
    for label, daemon_args in (("no_merge", ["--no-merge"]), ("merge", [])):
        with _Namespace(args.tp, TASKS_LAYOUT, blocks, daemon_args) as client:
            _pipelined(client, 500, args.window, blocks)  # warm-up
            rate = statistics.median(_pipelined(client, args.tasks, args.window, blocks)
                                     for _ in range(args.repeat))
            row = {"mode": label, "tp": args.tp, "tasks_per_s": round(rate)}
            if label == "merge":
                merged = sum(r.fields["counters"]["merged_batches"]
                             for r in client.stats().result(10).replies.values())
                row["merged_batches"] = merged
                batch_rate = statistics.median(_batched(client, args.tasks, 64, blocks)
                                               for _ in range(args.repeat))
                rows.append(row)
                row = {"mode": "batch64", "tp": args.tp, "tasks_per_s": round(batch_rate)}
            rows.append(row)
    base = rows[0]["tasks_per_s"]
    for r in rows:
        r["vs_no_merge"] = round(r["tasks_per_s"] / base, 2)
    return {"tasks": rows}


# ------------------------------------------------------------------ layer-wise


def bench_layerwise(args: argparse.Namespace) -> dict:
    layers = args.layers
    layout = f"layers={layers},block_tokens=16,heads=8,head_dim=128,dtype=float16,blocks=128"
    nblocks = args.blocks
    first, full = [], []
    with _Namespace(1, layout, 128, []) as client:
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
        finally:
            progress.close()
    f50, t50 = statistics.median(first), statistics.median(full)
    target = t50 / layers + 200e-6
    bytes_moved = nblocks * layers * 2 * 16 * 8 * 128 * 2
    return {"layerwise": {
        "layers": layers, "blocks": nblocks, "bytes": bytes_moved,
        "first_layer_us": round(f50 * 1e6, 1), "full_load_us": round(t50 * 1e6, 1),
        "target_us": round(target * 1e6, 1), "meets_target": f50 <= target,
        "first_over_full": round(f50 / t50, 4),
    }}


# ------------------------------------------------------------------ CLI

SCENARIOS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                           Callable[[argparse.Namespace], dict], str]] = {}


def _args_tasks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tasks", type=int, default=5000)
    p.add_argument("--window", type=int, default=256, help="tasks in flight")
    p.add_argument("--repeat", type=int, default=3)


def _args_layerwise(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=32, help="blocks per load")
    p.add_argument("--repeat", type=int, default=15)


SCENARIOS["tasks"] = (_args_tasks, bench_tasks, "tasks/s of small tasks: merging, batching")
SCENARIOS["layerwise"] = (_args_layerwise, bench_layerwise,
                          "time to the first layer vs the whole layer-wise load")


def add_parser(sub: argparse._SubParsersAction) -> None:
    bp = sub.add_parser("bench", help="benchmarks against baselines measured in the same run")
    bsub = bp.add_subparsers(dest="scenario", required=True)
    for name, (add_args, _, help_text) in SCENARIOS.items():
        sp = bsub.add_parser(name, help=help_text)
        add_args(sp)
        sp.add_argument("--json", action="store_true", help="print one JSON object")


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
    result = SCENARIOS[args.scenario][1](args)
    print(json.dumps(result) if args.json else _table(result), flush=True)
    return 0
