"""CUDA data mover: split a task into copy-engine runs and kernel items, run both.

A task names block ids once and applies them to every tensor.  Its (device ids,
host ids) pairs are coalesced by :func:`~kvswap.kernels.planner.plan_copy`:

* **long runs** (``count >= memcpy_run_blocks`` consecutive blocks on both
  sides) go to ``cudaMemcpyAsync``, one call per (run, tensor), on the copy
  engines;
* **every other block** goes to ONE launch of ``kvswap_block_copy``
  (``block_copy.cu``) that covers every tensor of every layer: a table of
  per-tensor (device base, device-mapped host base, bytes per block, access
  width) is uploaded once at attach, and the block-id arrays once per task,
  from a pinned staging buffer into device buffers that grow by doubling.

Each direction has one non-blocking stream (loads at a higher priority than
evicts, since an engine waits on loads while evicts are background work) and
an event; a task is complete when its event is.

Everything above :class:`CudaTaskCopier` is pure (numpy only) and tested on the
CPU; cupy is imported lazily, only by the GPU paths.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.kernels.planner import plan_copy

MEMCPY_RUN_BLOCKS_ENV = "KVSWAP_MEMCPY_RUN_BLOCKS"
# A run of at least this many consecutive blocks (on both sides) is moved by
# cudaMemcpyAsync instead of the kernel.  To be measured on a GPU with
# ``scripts/bench_gpu.py`` (its threshold sweep prints the crossover per block
# size, also run by ``scripts/gpu_check``); until then 16 is an estimate: one cudaMemcpyAsync costs a few microseconds of
# launch overhead, which at 25-50 GB/s of PCIe is the time of 100-200 KB, so for
# typical per-tensor blocks of 8-64 KiB a 16-block run (128 KiB - 1 MiB) keeps
# that overhead well under the copy itself, while shorter runs would multiply
# calls by the number of tensors (hundreds per task) for little gain over the
# kernel.  Copy engines also leave the SMs to the engine's own kernels.
DEFAULT_MEMCPY_RUN_BLOCKS = 16

# Bytes of one kernel item (a warp's share of a block).  16 KiB is 8 rounds of
# 32 lanes x 16-byte vectors x 4 loads in flight: small blocks are one item,
# 512 KiB blocks are spread over 32 warps.  A multiple of every access width.
SEGMENT_BYTES = 16 << 10

VECTOR_WIDTHS = (16, 8, 4, 1)

THREADS_PER_CTA = 256  # 8 warps, one item each at a time
# The kernel uses 46 registers per thread (ptxas, sm_90), so 5 CTAs of 256 fit
# on an SM; 4 per SM keeps the whole grid resident in one wave and already
# holds ~2 KiB of loads in flight per warp, far more than PCIe needs.
CTAS_PER_SM = 4

KERNEL_NAME = "kvswap_block_copy"
KERNEL_SOURCE = Path(__file__).with_name("block_copy.cu")

# One row per tensor; must match ``struct TensorEntry`` in block_copy.cu.
TABLE_DTYPE = np.dtype([("device", "<u8"), ("host", "<u8"), ("block_bytes", "<u8"),
                        ("vec_bytes", "<u8"), ("seg_first", "<u8")])

EVICT_PRIORITY = 0  # CUDA stream priorities: lower numbers run first
LOAD_PRIORITY = -1  # clamped by CUDA to the device's range


class CudaUnavailable(KvswapError):
    """cupy, NVRTC or a CUDA device is missing: the cuda backend cannot run here."""

    default_code = ErrorCode.NOT_READY


# ----------------------------------------------------------------------------- pure logic


def memcpy_run_blocks_from_env(env: Mapping[str, str]) -> int:
    """The memcpy run threshold: ``$KVSWAP_MEMCPY_RUN_BLOCKS`` or the default."""
    raw = env.get(MEMCPY_RUN_BLOCKS_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MEMCPY_RUN_BLOCKS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MEMCPY_RUN_BLOCKS_ENV} must be a positive integer, got {raw!r}") \
            from None
    if value < 1:
        raise ValueError(f"{MEMCPY_RUN_BLOCKS_ENV} must be a positive integer, got {raw!r}")
    return value


def pick_vector_width(device: int, host_mapped: int, block_bytes: int) -> int:
    """Widest access (16, 8, 4 or 1 bytes) that keeps every access of a tensor aligned.

    It must divide both base addresses and the block size, so every block start
    is aligned; segment sizes are multiples of 16 (:func:`build_arg_table`), so
    every item start is too."""
    for width in VECTOR_WIDTHS[:-1]:
        if device % width == 0 and host_mapped % width == 0 and block_bytes % width == 0:
            return width
    return 1


@dataclass(frozen=True)
class TensorPointers:
    """Where one tensor lives for the copier (absolute addresses)."""

    name: str
    device: int  # device address of block 0 of the device tensor
    host: int  # host virtual address of block 0 of its host region (cudaMemcpyAsync)
    host_mapped: int  # device-visible address of the same host bytes (kernel)
    block_bytes: int


def build_arg_table(tensors: Sequence[TensorPointers],
                    segment_bytes: int = SEGMENT_BYTES) -> tuple[np.ndarray, int]:
    """The kernel's per-tensor table and the number of segments of one block id.

    Tensor t owns segments ``[seg_first[t], seg_first[t] + ceil(block_bytes / segment_bytes))``
    of every block id; the kernel finds t from a segment by binary search."""
    if not tensors:
        raise ValueError("the copier needs at least one tensor")
    if segment_bytes <= 0 or segment_bytes % VECTOR_WIDTHS[0]:
        raise ValueError(f"segment_bytes must be a positive multiple of 16, got {segment_bytes}")
    table = np.zeros(len(tensors), dtype=TABLE_DTYPE)
    first = 0
    for i, t in enumerate(tensors):
        if t.block_bytes <= 0:
            raise ValueError(f"tensor {t.name}: block_bytes must be positive")
        table[i] = (t.device, t.host_mapped, t.block_bytes,
                    pick_vector_width(t.device, t.host_mapped, t.block_bytes), first)
        first += -(-t.block_bytes // segment_bytes)
    return table, first


@dataclass(frozen=True)
class SplitPlan:
    """A task split into long runs (cudaMemcpyAsync) and single blocks (kernel)."""

    run_device: np.ndarray  # int64 first device block of each long run
    run_host: np.ndarray  # int64 first host block of each long run
    run_counts: np.ndarray  # int64 blocks of each long run
    kernel_device: np.ndarray  # int64 device ids of the blocks left to the kernel
    kernel_host: np.ndarray  # int64 host ids, paired with kernel_device

    @property
    def num_blocks(self) -> int:
        return int(self.run_counts.sum()) + int(self.kernel_device.shape[0])


def split_plan(device_ids: np.ndarray, host_ids: np.ndarray, memcpy_run_blocks: int) -> SplitPlan:
    """Coalesce (device, host) id pairs into runs; runs of at least
    ``memcpy_run_blocks`` go to cudaMemcpyAsync, every other block to the kernel.

    Runs are the same whatever the direction (both sides advance by one), so the
    split is computed once in (device, host) terms."""
    if memcpy_run_blocks < 1:
        raise ValueError(f"memcpy_run_blocks must be >= 1, got {memcpy_run_blocks}")
    dev = np.asarray(device_ids, dtype=np.int64)
    host = np.asarray(host_ids, dtype=np.int64)
    plan = plan_copy(dev, host)
    long_run = plan.counts >= memcpy_run_blocks
    per_block = np.repeat(~long_run, plan.counts)
    return SplitPlan(plan.src_start[long_run], plan.dst_start[long_run], plan.counts[long_run],
                     dev[per_block], host[per_block])


@dataclass(frozen=True)
class MemcpyOp:
    dst: int
    src: int
    nbytes: int


def split_at_boundaries(start: int, nbytes: int, boundaries: np.ndarray) -> list[tuple[int, int]]:
    """Cut the byte range ``[start, start + nbytes)`` at every address in ``boundaries``
    strictly inside it.

    The host pool is registered with CUDA in chunks; a cudaMemcpyAsync is kept
    inside one registration so the driver always sees one pinned range."""
    end = start + nbytes
    cuts = boundaries[(boundaries > start) & (boundaries < end)].tolist()
    edges = [start, *cuts, end]
    return [(a, b - a) for a, b in zip(edges[:-1], edges[1:])]


def memcpy_ops(split: SplitPlan, tensors: Sequence[TensorPointers], to_host: bool,
               host_boundaries: np.ndarray) -> list[MemcpyOp]:
    """The cudaMemcpyAsync calls of a task's long runs, for every tensor."""
    ops: list[MemcpyOp] = []
    runs = list(zip(split.run_device.tolist(), split.run_host.tolist(),
                    split.run_counts.tolist()))
    for t in tensors:
        for d0, h0, count in runs:
            dev = t.device + d0 * t.block_bytes
            host = t.host + h0 * t.block_bytes
            for piece, nbytes in split_at_boundaries(host, count * t.block_bytes,
                                                     host_boundaries):
                dev_piece = dev + (piece - host)
                ops.append(MemcpyOp(piece, dev_piece, nbytes) if to_host
                           else MemcpyOp(dev_piece, piece, nbytes))
    return ops


def launch_geometry(items: int, sm_count: int) -> tuple[int, int]:
    """(CTAs, threads per CTA) for ``items`` warp items: enough warps for every
    item, at most one resident wave (the kernel loops over the rest)."""
    warps_per_cta = THREADS_PER_CTA // 32
    ctas = min(-(-items // warps_per_cta), max(1, sm_count) * CTAS_PER_SM)
    return max(1, ctas), THREADS_PER_CTA


def kernel_args(table: Any, num_tensors: int, total_segs: int, device_ids: Any, host_ids: Any,
                num_ids: int, to_host: bool, segment_bytes: int = SEGMENT_BYTES) -> tuple:
    """Arguments of ``kvswap_block_copy`` in its parameter order, scalars as numpy
    scalars of the exact C width (cupy passes them by size)."""
    return (table, np.int32(num_tensors), np.uint64(total_segs), np.uint64(segment_bytes),
            device_ids, host_ids, np.uint64(num_ids), np.int32(1 if to_host else 0))


def grow_capacity(current: int, needed: int, minimum: int = 1024) -> int:
    """Next buffer capacity (elements): doubled until it holds ``needed``."""
    cap = max(current, minimum)
    while cap < needed:
        cap *= 2
    return cap


def kernel_source() -> str:
    return KERNEL_SOURCE.read_text()


# ----------------------------------------------------------------------------- GPU side


def import_cupy() -> Any:
    """cupy, or a clear error naming what to install."""
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailable(
            f"the cuda backend needs cupy ({exc}); install kvswap[cuda12] or kvswap[cuda13]"
        ) from None
    return cupy


def check_nvrtc() -> tuple[int, int]:
    """NVRTC's version; raises :class:`CudaUnavailable` if cupy cannot load it.

    Checked at daemon start so a missing NVRTC fails there, not at the first
    register."""
    import_cupy()
    from cupy.cuda import nvrtc

    try:
        return nvrtc.getVersion()
    except (RuntimeError, OSError) as exc:  # cupy raises RuntimeError subclasses when the lib is missing
        raise CudaUnavailable(
            f"NVRTC (libnvrtc) is not available, so the copy kernel cannot be compiled: {exc}. "
            "Install the CUDA toolkit or the nvidia-cuda-nvrtc wheel matching cupy's CUDA major "
            "version (e.g. pip install 'cupy-cuda13x[ctk]')") from None


_KERNELS: dict[int, Any] = {}
_KERNELS_LOCK = threading.Lock()


def get_kernel(device: int) -> Any:
    """The compiled ``kvswap_block_copy`` for ``device``, compiled once per process
    (cupy additionally caches the binary on disk across processes)."""
    with _KERNELS_LOCK:
        kernel = _KERNELS.get(device)
        if kernel is None:
            cupy = import_cupy()
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=kernel_source())
                kernel = module.get_function(KERNEL_NAME)  # compiles and loads
            _KERNELS[device] = kernel
        return kernel


class _Lane:
    """One direction: its stream, completion event and id buffers, and the lock
    that makes tasks of this direction take turns.

    A task holds the lock from its id upload to its event's completion, so the
    pinned staging buffer is never refilled while an async upload reads it, and
    evicts and loads (different lanes) still run concurrently."""

    def __init__(self, cupy: Any, priority: int):
        self._cupy = cupy
        self.lock = threading.Lock()
        self.stream = cupy.cuda.Stream(non_blocking=True, priority=priority)
        self.event = cupy.cuda.Event(block=True, disable_timing=True)
        self._capacity = 0
        self._pinned: Any = None
        self._staging = np.empty(0, dtype=np.int64)
        self._ids: Any = None

    def _reserve(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        cap = grow_capacity(self._capacity, needed)
        self._pinned = self._cupy.cuda.alloc_pinned_memory(cap * 8)
        self._staging = np.frombuffer(self._pinned, dtype=np.int64, count=cap)
        self._ids = self._cupy.empty(cap, dtype=np.int64)
        self._capacity = cap

    def upload(self, device_ids: np.ndarray, host_ids: np.ndarray) -> tuple[Any, Any]:
        """Copy both id arrays to the device with one async upload on this lane
        (caller holds :attr:`lock`)."""
        n = device_ids.shape[0]
        self._reserve(2 * n)
        self._staging[:n] = device_ids
        self._staging[n:2 * n] = host_ids
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(self._ids.data.ptr, self._pinned.ptr, 2 * n * 8,
                            runtime.memcpyHostToDevice, self.stream.ptr)
        return self._ids[:n], self._ids[n:2 * n]

    def close(self) -> None:
        with self.lock:
            self.stream.synchronize()
            self._ids = None
            self._staging = np.empty(0, dtype=np.int64)
            self._pinned = None
            self._capacity = 0


@dataclass(frozen=True)
class _Selection:
    """The tensors one copy covers (all, or e.g. one layer) and their kernel table."""

    tensors: tuple[TensorPointers, ...]
    table: Any  # cupy uint64 array holding TABLE_DTYPE rows
    total_segs: int
    bytes_per_id: int


class CudaTaskCopier:
    """Moves a task's blocks between device tensors and registered (mapped) host memory
    (the ``cuda`` backend; the ``host`` backend's counterpart is
    :class:`~kvswap.kernels.host_copy.HostPlanCopier`).

    ``host_boundaries`` are the host addresses where a new cudaHostRegister
    chunk begins; memcpy runs are cut there.  Thread-safe: tasks of one
    direction take turns on that direction's stream, evicts and loads overlap.
    Used by the cuda backend and by ``scripts/bench_gpu.py`` (the same path)."""

    def __init__(self, device: int, tensors: Sequence[TensorPointers],
                 host_boundaries: Sequence[int], memcpy_run_blocks: int):
        if memcpy_run_blocks < 1:
            raise ValueError(f"memcpy_run_blocks must be >= 1, got {memcpy_run_blocks}")
        self._cupy = cupy = import_cupy()
        self.device = device
        self.tensors = tuple(tensors)
        self.memcpy_run_blocks = memcpy_run_blocks
        self._boundaries = np.array(sorted(host_boundaries), dtype=np.int64)
        self._selections: dict[tuple[int, ...] | None, _Selection] = {}
        self._selections_lock = threading.Lock()
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            self._kernel = get_kernel(device)
            self._sm_count = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount,
                                                        device)
            self._lanes = {True: _Lane(cupy, EVICT_PRIORITY), False: _Lane(cupy, LOAD_PRIORITY)}
            self._selections[None] = self._build_selection(self.tensors)

    def _build_selection(self, tensors: Sequence[TensorPointers]) -> _Selection:
        table, total_segs = build_arg_table(tensors)
        # Uploaded once (per attach, or per tensor subset on first use), so a plain
        # copy is fine; it is waited for because kernels on the lanes' non-blocking
        # streams would not be ordered after it.
        dev_table = self._cupy.asarray(table.view(np.uint64))
        self._cupy.cuda.get_current_stream().synchronize()
        return _Selection(tuple(tensors), dev_table, total_segs,
                          sum(t.block_bytes for t in tensors))

    def _selection(self, tensors: Sequence[int] | None) -> _Selection:
        key = None if tensors is None else tuple(int(i) for i in tensors)
        with self._selections_lock:
            sel = self._selections.get(key)
            if sel is None:
                assert key is not None
                sel = self._build_selection([self.tensors[i] for i in key])
                self._selections[key] = sel
            return sel

    def copy(self, to_host: bool, device_ids: np.ndarray, host_ids: np.ndarray,
             tensors: Sequence[int] | None = None) -> int:
        """Move one task (ids already validated) for every tensor, or for the
        tensors at indices ``tensors``; return bytes moved.

        Blocks the calling thread until the task's event completes."""
        split = split_plan(device_ids, host_ids, self.memcpy_run_blocks)
        cupy = self._cupy
        runtime = cupy.cuda.runtime
        kind = runtime.memcpyDeviceToHost if to_host else runtime.memcpyHostToDevice
        lane = self._lanes[to_host]
        with cupy.cuda.Device(self.device):
            sel = self._selection(tensors)
            ops = memcpy_ops(split, sel.tensors, to_host, self._boundaries)
            n = int(split.kernel_device.shape[0])
            with lane.lock:
                if n:
                    dev_ids, host_ids_dev = lane.upload(split.kernel_device, split.kernel_host)
                    grid, threads = launch_geometry(n * sel.total_segs, self._sm_count)
                    with lane.stream:
                        self._kernel((grid,), (threads,),
                                     kernel_args(sel.table, len(sel.tensors), sel.total_segs,
                                                 dev_ids, host_ids_dev, n, to_host))
                for op in ops:
                    runtime.memcpyAsync(op.dst, op.src, op.nbytes, kind, lane.stream.ptr)
                lane.event.record(lane.stream)
                lane.event.synchronize()
        return split.num_blocks * sel.bytes_per_id

    def close(self) -> None:
        """Wait for both lanes and free the device buffers (idempotent)."""
        with self._cupy.cuda.Device(self.device):
            for lane in self._lanes.values():
                lane.close()
        with self._selections_lock:
            self._selections.clear()


__all__ = [
    "CudaTaskCopier", "CudaUnavailable", "DEFAULT_MEMCPY_RUN_BLOCKS", "MEMCPY_RUN_BLOCKS_ENV",
    "MemcpyOp", "SEGMENT_BYTES", "SplitPlan", "TABLE_DTYPE", "TensorPointers",
    "build_arg_table", "check_nvrtc", "get_kernel", "grow_capacity", "import_cupy",
    "kernel_args", "kernel_source", "launch_geometry", "memcpy_ops",
    "memcpy_run_blocks_from_env", "pick_vector_width", "split_at_boundaries", "split_plan",
]
