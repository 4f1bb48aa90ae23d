"""Per-rank transfer scheduling: hazard ordering, priorities, merging, cancellation.

Evicts and loads run concurrently on a pool of worker threads, but two tasks
whose device-block sets or host-block sets overlap always run in the order the
rank admitted them (read-after-write, write-after-read and write-after-write,
whatever their directions).  Independent tasks never wait for each other.

How: the scheduler remembers, for every device block and every host block, the
last admitted task that touched it.  A new task depends on the unfinished ones
among those; it becomes READY when they have all finished.  Depending only on
the *last* toucher of each block is enough, because that task itself waited for
every earlier toucher (ordering is transitive).

READY tasks wait in one heap per direction.  A free worker takes loads before
evicts (loads are on a request's critical path), higher ``priority`` first,
then admission order.  With merging on, it also takes further READY tasks of
the same direction (up to ``max_merge_blocks``) and runs them as one copy pass:
READY tasks never overlap each other or a running task, or one of them would be
waiting for the other.  Layer-wise loads are never merged (they publish
per-layer progress of their own).

Cancellation removes a task that has not started: it is answered CANCELLED at
once and changes nothing.  A READY one (nothing earlier left to wait for) leaves
the order at once, releasing its dependents as if it had finished.  A WAITING one
stays in the order as a no-op until its own predecessors have finished, and only
then releases its dependents: the transitivity above rests on each last toucher
having waited for every earlier one, so a task that depends only on the cancelled
one (its last toucher) must still wait for what the cancelled one waited for.
Released at the cancel, it ran before an earlier overlapping task it never saw
(evict A into host 0, then a load X from host 0, then an evict Y into host 0: X
cancelled while A waited let Y write host 0 before A).  A task that has started
always completes.

An *agreed* op (``OpSpec.agreed``: a prefetch, whose count every rank agrees
on) also waits for the previous agreed op, blocks or not.  The ranks' storage
workers then enter the agreements in the order the tasks were admitted, the same
on every rank for one client; otherwise a rank could take a later prefetch
first (another became ready sooner, or had a higher priority) and wait in its
agreement while its peer waits in the earlier one's, both until the timeout.

A *held* op (``OpSpec.held``: a peer receive) stays RUNNING after its worker
returns: its host blocks are written by another node, so the daemon calls
:meth:`Scheduler.finish` when the bytes have landed, or the receive was
cancelled or expired.  Until then every later task touching those blocks waits.
"""

from __future__ import annotations

import enum
import heapq
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.client.protocol import OPS, Lane, Op


class TaskState(enum.Enum):
    WAITING = "waiting"  # admitted, waits for earlier overlapping tasks
    READY = "ready"  # in a ready heap
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


NOT_STARTED = frozenset({TaskState.WAITING, TaskState.READY})  # may still be cancelled


@dataclass(eq=False)
class Task:
    seq: int
    op: Op
    device_ids: np.ndarray
    host_ids: np.ndarray
    priority: int = 0
    layerwise: bool = False
    ctx: Any = None  # the daemon's job (who to answer)
    state: TaskState = TaskState.WAITING
    cancel_requested: bool = False  # a running prefetch stops at its next agreement step
    # submit() returned it RUNNING to its caller, who runs it (never in a ready heap).
    # Set under the lock before submit returns and never changed: the caller must read
    # this, not ``state``, which a worker may set to RUNNING the moment submit returns.
    claimed: bool = False
    deps: int = 0
    dependents: list["Task"] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return int(self.device_ids.shape[0])

    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


RunBatch = Callable[[list[Task]], None]

# Which worker pool runs an op (its OpSpec.lane), and the order in which a free
# worker of that pool looks at the ready heaps: the lane's urgent ops (a request
# waits for them: loads, prefetches) before the others, each group in op-table
# order.  Derived from the op table, so that a new op states its lane once.
LANES: dict[str, tuple[Op, ...]] = {
    lane.value: tuple(sorted((op for op, spec in OPS.items() if spec.lane is lane),
                             key=lambda op: not OPS[op].urgent))
    for lane in (Lane.TRANSFER, Lane.STORAGE, Lane.PEER)
}


_TRANSFER_OPS = LANES["transfer"]


class Scheduler:
    """Owns the hazard table and the ready heaps; ``run_batch`` executes work.

    ``submit``/``cancel`` are called by the daemon's I/O thread, workers call
    ``run_batch`` outside the lock.  ``run_batch`` must not raise: it reports
    each task's outcome itself.
    """

    def __init__(self, num_device_blocks: int, num_host_blocks: int, run_batch: RunBatch,
                 workers: int = 2, merge: bool = True, max_merge_blocks: int = 4096,
                 storage_workers: int = 0, peer_workers: int = 0):
        """``workers`` threads run evicts and loads; ``storage_workers`` threads run
        backups, prefetches and exists (which take part in hazard ordering on host
        blocks like any task, but must not hold up copies while storage is slow);
        ``peer_workers`` threads run peer sends and arm peer receives (a send waits on
        the network, which must not hold up copies either)."""
        if workers < 1:
            raise ValueError("a scheduler needs at least one transfer worker")
        self._run_batch = run_batch
        self.merge = merge
        self.max_merge_blocks = max_merge_blocks
        self._dev_last = np.full(num_device_blocks, -1, dtype=np.int64)
        self._host_last = np.full(num_host_blocks, -1, dtype=np.int64)
        self._live: dict[int, Task] = {}  # seq -> task not yet DONE/CANCELLED, by seq
        self._agreed_last = -1  # seq of the last admitted ``OpSpec.agreed`` task
        self._ready: dict[Op, list[tuple[tuple[int, int], Task]]] = {
            op: [] for ops in LANES.values() for op in ops}
        self._seq = 0
        self._lock = threading.RLock()
        # One condition per lane on the one lock: a task made ready wakes one worker of
        # its lane, not every worker of every lane (each woken thread costs the GIL).
        self._wake = {lane: threading.Condition(self._lock) for lane in LANES}
        self._wake_of = {op: self._wake[lane] for lane, ops in LANES.items() for op in ops}
        self._stopping = False
        self.merged_batches = 0  # under the lock: batches of several tasks finished
        self._threads = [
            threading.Thread(target=self._worker, args=(lane,), name=f"{lane}-{i}", daemon=True)
            for lane, count in (("transfer", workers), ("storage", storage_workers),
                                ("peer", peer_workers))
            for i in range(count)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ I/O thread
    def submit(self, op: Op, device_ids: np.ndarray, host_ids: np.ndarray, *, priority: int = 0,
               layerwise: bool = False, ctx: Any = None, claim_if_alone: bool = False) -> Task:
        """Admit a task.  With ``claim_if_alone``, a task that is ready at once while no
        other task is ready is returned claimed (``Task.claimed``, RUNNING) instead of
        queued: the caller runs it itself (no hand-off to a worker) and then calls
        :meth:`finish`.  Nothing else is ready, so no ordering or priority question
        can arise.  Several tasks may be claimed before the first is finished; they
        never overlap (a task that overlaps a claimed one depends on it, so is not
        ready), so the caller may run them as one merged pass."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("scheduler is stopping")
            task = Task(self._seq, op, device_ids, host_ids, priority, layerwise, ctx)
            self._seq += 1
            small = device_ids.shape[0] + host_ids.shape[0] <= 32
            if small:
                # a few ids: scalar reads and writes of Python ints cost a fraction of
                # numpy's fancy indexing (3.4 us a call on the CI machine)
                dev, host = device_ids.tolist(), host_ids.tolist()
                dev_last, host_last = self._dev_last, self._host_last
                earlier = {dev_last.item(i) for i in dev}
                earlier.update([host_last.item(i) for i in host])
            else:
                prev = np.concatenate((self._dev_last[device_ids], self._host_last[host_ids]))
                # Only unfinished tasks matter; they are the newest, so a cheap compare
                # with the oldest of them (the first in ``_live``, which keeps admission
                # order) leaves a handful of values for a set.
                oldest = next(iter(self._live), self._seq)
                earlier = set(prev[prev >= oldest].tolist())
            if OPS[op].agreed:  # after the previous one, whatever its blocks
                earlier.add(self._agreed_last)
                self._agreed_last = task.seq
            live = self._live
            for s in earlier:
                before = live.get(s)
                if before is not None:
                    before.dependents.append(task)
                    task.deps += 1
            if small:
                for i in dev:
                    dev_last[i] = task.seq
                for i in host:
                    host_last[i] = task.seq
            else:
                self._dev_last[device_ids] = task.seq
                self._host_last[host_ids] = task.seq
            live[task.seq] = task
            if task.deps == 0:
                if claim_if_alone and not any(self._ready[op] for op in _TRANSFER_OPS):
                    task.state = TaskState.RUNNING
                    task.claimed = True
                else:
                    self._make_ready(task)
            return task

    def finish(self, batch: Sequence[Task]) -> None:
        """Mark a batch done and release its dependents (a batch of several tasks
        ran as one merged copy pass)."""
        with self._lock:
            if len(batch) > 1:
                self.merged_batches += 1
            for t in batch:
                t.state = TaskState.DONE
                self._release(t)

    def cancel(self, match: Callable[[Task], bool]) -> Task | None:
        """Cancel the first not-yet-started task for which ``match`` holds (see the
        module docstring: a WAITING one leaves the order only once its predecessors
        have finished)."""
        with self._lock:
            for task in self._live.values():
                if task.state in NOT_STARTED and match(task):
                    task.state = TaskState.CANCELLED  # lazily dropped from its ready heap
                    if task.deps == 0:
                        self._release(task)
                    return task
        return None

    def find(self, match: Callable[[Task], bool]) -> Task | None:
        with self._lock:
            return next((t for t in self._live.values() if match(t)), None)

    def ids_of(self, match: Callable[[Task], bool]) -> set[int]:
        """The request ids of the live tasks for which ``match`` holds."""
        with self._lock:
            return {t.ctx.req_id for t in self._live.values() if match(t)}

    def stop(self) -> list[Task]:
        """Stop taking work; return every task that has not started (now CANCELLED)
        so the caller can answer them.  Running batches finish; see :meth:`join`."""
        with self._lock:
            self._stopping = True
            dropped = [t for t in self._live.values()
                       if t.state in NOT_STARTED]
            for t in dropped:
                t.state = TaskState.CANCELLED
            for t in [t for t in self._live.values() if t.state is TaskState.CANCELLED]:
                del self._live[t.seq]  # the dropped, and cancelled ones still in the order
            for heap in self._ready.values():
                heap.clear()
            for cv in self._wake.values():
                cv.notify_all()
        return sorted(dropped, key=lambda t: t.seq)

    def join(self, timeout: float) -> bool:
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    @property
    def pending(self) -> int:
        """Tasks admitted and not finished (not those cancelled, answered already)."""
        with self._lock:
            return sum(t.state is not TaskState.CANCELLED for t in self._live.values())

    # ------------------------------------------------------------------ internals (lock held)
    def _make_ready(self, task: Task) -> None:
        task.state = TaskState.READY
        heapq.heappush(self._ready[task.op], (task.sort_key(), task))
        # One worker of the lane: it takes this task (and, merging, others ready); a
        # worker that is busy looks at the heaps again before it waits.
        self._wake_of[task.op].notify()

    def _release(self, task: Task) -> None:
        """``task`` is finished, or cancelled with nothing left to wait for: forget it
        and wake its dependents.  A dependent cancelled while it waited is released
        in turn once this was its last predecessor (a worklist: a chain of cancelled
        tasks must not recurse)."""
        todo = [task]
        while todo:
            t = todo.pop()
            self._live.pop(t.seq, None)
            for dep in t.dependents:
                dep.deps -= 1
                if dep.deps == 0:
                    if dep.state is TaskState.WAITING:
                        self._make_ready(dep)
                    elif dep.state is TaskState.CANCELLED:
                        todo.append(dep)
            t.dependents = []

    def _pop_ready(self, op: Op) -> Task | None:
        heap = self._ready[op]
        while heap:
            _, task = heapq.heappop(heap)
            if task.state is TaskState.READY:
                return task
        return None

    def _take(self, lane: str) -> list[Task]:
        first = None
        for op in LANES[lane]:
            first = self._pop_ready(op)
            if first is not None:
                break
        if first is None:
            return []
        batch = [first]
        if lane == "transfer" and self.merge and not first.layerwise:
            heap = self._ready[first.op]
            blocks = first.num_blocks
            while heap:
                _, nxt = heap[0]
                if nxt.state is not TaskState.READY:
                    heapq.heappop(heap)
                    continue
                if nxt.layerwise or blocks + nxt.num_blocks > self.max_merge_blocks:
                    break
                heapq.heappop(heap)
                batch.append(nxt)
                blocks += nxt.num_blocks
        for t in batch:
            t.state = TaskState.RUNNING
        return batch

    # ------------------------------------------------------------------ workers
    def _worker(self, lane: str) -> None:
        wake = self._wake[lane]
        while True:
            with wake:
                batch = self._take(lane)
                while not batch:
                    if self._stopping:
                        return
                    wake.wait()
                    batch = self._take(lane)
            self._run_batch(batch)
            self.finish([t for t in batch if not OPS[t.op].held])


def concat_ids(tasks: Sequence[Task]) -> tuple[np.ndarray, np.ndarray]:
    """Device and host ids of a merged batch, in task order."""
    if len(tasks) == 1:
        return tasks[0].device_ids, tasks[0].host_ids
    return (np.concatenate([t.device_ids for t in tasks]),
            np.concatenate([t.host_ids for t in tasks]))
