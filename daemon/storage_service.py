"""The storage tier's side of the daemon: admission of backup / prefetch / exists
(I/O thread), and their execution on the scheduler's storage worker: entry
names, staging buffers, checksum verification on a small thread pool, and the
cross-rank agreement a prefetch needs before it writes a host block.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence, TYPE_CHECKING

import numpy as np

from kvswap.client.block_keys import entry_name
from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import (
    Op,
    Request,
    decode_id_frame,
    decode_keys,
    validate_storage,
)
from kvswap.client.signals import RankSlot
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.jobs import Completion, Job
from kvswap.daemon.journal import JOURNALED_OPS
from kvswap.daemon.rank import RankContext
from kvswap.daemon.scheduler import Task
from kvswap.daemon.storage import (
    HEADER_BYTES,
    CorruptEntry,
    StorageBackend,
    open_backend,
    pack_entry,
    unpack_entry,
)

if TYPE_CHECKING:  # attachment imports this module
    from kvswap.daemon.attachment import Attachment, AttachmentSlot

log = logging.getLogger("kvswap.daemon")


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
        self._stage: np.ndarray | None = None  # storage worker: reusable staging
        self._reported_corrupt: set[str] = set()  # storage worker
        self._verifier = ThreadPoolExecutor(2, thread_name_prefix="kvswap-verify")

    def open(self) -> None:
        """Open the backend of ``--storage`` once (control thread); it is kept across
        clear/restore."""
        if self._backend is None:
            self._backend = open_backend(self._rank.cfg.storage_url)
            log.info("storage tier %s (model id %r)", self._rank.cfg.storage_url,
                     self._rank.cfg.model_id)

    def use_pool(self, blocks: Sequence[np.ndarray]) -> None:
        """The host pool that backups read and prefetches fill, registered with the
        backend (control thread); ``[]`` before the pool is unmapped."""
        if self._backend is not None:
            self._backend.register_buffers("host", list(blocks))

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
        assert job.keys is not None and self._backend is not None
        t_start = time.perf_counter_ns()
        try:
            names = [entry_name(k.tobytes(), self._rank.index, att.fingerprint)
                     for k in job.keys]
            if task.op is Op.EXISTS:
                fields = {"count": _leading(self._backend.contains(names))}
            elif task.op is Op.BACKUP:
                stored = self._backup(att, task.host_ids, names)
                fields = {"count": stored, "skipped": len(names) - stored}
            else:
                fields = {"count": self._prefetch(att, task, names)}
        except KvswapError as exc:
            return Completion(job, exc.code, exc.message, t_start, time.perf_counter_ns())
        except Exception as exc:  # a backend bug must cost one task, never the daemon
            log.exception("%s %s failed", task.op.value, job.req_id)
            return Completion(job, ErrorCode.STORAGE_ERROR, f"{type(exc).__name__}: {exc}",
                              t_start, time.perf_counter_ns())
        return Completion(job, ErrorCode.OK, "", t_start, time.perf_counter_ns(), fields=fields)

    def _staging(self, n: int, block_bytes: int) -> list[memoryview]:
        """Reusable buffers for ``n`` entries: reading into memory already faulted in
        is several times faster than a fresh buffer each."""
        size = HEADER_BYTES + block_bytes
        if self._stage is None or self._stage.shape[0] < n or self._stage.shape[1] != size:
            stage = np.empty((max(n, 1), size), dtype=np.uint8)
            assert self._backend is not None
            # a zero-copy store reads into registered memory: register before the old
            # buffer is freed (the backend then drops its registration of that one)
            self._backend.register_buffers("staging", [stage])
            self._stage = stage
        return [memoryview(self._stage[i]) for i in range(n)]

    def _backup(self, att: "Attachment", host_ids: np.ndarray, names: list[str]) -> int:
        assert self._backend is not None
        present = self._backend.contains(names)
        blocks = att.swap.blocks
        items = [(name, pack_entry(att.fingerprint, [b[h] for b in blocks]))
                 for name, h, there in zip(names, host_ids.tolist(), present) if not there]
        return sum(self._backend.put(items)) if items else 0

    def _read_verified(self, att: "Attachment", names: list[str]) -> list[memoryview]:
        """The payloads of the longest prefix of ``names`` stored intact here.  A
        corrupt entry ends the prefix and is deleted; a store that fails raises."""
        backend = self._backend
        assert backend is not None
        raws = backend.get(names, self._staging(len(names), att.block_bytes)) if names else []
        end = next((i for i, raw in enumerate(raws) if raw is None), len(raws))

        def check(raw: memoryview) -> memoryview | CorruptEntry:
            try:
                return unpack_entry(raw, att.fingerprint, att.block_bytes)
            except CorruptEntry as exc:
                return exc

        # checksums on two threads (zlib releases the GIL); keep the intact prefix
        verified = []
        for name, result in zip(names, self._verifier.map(check, raws[:end])):
            if isinstance(result, CorruptEntry):
                if name not in self._reported_corrupt and len(self._reported_corrupt) < 100_000:
                    self._reported_corrupt.add(name)
                    # names are entry_name()'s hex and digits, never a peer's raw text
                    log.warning("storage entry %s is unusable (%s); treated as a miss and "
                                "deleted", name, result)
                # stores never overwrite (a backup skips existing names): remove it so
                # the block can be backed up again
                backend.delete([name])
                break
            verified.append(result)
        return verified

    def _prefetch(self, att: "Attachment", task: Task, names: list[str]) -> int:
        """Load the longest prefix every rank holds intact; return its length.

        Each rank reads and verifies its leading entries into a staging area,
        stopping at the first missing or corrupt one (never used).  Round 0 agrees
        on the minimum verified count; round 1 commits it (a rank may still cancel
        or give up while waiting in round 0, never after posting round 1).  Only
        then does each rank copy exactly that many into its host blocks."""
        rank = self._rank
        task_id = task.ctx.req_id

        def cancelled() -> bool:
            return task.cancel_requested or rank.stopping.is_set()

        timeout = rank.cfg.storage_timeout_s
        try:
            verified = self._read_verified(att, names)
        except BaseException:
            # The peers wait for this rank's round 0: tell them now, not at their timeout.
            rank.agreement.abort(task_id, last_round=1)
            raise
        agreed = rank.agreement.agree(task_id, 0, len(verified), timeout, cancelled,
                                      last_round=1)
        final = rank.agreement.agree(task_id, 1, agreed, timeout, cancelled, last_round=1)
        for host, payload in zip(task.host_ids.tolist()[:final], verified):
            for i, off, nbytes in att.tensor_spans:
                att.swap.blocks[i][host] = np.frombuffer(payload, np.uint8, nbytes, off)
        return final
