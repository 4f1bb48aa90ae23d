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

Like the client's exporter, this module imports cupy only inside functions; the
rules of steps 1-3 live in :mod:`kvswap.daemon.cuda_memory`, tested on a
machine without CUDA.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.client.cuda_export import CudaDriverError, CudaLocation, format_uuid, is_c_contiguous
from kvswap.client.cuda_export import driver as load_driver
from kvswap.client.errors import ErrorCode, InvalidTask, NotReady
from kvswap.client.layout import TensorDesc
from kvswap.client.naming import Names
from kvswap.client.protocol import Op
from kvswap.daemon.cuda_memory import (
    PIN_CHUNK_BYTES,
    AllocationGroup,
    IpcMappings,
    PinnedHostRange,
    bad_layout,
    group_by_allocation,
    uuid_to_ordinal,
)
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
                raise bad_layout(f"tensor {t.name}: strides {loc.strides} are not C-contiguous "
                                  f"for shape {t.shape}")
            locations.append(loc)
        return locations

    def _device_for(self, tensors: Sequence[TensorDesc], locations: Sequence[CudaLocation]) -> int:
        uuids = {loc.uuid for loc in locations}
        if len(uuids) != 1:
            where = ", ".join(f"{t.name} on {format_uuid(loc.uuid)}"
                              for t, loc in zip(tensors, locations))
            raise bad_layout(f"one rank's caches must live on one GPU; got {where}")
        uuid = uuids.pop()
        try:
            ordinal = uuid_to_ordinal(uuid, self._drv.device_uuids())
        except CudaDriverError as exc:
            raise bad_layout(f"cannot list this process's GPUs: {exc}") from None
        if self.device is not None and ordinal != self.device:
            raise bad_layout(f"the caches live on {format_uuid(uuid)} (ordinal {ordinal} in this "
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
            raise bad_layout(f"rank {self.rank}: attaching the caches on GPU {ordinal} failed: "
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
            raise bad_layout(f"GPU {ordinal} cannot map host memory; the cuda backend needs "
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
