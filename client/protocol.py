"""kvswap wire protocol: one table of ops, frame encoding, request validation.

Spec: ``docs/protocol.md`` (its version line must equal :data:`PROTOCOL_VERSION`;
a test checks it).  Summary:

    request  = [header, *id_frames]          client DEALER -> daemon ROUTER
    header   = msgpack map {v: [major, minor], id: int, op: str, ...op fields}
    id frame = raw little-endian int32 or int64 block ids (dtype named in ``ids``)
    reply    = [msgpack map {v, id, rank, ok, code, message, tq, tx, ...reply fields}]

Transfer ops carry exactly two id frames, always in the order
(device block ids, host block ids), whatever the direction: ``evict`` copies
device -> host, ``load`` host -> device.

Compatibility: unknown header fields are ignored; a different *major* version
is rejected with VERSION_MISMATCH; minor versions only ever add fields.

Adding an op (``pause``, ``clear`` ...) is one :data:`OPS` entry here (its
fields, frames, handler kind, reply fields and, for a scheduled op, its lane)
plus one handler in the daemon's handler table (the daemon checks at start-up
that every op has a handler of the right shape), plus its row in
``docs/protocol.md`` section 4 (a test holds the two equal).
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import msgpack
import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, ProtocolError

PROTOCOL_VERSION: tuple[int, int] = (1, 11)

# Request and task ids are non-negative int64: they key shm tables (layer progress,
# agreement, the completion journal) that hold them as 64-bit integers.
ID_LIMIT = 1 << 63
# The longest time a request may carry (a prefetch's timeout, a peer ticket's life,
# a client's task timeout, which is a ticket's default life): one year.  Longer means
# no limit, which a caller should say with the op's own "no limit" (no timeout),
# and some of them cannot be held as nanoseconds on the wire.
MAX_SECONDS = 366 * 86400.0

# Bounds on what one message may make a daemon hold (docs/protocol.md section 2).
MAX_HEADER_BYTES = 1 << 20  # the msgpack header frame
MAX_BATCH_TASKS = 4096  # tasks in one ``batch`` message; clients split larger batches
MAX_FRAMES = 1 + 2 * MAX_BATCH_TASKS  # header + two id frames per batch task
# A batch task map packs to at most ~62 bytes (id, op, n, priority, layerwise), so
# MAX_BATCH_TASKS of them stay far below MAX_HEADER_BYTES; Message.frames() checks both.

# Argument ranges a client checks before anything is sent (docs/protocol.md section 6).
PRIORITY_RANGE = (-(1 << 63), (1 << 63) - 1)  # signed 64-bit: what msgpack packs as an int
CID_LIMIT = 1 << 62  # client ids: 1 <= cid < CID_LIMIT


def max_frame_bytes(max_device_blocks: int, num_host_blocks: int) -> int:
    """The largest frame a valid request can carry, the daemon's ZMQ ``MAXMSGSIZE``.

    A valid task names each destination block at most once, so an id frame holds
    at most max(device, host) blocks of 8 bytes (int64); a keys frame holds at most
    one 32-byte key per host block (:func:`validate_storage`); the header is at most
    :data:`MAX_HEADER_BYTES`.  Device block counts are only known at ``register``,
    after the socket is bound, so the daemon sizes the limit from its
    ``--max-device-blocks`` cap and refuses a larger register."""
    return max(MAX_HEADER_BYTES, 8 * max(max_device_blocks, num_host_blocks),
               KEY_BYTES * num_host_blocks)


# id frame dtypes accepted on the wire (little-endian only, so frames mean the
# same on every host).
ID_DTYPES: dict[str, np.dtype] = {"<i4": np.dtype("<i4"), "<i8": np.dtype("<i8")}
# Up to this many ids, checks run on Python ints: for the tasks of a scheduler's
# hot path (a few blocks up to a request's worth) that is cheaper than numpy's
# reductions, each of which costs microseconds whatever its size (a list of 40
# ids: 6.2 against 14.9 us for as_block_ids; at 64 still 9.3 against 22.9).
_SMALL = 64
_I4_MAX = np.iinfo(np.int32).max
_I8_MAX = np.iinfo(np.int64).max


class Op(str, enum.Enum):
    REGISTER = "register"
    EVICT = "evict"
    LOAD = "load"
    BATCH = "batch"
    CANCEL = "cancel"
    BACKUP = "backup"
    PREFETCH = "prefetch"
    EXISTS = "exists"
    PAUSE = "pause"
    RESUME = "resume"
    CLEAR = "clear"
    RESTORE = "restore"
    PING = "ping"
    STATS = "stats"
    SHUTDOWN = "shutdown"
    PEER_INFO = "peer_info"
    PEER_RECV = "peer_recv"
    PEER_SEND = "peer_send"


class HandlerKind(enum.Enum):
    """Where the daemon runs an op's handler."""

    INLINE = "inline"  # the I/O thread answers at once (cheap, read-only or control)
    SERIAL = "serial"  # queued to the control thread, run in arrival order
    TRANSFER = "transfer"  # validated by the I/O thread, run by the hazard-ordered scheduler


class Lane(enum.Enum):
    """Which worker pool of a rank's scheduler runs a TRANSFER op.  Two pools, so that
    a slow or dead store never holds up evicts and loads."""

    NONE = "none"  # not scheduled (INLINE and SERIAL ops)
    TRANSFER = "transfer"  # the copy workers
    STORAGE = "storage"  # the storage thread
    PEER = "peer"  # the peer threads: node-to-node pushes and held receives (daemon/peer.py)


FieldType = Union[type, tuple[type, ...]]  # a field's type, or the types it may have


@dataclass(frozen=True)
class OpSpec:
    """Everything about one op, stated once.

    Derived from this table rather than restated: the scheduler's lanes and the
    order in which a free worker looks at them (``daemon/scheduler.py`` LANES), the
    daemon's set of storage ops, the latency histograms of the signal segment
    (``client/signals.py`` HIST_OPS: the ``timed`` ops in table order, which is part
    of the shm layout), the ops a ``batch`` may carry.  Checked against it: the
    daemon's handler table (at start-up), the op table of ``docs/protocol.md``
    section 4 and every op's reply fields against a live daemon (tests).
    """

    op: Op
    fields: Mapping[str, FieldType]  # required header fields and their types
    id_frames: int | None  # raw id frames after the header (None: the handler checks)
    kind: HandlerKind
    reply: Mapping[str, FieldType]  # fields of an OK reply beyond the common ones, and their types
    optional: Mapping[str, FieldType] = field(default_factory=dict)
    lane: Lane = Lane.NONE  # TRANSFER ops: the scheduler's worker pool that runs it
    urgent: bool = False  # a request waits for it: its lane's workers take it before the others
    timed: bool = False  # latency histograms (queued, exec) in the signal segment
    # The task stays RUNNING (holding its blocks in the hazard table) after its worker
    # returns, until the daemon finishes it: a peer receive, whose bytes are written by
    # another node's daemon (daemon/peer.py).
    held: bool = False
    # Every rank agrees on its outcome (a prefetch's count): the ranks must run such
    # tasks in the same order, or two ranks can each wait in the agreement of a task
    # the other has not started, until --storage-timeout.  So a rank runs them in
    # admission order among themselves, which one client makes the same everywhere.
    agreed: bool = False

    def __post_init__(self) -> None:
        if (self.kind is HandlerKind.TRANSFER) != (self.lane is not Lane.NONE):
            raise ValueError(f"{self.op.value}: exactly the TRANSFER ops have a lane")
        if (self.urgent or self.timed) and self.lane is Lane.NONE:
            raise ValueError(f"{self.op.value}: only a scheduled op can be urgent or timed")
        if self.held and self.lane is not Lane.PEER:
            raise ValueError(f"{self.op.value}: only a peer-lane op can be held")


# Fields any request may carry (docs/protocol.md section 3): the sending client's id, the
# message's sequence number in that client, and whether it is a re-send after a restart.
COMMON_OPTIONAL: dict[str, type] = {"cid": int, "cs": int, "re": bool}
_OP_NAMES = {op.value: op for op in Op}

# ep: the sender's view of every rank's epoch; a rank whose epoch differs refuses the
# task with RANK_RESTARTED, so nothing addressed to a dead daemon runs on its successor
# out of order.
_TRANSFER_OPTIONAL = {"priority": int, "layerwise": bool, "ep": list}
_COPY_REPLY = {"bytes": int, "merged": int}
# prefetch: its policy (PrefetchPolicy), deadline in seconds, and the fewest blocks worth loading
_PREFETCH_OPTIONAL: dict[str, FieldType] = {"policy": str, "timeout": float, "min": int}

# peer_info: what a ticket needs about this rank (client/ticket.py RankEndpoint).
_PEER_INFO_REPLY = {"te": str, "notify": str, "bases": list, "block_bytes": list,
                    "layout": str, "epoch": int}

OPS: dict[Op, OpSpec] = {
    spec.op: spec
    for spec in (
        OpSpec(Op.REGISTER, {"backend": str, "tensors": list}, 0, HandlerKind.SERIAL,
               {"num_device_blocks": int, "num_host_blocks": int, "host_pool_kept": bool},
               {"replace": bool}),
        OpSpec(Op.EVICT, {"ids": str, "n": int}, 2, HandlerKind.TRANSFER, _COPY_REPLY,
               _TRANSFER_OPTIONAL, lane=Lane.TRANSFER, timed=True),
        OpSpec(Op.LOAD, {"ids": str, "n": int}, 2, HandlerKind.TRANSFER, _COPY_REPLY,
               _TRANSFER_OPTIONAL, lane=Lane.TRANSFER, urgent=True, timed=True),
        OpSpec(Op.BATCH, {"ids": str, "tasks": list}, None, HandlerKind.INLINE,
               {"accepted": int}, {"ep": list}),
        OpSpec(Op.CANCEL, {"target": int}, 0, HandlerKind.INLINE, {"cancelled": bool}),
        OpSpec(Op.BACKUP, {"ids": str, "n": int}, 2, HandlerKind.TRANSFER,
               {"count": int, "skipped": int},
               {"ep": list, "priority": int, "mv": str, "after": int},
               lane=Lane.STORAGE, timed=True),
        OpSpec(Op.PREFETCH, {"ids": str, "n": int}, 2, HandlerKind.TRANSFER, {"count": int},
               {"ep": list, "priority": int, "mv": str, **_PREFETCH_OPTIONAL},
               lane=Lane.STORAGE, urgent=True, timed=True, agreed=True),
        OpSpec(Op.EXISTS, {"n": int}, 1, HandlerKind.TRANSFER, {"count": int},
               {"ep": list, "mv": str}, lane=Lane.STORAGE),
        OpSpec(Op.PAUSE, {}, 0, HandlerKind.INLINE, {}),
        OpSpec(Op.RESUME, {}, 0, HandlerKind.INLINE, {}),
        OpSpec(Op.CLEAR, {}, 0, HandlerKind.SERIAL, {}, {"free_host": bool}),
        OpSpec(Op.RESTORE, {}, 0, HandlerKind.INLINE, {}),
        OpSpec(Op.PING, {}, 0, HandlerKind.INLINE, {"state": str, "epoch": int, "pid": int}),
        OpSpec(Op.STATS, {}, 0, HandlerKind.INLINE, {"counters": dict}),
        OpSpec(Op.SHUTDOWN, {}, 0, HandlerKind.INLINE, {}),
        OpSpec(Op.PEER_INFO, {}, 0, HandlerKind.INLINE, _PEER_INFO_REPLY),
        OpSpec(Op.PEER_RECV, {}, 1, HandlerKind.TRANSFER, {"bytes": int}, {"ep": list},
               lane=Lane.PEER, held=True),
        OpSpec(Op.PEER_SEND, {"ids": str, "n": int}, 2, HandlerKind.TRANSFER, {"bytes": int},
               {"ep": list, "priority": int}, lane=Lane.PEER),
    )
}


_packers = threading.local()


def packb(obj: Any) -> bytes:
    """msgpack bytes of ``obj``, from this thread's own Packer.

    ``msgpack.packb`` makes a new Packer per call, and each Packer allocates a 1 MiB
    buffer: under the daemon's fixed 128 KiB mmap threshold (daemon/malloc_tuning.py)
    that is an mmap and an munmap per message, 13 µs against 1.3 µs for a kept
    Packer (measured on this project's CI machine).  A Packer is not thread-safe,
    hence one per thread; after an object that cannot be packed it starts afresh
    (msgpack resets its buffer when ``pack`` raises)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


# --------------------------------------------------------------------------- requests


@dataclass
class Request:
    """A decoded request as the daemon sees it."""

    id: int
    op: Op
    header: dict
    frames: list  # raw id frames (buffers), validated for count only


class RequestError(KvswapError):
    """A request that cannot be served; ``req_id`` is its id when it could be read."""

    def __init__(self, code: ErrorCode, message: str, req_id: int | None = None):
        super().__init__(message, code)
        self.req_id = req_id


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return "|".join(x.__name__ for x in t)
    return t.__name__


def _is_type(value: Any, t: type | tuple[type, ...]) -> bool:
    # bool is an int subclass; a bool is never a valid int field.
    if isinstance(value, bool) and t is not bool:
        return False
    return isinstance(value, t)


def decode_request(frames: Sequence[Any], max_header_bytes: int = MAX_HEADER_BYTES) -> Request:
    """Parse and check the shape of one request; raise :class:`RequestError` if unusable.

    ``frames`` are the frames after the ROUTER identity: buffers or bytes.
    Field *values* of transfers (ranges, duplicates) are checked later by
    :func:`validate_transfer`, against the rank's block counts.
    """
    if not frames:
        raise RequestError(ErrorCode.PROTOCOL_ERROR, "empty message")
    raw = frames[0]
    if len(memoryview(raw)) > max_header_bytes:
        raise RequestError(ErrorCode.MESSAGE_TOO_LARGE,
                           f"header of {len(memoryview(raw))} bytes exceeds {max_header_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RequestError(ErrorCode.PROTOCOL_ERROR, f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise RequestError(ErrorCode.PROTOCOL_ERROR,
                           f"header must be a msgpack map, got {type(header).__name__}")
    req_id = header.get("id")
    if not _is_type(req_id, int):
        raise RequestError(ErrorCode.BAD_FIELD, "header field 'id' missing or not an int")
    if not 0 <= req_id < ID_LIMIT:
        raise RequestError(ErrorCode.BAD_FIELD,
                           f"header field 'id' must be in [0, 2**63), got {req_id}")
    version = header.get("v")
    if (not isinstance(version, list) or len(version) != 2
            or not all(_is_type(x, int) for x in version)):
        raise RequestError(ErrorCode.BAD_FIELD,
                           "header field 'v' must be [major, minor]", req_id)
    if version[0] != PROTOCOL_VERSION[0]:
        raise RequestError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol major version {version[0]} not supported "
            f"(this daemon speaks {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]})",
            req_id,
        )
    op_name = header.get("op")
    op = _OP_NAMES.get(op_name) if isinstance(op_name, str) else None  # not Op(): 1 us
    if op is None:
        raise RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {op_name!r}", req_id)
    spec = OPS[op]
    check_fields(header, spec, req_id)
    for name, t in COMMON_OPTIONAL.items():
        if name not in header:
            continue
        value = header[name]  # present means typed: a nil cid/cs would reach the journal
        if not _is_type(value, t) or (t is int and not 0 <= value < ID_LIMIT):
            raise RequestError(ErrorCode.BAD_FIELD,
                               f"header field {name!r} must be {_type_name(t)}"
                               f"{' in [0, 2**63)' if t is int else ''}, got {value!r}", req_id)
    extra = len(frames) - 1
    if spec.id_frames is not None and extra != spec.id_frames:
        raise RequestError(
            ErrorCode.BAD_FRAMES,
            f"{op.value}: expected {spec.id_frames} id frame(s) after the header, got {extra}",
            req_id,
        )
    return Request(req_id, op, header, list(frames[1:]))


def peek_request_id(header_frame: Any) -> int | None:
    """The id a refusal of this request carries, from its header frame alone (None when
    the header has no valid id): how a daemon answers a message it will not read in
    full, one with more than :data:`MAX_FRAMES` frames, under its id."""
    try:
        return decode_request([header_frame]).id
    except RequestError as exc:
        return exc.req_id


def check_fields(fields: Mapping[str, Any], spec: OpSpec, req_id: int | None) -> None:
    """Required fields present with their types; optional ones typed when present."""
    for name, t in spec.fields.items():
        if name not in fields:
            raise RequestError(ErrorCode.BAD_FIELD, f"{spec.op.value}: missing field {name!r}",
                               req_id)
    for name, t in (*spec.fields.items(), *spec.optional.items()):
        if name in fields and not _is_type(fields[name], t):
            raise RequestError(
                ErrorCode.BAD_FIELD,
                f"{spec.op.value}: field {name!r} must be {_type_name(t)}, "
                f"got {type(fields[name]).__name__}",
                req_id,
            )


def request_header(op: Op, req_id: int, fields: Mapping[str, Any] | None = None) -> dict:
    """The header map of a request: the common fields, then the op's."""
    return {"v": list(PROTOCOL_VERSION), "id": req_id, "op": op.value, **(fields or {})}


def encode_request(op: Op, req_id: int, fields: Mapping[str, Any] | None = None,
                   frames: Sequence[Any] = ()) -> list:
    return [packb(request_header(op, req_id, fields)), *frames]


# --------------------------------------------------------------------------- arguments


def check_int(value: Any, what: str, lo: int, hi: int) -> int:
    """An int argument (a Python or numpy integer, never a bool) in ``[lo, hi]``, as a
    Python int; :class:`InvalidTask` (BAD_FIELD) naming ``what`` and the range otherwise.
    Checked in the caller's thread: a value msgpack cannot pack would otherwise fail
    later, on the thread that sends."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTask(f"{what} must be an int in [{lo}, {hi}], got "
                          f"{type(value).__name__} {value!r:.60}", ErrorCode.BAD_FIELD)
    v = int(value)
    if not lo <= v <= hi:
        raise InvalidTask(f"{what} {v} is out of range: it must be an int in [{lo}, {hi}]",
                          ErrorCode.BAD_FIELD)
    return v


def check_seconds(value: Any, what: str, positive: bool, most: float = math.inf) -> float:
    """A finite number of seconds (> 0 if ``positive``, else >= 0), at most ``most``, as a
    float; :class:`InvalidTask` (BAD_FIELD) naming ``what`` otherwise."""
    if (isinstance(value, (bool, np.bool_))
            or not isinstance(value, (int, float, np.integer, np.floating))):
        raise InvalidTask(f"{what} must be a number of seconds, got {type(value).__name__} "
                          f"{value!r:.60}", ErrorCode.BAD_FIELD)
    try:
        v = float(value)
    except OverflowError:  # an int past float's range: as far from finite as inf
        v = math.inf
    if not math.isfinite(v) or v < 0 or (positive and v == 0) or v > most:
        bound = "> 0" if positive else ">= 0"
        cap = f", at most {most:.0f}" if math.isfinite(most) else ""
        raise InvalidTask(f"{what} must be finite and {bound} seconds{cap}, got {v}",
                          ErrorCode.BAD_FIELD)
    return v


def check_priority(value: Any) -> int:
    """A task priority: any signed 64-bit int (higher runs first among ready tasks)."""
    return check_int(value, "priority", *PRIORITY_RANGE)


def check_flag(value: Any, what: str) -> bool:
    """A boolean argument: ``True`` or ``False`` (or a numpy bool), nothing truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidTask(f"{what} must be True or False, got {type(value).__name__} "
                          f"{value!r:.60}", ErrorCode.BAD_FIELD)
    return bool(value)


# --------------------------------------------------------------------------- block ids


def as_block_ids(ids: Any, what: str) -> np.ndarray:
    """Turn a list or numpy integer array into a contiguous little-endian id array.

    int32 on the wire when every id fits, int64 otherwise.  Raises
    :class:`InvalidTask` (BAD_ID_DTYPE) for non-integer input.
    """
    if type(ids) is list and 0 < len(ids) <= _SMALL and all(type(x) is int for x in ids):
        # the scheduler's usual few-block task: checked on Python ints, one array made
        lo, hi = min(ids), max(ids)
        if lo >= 0 and hi <= _I8_MAX:
            return np.array(ids, dtype="<i4" if hi <= _I4_MAX else "<i8")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:  # ragged nesting, objects numpy cannot read
        raise InvalidTask(f"{what} must be a 1-D sequence of block ids: {exc}",
                          ErrorCode.BAD_ID_DTYPE) from None
    if arr.ndim != 1:
        if arr.size == 0:
            arr = arr.reshape(0)
        else:
            raise InvalidTask(f"{what} must be a 1-D sequence of block ids, got shape {arr.shape}",
                              ErrorCode.BAD_ID_DTYPE)
    if arr.size == 0:
        return np.empty(0, dtype="<i4")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise InvalidTask(f"{what} must hold integers, got dtype {arr.dtype}",
                          ErrorCode.BAD_ID_DTYPE)
    if arr.size <= _SMALL:
        vals = arr.tolist()
        lo, hi = min(vals), max(vals)
    else:
        lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise InvalidTask(f"{what} holds negative block id {lo}", ErrorCode.ID_OUT_OF_RANGE)
    target = "<i4" if hi <= _I4_MAX else "<i8"
    if hi > _I8_MAX:
        raise InvalidTask(f"{what} holds block id {hi} beyond int64", ErrorCode.ID_OUT_OF_RANGE)
    # Always a private copy: the frame is sent zero-copy, after this call returns.
    return np.array(arr, dtype=target, copy=True, order="C")


def decode_id_frame(buf: Any, dtype_name: str, what: str) -> np.ndarray:
    """View a raw id frame as an array without copying; check its dtype and size."""
    dtype = ID_DTYPES.get(dtype_name)
    if dtype is None:
        raise InvalidTask(
            f"id dtype {dtype_name!r} not supported (use one of {sorted(ID_DTYPES)})",
            ErrorCode.BAD_ID_DTYPE,
        )
    mv = memoryview(buf)
    if mv.nbytes % dtype.itemsize:
        raise InvalidTask(
            f"{what} frame of {mv.nbytes} bytes is not a whole number of {dtype_name} ids",
            ErrorCode.BAD_ID_DTYPE,
        )
    return np.frombuffer(mv, dtype=dtype)


def decode_transfer(req: "Request") -> tuple[np.ndarray, np.ndarray]:
    """The (device ids, host ids) of a transfer request, as zero-copy views."""
    return decode_id_pair(req.op, req.header["ids"], req.header["n"], req.frames[0],
                          req.frames[1])


def decode_id_pair(op: Op, dtype_name: str, n: int, dev_frame: Any,
                   host_frame: Any) -> tuple[np.ndarray, np.ndarray]:
    dev = decode_id_frame(dev_frame, dtype_name, "device ids")
    host = decode_id_frame(host_frame, dtype_name, "host ids")
    if dev.shape[0] != host.shape[0]:
        raise InvalidTask(
            f"{op.value}: {dev.shape[0]} device ids but {host.shape[0]} host ids",
            ErrorCode.LENGTH_MISMATCH,
        )
    if n != dev.shape[0]:
        raise InvalidTask(f"{op.value}: header says n={n} but the frames hold "
                          f"{dev.shape[0]} ids", ErrorCode.BAD_FIELD)
    return dev, host


def validate_transfer(op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
                      num_device_blocks: int, num_host_blocks: int) -> None:
    """Reject a transfer whole before any byte moves.

    Checks equal lengths, every id in range, and that no destination block is
    named twice (the result would depend on copy order).  Sources may repeat.
    Used by the daemon on every task and by the client before sending.
    """
    if device_ids.shape[0] != host_ids.shape[0]:
        raise InvalidTask(
            f"{op.value}: {device_ids.shape[0]} device ids but {host_ids.shape[0]} host ids",
            ErrorCode.LENGTH_MISMATCH,
        )
    check_ids(op.value, "device", device_ids, num_device_blocks, unique=op is Op.LOAD)
    check_ids(op.value, "host", host_ids, num_host_blocks, unique=op is Op.EVICT)


def check_ids(what: str, side: str, ids: np.ndarray, limit: int, unique: bool) -> None:
    """Every id in ``[0, limit)``; with ``unique`` (``ids`` are destinations, written:
    the result would depend on copy order), none named twice.  InvalidTask
    (ID_OUT_OF_RANGE, DUPLICATE_DESTINATION) whose message starts with ``what``
    and names the ``side`` ("device", "host")."""
    n = ids.shape[0]
    if n == 0:
        return
    if n <= _SMALL:  # Python ints: a numpy reduction costs more than the whole check
        vals = ids.tolist()
        lo, hi = min(vals), max(vals)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        raise InvalidTask(f"{what}: {side} block id {lo if lo < 0 else hi} out of range "
                          f"[0, {limit})", ErrorCode.ID_OUT_OF_RANGE)
    dup = first_duplicate(ids) if unique else None
    if dup is not None:
        raise InvalidTask(f"{what}: destination {side} block {dup} named more than once",
                          ErrorCode.DUPLICATE_DESTINATION)


def first_duplicate(ids: np.ndarray) -> int | None:
    """Smallest id named more than once, or None.  Linear (a count per id) when the
    ids are dense enough, a sort otherwise: large tasks pay O(n), not O(n log n)."""
    n = ids.shape[0]
    if n < 2:
        return None
    if n <= _SMALL:
        vals = ids.tolist()
        if len(set(vals)) == n:
            return None
        seen: set[int] = set()
        dups = set()
        for x in vals:
            if x in seen:
                dups.add(x)
            seen.add(x)
        return min(dups)
    hi = int(ids.max())
    if hi < 16 * n:
        counts = np.bincount(ids, minlength=hi + 1)
        if counts.max() < 2:
            return None
        return int(np.flatnonzero(counts > 1)[0])
    s = np.sort(ids)
    dup = s[1:] == s[:-1]
    return int(s[1:][dup][0]) if dup.any() else None


def _wire_dtype(arrays: Sequence[np.ndarray]) -> str:
    """The ids' wire type: arrays from :func:`as_block_ids` are ``<i4`` or ``<i8``."""
    for a in arrays:
        if a.itemsize == 8:
            return "<i8"
    return "<i4"


def _transfer_fields(priority: int, layerwise: bool) -> dict:
    """Optional transfer fields, sent only when not default (keeps the header small)."""
    out: dict = {}
    if priority:
        out["priority"] = int(priority)
    if layerwise:
        out["layerwise"] = True
    return out


@dataclass
class Message:
    """A request before its header is packed: the client's I/O thread packs the
    header at send time, adding ``ep`` (its view of every rank's epoch) when
    ``epoch_stamped``; ``tail`` holds the raw id frames."""

    header: dict
    tail: list
    epoch_stamped: bool = False

    def frames(self, epochs: Sequence[int] | None = None, ts: int | None = None,
               cid: int | None = None, cs: int | None = None, re: bool = False) -> list:
        """The frames to send, with the sender's stamps (``ep``, ``ts``, ``cid``, ``cs``,
        ``re``: docs/protocol.md section 3) added to the header.

        Raises :class:`ProtocolError` (MESSAGE_TOO_LARGE) for a message beyond
        :data:`MAX_HEADER_BYTES` or :data:`MAX_FRAMES`: a daemon refuses such a message
        before it can read its id, so a sender would never learn which request failed.
        """
        header = dict(self.header)
        if epochs is not None:
            header["ep"] = list(epochs)
        if ts is not None:
            header["ts"] = ts
        if cid is not None:
            header["cid"] = cid
        if cs is not None:
            header["cs"] = cs
        if re:
            header["re"] = True
        packed = packb(header)
        if len(packed) > MAX_HEADER_BYTES or 1 + len(self.tail) > MAX_FRAMES:
            raise ProtocolError(
                f"{header.get('op')} {header.get('id')}: a header of {len(packed)} bytes and "
                f"{1 + len(self.tail)} frames exceeds the limits of one message "
                f"({MAX_HEADER_BYTES} bytes, {MAX_FRAMES} frames); not sent",
                ErrorCode.MESSAGE_TOO_LARGE)
        return [packed, *self.tail]


def transfer_message(op: Op, req_id: int, device_ids: np.ndarray, host_ids: np.ndarray,
                     priority: int = 0, layerwise: bool = False) -> Message:
    """A transfer request; both id arrays share one dtype."""
    dtype = _wire_dtype((device_ids, host_ids))
    header = request_header(op, req_id, {"ids": dtype, "n": int(device_ids.shape[0]),
                                         **_transfer_fields(priority, layerwise)})
    return Message(header, [device_ids.astype(dtype, copy=False),
                            host_ids.astype(dtype, copy=False)], epoch_stamped=True)


def validate_storage(op: Op, host_ids: np.ndarray | None, n_keys: int,
                     num_host_blocks: int) -> None:
    """At most one key per host block (this bounds a keys frame, see
    :func:`max_frame_bytes`); ``backup``/``prefetch``: one host block per key, in
    range; a prefetch names no destination block twice (sources of a backup may
    repeat)."""
    if n_keys > num_host_blocks:
        raise InvalidTask(f"{op.value}: {n_keys} keys, more than the {num_host_blocks} host "
                          f"blocks of a rank (the most one message may carry); split them "
                          f"over several messages", ErrorCode.MESSAGE_TOO_LARGE)
    if host_ids is None:
        if op is not Op.EXISTS:
            raise InvalidTask(f"{op.value} needs host_blocks: one host block per key, got None",
                              ErrorCode.BAD_FIELD)
        return
    if host_ids.shape[0] != n_keys:
        raise InvalidTask(f"{op.value}: {host_ids.shape[0]} host blocks but {n_keys} keys",
                          ErrorCode.LENGTH_MISMATCH)
    check_ids(op.value, "host", host_ids, num_host_blocks, unique=op is Op.PREFETCH)


def encode_transfer(op: Op, req_id: int, device_ids: np.ndarray, host_ids: np.ndarray,
                    priority: int = 0, layerwise: bool = False) -> list:
    """Frames of a transfer request (no epoch stamp)."""
    return transfer_message(op, req_id, device_ids, host_ids, priority, layerwise).frames()


_BATCH_TASK_FIELDS = {"id": int, "op": str, "n": int}
# The ops a ``batch`` may carry: the copies (the transfer lane).
_BATCH_OP_NAMES = tuple(op.value for op, spec in OPS.items() if spec.lane is Lane.TRANSFER)


@dataclass(frozen=True)
class BatchTask:
    """One task of a received ``batch``, shape-checked; its ids are decoded later."""

    id: int
    op: Op
    fields: dict
    device_frame: Any
    host_frame: Any


def decode_batch(req: Request) -> list[BatchTask]:
    """Check a batch's task list and frame count; raise :class:`RequestError` (the
    whole batch is refused) if a task map is malformed."""
    items = req.header["tasks"]
    if len(req.frames) != 2 * len(items):
        raise RequestError(ErrorCode.BAD_FRAMES, f"batch of {len(items)} tasks needs "
                           f"{2 * len(items)} id frames, got {len(req.frames)}", req.id)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(ErrorCode.BAD_FIELD, f"batch task {i} is not a map", req.id)
        for name, t in _BATCH_TASK_FIELDS.items():
            if not _is_type(item.get(name), t):
                raise RequestError(ErrorCode.BAD_FIELD,
                                   f"batch task {i}: field {name!r} missing or not "
                                   f"{t.__name__}", req.id)
        if not 0 <= item["id"] < ID_LIMIT:
            raise RequestError(ErrorCode.BAD_FIELD,
                               f"batch task {i}: field 'id' must be in [0, 2**63)", req.id)
        if item["op"] not in _BATCH_OP_NAMES:
            raise RequestError(ErrorCode.BAD_FIELD,
                               f"batch task {i}: op must be {' or '.join(_BATCH_OP_NAMES)}",
                               req.id)
        op = Op(item["op"])
        for name, t in OPS[op].optional.items():
            if name in item and not _is_type(item[name], t):
                raise RequestError(ErrorCode.BAD_FIELD,
                                   f"batch task {i}: field {name!r} must be {t.__name__}", req.id)
        out.append(BatchTask(item["id"], op, item, req.frames[2 * i], req.frames[2 * i + 1]))
    return out


# ------------------------------------------------------------------ storage ops

KEY_BYTES = 32  # a block key (client.block_keys.block_hashes)


def as_keys(keys: Any, what: str = "keys") -> np.ndarray:
    """A sequence of 32-byte keys as an (n, 32) uint8 array (a private copy)."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidTask(f"{what} must be a sequence of {KEY_BYTES}-byte keys, got one "
                          f"{type(keys).__name__} (wrap a single key in a list)",
                          ErrorCode.BAD_FIELD)
    try:
        items = list(keys)
    except TypeError:
        raise InvalidTask(f"{what} must be a sequence of {KEY_BYTES}-byte keys "
                          f"(block_hashes gives them), got {type(keys).__name__}",
                          ErrorCode.BAD_FIELD) from None
    for i, k in enumerate(items):
        if not isinstance(k, (bytes, bytearray, memoryview)) or len(k) != KEY_BYTES:
            raise InvalidTask(f"{what}[{i}] must be {KEY_BYTES} bytes (block_hashes gives them)",
                              ErrorCode.BAD_FIELD)
    return np.frombuffer(b"".join(bytes(k) for k in items), dtype=np.uint8).reshape(
        len(items), KEY_BYTES).copy()


def decode_keys(buf: Any, n: int) -> np.ndarray:
    mv = memoryview(buf)
    if n < 0 or mv.nbytes != n * KEY_BYTES:
        raise InvalidTask(f"keys frame holds {mv.nbytes} bytes, expected n={n} x {KEY_BYTES}",
                          ErrorCode.BAD_FIELD)
    return np.frombuffer(mv, dtype=np.uint8).reshape(n, KEY_BYTES)


MODEL_VERSION_MAX = 200  # characters of a model version (it is hashed into entry names)


def check_model_version(version: Any) -> str:
    """A model version (``--model-version``, ``set_model_version``): a string of at most
    :data:`MODEL_VERSION_MAX` characters without ``|``; ``""`` is "no version".

    The daemons fingerprint entries with ``<model id>|tp=<T>[|replicated][|version=<V>]``
    (daemon/storage_entries.py).  With ``|`` kept out of ``V`` that string names one
    (model id, TP, part, version) only, whatever the model id holds; with it, model id
    ``"m|tp=2|version=x"`` and version ``"x|tp=2"`` of model ``"m"`` gave one fingerprint,
    and one's entries loaded as the other's."""
    if not isinstance(version, str) or len(version) > MODEL_VERSION_MAX:
        raise InvalidTask(f"model version must be a string of at most {MODEL_VERSION_MAX} "
                          f"characters, got {version!r:.80}", ErrorCode.BAD_FIELD)
    if "|" in version:
        raise InvalidTask(f"model version {version!r:.80} contains '|', which separates the "
                          f"fields of the entries' fingerprint: use another character "
                          f"(e.g. ':' or '@')", ErrorCode.BAD_FIELD)
    return version


class PrefetchPolicy(str, enum.Enum):
    """When a prefetch stops reading and commits (docs/storage.md "Prefetch policies")."""

    WAIT_COMPLETE = "wait_complete"  # read every key (to the first miss); a store error fails it
    BEST_EFFORT = "best_effort"  # stop at the deadline if one is given or at a store error
    TIMEOUT = "timeout"  # stop at the deadline (required); a store error fails it


@dataclass(frozen=True)
class PrefetchOptions:
    """A prefetch's policy, deadline (seconds from its arrival at a daemon) and the
    fewest blocks worth loading: an agreed prefix shorter than ``min_blocks`` loads
    nothing."""

    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    timeout: float | None = None
    min_blocks: int = 0

    @classmethod
    def of(cls, policy: Any, timeout: Any, min_blocks: Any) -> "PrefetchOptions":
        """Checked options; InvalidTask naming the bad argument and what it wants."""
        try:
            pol = PrefetchPolicy(policy)
        except ValueError:
            raise InvalidTask(f"prefetch policy must be one of "
                              f"{', '.join(p.value for p in PrefetchPolicy)}, got {policy!r:.60}",
                              ErrorCode.BAD_FIELD) from None
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not 0 < timeout <= MAX_SECONDS):
            raise InvalidTask(f"prefetch timeout must be a positive number of seconds, at most "
                              f"{MAX_SECONDS:.0f} (a year), or None, got {timeout!r:.60}",
                              ErrorCode.BAD_FIELD)
        if pol is PrefetchPolicy.TIMEOUT and timeout is None:
            raise InvalidTask("prefetch policy 'timeout' needs timeout=SECONDS",
                              ErrorCode.BAD_FIELD)
        if pol is PrefetchPolicy.WAIT_COMPLETE and timeout is not None:
            raise InvalidTask("prefetch policy 'wait_complete' takes no timeout (use "
                              "policy='timeout' or 'best_effort')", ErrorCode.BAD_FIELD)
        if (isinstance(min_blocks, bool) or not isinstance(min_blocks, int)
                or not 0 <= min_blocks < ID_LIMIT):
            raise InvalidTask(f"min_blocks must be a non-negative int below 2**63, got "
                              f"{min_blocks!r:.60}", ErrorCode.BAD_FIELD)
        return cls(pol, None if timeout is None else float(timeout), min_blocks)

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> "PrefetchOptions":
        return cls.of(header.get("policy", PrefetchPolicy.WAIT_COMPLETE.value),
                      header.get("timeout"), header.get("min", 0))

    def to_fields(self) -> dict:
        """Header fields, only those not default."""
        out: dict = {}
        if self.policy is not PrefetchPolicy.WAIT_COMPLETE:
            out["policy"] = self.policy.value
        if self.timeout is not None:
            out["timeout"] = self.timeout
        if self.min_blocks:
            out["min"] = self.min_blocks
        return out


def storage_message(op: Op, req_id: int, host_ids: np.ndarray | None, keys: np.ndarray,
                    priority: int = 0, model_version: str | None = None,
                    prefetch: PrefetchOptions | None = None, after: int | None = None
                    ) -> Message:
    """``backup``/``prefetch`` (host ids + keys) or ``exists`` (keys only); ``model_version``
    (None: the daemons' ``--model-version``), a prefetch's options when not default, and
    ``after``: the evict a write-through backup belongs to (it runs only if that
    succeeded on the rank)."""
    fields: dict = {"n": int(keys.shape[0]), **_transfer_fields(priority, False)}
    if model_version is not None:
        fields["mv"] = model_version
    if after is not None:
        fields["after"] = after
    if prefetch is not None:
        fields.update(prefetch.to_fields())
    header = request_header(op, req_id, fields)
    tail: list = [keys]
    if host_ids is not None:
        header["ids"] = _wire_dtype((host_ids,))
        tail = [host_ids.astype(header["ids"], copy=False), keys]
    return Message(header, tail, epoch_stamped=True)


@dataclass(frozen=True)
class BatchItem:
    """One task of a ``batch`` message (ids already checked by :func:`as_block_ids`)."""

    id: int
    op: Op
    device_ids: np.ndarray
    host_ids: np.ndarray
    priority: int = 0
    layerwise: bool = False


def batch_message(req_id: int, items: Sequence[BatchItem]) -> Message:
    dtype = _wire_dtype([a for it in items for a in (it.device_ids, it.host_ids)])
    tasks, frames = [], []
    for it in items:
        tasks.append({"id": it.id, "op": it.op.value, "n": int(it.device_ids.shape[0]),
                      **_transfer_fields(it.priority, it.layerwise)})
        frames += [it.device_ids.astype(dtype, copy=False), it.host_ids.astype(dtype, copy=False)]
    header = request_header(Op.BATCH, req_id, {"ids": dtype, "tasks": tasks})
    return Message(header, frames, epoch_stamped=True)


def encode_batch(req_id: int, items: Sequence[BatchItem]) -> list:
    return batch_message(req_id, items).frames()


# --------------------------------------------------------------------------- replies


@dataclass
class Reply:
    id: int | None
    rank: int
    ok: bool
    code: ErrorCode
    message: str
    queued_us: float = 0.0
    exec_us: float = 0.0
    fields: dict = field(default_factory=dict)


_REPLY_COMMON = frozenset(("v", "id", "rank", "ok", "code", "message", "tq", "tx"))
_CODES = {int(c): c for c in ErrorCode}


def encode_reply(req_id: int | None, rank: int, code: ErrorCode = ErrorCode.OK,
                 message: str = "", queued_us: float = 0.0, exec_us: float = 0.0,
                 **fields: Any) -> bytes:
    body = {
        "v": PROTOCOL_VERSION,  # a tuple packs as an array, as a list does
        "id": req_id,
        "rank": rank,
        "ok": code == 0,
        "code": int(code),
        "message": message,
        "tq": round(queued_us, 1),
        "tx": round(exec_us, 1),
    }
    body.update(fields)
    return packb(body)


def decode_reply(raw: Any) -> Reply:
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"reply is not msgpack: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("rank"), int):
        raise ProtocolError(f"malformed reply {body!r:.200}")
    version = body.get("v")
    if not isinstance(version, list) or not version or version[0] != PROTOCOL_VERSION[0]:
        raise ProtocolError(f"reply has unsupported protocol version {version!r}",
                            ErrorCode.VERSION_MISMATCH)
    raw_code = body.get("code")
    code = (_CODES.get(raw_code, ErrorCode.PROTOCOL_ERROR) if isinstance(raw_code, int)
            else ErrorCode.PROTOCOL_ERROR)  # a dict, not an Enum call, per reply
    return Reply(
        id=body.get("id"),
        rank=body["rank"],
        ok=bool(body.get("ok")),
        code=code,
        message=str(body.get("message", "")),
        queued_us=float(body.get("tq", 0.0)),
        exec_us=float(body.get("tx", 0.0)),
        fields={k: v for k, v in body.items() if k not in _REPLY_COMMON},
    )
