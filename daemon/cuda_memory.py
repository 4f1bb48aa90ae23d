"""The cuda backend's memory plumbing, free of cupy at import: which device holds
the caches (:func:`uuid_to_ordinal`), which allocations to open
(:func:`group_by_allocation`, :class:`IpcMappings`), and the host swap pool
pinned and mapped for the GPU in chunks (:class:`PinnedHostRange`).

The CUDA runtime arrives as an argument (``cupy.cuda.runtime``, or a fake with
the same functions in the CPU tests), so every rule here is tested on a machine
without a GPU.  :mod:`kvswap.daemon.cuda_backend` composes them into the
backend (docs/architecture.md, section 6).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.client.cuda_export import CudaDriverError, CudaLocation, DriverAPI, format_uuid
from kvswap.client.errors import ErrorCode, InvalidTask
from kvswap.client.layout import TensorDesc

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


def bad_layout(msg: str) -> InvalidTask:
    """A register the cuda backend cannot attach (BAD_LAYOUT)."""
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
    raise bad_layout(
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
            raise bad_layout(f"tensor {t.name}: bytes [{loc.offset}, {end}) exceed its "
                              f"allocation of {loc.alloc_size} bytes")
        g = groups.get((loc.uuid, loc.base))
        if g is None:
            g = groups[(loc.uuid, loc.base)] = AllocationGroup(loc.uuid, loc.base, loc.handle,
                                                               loc.alloc_size)
        elif g.alloc_size != loc.alloc_size:
            first = tensors[g.members[0]].name
            raise bad_layout(f"tensors {first} and {t.name} share an allocation but report "
                              f"sizes {g.alloc_size} and {loc.alloc_size}")
        g.members.append(i)
        g.extent = max(g.extent, end)
    for g in groups.values():
        spans = sorted((locations[i].offset, locations[i].offset + tensors[i].nbytes, i)
                       for i in g.members)
        for (a0, a1, a), (b0, b1, b) in zip(spans[:-1], spans[1:]):
            if b0 < a1:
                raise bad_layout(f"tensors {tensors[a].name} (bytes [{a0}, {a1})) and "
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
                    raise bad_layout(
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
                raise bad_layout(f"registered host memory at {ptr:#x} has no device mapping "
                                  f"(memory type {attrs.type})")
            deltas.add(attrs.devicePointer - ptr)
        if len(deltas) != 1:
            raise bad_layout("the GPU maps the chunks of the host swap space at unrelated "
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
            raise bad_layout(
                f"tensors {names}: cudaIpcOpenMemHandle failed on {format_uuid(g.uuid)}: {exc} "
                "(the exporting worker must be alive and still hold the allocation; a process "
                "cannot open its own handles)") from None
        self.opened[g.key] = ptr
        try:
            base, size = self._drv.allocation_range(ptr)
        except CudaDriverError as exc:
            raise bad_layout(f"tensors {names}: {exc}") from None
        available = base + size - ptr
        if available < g.extent:
            raise bad_layout(f"tensors {names}: need {g.extent} bytes of their allocation but "
                              f"the opened mapping has {available}")

    def close(self) -> None:
        """Close every handle (idempotent); failures are logged, the rest still close."""
        opened, self.opened = self.opened, {}
        for ptr in opened.values():
            try:
                self._rt.ipcCloseMemHandle(ptr)
            except self._rt.CUDARuntimeError as exc:
                log.error("cudaIpcCloseMemHandle(%#x) failed: %s", ptr, exc)
