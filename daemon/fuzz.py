"""``scripts/fuzz_stress``: a long run of hostile traffic against a live namespace.

``tests/test_fuzz.py`` checks a few hundred hostile messages against one daemon
under hypothesis.  This module is the long version an operator (or a release
check) runs: it launches a namespace with demo caches, sends N seeded hostile
messages per transport (``ipc://``, and signed ``tcp://`` with a secret file),
keeps a bounded number of replies outstanding so the run takes minutes, and
then checks that the daemons survived it intact::

    generator --(Case)--> Driver --(frames, signed on tcp)--> DEALER per rank
                            ^                                      |
                            +------ Tracker (expected replies) <---+
    RssSampler: /proc/PID/status VmRSS of every daemon, every 0.2 s

Why expected replies are tracked per message.  The protocol promises one reply
for every request a daemon can attribute to a peer (``docs/protocol.md``,
section 5) and none for a frame beyond ``MAXMSGSIZE`` (section 9).  Before a
case is sent, the driver decodes it with the daemon's own ``decode_request``:
that says which id the reply will carry.  Cases whose reply id is one of the
run's unique ids are tracked one by one (a missing reply names the message);
the rest (a hostile ``id`` field) are counted.  On ``tcp://``, whether a
message that fails authentication (unsigned, forged, tampered, stale,
replayed) is answered at all is the daemon's choice, so those are neither
required nor waited for: the window of outstanding replies counts only
replies that must come, and nothing waits past ``stall_timeout_s``.

Safety of the stream.  Every case that the daemon would accept as a valid
``shutdown``, ``pause``, ``clear`` or replacing ``register`` (including one
produced by a bit flip) is dropped before sending and replaced, so the run
cannot stop, freeze or detach the namespace it is measuring.  A case that
decodes as a ``prefetch`` goes to every rank, as a client sends it: the ranks
agree on its outcome, and one rank alone would wait for the others for the
whole ``--storage-timeout`` while later tasks on the same host blocks wait
behind it.

Replays.  On ``tcp://`` a ``replay`` case sends again, byte for byte, a signed
message the same rank has already answered; a second answer under its id is
counted as a duplicate (the replay guard let it through).

Reproducibility.  The stream of messages is a function of ``--seed`` alone,
except the ``ts`` field of signed requests (wall clock, or the replay window
would refuse them) and which answered message a ``replay`` repeats; reply
timing, and so the order of merged transfers, varies.

The pass criteria (all must hold; the exit status is 1 otherwise): every
daemon alive with its original pid and epoch; a ping answered within 2 s;
nothing left queued or in flight once the replies are in; an evict + load
round trip whose bytes are verified in shared memory; RSS at the end within
``rss_drift`` of the baseline, both taken as the lowest sample over two of the
daemons' ``malloc_trim`` periods (``--rss-settle``), the baseline after the first tenth of the
hostile messages (those grow the allocators to their working size: Python's
object arenas, libzmq's buffers, and on ``tcp://`` the replay guard, whose
window is short for this reason, :data:`REPLAY_WINDOW_S`; a leak is growth past
that); every reply that must come came, exactly once; no ``INTERNAL_ERROR``
or ``TRANSFER_FAILED`` reply (hostile input that passed validation and then
failed while running) and no traceback in a daemon log; and after teardown no
shm object, run dir or daemon process left.  When no reply comes for
``stall_timeout_s``, the driver sends SIGUSR1 to every daemon (their thread
stacks go to their logs), counts what is due as lost and goes on.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import posix_ipc
import zmq

from kvswap.client.auth import MAC_BYTES, AuthFailed, mac, sign, verify
from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.layout import TensorDesc, demo_layout, parse_demo_layout
from kvswap.client.naming import tcp_endpoints
from kvswap.client.protocol import (
    MAX_BATCH_TASKS,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    OPS,
    PROTOCOL_VERSION,
    Op,
    Request,
    RequestError,
    decode_reply,
    decode_request,
    peek_request_id,
    packb,
)
from kvswap.client.signals import RankSlot
from kvswap.daemon.malloc_tuning import TRIM_EVERY_S
from kvswap.client.transfer_client import TransferClient
from kvswap.daemon.demo import RankView
from kvswap.daemon.launcher import LaunchConfig, Launcher

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"
SECRET_BYTES = 32
# Ops whose *valid* form would stop or freeze the namespace under test; and a valid
# register with ``replace`` (an engine restart): it detaches the tensors first, and when
# the new ones fail to attach the rank waits ATTACHING for the next good register, as
# documented (docs/protocol.md section 6): seed 4 sent one and left rank 1 so.
_FORBIDDEN = frozenset({Op.SHUTDOWN, Op.PAUSE, Op.CLEAR})


def _forbidden(req: Request | None) -> bool:
    """Whether the daemon would read ``req`` (None: undecodable) as one of those."""
    return req is not None and (req.op in _FORBIDDEN or (
        req.op is Op.REGISTER and req.header.get("replace") is True))


# The run's own request ids are multiples of a prime, (2**20 + k) * _ID_STEP: a bit flip
# changes an id by a sum of powers of two, which almost never lands on another multiple,
# so a mutated id is not mistaken for another case's.
_ID_STEP = 1_000_003
_ID_FIRST = 1 << 20
_CODES_BAD_AFTER_ADMISSION = frozenset({ErrorCode.INTERNAL_ERROR, ErrorCode.TRANSFER_FAILED})


# =========================================================================== raw msgpack


@dataclass(frozen=True)
class Raw:
    """One msgpack object already encoded: what ``msgpack.packb`` cannot produce
    (integers beyond 64 bits in some encoding, non-minimal widths, broken str)."""

    data: bytes
    label: str


@dataclass(frozen=True)
class Pairs:
    """A msgpack map written as a list of (key, value): keys may repeat."""

    items: tuple[tuple[Any, Any], ...]


def _container(n: int, fix: int, fix_max: int, m16: int, m32: int) -> bytes:
    if n <= fix_max:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([m16]) + struct.pack(">H", n)
    return bytes([m32]) + struct.pack(">I", n)


def encode(obj: Any) -> bytes:
    """msgpack-encode ``obj``, splicing :class:`Raw` pieces in where they occur."""
    if isinstance(obj, Raw):
        return obj.data
    if isinstance(obj, Pairs):
        return (_container(len(obj.items), 0x80, 15, 0xDE, 0xDF)
                + b"".join(encode(k) + encode(v) for k, v in obj.items))
    if isinstance(obj, dict):
        return encode(Pairs(tuple(obj.items())))
    if isinstance(obj, (list, tuple)):
        return _container(len(obj), 0x90, 15, 0xDC, 0xDD) + b"".join(encode(x) for x in obj)
    return packb(obj)


def _f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


# Integers at and beyond the 64-bit edges, as they can appear on the wire.  msgpack has no
# integer encoding past uint64 / int64, so 2**64, -2**63-1 and 2**100 travel as floats,
# big-endian bin or ext payloads, decimal strings, or as int markers with the wrong
# payload length (which break the whole header).
HUGE_INTS: tuple[Raw, ...] = (
    Raw(b"\xcf" + b"\xff" * 8, "2**64-1 (uint64)"),
    Raw(b"\xd3\x80" + b"\x00" * 7, "-2**63 (int64)"),
    Raw(b"\xd3\x7f" + b"\xff" * 7, "2**63-1 (int64)"),
    Raw(b"\xcf\x80" + b"\x00" * 7, "2**63 (uint64)"),
    Raw(b"\xce\xff\xff\xff\xff", "2**32-1 (uint32)"),
    Raw(b"\xd2\x80\x00\x00\x00", "-2**31 (int32)"),
    Raw(b"\xd2\x7f\xff\xff\xff", "2**31-1 (int32)"),
    Raw(b"\xce\x80\x00\x00\x00", "2**31 (uint32)"),
    Raw(_f64(2.0 ** 64), "2**64 (float64)"),
    Raw(_f64(-(2.0 ** 63) - 1), "-2**63-1 (float64)"),
    Raw(_f64(2.0 ** 100), "2**100 (float64)"),
    Raw(b"\xc4\x0d" + (2 ** 100).to_bytes(13, "big"), "2**100 (bin)"),
    Raw(b"\xc4\x09" + (2 ** 64).to_bytes(9, "big"), "2**64 (bin)"),
    Raw(b"\xc7\x09\x00" + (2 ** 64).to_bytes(9, "big"), "2**64 (ext 0)"),
    Raw(b"\xc7\x0d\x01" + (2 ** 100).to_bytes(13, "big"), "2**100 (ext 1)"),
    Raw(packb(str(2 ** 100)), "2**100 (decimal str)"),
    Raw(packb(str(-(2 ** 63) - 1)), "-2**63-1 (decimal str)"),
    Raw(b"\xcf\x00\x00\x00\x00\x00\x00\x00\x01\x00", "2**64 (uint64 marker, 9 bytes)"),
    Raw(b"\xcf\xff\xff\xff", "uint64 marker, 3 bytes"),
    Raw(b"\xd3\x00\x00\x00\x00\x00\x00\x00\x05", "5 (int64, non-minimal)"),
    Raw(b"\xcf\x00\x00\x00\x00\x00\x00\x00\x00", "0 (uint64, non-minimal)"),
    Raw(b"\xff", "-1 (negative fixint)"),
    Raw(b"\xe0", "-32 (negative fixint)"),
    Raw(b"\xd0\x80", "-128 (int8)"),
)

_SMALL_INTS = (0, 1, -1, 2, 3, 31, 32, 63, 64, 65, 4095, 4096, 4097, 8193, -(2 ** 31),
               2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 62, 2 ** 63 - 1, -(2 ** 63))

# Values of every other msgpack type, and broken ones.
OTHER_VALUES: tuple[Any, ...] = (
    None, True, False, 0.0, -0.0, 1.5, float("nan"), float("inf"), float("-inf"),
    Raw(b"\xca\x3f\xc0\x00\x00", "1.5 (float32)"),
    "", "x", "evict", "load", "<i4", "<i8", "é" * 3, "x" * 10_000, "\x00",
    b"", b"\x00" * 8, b"\xff" * 33,
    [], [1], [1, 4], [None], [[[[[]]]]], list(range(1000)), ["a", "b"],
    {}, {"a": 1}, {"id": 1}, Raw(b"\x81\x01\x02", "{1: 2}"), Raw(b"\x81\xc0\xc0", "{nil: nil}"),
    Raw(b"\xd4\x05\x01", "ext 5"), Raw(b"\xd6\xff\x00\x00\x00\x01", "timestamp ext"),
    Raw(b"\xd4\xff\x00", "timestamp ext, bad length"),
    Raw(b"\xa2\xff\xfe", "str with invalid utf-8"),
    Raw(b"\x91" * 3000 + b"\x01", "array nested 3000 deep"),
    Raw(b"\xdd\xff\xff\xff\xff", "array declaring 2**32-1 items"),
    Raw(b"\xdf\xff\xff\xff\xff", "map declaring 2**32-1 pairs"),
    Raw(b"\xdb\xff\xff\xff\xff", "str declaring 2**32-1 bytes"),
    Raw(b"\xc1", "reserved byte 0xc1"),
)

_DTYPE_NAMES = ("<i4", "<i8", ">i4", ">i8", "<u4", "<u8", "<f4", "<f8", "|u1", "|i1", "i4", "<i2",
                "<i16", "", "bogus", "<i4\x00", "x" * 300)


def hostile_value(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.35:
        return rng.choice(HUGE_INTS)
    if r < 0.55:
        return rng.choice(_SMALL_INTS)
    return rng.choice(OTHER_VALUES)


def _label(v: Any) -> str:
    if isinstance(v, Raw):
        return v.label
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


# =========================================================================== cases


class _Now:
    """Stands for the send time in a header's ``ts`` field: a case is built before it
    is sent, and a signed request must carry a fresh ``ts`` unless the case fuzzes
    that very field (then the hostile value replaces this marker)."""

    def __repr__(self) -> str:
        return "NOW"


NOW = _Now()
_PLACEHOLDER_TS = 1_700_000_000_000_000_000  # what NOW becomes where no clock is wanted (ipc)


class Expect(enum.Enum):
    REPLY = "reply"  # the protocol promises one reply
    MAYBE = "maybe"  # failed authentication on tcp://: answering is the daemon's choice
    NONE = "none"  # a frame beyond MAXMSGSIZE: ZMQ drops the connection, no reply


class Auth(enum.Enum):
    """How a case is framed on a signed tcp:// listener (ignored on ipc://)."""

    SIGNED = "signed"  # correct mac, fresh ts: the daemon must then validate the payload
    UNSIGNED = "unsigned"
    FORGED = "forged"  # signed with another secret
    TAMPERED = "tampered"  # a payload byte changed after signing
    STALE = "stale"  # ts far in the past
    FUTURE = "future"  # ts far in the future
    NO_TS = "no_ts"
    REPLAY = "replay"  # the exact frames of an earlier signed message the same rank served
    SHORT_MAC = "short_mac"  # mac of 31 bytes
    MAC_ONLY = "mac_only"  # a mac frame and nothing else


@dataclass
class Case:
    """One message: ``header`` is encoded at send time (tcp adds ``ts``), ``tail``
    are the raw frames after it.  ``header`` is a dict, :class:`Pairs`, or bytes
    (already a frame, e.g. random or truncated)."""

    kind: str
    op: str
    detail: str
    header: Any
    tail: list[bytes]
    req_id: int  # the unique id the case was built with (its reply carries it if intact)
    task_ids: tuple[int, ...] = ()  # ids of a batch's tasks (each may get its own reply)
    oversize: bool = False  # a frame beyond MAXMSGSIZE: sent on a throwaway socket
    auth: Auth = Auth.SIGNED

    def header_frame(self, ts: int | None) -> bytes:
        """The header frame; ``ts`` (tcp) fills a NOW marker or is added if absent."""
        if isinstance(self.header, bytes):
            return self.header
        items = self.header.items if isinstance(self.header, Pairs) else tuple(
            self.header.items())
        now = _PLACEHOLDER_TS if ts is None else ts
        items = tuple((k, now if v is NOW else v) for k, v in items)
        if ts is not None and not any(k == "ts" for k, _ in items):
            items += (("ts", ts),)
        return encode(Pairs(items))

    def describe(self, payload: list[bytes]) -> dict:
        """What a report shows of a case: enough to rebuild or recognise it.  ``payload``
        is the message without its mac."""
        head = bytes(payload[0]) if payload else b""
        return {"kind": self.kind, "op": self.op, "detail": self.detail,
                "auth": self.auth.value, "header_hex": head[:160].hex(),
                "header_bytes": len(head), "frames": len(payload),
                "frame_bytes": [len(f) for f in payload[1:8]]}


@dataclass(frozen=True)
class Target:
    """What the generator knows about the namespace: block counts, epochs, tensors."""

    num_device_blocks: int
    num_host_blocks: int
    epochs: tuple[int, ...]
    tensors: tuple[dict, ...]  # register descriptors of rank 0 (names valid, shm real)
    max_frame_bytes: int
    kinds: tuple[str, ...]  # case kinds to draw from (KIND_WEIGHTS keys)


# Mix of case kinds (weights).  "valid" messages keep real work flowing between hostile ones.
KIND_WEIGHTS: dict[str, float] = {
    "valid": 12, "random": 8, "truncated": 8, "bitflip": 10, "field": 30, "ids": 15,
    "huge": 10, "frames": 2.5, "oversize": 0.8,
}
_VALID_OPS = (Op.EVICT, Op.LOAD, Op.EVICT, Op.LOAD, Op.BATCH, Op.CANCEL, Op.BACKUP, Op.EXISTS,
              Op.RESUME, Op.RESTORE, Op.PING, Op.STATS, Op.REGISTER)
_AUTH_WEIGHTS = {Auth.SIGNED: 72, Auth.UNSIGNED: 5, Auth.FORGED: 4, Auth.TAMPERED: 4,
                 Auth.STALE: 3, Auth.FUTURE: 2, Auth.NO_TS: 3, Auth.REPLAY: 4,
                 Auth.SHORT_MAC: 2, Auth.MAC_ONLY: 1}


class Generator:
    """The seeded stream of cases.  Deterministic: only ``rng`` decides."""

    def __init__(self, seed: int, target: Target, signed: bool):
        self.rng = random.Random(seed)
        self.t = target
        self.signed = signed
        self._next = _ID_FIRST
        self._recent: collections.deque[int] = collections.deque(maxlen=64)
        self._kinds = list(target.kinds)
        self._kind_w = [KIND_WEIGHTS[k] for k in self._kinds]
        self._auths = list(_AUTH_WEIGHTS)
        self._auth_w = [_AUTH_WEIGHTS[a] for a in self._auths]
        self._makers: dict[str, Callable[[], Case]] = {
            "valid": self.valid_case, "random": self._k_random, "truncated": self._k_truncated,
            "bitflip": self._k_bitflip, "field": self._k_field, "ids": self._k_ids,
            "huge": self._k_huge, "frames": self._k_frames, "oversize": self._k_oversize}

    def new_id(self) -> int:
        self._next += 1
        rid = self._next * _ID_STEP
        self._recent.append(rid)
        return rid

    # ------------------------------------------------------------------ valid templates
    def _ids(self, limit: int, k: int, unique: bool = True) -> list[int]:
        if unique:
            return self.rng.sample(range(limit), min(k, limit))
        return [self.rng.randrange(limit) for _ in range(k)]

    def _frame(self, ids: list[int], dtype: str = "<i4") -> bytes:
        return np.asarray(ids, dtype=dtype).tobytes()

    def _keys(self, n: int) -> bytes:
        return self.rng.randbytes(32 * n)

    def _client_fields(self) -> dict:
        """The optional 1.4 client fields, on some messages."""
        if self.rng.random() < 0.7:
            return {}
        return {"cid": self.rng.randrange(1, 2 ** 62), "cs": self.rng.randrange(1, 2 ** 20),
                "re": self.rng.random() < 0.2}

    def template(self, op: Op) -> tuple[dict, list[bytes], tuple[int, ...]]:
        """A well-formed request of ``op`` (header, id frames, batch task ids)."""
        rng, t = self.rng, self.t
        rid = self.new_id()
        h: dict = {"v": list(PROTOCOL_VERSION), "id": rid, "op": op.value}
        tail: list[bytes] = []
        tasks: tuple[int, ...] = ()
        if op in (Op.EVICT, Op.LOAD):
            k = rng.randint(0, 4)
            dev = self._ids(t.num_device_blocks, k, unique=op is Op.LOAD)
            host = self._ids(t.num_host_blocks, k, unique=op is Op.EVICT)
            h.update(ids="<i4", n=k)
            if rng.random() < 0.3:
                h["priority"] = rng.randint(-5, 5)
            if op is Op.LOAD and rng.random() < 0.3:
                h["layerwise"] = True
            if rng.random() < 0.5:
                h["ep"] = list(t.epochs)
            tail = [self._frame(dev), self._frame(host)]
        elif op is Op.BATCH:
            items = []
            for _ in range(rng.randint(1, 6)):
                top = rng.choice((Op.EVICT, Op.LOAD))
                k = rng.randint(0, 3)
                item = {"id": self.new_id(), "op": top.value, "n": k}
                if rng.random() < 0.2:
                    item["priority"] = rng.randint(-3, 3)
                if top is Op.LOAD and rng.random() < 0.2:
                    item["layerwise"] = True
                items.append(item)
                tail += [self._frame(self._ids(t.num_device_blocks, k, unique=top is Op.LOAD)),
                         self._frame(self._ids(t.num_host_blocks, k, unique=top is Op.EVICT))]
            tasks = tuple(it["id"] for it in items)
            h.update(ids="<i4", tasks=items)
            if rng.random() < 0.5:
                h["ep"] = list(t.epochs)
        elif op is Op.CANCEL:
            h["target"] = rng.choice(self._recent) if self._recent else 0
        elif op in (Op.BACKUP, Op.PREFETCH):
            k = rng.randint(0, 3)
            h.update(ids="<i4", n=k)
            tail = [self._frame(self._ids(t.num_host_blocks, k)), self._keys(k)]
        elif op is Op.EXISTS:
            k = rng.randint(0, 3)
            h["n"] = k
            tail = [self._keys(k)]
        elif op is Op.PEER_SEND:  # the ticket: random bytes (a real one needs an engine)
            k = rng.randint(0, 3)
            h.update(ids="<i4", n=k)
            tail = [self._frame(self._ids(t.num_host_blocks, k)),
                    rng.randbytes(rng.randint(0, 64))]
        elif op is Op.PEER_RECV:
            tail = [rng.randbytes(rng.randint(0, 64))]
        elif op is Op.REGISTER:
            h.update(backend="host", tensors=copy.deepcopy(list(t.tensors)))
        elif op is Op.CLEAR:
            h["free_host"] = rng.random() < 0.5
        h.update(self._client_fields())
        return h, tail, tasks

    # ------------------------------------------------------------------ hostile kinds
    def next_case(self) -> Case:
        kind = self.rng.choices(self._kinds, self._kind_w)[0]
        case = self._makers[kind]()
        if self.signed:
            case.auth = self.rng.choices(self._auths, self._auth_w)[0]
        return case

    def _any_op(self) -> Op:
        return self.rng.choice(list(Op))

    def valid_case(self) -> Case:
        op = self.rng.choice(_VALID_OPS)
        h, tail, tasks = self.template(op)
        return Case("valid", op.value, "well-formed", h, tail, h["id"], tasks)

    def _k_random(self) -> Case:
        rng = self.rng
        rid = self.new_id()
        n = rng.choice((1, 1, 1, 2, 3, 4))
        frames = [rng.randbytes(rng.choice((0, 1, 2, 8, 33, 64, 300))) for _ in range(n)]
        r = rng.random()
        if r < 0.3 and frames[0]:  # start like a map, so the parser goes deeper
            frames[0] = bytes([rng.choice((0x80, 0x81, 0x83, 0x8F, 0xDE, 0xDF))]) + frames[0]
        elif r < 0.5:  # valid msgpack of the wrong shape
            frames[0] = encode(hostile_value(rng))
        return Case("random", "-", f"{n} random frame(s)", frames[0], frames[1:], rid)

    def _encoded(self, op: Op) -> tuple[dict, list[bytes], tuple[int, ...], bytes]:
        h, tail, tasks = self.template(op)
        return h, tail, tasks, encode(h)

    def _k_truncated(self) -> Case:
        rng = self.rng
        op = self._any_op()
        h, tail, tasks, raw = self._encoded(op)
        r = rng.random()
        if r < 0.6 or not tail:
            cut = rng.randrange(0, len(raw))
            return Case("truncated", op.value, f"header cut at {cut}/{len(raw)}", raw[:cut],
                        tail, h["id"], tasks)
        if r < 0.85:
            i = rng.randrange(len(tail))
            cut = rng.randrange(0, len(tail[i]) + 1) if tail[i] else 0
            tail = list(tail)
            tail[i] = tail[i][:max(0, cut - 1)]
            return Case("truncated", op.value, f"id frame {i} cut", h, tail, h["id"], tasks)
        keep = rng.randrange(len(tail))
        return Case("truncated", op.value, f"only {keep} of {len(tail)} id frames", h,
                    tail[:keep], h["id"], tasks)

    def _k_bitflip(self) -> Case:
        rng = self.rng
        op = self._any_op()
        h, tail, tasks, raw = self._encoded(op)
        buf = bytearray(raw)
        flips = rng.randint(1, 8)
        for _ in range(flips):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        tail = list(tail)
        if tail and rng.random() < 0.3:
            i = rng.randrange(len(tail))
            if tail[i]:
                f = bytearray(tail[i])
                f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
                tail[i] = bytes(f)
        return Case("bitflip", op.value, f"{flips} bit(s) flipped", bytes(buf), tail, h["id"],
                    tasks)

    def _paths(self, obj: Any, prefix: tuple = (), depth: int = 0) -> Iterator[tuple]:
        """Every field and element of a header, nested (tasks[i].n, v[0], ep[1], ...)."""
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            path = (*prefix, key)
            yield path
            if depth < 3 and isinstance(value, (dict, list)) and len(value) <= 64:
                yield from self._paths(value, path, depth + 1)

    @staticmethod
    def _parent(h: dict, path: tuple) -> Any:
        node: Any = h
        for key in path[:-1]:
            node = node[key]
        return node

    def _mutable_header(self, op: Op) -> tuple[dict, list[bytes], tuple[int, ...]]:
        h, tail, tasks = self.template(op)
        # fields a client may send that the template left out, so they get fuzzed too
        for name, value in (("cid", 7), ("cs", 1), ("re", False), ("ts", NOW),
                            *((n, 0) for n in OPS[op].optional if n not in h)):
            if name not in h and self.rng.random() < 0.3:
                h[name] = value
        return h, tail, tasks

    def _k_field(self) -> Case:
        rng = self.rng
        op = self._any_op()
        h, tail, tasks = self._mutable_header(op)
        rid = h["id"]
        path = rng.choice(list(self._paths(h)))
        parent = self._parent(h, path)
        action = rng.choice(("replace", "replace", "replace", "drop", "duplicate", "add"))
        name = ".".join(str(p) for p in path)
        if action == "drop":
            del parent[path[-1]]
            return Case("field", op.value, f"drop {name}", h, tail, rid, tasks)
        value = hostile_value(rng)
        if action == "add":  # an unknown key (or extra element) next to the field
            if isinstance(parent, dict):
                parent[rng.choice(("zz", "", "ID", "op ", "v\x00"))] = value
            else:
                parent.append(value)
            return Case("field", op.value, f"extra next to {name}: {_label(value)}", h, tail,
                        rid, tasks)
        if action == "duplicate" and len(path) == 1:
            items = (*h.items(), (path[0], value))
            return Case("field", op.value, f"duplicate key {name}={_label(value)}",
                        Pairs(tuple(items)), tail, rid, tasks)
        parent[path[-1]] = value
        return Case("field", op.value, f"{name}={_label(value)}", h, tail, rid, tasks)

    def _k_huge(self) -> Case:
        """Integer edges (64-bit limits and beyond, non-minimal encodings) in integer fields."""
        rng = self.rng
        op = self._any_op()
        h, tail, tasks = self._mutable_header(op)
        rid = h["id"]
        ints = [p for p in self._paths(h)
                if (isinstance(self._parent(h, p)[p[-1]], int)
                    and not isinstance(self._parent(h, p)[p[-1]], bool))
                or self._parent(h, p)[p[-1]] is NOW]
        path = rng.choice(ints)
        value = rng.choice(HUGE_INTS) if rng.random() < 0.7 else rng.choice(_SMALL_INTS)
        self._parent(h, path)[path[-1]] = value
        name = ".".join(str(p) for p in path)
        return Case("huge", op.value, f"{name}={_label(value)}", h, tail, rid, tasks)

    def _bad_ids(self, limit: int, k: int) -> tuple[list[int], str]:
        rng = self.rng
        style = rng.choice(("negative", "at_limit", "int32_edge", "int64_edge", "dup",
                            "in_range", "mixed"))
        ids = self._ids(limit, k, unique=False)
        if not ids:
            return ids, "empty"
        i = rng.randrange(len(ids))
        if style == "negative":
            ids[i] = rng.choice((-1, -2 ** 31, -2 ** 63, -limit))
        elif style == "at_limit":
            ids[i] = limit + rng.choice((0, 0, 1, 1000))
        elif style == "int32_edge":
            ids[i] = rng.choice((2 ** 31 - 1, -2 ** 31))
        elif style == "int64_edge":
            ids[i] = rng.choice((2 ** 63 - 1, -2 ** 63, 2 ** 32))
        elif style == "dup" and len(ids) > 1:
            ids[i] = ids[(i + 1) % len(ids)]
        elif style == "mixed":
            ids = [rng.choice((-1, 0, limit - 1, limit, 2 ** 31 - 1)) for _ in ids]
        return ids, style

    def _id_frame(self, ids: list[int], dtype: str) -> bytes:
        if dtype in ("<i8", ">i8"):
            return np.asarray(ids, dtype=np.int64).astype(dtype).tobytes()
        if dtype in ("<i4", ">i4"):
            return np.asarray(ids, dtype=np.int64).astype(np.int32).astype(dtype).tobytes()
        return self.rng.randbytes(self.rng.choice((0, 1, 3, 4, 8, 12, 16)))

    def _k_ids(self) -> Case:
        """Bad, ragged, negative, out-of-range ids; wrong dtypes; n that disagrees."""
        rng, t = self.rng, self.t
        op = rng.choice((Op.EVICT, Op.LOAD, Op.EVICT, Op.LOAD, Op.BATCH, Op.BACKUP,
                         Op.PREFETCH, Op.EXISTS))
        h, tail, tasks = self.template(op)
        k = rng.randint(0, 6)
        dtype = rng.choice(("<i4", "<i4", "<i8", "<i8") + _DTYPE_NAMES)
        dev, dstyle = self._bad_ids(t.num_device_blocks, k)
        host, hstyle = self._bad_ids(t.num_host_blocks, k + rng.choice((0, 0, 0, 1, -1)))
        frames = [self._id_frame(dev, dtype), self._id_frame(host, dtype)]
        if rng.random() < 0.2:  # ragged: not a whole number of ids
            i = rng.randrange(2)
            frames[i] = frames[i] + rng.randbytes(rng.randint(1, 3)) if rng.random() < 0.5 \
                else frames[i][:-1]
        n: Any = len(dev)
        if rng.random() < 0.25:
            n = rng.choice((len(dev) + 1, len(dev) - 1, -1, 0, 2 ** 31, 2 ** 63 - 1,
                            rng.choice(HUGE_INTS)))
        detail = f"ids={dtype!r} dev:{dstyle} host:{hstyle} n={_label(n)}"
        if op is Op.BATCH:
            items = h["tasks"]
            i = rng.randrange(len(items))
            items[i]["n"] = n
            tail = list(tail)
            tail[2 * i], tail[2 * i + 1] = frames
            h["ids"] = dtype
            return Case("ids", op.value, f"task {i}: {detail}", h, tail, h["id"], tasks)
        if op is Op.EXISTS:
            h["n"] = n
            keys = self._keys(max(0, min(len(dev), 8)))
            keys = keys[:len(keys) - rng.choice((0, 0, 1, 31))] if keys else keys
            return Case("ids", op.value, f"keys frame {len(keys)} bytes n={_label(n)}", h, [keys],
                        h["id"])
        h.update(ids=dtype, n=n)
        if op in (Op.BACKUP, Op.PREFETCH):
            keys = self._keys(max(0, len(host) + rng.choice((0, 0, -1, 1))))
            return Case("ids", op.value, f"{detail} keys {len(keys)} bytes", h,
                        [frames[1], keys], h["id"])
        return Case("ids", op.value, detail, h, frames, h["id"])

    def _k_frames(self) -> Case:
        """Wrong frame counts: missing, extra, many extra (MAX_FRAMES), big batches."""
        rng = self.rng
        r = rng.random()
        if r < 0.01:  # a batch at and just past MAX_BATCH_TASKS, frames consistent
            count = MAX_BATCH_TASKS + rng.choice((0, 1))
            rid = self.new_id()
            items, tail = [], []
            for j in range(count):
                top = Op.EVICT if j % 2 else Op.LOAD
                items.append({"id": self.new_id(), "op": top.value, "n": 1})
                tail += [self._frame([rng.randrange(self.t.num_device_blocks)]),
                         self._frame([rng.randrange(self.t.num_host_blocks)])]
            h = {"v": list(PROTOCOL_VERSION), "id": rid, "op": Op.BATCH.value, "ids": "<i4",
                 "tasks": items}
            return Case("frames", "batch", f"batch of {count} tasks ({1 + len(tail)} frames)",
                        h, tail, rid, tuple(it["id"] for it in items))
        op = self._any_op()
        h, tail, tasks = self.template(op)
        if r < 0.15:
            total = rng.choice((MAX_FRAMES - 1, MAX_FRAMES, MAX_FRAMES + 1, 2 * MAX_FRAMES,
                                30_000))
            extra = max(0, total - 1 - len(tail))
            filler = rng.choice((b"", b"\x01\x00\x00\x00"))
            return Case("frames", op.value, f"{total} frames in all", h,
                        tail + [filler] * extra, h["id"], tasks)
        if r < 0.6:
            extra = rng.choice((1, 2, 3, 17, 100))
            return Case("frames", op.value, f"{extra} extra frame(s)", h,
                        tail + [rng.randbytes(rng.choice((0, 4, 8)))] * extra, h["id"], tasks)
        if r < 0.8 and tail:
            drop = rng.randint(1, len(tail))
            return Case("frames", op.value, f"{drop} id frame(s) missing", h, tail[drop:],
                        h["id"], tasks)
        return Case("frames", op.value, "empty frames", h, [b""] * rng.randint(1, 6), h["id"],
                    tasks)

    def _k_oversize(self) -> Case:
        """Headers past MAX_HEADER_BYTES, frames at and past MAXMSGSIZE."""
        rng, limit = self.rng, self.t.max_frame_bytes
        r = rng.random()
        h, tail, tasks = self.template(rng.choice((Op.PING, Op.EVICT, Op.STATS)))
        if r < 0.4:
            size = MAX_HEADER_BYTES + rng.choice((-1, 0, 1, 1, 100, 65_536))
            if rng.random() < 0.3:
                return Case("oversize", h["op"], f"{size}-byte random header",
                            rng.randbytes(16) * (size // 16) + b"\x00" * (size % 16),
                            tail, h["id"])
            return Case("oversize", h["op"], f"{size}-byte header",
                        _padded(h, size), tail, h["id"], tasks)
        if r < 0.8:  # accepted by ZMQ (at most MAXMSGSIZE), then refused by the daemon
            size = limit - rng.choice((0, 0, 1, 3, 4096))
            i = rng.randrange(len(tail)) if tail else None
            frames = list(tail) if tail else [b""]
            frames[i or 0] = b"\x07" * size
            return Case("oversize", h["op"], f"{size}-byte frame (MAXMSGSIZE {limit})", h,
                        frames, h["id"], tasks)
        size = limit + rng.choice((1, 2, 4096, limit))
        return Case("oversize", h["op"], f"{size}-byte frame past MAXMSGSIZE {limit}", h,
                    [b"\x07" * size], h["id"], tasks, oversize=True)


def _padded(h: dict, size: int) -> bytes:
    """``h`` encoded to exactly ``size`` bytes with an unknown ``pad`` field."""
    body = {**h, "pad": b""}
    need = size - len(encode(body))
    for _ in range(4):
        body["pad"] = b"\x00" * max(0, need)
        got = len(encode(body))
        if got == size:
            break
        need += size - got
    return encode(body)


# =========================================================================== transport


# The tcp:// daemons' replay window.  The replay guard remembers every mac of its
# window (client/auth.py), by design as much as the signed request rate times the
# window: at this stream's ~1,100 signed messages a second the default 60 s window
# grew it by ~13 MB over a 100k-message run (200-byte entries then; ~80 now), all
# after the baseline, and the drift check measured that.  A 5 s window is full
# before the baseline is taken.
REPLAY_WINDOW_S = 5.0


@dataclass(frozen=True)
class Transport:
    name: str  # "ipc" or "tcp"
    endpoints: tuple[str, ...]
    secret: bytes | None = None  # tcp: every message is signed
    replay_window_s: float = REPLAY_WINDOW_S  # what the daemons were launched with


def _forged_secret(secret: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in secret)


@dataclass
class Wire:
    """A case as it goes on the wire, with what the daemon will make of it."""

    frames: list[bytes]  # what is sent
    payload: list[bytes]  # the message without its mac: what the daemon decodes
    expect: Expect
    reply_id: int | None  # the id the reply will carry (None: unreadable or auth refused)
    forbidden: bool  # a valid shutdown / pause / clear / replacing register: never sent
    op: Op | None = None  # the op the daemon will read, if the header decodes


class Framer:
    """Turns a case into wire frames (signing on tcp://) and predicts the reply by
    decoding the payload with the daemon's own ``decode_request``."""

    def __init__(self, transport: Transport, rng: random.Random, max_frame_bytes: int):
        self.tr = transport
        self.rng = rng
        self.max_frame_bytes = max_frame_bytes  # the daemons' MAXMSGSIZE

    def wire(self, case: Case) -> Wire:
        w = self._wire(case)
        if case.oversize:  # ZMQ drops the connection before the daemon sees it
            w.expect, w.reply_id = Expect.NONE, None
        return w

    def _wire(self, case: Case) -> Wire:
        secret = self.tr.secret
        now = time.time_ns()
        window = int(self.tr.replay_window_s * 1e9)
        ts = None
        if secret is not None:
            ts = {Auth.STALE: now - 2 * window - 10**9, Auth.FUTURE: now + 2 * window + 10**9,
                  Auth.NO_TS: None}.get(case.auth, now)
        payload = [case.header_frame(ts), *case.tail]
        try:
            req = decode_request(payload)
        except RequestError as exc:
            req, reply_id = None, exc.req_id
        else:
            reply_id = req.id
        if len(payload) > MAX_FRAMES:
            # read no further than MAX_FRAMES: refused under the header's id on ipc://;
            # on tcp:// the MAC cannot be checked, so like any unauthenticated message
            req, reply_id = None, peek_request_id(payload[0])
            if secret is not None:
                return Wire(sign(secret, payload), payload, Expect.MAYBE, None, False, None)
            return Wire(payload, payload, Expect.REPLY, reply_id, False, None)
        forbidden = _forbidden(req)
        op = req.op if req is not None else None
        if secret is None:
            return Wire(payload, payload, Expect.REPLY, reply_id, forbidden, op)
        refused = {
            Auth.UNSIGNED: lambda: payload,
            Auth.FORGED: lambda: sign(_forged_secret(secret), payload),
            Auth.SHORT_MAC: lambda: [mac(secret, payload)[:MAC_BYTES - 1], *payload],
            Auth.MAC_ONLY: lambda: [mac(secret, payload)],
        }.get(case.auth)
        if refused is not None:
            return Wire(refused(), payload, Expect.MAYBE, None, forbidden, op)
        signed = sign(secret, payload)
        if case.auth is Auth.TAMPERED:
            i = self.rng.randrange(1, len(signed))
            signed[i] = bytes(signed[i]) + b"\x00"
            if len(signed[i]) > self.max_frame_bytes:
                # now past MAXMSGSIZE: libzmq drops the connection, and with it whatever
                # the run's socket had in flight, so it goes on a throwaway socket
                return Wire(signed, payload, Expect.NONE, None, forbidden, op)
            return Wire(signed, payload, Expect.MAYBE, None, forbidden, op)
        if req is not None:
            ts_seen = req.header.get("ts")
            if (not isinstance(ts_seen, int) or isinstance(ts_seen, bool)
                    or abs(now - ts_seen) > window):
                # refused by the authentication layer (checked after decoding)
                return Wire(signed, payload, Expect.MAYBE, None, forbidden, op)
        return Wire(signed, payload, Expect.REPLY, reply_id, forbidden, op)


# =========================================================================== tracking


Key = tuple[int, Any]  # (rank, reply id); the id is None for a reply with a nil id


@dataclass
class Tracker:
    """Replies expected and received, keyed by (rank, reply id).

    ``pending``: replies that must come under one of the run's own ids, one case each,
    so a missing one names its message.  ``hostile``: replies that must come under an
    id the case does not own (a fuzzed or unreadable id), counted per key with the
    latest cases kept for the report.  ``maybe``: replies that may come (batch tasks)."""

    samples: int = 8
    pending: dict[Key, tuple[Case, list[bytes]]] = field(default_factory=dict)
    hostile: dict[Key, int] = field(default_factory=dict)
    hostile_due: int = 0
    hostile_cases: dict[Key, collections.deque] = field(default_factory=dict)
    maybe: set[Key] = field(default_factory=set)
    answered: dict[Key, str] = field(default_factory=dict)  # key -> what the case was
    codes: collections.Counter = field(default_factory=collections.Counter)
    replies: int = 0
    maybe_replies: int = 0  # answers to batch tasks and to messages refused by tcp:// auth
    unexpected: int = 0  # replies nobody predicted: bit-flipped batch task ids, after a stall
    unexpected_samples: list[dict] = field(default_factory=list)
    duplicates: int = 0
    duplicate_samples: list[dict] = field(default_factory=list)
    undecodable: int = 0
    bad_reply_mac: int = 0
    unanswered: int = 0
    unanswered_samples: list[dict] = field(default_factory=list)
    exec_failures: list[dict] = field(default_factory=list)
    exec_failure_count: int = 0

    def expect(self, rank: int, case: Case, wire: Wire) -> None:
        for tid in case.task_ids:
            self.maybe.add((rank, tid))
        if wire.expect is Expect.MAYBE:
            self.maybe.add((rank, wire.reply_id))
            return
        if wire.expect is Expect.NONE:
            return
        key = (rank, wire.reply_id)
        if wire.reply_id is not None and wire.reply_id == case.req_id:
            self.pending[key] = (case, wire.payload)
            return
        self.hostile[key] = self.hostile.get(key, 0) + 1
        self.hostile_due += 1
        self.hostile_cases.setdefault(key, collections.deque(maxlen=2)).append(
            (case, wire.payload))

    @property
    def outstanding(self) -> int:
        return len(self.pending) + self.hostile_due

    def on_reply(self, rank: int, body: Any) -> None:
        try:
            reply = decode_reply(body)
        except KvswapError:
            self.undecodable += 1
            return
        self.replies += 1
        self.codes[reply.code.name] += 1
        key: Key = (rank, reply.id if isinstance(reply.id, int) else None)
        if reply.code in _CODES_BAD_AFTER_ADMISSION:
            self.exec_failure_count += 1
            if len(self.exec_failures) < self.samples:
                sample: dict = {"rank": rank, "id": reply.id, "code": reply.code.name,
                                "message": reply.message[:300]}
                exact = self.pending.get(key)
                if exact is not None:  # the run's own id: exactly this message
                    sample["case"] = exact[0].describe(exact[1])
                elif self.hostile_cases.get(key):  # a shared hostile id: the latest ones
                    sample["cases_with_this_id"] = [c.describe(p)
                                                    for c, p in self.hostile_cases[key]]
                self.exec_failures.append(sample)
        entry = self.pending.pop(key, None)
        if entry is not None:
            self.answered[key] = f"{entry[0].kind} {entry[0].op}: {entry[0].detail}"
        elif self.hostile.get(key):
            self.hostile[key] -= 1
            self.hostile_due -= 1
        elif key in self.maybe:
            if key[1] is not None:
                self.maybe.discard(key)
                self.answered[key] = "batch task or replayed message"
            self.maybe_replies += 1
        elif key in self.answered and reply.code != ErrorCode.AUTH_FAILED:
            self.duplicates += 1  # (a replayed message may be refused under its id)
            if len(self.duplicate_samples) < self.samples:
                self.duplicate_samples.append({
                    "rank": rank, "id": reply.id, "code": reply.code.name,
                    "message": reply.message[:300], "first_answered": self.answered[key]})
        else:
            self.unexpected += 1
            if len(self.unexpected_samples) < self.samples:
                self.unexpected_samples.append({"rank": rank, "id": reply.id,
                                                "code": reply.code.name,
                                                "message": reply.message[:200]})

    def give_up(self) -> int:
        """Count every reply still due as lost (after a stall, or at the end)."""
        lost = 0
        for key, (case, payload) in self.pending.items():
            lost += 1
            if len(self.unanswered_samples) < self.samples:
                self.unanswered_samples.append({"rank": key[0], "id": key[1],
                                                **case.describe(payload)})
        for key, count in self.hostile.items():
            if not count:
                continue
            lost += count
            if len(self.unanswered_samples) < self.samples:
                case, payload = self.hostile_cases[key][-1]
                self.unanswered_samples.append({"rank": key[0], "id": key[1], "missing": count,
                                                **case.describe(payload)})
        self.pending.clear()
        self.hostile.clear()
        self.hostile_due = 0
        self.unanswered += lost
        return lost


class RssSampler:
    """VmRSS of each daemon every ``interval_s``: the peak between samples is missed,
    which is fine for a drift check over minutes."""

    def __init__(self, pids: list[int], interval_s: float = 0.2):
        self.pids = pids
        self.interval_s = interval_s
        self.peak = [0] * len(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> list[int]:
        out = [rss_kib(p) for p in self.pids]
        self.peak = [max(a, b) for a, b in zip(self.peak, out)]
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def settled(self, period_s: float) -> list[int]:
        """Each daemon's lowest RSS over ``period_s``: what stays resident once the
        memory of the last requests is freed and returned (the daemons call
        ``malloc_trim`` every ``TRIM_EVERY_S``).  Leaked memory stays resident
        throughout, so it still counts in full."""
        low = self.sample()
        deadline = time.monotonic() + period_s
        while time.monotonic() < deadline:
            time.sleep(self.interval_s)  # a measurement period, not a synchronisation
            low = [min(a, b) for a, b in zip(low, self.sample())]
        return low


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# =========================================================================== driver


@dataclass
class StressConfig:
    messages: int = 100_000  # hostile + valid cases per transport (warm-up not counted)
    seed: int = 0
    transports: tuple[str, ...] = ("ipc", "tcp")
    tp: int = 2
    window: int = 256  # replies that must come, outstanding at most
    warmup: int = 300  # valid cases before the RSS baseline
    layout: str = LAYOUT
    host_blocks: int = 64
    max_frame_bytes: int = 2 << 20  # the daemons' frame limit (via --max-device-blocks)
    storage: bool = True  # file:// storage tier, so backup/prefetch/exists get validated
    kinds: tuple[str, ...] = tuple(KIND_WEIGHTS)  # case kinds of the run
    rss_drift: float = 0.10
    rss_settle_s: float = 2 * TRIM_EVERY_S + 1  # RSS watched this long for its low point
    stall_timeout_s: float = 10.0
    ping_timeout_s: float = 2.0
    run_root: str | None = None
    log_dir: str | None = None  # keep the daemon logs here (default: removed)
    progress: Callable[[str], None] | None = None


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class RankFigures:
    rank: int
    pid_start: int
    pid_end: int
    alive: bool
    epoch_start: int
    epoch_end: int
    rss_launch_kib: int
    rss_start_kib: int  # after the valid warm-up
    rss_base_kib: int  # settled after the first tenth of the hostile run: the drift baseline
    rss_peak_kib: int
    rss_end_kib: int
    rss_timeline_kib: list[int]  # every twentieth of the run
    drift: float
    log_lines: int = 0
    log_bytes: int = 0
    tracebacks: int = 0


@dataclass
class TransportRun:
    transport: str
    namespace: str
    tp: int
    messages: int
    duration_s: float
    rate_per_s: float
    kinds: dict[str, int]
    auth: dict[str, int]
    codes: dict[str, int]
    replies: int
    required_replies_missing: int
    unanswered_samples: list[dict]
    duplicates: int
    duplicate_samples: list[dict]
    undecodable_replies: int
    bad_reply_mac: int
    exec_failures: int
    exec_failure_samples: list[dict]
    stalls: int
    stall_notes: list[str]
    ping_s: float | None
    ranks: list[RankFigures]
    leaks: list[str]
    checks: list[Check]
    crashed_after: list[dict] = field(default_factory=list)  # last cases sent to a dead rank

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


@dataclass
class StressReport:
    seed: int
    messages: int
    runs: list[TransportRun]

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.ok for r in self.runs)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        for run, src in zip(out["runs"], self.runs):
            run["ok"] = src.ok
        return out


def _free_base_port(tp: int) -> int:
    """A loopback port P such that P .. P+tp-1 are free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + tp > 65535:
            continue
        try:
            holders = []
            for p in range(base, base + tp):
                s = socket.socket()
                holders.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in holders:
                s.close()
    raise RuntimeError(f"no {tp} consecutive free loopback ports")


class Driver:
    """Sends one transport's cases to every rank and reads the replies."""

    def __init__(self, cfg: StressConfig, transport: Transport, target: Target, seed: int,
                 procs: list):
        self.cfg = cfg
        self.tr = transport
        self.procs = procs
        self.gen = Generator(seed, target, signed=transport.secret is not None)
        self.framer = Framer(transport, random.Random(seed ^ 0x5EED), target.max_frame_bytes)
        self.route = random.Random(seed ^ 0xA11)  # which rank gets the next case
        self.track = Tracker()
        self.kinds: collections.Counter = collections.Counter()
        self.auth: collections.Counter = collections.Counter()
        self.stalls = 0
        self.stall_notes: list[str] = []
        self.hung: list[int] = []  # ranks alive but not answering (found after a stall)
        self.sent = 0
        self.last: list[collections.deque] = [collections.deque(maxlen=16) for _ in procs]
        # signed messages that decoded, per rank, until replayed (tcp:// only)
        self.replayable: list[collections.deque] = [collections.deque(maxlen=64) for _ in procs]
        self.ctx = zmq.Context(1)
        self.socks = []
        for ep in transport.endpoints:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, int(cfg.stall_timeout_s * 1000))
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(ep)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.ctx.term()

    def dump_stacks(self) -> None:
        """Ask every daemon to write its threads' stacks to its log (kvswapd registers
        SIGUSR1 for that), so a stall can be diagnosed after the run."""
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGUSR1)

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is not None]

    # ------------------------------------------------------------------ replies
    def pump(self, timeout_ms: int) -> int:
        got = 0
        for sock, _ in self.poller.poll(timeout_ms):
            rank = self.socks.index(sock)
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1
                if self.tr.secret is not None:
                    try:
                        _, frames = verify(self.tr.secret, frames)
                    except AuthFailed:
                        self.track.bad_reply_mac += 1
                        continue
                self.track.on_reply(rank, frames[0])
        return got

    def wait_below(self, limit: int) -> bool:
        """Read replies until fewer than ``limit`` must still come; False if a daemon died."""
        last_progress = time.monotonic()
        while self.track.outstanding >= limit:
            if self.pump(100):
                last_progress = time.monotonic()
                continue
            if self.dead():
                return False
            if time.monotonic() - last_progress > self.cfg.stall_timeout_s:
                # nothing for a whole stall timeout: what is pending is lost, go on
                self.stalls += 1
                self.stall_notes.append(
                    f"no reply for {self.cfg.stall_timeout_s}s with {self.track.outstanding} "
                    f"due ({len(self.track.pending)} under the run's ids); daemon stacks "
                    f"written to their logs (SIGUSR1)")
                self.dump_stacks()
                self.track.give_up()
                self.hung = [r for r in range(len(self.socks)) if not self.answers_ping(r)]
                if self.hung:
                    self.stall_notes.append(f"rank(s) {self.hung} do not answer a ping on a "
                                            f"fresh connection: hung, run stopped")
                    return False
                last_progress = time.monotonic()
        return True

    def answers_ping(self, rank: int, timeout_s: float = 5.0) -> bool:
        """Does ``rank`` answer a ping on a connection of its own (so nothing queued on
        the fuzzing socket is in the way)?"""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.tr.endpoints[rank])
        try:
            frames = [packb({"v": list(PROTOCOL_VERSION), "id": 1, "op": Op.PING.value,
                             "ts": time.time_ns()})]
            if self.tr.secret is not None:
                frames = sign(self.tr.secret, frames)
            s.send_multipart(frames)
            return bool(s.poll(int(timeout_s * 1000)))
        finally:
            s.close()

    # ------------------------------------------------------------------ sending
    def _send_oversize(self, rank: int, frames: list[bytes]) -> None:
        """On a socket of its own: ZMQ drops the whole connection for it."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(self.tr.endpoints[rank])
        s.send_multipart(frames, copy=False)
        s.close()

    def _replay(self, rank: int, case: Case) -> bool:
        """Send again, byte for byte, a signed message this rank has already served: its
        replay guard must refuse it (a second answer under the id is a duplicate)."""
        queue = self.replayable[rank]
        while queue:
            key, frames = queue.popleft()
            if key in self.track.answered:
                self.kinds[case.kind] += 1
                self.auth[Auth.REPLAY.value] += 1
                self.last[rank].append({"replay_of": key[1], **case.describe(frames[1:])})
                self.track.expect(rank, case, Wire(frames, frames[1:], Expect.MAYBE, None, False))
                self.socks[rank].send_multipart(frames)
                return True
            if key in self.track.pending:
                queue.appendleft((key, frames))  # not answered yet: try a later one
                return False
        return False

    def send_one(self, case_source: Callable[[], Case]) -> bool:
        rank = self.route.randrange(len(self.socks))
        while True:
            case = case_source()
            wire = self.framer.wire(case)
            if not wire.forbidden:
                break
        if case.auth is Auth.REPLAY:
            if self._replay(rank, case):
                return True
            case.auth = Auth.SIGNED  # nothing served yet to replay
            wire = self.framer.wire(case)
        self.kinds[case.kind] += 1
        if self.tr.secret is not None:
            self.auth[case.auth.value] += 1
        if wire.expect is Expect.NONE:
            self.last[rank].append(case.describe(wire.payload))
            self._send_oversize(rank, wire.frames)
            return True
        # A prefetch runs a cross-rank agreement: sent to one rank alone it would hold that
        # rank's storage lane for the whole --storage-timeout, so it goes to every rank.
        ranks = range(len(self.socks)) if wire.op is Op.PREFETCH else (rank,)
        if (case.auth is Auth.SIGNED and self.tr.secret is not None and wire.op is not None
                and wire.expect is Expect.REPLY and wire.reply_id == case.req_id
                and len(ranks) == 1):
            self.replayable[rank].append(((rank, case.req_id), wire.frames))
        for r in ranks:
            self.last[r].append(case.describe(wire.payload))
            self.track.expect(r, case, wire)
            try:
                self.socks[r].send_multipart(wire.frames, copy=len(wire.frames) < 64)
            except zmq.Again:
                self.stalls += 1
                self.stall_notes.append(f"send to rank {r} blocked for {self.cfg.stall_timeout_s}s")
                if self.dead():
                    return False
        return True

    def run(self, n: int, source: Callable[[], Case],
            on_step: Callable[[int], str] | None = None) -> bool:
        """Send ``n`` cases; False (early) if a daemon died.  ``on_step(sent)`` runs after
        every twentieth of them and returns a line for the progress output."""
        step = max(1, n // 20)
        t0 = time.monotonic()
        for i in range(n):
            if not self.send_one(source):
                return False
            self.sent += 1
            self.pump(0)
            if not self.wait_below(self.cfg.window):
                return False
            if on_step is not None and (i + 1) % step == 0:
                extra = on_step(i + 1)
                if self.cfg.progress:
                    dt = time.monotonic() - t0
                    self.cfg.progress(f"  {self.tr.name}: {i + 1}/{n} messages, {dt:.0f}s, "
                                      f"{(i + 1) / max(dt, 1e-9):.0f}/s, {self.track.replies} "
                                      f"replies; {extra}")
        return True

    def drain(self) -> bool:
        """Wait for every reply that must come (stall timeout without progress)."""
        ok = self.wait_below(1)
        self.pump(200)  # late batch-task replies: counted, not waited for
        return ok


# =========================================================================== checks


def _round_trip(client: TransferClient, views: list[RankView], rng: np.random.Generator,
                num_dev: int, num_host: int) -> str | None:
    """Evict a freshly written device block, load it into another, compare every tensor
    of every rank in shared memory.  None if all bytes match, else what differs."""
    src, dst = 0, num_dev - 1
    host = num_host - 1
    expected = []
    for view in views:
        per = []
        for dev in view.device:
            words = rng.integers(0, 2 ** 63, size=dev.shape[1], dtype=np.uint64)
            dev[src] = words
            dev[dst] = 0
            per.append(words)
        expected.append(per)
    client.evict([src], [host]).result(10)
    client.load([host], [dst]).result(10)
    for r, (view, per) in enumerate(zip(views, expected)):
        for i, words in enumerate(per):
            if not np.array_equal(view.host[i][host], words):
                return f"rank {r} tensor {i}: host block {host} differs after the evict"
            if not np.array_equal(view.device[i][dst], words):
                return f"rank {r} tensor {i}: device block {dst} differs after the load"
    return None


def _final_checks(cfg: StressConfig, launcher: Launcher, transport: Transport,
                  tcp_spec: str | None, tensors: list[TensorDesc], num_dev: int,
                  seed: int) -> tuple[list[Check], float | None]:
    checks: list[Check] = []
    names = launcher.names
    client = TransferClient(names.namespace, cfg.tp, run_root=str(names.run_root),
                            task_timeout=30.0, tcp=tcp_spec, secret=transport.secret)
    views: list[RankView] = []
    ping_s = None
    try:
        t0 = time.monotonic()
        try:
            res = client.ping().result(cfg.ping_timeout_s)
            ping_s = time.monotonic() - t0
            states = {r.rank: r.fields.get("state") for r in res.replies.values()}
            pids = {r.rank: r.fields.get("pid") for r in res.replies.values()}
            ok = all(s == "READY" for s in states.values())
            expected_pids = {r: p.pid for r, p in enumerate(launcher.procs)}
            ok = ok and pids == expected_pids
            checks.append(Check("ping", ok, f"answered in {ping_s * 1e3:.1f} ms by every rank, "
                                            f"states {states}, pids {pids}"))
        except KvswapError as exc:
            checks.append(Check("ping", False, f"no ping within {cfg.ping_timeout_s}s: {exc}"))
        try:
            # After the drain every admitted task must have finished: a task left queued
            # waits on one that never ends, and its client never hears back.
            res = client.stats().result(10)
            left = {r.rank: (r.fields["counters"].get("queued"), r.fields["counters"]["inflight"])
                    for r in res.replies.values()}
            checks.append(Check("idle", all(q == 0 and f == 0 for q, f in left.values()),
                                "; ".join(f"rank {r}: {q} queued, {f} in flight"
                                          for r, (q, f) in sorted(left.items()))))
        except KvswapError as exc:
            checks.append(Check("idle", False, f"stats failed: {exc}"))
        try:
            for r in range(cfg.tp):
                views.append(RankView(names, r, tensors, cfg.host_blocks))
        except (posix_ipc.ExistentialError, ValueError) as exc:  # a rank without its caches
            checks.append(Check("round_trip", False, f"rank {len(views)}'s caches or host "
                                                     f"pool cannot be mapped: {exc}"))
        else:
            try:
                bad = _round_trip(client, views, np.random.default_rng(seed), num_dev,
                                  cfg.host_blocks)
                checks.append(Check("round_trip", bad is None,
                                    bad or "evict + load, every tensor of every rank verified"))
            except KvswapError as exc:
                checks.append(Check("round_trip", False, f"evict + load failed: {exc}"))
    finally:
        for view in views:
            view.close()
        client.close()
    return checks, ping_s


def _log_figures(path: Path) -> tuple[int, int, int]:
    try:
        data = path.read_bytes()
    except OSError:
        return 0, 0, 0
    return data.count(b"\n"), len(data), data.count(b"Traceback")


def _run_transport(cfg: StressConfig, name: str, seed: int, work: Path) -> TransportRun:
    progress = cfg.progress or (lambda _: None)
    secret = None
    tcp_spec = None
    extra: dict[str, Any] = {}
    if name == "tcp":
        secret = os.urandom(SECRET_BYTES).hex().encode()
        secret_path = work / f"secret-{name}"
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        tcp_spec = f"127.0.0.1:{_free_base_port(cfg.tp)}"
        extra.update(tcp=tcp_spec, secret_file=str(secret_path),
                     replay_window_s=REPLAY_WINDOW_S)
    if cfg.storage:
        store = work / f"store-{name}"
        store.mkdir()
        extra["storage_url"] = f"file://{store}"
    log_dir = (Path(cfg.log_dir) if cfg.log_dir else work) / f"logs-{name}"
    namespace = f"fuzz{os.getpid()}-{name}"
    launcher = Launcher(LaunchConfig(namespace=namespace, tp=cfg.tp, host_blocks=cfg.host_blocks,
                                     run_root=cfg.run_root, demo_caches=cfg.layout,
                                     log_dir=str(log_dir), ready_timeout_s=60.0,
                                     stop_timeout_s=15.0, storage_timeout_s=0.5,
                                     # the frame limit is derived from it: 8 bytes per block
                                     max_device_blocks=cfg.max_frame_bytes // 8, **extra))
    params = parse_demo_layout(cfg.layout)
    num_dev = params["blocks"]
    shapes = demo_layout(cfg.layout)
    tensors = [TensorDesc(s.name, s.layer, s.dtype, s.shape) for s in shapes]
    checks: list[Check] = []
    driver: Driver | None = None
    sampler: RssSampler | None = None
    crashed: list[dict] = []
    ping_s = None
    launcher.start()
    try:
        launcher.wait_ready(60)
        names = launcher.names
        assert launcher.seg is not None
        pids = [p.pid for p in launcher.procs]
        epochs = [int(launcher.seg.ranks[r, RankSlot.EPOCH]) for r in range(cfg.tp)]
        rss_launch = [rss_kib(p) for p in pids]
        endpoints = tuple(tcp_endpoints(tcp_spec, cfg.tp) if tcp_spec
                          else [names.endpoint(r) for r in range(cfg.tp)])
        transport = Transport(name, endpoints, secret)
        target = Target(num_dev, cfg.host_blocks, tuple(epochs),
                        tuple(TensorDesc(t.name, t.layer, t.dtype, t.shape,
                                         {"shm": names.device_segment(0, t.name)}).to_wire()
                              for t in tensors),
                        cfg.max_frame_bytes, cfg.kinds)
        driver = Driver(cfg, transport, target, seed, launcher.procs)
        sampler = RssSampler(pids)
        progress(f"{name}: namespace {namespace} READY, tp {cfg.tp}, daemons {pids}; "
                 f"warm-up {cfg.warmup} valid messages")
        alive = driver.run(cfg.warmup, driver.gen.valid_case) and driver.drain()
        rss_start = sampler.sample()
        sampler.peak = list(rss_start)
        timeline: list[list[int]] = [[] for _ in pids]
        sampler.start()
        driver.kinds.clear()
        driver.auth.clear()
        warm_codes = collections.Counter(driver.track.codes)
        warm_replies = driver.track.replies
        driver.sent = 0
        t0 = time.monotonic()
        rss_base = list(rss_start)
        if alive:
            def on_step(sent: int) -> str:
                now = sampler.sample()
                for r, kib in enumerate(now):
                    timeline[r].append(kib)
                return "RSS " + ", ".join(f"{kib} KiB" for kib in now)

            # The first tenth grows the daemons' allocators to their working size
            # (Python's object arenas, libzmq's buffers); a leak is what grows after it.
            first = max(1, cfg.messages // 10)
            alive = driver.run(first, driver.gen.next_case, on_step) and driver.drain()
            if alive:
                rss_base = sampler.settled(cfg.rss_settle_s)
                progress(f"{name}: drift baseline after {first} hostile messages: RSS "
                         + ", ".join(f"{kib} KiB" for kib in rss_base))
                alive = (driver.run(cfg.messages - first, driver.gen.next_case, on_step)
                         and driver.drain())
        duration = time.monotonic() - t0
        driver.track.give_up()
        for r in driver.dead():
            crashed.append({"rank": r, "exit_status": launcher.procs[r].returncode,
                            "last_cases": list(driver.last[r])})
        for r in driver.hung:
            crashed.append({"rank": r, "exit_status": "hung (alive, answers nothing; thread "
                                                      "stacks in its log)",
                            "last_cases": list(driver.last[r])})
        if not crashed:
            more, ping_s = _final_checks(cfg, launcher, transport, tcp_spec, tensors, num_dev,
                                         seed)
            checks += more
        sampler.stop()
        rss_end = sampler.settled(cfg.rss_settle_s)
        epochs_end = [int(launcher.seg.ranks[r, RankSlot.EPOCH]) for r in range(cfg.tp)]
        ranks = []
        for r in range(cfg.tp):
            proc = launcher.procs[r]
            base = rss_base[r]
            ranks.append(RankFigures(
                rank=r, pid_start=pids[r], pid_end=proc.pid, alive=proc.poll() is None,
                epoch_start=epochs[r], epoch_end=epochs_end[r], rss_launch_kib=rss_launch[r],
                rss_start_kib=rss_start[r], rss_base_kib=base, rss_peak_kib=sampler.peak[r],
                rss_end_kib=rss_end[r],
                rss_timeline_kib=timeline[r],
                drift=(rss_end[r] - base) / base if base else math.inf))
    finally:
        if sampler is not None:
            sampler.stop()
        if driver is not None:
            driver.close()
        launcher.stop()
    leaks = [f"/dev/shm/{e}" for e in launcher.names.owned_shm()]
    if launcher.names.run_dir.exists():
        leaks.append(str(launcher.names.run_dir))
    leaks += [f"pid {p.pid}" for p in launcher.procs if p.poll() is None]
    for fig in ranks:
        fig.log_lines, fig.log_bytes, fig.tracebacks = _log_figures(
            launcher.names.log_path(fig.rank, log_dir))
    track = driver.track
    codes = track.codes - warm_codes
    checks += [
        Check("alive", all(f.alive and f.pid_end == f.pid_start and f.epoch_end == f.epoch_start
                           for f in ranks),
              "; ".join(f"rank {f.rank}: pid {f.pid_start}->{f.pid_end} "
                        f"{'alive' if f.alive else 'DEAD'}, epoch {f.epoch_start}->{f.epoch_end}"
                        for f in ranks)),
        Check("rss_drift", all(f.drift < cfg.rss_drift for f in ranks),
              "; ".join(f"rank {f.rank}: {f.rss_base_kib} -> {f.rss_end_kib} KiB "
                        f"({f.drift:+.1%}, limit {cfg.rss_drift:.0%})" for f in ranks)),
        Check("replies", track.unanswered == 0 and track.duplicates == 0
              and track.undecodable == 0 and track.bad_reply_mac == 0,
              f"{track.unanswered} required replies missing, {track.duplicates} duplicates, "
              f"{track.undecodable} undecodable, {track.bad_reply_mac} with a bad mac "
              f"({track.maybe_replies} optional replies: batch tasks, refused tcp:// "
              f"messages; {track.unexpected} under ids nobody predicted, e.g. bit-flipped "
              f"batch task ids)"),
        Check("no_exec_failures", track.exec_failure_count == 0
              and not any(f.tracebacks for f in ranks),
              f"{track.exec_failure_count} INTERNAL_ERROR/TRANSFER_FAILED replies, "
              f"{sum(f.tracebacks for f in ranks)} tracebacks in daemon logs"),
        Check("no_leaks", not leaks, ", ".join(leaks) or "no shm object, run dir or process left"),
    ]
    if crashed:
        checks.append(Check("no_crash", False, "; ".join(f"rank {c['rank']}: {c['exit_status']}"
                                                         for c in crashed)))
        checks.append(Check("ping", False, "not run: a daemon died or hung"))
    return TransportRun(
        transport=name, namespace=namespace, tp=cfg.tp, messages=driver.sent,
        duration_s=round(duration, 2), rate_per_s=round(driver.sent / duration, 1),
        kinds=dict(driver.kinds), auth=dict(driver.auth), codes=dict(codes),
        replies=track.replies - warm_replies, required_replies_missing=track.unanswered,
        unanswered_samples=track.unanswered_samples, duplicates=track.duplicates,
        duplicate_samples=track.duplicate_samples,
        undecodable_replies=track.undecodable, bad_reply_mac=track.bad_reply_mac,
        exec_failures=track.exec_failure_count, exec_failure_samples=track.exec_failures,
        stalls=driver.stalls, stall_notes=driver.stall_notes[:8],
        ping_s=None if ping_s is None else round(ping_s, 4), ranks=ranks,
        leaks=leaks, checks=checks, crashed_after=crashed)


def run_stress(cfg: StressConfig) -> StressReport:
    """Launch, fuzz, check and tear down one namespace per transport, one after another."""
    runs = []
    work = Path(tempfile.mkdtemp(prefix="kvswap-fuzz-"))
    try:
        for i, name in enumerate(cfg.transports):
            if name not in ("ipc", "tcp"):
                raise ValueError(f"unknown transport {name!r} (ipc or tcp)")
            runs.append(_run_transport(cfg, name, cfg.seed * 1000 + i, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return StressReport(cfg.seed, cfg.messages, runs)


# =========================================================================== CLI


def format_report(rep: StressReport) -> str:
    lines = []
    for run in rep.runs:
        lines.append(f"{run.transport}: {run.messages} messages in {run.duration_s:.1f}s "
                     f"({run.rate_per_s:.0f}/s), tp {run.tp}, {run.replies} replies, "
                     f"{run.stalls} stalls")
        lines.append("  kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(run.kinds.items())))
        if run.auth:
            lines.append("  tcp framing: " + ", ".join(f"{k} {v}"
                                                     for k, v in sorted(run.auth.items())))
        lines.append("  codes: " + ", ".join(f"{k} {v}" for k, v in
                                             sorted(run.codes.items(), key=lambda kv: -kv[1])))
        for f in run.ranks:
            lines.append(f"  rank {f.rank} pid {f.pid_start}: RSS launch {f.rss_launch_kib} KiB, "
                         f"start {f.rss_start_kib}, baseline {f.rss_base_kib}, peak "
                         f"{f.rss_peak_kib}, end {f.rss_end_kib} ({f.drift:+.1%} of the "
                         f"baseline; {(f.rss_end_kib - f.rss_start_kib) / f.rss_start_kib:+.1%} "
                         f"of the start); log {f.log_lines} lines, {f.log_bytes} bytes")
        for c in run.checks:
            lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        for s in run.unanswered_samples:
            lines.append(f"    unanswered: {json.dumps(s)}")
        for s in run.exec_failure_samples:
            lines.append(f"    exec failure: {json.dumps(s)}")
        for s in run.duplicate_samples:
            lines.append(f"    duplicate reply: {json.dumps(s)}")
        for note in run.stall_notes:
            lines.append(f"    stall: {note}")
        for c in run.crashed_after:
            lines.append(f"    rank {c['rank']}: {c['exit_status']}; last cases sent to it:")
            for d in c["last_cases"]:
                lines.append(f"      {json.dumps(d)}")
    lines.append(f"fuzz_stress: {'PASS' if rep.ok else 'FAIL'} (seed {rep.seed})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fuzz_stress",
        description="Send N seeded hostile messages to a live namespace over ipc:// and signed "
                    "tcp://, then check the daemons still serve, kept their pids, did not grow, "
                    "answered what they must, and left nothing behind (docs/operations.md).")
    p.add_argument("--messages", type=int, default=100_000, help="messages per transport")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("ipc", "tcp", "both"), default="both")
    p.add_argument("--tp", type=int, default=2, help="ranks of the namespace under test")
    p.add_argument("--window", type=int, default=256,
                   help="replies that must come, outstanding at most (default 256)")
    p.add_argument("--warmup", type=int, default=300,
                   help="valid messages before the RSS baseline (default 300)")
    p.add_argument("--max-frame-bytes", type=int, default=2 << 20,
                   help="the daemons' frame limit for the run, set through kvswapd "
                        "--max-device-blocks (default 2 MiB, so frames past it stay cheap; must "
                        "exceed the 1 MiB header limit)")
    p.add_argument("--kinds", default=",".join(KIND_WEIGHTS),
                   help="comma-separated case kinds to send (default all: "
                        + ", ".join(KIND_WEIGHTS) + ")")
    p.add_argument("--no-storage", action="store_true",
                   help="no file:// storage tier (backup/prefetch/exists then stop at "
                        "STORAGE_ERROR)")
    p.add_argument("--rss-drift", type=float, default=0.10,
                   help="largest allowed (end - start) / start RSS per daemon (default 0.10)")
    p.add_argument("--rss-settle", type=float, default=2 * TRIM_EVERY_S + 1,
                   help="seconds the baseline and end RSS are watched for their lowest sample "
                        f"(default {2 * TRIM_EVERY_S + 1:g}: two of the daemons' malloc_trim "
                        "periods; shorter measures allocator slack as growth)")
    p.add_argument("--stall-timeout", type=float, default=10.0,
                   help="seconds without any reply before pending replies count as lost")
    p.add_argument("--run-root", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the daemon logs here (DIR/logs-ipc/rank0.log, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.messages < 1 or args.tp < 1 or args.window < 1:
        print("fuzz_stress: --messages, --tp and --window must be positive", file=sys.stderr)
        return 2
    if args.max_frame_bytes <= MAX_HEADER_BYTES:
        print(f"fuzz_stress: --max-frame-bytes must exceed {MAX_HEADER_BYTES} (the header "
              f"limit), or oversized headers never reach the daemon", file=sys.stderr)
        return 2
    if not 0 < args.rss_settle <= 3600:
        print(f"fuzz_stress: --rss-settle must be in (0, 3600] seconds, got {args.rss_settle}",
              file=sys.stderr)
        return 2
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(KIND_WEIGHTS))
    if unknown or not kinds:
        print(f"fuzz_stress: unknown --kinds {unknown}; choose from {', '.join(KIND_WEIGHTS)}",
              file=sys.stderr)
        return 2
    cfg = StressConfig(
        kinds=kinds, messages=args.messages, seed=args.seed,
        transports=("ipc", "tcp") if args.transport == "both" else (args.transport,),
        tp=args.tp, window=args.window, warmup=args.warmup,
        max_frame_bytes=args.max_frame_bytes, storage=not args.no_storage,
        rss_drift=args.rss_drift, rss_settle_s=args.rss_settle,
        stall_timeout_s=args.stall_timeout, run_root=args.run_root,
        log_dir=args.log_dir,
        progress=lambda text: print(text, file=sys.stderr, flush=True))
    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGTERM, and SIGINT even where a shell started the run in the background with
    # SIGINT ignored: unwind, so the namespace is torn down on the way out.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        rep = run_stress(cfg)
    except KvswapError as exc:
        print(f"fuzz_stress: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fuzz_stress: interrupted; namespace torn down", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(rep.to_json(), indent=1, default=str))
    else:
        print(format_report(rep))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
