"""``kvswap bench trace`` and ``kvswap bench hostcache``: the engine-side host tier on
request traces, and the cost of its bookkeeping.

**trace** replays a request trace (``daemon/trace.py``: Mooncake format, or
``--synthetic``) the way an engine with a two-level prefix cache would serve it:
a device prefix cache of ``--device-blocks`` blocks (LRU) in front of a
:class:`~kvswap.client.host_cache.HostCache` of ``--host-blocks`` blocks, and,
with ``--storage``, the storage tier behind it.  Per request (the steps of
:func:`replay`):

1. the leading blocks on the device are device hits;
2. of the rest, the leading ``lookup`` hits of the host tier are protected
   (``prepare_load``) and touched; with a storage tier, the blocks after them
   are prefetched from storage and the leading ones that arrived are storage
   hits (protected the same way);
3. device slots for the blocks not on the device are freed by evicting the
   device's least recently used blocks (never the request's own) through
   ``HostCache.offload`` (write-through to storage with ``--storage``);
4. the host and storage hits are loaded (``fetch(prepared=True)``) and
   ``complete_load``-ed; the misses are "computed": their content, derived from
   the hash, is written into the device tensors on every rank (after the
   offload that read those slots has finished);
5. every loaded block is compared on every rank with the content of its hash.

It runs twice: through real daemons on the host backend (a namespace launched
with the Launcher, demo caches sized to fit), and as bookkeeping only (the same
HostCache calls, transfers assumed instant), the reference: with "lru" the host
hits must be equal, and no verified block may differ.

**hostcache** times the bookkeeping cycle lookup + prepare_load + touch +
complete_load + prepare_store + complete_store on 64-block requests, in ns per
block, for "lru" and "arc" against a plain ``OrderedDict`` LRU written here
(:class:`ReferenceLru`), in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

import numpy as np

from kvswap.client.host_cache import POLICIES, CacheFuture, HostCache
from kvswap.client.layout import TensorDesc, demo_layout
from kvswap.client.transfer_client import TransferClient
from kvswap.daemon.bench_refs import BenchError
from kvswap.daemon.demo import RankView, pattern
from kvswap.daemon.launcher import LaunchConfig, Launcher
from kvswap.daemon.trace import SyntheticConfig, TraceRequest, read_trace, synthetic_trace
from kvswap.daemon.trace import trace_stats, write_trace

# K and V of 2 layers, 1 KiB per block and tensor: small, so the replay measures
# the bookkeeping and the control path rather than memcpy.
_LAYOUT = "layers=2,block_tokens=16,heads=1,head_dim=32,dtype=float16,blocks={blocks}"


# ---------------------------------------------------------------------- the engine's side


class DevicePrefixCache:
    """The engine's device cache: hash -> device slot, least recently used first."""

    def __init__(self, num_slots: int):
        self.slots: OrderedDict[Hashable, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))

    def prefix_hits(self, hashes: Sequence[Hashable]) -> int:
        n = 0
        for h in hashes:
            if h not in self.slots:
                break
            n += 1
        return n

    def evict(self, count: int, keep: set) -> list[tuple[Hashable, int]]:
        """Free ``count`` slots beyond the free ones, least recently used first, never
        one of ``keep``; return the (hash, slot) evicted."""
        need = count - len(self.free)
        out: list[tuple[Hashable, int]] = []
        for h, slot in self.slots.items():
            if len(out) >= need:
                break
            if h not in keep:
                out.append((h, slot))
        for h, slot in out:
            del self.slots[h]
            self.free.append(slot)
        return out

    def place(self, hashes: Sequence[Hashable]) -> list[int]:
        """A slot for each hash: the one it has, else a free one."""
        out = []
        for h in hashes:
            slot = self.slots.get(h)
            if slot is None:
                slot = self.slots[h] = self.free.pop()
            out.append(slot)
        return out

    def touch(self, hashes: Sequence[Hashable]) -> None:
        for h in reversed(hashes):
            self.slots.move_to_end(h)


@dataclass
class ReplayCounts:
    mode: str
    policy: str
    requests: int = 0
    blocks: int = 0
    device_hits: int = 0
    host_hits: int = 0
    storage_hits: int = 0
    misses: int = 0
    offloaded: int = 0  # blocks stored in the host tier
    offload_dropped: int = 0  # device victims the host tier had no room for
    tasks: int = 0
    bytes_moved: int = 0
    verified: int = 0  # (block, rank) pairs compared after a load
    mismatched: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the whole process (every thread)
    sim_cpu_s: float = 0.0  # of which: writing computed blocks, verifying loaded ones
    mismatches: list[str] = field(default_factory=list)

    def row(self) -> dict:
        reached_host = self.blocks - self.device_hits
        reached_storage = reached_host - self.host_hits
        ratio = (lambda a, b: round(a / b, 4) if b else 0.0)
        return {"mode": self.mode, "policy": self.policy, "requests": self.requests,
                "blocks": self.blocks, "device_hits": self.device_hits,
                "host_hits": self.host_hits, "storage_hits": self.storage_hits,
                "misses": self.misses, "device_ratio": ratio(self.device_hits, self.blocks),
                "host_ratio": ratio(self.host_hits, reached_host),
                "storage_ratio": ratio(self.storage_hits, reached_storage),
                "offloaded": self.offloaded, "offload_dropped": self.offload_dropped,
                "tasks": self.tasks, "bytes_moved": self.bytes_moved,
                "verified": self.verified, "mismatched": self.mismatched,
                "wall_s": round(self.wall_s, 3),
                "cpu_us_per_request": round(self.cpu_s / max(1, self.requests) * 1e6, 1),
                "sim_cpu_us_per_request": round(self.sim_cpu_s / max(1, self.requests) * 1e6,
                                                1)}


class Tiers(Protocol):
    """How a replay moves blocks: through daemons, or by bookkeeping alone."""

    cache: HostCache

    def prefetch(self, hashes: list) -> None: ...

    def offload(self, hashes: list, slots: list[int]) -> None: ...

    def load(self, hashes: list, slots: list[int]) -> None: ...

    def compute(self, hashes: list, slots: list[int]) -> None: ...

    def finish(self) -> None: ...


def replay(requests: Sequence[TraceRequest], device_blocks: int, tiers: Tiers,
           counts: ReplayCounts, storage: bool) -> ReplayCounts:
    """Serve every request (the steps in the module docstring); fills ``counts``."""
    device = DevicePrefixCache(device_blocks)
    cache = tiers.cache
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(requests):
        hashes = list(req.hash_ids)
        if len(hashes) > device_blocks:
            raise BenchError(f"request {i} has {len(hashes)} blocks, more than the "
                             f"{device_blocks} device blocks; raise --device-blocks")
        d = device.prefix_hits(hashes)
        rest = hashes[d:]
        n = cache.lookup(rest)
        if n:
            cache.prepare_load(rest[:n])
            cache.touch(rest[:n])
        s = 0
        if storage and n < len(rest):
            tiers.prefetch(rest[n:])
            s = cache.lookup(rest[n:])
            if s:
                cache.prepare_load(rest[n:n + s])
                cache.touch(rest[n:n + s])
        keep = set(hashes)
        victims = device.evict(sum(1 for h in rest if h not in device.slots), keep)
        if victims:
            tiers.offload([h for h, _ in victims], [slot for _, slot in victims])
        slots = device.place(rest)
        if n + s:
            tiers.load(rest[:n + s], slots[:n + s])
        if n + s < len(rest):
            tiers.compute(rest[n + s:], slots[n + s:])
        tiers.finish()
        device.touch(hashes)
        counts.requests += 1
        counts.blocks += len(hashes)
        counts.device_hits += d
        counts.host_hits += n
        counts.storage_hits += s
        counts.misses += len(rest) - n - s
    counts.wall_s = time.perf_counter() - t0
    counts.cpu_s = time.process_time() - c0
    return counts


class BookkeepingTiers:
    """The reference: the same HostCache calls, every transfer done at once; the
    storage tier is a set of the hashes written through to it."""

    def __init__(self, cache: HostCache, counts: ReplayCounts, storage: bool):
        self.cache = cache
        self.counts = counts
        self.stored: set | None = set() if storage else None
        self._loading: list = []

    def prefetch(self, hashes: list) -> None:
        assert self.stored is not None
        out = self.cache.prepare_store(hashes)
        if out is None or not out.hashes:
            return
        n = 0
        while n < len(out.hashes) and out.hashes[n] in self.stored:
            n += 1
        self.cache.complete_store(out.hashes[:n])
        self.cache.complete_store(out.hashes[n:], success=False)

    def offload(self, hashes: list, slots: list[int]) -> None:
        out = self.cache.prepare_store(hashes)
        if out is None:
            self.counts.offload_dropped += sum(1 for h in dict.fromkeys(hashes)
                                               if h not in self.cache)
            return
        self.cache.complete_store(out.hashes)
        self.counts.offloaded += len(out.hashes)
        if self.stored is not None:
            self.stored.update(out.hashes)

    def load(self, hashes: list, slots: list[int]) -> None:
        self._loading = hashes

    def compute(self, hashes: list, slots: list[int]) -> None:
        pass  # nothing to write: no device memory in this mode

    def finish(self) -> None:
        if self._loading:
            self.cache.complete_load(self._loading)
            self._loading = []


class DaemonTiers:
    """Real transfers: a namespace on the host backend, its device tensors mapped here."""

    def __init__(self, cache: HostCache, counts: ReplayCounts, client: TransferClient,
                 views: list[RankView], tensors: list[TensorDesc], storage: bool):
        self.cache = cache
        self.counts = counts
        self.client = client
        self.views = views
        self.tensors = tensors
        self.storage = storage
        self._offload: CacheFuture | None = None
        self._load: tuple[CacheFuture, list, list[int]] | None = None

    def _account(self, fut: CacheFuture) -> None:
        res = fut.result()
        self.counts.tasks += len(res.tasks)
        self.counts.bytes_moved += res.nbytes

    def prefetch(self, hashes: list) -> None:
        fut = self.cache.prefetch(self.client, hashes)
        self._account(fut)
        self.cache.poll()

    def offload(self, hashes: list, slots: list[int]) -> None:
        self._offload = self.cache.offload(self.client, hashes, slots, backup=self.storage)

    def load(self, hashes: list, slots: list[int]) -> None:
        self._load = (self.cache.fetch(self.client, hashes, slots, prepared=True), hashes, slots)

    def _write(self, hashes: list, slots: list[int]) -> None:
        tags = np.asarray(hashes, dtype=np.int64) + 1
        for rank, view in enumerate(self.views):
            for ti, t in enumerate(self.tensors):
                view.device[ti][slots] = pattern(rank, ti, tags, t.bytes_per_block // 8)

    def compute(self, hashes: list, slots: list[int]) -> None:
        # The offload's evict reads device slots that the misses now take: wait for it.
        self._wait_offload()
        t0 = time.thread_time()
        self._write(hashes, slots)
        self.counts.sim_cpu_s += time.thread_time() - t0

    def _wait_offload(self) -> None:
        if self._offload is None:
            return
        fut, self._offload = self._offload, None
        res = fut.result()
        self.counts.offloaded += len(res.hashes)
        self.counts.offload_dropped += len(res.dropped)
        self._account(fut)

    def finish(self) -> None:
        self._wait_offload()
        if self._load is not None:
            (fut, hashes, slots), self._load = self._load, None
            self._account(fut)
            t0 = time.thread_time()
            self._verify(hashes, slots)
            self.counts.sim_cpu_s += time.thread_time() - t0
        self.cache.poll()

    def _verify(self, hashes: list, slots: list[int]) -> None:
        tags = np.asarray(hashes, dtype=np.int64) + 1
        idx = np.asarray(slots)
        for rank, view in enumerate(self.views):
            bad = np.zeros(len(hashes), dtype=bool)
            for ti, t in enumerate(self.tensors):
                want = pattern(rank, ti, tags, t.bytes_per_block // 8)
                bad |= (view.device[ti][idx] != want).any(axis=1)
            self.counts.verified += len(hashes)
            self.counts.mismatched += int(bad.sum())
            for k in np.flatnonzero(bad)[:3]:
                self.counts.mismatches.append(f"rank {rank}: block {hashes[k]} in device "
                                              f"slot {slots[k]} differs")


@dataclass(frozen=True)
class ReplaySetup:
    device_blocks: int
    host_blocks: int
    policy: str
    tp: int
    storage: str | None  # URL, or None


def replay_bookkeeping(requests: Sequence[TraceRequest], setup: ReplaySetup) -> ReplayCounts:
    counts = ReplayCounts("bookkeeping", setup.policy)
    tiers = BookkeepingTiers(HostCache(setup.host_blocks, setup.policy, events=False), counts,
                             setup.storage is not None)
    return replay(requests, setup.device_blocks, tiers, counts, setup.storage is not None)


def replay_daemons(requests: Sequence[TraceRequest], setup: ReplaySetup,
                   run_root: str | None = None, namespace: str | None = None) -> ReplayCounts:
    """The replay through ``setup.tp`` real daemons on the host backend, in a namespace
    launched for it (``namespace`` under ``run_root``; default: a fresh one)."""
    layout = _LAYOUT.format(blocks=setup.device_blocks)
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(layout)]
    own_root = run_root is None
    root = tempfile.mkdtemp(prefix="kvt-", dir="/tmp") if own_root else run_root
    store_dir = None
    url = setup.storage
    counts = ReplayCounts("daemons", setup.policy)
    views: list[RankView] = []
    client = None
    launcher = None
    try:  # from the first directory made: everything below is removed on the way out
        if url == "auto":
            store_dir = tempfile.mkdtemp(prefix="kvt-store-", dir="/tmp")
            url = f"file://{store_dir}"
        launcher = Launcher(LaunchConfig(
            namespace=namespace or f"trace-{os.getpid()}-{time.monotonic_ns() % 10**6}",
            tp=setup.tp,
            run_root=root, demo_caches=layout, host_blocks=setup.host_blocks,
            storage_url=url, model_id="bench-trace", log_level="WARNING",
            ready_timeout_s=60.0))
        launcher.start()
        launcher.wait_ready()
        views = [RankView(launcher.names, r, tensors, setup.host_blocks) for r in range(setup.tp)]
        client = TransferClient(launcher.names.namespace, setup.tp, run_root=root,
                                task_timeout=60)
        client.wait_ready(30)
        cache = HostCache(setup.host_blocks, setup.policy, events=False)
        tiers = DaemonTiers(cache, counts, client, views, tensors, url is not None)
        replay(requests, setup.device_blocks, tiers, counts, url is not None)
    finally:
        if client is not None:
            client.close()
        for v in views:
            v.close()
        if launcher is not None:
            launcher.stop()
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    return counts


def sweep(requests: Sequence[TraceRequest], device_blocks: int, capacities: Sequence[int],
          storage: bool) -> list[dict]:
    """Host hit ratio of each policy at each host capacity (bookkeeping replays)."""
    rows = []
    for cap in capacities:
        row: dict = {"host_blocks": cap}
        for policy in POLICIES:
            c = replay_bookkeeping(requests, ReplaySetup(device_blocks, cap, policy, 1,
                                                         "auto" if storage else None)).row()
            row[f"{policy}_host_ratio"] = c["host_ratio"]
        row["arc_minus_lru_points"] = round(100 * (row["arc_host_ratio"]
                                                   - row["lru_host_ratio"]), 2)
        rows.append(row)
    return rows


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is not None:
        requests = read_trace(args.trace)
        return requests[:args.requests] if args.requests else requests
    cfg = SyntheticConfig(requests=args.requests or 2000, seed=args.seed, oneshot=args.oneshot,
                          zipf=args.zipf)
    requests = synthetic_trace(cfg)
    if args.save_trace:
        with open(args.save_trace, "w", encoding="utf-8") as f:
            write_trace(requests, f)
    return requests


def bench_trace(args: argparse.Namespace) -> dict:
    for name in ("device_blocks", "host_blocks", "tp"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    try:
        requests = load_requests(args)
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from None
    out: dict = {"trace": trace_stats(requests)}
    if args.sweep:
        out["sweep"] = sweep(requests, args.device_blocks, args.sweep, args.storage is not None)
        return out
    setup = ReplaySetup(args.device_blocks, args.host_blocks, args.policy, args.tp,
                        args.storage)
    ref = replay_bookkeeping(requests, setup)
    real = replay_daemons(requests, setup)
    out["replay"] = [real.row(), ref.row()]
    out["check"] = {"host_hits_equal": real.host_hits == ref.host_hits,
                    "storage_hits_equal": real.storage_hits == ref.storage_hits,
                    "verified": real.verified, "mismatched": real.mismatched,
                    "first_mismatches": "; ".join(real.mismatches[:3]) or "-"}
    return out


def add_trace_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", default=None, metavar="FILE.jsonl",
                     help="a request trace in the Mooncake format (JSON lines with timestamp, "
                          "input_length, output_length, hash_ids)")
    src.add_argument("--synthetic", action="store_true",
                     help="generate one: multi-turn conversations sharing system prompts, "
                          "Zipf popularity, one-shot documents (seeded)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests to replay (default: all of --trace, 2000 synthetic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    p.add_argument("--oneshot", type=float, default=SyntheticConfig.oneshot,
                   help="synthetic: share of one-shot requests, never reused")
    p.add_argument("--zipf", type=float, default=SyntheticConfig.zipf,
                   help="synthetic: popularity exponent of conversations and system prompts "
                        "(0 = uniform)")
    p.add_argument("--save-trace", default=None, metavar="FILE.jsonl",
                   help="also write the synthetic trace to FILE")
    p.add_argument("--device-blocks", type=int, default=128,
                   help="blocks of the engine's device prefix cache (LRU)")
    p.add_argument("--host-blocks", type=int, default=512, help="blocks of the host tier")
    p.add_argument("--policy", choices=tuple(POLICIES), default="lru",
                   help="eviction policy of the host tier")
    p.add_argument("--tp", type=int, default=2, help="ranks of the namespace replayed through")
    p.add_argument("--storage", default=None, metavar="URL|auto",
                   help="a storage tier behind the host tier (auto: a throw-away file store)")
    p.add_argument("--sweep", type=_capacities, default=None, metavar="N,N,...",
                   help="instead of the daemon replay: host hit ratio of lru and arc at each "
                        "host capacity (bookkeeping replays)")


def _capacities(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep takes capacities like 128,256 (got {text!r})")
    if not caps or min(caps) < 1:
        raise argparse.ArgumentTypeError("--sweep capacities must be >= 1")
    return caps


# ---------------------------------------------------------------------- bookkeeping cost


class ReferenceLru:
    """The same contract as HostCache "lru", written plainly around an OrderedDict:
    hash -> [host id, refs] (refs -1: store pending), a free list, outputs as
    HostCache gives them (int64 id arrays).  No validation, no events, no
    statistics, no completion queue: what a scheduler would write by hand."""

    def __init__(self, num_blocks: int):
        self.blocks: OrderedDict = OrderedDict()
        self.free = list(range(num_blocks - 1, -1, -1))

    def lookup(self, hashes):
        n = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or b[1] < 0:
                break
            n += 1
        return n

    def prepare_load(self, hashes):
        ids = []
        for h in hashes:
            b = self.blocks[h]
            b[1] += 1
            ids.append(b[0])
        return np.array(ids, dtype=np.int64)

    def touch(self, hashes):
        for h in reversed(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def complete_load(self, hashes):
        for h in hashes:
            self.blocks[h][1] -= 1

    def prepare_store(self, hashes):
        new = [h for h in dict.fromkeys(hashes) if h not in self.blocks]
        need = len(new) - len(self.free)
        evicted = []
        if need > 0:
            for h, b in self.blocks.items():
                if b[1] == 0:
                    evicted.append(h)
                    if len(evicted) == need:
                        break
            if len(evicted) < need:
                return None
            for h in evicted:
                self.free.append(self.blocks.pop(h)[0])
        ids = [self.free.pop() for _ in new]
        for h, i in zip(new, ids):
            self.blocks[h] = [i, -1]
        return new, np.array(ids, dtype=np.int64), evicted

    def complete_store(self, hashes, success=True):
        for h in hashes:
            b = self.blocks.get(h)
            if b is not None and b[1] < 0:
                if success:
                    b[1] = 0
                else:
                    del self.blocks[h]
                    self.free.append(b[0])


def cycle_requests(n: int, blocks: int, seed: int) -> list[list[bytes]]:
    """``n`` requests of ``blocks`` 32-byte hashes: a shared prefix (one of 256, Zipf
    popularity, 25-75 % of the request) and fresh blocks after it."""
    rng = random.Random(seed)
    prefixes = [[rng.randbytes(32) for _ in range(blocks)] for _ in range(256)]
    weights = [(k + 1) ** -1.1 for k in range(256)]
    out = []
    for _ in range(n):
        p = rng.choices(prefixes, weights)[0]
        k = rng.randint(blocks // 4, 3 * blocks // 4)
        out.append(p[:k] + [rng.randbytes(32) for _ in range(blocks - k)])
    return out


def run_cycle(cache, requests: list[list[bytes]]) -> float:
    """CPU seconds of this thread for the cycle over every request (thread CPU time, not
    wall time: on a shared machine, time spent descheduled is not the cache's cost)."""
    t0 = time.thread_time()
    for hashes in requests:
        n = cache.lookup(hashes)
        hits = hashes[:n]
        cache.prepare_load(hits)
        cache.touch(hits)
        cache.complete_load(hits)
        out = cache.prepare_store(hashes[n:])
        if out is not None:
            cache.complete_store(out[0])
    return time.thread_time() - t0


_CHUNK = 50  # requests per timed slice; the implementations take turns slice by slice


def bench_hostcache(args: argparse.Namespace) -> dict:
    """Each round gives every implementation a fresh cache and feeds them the same
    requests in slices of 50, taking turns slice by slice (in a rotating order), so a
    burst of load on the machine hits all of them alike; per round, the cost is the
    thread CPU time summed over the slices.  The figure is the median over rounds."""
    if args.requests < 1 or args.blocks < 1 or args.capacity < 1 or args.rounds < 1:
        raise BenchError("--requests, --blocks, --capacity and --rounds must be >= 1")
    requests = cycle_requests(args.requests, args.blocks, args.seed)
    makers = {"reference": lambda: ReferenceLru(args.capacity),
              "lru": lambda: HostCache(args.capacity, "lru"),
              "arc": lambda: HostCache(args.capacity, "arc")}
    names = list(makers)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    hits: dict[str, int] = {}
    gc.collect()
    for r in range(args.rounds + 1):  # round 0 warms up
        caches = {name: make() for name, make in makers.items()}
        spent = dict.fromkeys(names, 0.0)
        for k, start in enumerate(range(0, len(requests), _CHUNK)):
            chunk = requests[start:start + _CHUNK]
            turn = (r + k) % len(names)
            for name in names[turn:] + names[:turn]:
                spent[name] += run_cycle(caches[name], chunk)
        if r:
            for name in names:
                times[name].append(spent[name])
                ratios[name].append(spent[name] / spent["reference"])
        hits = {name: caches[name].stats()["hits"] for name in names if name != "reference"}
    total = args.requests * args.blocks
    rows = [{"impl": name, "ns_per_block": round(statistics.median(times[name]) / total * 1e9, 1),
             "vs_reference": round(statistics.median(ratios[name]), 3),
             "hit_ratio": round(hits[name] / total, 4) if name in hits else "-"}
            for name in names]
    return {"hostcache": rows,
            "target": {"lru_vs_reference": rows[1]["vs_reference"], "limit": 1.5,
                       "meets_target": rows[1]["vs_reference"] <= 1.5}}


def add_hostcache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=4000, help="requests per measured round")
    p.add_argument("--blocks", type=int, default=64, help="blocks per request")
    p.add_argument("--capacity", type=int, default=4096, help="host blocks")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds per implementation, taken in turns (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request stream")


# ---------------------------------------------------------------------- plots


def plot_trace(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), dpi=100)
    ax = fig.subplots()
    if "sweep" in result:
        rows = result["sweep"]
        caps = [r["host_blocks"] for r in rows]
        for policy, color in (("lru", "#1f77b4"), ("arc", "#d62728")):
            ax.plot(caps, [100 * r[f"{policy}_host_ratio"] for r in rows], marker="o",
                    color=color, label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("host blocks", fontsize=8)
        ax.set_ylabel("host hit ratio (%)", fontsize=8)
        ax.legend(fontsize=7)
    else:
        rows = result["replay"]
        tiers = ("device_hits", "host_hits", "storage_hits", "misses")
        xs = np.arange(len(tiers))
        for k, row in enumerate(rows):
            ax.bar(xs + (k - 0.5) * 0.4, [row[t] for t in tiers], 0.4, label=row["mode"])
        ax.set_xticks(xs, [t.replace("_", " ") for t in tiers])
        ax.set_ylabel("blocks", fontsize=8)
        ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path)


def plot_hostcache(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), dpi=100)
    ax = fig.subplots()
    rows = result["hostcache"]
    ax.bar([r["impl"] for r in rows], [r["ns_per_block"] for r in rows],
           color=["#7f7f7f", "#1f77b4", "#d62728"])
    ax.set_ylabel("ns per block (cycle)", fontsize=8)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
