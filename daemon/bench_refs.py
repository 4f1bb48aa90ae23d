"""Reference control planes that ``kvswap bench control`` measures kvswap against.

Two references, each running in processes of its own (started as
``python -m kvswap.daemon.bench_refs ROLE ...`` with the bench's interpreter, so
no fork of a process that already runs threads):

* **floor** (:class:`FloorRef`): one bare ZeroMQ ROUTER per rank on ``ipc://``
  that answers every request with a fixed reply at once, without decoding it,
  and a client that is one thread with one DEALER per rank: it encodes the
  request with :func:`~kvswap.client.protocol.encode_transfer`, sends it to
  every rank and reads one reply from each.  No I/O thread, no futures, no
  validation, no copy: the transport cost any design pays, i.e. the floor.
* **baseline** (:class:`BaselineRef`): the control plane of the reference
  design (FastDeploy's ``cache_transfer_manager``), written from its design,
  not its code: a ``multiprocessing.managers`` server holds the task queue and
  the cross-rank barriers; one process per rank polls the queue (rank 0 checks
  it and raises a broadcast flag in shared memory, every rank meets at a
  manager barrier, reads the task, and runs it on a thread pool between two
  more barriers); rank 0 writes the acknowledgement back through the manager;
  the engine polls for it with 1 ms sleeps.  Departures from the original, all
  in the baseline's favour or neutral: the manager listens on a Unix socket
  (the original uses TCP); barriers are cyclic and never ``reset()`` (saving the
  original's extra calls); and between its own measurement rounds the ranks
  are parked (sleeping on a shared-memory flag) so that their busy polling
  does not steal CPU from the other systems measured in the same run.

Each rank of both references counts the tasks it served and reports the count
when it exits, so the bench can check that every system ran the same work.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.managers import BaseManager
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from kvswap.client.protocol import Op, encode_reply, encode_transfer
from kvswap.client.shm_region import ShmRegion

REPLY_TIMEOUT_S = 30.0  # no wait of the references is unbounded
_STARTUP_TIMEOUT_S = 60.0
_AUTHKEY_ENV = "KVSWAP_BENCH_AUTHKEY"


class BenchError(Exception):
    """A benchmark could not measure what it claims (a reference failed, counts differ)."""


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system, every thread) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / _CLK_TCK


def measure_latencies_us(roundtrip: Callable[[int], None], start: int, n: int) -> list[float]:
    """Microseconds of ``n`` sequential round trips ``roundtrip(start + i)``."""
    out = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        roundtrip(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


# ====================================================================== child processes


class _Child:
    """A reference process: announces ``ready`` on stdout, and its count on exit."""

    def __init__(self, what: str, argv: list[str], env: dict[str, str] | None = None):
        self.what = what
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvswap.daemon.bench_refs", *argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise BenchError(f"{self.what}: no answer within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"{self.what} exited with status {self.proc.wait(5)}")
        return line.strip()

    def wait_ready(self) -> None:
        line = self._line(_STARTUP_TIMEOUT_S)
        if line != "ready":
            raise BenchError(f"{self.what}: expected 'ready', got {line!r}")

    def result(self) -> int:
        """The count the process prints when it exits (``served N``)."""
        line = self._line(REPLY_TIMEOUT_S)
        word, _, count = line.partition(" ")
        if word != "served" or not count.isdigit():
            raise BenchError(f"{self.what}: expected 'served N', got {line!r}")
        self.proc.wait(REPLY_TIMEOUT_S)
        return int(count)

    def stop(self) -> None:
        """End the process if it still runs (SIGTERM, then SIGKILL if it hangs)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# ====================================================================== floor

_FLOOR_STOP = b"stop"


def serve_floor(endpoint: str, rank: int) -> int:
    """Child: answer every request on ``endpoint`` at once with a fixed reply."""
    ctx = zmq.Context(1)
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    reply = encode_reply(0, rank)
    print("ready", flush=True)
    served = 0
    while True:
        frames = router.recv_multipart()
        if len(frames) == 2 and frames[1] == _FLOOR_STOP:
            break
        router.send_multipart([frames[0], reply])
        served += 1
    router.close(linger=0)
    ctx.term()
    return served


class FloorRef:
    """``tp`` echo servers and the single-threaded client that waits for all of them."""

    name = "floor"

    def __init__(self, tp: int, run_dir: str, blocks: int):
        self.tp = tp
        self._ids = np.arange(blocks, dtype="<i4")
        self._children: list[_Child] = []
        self._ctx = zmq.Context(1)
        self._dealers: list[zmq.Socket] = []
        self._closed = False
        try:
            endpoints = [f"ipc://{run_dir}/floor{r}.sock" for r in range(tp)]
            for r, ep in enumerate(endpoints):
                self._children.append(_Child(f"floor rank {r}", ["floor", ep, str(r)]))
            for child in self._children:
                child.wait_ready()
            for ep in endpoints:
                s = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.RCVTIMEO, int(REPLY_TIMEOUT_S * 1000))
                s.setsockopt(zmq.LINGER, 0)
                s.connect(ep)
                self._dealers.append(s)
        except BaseException:
            self._abort()
            raise

    def _send(self, i: int) -> None:
        b = i % self._ids.shape[0]
        frames = encode_transfer(Op.EVICT, i, self._ids[b:b + 1], self._ids[b:b + 1])
        for s in self._dealers:
            s.send_multipart(frames)

    def _recv_all(self) -> None:
        for r, s in enumerate(self._dealers):
            try:
                s.recv()
            except zmq.Again:
                raise BenchError(f"floor rank {r} did not answer within "
                                 f"{REPLY_TIMEOUT_S:.0f}s") from None

    def roundtrip(self, i: int) -> None:
        self._send(i)
        self._recv_all()

    def tasks_per_s(self, start: int, n: int, window: int) -> float:
        inflight = 0
        t0 = time.perf_counter()
        for i in range(start, start + n):
            self._send(i)
            inflight += 1
            if inflight >= window:
                self._recv_all()
                inflight -= 1
        for _ in range(inflight):
            self._recv_all()
        return n / (time.perf_counter() - t0)

    def server_pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    def pause(self) -> None:
        """Idle echo servers sleep in ``recv``: nothing to park."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def close(self) -> list[int]:
        """Stop every server; return the requests each one answered."""
        try:
            for s in self._dealers:
                s.send(_FLOOR_STOP)
            counts = [c.result() for c in self._children]
        finally:
            self._abort()
        return counts

    def _abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._dealers:
            s.close()
        self._ctx.term()
        for c in self._children:
            c.stop()

    def __enter__(self) -> "FloorRef":
        return self

    def __exit__(self, *exc: object) -> None:
        self._abort()


# ====================================================================== baseline

# Shared-memory flags of the baseline (what the original keeps in IPCSignal arrays).
_BROADCAST, _ACTIVE, _STOP = 0, 1, 2
# Values of the broadcast flag, written by rank 0 at the top of each poll.
_IDLE, _TASK, _PARKED, _EXIT = 0, 1, 2, 3
_BARRIERS = ("barrier1", "barrier2", "barrier3", "swap_barrier1", "swap_barrier2")
_PARK_SLEEP_S = 0.002


class TaskHub:
    """The manager-side task queue: every rank reads each task once; the last
    reader removes it.  Called from the manager's per-connection threads."""

    def __init__(self, num_ranks: int):
        self._num_ranks = num_ranks
        self._lock = threading.Lock()
        self._tasks: list[Any] = []
        self._reads = 0
        self._done: list[Any] = []

    def empty(self) -> bool:
        with self._lock:
            return not self._tasks

    def put_transfer_task(self, task: Any) -> None:
        with self._lock:
            self._tasks.append(task)

    def get_transfer_task(self) -> tuple[Any, bool]:
        """(the head task, whether this caller was its last reader)."""
        with self._lock:
            task = self._tasks[0]
            self._reads += 1
            if self._reads < self._num_ranks:
                return task, False
            self._reads = 0
            self._tasks.pop(0)
            return task, True

    def put_transfer_done_signal(self, result: Any) -> None:
        with self._lock:
            self._done.append(result)

    def get_transfer_done_signal(self) -> Any:
        with self._lock:
            return self._done.pop(0) if self._done else None


class _HubManager(BaseManager):
    """Serves ``hub`` and the barriers (typeids registered in :func:`_register`)."""


def _register(shared: dict[str, Any] | None) -> None:
    """Register the typeids; the server side passes the objects it serves."""
    for typeid in ("hub", *_BARRIERS):
        if shared is None:
            _HubManager.register(typeid)
        else:
            obj = shared[typeid]
            _HubManager.register(typeid, callable=lambda obj=obj: obj)


def serve_manager(address: str, num_ranks: int) -> None:
    """Child: run the manager server until killed."""
    shared: dict[str, Any] = {"hub": TaskHub(num_ranks)}
    shared.update({b: threading.Barrier(num_ranks) for b in _BARRIERS})
    _register(shared)
    server = _HubManager(address=address, authkey=_authkey_from_env()).get_server()
    print("ready", flush=True)
    server.serve_forever()


def _authkey_from_env() -> bytes:
    """The manager's key, handed to the children in the environment (not on argv)."""
    return bytes.fromhex(os.environ[_AUTHKEY_ENV])


def _connect(address: str, authkey: bytes) -> _HubManager:
    _register(None)
    mgr = _HubManager(address=address, authkey=authkey)
    mgr.connect()
    return mgr


def _reap(futures: list[Future]) -> list[Future]:
    """Drop finished swaps, re-raising a failed one (its count would be wrong)."""
    running = []
    for f in futures:
        if f.done():
            f.result()
        else:
            running.append(f)
    return running


def serve_baseline_rank(address: str, flags_name: str, rank: int, num_ranks: int,
                        blocks: int, block_bytes: int) -> int:
    """Child: one rank of the reference design's transfer manager."""
    mgr = _connect(address, _authkey_from_env())
    hub = mgr.hub()  # type: ignore[attr-defined]
    b1, b2, b3, sb1, sb2 = (getattr(mgr, b)() for b in _BARRIERS)
    region = ShmRegion.attach(flags_name)
    flags = region.array(0, (3,), "<i8")
    device = np.ones((blocks, block_bytes), dtype=np.uint8)
    host = np.zeros((blocks, block_bytes), dtype=np.uint8)
    served = 0

    def swap(task: tuple) -> None:
        nonlocal served
        _, dev_ids, host_ids, _, task_id = task
        sb1.wait(REPLY_TIMEOUT_S)
        host[host_ids] = device[dev_ids]
        sb2.wait(REPLY_TIMEOUT_S)
        served += 1
        if rank == 0:
            hub.put_transfer_done_signal(task_id)

    pool = ThreadPoolExecutor(1)
    pending: list[Future] = []
    print("ready", flush=True)
    while True:
        if rank == 0:
            if flags[_STOP]:
                flags[_BROADCAST] = _EXIT
            elif not flags[_ACTIVE]:
                flags[_BROADCAST] = _PARKED
            elif not hub.empty():
                flags[_BROADCAST] = _TASK
            else:
                flags[_BROADCAST] = _IDLE
        if num_ranks > 1:
            b1.wait(REPLY_TIMEOUT_S)
        state = int(flags[_BROADCAST])
        if state == _EXIT:
            break
        if state == _TASK:
            task, read_finish = hub.get_transfer_task()
            if read_finish:
                flags[_BROADCAST] = _IDLE
            pending = _reap(pending)
            pending.append(pool.submit(swap, task))
            if num_ranks > 1:
                b3.wait(REPLY_TIMEOUT_S)
            continue
        if state == _PARKED:
            while not (flags[_ACTIVE] or flags[_STOP]):
                time.sleep(_PARK_SLEEP_S)
        if num_ranks > 1:
            b2.wait(REPLY_TIMEOUT_S)
    pool.shutdown(wait=True)
    _reap(pending)
    del flags
    region.close()
    return served


class BaselineRef:
    """Engine side of the reference design: put tasks, poll acks with 1 ms sleeps."""

    name = "baseline"
    POLL_SLEEP_S = 0.001

    def __init__(self, tp: int, run_dir: str, blocks: int, block_bytes: int):
        self.tp = tp
        self.blocks = blocks
        authkey = secrets.token_bytes(16)
        env = {_AUTHKEY_ENV: authkey.hex()}
        address = f"{run_dir}/manager.sock"
        flags_name = f"/kvswap-bench-{os.getpid()}-{secrets.token_hex(4)}.flags"
        self._flags_region = ShmRegion.create(flags_name, 64)
        self._flags = self._flags_region.array(0, (3,), "<i8")
        self._manager: _Child | None = None
        self._ranks: list[_Child] = []
        self._hub: Any = None
        self._closed = False
        try:
            self._manager = _Child("baseline manager", ["manager", address, str(tp)], env)
            self._manager.wait_ready()
            self._ranks = [_Child(f"baseline rank {r}",
                                  ["baseline-rank", address, flags_name, str(r), str(tp),
                                   str(blocks), str(block_bytes)], env)
                           for r in range(tp)]
            for c in self._ranks:
                c.wait_ready()
            self._hub = _connect(address, authkey).hub()  # type: ignore[attr-defined]
        except BaseException:
            self._abort()
            raise

    def _put(self, i: int) -> None:
        b = i % self.blocks
        self._hub.put_transfer_task((["node"], [b], [b], "swap2cpu", i))

    def _wait_done(self) -> Any:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            done = self._hub.get_transfer_done_signal()
            if done is not None:
                return done
            if time.monotonic() > deadline:
                raise BenchError(f"baseline: no task acknowledged within {REPLY_TIMEOUT_S:.0f}s")
            time.sleep(self.POLL_SLEEP_S)

    def roundtrip(self, i: int) -> None:
        self._put(i)
        done = self._wait_done()
        if done != i:
            raise BenchError(f"baseline: acknowledged task {done}, expected {i}")

    def tasks_per_s(self, start: int, n: int, window: int) -> float:
        t0 = time.perf_counter()
        nxt, acked = start, 0
        while acked < n:
            while nxt < start + n and nxt - start - acked < window:
                self._put(nxt)
                nxt += 1
            self._wait_done()
            acked += 1
        return n / (time.perf_counter() - t0)

    def server_pids(self) -> list[int]:
        assert self._manager is not None
        return [self._manager.proc.pid, *(c.proc.pid for c in self._ranks)]

    def pause(self) -> None:
        """Park the ranks: the original polls without pause, which would steal CPU
        from whatever else this run measures."""
        self._flags[_ACTIVE] = 0

    def resume(self) -> None:
        self._flags[_ACTIVE] = 1

    def close(self) -> list[int]:
        """Stop every rank; return the tasks each one copied."""
        try:
            self._flags[_STOP] = 1
            counts = [c.result() for c in self._ranks]
        finally:
            self._abort()
        return counts

    def _abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hub = None  # drop the proxy (it says goodbye to the manager) before stopping it
        for c in self._ranks:
            c.stop()
        if self._manager is not None:
            self._manager.stop()
        del self._flags
        self._flags_region.unlink()
        self._flags_region.close()

    def __enter__(self) -> "BaselineRef":
        return self

    def __exit__(self, *exc: object) -> None:
        self._abort()


# ====================================================================== entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvswap.daemon.bench_refs",
                                description="reference processes of 'kvswap bench control'")
    sub = p.add_subparsers(dest="role", required=True)
    fl = sub.add_parser("floor")
    fl.add_argument("endpoint")
    fl.add_argument("rank", type=int)
    mg = sub.add_parser("manager")
    mg.add_argument("address")
    mg.add_argument("ranks", type=int)
    br = sub.add_parser("baseline-rank")
    br.add_argument("address")
    br.add_argument("flags")
    br.add_argument("rank", type=int)
    br.add_argument("ranks", type=int)
    br.add_argument("blocks", type=int)
    br.add_argument("block_bytes", type=int)
    args = p.parse_args(argv)
    if args.role == "floor":
        served = serve_floor(args.endpoint, args.rank)
    elif args.role == "manager":
        serve_manager(args.address, args.ranks)
        return 0
    else:
        served = serve_baseline_rank(args.address, args.flags, args.rank, args.ranks,
                                     args.blocks, args.block_bytes)
    print(f"served {served}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
