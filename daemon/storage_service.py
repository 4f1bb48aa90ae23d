"""The storage tier's side of the daemon: admission of backup / prefetch / exists
(I/O thread), and their execution on the scheduler's storage worker: entry
names (per part and model version, :mod:`.storage_entries`), staging buffers,
checksum verification on a small thread pool, the prefetch policies (when
reading stops) and the cross-rank agreement a prefetch needs before it writes a
host block.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvswap.client.errors import BarrierAborted, ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import (
    OPS,
    Op,
    PrefetchOptions,
    PrefetchPolicy,
    Request,
    check_model_version,
    decode_id_frame,
    decode_keys,
    validate_storage,
)
from kvswap.client.signals import RankSlot
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.jobs import Completion, Job
from kvswap.daemon.journal import JOURNALED_OPS
from kvswap.daemon.rank import RankContext
from kvswap.daemon.scheduler import NOT_STARTED, Task
from kvswap.daemon.storage.mooncake_buffers import address
from kvswap.daemon.storage_entries import EntryPart
from kvswap.daemon.storage import (
    HEADER_BYTES,
    CorruptEntry,
    NotAnEntry,
    StorageBackend,
    StorageError,
    open_backend,
    pack_entry,
    unpack_entry,
)

if TYPE_CHECKING:  # attachment imports this module
    from kvswap.daemon.attachment import Attachment, AttachmentSlot
    from kvswap.daemon.swap_space import HostSwapSpace

log = logging.getLogger("kvswap.daemon")

Part = tuple[EntryPart, bytes, list[str]]  # a part, its fingerprint, the names of the keys
_MAX_CHUNK = 64  # blocks read per round trip under a deadline policy
# Bytes read per round trip under wait_complete.  A store's batch call ends with a
# tail where its last transfers run alone: Mooncake over TCP read 128 entries of
# 256 KiB in 27.7 ms as one call, 38.3 ms as four, 50.2 ms as eight (the
# development VM), while checking those 32 MiB took 5-8 ms on two threads.  So
# chunks are large, and checks overlap reads only in prefetches past 64 MiB.
_READ_CHUNK_BYTES = 64 << 20
_CHECK_THREADS = 2  # the verifier's threads; a chunk's entries are checked in as many runs
# A backup packs and puts its entries a chunk at a time: at most this many bytes, and
# this many tensor views (the Python objects an entry holds, beside its bytes).
_PUT_CHUNK_BYTES = 64 << 20
_PUT_CHUNK_VIEWS = 1 << 14


@dataclass
class _Checks:
    """One chunk of a prefetch read into staging, its checks running: rows ``lo`` to
    ``lo + size`` of each part; per part, the runs checking its entries up to the
    first miss, in order, each the future of the first corrupt entry it found as
    (row in the chunk, error), or None."""

    lo: int
    size: int
    names: list[list[str]]
    ends: list[int]  # per part, the chunk's rows up to its first miss
    runs: list[list[Future]]


def _leading(flags: list[bool]) -> int:
    """Length of the prefix of True values."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


class StorageService:
    """Backup, prefetch and exists against the rank's storage backend."""

    def __init__(self, rank: RankContext, slot: "AttachmentSlot", exactly: ExactlyOnce):
        self._rank = rank
        self._slot = slot
        self._exactly = exactly
        # Opened by the control thread at the first attach, before the storage worker
        # exists; used by that worker; closed at teardown after it ended.
        self._backend: StorageBackend | None = None
        self._stage: dict[int, np.ndarray] = {}  # storage worker: reusable staging per part
        self._reported_corrupt: set[str] = set()  # storage worker
        self._verifier = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="kvswap-verify")

    def open(self) -> None:
        """Open the backend of ``--storage`` once (control thread); it is kept across
        clear/restore."""
        if self._backend is None:
            self._backend = open_backend(self._rank.cfg.storage_url)
            log.info("storage tier %s (model id %r, model version %r)",
                     self._rank.cfg.storage_url, self._rank.cfg.model_id,
                     self._rank.cfg.model_version)

    def attach(self, swap: "HostSwapSpace") -> None:
        """The pool just attached, which backups read and prefetches fill, registered
        with the backend (a ``PoolUser`` of the Registrar; control thread)."""
        if self._backend is not None:
            self._backend.register_buffers("host", list(swap.blocks))

    def detach(self) -> None:
        """The pool is about to be unmapped or kept unattached: release its registration."""
        if self._backend is not None:
            self._backend.register_buffers("host", [])

    def close(self) -> None:
        """Teardown, after the storage worker ended."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        self._verifier.shutdown(wait=True)

    # ---------------------------------------------------------------- I/O thread
    def admit(self, job: Job, req: Request | None) -> None:
        assert req is not None
        rank = self._rank
        origin = self._exactly.begin_admission(job, req.header)
        if origin is None:
            return
        if not rank.cfg.storage_url:
            raise KvswapError(f"rank {rank.index} has no storage tier (kvswapd --storage URL)",
                              ErrorCode.STORAGE_ERROR)
        att = self._slot.current
        assert att is not None  # READY implies attached
        n = req.header["n"]
        if "mv" in req.header:
            check_model_version(req.header["mv"])
        if req.op is Op.PREFETCH:
            PrefetchOptions.from_header(req.header)  # refused here, before anything runs
        if req.op is Op.EXISTS:
            validate_storage(req.op, None, n, att.num_host_blocks)  # the keys per message
            host = np.empty(0, dtype=np.int64)
            job.keys = decode_keys(req.frames[0], n)
        else:
            if "ids" not in req.header or not isinstance(req.header["ids"], str):
                raise InvalidTask(f"{req.op.value}: missing field 'ids'", ErrorCode.BAD_FIELD)
            host = decode_id_frame(req.frames[0], req.header["ids"], "host ids")
            job.keys = decode_keys(req.frames[1], n)
            validate_storage(req.op, host, n, att.num_host_blocks)
        no_devices = np.empty(0, dtype=np.int64)
        if req.op in JOURNALED_OPS:  # exists changes nothing: running it twice is harmless
            self._exactly.admit(job, origin, no_devices, host, keys=job.keys)
        rank.sig.add(RankSlot.INFLIGHT, 1)
        att.scheduler.submit(req.op, no_devices, host,
                             priority=int(req.header.get("priority", 0)), ctx=job)

    # ---------------------------------------------------------------- storage worker
    def execute(self, task: Task, att: "Attachment") -> Completion:
        """Run one backup / prefetch / exists; never raises."""
        job = task.ctx
        assert job.keys is not None and self._backend is not None and att.entries is not None
        t_start = time.perf_counter_ns()
        try:
            # the request's model version (TransferClient.set_model_version), else the launch's
            version = job.header.get("mv", self._rank.cfg.model_version)
            parts = att.entries.names(job.keys, version)
            if task.op is Op.EXISTS:
                present = [self._backend.contains(names) for _, _, names in parts]
                fields = {"count": _leading([all(p) for p in zip(*present)])}
            elif task.op is Op.BACKUP:
                self._exactly.require_evicted(job.header.get("after"))
                stored = self._backup(att, task.host_ids, parts)
                fields = {"count": stored, "skipped": len(job.keys) - stored}
            else:
                fields = {"count": self._prefetch(att, task, parts)}
        except KvswapError as exc:
            return Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
        except Exception as exc:  # a backend bug must cost one task, never the daemon
            log.exception("%s %s failed", task.op.value, job.req_id)
            return Completion(job, ErrorCode.STORAGE_ERROR, f"{type(exc).__name__}: {exc}",
                              t_start, time.perf_counter_ns())
        return Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(), fields=fields)

    def _staging(self, part: int, n: int, payload_bytes: int) -> np.ndarray:
        """Reusable rows for ``n`` entries of one part (an entry's header, then its
        payload): reading into memory already faulted in is several times faster than
        a fresh buffer each."""
        size = HEADER_BYTES + payload_bytes
        stage = self._stage.get(part)
        if stage is None or stage.shape[0] < n or stage.shape[1] != size:
            stage = np.empty((max(n, 1), size), dtype=np.uint8)
            assert self._backend is not None
            # a zero-copy store reads into registered memory: register before the old
            # buffer is freed (the backend then drops its registration of that one)
            self._backend.register_buffers(
                "staging", [*(s for p, s in self._stage.items() if p != part), stage])
            self._stage[part] = stage
        return stage

    def _backup(self, att: "Attachment", host_ids: np.ndarray, parts: list[Part]) -> int:
        """Store the parts this rank writes; return how many blocks got a new entry.  A
        rank with no part to write (every tensor replicated, rank > 0) returns every
        block: rank 0 stores them for it."""
        backend, entries = self._backend, att.entries
        assert backend is not None and entries is not None
        mine = [(part, fp, names) for part, fp, names in parts if entries.writes(part)]
        if not mine:
            return len(host_ids)
        blocks = att.swap.blocks
        fresh = np.zeros(len(host_ids), dtype=bool)
        for part, fp, names in mine:
            todo = [j for j, there in enumerate(backend.contains(names)) if not there]
            # entries are packed and put a chunk at a time: an entry holds a header and a
            # view per tensor (~750 bytes of Python objects each), so a backup of every
            # block of a 64-tensor pool packed at once held ~48 KB per key, 100x its data
            step = max(1, min(_PUT_CHUNK_BYTES // (HEADER_BYTES + part.payload_bytes),
                              _PUT_CHUNK_VIEWS // len(part.spans)))
            for lo in range(0, len(todo), step):
                chunk = todo[lo:lo + step]
                items = [(names[j], pack_entry(fp, names[j], [blocks[i][int(host_ids[j])]
                                                              for i, _, _ in part.spans]))
                         for j in chunk]
                fresh[[j for j, ok in zip(chunk, backend.put(items)) if ok]] = True
        return int(fresh.sum())

    def _prefetch(self, att: "Attachment", task: Task, parts: list[Part]) -> int:
        """Load the longest prefix every rank holds intact; return its length.

        Each rank reads and verifies its leading blocks (every part of each) into
        staging rows, stopping at the first missing or corrupt entry (never used)
        or, under a deadline policy, at the deadline.  Round 0 agrees on the
        minimum verified count; a count below the request's ``min`` becomes 0;
        round 1 commits it (a rank may still cancel or give up while waiting in
        round 0, never after posting round 1).  Only then does each rank copy
        exactly that many into its host blocks."""
        rank, job = self._rank, task.ctx
        opts = PrefetchOptions.from_header(job.header)
        n = len(job.keys)
        if n == 0 or n < opts.min_blocks:  # the same decision on every rank: no agreement
            return 0
        task_id = job.req_id

        def cancelled() -> bool:
            return task.cancel_requested or rank.stopping.is_set()

        def queued_here() -> set[int]:  # the agreed tasks admitted here, not yet run
            return att.scheduler.ids_of(lambda t: OPS[t.op].agreed
                                        and t.state in NOT_STARTED)

        timeout = rank.cfg.storage_timeout_s

        def give_up() -> None:
            # the peers stop waiting for this rank at once; this rank then waits (at most
            # the storage timeout) until they have reached the task, so that it never runs
            # so far ahead that its ring overwrites a mark they have yet to read
            # (agreement.py, "The ring is never overrun")
            rank.agreement.abort(task_id, last_round=1, timeout=timeout, cancelled=cancelled,
                                 queued_here=queued_here)

        gave_up = rank.agreement.gave_up(task_id)
        if gave_up is not None:  # it gave way to a crossed task, or its store failed
            give_up()
            raise BarrierAborted(f"agreement on task {task_id}: rank {gave_up} gave up before "
                                 f"this rank began (see its reply)")
        deadline = (None if opts.timeout is None
                    else job.t_recv + int(opts.timeout * 1e9))  # perf_counter_ns
        stages = [self._staging(j, n, part.payload_bytes) for j, (part, _, _) in enumerate(parts)]
        try:
            verified = self._read_verified(parts, stages, opts.policy, deadline, cancelled)
        except BaseException:
            give_up()
            raise

        agreed = rank.agreement.agree(task_id, 0, verified, timeout, cancelled, last_round=1,
                                      queued_here=queued_here)
        if agreed < opts.min_blocks:
            agreed = 0
        final = rank.agreement.agree(task_id, 1, agreed, timeout, cancelled, last_round=1)
        if final:
            hosts = task.host_ids[:final]

            def gather(span: tuple[np.ndarray, int, int, int]) -> None:
                stage, i, off, nbytes = span  # numpy leaves the GIL for the copy
                att.swap.blocks[i][hosts] = stage[:final, HEADER_BYTES + off:
                                                  HEADER_BYTES + off + nbytes]

            # one gather per tensor (not per block), on the verifier's two threads
            list(self._verifier.map(gather, [(stage, *span) for (part, _, _), stage
                                             in zip(parts, stages) for span in part.spans]))
        return final

    def _read_verified(self, parts: list[Part], stages: list[np.ndarray],
                       policy: PrefetchPolicy, deadline: int | None,
                       cancelled: Callable[[], bool]) -> int:
        """How many leading blocks were read into the staging rows (``stages``: one
        array per part) and verified intact.

        Reading goes in chunks, and a chunk is verified on the verifier's threads
        while the next one is read (the store's calls and the checksums both leave
        the GIL), so on a host with cores to spare the checks hide behind the reads
        (on the two-CPU development VM the reads slow down by as much: no gain there,
        docs/storage.md section 7).
        ``wait_complete`` reads chunks of :data:`_READ_CHUNK_BYTES`.  The other
        policies read chunks of 1, 2, 4 ... 64 blocks (few round trips, yet an early
        block is not held up by a late one); a chunk that ends past the deadline is
        dropped with everything after it, and ``best_effort`` also ends at a store
        error, keeping the chunks verified before.  Reading stops at the first chunk
        with a missing or corrupt entry, and at a cancel (the agreement then answers
        CANCELLED)."""
        backend = self._backend
        assert backend is not None
        n = len(parts[0][2])
        good = 0  # blocks verified intact so far
        checking: _Checks | None = None  # the chunk read last, its checks running
        size = 1
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            size = max(1, _READ_CHUNK_BYTES // sum(HEADER_BYTES + part.payload_bytes
                                                   for part, _, _ in parts))
        lo = 0
        try:
            while lo < n and not cancelled():
                hi = min(n, lo + size)
                try:
                    raws = [backend.get(names[lo:hi], [memoryview(r) for r in stage[lo:hi]])
                            for (_, _, names), stage in zip(parts, stages)]
                except StorageError as exc:
                    if policy is not PrefetchPolicy.BEST_EFFORT:
                        raise
                    log.warning("best-effort prefetch ends at block %d of %d: %s", lo, n, exc)
                    break
                if checking is not None:
                    intact, checking = self._intact(checking), None
                    good += intact
                    if good < lo:  # the previous chunk ended early: this one is not used
                        break
                if deadline is not None and time.perf_counter_ns() > deadline:
                    break  # read too late: not used, and not judged either
                checking = self._check(parts, stages, lo, raws)
                lo = hi
                if policy is not PrefetchPolicy.WAIT_COMPLETE:
                    size = min(2 * size, _MAX_CHUNK)
        finally:
            if checking is not None:  # also on the way out of an error: no check outlives us
                good += self._intact(checking)
        return good

    def _check(self, parts: list[Part], stages: list[np.ndarray], lo: int,
               raws: list[list]) -> "_Checks":
        """Start the checks of one chunk (``raws``: each part's entries as read, rows
        ``lo`` on of its staging area) on the verifier's threads, in one run of
        consecutive entries per thread (a task per entry cost more than its checksum:
        128 entries of 256 KiB took 7-8 ms as 128 tasks, 3.6 ms on one thread).  An
        entry the backend returned elsewhere (a store that cannot read in place) is
        copied into its row first, so every verified payload is where the commit
        gathers it from."""

        def check(part: EntryPart, fp: bytes, names: list[str], first: int, got: list,
                  stage: np.ndarray) -> tuple[int, CorruptEntry] | None:
            for i, raw in enumerate(got, first):
                if isinstance(raw, NotAnEntry):  # e.g. a Redis list under the name
                    return i, CorruptEntry(raw.reason)
                view, row = memoryview(raw), stage[lo + i]
                if view.nbytes <= row.nbytes and address(view)[0] != row.ctypes.data:
                    row[:view.nbytes] = np.frombuffer(view, np.uint8)
                    view = memoryview(row)[:view.nbytes]
                try:
                    unpack_entry(view, fp, names[lo + i], part.payload_bytes)
                except CorruptEntry as exc:
                    return i, exc
            return None

        ends, runs = [], []
        for (part, fp, names), stage, got in zip(parts, stages, raws):
            end = next((i for i, raw in enumerate(got) if raw is None), len(got))
            step = max(1, -(-end // _CHECK_THREADS))
            ends.append(end)
            runs.append([self._verifier.submit(check, part, fp, names, first,
                                               got[first:min(end, first + step)], stage)
                         for first in range(0, end, step)])
        return _Checks(lo, len(raws[0]), [names for _, _, names in parts], ends, runs)

    def _intact(self, checks: "_Checks") -> int:
        """How many leading blocks of a checked chunk are intact in every part (waits
        for its checks).  A corrupt entry is reported once and deleted."""
        backend = self._backend
        assert backend is not None
        # every run ends before this returns: none may touch staging after the prefetch
        found = [[run.result() for run in runs] for runs in checks.runs]
        intact = checks.size
        for names, end, corrupt in zip(checks.names, checks.ends, found):
            ok = end
            for hit in corrupt:
                if hit is not None:
                    i, error = hit
                    name = names[checks.lo + i]
                    if (name not in self._reported_corrupt
                            and len(self._reported_corrupt) < 100_000):
                        self._reported_corrupt.add(name)
                        # names are entry_name()'s hex and digits, never a peer's raw text
                        log.warning("storage entry %s is unusable (%s); treated as a miss "
                                    "and deleted", name, error)
                    # stores never overwrite (a backup skips existing names): remove it
                    # so the block can be backed up again
                    backend.delete([name])
                    ok = i
                    break
            intact = min(intact, ok)
        return intact
