"""Peer-transfer tickets and span planning, without daemons (client/ticket.py,
daemon/peer.py plan_spans)."""

from __future__ import annotations


import msgpack
import numpy as np
import pytest

from kvswap.client.errors import ErrorCode
from kvswap.client.ticket import RankEndpoint, Ticket, TicketRefused
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon.peer import plan_spans

LAYOUT = bytes(range(32))
SECRET = b"a-shared-secret-of-32-bytes-here"


def _ranks(tp: int) -> list[RankEndpoint]:
    return [RankEndpoint(f"10.0.0.{r}:1500{r}", f"tcp://10.0.0.{r}:2500{r}",
                         (1 << 30, 2 << 30), (4096, 4096), 1) for r in range(tp)]


def _ticket(tp: int = 2, ids=(3, 4, 5), ttl: float = 30.0, secret: bytes | None = None):
    return Ticket.issue("decode", LAYOUT, ids, _ranks(tp), ttl, secret)


def test_round_trip_keeps_every_field_and_the_mac():
    t = _ticket(secret=SECRET)
    back = Ticket.from_bytes(t.to_bytes())
    assert back == t and back.mac
    back.verify(SECRET)
    body = msgpack.unpackb(t.to_bytes())
    assert body["kind"] == "kvswap-peer-ticket" and body["ns"] == "decode" and body["tp"] == 2
    assert body["ids"] == [3, 4, 5] and len(body["nonce"]) == 16
    assert [r["te"] for r in body["ranks"]] == ["10.0.0.0:15000", "10.0.0.1:15001"]


def test_two_tickets_for_the_same_blocks_differ_in_their_nonce():
    assert _ticket().nonce != _ticket().nonce


@pytest.mark.parametrize("tp,layout,count,code,words", [
    (1, LAYOUT, 3, ErrorCode.TICKET_MISMATCH, "TP size differs: the sender has 1 ranks"),
    (2, bytes(32), 3, ErrorCode.TICKET_MISMATCH, "block layout differs"),
    (2, LAYOUT, 2, ErrorCode.LENGTH_MISMATCH, "the sender names 2 host blocks, the ticket 3"),
])
def test_each_pairing_difference_is_named(tp, layout, count, code, words):
    with pytest.raises(TicketRefused) as exc:
        _ticket().check_pairing(tp, layout, count)
    assert exc.value.code == code and words in exc.value.message


def test_a_pairing_ticket_passes_and_an_expired_one_is_refused():
    t = _ticket(ttl=10)
    t.check_pairing(2, LAYOUT, 3)
    with pytest.raises(TicketRefused) as exc:
        t.check_pairing(2, LAYOUT, 3, now_ns=t.expires_ns + 1)
    assert exc.value.code == ErrorCode.TICKET_EXPIRED and "expired" in exc.value.message


def test_an_altered_or_unsigned_ticket_fails_the_hmac():
    t = _ticket(secret=SECRET)
    altered = Ticket(t.namespace, t.tp_size, t.layout, (7, 8, 9), t.expires_ns, t.nonce,
                     t.ranks, t.mac)
    for bad, words in ((altered, "bad HMAC"), (_ticket(), "not signed")):
        with pytest.raises(TicketRefused) as exc:
            Ticket.from_bytes(bad.to_bytes()).verify(SECRET)
        assert exc.value.code == ErrorCode.AUTH_FAILED and words in exc.value.message
    with pytest.raises(TicketRefused):
        t.verify(b"another-secret-of-enough-length!")


@pytest.mark.parametrize("raw,words", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"kind": "other"}), "not a kvswap peer ticket"),
    (msgpack.packb([1, 2]), "not a kvswap peer ticket"),
    ("text", "a ticket is bytes"),
])
def test_garbage_is_refused_with_a_clear_error(raw, words):
    with pytest.raises(TicketRefused) as exc:
        Ticket.from_bytes(raw)
    assert exc.value.code == ErrorCode.TICKET_MISMATCH and words in exc.value.message


@pytest.mark.parametrize("field,value", [
    ("exp", float("inf")), ("exp", 1.5), ("tp", True), ("ids", [3, 4.0, 5]),
    ("nonce", 10**9), ("layout", 10**9), ("mac", 7),
])
def test_a_field_of_the_wrong_type_is_refused_not_converted(field, value):
    """int() of an infinite float raised OverflowError (it killed the receiving daemon's
    listener thread), int(1.7) read as 1, bytes(10**9) allocated a gigabyte: every field
    must arrive as the type it was packed as."""
    body = _ticket().body()
    body[field] = value
    with pytest.raises(TicketRefused) as exc:
        Ticket.from_bytes(msgpack.packb(body))
    assert exc.value.code == ErrorCode.TICKET_MISMATCH and "malformed" in exc.value.message
    entry = _ticket().body()
    entry["ranks"][0]["epoch"] = float("inf")
    with pytest.raises(TicketRefused, match="rank entry is malformed"):
        Ticket.from_bytes(msgpack.packb(entry))


@pytest.mark.parametrize("field,value,words", [
    ("notify", "bogus", "notify (its completion listener) must be 'tcp://HOST:PORT'"),
    ("notify", "tcp://a b:5", "notify"),
    ("notify", "tcp://10.0.0.1:0", "notify"),
    ("notify", "tcp://10.0.0.1:70000", "notify"),
    ("notify", "ipc:///tmp/x", "notify"),
    ("notify", "tcp://" + "h" * 300 + ":5", "notify"),
    ("notify", 7, "notify"),
    ("te", "bogus", "te (its Transfer Engine) must be 'HOST:PORT'"),
    ("te", "10.0.0.1:5\x00", "te"),
    ("te", ["10.0.0.1:5"], "te"),
])
def test_a_rank_entry_naming_an_unusable_endpoint_is_refused_naming_it(field, value, words):
    """``notify: "bogus"`` passed every check and then raised ZMQError in the sending
    daemon's peer worker, which died (its send unanswered, its blocks held; two such
    tickets and every later send hung).  It is refused where the entry is read, in
    the caller's thread of send_to and at the daemon's admission, naming the field."""
    body = _ticket().body()
    body["ranks"][1][field] = value
    with pytest.raises(TicketRefused) as exc:
        Ticket.from_bytes(msgpack.packb(body))
    assert exc.value.code == ErrorCode.TICKET_MISMATCH and words in exc.value.message, exc.value


@pytest.mark.parametrize("endpoint", [("[::1]:5", "tcp://[::1]:6"),
                                      ("node-7.cluster.local:15000", "tcp://node-7:25000")])
def test_host_names_and_ipv6_endpoints_are_kept(endpoint):
    body = _ticket().body()
    body["ranks"][0]["te"], body["ranks"][0]["notify"] = endpoint
    assert (Ticket.from_bytes(msgpack.packb(body)).ranks[0].te,
            Ticket.from_bytes(msgpack.packb(body)).ranks[0].notify) == endpoint


@pytest.mark.parametrize("where,field,value", [
    ("ticket", "ids", [3, -1, 5]), ("ticket", "ids", [3, 2**63, 5]), ("ticket", "tp", 0),
    ("rank", "bases", [0, 1 << 30]), ("rank", "bases", [2**64 - 1, 1 << 30]),
    ("rank", "block_bytes", [0, 4096]), ("rank", "block_bytes", [-4096, 4096]),
])
def test_ids_addresses_and_sizes_out_of_range_are_refused(where, field, value):
    """A sender plans its spans in int64: an id or address past 2**63 raised
    OverflowError in its peer worker, a negative one named another address."""
    body = _ticket().body()
    (body if where == "ticket" else body["ranks"][0])[field] = value
    with pytest.raises(TicketRefused) as exc:
        Ticket.from_bytes(msgpack.packb(body))
    assert exc.value.code == ErrorCode.TICKET_MISMATCH and "out of range" in exc.value.message


def test_a_ticket_whose_rank_list_disagrees_with_its_tp_size_is_malformed():
    body = msgpack.unpackb(_ticket().to_bytes())
    body["tp"] = 3
    with pytest.raises(TicketRefused, match="malformed"):
        Ticket.from_bytes(msgpack.packb(body))


def test_spans_merge_runs_consecutive_on_both_sides():
    srcs, dsts, lens = plan_spans([1000, 50000], [9000, 90000], [10, 20],
                                  np.array([0, 1, 2, 7, 8]), np.array([5, 6, 7, 1, 3]))
    # runs: (0..2 -> 5..7), (7 -> 1), (8 -> 3): three spans per tensor
    assert srcs == [1000, 1070, 1080, 50000, 50140, 50160]
    assert dsts == [9050, 9010, 9030, 90100, 90020, 90060]
    assert lens == [30, 10, 10, 60, 20, 20]
    assert plan_spans([0], [0], [8], np.array([], dtype=np.int64),
                      np.array([], dtype=np.int64)) == ([], [], [])


def test_peer_host_defaults_to_the_tcp_host_else_loopback():
    base = dict(namespace="n", rank=0, tp_size=1)
    assert DaemonConfig(**base).peer_address == "127.0.0.1"
    assert DaemonConfig(**base, listen_tcp="tcp://10.1.2.3:7000").peer_address == "10.1.2.3"
    assert DaemonConfig(**base, listen_tcp="tcp://10.1.2.3:7000",
                        peer_host="192.168.0.9").peer_address == "192.168.0.9"


def test_early_begins_are_capped_by_count_and_bytes_and_freed_when_handled(monkeypatch):
    """Begins that reach a receiver before their receive are kept, each with its
    ticket: an unauthenticated peer must not make the daemon keep more than the caps
    (40 begins of 8 MiB tickets took 340 MB before).  A begin handled (its receive
    admitted) gives its bytes back; one for an expired or foreign ticket is refused
    without being kept."""
    from kvswap.daemon import peer_early
    from kvswap.daemon.peer_early import EarlyBegins

    answers: list = []
    early = EarlyBegins(0, 30.0, b"", lambda ident, code, message: answers.append((ident, code,
                                                                                   message)))
    tickets = [_ticket(ttl=60.0) for _ in range(3)]
    raws = [t.to_bytes() for t in tickets]
    monkeypatch.setattr(peer_early, "MAX_EARLY_BYTES", len(raws[0]) + len(raws[1]))
    for i, (t, raw) in enumerate(zip(tickets, raws)):
        early.park(b"id%d" % i, t.nonce, raw)
    assert [(i, c) for i, c, _ in answers] == [(b"id2", ErrorCode.TICKET_MISMATCH)]
    assert "bytes of tickets wait already" in answers[0][2]
    handled = list(early.due(lambda nonce: "receive" if nonce == tickets[0].nonce else None,
                             0.0))
    assert [h[:4] for h in handled] == [(b"id0", tickets[0].nonce, raws[0], "receive")]
    early.park(b"id2", tickets[2].nonce, raws[2])  # room again
    assert len(answers) == 1 and len(early.deadlines()) == 2
    expired = _ticket(ttl=-1.0)
    early.park(b"old", expired.nonce, expired.to_bytes())
    early.park(b"odd", tickets[0].nonce, raws[1])  # another receive's ticket
    assert [(i, c) for i, c, _ in answers[1:]] == [(b"old", ErrorCode.TICKET_EXPIRED),
                                                    (b"odd", ErrorCode.TICKET_MISMATCH)]
    # a begin keeps the deadline it arrived with, and past it is refused even when its
    # receive is admitted (it used to be handed over with a fresh --peer-timeout)
    monkeypatch.setattr(peer_early, "MAX_EARLY_BYTES", 1 << 20)
    late = _ticket(ttl=60.0)
    before = set(early.deadlines())
    early.park(b"late", late.nonce, late.to_bytes())
    (deadline,) = set(early.deadlines()) - before
    handed = list(early.due(lambda nonce: "receive" if nonce == late.nonce else None,
                            deadline - 1.0))
    assert [(h[0], h[4].deadline) for h in handed] == [(b"late", deadline)]
    early.park(b"late", late.nonce, late.to_bytes())
    (deadline,) = set(early.deadlines()) - before
    assert list(early.due(lambda nonce: "receive", deadline)) == []  # its sender gave up
    assert answers[-1][0] == b"late" and "after 30.0s" in answers[-1][2]


def test_early_begins_of_a_namespace_with_a_secret_keep_only_tickets_signed_with_it():
    """Where the namespace has a secret, a begin that overtook its receive is kept
    only if its ticket carries that secret's MAC: a peer without the secret could
    otherwise fill the places of real senders' early begins with forged tickets."""
    from kvswap.daemon.peer_early import EarlyBegins

    answers: list = []
    early = EarlyBegins(0, 30.0, b"s" * 32, lambda ident, code, message: answers.append(
        (ident, code, message)))
    unsigned, forged = _ticket(ttl=60.0), _ticket(ttl=60.0).signed(b"x" * 32)
    good = _ticket(ttl=60.0).signed(b"s" * 32)
    for ident, t in ((b"unsigned", unsigned), (b"forged", forged), (b"good", good)):
        early.park(ident, t.nonce, t.to_bytes())
    assert [(i, c) for i, c, _ in answers] == [(b"unsigned", ErrorCode.AUTH_FAILED),
                                               (b"forged", ErrorCode.AUTH_FAILED)]
    assert len(early.deadlines()) == 1  # only the signed one waits
