"""Numeric error codes and the exception hierarchy shared by client and daemon.

Every failure that crosses a process boundary travels as a numeric code (in a
reply frame or in the signal segment) and is turned back into one of the
exception classes below on the receiving side.  The codes are part of the wire
protocol (``docs/protocol.md``): never renumber one, only add.

Ranges:
    0        OK
    1xx      malformed traffic (protocol errors)
    2xx      a well-formed request that is invalid (rejected whole, nothing changed)
    3xx      the daemon's state does not allow the request now
    4xx      a transfer was accepted but did not complete (or the storage tier failed)
    5xx      something did not happen in time
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@enum.unique
class ErrorCode(enum.IntEnum):
    OK = 0

    PROTOCOL_ERROR = 100  # frame is not a msgpack map, or the header is unusable
    VERSION_MISMATCH = 101  # unknown major protocol version
    UNKNOWN_OP = 102
    BAD_FRAMES = 103  # missing or extra frames after the header
    BAD_FIELD = 104  # a header field is missing or has the wrong type
    MESSAGE_TOO_LARGE = 105
    AUTH_FAILED = 106  # tcp:// only: missing or wrong HMAC signature, or a replayed message

    INVALID_TASK = 200  # generic invalid request
    ID_OUT_OF_RANGE = 201  # block id < 0 or >= the number of blocks
    DUPLICATE_DESTINATION = 202  # a destination block named twice in one task
    LENGTH_MISMATCH = 203  # device and host id lists of different lengths
    BAD_ID_DTYPE = 204  # id frame dtype not int32/int64 little-endian, or size wrong
    BAD_LAYOUT = 205  # register: tensors inconsistent (dtype, shape, block counts)
    TICKET_MISMATCH = 206  # peer transfer: the ticket does not pair (TP size, layout, count, rank)
    TICKET_EXPIRED = 207  # peer transfer: the ticket's expiry has passed

    NOT_READY = 300  # caches not attached / swap space not ready
    SHUTTING_DOWN = 301
    ALREADY_REGISTERED = 302
    RANK_RESTARTED = 303  # the rank restarted since the client addressed it (epoch changed)
    PAUSED = 304  # transfers refused until resume
    CLEARED = 305  # caches released for a weight update; restore and re-register first
    JOURNAL_FULL = 306  # too many tasks admitted and not yet recorded; retry once some finish
    PEER_DISABLED = 307  # peer transfer asked of a daemon launched without --peer-transfer

    TRANSFER_FAILED = 400  # copy raised on the daemon
    CANCELLED = 401  # cancelled before it started (nothing was copied)
    INTERNAL_ERROR = 402  # the daemon hit an unexpected error on this request (see its log)
    STORAGE_ERROR = 403  # the storage tier (file directory, Redis, ...) is unreachable or failed
    OUTCOME_UNKNOWN = 404  # a re-sent task whose earlier run cannot be proved complete or absent

    RANK_TIMEOUT = 500  # a rank did not answer in time
    BARRIER_TIMEOUT = 501
    BARRIER_ABORTED = 502  # a barrier participant failed or stopped beating
    NAMESPACE_ERROR = 503  # namespace missing, in use, or unusable
    STORAGE_TIMEOUT = 504  # a storage tier call exceeded its timeout


class KvswapError(Exception):
    """Base of every kvswap error; ``code`` is its :class:`ErrorCode`."""

    default_code: ErrorCode = ErrorCode.INVALID_TASK

    def __init__(self, message: str, code: ErrorCode | int | None = None):
        super().__init__(message)
        self.code = ErrorCode(code) if code is not None else self.default_code
        self.message = message

    def __str__(self) -> str:
        return f"[{int(self.code)} {self.code.name}] {self.message}"


class ProtocolError(KvswapError):
    default_code = ErrorCode.PROTOCOL_ERROR


class InvalidTask(KvswapError, ValueError):
    """A request or an argument that is wrong whatever the daemons' state: bad block
    ids, a priority out of range, a non-bool flag, an unknown write policy.  Also a
    ``ValueError``, so argument checks can be caught the usual way."""

    default_code = ErrorCode.INVALID_TASK


class NotReady(KvswapError):
    default_code = ErrorCode.NOT_READY


class RankTimeout(KvswapError, TimeoutError):
    default_code = ErrorCode.RANK_TIMEOUT


class BarrierTimeout(RankTimeout):
    default_code = ErrorCode.BARRIER_TIMEOUT


class BarrierAborted(KvswapError):
    default_code = ErrorCode.BARRIER_ABORTED


class NamespaceError(KvswapError):
    default_code = ErrorCode.NAMESPACE_ERROR


class StorageError(KvswapError):
    """The storage tier behind host swap space failed: unreachable, I/O error, full.

    Raised by a storage backend for the whole call; entries of a batch written
    before the failure may be stored (``put`` is idempotent, so a retry skips them).
    """

    default_code = ErrorCode.STORAGE_ERROR


class StorageTimeout(StorageError, TimeoutError):
    """A storage call waited longer than its timeout for the backend."""

    default_code = ErrorCode.STORAGE_TIMEOUT


@dataclass(frozen=True)
class RankFailure:
    """One rank's negative reply to a task."""

    rank: int
    code: ErrorCode
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: [{int(self.code)} {self.code.name}] {self.message}"


class TransferFailed(KvswapError):
    """A task was refused or failed on one or more ranks.

    ``failures`` holds one :class:`RankFailure` per failing rank; ``code`` is the
    code of the lowest failing rank (they are usually all the same, e.g. an
    out-of-range id is rejected by every rank).
    """

    default_code = ErrorCode.TRANSFER_FAILED

    def __init__(self, task_id: int, op: str, failures: list[RankFailure]):
        self.task_id = task_id
        self.op = op
        self.failures = sorted(failures, key=lambda f: f.rank)
        detail = "; ".join(str(f) for f in self.failures)
        code = self.failures[0].code if self.failures else ErrorCode.TRANSFER_FAILED
        super().__init__(f"task {task_id} ({op}) failed: {detail}", code)


class RankRestarted(TransferFailed):
    """A rank restarted while the task was in flight, and its restarted daemon cannot
    prove whether the earlier incarnation ran the task (code ``OUTCOME_UNKNOWN`` in
    ``failures``): the task's destination blocks on that rank hold unknown content.

    ``TransferClient`` re-sends every task a restarted rank never answered, marked
    ``re`` (docs/protocol.md section 10), and the daemon answers a re-sent task from
    its completion journal, so a restart normally costs no task at all; this error is
    what is left when the journal has no answer."""

    default_code = ErrorCode.RANK_RESTARTED


_BY_RANGE: list[tuple[int, type[KvswapError]]] = [
    (100, ProtocolError),
    (200, InvalidTask),
    (300, NotReady),
    (400, KvswapError),
    (500, RankTimeout),
]


def code_name(code: int) -> str:
    """The name of a numeric code read from a signal slot or the wire (``AUTH_FAILED``),
    or ``unknown code`` for one this version does not know."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return "unknown code"


def error_for_code(code: int, message: str) -> KvswapError:
    """Rebuild the exception class that matches a numeric code from the wire."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return KvswapError(f"unknown error code {code}: {message}", ErrorCode.PROTOCOL_ERROR)
    special = {
        ErrorCode.BARRIER_TIMEOUT: BarrierTimeout,
        ErrorCode.BARRIER_ABORTED: BarrierAborted,
        ErrorCode.NAMESPACE_ERROR: NamespaceError,
        ErrorCode.STORAGE_ERROR: StorageError,
        ErrorCode.STORAGE_TIMEOUT: StorageTimeout,
    }
    cls = special.get(ec)
    if cls is None:
        cls = KvswapError
        for lo, c in _BY_RANGE:
            if lo <= ec < lo + 100:
                cls = c
    return cls(message, ec)
