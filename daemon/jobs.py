"""The records the daemon's parts hand each other: where a request came from
(:class:`Route`, :class:`Origin`), the request in flight (:class:`Job`), how it
ended (:class:`Completion`), and how an op is served (:class:`Handler`).

They carry no behaviour of their own, so every part of the daemon can import
them without importing another part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import zmq

from kvswap.client.errors import ErrorCode
from kvswap.client.layout import TensorDesc
from kvswap.client.protocol import OPS, HandlerKind, Lane, Op, Request

# Ops the storage worker runs; derived from the op table so that an op states its lane once.
STORAGE_OPS = frozenset(op for op, spec in OPS.items() if spec.lane is Lane.STORAGE)
# Ops the peer workers run (daemon/peer_ops.py), and how many peer workers a rank has
# with --peer-transfer: one push may wait on the network while another runs.
PEER_OPS = frozenset(op for op, spec in OPS.items() if spec.lane is Lane.PEER)
PEER_WORKERS = 2


class DaemonError(Exception):
    """Start-up failure; the daemon exits with status 2."""


@dataclass(frozen=True)
class Route:
    """Where a request came from: the socket, the peer's ROUTER identity, and whether
    the channel is signed (tcp://) so the reply must be too."""

    sock: zmq.Socket
    ident: bytes
    signed: bool = False


@dataclass
class Job:
    """One request between its admission and its reply."""

    route: Route | None  # where the reply goes; None for internal jobs
    req_id: int
    op: Op
    t_recv: int
    header: dict = field(default_factory=dict)
    tensors: list[TensorDesc] = field(default_factory=list)
    rejoin: bool = False  # a restarted daemon re-attaching its predecessor's caches
    replace: bool = False  # register replacing the attached tensors (an engine restart)
    keys: np.ndarray | None = None  # storage ops: (n, 32) block keys
    jseq: int | None = None  # the task's completion-journal record, once admitted


@dataclass(frozen=True)
class Origin:
    """Who sent a message and whether it is a re-send (protocol fields cid, cs, re)."""

    cid: int = 0
    cs: int = 0
    resent: bool = False

    @classmethod
    def of(cls, header: dict) -> "Origin":
        return cls(header.get("cid", 0), header.get("cs", 0), header.get("re", False))


@dataclass
class Completion:
    """How a job ended; the I/O thread counts it and answers it."""

    job: Job
    code: ErrorCode
    message: str
    t_start: int
    t_end: int
    nbytes: int = 0
    fields: dict = field(default_factory=dict)

    @classmethod
    def now(cls, job: Job, code: ErrorCode, message: str, t_ns: int,
            fields: dict | None = None) -> "Completion":
        """A job that ended the moment it started (refused, cancelled, answered by another)."""
        return cls(job, code, message, t_ns, t_ns, fields=fields or {})


@dataclass(frozen=True)
class Handler:
    """``run`` answers an INLINE op in the I/O thread (returning reply fields, or None
    when the reply comes later) or executes a SERIAL job on the control thread;
    TRANSFER ops have ``admit`` only, which validates in the I/O thread and hands the
    task to the scheduler."""

    run: Callable[[Job, Request | None], dict | None] | None = None
    admit: Callable[[Job, Request | None], None] | None = None
    # Its admission may leave tasks claimed for the I/O thread to copy at the end of the
    # burst (daemon/transfers.py); before a request of any other op they are copied.
    claims: bool = False


def check_handlers(handlers: dict[Op, Handler]) -> None:
    """Every op of the op table has a handler of the shape its kind needs."""
    for op, spec in OPS.items():
        h = handlers.get(op)
        shape = {HandlerKind.INLINE: (True, False), HandlerKind.SERIAL: (True, True),
                 HandlerKind.TRANSFER: (False, True)}[spec.kind]
        if h is None or (h.run is not None, h.admit is not None) != shape:
            raise AssertionError(f"handler table does not match the op table for {op}")
