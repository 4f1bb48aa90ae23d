"""Cache layout: the tensors of one rank, as registered with its daemon.

A rank's cache is a list of named tensors, each block-major (axis 0 = block)
and C-contiguous: K and V per layer, optional fp8 scale tensors, extra (MTP)
layers, MLA latent caches (no V).  The host swap space mirrors the same list
with its own block count.  A task names block ids once; the daemon applies
them to every tensor.

:class:`TensorDesc` is what travels in the ``register`` op; ``location`` is
backend-specific (host: the shm segment name; cuda: the IPC handle).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask
from kvswap.client.naming import check_tensor_name


def _layout_error(msg: str) -> InvalidTask:
    return InvalidTask(msg, ErrorCode.BAD_LAYOUT)


def element_dtype(name: str) -> np.dtype:
    """The dtype of a tensor's elements: one fixed-size scalar type, else ValueError.

    numpy also reads a string as a record (``"f2,f2"``) or sub-array (``"2f2"``)
    type, and raises SyntaxError, not TypeError, for some strings with a comma
    (the fuzz's bit-flipped ``register`` with dtype ``",f2"`` got INTERNAL_ERROR)."""
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        dt = None
    if dt is None or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(f"dtype {name!r} is not a numpy scalar type; name one such as '<f2' "
                         f"or 'float16' (bfloat16 and fp8 as raw bits: '<u2', '|u1')")
    if dt.hasobject or dt.itemsize == 0:
        raise ValueError(f"dtype {name!r} cannot be copied as bytes; name a fixed-size "
                         f"numeric type such as '<f2'")
    return dt


@dataclass(frozen=True)
class TensorDesc:
    name: str
    layer: int
    dtype: str  # numpy dtype string, e.g. '<u2', '|u1', '<f4'
    shape: tuple[int, ...]  # axis 0 = blocks
    location: dict = field(default_factory=dict, compare=False)
    # The same bytes on every TP rank (an MLA latent cache): the storage tier keeps one
    # copy, written by rank 0 and read by every rank (docs/storage.md "MLA dedup").
    replicated: bool = False

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.block_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def to_wire(self) -> dict:
        wire = {"name": self.name, "layer": self.layer, "dtype": self.dtype,
                "shape": list(self.shape), "location": self.location}
        if self.replicated:  # sent only when set: a 1.5 descriptor reads the same
            wire["replicated"] = True
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> "TensorDesc":
        if not isinstance(obj, dict):
            raise _layout_error(f"tensor descriptor must be a map, got {type(obj).__name__}")
        try:
            name, layer, dtype, shape = obj["name"], obj["layer"], obj["dtype"], obj["shape"]
        except KeyError as exc:
            raise _layout_error(f"tensor descriptor misses field {exc.args[0]!r}") from None
        location = obj.get("location", {})
        if not isinstance(name, str):
            raise _layout_error("tensor name must be a string")
        try:
            check_tensor_name(name)
        except ValueError as exc:
            raise _layout_error(str(exc)) from None
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise _layout_error(f"tensor {name}: layer must be a non-negative int")
        if (not isinstance(shape, list) or len(shape) < 1
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                           for d in shape)):
            raise _layout_error(f"tensor {name}: shape must be a list of positive ints")
        if not isinstance(dtype, str):
            raise _layout_error(f"tensor {name}: dtype must be a string")
        try:
            dt = element_dtype(dtype)
        except ValueError as exc:
            raise _layout_error(f"tensor {name}: {exc}") from None
        if not isinstance(location, dict):
            raise _layout_error(f"tensor {name}: location must be a map")
        replicated = obj.get("replicated", False)
        if not isinstance(replicated, bool):
            raise _layout_error(f"tensor {name}: replicated must be a bool")
        return cls(name, layer, dt.str, tuple(shape), location, replicated)


def validate_layout(tensors: Sequence[TensorDesc]) -> int:
    """Check a rank's tensor list; return its number of blocks.

    Names must be unique and every tensor must have the same block count.
    """
    if not tensors:
        raise _layout_error("a cache needs at least one tensor")
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise _layout_error(f"tensor name {t.name!r} registered twice")
        seen.add(t.name)
    counts = {t.num_blocks for t in tensors}
    if len(counts) != 1:
        detail = ", ".join(f"{t.name}={t.num_blocks}" for t in tensors)
        raise _layout_error(f"all tensors must have the same number of blocks ({detail})")
    return counts.pop()


def layout_hash(tensors: Sequence[TensorDesc]) -> bytes:
    """32-byte digest of what a block is made of (names, layers, dtypes, block shapes).

    Independent of block counts, so a host pool written under one device cache
    size is still readable after the engine re-registers a resized cache.
    """
    h = hashlib.sha256(b"kvswap-layout-v1")
    for t in tensors:
        h.update(f"{t.name}|{t.layer}|{t.dtype}|{','.join(map(str, t.block_shape))};".encode())
    return h.digest()


# ------------------------------------------------------------------ demo layouts

DEMO_LAYOUT_DEFAULTS: dict[str, Any] = {
    "layers": 8,
    "block_tokens": 16,
    "heads": 4,
    "head_dim": 64,
    "dtype": "float16",
    "blocks": 128,
    "mla": 0,
    "scales": 0,
    "extra_layers": 0,
    "replicated": 0,
}

DEMO_LAYOUT_HELP = (
    "comma-separated key=value pairs overriding the defaults "
    + ",".join(f"{k}={v}" for k, v in DEMO_LAYOUT_DEFAULTS.items())
    + ". Tensors per layer: k<l> and v<l> of shape (blocks, block_tokens, heads, head_dim); "
    "mla=1 gives one latent tensor kv<l> instead; scales=1 adds float32 k<l>_scale/v<l>_scale "
    "of shape (blocks, block_tokens, heads) (fp8 caches use dtype=uint8); extra_layers=N adds "
    "N more layers (MTP); replicated=1 (with mla=1) marks the latent tensors replicated across "
    "TP ranks (stored once by the storage tier)."
)


@dataclass(frozen=True)
class TensorShape:
    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...]
    replicated: bool = False


def parse_demo_layout(spec: str | None) -> dict[str, Any]:
    params = dict(DEMO_LAYOUT_DEFAULTS)
    if spec:
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in params:
                raise ValueError(f"bad demo layout item {item!r}; {DEMO_LAYOUT_HELP}")
            if key == "dtype":
                element_dtype(value)
                params[key] = value
            else:
                try:
                    params[key] = int(value)
                except ValueError:
                    raise ValueError(f"demo layout {key} must be an int, got {value!r}") from None
                if params[key] < 0 or (params[key] == 0 and key not in
                                       ("mla", "scales", "extra_layers", "replicated")):
                    raise ValueError(f"demo layout {key} must be positive, got {value!r}")
    if params["replicated"] and not params["mla"]:
        raise ValueError("demo layout replicated=1 marks the MLA latent tensors: it needs mla=1")
    return params


def demo_layout(spec: str | None = None) -> list[TensorShape]:
    """A model-like list of cache tensors (see :data:`DEMO_LAYOUT_HELP`)."""
    p = parse_demo_layout(spec)
    dtype = np.dtype(p["dtype"]).str
    kv_shape = (p["blocks"], p["block_tokens"], p["heads"], p["head_dim"])
    scale_shape = (p["blocks"], p["block_tokens"], p["heads"])
    out: list[TensorShape] = []
    for layer in range(p["layers"] + p["extra_layers"]):
        kinds = ["kv"] if p["mla"] else ["k", "v"]
        for kind in kinds:
            out.append(TensorShape(f"{kind}{layer}", layer, dtype, kv_shape,
                                   bool(p["replicated"])))
            if p["scales"]:
                out.append(TensorShape(f"{kind}{layer}_scale", layer, "<f4", scale_shape,
                                       bool(p["replicated"])))
    return out
