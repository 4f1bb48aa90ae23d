"""``kvswap demo``: a real multi-process run on the host backend, verified byte for byte.

It launches ``tp`` daemons with simulated caches (a model-like layout), fills
every block of every tensor on every rank with a pattern unique to (rank,
tensor, content tag), then runs evicts and loads of random, non-contiguous
block sets from several threads.  Each thread owns a disjoint slice of device
and host blocks and keeps a model of which tag every block holds, updated in
submission order.  At the end every device and host block is compared with the
model: a loaded block must hold exactly the tag it was loaded from, and every
block no task touched must still hold its initial tag.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvswap.client.layout import DEMO_LAYOUT_HELP, TensorDesc, demo_layout, parse_demo_layout
from kvswap.client.naming import Names
from kvswap.client.shm_region import ShmRegion
from kvswap.client.transfer_client import TransferClient, TransferFuture
from kvswap.daemon.config import host_blocks_option, layout_problem, run_root_option, tp_option
from kvswap.daemon.launcher import LaunchConfig, Launcher
from kvswap.daemon.options import Options, at_least, option
from kvswap.daemon.swap_space import SwapLayout

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


def pattern(rank: int, tensor: int, tags: np.ndarray, words: int) -> np.ndarray:
    """Expected u64 words of blocks holding ``tags`` (tag 0 = never written = zeros)."""
    tags = tags.astype(np.uint64)
    with np.errstate(over="ignore"):
        seed = tags * _M1 + np.uint64(rank * 1_000_003 + tensor + 1) * _M2
        out = seed[:, None] + np.arange(words, dtype=np.uint64)[None, :]
    out[tags == 0] = 0
    return out


@dataclass
class DemoConfig(Options):
    """demo"""

    tp: int = tp_option(2)
    tasks: int = option(600, flag="--tasks", parse=int, check=at_least(1),
                        help="evict and load tasks to run, spread over the threads")
    threads: int = option(4, flag="--threads", parse=int, check=at_least(1),
                          help="client threads submitting tasks, each on its own blocks")
    max_blocks: int = 12  # most blocks per task
    window: int = 4  # tasks in flight per thread
    host_blocks: int = host_blocks_option(256)
    layout: str = option("", flag="--layout", metavar="LAYOUT", check=layout_problem,
                         default_text="the default layout", help=DEMO_LAYOUT_HELP)
    seed: int = option(0, flag="--seed", parse=int, help="seed of the random block sets")
    run_root: str | None = run_root_option()
    namespace: str | None = None  # None: demo-<pid>

    def __post_init__(self) -> None:
        super().__post_init__()
        # each thread works on blocks of its own, so the sequential model stays exact
        device_blocks = parse_demo_layout(self.layout)["blocks"]
        for what, n in (("--host-blocks", self.host_blocks), ("device blocks (--layout "
                                                               "blocks=)", device_blocks)):
            if n < self.threads:
                raise ValueError(f"{what} {n}: fewer than --threads {self.threads}, so a "
                                 f"thread would have no block of its own; give at least one "
                                 f"per thread, or fewer --threads")


@dataclass
class DemoResult:
    tasks: int
    evicts: int
    loads: int
    bytes_moved: int
    wall_s: float
    latencies_s: list[float]
    verified_blocks: int
    mismatches: list[str]
    leaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.leaks

    def summary(self) -> str:
        lat = sorted(self.latencies_s)
        p50 = statistics.median(lat) * 1e3 if lat else 0.0
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else 0.0
        gbps = self.bytes_moved / self.wall_s / 1e9 if self.wall_s else 0.0
        return (f"demo: {self.tasks} tasks ({self.evicts} evict, {self.loads} load), "
                f"{self.bytes_moved / 2**30:.3f} GiB moved in {self.wall_s:.2f}s, "
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, {gbps:.2f} GB/s, "
                f"verified {self.verified_blocks} blocks, {len(self.mismatches)} mismatches, "
                f"{len(self.leaks)} leaks")


class RankView:
    """The demo's own mapping of one rank's device tensors and host swap pool."""

    def __init__(self, names: Names, rank: int, tensors: Sequence[TensorDesc], host_blocks: int):
        """Map them; a segment that is missing (posix_ipc.ExistentialError) or too small
        (ValueError) raises, with whatever was mapped before it closed again."""
        self.regions: list[ShmRegion] = []
        self.device: list[np.ndarray] = []
        self.host: list[np.ndarray] = []
        try:
            for t in tensors:
                self.regions.append(ShmRegion.attach(names.device_segment(rank, t.name)))
                self.device.append(self.regions[-1].array(
                    0, (t.num_blocks, t.bytes_per_block // 8), "<u8"))
            self.regions.append(ShmRegion.attach(names.swap_segment(rank), readonly=True))
            layout = SwapLayout.of(tensors, host_blocks)
            self.host = [self.regions[-1].array(off, (host_blocks, t.bytes_per_block // 8),
                                                "<u8")
                         for off, t in zip(layout.offsets, tensors)]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.device, self.host = [], []
        for reg in self.regions:
            reg.close()


def _worker(client: TransferClient, cfg: DemoConfig, idx: int, dev_tag: np.ndarray,
            host_tag: np.ndarray, dev_slice: np.ndarray, host_slice: np.ndarray,
            out: dict, errors: list) -> None:
    """Submit ``tasks`` random tasks over this thread's blocks, ``window`` in flight."""
    rng = random.Random(cfg.seed * 1000 + idx)
    futures: deque[TransferFuture] = deque()
    latencies, evicts, loads, nbytes = [], 0, 0, 0
    n_tasks = cfg.tasks // cfg.threads + (1 if idx < cfg.tasks % cfg.threads else 0)
    try:
        for _ in range(n_tasks):
            k = rng.randint(1, min(cfg.max_blocks, len(dev_slice), len(host_slice)))
            dev = np.array(rng.sample(list(dev_slice), k))
            host = np.array(rng.sample(list(host_slice), k))
            if rng.random() < 0.5:
                futures.append(client.evict(dev, host))
                host_tag[host] = dev_tag[dev]
                evicts += 1
            else:
                futures.append(client.load(host, dev))
                dev_tag[dev] = host_tag[host]
                loads += 1
            while len(futures) >= cfg.window:
                f = futures.popleft()
                nbytes += f.result().nbytes
                latencies.append(f.latency_s)
        while futures:
            f = futures.popleft()
            nbytes += f.result().nbytes
            latencies.append(f.latency_s)
    except Exception as exc:  # reported by the main thread; the demo then fails
        errors.append(f"thread {idx}: {exc}")
    out[idx] = (latencies, evicts, loads, nbytes)


def _verify(views: list[RankView], tensors: Sequence[TensorDesc], dev_tag: np.ndarray,
            host_tag: np.ndarray) -> tuple[int, list[str]]:
    verified, mismatches = 0, []
    for rank, view in enumerate(views):
        for ti, t in enumerate(tensors):
            words = t.bytes_per_block // 8
            for side, arr, tags in (("device", view.device[ti], dev_tag),
                                    ("host", view.host[ti], host_tag)):
                bad = np.flatnonzero((arr != pattern(rank, ti, tags, words)).any(axis=1))
                verified += arr.shape[0]
                for b in bad[:5]:
                    mismatches.append(f"rank {rank} tensor {t.name} {side} block {b} "
                                      f"(expected tag {tags[b]})")
    return verified, mismatches


def run_demo(cfg: DemoConfig, progress=print) -> DemoResult:
    shapes = demo_layout(cfg.layout or None)
    params = parse_demo_layout(cfg.layout or None)
    tensors = [TensorDesc(s.name, s.layer, s.dtype, s.shape) for s in shapes]
    bad = [t.name for t in tensors if t.bytes_per_block % 8]
    if bad:
        raise ValueError(f"demo needs blocks of a multiple of 8 bytes; {bad} are not")
    num_dev = params["blocks"]
    namespace = cfg.namespace or f"demo-{os.getpid()}"
    launcher = Launcher(LaunchConfig(namespace=namespace, tp=cfg.tp, host_blocks=cfg.host_blocks,
                                     run_root=cfg.run_root, demo_caches=cfg.layout,
                                     ready_timeout_s=60.0))
    block_bytes = sum(t.bytes_per_block for t in tensors)
    progress(f"demo: namespace {namespace}, {cfg.tp} ranks, {len(tensors)} tensors per rank, "
             f"{block_bytes / 1024:.0f} KiB per block per rank, {num_dev} device / "
             f"{cfg.host_blocks} host blocks")
    views: list[RankView] = []
    client = None
    launcher.start()
    try:
        launcher.wait_ready()
        views = [RankView(launcher.names, r, tensors, cfg.host_blocks) for r in range(cfg.tp)]
        dev_tag = np.arange(1, num_dev + 1, dtype=np.int64)  # block b starts with tag b+1
        host_tag = np.zeros(cfg.host_blocks, dtype=np.int64)
        for rank, view in enumerate(views):
            for ti, t in enumerate(tensors):
                view.device[ti][:] = pattern(rank, ti, dev_tag, t.bytes_per_block // 8)
        client = TransferClient(namespace, cfg.tp, run_root=cfg.run_root)
        client.wait_ready(timeout=10)
        dev_slices = np.array_split(np.arange(num_dev), cfg.threads)
        host_slices = np.array_split(np.arange(cfg.host_blocks), cfg.threads)
        out: dict = {}
        errors: list[str] = []
        threads = [threading.Thread(target=_worker, args=(client, cfg, i, dev_tag, host_tag,
                                                          dev_slices[i], host_slices[i], out,
                                                          errors))
                   for i in range(cfg.threads)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        verified, mismatches = _verify(views, tensors, dev_tag, host_tag)
        mismatches = errors + mismatches
        lat = [x for v in out.values() for x in v[0]]
        result = DemoResult(
            tasks=sum(v[1] + v[2] for v in out.values()),
            evicts=sum(v[1] for v in out.values()), loads=sum(v[2] for v in out.values()),
            bytes_moved=sum(v[3] for v in out.values()), wall_s=wall, latencies_s=lat,
            verified_blocks=verified, mismatches=mismatches)
    finally:
        if client is not None:
            client.close()
        for view in views:
            view.close()
        launcher.stop()
    result.leaks = launcher.names.owned_shm()
    if launcher.names.run_dir.exists():
        result.leaks.append(str(launcher.names.run_dir))
    result.leaks += [f"pid {p.pid}" for p in launcher.procs if p.poll() is None]
    return result
