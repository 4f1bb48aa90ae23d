"""The daemon's I/O thread: completions handed to it never block their sender, and
no reply is dropped however many a peer has outstanding."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvswap.client.errors import ErrorCode
from kvswap.client.protocol import Op, decode_reply, encode_request
from kvswap.daemon.io_loop import CompletionQueue

from conftest import SMALL_LAYOUT


@pytest.fixture
def zctx():
    ctx = zmq.Context(1)
    yield ctx
    ctx.term()


def test_completions_never_block_while_the_io_thread_is_busy():
    """10,000 completions from two workers while the I/O thread reads nothing, then
    more from the I/O thread itself (as cancel and shutdown do).  A blocking send on
    the PAIR filled it after about 2,000 and hung the senders (and the I/O thread,
    which waited for their lock)."""
    ctx = zmq.Context(1)
    q = CompletionQueue(ctx)
    per_worker = 5000
    done = threading.Barrier(3, timeout=30)  # the gate: both workers finished putting

    def worker(tag: str) -> None:
        for i in range(per_worker):
            q.put((tag, i))
        done.wait()

    workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in "ab"]
    for w in workers:
        w.start()
    try:
        done.wait()
    except threading.BrokenBarrierError:
        # A worker is stuck inside put(): its socket cannot be closed from here, so
        # the context is left to the process's exit rather than hang in term().
        pytest.fail("put() blocked while the I/O thread was busy")
    q.put(("io", 0))  # the I/O thread's own completion, before it has read anything
    poller = zmq.Poller()
    poller.register(q.rx, zmq.POLLIN)
    assert poller.poll(5000), "no wake-up for the I/O thread"
    got = q.take()
    assert len(got) == 2 * per_worker + 1
    assert [i for t, i in got if t == "a"] == list(range(per_worker))  # in order
    assert not poller.poll(0), "a wake-up left over after take()"
    q.put(("late", 0))  # a completion after take() wakes the thread again
    assert poller.poll(5000) and q.take() == [("late", 0)]
    q.close()
    ctx.term()


def test_a_completion_queued_during_take_still_wakes_the_io_thread(zctx):
    """A worker's put() lands while take() reads the wake-ups (forced here, at the
    first read).  Clearing the flag before reading let take() swallow that put's
    wake-up and leave the flag set: no later completion woke the I/O thread again
    (in the demo, tasks went unanswered for their whole timeout)."""
    q = CompletionQueue(zctx)
    real_rx = q.rx

    class PutDuringRead:
        """The I/O thread's view of the PAIR, with a worker's put() at the first read."""

        def __init__(self) -> None:
            self.fired = False

        def recv(self, flags: int) -> bytes:
            if not self.fired:
                self.fired = True
                worker = threading.Thread(target=q.put, args=("racing",))
                worker.start()
                worker.join(10)
            return real_rx.recv(flags)

    poller = zmq.Poller()
    poller.register(real_rx, zmq.POLLIN)
    try:
        q.put("first")
        assert poller.poll(5000)
        q.rx = PutDuringRead()
        taken = q.take()
        q.rx = real_rx
        assert set(taken) <= {"first", "racing"} and "first" in taken
        q.put("after")
        assert poller.poll(5000), "a completion queued with no wake-up for the I/O thread"
        assert set(taken + q.take()) == {"first", "racing", "after"}
    finally:
        q.rx = real_rx
        q.close()


def test_more_than_a_thousand_outstanding_replies_to_one_peer_all_arrive(namespaces, zctx):
    """A peer that reads its replies late: with the ROUTER's default SNDHWM (1000)
    libzmq dropped the replies past it, silently."""
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT)
    n = 20_000
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # hold almost nothing here: the daemon must queue them
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(launcher.names.endpoint(0))
    try:
        for i in range(n):
            sock.send_multipart(encode_request(Op.PING, i + 1))
        # Nothing was read yet.  Now read every reply, with a deadline per reply.
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        ids = set()
        deadline = time.monotonic() + 60
        while len(ids) < n and time.monotonic() < deadline:
            if not poller.poll(3000):
                break
            reply = decode_reply(sock.recv_multipart()[0])
            assert reply.code == ErrorCode.OK
            ids.add(reply.id)
        assert len(ids) == n, f"{n - len(ids)} of {n} replies never arrived"
    finally:
        sock.close()
