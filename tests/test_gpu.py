"""The cuda backend on a real GPU (marked ``gpu``; skipped cleanly without cupy or a device).

Two real processes: this test process plays the engine's TP worker (cupy, and
torch where installed, allocate the caches; ``CacheWorker`` exports them; a
``TransferClient`` submits tasks) and a ``kvswapd`` started by the real launcher
attaches them through CUDA IPC and pins its shm swap pool.  Every block of
every tensor carries a byte pattern derived from (tensor, tag); after random,
non-contiguous evicts and loads (some long runs, so both the copy kernel and
cudaMemcpyAsync run) every device and host block is compared byte for byte
with a model of the tag it must hold, so moved blocks and untouched blocks are
both checked, in both directions.

The handle-leak test drives ``CudaBackend`` directly against a worker
subprocess that allocates a fresh buffer per cycle.
"""

from __future__ import annotations

import base64
import json
import os
import random
import select
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")


def _device_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_device_count() == 0, reason="no CUDA device visible")]

from kvswap.client import CacheTensor, CacheWorker, ErrorCode, InvalidTask, TransferClient  # noqa: E402
from kvswap.client.cuda_export import CudaLocation, export_tensor  # noqa: E402
from kvswap.client.layout import TensorDesc  # noqa: E402
from kvswap.client.protocol import Op, decode_reply, encode_transfer  # noqa: E402
from kvswap.client.shm_region import ShmRegion  # noqa: E402
from kvswap.client.signals import RankSlot, RankState, poll_until  # noqa: E402
from kvswap.daemon.launcher import log_tail  # noqa: E402
from kvswap.daemon.swap_space import HostSwapSpace, SwapLayout  # noqa: E402


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ============================================================================ patterns


def pattern(xp: Any, ti: int, tags: Any, bpb: int) -> Any:
    """Bytes of blocks of tensor ``ti`` holding ``tags`` (tag 0 = never written = zeros);
    the same values from numpy (host pool) and cupy (device)."""
    tags = xp.asarray(tags, dtype=xp.uint64)
    idx = xp.arange(bpb, dtype=xp.uint64)
    v = tags[:, None] * xp.uint64(2654435761) + xp.uint64(ti * 40503 + 17) + idx[None, :] * xp.uint64(7)
    out = ((v >> xp.uint64(3)) & xp.uint64(0xFF)).astype(xp.uint8)
    out[tags == 0] = 0
    return out


@dataclass
class Cache:
    """One rank's caches in this process: what CacheWorker registers, and a
    (blocks, bytes per block) uint8 cupy view of each tensor."""

    tensors: list[CacheTensor] = field(default_factory=list)
    views: list[Any] = field(default_factory=list)
    descs: list[TensorDesc] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # buffers the views were carved from

    def add(self, name: str, layer: int, arr: Any, view: Any, dtype: str) -> None:
        self.tensors.append(CacheTensor(name, layer, arr))
        self.views.append(view)
        self.descs.append(TensorDesc(name, layer, np.dtype(dtype).str, tuple(arr.shape)))

    def add_cupy(self, name: str, layer: int, arr: Any) -> None:
        self.add(name, layer, arr, arr.view(cupy.uint8).reshape(arr.shape[0], -1), arr.dtype.str)

    def add_torch(self, torch: Any, name: str, layer: int, t: Any) -> None:
        view = cupy.asarray(t.view(torch.uint8).reshape(t.shape[0], -1))
        self.add(name, layer, t, view, f"<u{t.element_size()}")

    def carve(self, specs: list[tuple[str, int, str, tuple[int, ...]]], pad: int = 0) -> None:
        """Several tensors in ONE cupy allocation (like an engine's KV buffer)."""
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, _, dtype, shape in specs]
        buf = cupy.zeros(pad + sum(sizes), dtype=cupy.uint8)
        self.keep.append(buf)
        off = pad
        for (name, layer, dtype, shape), n in zip(specs, sizes):
            self.add_cupy(name, layer, buf[off:off + n].view(np.dtype(dtype)).reshape(shape))
            off += n

    def fill(self, dev_tag: np.ndarray) -> None:
        for ti, v in enumerate(self.views):
            v[:] = pattern(cupy, ti, dev_tag, v.shape[1])
        cupy.cuda.runtime.deviceSynchronize()  # the engine's writes are done before evicts


class HostPool:
    """Read-only view of rank 0's host swap space, laid out like the daemon's."""

    def __init__(self, names: Any, descs: list[TensorDesc], host_blocks: int):
        self.region = ShmRegion.attach(names.swap_segment(0), readonly=True)
        layout = SwapLayout.of(descs, host_blocks)
        self.blocks = [self.region.array(off, (host_blocks, d.bytes_per_block), np.uint8)
                       for off, d in zip(layout.offsets, descs)]

    def close(self) -> None:
        self.blocks = []
        self.region.close()


def verify(cache: Cache, pool: HostPool, dev_tag: np.ndarray, host_tag: np.ndarray) -> None:
    for ti, (dev, host, desc) in enumerate(zip(cache.views, pool.blocks, cache.descs)):
        bpb = dev.shape[1]
        bad_dev = cupy.flatnonzero((dev != pattern(cupy, ti, dev_tag, bpb)).any(axis=1)).get()
        assert bad_dev.size == 0, (f"tensor {desc.name}: device blocks {bad_dev[:8]} (of "
                                   f"{bad_dev.size}) differ; expected tags {dev_tag[bad_dev[:8]]}")
        bad_host = np.flatnonzero((host != pattern(np, ti, host_tag, bpb)).any(axis=1))
        assert bad_host.size == 0, (f"tensor {desc.name}: host blocks {bad_host[:8]} (of "
                                    f"{bad_host.size}) differ; expected tags {host_tag[bad_host[:8]]}")


def checksum(cache: Cache, pool: HostPool) -> tuple[int, int]:
    """Sums of every device and every host byte (weighted by position)."""
    dev = sum(int((v.astype(cupy.uint64) * (cupy.arange(v.size, dtype=cupy.uint64)
                                            .reshape(v.shape) + 1)).sum()) for v in cache.views)
    host = sum(int((b.astype(np.uint64) * (np.arange(b.size, dtype=np.uint64)
                                          .reshape(b.shape) + 1)).sum()) for b in pool.blocks)
    return dev, host


# ============================================================================ a launched rank


@dataclass
class Rank:
    launcher: Any
    worker: CacheWorker
    client: TransferClient
    pool: HostPool
    cache: Cache
    dev_tag: np.ndarray
    host_tag: np.ndarray

    def close(self) -> None:
        self.client.close()
        self.launcher.stop()  # the daemon closes its IPC handles before we free the caches
        self.pool.close()
        self.worker.close()


def _wait_attaching(launcher: Any, timeout: float = 180.0) -> None:
    """The daemon imported cupy, found NVRTC (and compiled the kernel with --device)."""
    def check() -> bool | None:
        for rank, rc in launcher.dead_ranks():
            path = launcher.names.log_path(rank, launcher.log_dir)
            pytest.fail(f"daemon exited with {rc} before attaching:\n{log_tail(path, 40)}")
        return True if launcher.seg.state_of(0) == RankState.ATTACHING else None

    assert poll_until(check, time.monotonic() + timeout), launcher.progress()


def launch_rank(namespaces: Any, cache: Cache, host_blocks: int,
                devices: list[int] | None = None) -> Rank:
    launcher = namespaces.launch(tp=1, backend="cuda", demo_caches=None, host_blocks=host_blocks,
                                 devices=devices, wait=False, stop_timeout_s=30.0)
    _wait_attaching(launcher)
    num_dev = cache.descs[0].num_blocks
    dev_tag = np.arange(1, num_dev + 1, dtype=np.int64)
    host_tag = np.zeros(host_blocks, dtype=np.int64)
    cache.fill(dev_tag)
    worker = CacheWorker(launcher.names.namespace, 0, run_root=launcher.cfg.run_root,
                         backend="cuda")
    reply = worker.register(cache.tensors, timeout=180)
    assert reply.fields["num_device_blocks"] == num_dev
    assert reply.fields["num_host_blocks"] == host_blocks
    launcher.wait_ready(timeout=60)
    sig = launcher.seg.ranks[0]
    assert int(sig[RankSlot.SWAP_BYTES_TOTAL]) > 0
    assert int(sig[RankSlot.SWAP_BYTES_PINNED]) == int(sig[RankSlot.SWAP_BYTES_TOTAL])
    client = TransferClient(launcher.names.namespace, 1, run_root=launcher.cfg.run_root)
    client.wait_ready(10)
    pool = HostPool(launcher.names, cache.descs, host_blocks)
    return Rank(launcher, worker, client, pool, cache, dev_tag, host_tag)


def random_tasks(rank: Rank, seed: int, count: int, max_blocks: int, window: int = 6) -> None:
    """Random evicts and loads, ``window`` in flight, model updated in submission
    order (the daemon orders overlapping tasks the same way)."""
    rng = random.Random(seed)
    n_dev, n_host = rank.dev_tag.shape[0], rank.host_tag.shape[0]
    pending: deque = deque()
    for _ in range(count):
        k = rng.randint(1, max_blocks)
        if rng.random() < 0.35:  # a long run: cudaMemcpyAsync when k >= the threshold
            d0, h0 = rng.randrange(n_dev - k + 1), rng.randrange(n_host - k + 1)
            dev, host = np.arange(d0, d0 + k), np.arange(h0, h0 + k)
        else:
            dev = np.array(rng.sample(range(n_dev), k))
            host = np.array(rng.sample(range(n_host), k))
        if rng.random() < 0.5:
            pending.append(rank.client.evict(dev, host))
            rank.host_tag[host] = rank.dev_tag[dev]
        else:
            pending.append(rank.client.load(host, dev))
            rank.dev_tag[dev] = rank.host_tag[host]
        while len(pending) >= window:
            pending.popleft().result()
    while pending:
        pending.popleft().result()


# ============================================================================ round trips


def test_kv_cache_round_trips_with_extra_layer_and_layerwise_load(namespaces, monkeypatch):
    monkeypatch.setenv("KVSWAP_MEMCPY_RUN_BLOCKS", "4")
    shape = (48, 16, 4, 64)
    cache = Cache()
    # layers 0-2 carved from one allocation (opened once by the daemon)
    cache.carve([(f"{kind}{layer}", layer, "<f2", shape) for layer in range(3)
                 for kind in ("k", "v")])
    for kind in ("k", "v"):  # an extra (MTP) layer in allocations of its own
        cache.add_cupy(f"{kind}3", 3, cupy.zeros(shape, dtype=cupy.float16))
    torch = _torch_cuda()
    if torch is not None:  # a torch bf16 layer, exported without __cuda_array_interface__
        for kind in ("k", "v"):
            cache.add_torch(torch, f"{kind}4", 4, torch.zeros(shape, dtype=torch.bfloat16,
                                                                device="cuda"))
    rank = launch_rank(namespaces, cache, host_blocks=64)  # device found by UUID
    try:
        random_tasks(rank, seed=1, count=80, max_blocks=12)
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)

        # layer-wise load: each layer is complete when wait_layer returns
        dev, host = np.array([5, 9, 30, 31, 32, 33, 34, 47]), np.arange(8, 16)
        rank.client.evict(np.arange(8), host).result()
        rank.host_tag[host] = rank.dev_tag[np.arange(8)]
        fut = rank.client.load(host, dev, layerwise=True)
        expected = rank.dev_tag.copy()
        expected[dev] = rank.host_tag[host]
        for layer in sorted({d.layer for d in cache.descs}):
            rank.worker.wait_layer(fut.task_id, layer, timeout=30)
            for ti, d in enumerate(cache.descs):
                if d.layer == layer:
                    got = cache.views[ti][cupy.asarray(dev)]
                    want = pattern(cupy, ti, expected[dev], got.shape[1])
                    assert bool((got == want).all()), f"layer {layer} tensor {d.name}"
        fut.result()
        rank.dev_tag[:] = expected
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)
    finally:
        rank.close()


def test_fp8_cache_with_scales_and_unaligned_tensors(namespaces, monkeypatch):
    monkeypatch.setenv("KVSWAP_MEMCPY_RUN_BLOCKS", "3")
    blocks = 40
    cache = Cache()
    specs = []
    for layer in range(2):
        for kind in ("k", "v"):
            specs.append((f"{kind}{layer}", layer, "|u1", (blocks, 16, 2, 64)))  # fp8 bits
            specs.append((f"{kind}{layer}_scale", layer, "<f4", (blocks, 16, 2)))
    cache.carve(specs)
    # 21-byte blocks starting at an odd address: the kernel's 1-byte path
    cache.carve([("odd0", 0, "|u1", (blocks, 21))], pad=1)
    # 12-byte blocks at a 4-aligned address: the 4-byte path
    cache.carve([("odd1", 1, "|u1", (blocks, 12))], pad=4)
    rank = launch_rank(namespaces, cache, host_blocks=48, devices=[0])
    try:
        random_tasks(rank, seed=2, count=60, max_blocks=9)
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)
    finally:
        rank.close()


def test_mla_cache_without_v(namespaces, monkeypatch):
    monkeypatch.setenv("KVSWAP_MEMCPY_RUN_BLOCKS", "8")
    cache = Cache()
    cache.carve([(f"kv{layer}", layer, "<f2", (32, 16, 576)) for layer in range(4)])
    rank = launch_rank(namespaces, cache, host_blocks=40, devices=[0])
    try:
        random_tasks(rank, seed=3, count=50, max_blocks=16)
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)
    finally:
        rank.close()


def test_out_of_range_ids_are_rejected_before_any_copy(namespaces):
    import zmq

    cache = Cache()
    cache.carve([(f"{kind}0", 0, "<f2", (16, 16, 2, 32)) for kind in ("k", "v")])
    rank = launch_rank(namespaces, cache, host_blocks=24, devices=[0])
    try:
        rank.client.evict(np.arange(4), np.arange(4)).result()
        rank.host_tag[np.arange(4)] = rank.dev_tag[np.arange(4)]
        before = checksum(cache, rank.pool)
        with pytest.raises(InvalidTask) as ei:  # the client checks against the rank's counts
            rank.client.evict(np.array([0, 16]), np.array([5, 6]))
        assert ei.value.code == ErrorCode.ID_OUT_OF_RANGE
        ctx = zmq.Context(1)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rank.launcher.names.endpoint(0))
        try:  # and the daemon rejects it whole when a client does not
            for op, dev, host in ((Op.EVICT, [1, 2], [3, 24]), (Op.LOAD, [16, 2], [0, 1])):
                sock.send_multipart(encode_transfer(op, 777, np.array(dev, np.int32),
                                                    np.array(host, np.int32)))
                assert sock.poll(20_000), "daemon did not answer"
                reply = decode_reply(sock.recv_multipart()[0])
                assert not reply.ok and reply.code == ErrorCode.ID_OUT_OF_RANGE, reply
        finally:
            sock.close()
            ctx.term()
        assert checksum(cache, rank.pool) == before
        rank.client.load(np.arange(4), np.arange(8, 12)).result()  # still serving
        rank.dev_tag[8:12] = rank.host_tag[:4]
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)
    finally:
        rank.close()


@pytest.mark.skipif(_device_count() < 2, reason="needs two GPUs")
def test_daemon_finds_the_gpu_by_uuid_under_other_visible_devices(namespaces, monkeypatch):
    count = _device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = visible.split(",") if visible else [str(i) for i in range(count)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(reversed(order)))  # the daemon's view
    cache = Cache()
    cache.carve([(f"{kind}0", 0, "<f2", (16, 16, 2, 32)) for kind in ("k", "v")])
    rank = launch_rank(namespaces, cache, host_blocks=16)
    try:
        random_tasks(rank, seed=4, count=20, max_blocks=6)
        verify(cache, rank.pool, rank.dev_tag, rank.host_tag)
    finally:
        rank.close()


# ============================================================================ export with the real driver


def test_export_with_the_real_driver():
    buf = cupy.zeros(1 << 20, dtype=cupy.uint8)
    arr = buf[4096:4096 + 16 * 512].view(cupy.float16).reshape(16, 256)
    exp = export_tensor(arr, "k0")
    loc = exp.location
    assert exp.dtype == "<f2" and exp.shape == (16, 256)
    assert loc.base + loc.offset == arr.data.ptr
    assert loc.alloc_size >= loc.offset + arr.nbytes
    device = cupy.cuda.Device().id
    assert loc.uuid == cupy.cuda.runtime.getDeviceProperties(device)["uuid"].hex()
    assert CudaLocation.from_wire(loc.to_wire(), "k0") == loc
    with pytest.raises(InvalidTask) as ei:
        export_tensor(arr.T, "v0")
    assert "not C-contiguous" in str(ei.value)
    with pytest.raises(InvalidTask) as ei:
        export_tensor(np.zeros((16, 256), np.float16), "v0")
    assert "__cuda_array_interface__" in str(ei.value)


_VMM_PROBE = """
import torch
from kvswap.client.cuda_export import export_tensor
from kvswap.client.errors import InvalidTask
t = torch.zeros((16, 1024), dtype=torch.bfloat16, device="cuda")
try:
    export_tensor(t, "k0")
except InvalidTask as exc:
    print("REFUSED", exc)
else:
    print("EXPORTED")
"""


@pytest.mark.skipif(_torch_cuda() is None, reason="torch with CUDA not installed")
def test_expandable_segments_are_refused_with_the_fix():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    res = subprocess.run([sys.executable, "-c", _VMM_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "REFUSED" in res.stdout, res.stdout
    assert "expandable_segments:False" in res.stdout


# ============================================================================ handle leaks


LEAK_CYCLES = 100
LEAK_BLOCKS = 64
LEAK_BPB = 4096
LEAK_ALLOC = 64 << 20  # per cycle: a leaked mapping would keep this much device memory


class LeakWorker:
    """A subprocess playing the engine: a fresh cudaMalloc'd buffer per cycle
    holding k0 and v0, exported, freed when the daemon side is done with it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--leak-worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def ask(self, msg: dict, timeout: float = 60.0) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"leak worker did not answer {msg}"
        line = self.proc.stdout.readline()
        assert line, f"leak worker exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask({"op": "exit"})
        self.proc.wait(timeout=30)


def _export_cycle(cycle: int) -> tuple[Any, list[dict]]:
    """A fresh allocation holding k0 and v0 (patterned for ``cycle``), exported."""
    buf = cupy.empty(LEAK_ALLOC, dtype=cupy.uint8)
    half = LEAK_BLOCKS * LEAK_BPB
    tensors = []
    for ti, name in enumerate(("k0", "v0")):
        view = buf[ti * half:(ti + 1) * half].reshape(LEAK_BLOCKS, LEAK_BPB)
        view[:] = pattern(cupy, ti, np.arange(1, LEAK_BLOCKS + 1) + cycle, LEAK_BPB)
        loc = export_tensor(view, name).location.to_wire()
        loc["ipc"] = base64.b64encode(loc["ipc"]).decode()
        tensors.append({"name": name, "location": loc})
    cupy.cuda.runtime.deviceSynchronize()
    return buf, tensors


def _leak_worker_main() -> None:
    cupy.cuda.set_allocator(None)  # plain cudaMalloc/cudaFree: freed memory really goes back
    held: dict[str, Any] = {}  # the current cycle's buffer
    for line in sys.stdin:
        msg = json.loads(line)
        reply: dict = {}
        if msg["op"] == "alloc":
            held["buf"], reply["tensors"] = _export_cycle(msg["cycle"])
        elif msg["op"] == "free":
            del held["buf"]  # the only reference: cudaFree now
            cupy.cuda.runtime.deviceSynchronize()
        elif msg["op"] == "meminfo":
            reply["free"] = cupy.cuda.runtime.memGetInfo()[0]
        print(json.dumps(reply), flush=True)
        if msg["op"] == "exit":
            return


def test_no_handle_or_pin_leak_over_100_register_detach_cycles(namespaces):
    from kvswap.daemon.cuda_backend import CudaBackend

    names = namespaces.new()
    descs = [TensorDesc(n, 0, "|u1", (LEAK_BLOCKS, LEAK_BPB)) for n in ("k0", "v0")]
    swap = HostSwapSpace.open(names, 0, descs, num_host_blocks=LEAK_BLOCKS)
    backend = CudaBackend(names, 0, device=cupy.cuda.Device().id, memcpy_run_blocks=4,
                          pin_chunk_bytes=64 << 10)  # several chunks per pin
    worker = LeakWorker()
    try:
        worker.ask({"op": "alloc", "cycle": 0})  # warm up the worker's context
        worker.ask({"op": "free"})
        free_before = worker.ask({"op": "meminfo"})["free"]
        host_ptr = int(swap.region.array(0, (1,), np.uint8).__array_interface__["data"][0])
        for cycle in range(LEAK_CYCLES):
            exported = worker.ask({"op": "alloc", "cycle": cycle})["tensors"]
            tensors = []
            for d, e in zip(descs, exported):
                loc = dict(e["location"], ipc=base64.b64decode(e["location"]["ipc"]))
                tensors.append(TensorDesc(d.name, d.layer, d.dtype, d.shape, loc))
            backend.attach(tensors, swap)
            assert backend.open_allocations == 1  # k0 and v0 share one allocation
            if cycle % 10 == 0:
                tags = np.arange(1, LEAK_BLOCKS + 1) + cycle
                ids = np.arange(4) + cycle % 7
                assert backend.copy(Op.EVICT, ids, ids + 10) == 4 * 2 * LEAK_BPB
                for ti, host in enumerate(swap.blocks):
                    assert np.array_equal(host[ids + 10], pattern(np, ti, tags[ids], LEAK_BPB))
                backend.copy(Op.LOAD, ids + 10, ids + 20)
                for ti, name in enumerate(("k0", "v0")):
                    view = backend.device_array(name).reshape(LEAK_BLOCKS, LEAK_BPB)
                    got = view[cupy.asarray(ids + 20)]
                    assert bool((got == pattern(cupy, ti, tags[ids], LEAK_BPB)).all())
            dev_ptr = backend.device_array("k0").data.ptr
            backend.detach()
            assert backend.open_allocations == 0
            assert cupy.cuda.runtime.pointerGetAttributes(host_ptr).type == 0  # unregistered
            try:
                kind = cupy.cuda.runtime.pointerGetAttributes(dev_ptr).type
            except cupy.cuda.runtime.CUDARuntimeError:
                kind = 0
            assert kind != 2, "the IPC mapping is still open after detach"  # 2: device memory
            worker.ask({"op": "free"})
        free_after = worker.ask({"op": "meminfo"})["free"]
        # A leaked mapping keeps its cudaFree'd allocation alive: 100 x 64 MiB.
        assert free_before - free_after < 4 * LEAK_ALLOC, (free_before, free_after)
    finally:
        backend.detach()
        worker.close()
        swap.close(unlink=True)


if __name__ == "__main__" and sys.argv[1:] == ["--leak-worker"]:
    _leak_worker_main()
