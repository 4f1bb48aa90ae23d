#!/usr/bin/env python3
"""Benchmark kvswap's CUDA data mover against cudaMemcpyAsync, per direction.

Runs the daemon's own copier (``kvswap.kernels.cuda_copy.CudaTaskCopier`` over a
host buffer pinned by the daemon's ``PinnedHostRange``) in one process, and in
the same run measures ``cudaMemcpyAsync`` of the same total bytes between the
same pinned buffer and the same device buffer.  Reported as GB/s and as a
ratio to that baseline, so numbers compare across machines.

Cases, for evict (device -> host) and load (host -> device):

* ``contiguous``: one run of consecutive blocks on both sides (the copier sends
  it to cudaMemcpyAsync, one call per tensor);
* ``scattered``: random, non-contiguous blocks of 4, 8, 64 and 512 KiB (one
  kernel launch for all tensors);
* ``--sweep``: tasks made of runs of L consecutive blocks, for several L, with
  the runs sent to cudaMemcpyAsync (threshold = L) or to the kernel (threshold
  above every run).  The smallest L from which cudaMemcpyAsync is at least as
  fast is the value to set as ``KVSWAP_MEMCPY_RUN_BLOCKS``.

Usage: python scripts/bench_gpu.py [--device N] [--tensors 8] [--task-mib 64]
       [--reps 7] [--no-sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from kvswap.daemon.cuda_memory import PinnedHostRange
from kvswap.kernels.cuda_copy import CudaTaskCopier, TensorPointers, import_cupy

SCATTERED_KIB = (4, 8, 64, 512)
SWEEP_KIB = (16, 64)
SWEEP_RUNS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Row:
    direction: str  # evict | load
    case: str  # contiguous | scattered | runs of L
    block_kib: int
    tensors: int
    blocks_per_task: int
    mib_per_task: float
    kvswap_gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.kvswap_gbps / self.memcpy_gbps if self.memcpy_gbps else 0.0


class Rig:
    """``tensors`` device tensors and their host regions, ``slots`` blocks each:
    one device allocation and one pinned, mapped host buffer (as in the daemon)."""

    def __init__(self, cupy: Any, device: int, tensors: int, block_bytes: int, slots: int):
        self.cupy = cupy
        self.device = device
        self.block_bytes = block_bytes
        self.slots = slots
        self.tensor_bytes = slots * block_bytes
        nbytes = tensors * self.tensor_bytes
        with cupy.cuda.Device(device):
            self.dev = cupy.empty(nbytes, dtype=cupy.uint8)
            self.dev[:] = cupy.arange(nbytes, dtype=cupy.uint32).astype(cupy.uint8)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.host = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        # One registration, so the memcpy baseline never spans two.
        self.pinned = PinnedHostRange(cupy.cuda.runtime, self.host, chunk_bytes=nbytes)
        with cupy.cuda.Device(device):
            self.pinned.pin()
        assert self.pinned.mapped_delta is not None
        dev0 = self.dev.data.ptr
        host0 = int(self.host.__array_interface__["data"][0])
        self.pointers = [
            TensorPointers(f"t{i}", dev0 + i * self.tensor_bytes, host0 + i * self.tensor_bytes,
                           host0 + i * self.tensor_bytes + self.pinned.mapped_delta, block_bytes)
            for i in range(tensors)]

    def copier(self, memcpy_run_blocks: int) -> CudaTaskCopier:
        return CudaTaskCopier(self.device, self.pointers, self.pinned.boundaries,
                              memcpy_run_blocks)

    def memcpy(self, to_host: bool, nbytes: int) -> None:
        """The baseline: one cudaMemcpyAsync of ``nbytes`` between the same buffers."""
        rt = self.cupy.cuda.runtime
        host = int(self.host.__array_interface__["data"][0])
        with self.cupy.cuda.Device(self.device):
            if to_host:
                rt.memcpyAsync(host, self.dev.data.ptr, nbytes, rt.memcpyDeviceToHost,
                               self.stream.ptr)
            else:
                rt.memcpyAsync(self.dev.data.ptr, host, nbytes, rt.memcpyHostToDevice,
                               self.stream.ptr)
            self.stream.synchronize()

    def check_evicted(self, dev_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """The last evict really moved the bytes (first and last tensor, a few blocks)."""
        bb = self.block_bytes
        for p_index in (0, len(self.pointers) - 1):
            base = p_index * self.tensor_bytes
            for d, h in list(zip(dev_ids.tolist(), host_ids.tolist()))[:4]:
                want = self.dev[base + d * bb: base + (d + 1) * bb].get()
                got = self.host[base + h * bb: base + (h + 1) * bb]
                if not np.array_equal(got, want):
                    raise RuntimeError(f"evict moved wrong bytes (tensor {p_index}, device block "
                                       f"{d} -> host block {h})")

    def close(self) -> None:
        with self.cupy.cuda.Device(self.device):
            self.stream.synchronize()
            self.pinned.unpin()
            self.dev = None


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rig: Rig, copier: CudaTaskCopier, dev_ids: np.ndarray, host_ids: np.ndarray,
            reps: int) -> dict[str, tuple[float, float]]:
    """{direction: (kvswap GB/s, memcpy GB/s)} for one task shape."""
    nbytes = len(dev_ids) * rig.block_bytes * len(rig.pointers)
    out = {}
    for direction, to_host in (("evict", True), ("load", False)):
        ours = median_seconds(lambda: copier.copy(to_host, dev_ids, host_ids), reps)
        if to_host:
            rig.check_evicted(dev_ids, host_ids)
        base = median_seconds(lambda: rig.memcpy(to_host, nbytes), reps)
        out[direction] = (nbytes / ours / 1e9, nbytes / base / 1e9)
    return out


def task_blocks(task_bytes: int, tensors: int, block_bytes: int) -> int:
    return max(8, task_bytes // (tensors * block_bytes))


def run_cases(cupy: Any, args: argparse.Namespace, rng: np.random.Generator) -> list[Row]:
    rows = []
    cases = [("contiguous", 64)] + [("scattered", kib) for kib in SCATTERED_KIB]
    for case, kib in cases:
        bb = kib << 10
        n = task_blocks(args.task_mib << 20, args.tensors, bb)
        rig = Rig(cupy, args.device, args.tensors, bb, 2 * n)
        try:
            if case == "contiguous":
                dev_ids, host_ids = np.arange(n), np.arange(n, 2 * n)
            else:
                dev_ids = rng.permutation(2 * n)[:n]
                host_ids = rng.permutation(2 * n)[:n]
            copier = rig.copier(args.memcpy_run_blocks)
            try:
                for direction, (ours, base) in measure(rig, copier, dev_ids, host_ids,
                                                       args.reps).items():
                    rows.append(Row(direction, case, kib, args.tensors, n,
                                    n * bb * args.tensors / 2**20, ours, base))
            finally:
                copier.close()
        finally:
            rig.close()
    return rows


def runs_of(length: int, n_runs: int, slots: int, rng: np.random.Generator) -> np.ndarray:
    """Ids of ``n_runs`` runs of ``length`` consecutive blocks at random, disjoint
    places, never adjacent (so the planner cannot merge two runs)."""
    starts = rng.permutation(slots // (length + 1))[:n_runs] * (length + 1)
    return (starts[:, None] + np.arange(length)[None, :]).ravel()


def run_sweep(cupy: Any, args: argparse.Namespace,
              rng: np.random.Generator) -> tuple[list[dict], dict[str, int | None]]:
    rows: list[dict] = []
    suggested: dict[str, int | None] = {}
    for kib in SWEEP_KIB:
        bb = kib << 10
        n = task_blocks(args.task_mib << 20, args.tensors, bb)
        rig = Rig(cupy, args.device, args.tensors, bb, 3 * n)
        try:
            for length in SWEEP_RUNS:
                n_runs = max(1, n // length)
                dev_ids = runs_of(length, n_runs, rig.slots, rng)
                host_ids = runs_of(length, n_runs, rig.slots, rng)
                results = {}
                for path, threshold in (("memcpy", length), ("kernel", rig.slots + 1)):
                    copier = rig.copier(threshold)
                    try:
                        results[path] = measure(rig, copier, dev_ids, host_ids, args.reps)
                    finally:
                        copier.close()
                for direction in ("evict", "load"):
                    rows.append({"direction": direction, "block_kib": kib, "run_blocks": length,
                                 "blocks_per_task": len(dev_ids),
                                 "memcpy_gbps": results["memcpy"][direction][0],
                                 "kernel_gbps": results["kernel"][direction][0],
                                 "baseline_gbps": results["kernel"][direction][1]})
        finally:
            rig.close()
        for direction in ("evict", "load"):
            wins = [r["run_blocks"] for r in rows if r["block_kib"] == kib
                    and r["direction"] == direction and r["memcpy_gbps"] >= r["kernel_gbps"]]
            suggested[f"{direction} {kib} KiB"] = min(wins) if wins else None
    return rows, suggested


def print_table(device_name: str, rows: list[Row], sweep: list[dict],
                suggested: dict[str, int | None]) -> None:
    print(f"kvswap cuda copier vs cudaMemcpyAsync of the same bytes, same buffers ({device_name})")
    print(f"{'dir':6} {'case':11} {'block':>7} {'T':>3} {'blocks':>6} {'MiB':>7} "
          f"{'kvswap GB/s':>12} {'memcpy GB/s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r.direction:6} {r.case:11} {r.block_kib:>5}Ki {r.tensors:>3} "
              f"{r.blocks_per_task:>6} {r.mib_per_task:>7.1f} {r.kvswap_gbps:>12.2f} "
              f"{r.memcpy_gbps:>12.2f} {r.ratio:>6.2f}")
    if sweep:
        print("\nmemcpy-run threshold sweep: tasks made of runs of L blocks")
        print(f"{'dir':6} {'block':>7} {'L':>4} {'blocks':>6} {'memcpy path':>12} "
              f"{'kernel path':>12} {'baseline':>9}  (GB/s)")
        for s in sweep:
            print(f"{s['direction']:6} {s['block_kib']:>5}Ki {s['run_blocks']:>4} "
                  f"{s['blocks_per_task']:>6} {s['memcpy_gbps']:>12.2f} {s['kernel_gbps']:>12.2f} "
                  f"{s['baseline_gbps']:>9.2f}")
        print("\nsmallest run length where cudaMemcpyAsync beats the kernel "
              "(candidate KVSWAP_MEMCPY_RUN_BLOCKS):")
        for key, value in suggested.items():
            print(f"  {key}: {value if value is not None else 'never (kernel always faster)'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--tensors", type=int, default=8, help="tensors per task (default 8)")
    p.add_argument("--task-mib", type=int, default=64,
                   help="bytes per task over all tensors, in MiB (default 64)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions, median (default 7)")
    p.add_argument("--memcpy-run-blocks", type=int, default=16,
                   help="threshold for the contiguous/scattered cases (default 16)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="skip the memcpy-run threshold sweep")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE; '-': JSON on stdout and the "
                        "table on stderr (what `kvswap bench gpu --json` runs)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cupy = import_cupy()
    rng = np.random.default_rng(args.seed)
    name = cupy.cuda.runtime.getDeviceProperties(args.device)["name"]
    device_name = name.decode() if isinstance(name, bytes) else str(name)
    rows = run_cases(cupy, args, rng)
    sweep, suggested = run_sweep(cupy, args, rng) if args.sweep else ([], {})
    with contextlib.redirect_stdout(sys.stderr if args.json == "-" else sys.stdout):
        print_table(device_name, rows, sweep, suggested)
    if args.json:
        result = {"device": device_name, "tensors": args.tensors, "task_mib": args.task_mib,
                  "reps": args.reps,
                  "rows": [dict(asdict(r), ratio=r.ratio) for r in rows],
                  "sweep": sweep, "suggested_memcpy_run_blocks": suggested}
        if args.json == "-":
            json.dump(result, sys.stdout, indent=2)
            print()
        else:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
