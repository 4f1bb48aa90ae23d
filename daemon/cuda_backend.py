"""The ``cuda`` backend: a rank's GPU caches mapped through CUDA IPC, and its host
swap space pinned and mapped for the GPU.

``attach``:

1. decode each tensor's location (written by ``client/cuda_export.py``) and map
   the device UUID to this process's ordinal (the daemon may see a different
   ``CUDA_VISIBLE_DEVICES`` than the engine);
2. group tensors by allocation and open each allocation's IPC handle once
   (``cudaIpcMemLazyEnablePeerAccess``), checking with the driver that every
   tensor fits in what was opened;
3. populate the shm pool (:meth:`HostSwapSpace.populate`), then pin it with
   ``cudaHostRegister(portable | mapped)`` in chunks, publishing progress;
4. build the :class:`~kvswap.kernels.cuda_copy.CudaTaskCopier` (kernel table,
   streams, id buffers).

``detach`` undoes it in reverse: every chunk is unregistered and every handle
closed.  A failed attach leaves nothing mapped or pinned.

Threads: attach runs on the daemon's control thread; copies run on its
transfer workers or, for small tasks, its I/O thread (the copier makes
same-direction tasks take turns on their stream); detach runs once no copy can
start any more.  Every CUDA call runs under
``cupy.cuda.Device(ordinal)``, since the current device is per thread.

Like the client's exporter, this module imports cupy only inside functions, so
its pure helpers are testable on a machine without CUDA.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.client.cuda_export import (
    CudaDriverError,
    CudaLocation,
    DriverAPI,
    format_uuid,
    is_c_contiguous,
)
from kvswap.client.cuda_export import driver as load_driver
from kvswap.client.errors import ErrorCode, InvalidTask, NotReady
from kvswap.client.layout import TensorDesc
from kvswap.client.naming import Names
from kvswap.client.protocol import Op
from kvswap.daemon.swap_space import HostSwapSpace
from kvswap.kernels.cuda_copy import (
    CudaTaskCopier,
    CudaUnavailable,
    TensorPointers,
    check_nvrtc,
    get_kernel,
    import_cupy,
    memcpy_run_blocks_from_env,
)

log = logging.getLogger("kvswap.daemon.cuda")

PAGE_BYTES = 4096
# cudaHostRegister per chunk: progress becomes visible every 256 MiB, and a pool of
# hundreds of GiB does not sit in one multi-second driver call.
PIN_CHUNK_BYTES = 256 << 20
# driver_types.h
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x01
MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def _bad_layout(msg: str) -> InvalidTask:
    return InvalidTask(msg, ErrorCode.BAD_LAYOUT)


# ----------------------------------------------------------------------------- pure logic


def uuid_to_ordinal(uuid: str, devices: Sequence[tuple[int, bytes]]) -> int:
    """This process's ordinal of the device with ``uuid`` (hex), given (ordinal,
    uuid bytes) of every visible device."""
    for ordinal, dev_uuid in devices:
        if dev_uuid.hex() == uuid:
            return ordinal
    seen = ", ".join(f"{o}: {format_uuid(u.hex())}" for o, u in devices) or "none"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise _bad_layout(
        f"the caches live on {format_uuid(uuid)}, which this daemon cannot see (it sees {seen}; "
        f"CUDA_VISIBLE_DEVICES={visible!r}); start the daemon with that GPU visible")


@dataclass
class AllocationGroup:
    """The tensors of one device allocation: opened once, closed once."""

    uuid: str
    base: int  # base address in the worker (the grouping key with uuid)
    handle: bytes
    alloc_size: int
    members: list[int] = field(default_factory=list)  # tensor indices
    extent: int = 0  # bytes from the base that the members need

    @property
    def key(self) -> tuple[str, int]:
        return self.uuid, self.base


def group_by_allocation(tensors: Sequence[TensorDesc],
                        locations: Sequence[CudaLocation]) -> list[AllocationGroup]:
    """Group tensors by (device, allocation base); check that each fits its
    allocation and that no two overlap."""
    groups: dict[tuple[str, int], AllocationGroup] = {}
    for i, (t, loc) in enumerate(zip(tensors, locations)):
        end = loc.offset + t.nbytes
        if end > loc.alloc_size:
            raise _bad_layout(f"tensor {t.name}: bytes [{loc.offset}, {end}) exceed its "
                              f"allocation of {loc.alloc_size} bytes")
        g = groups.get((loc.uuid, loc.base))
        if g is None:
            g = groups[(loc.uuid, loc.base)] = AllocationGroup(loc.uuid, loc.base, loc.handle,
                                                               loc.alloc_size)
        elif g.alloc_size != loc.alloc_size:
            first = tensors[g.members[0]].name
            raise _bad_layout(f"tensors {first} and {t.name} share an allocation but report "
                              f"sizes {g.alloc_size} and {loc.alloc_size}")
        g.members.append(i)
        g.extent = max(g.extent, end)
    for g in groups.values():
        spans = sorted((locations[i].offset, locations[i].offset + tensors[i].nbytes, i)
                       for i in g.members)
        for (a0, a1, a), (b0, b1, b) in zip(spans[:-1], spans[1:]):
            if b0 < a1:
                raise _bad_layout(f"tensors {tensors[a].name} (bytes [{a0}, {a1})) and "
                                  f"{tensors[b].name} (bytes [{b0}, {b1})) overlap in one "
                                  "allocation")
    return list(groups.values())


def plan_pin_chunks(size: int, chunk_bytes: int, page: int = PAGE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each cudaHostRegister call over ``size`` bytes.

    Chunk boundaries are page-aligned: two registrations sharing a page would
    make the second fail."""
    if size <= 0:
        raise ValueError(f"cannot pin {size} bytes")
    step = max(page, chunk_bytes // page * page)
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def touch_pages(view: np.ndarray, page: int = PAGE_BYTES) -> None:
    """Fault every page of ``view`` in, writable, without changing a byte.

    Each page's first byte is OR-ed with 0 in place: a write fault that
    allocates the shm page (so cudaHostRegister only has to pin it), while
    adopted pool data stays intact.  numpy releases the GIL, so threads fault
    in parallel.  Nothing else writes the pool while it is being attached."""
    firsts = view[::page]
    np.bitwise_or(firsts, 0, out=firsts)


RuntimeAPI = Any  # cupy.cuda.runtime, or a fake with the same functions in CPU tests


class PinnedHostRange:
    """A page-aligned host range registered with CUDA (portable | mapped) in chunks.

    :attr:`mapped_delta` is ``device-visible address - host address``; it must be
    the same for every chunk, so a kernel can address the whole range from one
    base (true on every platform where the GPU uses the host's addresses)."""

    def __init__(self, runtime: RuntimeAPI, view: np.ndarray, chunk_bytes: int = PIN_CHUNK_BYTES,
                 on_progress: Callable[[int], None] | None = None, threads: int | None = None):
        if view.dtype != np.uint8 or view.ndim != 1 or not view.flags.c_contiguous:
            raise ValueError("PinnedHostRange needs a contiguous 1-D uint8 view")
        self._rt = runtime
        self._view = view
        self.ptr = int(view.__array_interface__["data"][0])
        self.size = int(view.nbytes)
        if self.ptr % PAGE_BYTES:
            raise ValueError(f"host range {self.ptr:#x} is not page-aligned")
        self._chunks = plan_pin_chunks(self.size, chunk_bytes)
        self._on_progress = on_progress
        self._threads = threads or min(8, os.cpu_count() or 1)
        self._registered: list[int] = []
        self.mapped_delta: int | None = None

    @property
    def boundaries(self) -> list[int]:
        """Host addresses where a registration other than the first begins."""
        return [self.ptr + off for off, _ in self._chunks[1:]]

    @property
    def registered_chunks(self) -> int:
        return len(self._registered)

    def pin(self) -> None:
        """Fault pages in (thread pool) and register chunk after chunk as each is
        ready; on failure unregister what was registered and raise InvalidTask."""
        pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvswap-touch")
        try:
            touched = [pool.submit(touch_pages, self._view[off:off + n]) for off, n in self._chunks]
            for (off, n), done in zip(self._chunks, touched):
                done.result()
                try:
                    self._rt.hostRegister(self.ptr + off, n,
                                          HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
                except self._rt.CUDARuntimeError as exc:
                    raise _bad_layout(
                        f"cannot pin the host swap space ({self.size / 2**30:.2f} GiB) with "
                        f"cudaHostRegister at offset {off}: {exc}; check free memory and the "
                        "locked-memory limit (ulimit -l)") from None
                self._registered.append(self.ptr + off)
                if self._on_progress is not None:
                    self._on_progress(off + n)
            self.mapped_delta = self._common_delta()
        except BaseException:
            self.unpin()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _common_delta(self) -> int:
        deltas = set()
        for ptr in self._registered:
            attrs = self._rt.pointerGetAttributes(ptr)
            if attrs.type != MEMORY_TYPE_HOST or not attrs.devicePointer:
                raise _bad_layout(f"registered host memory at {ptr:#x} has no device mapping "
                                  f"(memory type {attrs.type})")
            deltas.add(attrs.devicePointer - ptr)
        if len(deltas) != 1:
            raise _bad_layout("the GPU maps the chunks of the host swap space at unrelated "
                              f"addresses (offsets {sorted(deltas)}); this platform cannot "
                              "address the pool from one base")
        return deltas.pop()

    def unpin(self) -> None:
        """Unregister every registered chunk (idempotent).  A chunk CUDA refuses to
        unregister is logged and skipped, so teardown always completes."""
        while self._registered:
            ptr = self._registered.pop()
            try:
                self._rt.hostUnregister(ptr)
            except self._rt.CUDARuntimeError as exc:
                log.error("cudaHostUnregister(%#x) failed: %s", ptr, exc)
        self.mapped_delta = None


class IpcMappings:
    """Allocations opened through cudaIpcOpenMemHandle, each once; closed together."""

    def __init__(self, runtime: RuntimeAPI, drv: DriverAPI):
        self._rt = runtime
        self._drv = drv
        self.opened: dict[tuple[str, int], int] = {}  # group key -> address in this process

    def open(self, groups: Sequence[AllocationGroup], tensors: Sequence[TensorDesc]) -> None:
        """Open every group; on failure close what was opened and raise InvalidTask."""
        try:
            for g in groups:
                self._open(g, ", ".join(tensors[i].name for i in g.members))
        except BaseException:
            self.close()
            raise

    def _open(self, g: AllocationGroup, names: str) -> None:
        try:
            ptr = self._rt.ipcOpenMemHandle(g.handle, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        except self._rt.CUDARuntimeError as exc:
            raise _bad_layout(
                f"tensors {names}: cudaIpcOpenMemHandle failed on {format_uuid(g.uuid)}: {exc} "
                "(the exporting worker must be alive and still hold the allocation; a process "
                "cannot open its own handles)") from None
        self.opened[g.key] = ptr
        try:
            base, size = self._drv.allocation_range(ptr)
        except CudaDriverError as exc:
            raise _bad_layout(f"tensors {names}: {exc}") from None
        available = base + size - ptr
        if available < g.extent:
            raise _bad_layout(f"tensors {names}: need {g.extent} bytes of their allocation but "
                              f"the opened mapping has {available}")

    def close(self) -> None:
        """Close every handle (idempotent); failures are logged, the rest still close."""
        opened, self.opened = self.opened, {}
        for ptr in opened.values():
            try:
                self._rt.ipcCloseMemHandle(ptr)
            except self._rt.CUDARuntimeError as exc:
                log.error("cudaIpcCloseMemHandle(%#x) failed: %s", ptr, exc)


# ----------------------------------------------------------------------------- backend


@dataclass
class _Attached:
    device: int
    tensors: list[TensorDesc]
    pointers: list[TensorPointers]
    mappings: IpcMappings
    pinned: PinnedHostRange
    copier: CudaTaskCopier
    num_device_blocks: int
    num_host_blocks: int


class CudaBackend:
    """:class:`~kvswap.daemon.backend.Backend` over CUDA IPC and mapped pinned memory."""

    name = "cuda"

    def __init__(self, names: Names, rank: int, device: int | None = None,
                 on_pin_progress: Callable[[int], None] | None = None, *,
                 memcpy_run_blocks: int | None = None, pin_chunk_bytes: int = PIN_CHUNK_BYTES):
        self.names = names
        self.rank = rank
        self._cupy = import_cupy()
        check_nvrtc()
        try:
            self._drv = load_driver()
        except CudaDriverError as exc:
            raise CudaUnavailable(f"rank {rank}: {exc}") from None
        try:
            self.memcpy_run_blocks = (memcpy_run_blocks if memcpy_run_blocks is not None
                                      else memcpy_run_blocks_from_env(os.environ))
        except ValueError as exc:
            raise CudaUnavailable(f"rank {rank}: {exc}") from None
        self.device = device
        self._on_pin_progress = on_pin_progress
        self._pin_chunk_bytes = pin_chunk_bytes
        self._state: _Attached | None = None
        if device is not None:
            self._check_ordinal(device)
            get_kernel(device)  # compile at start: a kernel problem fails here, not at register

    def _check_ordinal(self, device: int) -> None:
        runtime = self._cupy.cuda.runtime
        try:
            count = runtime.getDeviceCount()
        except runtime.CUDARuntimeError as exc:
            raise CudaUnavailable(f"rank {self.rank}: no usable CUDA device: {exc}") from None
        if not 0 <= device < count:
            raise CudaUnavailable(f"rank {self.rank}: --device {device} out of range, this "
                                  f"process sees {count} device(s) (CUDA_VISIBLE_DEVICES="
                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")

    # ------------------------------------------------------------------ attach
    def _locations(self, tensors: Sequence[TensorDesc]) -> list[CudaLocation]:
        locations = []
        for t in tensors:
            loc = CudaLocation.from_wire(t.location, t.name)
            itemsize = np.dtype(t.dtype).itemsize
            if not is_c_contiguous(t.shape, loc.strides, itemsize):
                raise _bad_layout(f"tensor {t.name}: strides {loc.strides} are not C-contiguous "
                                  f"for shape {t.shape}")
            locations.append(loc)
        return locations

    def _device_for(self, tensors: Sequence[TensorDesc], locations: Sequence[CudaLocation]) -> int:
        uuids = {loc.uuid for loc in locations}
        if len(uuids) != 1:
            where = ", ".join(f"{t.name} on {format_uuid(loc.uuid)}"
                              for t, loc in zip(tensors, locations))
            raise _bad_layout(f"one rank's caches must live on one GPU; got {where}")
        uuid = uuids.pop()
        try:
            ordinal = uuid_to_ordinal(uuid, self._drv.device_uuids())
        except CudaDriverError as exc:
            raise _bad_layout(f"cannot list this process's GPUs: {exc}") from None
        if self.device is not None and ordinal != self.device:
            raise _bad_layout(f"the caches live on {format_uuid(uuid)} (ordinal {ordinal} in this "
                              f"process) but rank {self.rank} was started with --device "
                              f"{self.device}")
        return ordinal

    def attach(self, tensors: Sequence[TensorDesc], swap: HostSwapSpace) -> None:
        self.detach()  # the pool cannot be registered twice
        tensors = list(tensors)
        locations = self._locations(tensors)
        ordinal = self._device_for(tensors, locations)
        groups = group_by_allocation(tensors, locations)
        cupy = self._cupy
        region = swap.region.array(0, (swap.region.size,), np.uint8)
        total = swap.nbytes

        # Ready bytes as published: population counts for the first half of the
        # pool's size, pinning for the second (make_backend).
        def populated(done: int) -> None:
            if self._on_pin_progress is not None:
                self._on_pin_progress(total * done // region.nbytes // 2)

        def progress(done: int) -> None:
            if self._on_pin_progress is not None:
                self._on_pin_progress(total // 2 + total * done // region.nbytes // 2)

        swap.populate(populated)
        try:
            with cupy.cuda.Device(ordinal):
                pointers, mappings, pinned, copier = self._map(
                    ordinal, tensors, locations, groups, swap, region, progress)
        except _cuda_errors(cupy) as exc:
            raise _bad_layout(f"rank {self.rank}: attaching the caches on GPU {ordinal} failed: "
                              f"{type(exc).__name__}: {exc}") from None
        self._state = _Attached(ordinal, tensors, pointers, mappings, pinned, copier,
                                tensors[0].num_blocks, swap.num_host_blocks)
        log.info("cuda: rank %d attached %d tensors in %d allocation(s) on GPU %d, pinned %.1f "
                 "MiB in %d chunk(s), memcpy runs >= %d blocks", self.rank, len(tensors),
                 len(groups), ordinal, pinned.size / 2**20, pinned.registered_chunks,
                 self.memcpy_run_blocks)

    def _map(self, ordinal: int, tensors: list[TensorDesc], locations: list[CudaLocation],
             groups: list[AllocationGroup], swap: HostSwapSpace, region: np.ndarray,
             progress: Callable[[int], None],
             ) -> tuple[list[TensorPointers], IpcMappings, PinnedHostRange, CudaTaskCopier]:
        """Open the allocations, pin the pool, build the copier (current device:
        ``ordinal``); on failure release what was taken."""
        runtime = self._cupy.cuda.runtime
        get_kernel(ordinal)
        if not runtime.deviceGetAttribute(runtime.cudaDevAttrCanMapHostMemory, ordinal):
            raise _bad_layout(f"GPU {ordinal} cannot map host memory; the cuda backend needs "
                              "mapped pinned memory")
        mappings = IpcMappings(runtime, self._drv)
        pinned = PinnedHostRange(runtime, region, self._pin_chunk_bytes, progress)
        try:
            mappings.open(groups, tensors)
            pinned.pin()
            assert pinned.mapped_delta is not None
            pointers = [
                TensorPointers(t.name, mappings.opened[loc.uuid, loc.base] + loc.offset,
                               _address(host), _address(host) + pinned.mapped_delta,
                               t.bytes_per_block)
                for t, loc, host in zip(tensors, locations, swap.blocks)]
            copier = CudaTaskCopier(ordinal, pointers, pinned.boundaries, self.memcpy_run_blocks)
        except BaseException:
            pinned.unpin()
            mappings.close()
            raise
        return pointers, mappings, pinned, copier

    # ------------------------------------------------------------------ copy
    def _require(self) -> _Attached:
        state = self._state
        if state is None:
            raise NotReady(f"rank {self.rank}: no caches attached")
        return state

    def copy(self, op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
             tensors: Sequence[int] | None = None) -> int:
        state = self._require()
        # The daemon validated the task; checked again because an out-of-range id
        # here would make the kernel write into another process's memory.
        _check_range(device_ids, state.num_device_blocks, "device")
        _check_range(host_ids, state.num_host_blocks, "host")
        return state.copier.copy(op is Op.EVICT, device_ids, host_ids, tensors)

    def device_array(self, name: str) -> Any:
        """A cupy view (no copy) of the registered device tensor ``name``, valid
        until :meth:`detach`; for inspection and tests."""
        state = self._require()
        cupy = self._cupy
        for t, p in zip(state.tensors, state.pointers):
            if t.name == name:
                mem = cupy.cuda.UnownedMemory(p.device, t.nbytes, self, state.device)
                return cupy.ndarray(t.shape, dtype=np.dtype(t.dtype),
                                    memptr=cupy.cuda.MemoryPointer(mem, 0))
        raise KeyError(f"no registered tensor {name!r}")

    @property
    def open_allocations(self) -> int:
        """Device allocations currently opened through IPC."""
        return len(self._state.mappings.opened) if self._state is not None else 0

    # ------------------------------------------------------------------ detach
    def detach(self) -> None:
        state, self._state = self._state, None
        if state is None:
            return
        with self._cupy.cuda.Device(state.device):
            try:
                state.copier.close()
            finally:
                try:
                    state.pinned.unpin()
                finally:
                    state.mappings.close()
        log.info("cuda: rank %d detached", self.rank)


def _cuda_errors(cupy: Any) -> tuple[type[BaseException], ...]:
    """The exceptions cupy raises for CUDA failures (runtime, driver, NVRTC)."""
    return (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError,
            cupy.cuda.compiler.CompileException)


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _check_range(ids: np.ndarray, limit: int, side: str) -> None:
    if ids.shape[0] and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise InvalidTask(f"{side} block ids outside [0, {limit})", ErrorCode.ID_OUT_OF_RANGE)
