"""The cuda backend's logic, on the CPU: tensor inspection and export (with a fake
driver), the wire location, device and allocation mapping, pinning and IPC
bookkeeping (with a fake runtime), copy planning, the kernel's argument table,
and an emulation of the kernel's indexing that moves real bytes.

The GPU paths themselves are exercised by tests/test_gpu.py on a machine with
a device."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest

from kvswap.client import CacheTensor, CacheWorker
from kvswap.client import cuda_export as ce
from kvswap.client.cuda_export import (
    CudaDriverError,
    CudaLocation,
    array_info,
    check_block_contiguous,
    export_tensor,
    format_uuid,
    is_c_contiguous,
    parse_cuda_array_interface,
)
from kvswap.client.errors import ErrorCode, InvalidTask, NotReady
from kvswap.client.layout import TensorDesc
from kvswap.client.protocol import Op, packb
from kvswap.daemon import cuda_backend as cb
from kvswap.daemon import cuda_memory as cm
from kvswap.daemon.backend import make_backend
from kvswap.daemon.swap_space import HostSwapSpace
from kvswap.daemon.cuda_memory import (
    IpcMappings,
    PinnedHostRange,
    group_by_allocation,
    plan_pin_chunks,
    touch_pages,
    uuid_to_ordinal,
)
from kvswap.kernels import cuda_copy as cc
from kvswap.kernels.cuda_copy import (
    TABLE_DTYPE,
    CudaUnavailable,
    TensorPointers,
    build_arg_table,
    kernel_args,
    launch_geometry,
    memcpy_ops,
    memcpy_run_blocks_from_env,
    pick_vector_width,
    split_at_boundaries,
    split_plan,
)

PAGE = cm.PAGE_BYTES
UUID0 = bytes(range(16))
UUID1 = bytes(range(100, 116))


# ============================================================================ fakes


class FakeCAI:
    """Any object exposing __cuda_array_interface__ (like a cupy array)."""

    def __init__(self, ptr, shape, typestr="<f2", strides=None, readonly=False, **extra):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, readonly), "strides": strides,
                                         "version": 3, **extra}


class Tensor:
    """Stands in for torch.Tensor: matched by module and class name, as torch is."""


Tensor.__module__ = "torch"


class FakeTorch(Tensor):
    def __init__(self, ptr, shape, dtype="torch.bfloat16", itemsize=2, stride=None,
                 cuda=True):
        self._ptr, self.shape, self._itemsize = ptr, shape, itemsize
        self.dtype = _TorchDtype(dtype)
        self._stride = stride or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        self.is_cuda = cuda
        self.device = "cuda:0" if cuda else "cpu"

    def data_ptr(self):
        return self._ptr

    def element_size(self):
        return self._itemsize

    def stride(self):
        return self._stride


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


def fake_handle(base: int, size: int) -> bytes:
    return struct.pack("<QQ", base, size) + bytes(48)


class FakeDriver:
    """DriverAPI over a table of allocations {base: size} on one device."""

    def __init__(self, allocations=None, ordinal=0, uuids=None, managed=False, mem_type=2,
                 capable=True, fail_handle=False):
        self.allocations = dict(allocations or {})
        self.ordinal = ordinal
        self.uuids = uuids if uuids is not None else {0: UUID0, 1: UUID1}
        self.managed, self.mem_type, self.capable = managed, mem_type, capable
        self.fail_handle = fail_handle
        self.handle_calls: list[int] = []

    def _find(self, ptr):
        for base, size in self.allocations.items():
            if base <= ptr < base + size:
                return base, size
        raise CudaDriverError("cuPointerGetAttribute", 1, "CUDA_ERROR_INVALID_VALUE (1)")

    def memory_type(self, ptr):
        self._find(ptr)
        return self.mem_type

    def is_managed(self, ptr):
        return self.managed

    def ipc_capable(self, ptr):
        return self.capable

    def device_ordinal(self, ptr):
        return self.ordinal

    def allocation_range(self, ptr):
        return self._find(ptr)

    def ipc_handle(self, base):
        self.handle_calls.append(base)
        if self.fail_handle:
            raise CudaDriverError("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE (1)")
        return fake_handle(base, self.allocations[base])

    def device_uuid(self, ordinal):
        return self.uuids[ordinal]

    def device_uuids(self):
        return sorted(self.uuids.items())


class FakeRuntimeError(Exception):
    pass


class FakeRuntime:
    """The cupy.cuda.runtime functions the backend's bookkeeping calls."""

    CUDARuntimeError = FakeRuntimeError

    def __init__(self, driver=None, delta=0x7F00_0000_0000, chunk_delta_step=0, fail_register_at=None,
                 fail_open_at=None, shrink_opened_by=0):
        self.driver = driver
        self.delta, self.chunk_delta_step = delta, chunk_delta_step
        self.fail_register_at, self.fail_open_at = fail_register_at, fail_open_at
        self.shrink_opened_by = shrink_opened_by
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (size, flags)
        self.register_log: list[tuple[int, int, int]] = []
        self.unregister_log: list[int] = []
        self.opened: dict[int, int] = {}
        self.open_log: list[bytes] = []
        self.close_log: list[int] = []
        self._next_ptr = 0x5000_0000_0000

    def hostRegister(self, ptr, size, flags):
        if self.fail_register_at == len(self.register_log):
            self.register_log.append((ptr, size, flags))
            raise FakeRuntimeError("cudaErrorMemoryAllocation: out of memory")
        for p, (n, _) in self.registered.items():
            if p < ptr + size and ptr < p + n:
                raise FakeRuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.register_log.append((ptr, size, flags))
        self.registered[ptr] = (size, flags)

    def hostUnregister(self, ptr):
        if ptr not in self.registered:
            raise FakeRuntimeError("cudaErrorHostMemoryNotRegistered")
        del self.registered[ptr]
        self.unregister_log.append(ptr)

    def pointerGetAttributes(self, ptr):
        for i, (p, (n, _)) in enumerate(sorted(self.registered.items())):
            if p <= ptr < p + n:
                return SimpleNamespace(type=1, devicePointer=ptr + self.delta
                                       + i * self.chunk_delta_step, hostPointer=ptr, device=0)
        return SimpleNamespace(type=0, devicePointer=0, hostPointer=0, device=-2)

    def ipcOpenMemHandle(self, handle, flags):
        assert flags == cm.IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        if self.fail_open_at == len(self.open_log):
            self.open_log.append(handle)
            raise FakeRuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")
        self.open_log.append(handle)
        _, size = struct.unpack("<QQ", handle[:16])
        ptr = self._next_ptr
        self._next_ptr += 1 << 40
        self.opened[ptr] = size
        self.driver.allocations[ptr] = size - self.shrink_opened_by
        return ptr

    def ipcCloseMemHandle(self, ptr):
        if ptr not in self.opened:
            raise FakeRuntimeError("cudaErrorInvalidValue")
        del self.opened[ptr]
        del self.driver.allocations[ptr]
        self.close_log.append(ptr)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, writable byte buffer (anonymous mapping, kept alive by the array)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


# ============================================================================ tensor inspection


def test_cai_contiguous_default_strides_and_dtype():
    info = parse_cuda_array_interface(FakeCAI(0x1000, (8, 16, 4), "<f2").__cuda_array_interface__,
                                      "k0")
    assert info.ptr == 0x1000
    assert info.shape == (8, 16, 4)
    assert info.dtype == "<f2"
    assert info.strides == (128, 8, 2)
    assert info.nbytes == 8 * 16 * 4 * 2
    check_block_contiguous(info, "k0")  # contiguous: no error
    assert is_c_contiguous(info.shape, info.strides, 2)


def test_cai_uint8_typestr_is_normalized():
    info = array_info(FakeCAI(0x1000, (4, 7), "<u1"), "k0_fp8")
    assert info.dtype == "|u1"
    assert info.strides == (7, 1)


def test_non_contiguous_tensor_is_rejected_by_name():
    # a transposed (4, 8) view of an (8, 4) fp16 array
    info = array_info(FakeCAI(0x1000, (4, 8), "<f2", strides=(2, 8)), "v3")
    with pytest.raises(InvalidTask) as ei:
        check_block_contiguous(info, "v3")
    assert ei.value.code == ErrorCode.BAD_LAYOUT
    assert "v3" in str(ei.value) and "not C-contiguous" in str(ei.value)


def test_size_one_dimension_may_have_any_stride():
    info = array_info(FakeCAI(0x1000, (6, 1, 4), "<f4", strides=(16, 999, 4)), "s")
    check_block_contiguous(info, "s")
    assert is_c_contiguous((6, 1, 4), (16, 999, 4), 4)
    assert not is_c_contiguous((6, 2, 4), (16, 999, 4), 4)


@pytest.mark.parametrize("cai, fragment", [
    ({"shape": (4, 2), "typestr": "<f2", "data": (0x1000, True)}, "read-only"),
    ({"shape": (4, 2), "typestr": "<f2", "data": (0x1000, False), "mask": object()}, "masked"),
    ({"shape": (0, 2), "typestr": "<f2", "data": (0x1000, False)}, "no empty dimension"),
    ({"shape": (), "typestr": "<f2", "data": (0x1000, False)}, "blocks on axis 0"),
    ({"shape": (4, 2), "typestr": "<f2", "data": (0, False)}, "null data pointer"),
    ({"shape": (4, 2), "typestr": "<zz", "data": (0x1000, False)}, "unknown typestr"),
    ({"shape": (4, 2), "typestr": "<f2"}, "no 'data'"),
    ({"shape": (4, 2), "typestr": "<f2", "data": (0x1000, False), "strides": (4,)},
     "strides must be"),
])
def test_bad_interfaces_are_rejected(cai, fragment):
    with pytest.raises(InvalidTask) as ei:
        parse_cuda_array_interface(cai, "k1")
    assert fragment in str(ei.value)
    assert "tensor k1" in str(ei.value)


def test_cpu_arrays_are_rejected_with_the_reason():
    with pytest.raises(InvalidTask) as ei:
        array_info(np.zeros((4, 8), np.float16), "k0")
    msg = str(ei.value)
    assert "numpy.ndarray" in msg and "__cuda_array_interface__" in msg and "k0" in msg


def test_torch_cpu_tensor_is_rejected():
    with pytest.raises(InvalidTask) as ei:
        array_info(FakeTorch(0x1000, (4, 8), cuda=False), "k0")
    assert "cpu" in str(ei.value) and "not on a CUDA device" in str(ei.value)


def test_torch_bf16_and_fp8_read_without_the_cuda_array_interface():
    bf16 = array_info(FakeTorch(0x2000, (4, 16, 8), "torch.bfloat16", 2), "k0")
    assert bf16.dtype == "<u2" and bf16.strides == (256, 16, 2) and bf16.ptr == 0x2000
    fp8 = array_info(FakeTorch(0x2000, (4, 16), "torch.float8_e4m3fn", 1), "k0")
    assert fp8.dtype == "|u1"
    f32 = array_info(FakeTorch(0x2000, (4, 16), "torch.float32", 4), "k0_scale")
    assert f32.dtype == "<f4" and f32.strides == (64, 4)
    transposed = array_info(FakeTorch(0x2000, (4, 16), "torch.float16", 2, stride=(1, 4)), "v")
    with pytest.raises(InvalidTask):
        check_block_contiguous(transposed, "v")


# ============================================================================ export


def test_export_offset_handle_uuid_and_strides():
    base, size = 0x7000_0000, 1 << 20
    drv = FakeDriver({base: size}, ordinal=1)
    exp = export_tensor(FakeCAI(base + 4096, (8, 32), "<f2"), "v0", drv)
    loc = exp.location
    assert exp.dtype == "<f2" and exp.shape == (8, 32)
    assert loc.offset == 4096 and loc.alloc_size == size and loc.base == base
    assert loc.handle == fake_handle(base, size) and len(loc.handle) == ce.IPC_HANDLE_BYTES
    assert loc.uuid == UUID1.hex()  # the device's UUID, not its ordinal
    assert loc.strides == (64, 2)
    assert drv.handle_calls == [base]  # the handle is taken on the allocation base


def test_export_rejects_vmm_memory_with_the_allocator_hint():
    drv = FakeDriver({0x7000_0000: 1 << 20}, capable=False)
    with pytest.raises(InvalidTask) as ei:
        export_tensor(FakeCAI(0x7000_0000, (8, 32)), "k5", drv)
    msg = str(ei.value)
    assert "k5" in msg and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in msg
    assert drv.handle_calls == []


def test_export_failing_handle_gives_the_hint_when_capability_is_unknown():
    drv = FakeDriver({0x7000_0000: 1 << 20}, capable=None, fail_handle=True)
    with pytest.raises(InvalidTask) as ei:
        export_tensor(FakeCAI(0x7000_0000, (8, 32)), "k5", drv)
    assert "cudaIpcGetMemHandle failed" in str(ei.value)
    assert "expandable_segments:False" in str(ei.value)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"managed": True}, "managed memory"),
    ({"mem_type": 1}, "not device memory"),
])
def test_export_rejects_non_device_memory(kwargs, fragment):
    drv = FakeDriver({0x7000_0000: 1 << 20}, **kwargs)
    with pytest.raises(InvalidTask) as ei:
        export_tensor(FakeCAI(0x7000_0000, (8, 32)), "k0", drv)
    assert fragment in str(ei.value)


def test_export_rejects_a_tensor_past_its_allocation():
    drv = FakeDriver({0x7000_0000: 1000})
    with pytest.raises(InvalidTask) as ei:
        export_tensor(FakeCAI(0x7000_0000 + 512, (8, 64), "|u1"), "k0", drv)
    assert "allocation of 1000 bytes" in str(ei.value)


def test_export_turns_driver_errors_into_layout_errors():
    with pytest.raises(InvalidTask) as ei:
        export_tensor(FakeCAI(0x1234, (8, 32)), "k9", FakeDriver({}))
    assert ei.value.code == ErrorCode.BAD_LAYOUT
    assert "k9" in str(ei.value) and "CUDA_ERROR_INVALID_VALUE" in str(ei.value)


# ============================================================================ wire location


def _location(**over) -> CudaLocation:
    fields = dict(handle=bytes(range(64)), offset=4096, alloc_size=1 << 30,
                  uuid=UUID0.hex(), base=0x7F00_0000_0000, strides=(512, 2))
    fields.update(over)
    return CudaLocation(**fields)


def test_location_survives_msgpack_like_the_protocol_sends_it():
    loc = _location()
    desc = TensorDesc("k0", 0, "<f2", (16, 256), loc.to_wire())
    wire = msgpack.unpackb(packb(desc.to_wire()), raw=False, strict_map_key=False)
    back = TensorDesc.from_wire(wire)
    assert CudaLocation.from_wire(back.location, "k0") == loc


@pytest.mark.parametrize("key, value, fragment", [
    ("ipc", bytes(12), "64 bytes"),
    ("ipc", "not-bytes", "64 bytes"),
    ("offset", -1, "offset"),
    ("offset", True, "offset"),
    ("alloc_size", 0, "alloc_size"),
    ("base", 0, "base"),
    ("uuid", "GPU-123", "uuid"),
    ("uuid", UUID0.hex().upper(), "uuid"),
    ("strides", [1.5], "strides"),
])
def test_malformed_locations_are_rejected(key, value, fragment):
    wire = _location().to_wire()
    wire[key] = value
    with pytest.raises(InvalidTask) as ei:
        CudaLocation.from_wire(wire, "v2")
    assert fragment in str(ei.value) and "v2" in str(ei.value)
    assert ei.value.code == ErrorCode.BAD_LAYOUT


def test_host_backend_location_is_rejected_by_the_cuda_decoder():
    with pytest.raises(InvalidTask) as ei:
        CudaLocation.from_wire({"shm": "/kvswap.x.dev.r0.k0"}, "k0")
    assert "cuda location misses" in str(ei.value)


# ============================================================================ devices and allocations


def test_uuid_maps_to_this_process_ordinal():
    # The daemon sees the engine's GPU 1 as its ordinal 0 (other CUDA_VISIBLE_DEVICES).
    assert uuid_to_ordinal(UUID1.hex(), [(0, UUID1), (1, UUID0)]) == 0
    assert uuid_to_ordinal(UUID0.hex(), [(0, UUID1), (1, UUID0)]) == 1


def test_unknown_uuid_names_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(InvalidTask) as ei:
        uuid_to_ordinal(UUID1.hex(), [(0, UUID0)])
    msg = str(ei.value)
    assert format_uuid(UUID1.hex()) in msg and format_uuid(UUID0.hex()) in msg
    assert "CUDA_VISIBLE_DEVICES='3'" in msg
    assert format_uuid(UUID0.hex()) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def _descs_and_locs(specs):
    """specs: (name, shape, dtype, base, offset, alloc_size)"""
    descs, locs = [], []
    for name, shape, dtype, base, offset, size in specs:
        d = TensorDesc(name, 0, np.dtype(dtype).str, shape)
        descs.append(d)
        locs.append(_location(base=base, offset=offset, alloc_size=size,
                              handle=fake_handle(base, size)))
    return descs, locs


def test_tensors_of_one_allocation_are_grouped_once():
    descs, locs = _descs_and_locs([
        ("k0", (8, 64), "<f2", 0x1000_0000, 0, 8192),
        ("v0", (8, 64), "<f2", 0x1000_0000, 1024, 8192),
        ("k1", (8, 64), "<f2", 0x2000_0000, 0, 1024),
        ("v1", (8, 64), "<f2", 0x1000_0000, 4096, 8192),
    ])
    groups = group_by_allocation(descs, locs)
    assert [g.members for g in groups] == [[0, 1, 3], [2]]
    assert groups[0].extent == 4096 + 1024 and groups[1].extent == 1024
    assert groups[0].handle == fake_handle(0x1000_0000, 8192)


def test_same_base_on_another_gpu_is_another_allocation():
    descs, locs = _descs_and_locs([("k0", (8, 64), "<f2", 0x1000_0000, 0, 8192),
                                   ("v0", (8, 64), "<f2", 0x1000_0000, 1024, 8192)])
    locs[1] = _location(base=0x1000_0000, offset=1024, alloc_size=8192, uuid=UUID1.hex())
    assert len(group_by_allocation(descs, locs)) == 2


@pytest.mark.parametrize("specs, fragment", [
    ([("k0", (8, 64), "<f2", 0x1000, 0, 8192), ("v0", (8, 64), "<f2", 0x1000, 512, 8192)],
     "overlap"),
    ([("k0", (8, 64), "<f2", 0x1000, 7680, 8192)], "exceed its allocation"),
])
def test_bad_allocation_layouts_are_rejected(specs, fragment):
    descs, locs = _descs_and_locs(specs)
    with pytest.raises(InvalidTask) as ei:
        group_by_allocation(descs, locs)
    assert fragment in str(ei.value)


def test_inconsistent_allocation_sizes_are_rejected():
    descs, locs = _descs_and_locs([("k0", (8, 64), "<f2", 0x1000, 0, 8192),
                                   ("v0", (8, 64), "<f2", 0x1000, 1024, 16384)])
    with pytest.raises(InvalidTask) as ei:
        group_by_allocation(descs, locs)
    assert "k0 and v0" in str(ei.value)


# ============================================================================ pinning


def test_pin_chunks_are_page_aligned_and_cover_everything():
    chunks = plan_pin_chunks(10 * PAGE + 123, 3 * PAGE + 100)
    assert chunks == [(0, 3 * PAGE), (3 * PAGE, 3 * PAGE), (6 * PAGE, 3 * PAGE),
                      (9 * PAGE, PAGE + 123)]
    assert plan_pin_chunks(100, 1) == [(0, 100)]  # never smaller than a page


def test_touch_pages_changes_no_byte():
    view = aligned_buffer(5 * PAGE)
    view[:] = np.random.default_rng(1).integers(0, 256, view.shape, dtype=np.uint8)
    before = view.copy()
    touch_pages(view)
    assert np.array_equal(view, before)


def test_pinning_registers_chunks_reports_progress_and_unpins():
    size = 10 * PAGE + 123
    view = aligned_buffer(size)
    view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    before = view.copy()
    rt = FakeRuntime()
    progress = []
    pinned = PinnedHostRange(rt, view, chunk_bytes=3 * PAGE, on_progress=progress.append,
                             threads=3)
    pinned.pin()
    ptr = pinned.ptr
    assert [(p - ptr, n, f) for p, n, f in rt.register_log] == [
        (0, 3 * PAGE, 3), (3 * PAGE, 3 * PAGE, 3), (6 * PAGE, 3 * PAGE, 3), (9 * PAGE, PAGE + 123, 3)]
    assert progress == [3 * PAGE, 6 * PAGE, 9 * PAGE, size]
    assert pinned.mapped_delta == rt.delta
    assert pinned.boundaries == [ptr + 3 * PAGE, ptr + 6 * PAGE, ptr + 9 * PAGE]
    assert np.array_equal(view, before)
    pinned.unpin()
    assert rt.registered == {} and len(rt.unregister_log) == 4
    pinned.unpin()  # idempotent
    assert len(rt.unregister_log) == 4 and pinned.mapped_delta is None


def test_a_failed_registration_unpins_what_was_pinned():
    view = aligned_buffer(8 * PAGE)
    rt = FakeRuntime(fail_register_at=2)
    pinned = PinnedHostRange(rt, view, chunk_bytes=2 * PAGE)
    with pytest.raises(InvalidTask) as ei:
        pinned.pin()
    assert "cudaHostRegister" in str(ei.value) and "ulimit -l" in str(ei.value)
    assert rt.registered == {}
    assert rt.unregister_log == [pinned.ptr + 2 * PAGE, pinned.ptr]


def test_chunks_mapped_at_unrelated_device_addresses_are_refused():
    view = aligned_buffer(4 * PAGE)
    rt = FakeRuntime(chunk_delta_step=1 << 30)
    pinned = PinnedHostRange(rt, view, chunk_bytes=2 * PAGE)
    with pytest.raises(InvalidTask) as ei:
        pinned.pin()
    assert "unrelated addresses" in str(ei.value)
    assert rt.registered == {}


def test_pinning_twice_without_unpin_is_what_the_driver_refuses():
    # The backend detaches before it attaches again because of exactly this.
    view = aligned_buffer(4 * PAGE)
    rt = FakeRuntime()
    first = PinnedHostRange(rt, view, chunk_bytes=2 * PAGE)
    first.pin()
    with pytest.raises(InvalidTask):
        PinnedHostRange(rt, view, chunk_bytes=2 * PAGE).pin()
    assert len(rt.registered) == 2  # the first registration is untouched
    first.unpin()


# ============================================================================ IPC bookkeeping


def _groups():
    descs, locs = _descs_and_locs([
        ("k0", (8, 64), "<f2", 0x1000_0000, 0, 8192),
        ("v0", (8, 64), "<f2", 0x1000_0000, 1024, 8192),
        ("k1", (8, 64), "<f2", 0x2000_0000, 0, 4096),
    ])
    return descs, group_by_allocation(descs, locs)


def test_each_allocation_is_opened_once_and_closed_once():
    descs, groups = _groups()
    drv = FakeDriver({})
    rt = FakeRuntime(driver=drv)
    maps = IpcMappings(rt, drv)
    maps.open(groups, descs)
    assert len(rt.open_log) == 2 and set(maps.opened) == {g.key for g in groups}
    maps.close()
    assert rt.opened == {} and len(rt.close_log) == 2
    maps.close()
    assert len(rt.close_log) == 2


def test_a_failed_open_closes_the_others_and_names_the_tensors():
    descs, groups = _groups()
    drv = FakeDriver({})
    rt = FakeRuntime(driver=drv, fail_open_at=1)
    maps = IpcMappings(rt, drv)
    with pytest.raises(InvalidTask) as ei:
        maps.open(groups, descs)
    assert "tensors k1" in str(ei.value) and "cudaIpcOpenMemHandle" in str(ei.value)
    assert rt.opened == {} and maps.opened == {}


def test_an_opened_mapping_smaller_than_the_tensors_is_refused():
    descs, groups = _groups()
    drv = FakeDriver({})
    rt = FakeRuntime(driver=drv, shrink_opened_by=8192 - 1024)
    maps = IpcMappings(rt, drv)
    with pytest.raises(InvalidTask) as ei:
        maps.open(groups, descs)
    assert "k0, v0" in str(ei.value) and "need 2048 bytes" in str(ei.value)
    assert rt.opened == {}


# ============================================================================ copy planning


def test_vector_width_needs_both_bases_and_the_block_size_aligned():
    assert pick_vector_width(0x1000, 0x2000, 32768) == 16
    assert pick_vector_width(0x1008, 0x2000, 32768) == 8
    assert pick_vector_width(0x1000, 0x2004, 32768) == 4
    assert pick_vector_width(0x1000, 0x2000, 8 * 6) == 16
    assert pick_vector_width(0x1000, 0x2000, 24) == 8
    assert pick_vector_width(0x1000, 0x2000, 12) == 4
    assert pick_vector_width(0x1000, 0x2000, 21) == 1
    assert pick_vector_width(0x1001, 0x2000, 32) == 1
    assert pick_vector_width(0x1000, 0x2000, 6) == 1  # no 2-byte path


def test_arg_table_numbers_segments_per_block_id():
    tensors = [TensorPointers("a", 0x1000, 0, 0x9000, 40 << 10),   # 3 segments of 16 KiB
               TensorPointers("b", 0x2001, 0, 0xA000, 21),        # 1 segment, width 1
               TensorPointers("c", 0x3000, 0, 0xB000, 16 << 10)]  # 1 segment
    table, total = build_arg_table(tensors)
    assert table.dtype == TABLE_DTYPE
    assert table["seg_first"].tolist() == [0, 3, 4] and total == 5
    assert table["vec_bytes"].tolist() == [16, 1, 16]
    assert table["host"].tolist() == [0x9000, 0xA000, 0xB000]  # the device-mapped address
    assert table.view(np.uint64).shape == (15,)


def test_split_sends_long_runs_to_memcpy_and_the_rest_to_the_kernel():
    dev = np.array([10, 11, 12, 13, 40, 7, 8, 50, 51, 52, 53, 54])
    host = np.array([0, 1, 2, 3, 9, 20, 21, 30, 31, 32, 33, 34])
    s = split_plan(dev, host, memcpy_run_blocks=4)
    assert s.run_device.tolist() == [10, 50] and s.run_host.tolist() == [0, 30]
    assert s.run_counts.tolist() == [4, 5]
    assert s.kernel_device.tolist() == [40, 7, 8] and s.kernel_host.tolist() == [9, 20, 21]
    assert s.num_blocks == 12
    everything_kernel = split_plan(dev, host, memcpy_run_blocks=100)
    assert everything_kernel.run_counts.size == 0
    assert everything_kernel.kernel_device.tolist() == dev.tolist()
    with pytest.raises(ValueError):
        split_plan(dev, host, 0)


def test_memcpy_runs_are_cut_at_registration_boundaries():
    t = TensorPointers("k", device=0x10_0000, host=0x80_0000, host_mapped=0, block_bytes=1000)
    s = split_plan(np.arange(5, 10), np.arange(2, 7), memcpy_run_blocks=2)
    boundary = 0x80_0000 + 4000 + 500  # inside host block 4
    ops = memcpy_ops(s, [t], True, np.array([boundary, 0x90_0000]))
    assert [(o.src - 0x10_0000, o.dst - 0x80_0000, o.nbytes) for o in ops] == [
        (5000, 2000, 2500), (7500, 4500, 2500)]
    loads = memcpy_ops(s, [t], False, np.array([boundary]))
    assert [(o.src - 0x80_0000, o.dst - 0x10_0000, o.nbytes) for o in loads] == [
        (2000, 5000, 2500), (4500, 7500, 2500)]
    assert split_at_boundaries(100, 50, np.array([100, 150, 120])) == [(100, 20), (120, 30)]


def test_launch_geometry_covers_items_within_one_wave():
    assert launch_geometry(1, 132) == (1, 256)
    assert launch_geometry(8, 132) == (1, 256)
    assert launch_geometry(9, 132) == (2, 256)
    assert launch_geometry(10**7, 132) == (132 * cc.CTAS_PER_SM, 256)


def test_memcpy_threshold_comes_from_the_environment():
    assert memcpy_run_blocks_from_env({}) == cc.DEFAULT_MEMCPY_RUN_BLOCKS
    assert memcpy_run_blocks_from_env({"KVSWAP_MEMCPY_RUN_BLOCKS": "64"}) == 64
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError) as ei:
            memcpy_run_blocks_from_env({"KVSWAP_MEMCPY_RUN_BLOCKS": bad})
        assert "KVSWAP_MEMCPY_RUN_BLOCKS" in str(ei.value)


def test_id_buffers_grow_by_doubling():
    assert cc.grow_capacity(0, 10) == 1024
    assert cc.grow_capacity(1024, 1025) == 2048
    assert cc.grow_capacity(2048, 9000) == 16384
    assert cc.grow_capacity(4096, 100) == 4096


# ============================================================================ emulated copy


def _find_tensor(seg_first: list[int], seg: int) -> int:
    """The kernel's binary search, step for step."""
    lo, hi = 0, len(seg_first) - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if seg_first[mid] <= seg:
            lo = mid
        else:
            hi = mid - 1
    return lo


def emulate_kernel(table, total_segs, segment_bytes, dev_ids, host_ids, to_host, grid, threads,
                   host_delta, memmove=ctypes.memmove):
    """Run block_copy.cu's indexing on the CPU: every warp's grid-stride loop,
    with the copies done by memmove on real addresses (mapped host addresses are
    turned back into host addresses with ``host_delta``)."""
    seg_first = table["seg_first"].tolist()
    warps = grid * (threads // 32)
    items = len(dev_ids) * total_segs
    for warp in range(warps):
        for item in range(warp, items, warps):
            k, seg = divmod(item, total_segs)
            e = table[_find_tensor(seg_first, seg)]
            bpb, vec = int(e["block_bytes"]), int(e["vec_bytes"])
            lo = (seg - int(e["seg_first"])) * segment_bytes
            assert lo < bpb
            nbytes = min(lo + segment_bytes, bpb) - lo
            dev = int(e["device"]) + int(dev_ids[k]) * bpb + lo
            host = int(e["host"]) + int(host_ids[k]) * bpb + lo
            assert dev % vec == 0 and host % vec == 0 and nbytes % vec == 0
            host -= host_delta
            src, dst = (dev, host) if to_host else (host, dev)
            memmove(dst, src, nbytes)


class EmulatedRank:
    """Device tensors carved from one buffer at awkward offsets, and a host pool."""

    # (name, bytes per block, padding before the tensor): the padding and block
    # sizes give access widths 16, 1, 4 and 8.
    SPECS = [("k0", 40 << 10, 0), ("v0", 40 << 10, 0), ("s0", 21, 0), ("k1", 4 << 10, 4),
             ("x", 24, 4)]

    def __init__(self, num_dev=24, num_host=32, delta=0x1000_0000):
        rng = np.random.default_rng(7)
        self.num_dev, self.num_host, self.delta = num_dev, num_host, delta
        offsets, pos = [], 0
        for _, bpb, pad in self.SPECS:
            pos += pad
            offsets.append(pos)
            pos += num_dev * bpb
        self.dev_buf = np.zeros(pos, np.uint8)
        dev_base = self.dev_buf.__array_interface__["data"][0]
        self.dev = [self.dev_buf[off:off + num_dev * bpb].reshape(num_dev, bpb)
                    for (_, bpb, _), off in zip(self.SPECS, offsets)]
        for d in self.dev:
            d[:] = rng.integers(0, 256, d.shape, dtype=np.uint8)
        self.host = [np.zeros((num_host, bpb), np.uint8) for _, bpb, _ in self.SPECS]
        self.pointers = [
            TensorPointers(name, dev_base + off, h.__array_interface__["data"][0],
                           h.__array_interface__["data"][0] + delta, bpb)
            for (name, bpb, _), off, h in zip(self.SPECS, offsets, self.host)]

    def run(self, to_host, dev_ids, host_ids, threshold, tensors=None):
        ptrs = self.pointers if tensors is None else [self.pointers[i] for i in tensors]
        split = split_plan(dev_ids, host_ids, threshold)
        boundaries = np.array([p.host + 3 * p.block_bytes + 7 for p in ptrs])  # cut some runs
        for op in memcpy_ops(split, ptrs, to_host, boundaries):
            ctypes.memmove(op.dst, op.src, op.nbytes)
        if split.kernel_device.size:
            table, total = build_arg_table(ptrs)
            args = kernel_args(table, len(ptrs), total, split.kernel_device, split.kernel_host,
                               split.kernel_device.size, to_host)
            grid, threads = launch_geometry(split.kernel_device.size * total, sm_count=2)
            emulate_kernel(args[0], int(args[2]), int(args[3]), args[4], args[5], bool(args[7]),
                           grid, threads, self.delta)
        return split.num_blocks * sum(p.block_bytes for p in ptrs)


@pytest.mark.parametrize("threshold", [1, 3, 1000])
def test_emulated_tasks_move_exactly_the_named_blocks(threshold):
    rank = EmulatedRank()
    widths = build_arg_table(rank.pointers)[0]["vec_bytes"].tolist()
    assert widths == [16, 16, 1, 4, 8]  # every access path of the kernel
    rng = random.Random(threshold)
    model_dev = [d.copy() for d in rank.dev]
    model_host = [h.copy() for h in rank.host]
    for step in range(30):
        k = rng.randint(1, 10)
        if rng.random() < 0.4:  # a consecutive run on both sides
            d0, h0 = rng.randrange(rank.num_dev - k), rng.randrange(rank.num_host - k)
            dev_ids, host_ids = np.arange(d0, d0 + k), np.arange(h0, h0 + k)
        else:
            dev_ids = np.array(rng.sample(range(rank.num_dev), k))
            host_ids = np.array(rng.sample(range(rank.num_host), k))
        to_host = step % 3 != 2
        tensors = [0, 2] if step % 5 == 4 else None
        moved = rank.run(to_host, dev_ids, host_ids, threshold, tensors)
        for i in (tensors if tensors is not None else range(len(rank.SPECS))):
            if to_host:
                model_host[i][host_ids] = model_dev[i][dev_ids]
            else:
                model_dev[i][dev_ids] = model_host[i][host_ids]
        which = tensors if tensors is not None else range(len(rank.SPECS))
        assert moved == k * sum(rank.SPECS[i][1] for i in which)
        for i in range(len(rank.SPECS)):
            assert np.array_equal(rank.dev[i], model_dev[i]), (step, rank.SPECS[i][0], "device")
            assert np.array_equal(rank.host[i], model_host[i]), (step, rank.SPECS[i][0], "host")


# ============================================================================ kernel source and ABI


def _kernel_source() -> str:
    return cc.kernel_source()


def test_table_dtype_matches_the_kernel_struct():
    src = _kernel_source()
    body = re.search(r"struct TensorEntry \{(.*?)\};", src, re.S).group(1)
    fields = re.findall(r"^\s*(unsigned long long)\s+(\w+);", body, re.M)
    assert [name for _, name in fields] == list(TABLE_DTYPE.names)
    assert all(TABLE_DTYPE[n] == np.dtype("<u8") for n in TABLE_DTYPE.names)


def test_kernel_args_match_the_kernel_parameters():
    src = _kernel_source()
    params = re.search(r'extern "C" __global__ void ' + cc.KERNEL_NAME + r"\((.*?)\)\s*\{",
                       src, re.S).group(1)
    decls = [" ".join(p.split()) for p in params.split(",")]
    table, dev_ids, host_ids = object(), object(), object()
    args = kernel_args(table, 3, 5, dev_ids, host_ids, 7, True)
    assert len(args) == len(decls)
    c_scalars = {"int": np.dtype(np.int32), "unsigned long long": np.dtype(np.uint64)}
    for decl, arg in zip(decls, args):
        ctype = re.sub(r"\s*\w+$", "", decl.replace("__restrict__", "")).strip()
        if "*" in ctype:
            assert arg in (table, dev_ids, host_ids), decl
        else:
            assert isinstance(arg, np.generic) and arg.dtype == c_scalars[ctype], decl
    assert int(args[1]) == 3 and int(args[2]) == 5 and int(args[3]) == cc.SEGMENT_BYTES
    assert int(args[6]) == 7 and int(args[7]) == 1
    assert int(kernel_args(table, 3, 5, dev_ids, host_ids, 7, False)[7]) == 0


def test_kernel_source_needs_no_headers():
    assert "#include" not in _kernel_source()  # NVRTC compiles it without include paths


def _nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_kernel_compiles_with_nvcc(tmp_path):
    out = tmp_path / "block_copy.ptx"
    res = subprocess.run([_nvcc(), "-ptx", "-arch=sm_80", "-std=c++17", "-o", str(out),
                          str(cc.KERNEL_SOURCE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f".entry {cc.KERNEL_NAME}(" in out.read_text()


# ============================================================================ imports and integration


def test_client_import_loads_no_gpu_library():
    code = ("import sys, kvswap.client, kvswap.client.cuda_export, kvswap.daemon.cuda_backend, "
            "kvswap.kernels.cuda_copy\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch', "
            "'cupy_backends'))\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_make_backend_cuda_without_cupy_says_what_to_install(run_root):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed; covered by tests/test_gpu.py")
    from kvswap.client.naming import Names

    with pytest.raises(CudaUnavailable) as ei:
        make_backend("cuda", Names.of("nocupy", run_root), 0)
    assert "cupy" in str(ei.value) and "kvswap[cuda12]" in str(ei.value)


def test_cuda_worker_describes_tensors_through_the_exporter(namespaces, monkeypatch):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False)
    base = 0x7000_0000
    drv = FakeDriver({base: 1 << 20})
    monkeypatch.setattr(ce, "driver", lambda: drv)
    worker = CacheWorker(launcher.names.namespace, 0, run_root=launcher.cfg.run_root,
                         backend="cuda")
    try:
        desc = worker._describe(0, CacheTensor("v3", 3, FakeCAI(base + 2048, (16, 4, 8), "<f2")))
        assert (desc.name, desc.layer, desc.dtype, desc.shape) == ("v3", 3, "<f2", (16, 4, 8))
        loc = CudaLocation.from_wire(desc.location, "v3")
        assert loc.offset == 2048 and loc.base == base and loc.uuid == UUID0.hex()
        with pytest.raises(InvalidTask) as ei:
            worker.register([CacheTensor("k0", 0, np.zeros((16, 8), np.float16))], timeout=5)
        assert "k0" in str(ei.value) and "__cuda_array_interface__" in str(ei.value)
    finally:
        worker.close()


# ============================================================================ the backend on a fake cupy


WORKER_SHIFT = 0x1_0000_0000_0000  # the worker's addresses differ from the daemon's, as with IPC
MAPPED_DELTA = 0x2_0000_0000_0000  # device-visible address of pinned host memory - host address


def _addr(buf) -> int:
    return int(np.asarray(buf).__array_interface__["data"][0]) if not isinstance(buf, int) else buf


class FakeMemory:
    """The real buffers standing in for device memory and pinned host memory.  Every
    copy is checked to stay inside one buffer of the right kind before it happens,
    so a wrong address fails the test instead of crashing it."""

    def __init__(self):
        self.ranges: list[tuple[int, int, str]] = []

    def add(self, start: int, nbytes: int, kind: str) -> None:
        self.ranges.append((start, start + nbytes, kind))

    def kind_of(self, ptr: int, nbytes: int) -> str:
        for start, end, kind in self.ranges:
            if start <= ptr and ptr + nbytes <= end:
                return kind
        raise AssertionError(f"access [{ptr:#x}, +{nbytes}) is outside every known buffer")

    def memmove(self, dst: int, src: int, nbytes: int) -> None:
        self.kind_of(dst, nbytes)
        self.kind_of(src, nbytes)
        ctypes.memmove(dst, src, nbytes)


class FakeArray:
    """A 'device' array: numpy memory registered as device memory."""

    def __init__(self, a: np.ndarray, memory: FakeMemory, register: bool = True):
        self.a = a
        self.data = SimpleNamespace(ptr=_addr(a))
        if register:
            memory.add(self.data.ptr, a.nbytes, "device")
        self._memory = memory

    def __getitem__(self, key):
        return FakeArray(self.a[key], self._memory, register=False)


class FakePinned(bytearray):
    """cupy.cuda.alloc_pinned_memory: a buffer (for numpy) with a .ptr."""


class FakeCupy:
    """The slice of cupy the backend and the copier use, executing on the CPU:
    copies are immediate memmoves, the kernel is :func:`emulate_kernel`."""

    def __init__(self, runtime: "FakeCudaRuntime", memory: FakeMemory):
        self.memory = memory
        self.device_stack = [0]
        self.stream_stack: list[Any] = []
        self.launches: list[dict] = []
        fake = self

        class Device:
            def __init__(self, ordinal):
                self.id = ordinal

            def __enter__(self):
                fake.device_stack.append(self.id)
                return self

            def __exit__(self, *exc):
                fake.device_stack.pop()

        class Stream:
            def __init__(self, non_blocking=False, priority=None):
                self.non_blocking, self.priority = non_blocking, priority
                self.device = fake.device_stack[-1]
                self.ptr = id(self)

            def __enter__(self):
                fake.stream_stack.append(self)
                return self

            def __exit__(self, *exc):
                fake.stream_stack.pop()

            def synchronize(self):
                pass

        class Event:
            def __init__(self, block=False, disable_timing=False):
                assert block, "the executor thread should sleep, not spin, on completion"
                self.recorded = None

            def record(self, stream=None):
                self.recorded = stream

            def synchronize(self):
                assert self.recorded is not None

        def alloc_pinned_memory(nbytes):
            buf = FakePinned(nbytes)
            buf.ptr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
            memory.add(buf.ptr, nbytes, "host")
            return buf

        self.cuda = SimpleNamespace(
            Device=Device, Stream=Stream, Event=Event, runtime=runtime,
            alloc_pinned_memory=alloc_pinned_memory,
            get_current_stream=lambda: fake.stream_stack[-1] if fake.stream_stack else Stream(),
            nvrtc=SimpleNamespace(getVersion=lambda: (13, 0)),
            driver=SimpleNamespace(CUDADriverError=type("CUDADriverError", (Exception,), {})),
            compiler=SimpleNamespace(CompileException=type("CompileException", (Exception,), {})))

        class RawModule:
            def __init__(self, code):
                assert code == cc.kernel_source()

            def get_function(self, name):
                assert name == cc.KERNEL_NAME
                return fake.launch

        self.RawModule = RawModule

    def empty(self, n, dtype):
        return FakeArray(np.zeros(n, dtype=dtype), self.memory)

    def asarray(self, a):
        return FakeArray(np.array(a), self.memory)

    def launch(self, grid, block, args):
        stream = self.stream_stack[-1]
        assert stream.non_blocking and stream.device == self.device_stack[-1]
        table = args[0].a.view(TABLE_DTYPE)
        self.launches.append({"device": self.device_stack[-1], "priority": stream.priority,
                              "tensors": int(args[1]), "ids": int(args[6])})
        assert len(table) == int(args[1])
        emulate_kernel(table, int(args[2]), int(args[3]), args[4].a, args[5].a, bool(args[7]),
                       grid[0], block[0], MAPPED_DELTA, self.memory.memmove)


class FakeCudaRuntime(FakeRuntime):
    """FakeRuntime whose IPC handles open the worker's real buffers, and which
    copies for real."""

    cudaDevAttrMultiProcessorCount = 16
    cudaDevAttrCanMapHostMemory = 19
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2

    def __init__(self, driver, memory):
        super().__init__(driver=driver, delta=MAPPED_DELTA)
        self.memory = memory
        self.memcpys: list[tuple[int, int]] = []  # (bytes, kind)

    def getDeviceCount(self):
        return 2

    def deviceGetAttribute(self, attr, device):
        return {self.cudaDevAttrMultiProcessorCount: 4, self.cudaDevAttrCanMapHostMemory: 1}[attr]

    def ipcOpenMemHandle(self, handle, flags):
        assert flags == cm.IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        if self.fail_open_at == len(self.open_log):
            self.open_log.append(handle)
            raise FakeRuntimeError("cudaErrorInvalidResourceHandle")
        self.open_log.append(handle)
        worker_base, size = struct.unpack("<QQ", handle[:16])
        ptr = worker_base - WORKER_SHIFT
        self.opened[ptr] = size
        self.driver.allocations[ptr] = size
        return ptr

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        want = ("host", "device") if kind == self.memcpyDeviceToHost else ("device", "host")
        assert (self.memory.kind_of(dst, nbytes), self.memory.kind_of(src, nbytes)) == want
        self.memcpys.append((nbytes, kind))
        self.memory.memmove(dst, src, nbytes)


def _worker_tensors(memory, worker_drv, specs):
    """Allocate 'device' buffers, export every tensor as a CacheWorker would and
    send the descriptors through msgpack.  specs: list of allocations, each a
    (pad, [(name, layer, dtype, shape), ...])."""
    arrays, descs = [], []
    for pad, tensors in specs:
        sizes = [int(np.prod(shape)) * np.dtype(dt).itemsize for _, _, dt, shape in tensors]
        buf = np.zeros(pad + sum(sizes), np.uint8)
        real = _addr(buf)
        memory.add(real, buf.nbytes, "device")
        worker_drv.allocations[real + WORKER_SHIFT] = buf.nbytes
        off = pad
        for (name, layer, dt, shape), n in zip(tensors, sizes):
            arr = buf[off:off + n]
            arr[:] = np.random.default_rng(len(arrays)).integers(0, 256, n, dtype=np.uint8)
            arrays.append(arr.reshape(shape[0], -1))
            exp = export_tensor(FakeCAI(real + WORKER_SHIFT + off, shape, dt), name, worker_drv)
            wire = TensorDesc(name, layer, exp.dtype, exp.shape, exp.location.to_wire()).to_wire()
            descs.append(TensorDesc.from_wire(msgpack.unpackb(packb(wire), raw=False)))
            off += n
        arrays.append(buf)  # keeps the allocation alive with its views
    return [a for a in arrays if a.ndim == 2], descs


@pytest.fixture
def fake_cuda(monkeypatch):
    """cupy replaced by FakeCupy, libcuda by FakeDrivers (worker sees UUID1 as its
    ordinal 0; the daemon sees it as ordinal 1)."""
    memory = FakeMemory()
    worker_drv = FakeDriver({}, ordinal=0, uuids={0: UUID1})
    daemon_drv = FakeDriver({}, uuids={0: UUID0, 1: UUID1})
    runtime = FakeCudaRuntime(daemon_drv, memory)
    fake = FakeCupy(runtime, memory)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setattr(cb, "load_driver", lambda: daemon_drv)
    monkeypatch.setattr(cc, "_KERNELS", {})
    return SimpleNamespace(memory=memory, worker_drv=worker_drv, daemon_drv=daemon_drv,
                           runtime=runtime, cupy=fake)


SPECS = [
    (0, [("k0", 0, "<f2", (24, 4, 64)), ("v0", 0, "<f2", (24, 4, 64)),
         ("k1", 1, "<f2", (24, 4, 64)), ("v1", 1, "<f2", (24, 4, 64))]),
    (1, [("k1_scale", 1, "|u1", (24, 21))]),  # odd start and size: the 1-byte path
]


def test_backend_attach_copy_detach_on_a_fake_cupy(fake_cuda, namespaces):
    f = fake_cuda
    names = namespaces.new()
    dev, descs = _worker_tensors(f.memory, f.worker_drv, SPECS)
    swap = HostSwapSpace.open(names, 0, descs, num_host_blocks=32)
    f.memory.add(_addr(swap.region.array(0, (1,), np.uint8)), swap.region.size, "host")
    progress: list[int] = []
    backend = cb.CudaBackend(names, 0, on_pin_progress=progress.append, memcpy_run_blocks=3,
                             pin_chunk_bytes=4 * PAGE)
    try:
        backend.attach(descs, swap)
        assert backend.open_allocations == 2 and len(f.runtime.open_log) == 2
        chunks = len(plan_pin_chunks(swap.region.size, 4 * PAGE))
        assert len(f.runtime.registered) == chunks > 1
        assert progress == sorted(progress) and progress[-1] == swap.nbytes
        model_dev = [d.copy() for d in dev]
        model_host = [h.copy() for h in swap.blocks]
        rng = random.Random(5)
        for step in range(40):
            k = rng.randint(1, 8)
            if step % 4 == 0:
                d0, h0 = rng.randrange(24 - k), rng.randrange(32 - k)
                dev_ids, host_ids = np.arange(d0, d0 + k), np.arange(h0, h0 + k)
            else:
                dev_ids = np.array(rng.sample(range(24), k))
                host_ids = np.array(rng.sample(range(32), k))
            op = Op.EVICT if step % 3 else Op.LOAD
            subset = [2, 3, 4] if step % 5 == 4 else None  # layer 1 only (a layer-wise step)
            moved = backend.copy(op, dev_ids, host_ids, subset)
            which = subset if subset is not None else range(len(descs))
            assert moved == k * sum(descs[i].bytes_per_block for i in which)
            for i in which:
                if op is Op.EVICT:
                    model_host[i][host_ids] = model_dev[i][dev_ids]
                else:
                    model_dev[i][dev_ids] = model_host[i][host_ids]
            for i, d in enumerate(descs):
                assert np.array_equal(dev[i], model_dev[i]), (step, d.name, "device")
                assert np.array_equal(swap.blocks[i], model_host[i]), (step, d.name, "host")
        launches = f.cupy.launches
        assert launches and {l["device"] for l in launches} == {1}  # found by UUID
        assert {l["priority"] for l in launches} == {cc.EVICT_PRIORITY, cc.LOAD_PRIORITY}
        assert {l["tensors"] for l in launches} == {5, 3}
        assert f.runtime.memcpys  # long runs went to cudaMemcpyAsync
        with pytest.raises(InvalidTask) as ei:
            backend.copy(Op.EVICT, np.array([0, 24]), np.array([0, 1]))
        assert ei.value.code == ErrorCode.ID_OUT_OF_RANGE
        for i in range(len(descs)):
            assert np.array_equal(swap.blocks[i], model_host[i])
    finally:
        backend.detach()
        backend.detach()
        swap.close(unlink=True)
    assert f.runtime.registered == {} and f.runtime.opened == {}
    assert len(f.runtime.close_log) == 2
    with pytest.raises(NotReady):
        backend.copy(Op.EVICT, np.array([0]), np.array([0]))


def test_failed_attach_leaves_nothing_open_or_pinned(fake_cuda, namespaces):
    f = fake_cuda
    names = namespaces.new()
    _, descs = _worker_tensors(f.memory, f.worker_drv, SPECS)
    swap = HostSwapSpace.open(names, 0, descs, num_host_blocks=8)
    backend = cb.CudaBackend(names, 0, device=1, pin_chunk_bytes=4 * PAGE)
    try:
        f.runtime.fail_open_at = 1
        with pytest.raises(InvalidTask) as ei:
            backend.attach(descs, swap)
        assert "k1_scale" in str(ei.value) and "cudaIpcOpenMemHandle" in str(ei.value)
        assert f.runtime.opened == {} and f.runtime.registered == {}
        f.runtime.fail_open_at = None
        f.runtime.fail_register_at = len(f.runtime.register_log) + 1  # the second chunk
        with pytest.raises(InvalidTask) as ei:
            backend.attach(descs, swap)
        assert "cudaHostRegister" in str(ei.value)
        assert f.runtime.opened == {} and f.runtime.registered == {}
        assert backend.open_allocations == 0
    finally:
        swap.close(unlink=True)


def test_the_daemon_must_see_the_caches_gpu(fake_cuda, namespaces):
    f = fake_cuda
    names = namespaces.new()
    _, descs = _worker_tensors(f.memory, f.worker_drv, SPECS)
    swap = HostSwapSpace.open(names, 0, descs, num_host_blocks=8)
    try:
        pinned_to_0 = cb.CudaBackend(names, 0, device=0)
        with pytest.raises(InvalidTask) as ei:
            pinned_to_0.attach(descs, swap)
        assert "--device 0" in str(ei.value) and format_uuid(UUID1.hex()) in str(ei.value)
        f.daemon_drv.uuids = {0: UUID0}
        with pytest.raises(InvalidTask) as ei:
            cb.CudaBackend(names, 0).attach(descs, swap)
        assert "cannot see" in str(ei.value)
        assert f.runtime.opened == {} and f.runtime.registered == {}
        with pytest.raises(CudaUnavailable) as ei:
            cb.CudaBackend(names, 0, device=5)
        assert "out of range" in str(ei.value)
    finally:
        swap.close(unlink=True)
