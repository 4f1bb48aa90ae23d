"""Exactly-once execution across daemon crashes, through the completion journal.

A task is journalled when it is admitted and its outcome when it ends, before
its dependents are released and before its reply is sent (why that order makes
re-sends safe: daemon/journal.py).  A re-sent task is answered from the record
of an earlier incarnation; tasks a crash interrupted are replayed, in admission
order, before the rank reports READY again, or recorded OUTCOME_UNKNOWN when
they cannot be.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import Op, validate_transfer
from kvswap.daemon import crashpoints
from kvswap.daemon.io_loop import IoLoop
from kvswap.daemon.jobs import Completion, Job, Origin
from kvswap.daemon.journal import JOURNALED_OPS, UNREPLAYABLE_OPS, Journal, Outcome
from kvswap.daemon.rank import RankContext
from kvswap.daemon.scheduler import Task

log = logging.getLogger("kvswap.daemon")

Execute = Callable[[list[Task]], list[Completion]]


class ExactlyOnce:
    """The rank's completion journal (opened at start, adopting the one a crashed
    predecessor left) and the rules for using it."""

    def __init__(self, rank: RankContext, journal: Journal, io: IoLoop):
        self._rank = rank
        # admit/lookup: I/O thread; finish: whichever thread ended the task (the journal
        # serialises them itself); replay: control thread before READY.
        self._journal = journal
        self._io = io

    def begin_admission(self, job: Job, header: dict) -> Origin | None:
        """The checks every scheduled op's admission starts with (I/O thread): the
        epochs it was addressed to, a serving rank, then a re-send the journal
        answers.  Returns the sender's origin, or None when the re-send was answered
        from the journal and there is nothing left to admit."""
        self._rank.check_epoch(header)
        origin = Origin.of(header)
        resent = job.op in JOURNALED_OPS and origin.resent
        if resent and self.answer_recorded(job):
            return None
        self._rank.check_serving()
        if resent and self.answer_resent(job, origin):
            return None
        return origin

    def require_evicted(self, evict_id: int | None) -> None:
        """A write-through backup (``after``: its evict; None: not one) runs only if that
        evict succeeded on this rank, else CANCELLED: cancelled or failed, it left the
        host blocks holding their old bytes, which must never be stored under the new
        keys (other nodes would load them).  Hazard ordering runs the backup after the
        evict, so its outcome is journalled by now; no record (dropped, or never
        admitted here) is no proof."""
        if evict_id is None:
            return
        found = self._journal.lookup(evict_id)
        outcome = None if found is None else found[1]
        if outcome is None or outcome.code != ErrorCode.OK:
            why = ("has no outcome on this rank" if outcome is None else
                   f"ended {outcome.code.name} on this rank")
            raise KvswapError(f"backup not run: the evict it backs up (task {evict_id}) "
                              f"{why}; its host blocks do not hold the bytes of these keys",
                              ErrorCode.CANCELLED)

    def answer_recorded(self, job: Job) -> bool:
        """A re-sent task whose outcome an earlier incarnation recorded: answer it from
        the record and return True (I/O thread), whatever mode the rank is in now.  A
        rank restarted into a paused namespace comes back PAUSED with the held re-sends
        still to answer: refusing one PAUSED would say it never ran, and it did."""
        found = self._journal.lookup(job.req_id)
        if found is None or found[1] is None:
            return False
        self._reply_recorded(job, found[1])
        return True

    def admit(self, job: Job, origin: Origin, device_ids: np.ndarray, host_ids: np.ndarray, *,
              layerwise: bool = False, keys: np.ndarray | None = None) -> None:
        """Journal an admitted task (I/O thread); its record is ``job.jseq``."""
        job.jseq = self._journal.admit(job.req_id, job.op, device_ids, host_ids,
                                       layerwise=layerwise, keys=keys, cid=origin.cid,
                                       cs=origin.cs)

    def record(self, c: Completion) -> None:
        """Journal a task's outcome.  Called before its dependents are released and
        before its reply is sent: that order is what makes re-sends safe."""
        if c.job.jseq is not None:
            crashpoints.hit("record.before")
            self._journal.finish(c.job.jseq, c.code, c.message, c.fields)

    def settle(self, c: Completion) -> None:
        """Journal a completion and hand it to the I/O thread (any thread)."""
        self.record(c)
        self._io.complete(c)

    def answer_resent(self, job: Job, origin: Origin) -> bool:
        """A re-sent task (I/O thread): answer it from the journal if an earlier
        incarnation admitted it and return True; False if it was never admitted
        here, so it runs now like a new task."""
        found = self._journal.lookup(job.req_id)
        index = self._rank.index
        if found is None:
            if self._journal.forgotten(origin.cid, origin.cs):
                raise KvswapError(
                    f"task {job.req_id} was re-sent after a restart, and rank {index}'s "
                    f"completion journal no longer holds records that old, so whether it ran "
                    f"cannot be proved; its destination blocks hold unknown content: submit a "
                    f"new task if its source still holds what you want", ErrorCode.OUTCOME_UNKNOWN)
            return False
        state, outcome = found
        if outcome is None:
            raise InvalidTask(f"task {job.req_id} was re-sent while it is still running on rank "
                              f"{index}; it is answered once", ErrorCode.INVALID_TASK)
        self._reply_recorded(job, outcome)
        return True

    def _reply_recorded(self, job: Job, outcome: Outcome) -> None:
        fields = outcome.fields if outcome.code == ErrorCode.OK else {}
        self._io.reply(job.route, job.req_id, outcome.code, outcome.message,
                       fields={**fields, "journal": True})

    def replay_in_doubt(self, num_device_blocks: int, num_host_blocks: int,
                        execute: Execute) -> None:
        """Control thread, after re-attaching and before READY: finish the tasks a
        crash interrupted, in admission order (why that is safe: daemon/journal.py)."""
        for d in self._journal.in_doubt():
            job = Job(None, d.task_id, d.op, time.perf_counter_ns(), keys=d.keys)
            job.jseq = d.seq
            now = time.perf_counter_ns()
            if d.op in UNREPLAYABLE_OPS:
                done = Completion.now(job, ErrorCode.OUTCOME_UNKNOWN,
                                      f"a daemon crash interrupted this {d.op.value}, which other "
                                      f"ranks or nodes took part in; its host blocks hold "
                                      f"unknown content: run it again", now)
            elif d.op is Op.BACKUP:
                # Its entry names depend on the model version it was sent under, which
                # the journal does not hold: replaying it under the launch's version
                # could store new weights' blocks under an old version's names.  (The
                # journal keeps 66 characters of a message.)
                done = Completion.now(job, ErrorCode.OUTCOME_UNKNOWN,
                                      "backup not replayed after a crash: its model version "
                                      "is not kept", now)
            else:
                try:
                    validate_transfer(d.op, d.device_ids, d.host_ids, num_device_blocks,
                                      num_host_blocks)
                except KvswapError as exc:
                    done = Completion.now(job, ErrorCode.OUTCOME_UNKNOWN,
                                          f"cannot replay after a crash: {exc.message}", now)
                else:
                    task = Task(-1, d.op, d.device_ids, d.host_ids, layerwise=d.layerwise,
                                ctx=job)
                    (done,) = execute([task])
            self.record(done)
            log.warning("replayed %s %d, interrupted by a crash: [%d] %.200r", d.op.value,
                        d.task_id, done.code, done.message or "OK")

    def abandon_in_doubt(self) -> None:
        """A register of new tensors: tasks a crash interrupted cannot be replayed onto
        them; each is recorded OUTCOME_UNKNOWN so a re-send gets a clear answer."""
        for d in self._journal.in_doubt():
            self._journal.finish(d.seq, ErrorCode.OUTCOME_UNKNOWN,
                                 "interrupted by a daemon crash; the caches were registered "
                                 "anew, so it was not replayed")
            log.warning("%s %d, interrupted by a crash, not replayed onto new caches",
                        d.op.value, d.task_id)

    def close(self) -> None:
        """Close the journal; keep it for the next incarnation while a task is in doubt."""
        in_doubt = self._journal.admitted
        if in_doubt:
            log.error("%d task(s) never finished; keeping the completion journal for the "
                      "next incarnation", in_doubt)
        self._journal.close(unlink=not in_doubt)
