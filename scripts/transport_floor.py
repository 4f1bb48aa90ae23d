"""Round trips of the transports under kvswap, without kvswap's work, in one run.

A diagnosis for ``kvswap bench control`` (docs/benchmarks.md, "Where the time
goes"), not a target.  Sequential 1-request round trips, p50 in µs, the systems
alternating in blocks so that each sees the same machine:

* ``zmq floor``: the bench's floor (``daemon/bench_refs.FloorRef``, TP 1): a bare
  ROUTER that echoes, a one-thread DEALER client;
* ``ring echo``: kvswap's shared-memory rings and FIFO doorbells
  (``client/rings.py``) with a server that echoes each record, and a client
  that is one thread: it writes the request, then reads its reply itself;
* ``ring echo + reader``: the same, but the reply is read by a second thread
  that completes a ``concurrent.futures.Future`` the caller waits on (the
  client's structure: a caller thread and one reader thread);
* ``kvswap``: a 1-block evict on a TP 1 namespace (path ``ring``).

Usage: .venv/bin/python scripts/transport_floor.py [--trips N] [--blocks B]
"""

from __future__ import annotations

import argparse
import secrets
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from kvswap.client.naming import Names
from kvswap.client.rings import Bell, RingSegment
from kvswap.client.shm_region import unlink_shm
from kvswap.daemon.bench import CONTROL_BLOCKS, CONTROL_LAYOUT, _Namespace
from kvswap.daemon.bench_refs import FloorRef, measure_latencies_us

_STOP = b"stop"
_REQUEST = [b"h" * 64, b"\0" * 4, b"\0" * 4]  # about an evict's header and id frames
_REPLY = [b"r" * 48]
_TIMEOUT_MS = 30_000  # no wait is unbounded


def _bells(run: Path) -> tuple[Path, Path]:
    return run / "rq.bell", run / "cq.bell"


def serve(namespace: str, run: str) -> None:
    """Child: create the ring segment and bells, echo every request until ``stop``."""
    names, rq_path, cq_path = Names(namespace, Path(run)), *_bells(Path(run))
    seg = RingSegment.create(names, 0, 1, 1 << 20)
    Bell.create(rq_path)
    Bell.create(cq_path)
    rx, tx = Bell.listen(rq_path), Bell.listen(cq_path)
    poller = select.poll()
    poller.register(rx.fileno(), select.POLLIN)
    print("ready", flush=True)
    try:
        while True:
            rx.drain()
            while (frames := seg.request.get()) is not None or not seg.request.arm():
                if frames is None:
                    continue
                if frames[0] == _STOP:
                    return
                if seg.completion.put(_REPLY) > 0:
                    tx.ring()
            if not poller.poll(_TIMEOUT_MS):
                raise SystemExit("ring echo server: no request for 30 s")
    finally:
        seg.unlink()
        seg.close()


class RingEcho:
    """The client side of the ring echo (one thread, or with a reader thread)."""

    def __init__(self, run: Path):
        namespace = "kvsfloor" + secrets.token_hex(3)
        self._run = run
        self._names = Names(namespace, run)
        run.mkdir()
        self._child = subprocess.Popen(
            [sys.executable, __file__, "--serve", namespace, str(run)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self._child.stdout is not None
        ready, _, _ = select.select([self._child.stdout], [], [], 30)
        if not ready or self._child.stdout.readline().strip() != "ready":
            self._stop_child()
            raise SystemExit("ring echo server did not start")
        self._seg = RingSegment.attach(self._names, 0)
        rq_path, cq_path = _bells(run)
        self._tx, self._rx = Bell.connect(rq_path), Bell.listen(cq_path)
        self._poller = select.poll()
        self._poller.register(self._rx.fileno(), select.POLLIN)
        self._future: Future | None = None
        self._reader: threading.Thread | None = None
        self._closing = False

    def _send(self, frames: list[bytes]) -> None:
        if self._seg.request.put(frames) > 0:
            self._tx.ring()

    def _next_reply(self) -> list[bytes] | None:
        """The next reply, sleeping on the bell while there is none; None on close."""
        completion = self._seg.completion
        while (frames := completion.get()) is None:
            if completion.arm():
                if not self._poller.poll(_TIMEOUT_MS):
                    raise TimeoutError("ring echo: no reply for 30 s")
                self._rx.drain()
            if self._closing:
                return None
        return frames

    def roundtrip(self, i: int) -> None:
        self._send(_REQUEST)
        self._next_reply()

    def with_reader(self) -> None:
        """From now on a reader thread reads the replies and completes futures."""
        def read() -> None:
            while (frames := self._next_reply()) is not None:
                assert self._future is not None
                self._future.set_result(frames)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def roundtrip_via_reader(self, i: int) -> None:
        self._future = Future()
        self._send(_REQUEST)
        self._future.result(_TIMEOUT_MS / 1000)

    def close(self) -> None:
        self._closing = True
        try:
            self._send([_STOP])
            self._child.wait(30)
        finally:
            self._stop_child()
            if self._reader is not None:
                self._rx_wake()
                self._reader.join(5)
            for bell in (self._tx, self._rx):
                bell.close()
            self._seg.close()

    def _stop_child(self) -> None:
        """Kill the server if it still runs; its segment goes with it either way."""
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        unlink_shm(self._names.ring_segment(0))

    def _rx_wake(self) -> None:
        """Wake a reader asleep on the completion bell (it then sees ``_closing``)."""
        waker = Bell.connect(_bells(self._run)[1])
        waker.ring()
        waker.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trips", type=int, default=2000, help="round trips per block")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per system")
    p.add_argument("--serve", nargs=2, metavar=("NAMESPACE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    run = Path(tempfile.mkdtemp(prefix="kvsfloor-"))
    samples: dict[str, list[float]] = {}
    try:
        with FloorRef(1, str(run), CONTROL_BLOCKS) as floor, \
                _Namespace(1, CONTROL_LAYOUT, CONTROL_BLOCKS, path="ring") as client:
            alone, threaded = RingEcho(run / "a"), None
            try:
                threaded = RingEcho(run / "b")
                threaded.with_reader()

                def kvswap(i: int) -> None:
                    b = i % CONTROL_BLOCKS
                    client.evict([b], [b]).result(30)

                systems = {"zmq floor": floor.roundtrip, "ring echo": alone.roundtrip,
                           "ring echo + reader": threaded.roundtrip_via_reader,
                           "kvswap": kvswap}
                for block in range(args.blocks):
                    for name, trip in systems.items():
                        measure_latencies_us(trip, 0, 200)  # warm-up
                        samples.setdefault(name, []).extend(
                            measure_latencies_us(trip, block * args.trips, args.trips))
            finally:
                for echo in (alone, threaded):
                    if echo is not None:
                        echo.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    floor_p50 = statistics.median(samples["zmq floor"])
    print(f"{'system':<20} {'p50 us':>8} {'p99 us':>8} {'p50 / zmq floor':>16}")
    for name, lat in samples.items():
        lat.sort()
        p50 = statistics.median(lat)
        print(f"{name:<20} {p50:8.1f} {lat[int(len(lat) * 0.99)]:8.1f} {p50 / floor_p50:16.2f}")


if __name__ == "__main__":
    main()
