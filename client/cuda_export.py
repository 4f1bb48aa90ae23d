"""Worker side of the ``cuda`` backend: inspect GPU cache tensors, export them by CUDA IPC.

Why it looks like this:

* ``cudaIpcGetMemHandle`` shares a whole *allocation*, and a cache tensor usually
  sits inside a larger one (cupy's memory pool, torch's caching allocator, or one
  buffer carved into every layer's K and V).  So a tensor is exported as the
  handle of its allocation's base plus its offset into it; the daemon opens
  each allocation once, however many tensors it holds.
* The device travels as its UUID, never its ordinal: the daemon may run with a
  different ``CUDA_VISIBLE_DEVICES`` than the engine.
* Nothing here imports cupy or torch.  Tensors are read through
  ``__cuda_array_interface__`` or, for torch, through its own attributes
  (torch's interface refuses bf16 and fp8, the usual KV-cache dtypes), and the
  CUDA driver is reached through ctypes on ``libcuda`` on first use.  A
  torch-only engine needs no cupy, and ``import kvswap.client`` loads no GPU
  library.

The pure functions (interface parsing, contiguity, the location encoding) are
shared with the daemon, which decodes what :func:`export_tensor` encodes.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == CU_IPC_HANDLE_SIZE
UUID_BYTES = 16  # sizeof(CUuuid)

VMM_HINT = (
    "memory from a virtual-memory allocator (PyTorch with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cuMemCreate/cuMemMap, or a "
    "cudaMallocAsync pool) cannot be shared through legacy CUDA IPC; set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before the engine allocates its "
    "KV cache (or allocate it with cudaMalloc)")

# CUDA driver API values (cuda.h).
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_MEMORYTYPE_DEVICE = 2
CUDA_ERROR_INVALID_VALUE = 1

_UUID_RE = re.compile(r"^[0-9a-f]{32}$")

# torch dtypes numpy can name; every other dtype travels as raw unsigned bits of
# the same size (bf16 -> '<u2', fp8 -> '|u1'): kvswap copies bytes, never values.
_TORCH_NUMPY_DTYPES = {
    "torch.float16": "<f2", "torch.float32": "<f4", "torch.float64": "<f8",
    "torch.uint8": "|u1", "torch.int8": "|i1", "torch.int16": "<i2", "torch.int32": "<i4",
    "torch.int64": "<i8", "torch.bool": "|b1",
}
_RAW_DTYPES = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _layout_error(name: str, msg: str) -> InvalidTask:
    return InvalidTask(f"tensor {name}: {msg}", ErrorCode.BAD_LAYOUT)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class ArrayInfo:
    """What the exporter needs to know about a GPU tensor."""

    ptr: int  # address of element 0
    shape: tuple[int, ...]
    dtype: str  # numpy dtype string (raw unsigned bits for dtypes numpy lacks)
    strides: tuple[int, ...]  # bytes

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def c_contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def is_c_contiguous(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """C-contiguous, ignoring the stride of size-1 dimensions (which never moves)."""
    if len(shape) != len(strides):
        return False
    expected = c_contiguous_strides(shape, itemsize)
    return all(d == 1 or s == e for d, s, e in zip(shape, strides, expected))


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(_is_int(d) for d in shape):
        raise _layout_error(name, f"shape must be a tuple of ints, got {shape!r}")
    if len(shape) < 1 or any(d <= 0 for d in shape):
        raise _layout_error(name, f"needs blocks on axis 0 and no empty dimension, "
                                  f"got shape {tuple(shape)}")
    return tuple(shape)


def parse_cuda_array_interface(cai: Any, name: str) -> ArrayInfo:
    """Read a ``__cuda_array_interface__`` dict (versions 2 and 3).

    Rejects masked and read-only arrays (the daemon writes loaded blocks)."""
    if not isinstance(cai, Mapping):
        raise _layout_error(name, f"__cuda_array_interface__ must be a dict, "
                                  f"got {type(cai).__name__}")
    for key in ("shape", "typestr", "data"):
        if key not in cai:
            raise _layout_error(name, f"__cuda_array_interface__ has no {key!r}")
    shape = _check_shape(name, cai["shape"])
    try:
        dt = np.dtype(cai["typestr"])
    except TypeError:
        raise _layout_error(name, f"unknown typestr {cai['typestr']!r}") from None
    if dt.hasobject or dt.itemsize == 0:
        raise _layout_error(name, f"typestr {cai['typestr']!r} cannot be copied as bytes")
    data = cai["data"]
    if (not isinstance(data, (tuple, list)) or len(data) != 2 or not _is_int(data[0])
            or not isinstance(data[1], bool)):
        raise _layout_error(name, f"__cuda_array_interface__ data must be (ptr, readonly), "
                                  f"got {data!r}")
    ptr, readonly = data
    if ptr == 0:
        raise _layout_error(name, "has a null data pointer")
    if readonly:
        raise _layout_error(name, "is read-only; the daemon writes loaded blocks into it")
    if cai.get("mask") is not None:
        raise _layout_error(name, "masked arrays cannot be registered")
    strides = cai.get("strides")
    if strides is None:
        strides = c_contiguous_strides(shape, dt.itemsize)
    elif (not isinstance(strides, (tuple, list)) or len(strides) != len(shape)
          or not all(_is_int(s) for s in strides)):
        raise _layout_error(name, f"strides must be a tuple of {len(shape)} ints, got {strides!r}")
    return ArrayInfo(ptr, shape, dt.str, tuple(strides))


def is_torch_tensor(obj: Any) -> bool:
    """True for ``torch.Tensor`` and subclasses, without importing torch."""
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(obj).__mro__)


def torch_dtype_str(torch_dtype: str, itemsize: int) -> str:
    """numpy dtype string for a torch dtype name such as ``'torch.bfloat16'``."""
    known = _TORCH_NUMPY_DTYPES.get(torch_dtype)
    if known is not None:
        return known
    return _RAW_DTYPES.get(itemsize, f"|V{itemsize}")


def torch_array_info(t: Any, name: str) -> ArrayInfo:
    """Read a torch tensor through its own attributes (works for bf16 and fp8)."""
    if not t.is_cuda:
        raise _layout_error(name, f"is a torch tensor on {t.device}, not on a CUDA device; the "
                                  "cuda backend registers GPU memory only")
    itemsize = int(t.element_size())
    shape = _check_shape(name, tuple(int(d) for d in t.shape))
    strides = tuple(int(s) * itemsize for s in t.stride())
    ptr = int(t.data_ptr())
    if ptr == 0:
        raise _layout_error(name, "has a null data pointer")
    return ArrayInfo(ptr, shape, torch_dtype_str(str(t.dtype), itemsize), strides)


def array_info(obj: Any, name: str) -> ArrayInfo:
    """Inspect a GPU tensor: torch, or anything with ``__cuda_array_interface__``."""
    if is_torch_tensor(obj):
        return torch_array_info(obj, name)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        raise _layout_error(
            name, f"{kind} has no __cuda_array_interface__, so it is not GPU memory; the cuda "
                  "backend registers cupy arrays, torch CUDA tensors or any object exposing "
                  "__cuda_array_interface__ (numpy arrays and CPU tensors cannot be registered)")
    return parse_cuda_array_interface(cai, name)


def check_block_contiguous(info: ArrayInfo, name: str) -> None:
    itemsize = np.dtype(info.dtype).itemsize
    if not is_c_contiguous(info.shape, info.strides, itemsize):
        raise _layout_error(
            name, f"is not C-contiguous (shape {info.shape}, strides {info.strides} bytes, "
                  f"contiguous would be {c_contiguous_strides(info.shape, itemsize)}); the cuda "
                  "backend needs every tensor block-major and contiguous with blocks on axis 0 "
                  "(register the cache tensor itself, not a transposed or strided view)")


# ----------------------------------------------------------------------------- location


def format_uuid(uuid_hex: str) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it."""
    u = uuid_hex
    return f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"


@dataclass(frozen=True)
class CudaLocation:
    """``TensorDesc.location`` of a cuda tensor: where the daemon finds its bytes."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation's base
    offset: int  # bytes from the allocation base to block 0 of the tensor
    alloc_size: int  # bytes of the whole allocation
    uuid: str  # device UUID, 32 lowercase hex digits
    base: int  # allocation base in the worker's address space: groups tensors by allocation
    strides: tuple[int, ...]  # bytes, as the worker saw them

    def to_wire(self) -> dict:
        return {"ipc": self.handle, "offset": self.offset, "alloc_size": self.alloc_size,
                "uuid": self.uuid, "base": self.base, "strides": list(self.strides)}

    @classmethod
    def from_wire(cls, obj: Any, name: str) -> "CudaLocation":
        if not isinstance(obj, Mapping):
            raise _layout_error(name, f"location must be a map, got {type(obj).__name__}")
        missing = [k for k in ("ipc", "offset", "alloc_size", "uuid", "base", "strides")
                   if k not in obj]
        if missing:
            raise _layout_error(name, f"cuda location misses {', '.join(missing)} (was it "
                                      "registered by a cuda-backend CacheWorker?)")
        handle, offset, size = obj["ipc"], obj["offset"], obj["alloc_size"]
        uuid, base, strides = obj["uuid"], obj["base"], obj["strides"]
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            got = len(handle) if isinstance(handle, bytes) else type(handle).__name__
            raise _layout_error(name, f"location.ipc must be {IPC_HANDLE_BYTES} bytes "
                                      f"(a cudaIpcMemHandle_t), got {got}")
        if not _is_int(offset) or offset < 0:
            raise _layout_error(name, f"location.offset must be an int >= 0, got {offset!r}")
        if not _is_int(size) or size <= 0:
            raise _layout_error(name, f"location.alloc_size must be an int > 0, got {size!r}")
        if not _is_int(base) or base <= 0:
            raise _layout_error(name, f"location.base must be an int > 0, got {base!r}")
        if not isinstance(uuid, str) or not _UUID_RE.match(uuid):
            raise _layout_error(name, f"location.uuid must be {2 * UUID_BYTES} lowercase hex "
                                      f"digits, got {uuid!r}")
        if not isinstance(strides, (list, tuple)) or not all(_is_int(s) for s in strides):
            raise _layout_error(name, f"location.strides must be a list of ints, got {strides!r}")
        return cls(handle, offset, size, uuid, base, tuple(strides))


@dataclass(frozen=True)
class TensorExport:
    dtype: str
    shape: tuple[int, ...]
    location: CudaLocation


# ----------------------------------------------------------------------------- driver


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``status`` is its CUresult."""

    def __init__(self, call: str, status: int, detail: str):
        super().__init__(f"{call} failed: {detail}")
        self.call = call
        self.status = status


class DriverAPI(Protocol):
    """The driver queries the exporter and the daemon need (faked in CPU tests)."""

    def memory_type(self, ptr: int) -> int: ...

    def is_managed(self, ptr: int) -> bool: ...

    def ipc_capable(self, ptr: int) -> bool | None:
        """None when the driver is too old to tell."""

    def device_ordinal(self, ptr: int) -> int: ...

    def allocation_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that contains ``ptr``."""

    def ipc_handle(self, base: int) -> bytes: ...

    def device_uuid(self, ordinal: int) -> bytes: ...

    def device_uuids(self) -> list[tuple[int, bytes]]: ...


_IpcHandle = ctypes.c_ubyte * IPC_HANDLE_BYTES
_Uuid = ctypes.c_ubyte * UUID_BYTES


class LibCuda:
    """:class:`DriverAPI` on ``libcuda.so.1`` through ctypes.

    Calls that need a context (address range, IPC handle) run with the context
    that owns the pointer pushed, so they work on any thread of the engine."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        u64, c_int, vp = ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
        self._fn("cuInit", ctypes.c_uint)
        self._fn("cuGetErrorName", c_int, ctypes.POINTER(ctypes.c_char_p))
        self._fn("cuPointerGetAttribute", vp, c_int, u64)
        self._fn("cuMemGetAddressRange_v2", ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t),
                 u64)
        self._fn("cuIpcGetMemHandle", ctypes.POINTER(_IpcHandle), u64)
        self._fn("cuDeviceGetCount", ctypes.POINTER(c_int))
        self._fn("cuDeviceGet", ctypes.POINTER(c_int), c_int)
        self._uuid_call = "cuDeviceGetUuid_v2" if hasattr(lib, "cuDeviceGetUuid_v2") \
            else "cuDeviceGetUuid"
        self._fn(self._uuid_call, ctypes.POINTER(_Uuid), c_int)
        self._fn("cuCtxPushCurrent_v2", vp)
        self._fn("cuCtxPopCurrent_v2", ctypes.POINTER(vp))
        self._check("cuInit", lib.cuInit(0))

    def _fn(self, name: str, *argtypes: Any) -> None:
        f = getattr(self._lib, name)
        f.argtypes = list(argtypes)
        f.restype = ctypes.c_int

    def _check(self, call: str, status: int) -> None:
        if status == 0:
            return
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorName(status, ctypes.byref(text)) == 0 and text.value:
            detail = f"{text.value.decode()} ({status})"
        else:
            detail = f"CUresult {status}"
        raise CudaDriverError(call, status, detail)

    def _attr(self, value: Any, attribute: int, ptr: int) -> Any:
        self._check(f"cuPointerGetAttribute({attribute})",
                    self._lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ptr))
        return value.value

    @contextlib.contextmanager
    def _context_of(self, ptr: int) -> Iterator[None]:
        ctx = ctypes.c_void_p()
        self._attr(ctx, CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
        if not ctx.value:
            raise CudaDriverError("cuPointerGetAttribute(CONTEXT)", CUDA_ERROR_INVALID_VALUE,
                                  f"pointer {ptr:#x} belongs to no context ({VMM_HINT})")
        self._check("cuCtxPushCurrent", self._lib.cuCtxPushCurrent_v2(ctx))
        try:
            yield
        finally:
            self._check("cuCtxPopCurrent", self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)))

    def memory_type(self, ptr: int) -> int:
        return int(self._attr(ctypes.c_uint(0), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))

    def is_managed(self, ptr: int) -> bool:
        return bool(self._attr(ctypes.c_uint(0), CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr))

    def ipc_capable(self, ptr: int) -> bool | None:
        value = ctypes.c_uint(0)
        status = self._lib.cuPointerGetAttribute(
            ctypes.byref(value), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
        if status == CUDA_ERROR_INVALID_VALUE:
            return None  # attribute unknown to this driver (before CUDA 11.3)
        self._check("cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)", status)
        return bool(value.value)

    def device_ordinal(self, ptr: int) -> int:
        return int(self._attr(ctypes.c_int(0), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))

    def allocation_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        with self._context_of(ptr):
            self._check("cuMemGetAddressRange",
                        self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                          ptr))
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int) -> bytes:
        handle = _IpcHandle()
        with self._context_of(base):
            self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(ctypes.byref(handle),
                                                                          base))
        return bytes(handle)

    def device_uuid(self, ordinal: int) -> bytes:
        dev = ctypes.c_int(0)
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        uuid = _Uuid()
        self._check(self._uuid_call, getattr(self._lib, self._uuid_call)(ctypes.byref(uuid), dev))
        return bytes(uuid)

    def device_uuids(self) -> list[tuple[int, bytes]]:
        count = ctypes.c_int(0)
        self._check("cuDeviceGetCount", self._lib.cuDeviceGetCount(ctypes.byref(count)))
        return [(i, self.device_uuid(i)) for i in range(count.value)]


_DRIVER: LibCuda | None = None
_DRIVER_LOCK = threading.Lock()


def driver() -> LibCuda:
    """The process's :class:`LibCuda`, loaded on first use."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaDriverError("dlopen(libcuda.so.1)", -1,
                                      f"{exc} (is the NVIDIA driver installed?)") from None
            _DRIVER = LibCuda(lib)
        return _DRIVER


# ----------------------------------------------------------------------------- export


def export_tensor(obj: Any, name: str, drv: DriverAPI | None = None) -> TensorExport:
    """Describe one GPU cache tensor for the daemon; raise :class:`InvalidTask`
    (BAD_LAYOUT) naming the tensor and the reason when it cannot be shared."""
    info = array_info(obj, name)
    check_block_contiguous(info, name)
    try:
        drv = drv if drv is not None else driver()
        return _export(info, name, drv)
    except CudaDriverError as exc:
        raise _layout_error(name, f"CUDA driver: {exc}") from None


def _export(info: ArrayInfo, name: str, drv: DriverAPI) -> TensorExport:
    ptr = info.ptr
    if drv.is_managed(ptr):
        raise _layout_error(name, "is managed memory (cudaMallocManaged), which CUDA IPC cannot "
                                  "share; allocate the KV cache with cudaMalloc")
    mem_type = drv.memory_type(ptr)
    if mem_type != CU_MEMORYTYPE_DEVICE:
        raise _layout_error(name, f"points to memory of CUmemorytype {mem_type}, not device "
                                  "memory; the cuda backend registers GPU tensors only")
    capable = drv.ipc_capable(ptr)
    if capable is False:
        raise _layout_error(name, VMM_HINT)
    base, size = drv.allocation_range(ptr)
    offset = ptr - base
    if offset < 0 or offset + info.nbytes > size:
        raise _layout_error(name, f"spans bytes [{offset}, {offset + info.nbytes}) of an "
                                  f"allocation of {size} bytes")
    try:
        handle = drv.ipc_handle(base)
    except CudaDriverError as exc:
        hint = f"; {VMM_HINT}" if capable is None else ""
        raise _layout_error(name, f"cudaIpcGetMemHandle failed: {exc}{hint}") from None
    uuid = drv.device_uuid(drv.device_ordinal(ptr))
    location = CudaLocation(handle, offset, size, uuid.hex(), base, info.strides)
    return TensorExport(info.dtype, info.shape, location)
