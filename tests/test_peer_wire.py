"""Peer transfer's wire and its daemon-side bookkeeping, in process (no Transfer Engine,
no daemons): what a sender does with answers it cannot read, what the completion
listener does with messages it cannot read, how long a parked begin waits, and the
peer ops' table of queued work (daemon/peer.py, peer_receiver.py, peer_table.py,
peer_ops.py).  Each test is about a bug that took a thread or leaked: a peer worker
killed by a receiver's answer, a listener killed by one message, a parked begin
refused only after its sender had given up, work left behind by a cancel or a
failed submit.  Real ZMQ sockets on loopback; every socket and thread is closed in
a ``finally``."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.protocol import PROTOCOL_VERSION, Op, Request
from kvswap.client.ticket import RankEndpoint, Ticket
from kvswap.daemon.jobs import Job, Origin
from kvswap.daemon.peer import PeerSender, PoolView
from kvswap.daemon.peer_ops import PeerOps, _Recv
from kvswap.daemon.peer_receiver import PeerReceiver
from kvswap.daemon.peer_table import MAX_ABORT_TEXT, PARK_MARGIN_S, park, read_message
from kvswap.daemon.scheduler import Scheduler, Task

LAYOUT = bytes(range(32))
BPB = 4096
NONCE = bytes(16)


# =========================================================================== sender


class _FakeReceiver:
    """A ROUTER answering each message with the next of ``answers`` (lists of frames),
    on its own thread; ``seen`` holds the messages it read."""

    def __init__(self, answers: list[list[bytes]]):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._answers = list(answers)
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                ident, raw = self._sock.recv_multipart()
                self.seen.append(msgpack.unpackb(raw))
                if self._answers:
                    self._sock.send_multipart([ident, *self._answers.pop(0)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


@pytest.mark.parametrize("frames,words", [
    ([msgpack.packb({"code": 99999, "message": "a newer code"})], "error code 99999"),
    ([msgpack.packb([0, "ok"])], "a list, not a map"),
    ([b"\xc1"], "not msgpack"),
    ([msgpack.packb({"code": True})], "not an integer"),
    ([msgpack.packb({"message": "no code"})], "code is None"),
    ([msgpack.packb({"code": 0, "message": 7})], "message is a int"),
    ([msgpack.packb({"code": 0}), b"more"], "2 frames"),
])
def test_an_answer_the_sender_cannot_read_fails_the_send_protocol_error(frames, words):
    """An unknown code (ErrorCode(99999) raised ValueError), a body that is not a map
    (AttributeError) or not msgpack escaped PeerSender._ask and killed the peer worker:
    the send was never answered and its blocks stayed held.  Each is now a
    PROTOCOL_ERROR naming what was wrong, and the socket is dropped, so a late answer
    is never read as the next message's."""
    fake = _FakeReceiver([frames, [msgpack.packb({"code": 0, "message": ""})]])
    ctx = zmq.Context()
    sender = PeerSender(ctx, engine=None, timeout_s=5.0)
    try:
        with pytest.raises(KvswapError) as exc:
            sender._ask(fake.endpoint, {"k": "begin", "nonce": NONCE, "rank": 0})
        assert exc.value.code == ErrorCode.PROTOCOL_ERROR, exc.value
        assert words in exc.value.message and fake.endpoint in exc.value.message, exc.value
        # the next message goes out on a fresh socket and reads its own answer
        assert sender._ask(fake.endpoint, {"k": "done", "nonce": NONCE, "rank": 0})["code"] == 0
    finally:
        sender.close()
        ctx.term()
        fake.close()


def test_a_push_tells_the_receiver_how_long_it_waits_for_begins_answer():
    """The receiver parks a begin whose receive is not armed yet; it must refuse it
    before the sender gives up, so the begin says how long that is (``wait``)."""
    fake = _FakeReceiver([[msgpack.packb({"code": int(ErrorCode.TICKET_MISMATCH),
                                          "message": "no"})]])
    ctx = zmq.Context()
    sender = PeerSender(ctx, engine=None, timeout_s=7.5)
    ticket = Ticket.issue("ns", LAYOUT, [3], [RankEndpoint("127.0.0.1:1", fake.endpoint,
                                                           (1 << 30,), (BPB,), 1)], 60.0, None)
    pool = PoolView((1 << 30,), (BPB,), LAYOUT, 32)
    try:
        with pytest.raises(KvswapError) as exc:
            sender.push(0, ticket, ticket.to_bytes(), pool, np.array([1]))
        assert exc.value.code == ErrorCode.TICKET_MISMATCH
        (begin,) = fake.seen
        assert begin["k"] == "begin" and begin["wait"] == 7.5, begin
        assert begin["v"] == list(PROTOCOL_VERSION)
    finally:
        sender.close()
        ctx.term()
        fake.close()


# =========================================================================== listener


class _Listener:
    """A PeerReceiver on loopback with a DEALER to it; ``dead`` records on_dead."""

    def __init__(self, timeout_s: float = 30.0):
        self.ctx = zmq.Context()
        self.dead: list = []
        self.ended: list = []
        self.receiver = PeerReceiver(self.ctx, "127.0.0.1", 0, b"", timeout_s,
                                     lambda *a: self.ended.append(a), on_dead=self.dead.append,
                                     on_stale=lambda nonce: None)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.receiver.endpoint)

    def ticket(self) -> Ticket:
        return Ticket.issue("ns", LAYOUT, [3], [RankEndpoint(
            "127.0.0.1:1", self.receiver.endpoint, (1 << 30,), (BPB,), 1)], 60.0, None)

    def ask(self, raw: bytes, timeout_s: float = 5.0) -> dict:
        self.sock.send(raw)
        assert self.sock.poll(int(timeout_s * 1000)), "the listener did not answer"
        return msgpack.unpackb(self.sock.recv())

    def close(self) -> None:
        self.receiver.close()
        self.sock.close()
        self.ctx.term()


def _begin(**fields) -> bytes:
    return msgpack.packb({"k": "begin", "nonce": NONCE, "rank": 0, "ticket": b"x",
                          "v": list(PROTOCOL_VERSION), **fields})


@pytest.mark.parametrize("raw,words", [
    (_begin(v=[float("inf"), 0]), "v must be"),
    (_begin(v=[float("nan"), 9]), "v must be"),
    (_begin(v=[1.0, 9.0]), "v must be"),
    (_begin(v=[True, 9]), "v must be"),
    (_begin(v=[1, 9, 0]), "v must be"),
    (_begin(v="1.9"), "v must be"),
    (_begin(wait=float("inf")), "wait must be"),
    (_begin(wait=float("nan")), "wait must be"),
    (_begin(wait=-1.0), "wait must be"),
    (_begin(wait=True), "wait must be"),
    (_begin(wait="30"), "wait must be"),
    (msgpack.packb({"k": "abort", "nonce": NONCE, "rank": 0, "message": 10**9}),
     "message must be a string"),
    (msgpack.packb({"k": 5, "nonce": NONCE, "rank": 0}), "k must be a string"),
    (msgpack.packb({"k": "begin", "nonce": NONCE, "rank": True}), "rank must be an integer"),
    (msgpack.packb({"k": "begin", "nonce": NONCE, "rank": 2**64 - 1, "v": [1, 2, 3]}),
     "v must be"),
    (msgpack.packb({"k": "done", "nonce": NONCE}), "no rank"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"k": "boom", "nonce": NONCE, "rank": 0}), "unknown peer message 'boom'"),
], ids=["v-inf", "v-nan", "v-floats", "v-bool", "v-three", "v-str", "wait-inf", "wait-nan",
        "wait-negative", "wait-bool", "wait-str", "abort-message-int", "k-int", "rank-bool",
        "rank-huge-v-three", "no-rank", "a-list", "not-msgpack", "unknown-k"])
def test_a_malformed_message_is_refused_and_the_listener_goes_on(raw, words):
    """``v: [inf, 0]`` raised OverflowError in the listener thread (int(inf)), which died
    and failed the rank, from one unauthenticated message.  Every field of every kind
    is checked for its type and range first: refused PROTOCOL_ERROR naming it, and
    the listener answers the next message."""
    listener = _Listener()
    try:
        refused = listener.ask(raw)
        assert refused["code"] == ErrorCode.PROTOCOL_ERROR, refused
        assert words in refused["message"], refused
        probe = listener.ask(msgpack.packb({"k": "done", "nonce": NONCE, "rank": 1}))
        assert "rank 1's push reached rank 0" in probe["message"], probe
        assert listener.dead == []
    finally:
        listener.close()


def test_an_aborts_message_is_cut_to_a_bounded_length():
    """An abort's message goes into the receive's error (journal, reply, log); a peer
    may send megabytes of it."""
    m = read_message(msgpack.packb({"k": "abort", "nonce": NONCE, "rank": 0,
                                    "message": "x" * 10**6}))
    assert m.kind == "abort" and m.text == "x" * MAX_ABORT_TEXT


@pytest.mark.parametrize("early", [False, True])
def test_a_parked_begin_is_refused_before_its_sender_gives_up(early):
    """A begin whose receive is not armed yet (or not admitted yet: ``early``) waited
    this rank's --peer-timeout from its arrival, but its sender's equal wait began
    earlier, at sending: the sender always gave up first and reported a receiver
    that "may have died".  With ``wait`` in the begin it is refused a margin before
    the sender gives up, naming the cause; here 1 s against a 30 s --peer-timeout."""
    listener = _Listener(timeout_s=30.0)
    t = listener.ticket()
    raw = t.to_bytes()
    try:
        if not early:
            listener.receiver.expect(t.nonce, raw, t.expires_ns, BPB, np.array([3]))
        t0 = time.monotonic()
        refused = listener.ask(msgpack.packb({
            "k": "begin", "nonce": t.nonce, "rank": 0, "ticket": raw,
            "v": list(PROTOCOL_VERSION), "wait": 1.0}), timeout_s=5.0)
        took = time.monotonic() - t0
        assert refused["code"] == ErrorCode.TICKET_MISMATCH, refused
        assert "its sender waits 1.0s for begin's answer" in refused["message"], refused
        assert ("no peer_recv" if early else "did not arm within") in refused["message"]
        assert 0.5 <= took < 1.0, took
        assert listener.dead == []
    finally:
        listener.close()


def test_a_park_ends_a_margin_before_the_sender_or_at_the_peer_timeout():
    """A begin without ``wait`` (an older sender) waits --peer-timeout, as before."""
    assert park(100.0, 30.0, None).deadline == 130.0
    assert park(100.0, 30.0, 60.0).deadline == 130.0  # this rank's timeout is shorter
    short = park(100.0, 30.0, 2.0)
    assert short.deadline == 100.0 + 2.0 - PARK_MARGIN_S and "2.0s" in short.why
    assert park(100.0, 30.0, 0.4).deadline == pytest.approx(100.3)  # a quarter of a short wait


# =========================================================================== peer ops


class _Sig:
    def __init__(self):
        self.inflight = 0

    def add(self, slot, n: int) -> None:
        self.inflight += n


class _Exactly:
    def __init__(self):
        self.settled: list = []

    def begin_admission(self, job, header):
        return Origin()

    def admit(self, *a, **kw) -> None:
        pass

    def settle(self, c) -> None:
        self.settled.append(c)


def _ops(scheduler: Scheduler, receiver=None, sender=None) -> PeerOps:
    """A PeerOps over a real scheduler and fakes for the rest of the rank (its
    constructor starts a Transfer Engine)."""
    ops = PeerOps.__new__(PeerOps)
    ops._rank = SimpleNamespace(index=0, epoch=1, cfg=SimpleNamespace(tp_size=1), sig=_Sig())
    ops._slot = SimpleNamespace(current=SimpleNamespace(scheduler=scheduler))
    ops._exactly = _Exactly()
    ops._secret = b""
    ops._lock = threading.Lock()
    ops._work = {}
    endpoint = RankEndpoint("127.0.0.1:1", receiver.endpoint if receiver else "tcp://h:1",
                            (1 << 30,), (BPB,), 1)
    ops._runtime = SimpleNamespace(pool=PoolView((1 << 30,), (BPB,), LAYOUT, 32),
                                   receiver=receiver, sender=sender,
                                   endpoint=lambda epoch: endpoint)
    return ops


def _request(op: Op, ticket: bytes) -> tuple[Job, Request]:
    if op is Op.PEER_SEND:
        req = Request(7, op, {"ids": "<i8", "n": 1}, [np.array([1], "<i8").tobytes(), ticket])
    else:
        req = Request(7, op, {}, [ticket])
    return Job(None, 7, op, 0), req


def _scheduler() -> Scheduler:
    return Scheduler(4, 32, lambda batch: None, workers=1, peer_workers=0)


def test_a_send_cancelled_while_queued_leaves_nothing_behind():
    """``PeerOps.cancel`` forgot only a receive: a send dropped before it started kept
    its entry (and ticket) in the table for as long as the process lived."""
    scheduler = _scheduler()
    ops = _ops(scheduler)
    try:
        ticket = Ticket.issue("ns", LAYOUT, [3], [ops._runtime.endpoint(1)], 60.0, None)
        ops.admit(*_request(Op.PEER_SEND, ticket.to_bytes()))
        task = scheduler.cancel(lambda t: True)  # no peer worker: it is still queued
        assert task is not None
        assert ops.cancel(task) is True
        assert ops._work == {}
    finally:
        scheduler.stop()
        scheduler.join(5)


def test_a_receive_whose_submit_fails_is_forgotten():
    """``peer_recv`` records the receive (``expect``) before it submits the task; a
    submit that raised (the scheduler stopping) left the nonce WAITING, with no task
    to end it, until the process ended.  It is forgotten, and the in-flight count
    given back."""
    scheduler = _scheduler()
    listener = _Listener()
    ops = _ops(scheduler, receiver=listener.receiver)
    try:
        scheduler.stop()
        ticket = Ticket.issue("ns", LAYOUT, [3], [ops._runtime.endpoint(1)], 60.0, None)
        with pytest.raises(RuntimeError, match="stopping"):
            ops.admit(*_request(Op.PEER_RECV, ticket.to_bytes()))
        assert listener.receiver._pending == {} and ops._work == {}
        assert ops._rank.sig.inflight == 0
    finally:
        scheduler.join(5)
        listener.close()


def test_a_peer_task_that_raises_unexpectedly_fails_alone_and_is_logged(caplog):
    """Only KvswapError was caught around a push: anything else ended the peer worker
    thread (two of them: the peer lane) with the send unanswered and its blocks held.
    It fails that task INTERNAL_ERROR, its traceback in the log; a receive that fails
    to arm (held: the worker does not finish it) is ended, not left held."""

    class Boom:
        def push(self, *a):
            raise RuntimeError("boom")

    class BadArm:
        forgotten: list = []

        def arm(self, nonce, handle):
            raise RuntimeError("arm")

        def forget(self, nonce):
            self.forgotten.append(nonce)
            return True

    scheduler = _scheduler()
    ops = _ops(scheduler, sender=Boom())
    ended: list = []
    try:
        ticket = Ticket.issue("ns", LAYOUT, [3], [ops._runtime.endpoint(1)], 60.0, None)
        ops.admit(*_request(Op.PEER_SEND, ticket.to_bytes()))
        (task,) = list(ops._work)
        with caplog.at_level(logging.ERROR, logger="kvswap.daemon.peer"):
            (c,) = ops.execute([task], None)
        assert c.code == ErrorCode.INTERNAL_ERROR and "RuntimeError: boom" in c.message
        assert "peer_send 7 failed unexpectedly" in caplog.text
        assert "Traceback" in caplog.text and "boom" in caplog.text

        ops._runtime.receiver = BadArm()
        ops._on_end = lambda task, code, message, nbytes, hold=False: ended.append(
            (task, code, message))
        recv_task = Task(1, Op.PEER_RECV, np.empty(0, np.int64), np.array([3]),
                         ctx=Job(None, 8, Op.PEER_RECV, 0))
        ops._work[recv_task] = _Recv(NONCE)
        assert ops.execute([recv_task], None) == []
        assert ended == [(recv_task, ErrorCode.INTERNAL_ERROR,
                          ended[0][2])] and "RuntimeError: arm" in ended[0][2]
        assert BadArm.forgotten == [NONCE]
    finally:
        scheduler.stop()
        scheduler.join(5)
