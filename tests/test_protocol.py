"""Wire protocol: encoding round trips, decode-time rejections, docs in sync with code."""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvswap.client import CacheTensor, CacheWorker
from kvswap.client.block_keys import block_hashes
from kvswap.client.errors import ErrorCode, InvalidTask, TransferFailed, RankFailure, error_for_code
from kvswap.client.ticket import RankEndpoint, Ticket
from kvswap.client.protocol import (
    OPS,
    PROTOCOL_VERSION,
    BatchItem,
    HandlerKind,
    Lane,
    Op,
    OpSpec,
    Reply,
    RequestError,
    as_block_ids,
    as_keys,
    decode_batch,
    decode_reply,
    decode_request,
    decode_transfer,
    encode_batch,
    encode_reply,
    encode_request,
    encode_transfer,
    packb,
    storage_message,
    validate_transfer,
)
from kvswap.client.signals import HEADER_FIELDS, HIST_OPS, RANK_FIELDS
from kvswap.daemon.scheduler import LANES
from kvswap.daemon.jobs import STORAGE_OPS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _bufs(frames):
    return [memoryview(f) if not isinstance(f, bytes) else f for f in frames]


def test_transfer_round_trip_is_zero_copy_and_exact():
    dev = as_block_ids([3, 4, 9], "device")
    host = as_block_ids(np.array([0, 1, 2], dtype=np.uint16), "host")
    frames = encode_transfer(Op.EVICT, 42, dev, host)
    req = decode_request(_bufs(frames))
    assert (req.id, req.op) == (42, Op.EVICT)
    assert req.header["v"] == list(PROTOCOL_VERSION)
    d, h = decode_transfer(req)
    assert d.tolist() == [3, 4, 9] and h.tolist() == [0, 1, 2]
    assert d.dtype == np.dtype("<i4")
    # zero-copy: the decoded array is a view of the frame buffer
    assert not d.flags.owndata


def test_large_ids_travel_as_int64():
    dev = as_block_ids([2**31 + 5], "device")
    host = as_block_ids([1], "host")
    frames = encode_transfer(Op.LOAD, 1, dev, host)
    d, h = decode_transfer(decode_request(_bufs(frames)))
    assert d.dtype == np.dtype("<i8") and h.dtype == np.dtype("<i8")
    assert int(d[0]) == 2**31 + 5


def test_as_block_ids_copies_so_later_mutation_cannot_race_the_send():
    src = np.array([1, 2, 3], dtype="<i4")
    ids = as_block_ids(src, "x")
    src[0] = 99
    assert ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize("bad, code", [
    ([1.5, 2.0], ErrorCode.BAD_ID_DTYPE),
    ([True, False], ErrorCode.BAD_ID_DTYPE),
    ([[1, 2]], ErrorCode.BAD_ID_DTYPE),
    ([-1, 2], ErrorCode.ID_OUT_OF_RANGE),
])
def test_as_block_ids_rejects(bad, code):
    with pytest.raises(InvalidTask) as ei:
        as_block_ids(bad, "ids")
    assert ei.value.code == code


def test_reply_round_trip():
    raw = encode_reply(7, 1, ErrorCode.ID_OUT_OF_RANGE, "nope", 12.5, 3.5, bytes=10)
    r = decode_reply(raw)
    assert (r.id, r.rank, r.ok, r.code, r.message) == (7, 1, False, ErrorCode.ID_OUT_OF_RANGE,
                                                       "nope")
    assert (r.queued_us, r.exec_us, r.fields) == (12.5, 3.5, {"bytes": 10})
    assert decode_reply(encode_reply(8, 0)).ok


def _hdr(**kw):
    h = {"v": list(PROTOCOL_VERSION), "id": 5, "op": "ping"}
    h.update(kw)
    return packb({k: v for k, v in h.items() if v is not ...})


@pytest.mark.parametrize("frames, code", [
    ([], ErrorCode.PROTOCOL_ERROR),
    ([b"\xc1\xc1"], ErrorCode.PROTOCOL_ERROR),  # 0xc1 is never valid msgpack
    ([packb([1, 2, 3])], ErrorCode.PROTOCOL_ERROR),
    ([_hdr(id="x")], ErrorCode.BAD_FIELD),
    ([_hdr(id=True)], ErrorCode.BAD_FIELD),
    ([_hdr(v=...)], ErrorCode.BAD_FIELD),
    ([_hdr(v=[PROTOCOL_VERSION[0] + 1, 0])], ErrorCode.VERSION_MISMATCH),
    ([_hdr(op="explode")], ErrorCode.UNKNOWN_OP),
    ([_hdr(op=3)], ErrorCode.UNKNOWN_OP),
    ([_hdr(op="evict", ids="<i4", n=1)], ErrorCode.BAD_FRAMES),
    ([_hdr(op="evict", ids="<i4", n="1"), b"", b""], ErrorCode.BAD_FIELD),
    ([_hdr(op="evict", n=0), b"", b""], ErrorCode.BAD_FIELD),
    ([_hdr(), b"extra"], ErrorCode.BAD_FRAMES),
])
def test_decode_request_rejections(frames, code):
    with pytest.raises(RequestError) as ei:
        decode_request(frames)
    assert ei.value.code == code


def test_decode_keeps_id_when_known_and_ignores_unknown_fields():
    with pytest.raises(RequestError) as ei:
        decode_request([_hdr(op="explode")])
    assert ei.value.req_id == 5
    req = decode_request([_hdr(future_field={"x": 1})])
    assert req.op is Op.PING


def test_minor_version_is_accepted():
    req = decode_request([_hdr(v=[PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7])])
    assert req.op is Op.PING


def test_oversized_header_rejected():
    with pytest.raises(RequestError) as ei:
        decode_request([_hdr(pad="x" * 5000)], max_header_bytes=1000)
    assert ei.value.code == ErrorCode.MESSAGE_TOO_LARGE


def _transfer_req(op, dev, host, dtype="<i4", n=None):
    n = len(dev) if n is None else n
    frames = encode_request(op, 1, {"ids": dtype, "n": n},
                            (np.asarray(dev, dtype=dtype).tobytes(),
                             np.asarray(host, dtype=dtype).tobytes()))
    return decode_request(frames)


@pytest.mark.parametrize("op, dev, host, dtype, n, code", [
    (Op.EVICT, [1, 2], [1], "<i4", 2, ErrorCode.LENGTH_MISMATCH),
    (Op.EVICT, [1, 2], [1, 2], "<i4", 3, ErrorCode.BAD_FIELD),
    (Op.EVICT, [1, 2], [1, 2], "<f4", 2, ErrorCode.BAD_ID_DTYPE),
    (Op.EVICT, [1, 2], [1, 2], ">i4", 2, ErrorCode.BAD_ID_DTYPE),
])
def test_decode_transfer_rejections(op, dev, host, dtype, n, code):
    with pytest.raises(InvalidTask) as ei:
        decode_transfer(_transfer_req(op, dev, host, dtype, n))
    assert ei.value.code == code


def test_ragged_id_frame_rejected():
    frames = encode_request(Op.LOAD, 1, {"ids": "<i4", "n": 1}, (b"\x01\x00\x00", b"\x01\x00\x00"))
    with pytest.raises(InvalidTask) as ei:
        decode_transfer(decode_request(frames))
    assert ei.value.code == ErrorCode.BAD_ID_DTYPE


@pytest.mark.parametrize("op, dev, host, code", [
    (Op.EVICT, [0, 10], [0, 1], ErrorCode.ID_OUT_OF_RANGE),  # device limit 10
    (Op.EVICT, [0, 1], [0, 20], ErrorCode.ID_OUT_OF_RANGE),  # host limit 20
    (Op.LOAD, [-1, 1], [0, 1], ErrorCode.ID_OUT_OF_RANGE),
    (Op.EVICT, [0, 1], [3, 3], ErrorCode.DUPLICATE_DESTINATION),  # evict: host is destination
    (Op.LOAD, [4, 4], [0, 1], ErrorCode.DUPLICATE_DESTINATION),  # load: device is destination
    (Op.LOAD, [1, 2, 3], [0, 1], ErrorCode.LENGTH_MISMATCH),
])
def test_validate_transfer_rejections(op, dev, host, code):
    with pytest.raises(InvalidTask) as ei:
        validate_transfer(op, np.array(dev), np.array(host), 10, 20)
    assert ei.value.code == code


def test_duplicate_sources_are_allowed():
    # evict: repeating a device (source) block into two host blocks is well defined
    validate_transfer(Op.EVICT, np.array([2, 2]), np.array([0, 1]), 10, 20)
    validate_transfer(Op.LOAD, np.array([0, 1]), np.array([5, 5]), 10, 20)


def test_op_table_is_consistent():
    assert set(OPS) == set(Op)
    for op in (Op.EVICT, Op.LOAD):
        assert OPS[op].id_frames == 2 and OPS[op].kind is HandlerKind.TRANSFER
    assert OPS[Op.BATCH].id_frames is None  # two per task, checked by decode_batch
    for spec in OPS.values():
        if spec.kind is HandlerKind.INLINE and spec.op is not Op.BATCH:
            assert spec.id_frames == 0


def test_lanes_storage_ops_and_histograms_derive_from_the_op_table():
    """The scheduler's lanes (and their pick order), the daemon's storage ops and the
    histogram layout follow the op table; the values are today's behaviour."""
    assert LANES == {"transfer": (Op.LOAD, Op.EVICT),
                     "storage": (Op.PREFETCH, Op.BACKUP, Op.EXISTS),
                     "peer": (Op.PEER_RECV, Op.PEER_SEND)}
    assert STORAGE_OPS == {Op.BACKUP, Op.PREFETCH, Op.EXISTS}
    assert HIST_OPS == ("evict", "load", "backup", "prefetch")
    scheduled = {op for ops in LANES.values() for op in ops}
    assert scheduled == {op for op, spec in OPS.items() if spec.kind is HandlerKind.TRANSFER}
    with pytest.raises(ValueError, match="exactly the TRANSFER ops have a lane"):
        OpSpec(Op.PING, {}, 0, HandlerKind.INLINE, {}, lane=Lane.TRANSFER)
    with pytest.raises(ValueError, match="exactly the TRANSFER ops have a lane"):
        OpSpec(Op.EVICT, {}, 2, HandlerKind.TRANSFER, {})
    with pytest.raises(ValueError, match="only a scheduled op"):
        OpSpec(Op.STATS, {}, 0, HandlerKind.INLINE, {}, timed=True)
    with pytest.raises(ValueError, match="only a peer-lane op can be held"):
        OpSpec(Op.EVICT, {}, 2, HandlerKind.TRANSFER, {}, lane=Lane.TRANSFER, held=True)


def test_a_batch_carries_copies_only():
    ids = np.array([0], "<i4")
    frames = [packb({"v": list(PROTOCOL_VERSION), "id": 1, "op": "batch", "ids": "<i4",
                     "tasks": [{"id": 2, "op": "backup", "n": 1}]}), ids, ids]
    with pytest.raises(RequestError, match="op must be evict or load"):
        decode_batch(decode_request(frames))


def test_error_codes_map_back_to_classes():
    e = error_for_code(201, "x")
    assert isinstance(e, InvalidTask) and e.code == ErrorCode.ID_OUT_OF_RANGE
    assert error_for_code(9999, "y").code == ErrorCode.PROTOCOL_ERROR
    tf = TransferFailed(3, "evict", [RankFailure(1, ErrorCode.NOT_READY, "b"),
                                     RankFailure(0, ErrorCode.ID_OUT_OF_RANGE, "a")])
    assert [f.rank for f in tf.failures] == [0, 1]
    assert tf.code == ErrorCode.ID_OUT_OF_RANGE
    assert "rank 0" in str(tf) and "rank 1" in str(tf) and "task 3" in str(tf)


# ------------------------------------------------------------------ docs in sync


def test_protocol_doc_version_matches_code():
    text = (DOCS / "protocol.md").read_text()
    m = re.search(r"^PROTOCOL_VERSION = (\d+)\.(\d+)$", text, re.M)
    assert m, "docs/protocol.md must state 'PROTOCOL_VERSION = X.Y' on a line of its own"
    assert (int(m.group(1)), int(m.group(2))) == PROTOCOL_VERSION


def test_protocol_doc_names_every_op_and_code():
    text = (DOCS / "protocol.md").read_text()
    missing = [op.value for op in Op if f"`{op.value}`" not in text]
    missing += [c.name for c in ErrorCode if c.name not in text]
    assert not missing, f"docs/protocol.md does not document: {missing}"


_DOC_TYPE = {str: "str", int: "int", float: "float", bool: "bool", list: "array", dict: "map"}
_DOC_FIELD = re.compile(r"`(\w+)` \(([a-z]+)")


def _doc_op_rows() -> list[list[str]]:
    """The cells of each row of the op table in docs/protocol.md section 4."""
    text = (DOCS / "protocol.md").read_text()
    section = text[text.index("\n## 4. Ops"):text.index("\n## 5.")]
    head = section.index("\n| op | required fields (type) | optional fields (type) | id frames | "
                         "kind | lane | reply fields | meaning |")
    table = section[head:].strip().split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in table]


def _doc_fields(cell: str) -> dict[str, str]:
    return dict(_DOC_FIELD.findall(cell))


def test_protocol_doc_op_table_equals_the_op_table():
    rows = _doc_op_rows()
    assert [r[0] for r in rows] == [f"`{op.value}`" for op in OPS], "ops or their order differ"
    for row, spec in zip(rows, OPS.values()):
        _, required, optional, frames, kind, lane, reply, _meaning = row
        what = f"docs/protocol.md section 4, op {spec.op.value}"
        assert _doc_fields(required) == {k: _DOC_TYPE[t] for k, t in spec.fields.items()}, what
        assert _doc_fields(optional) == {k: _DOC_TYPE[t] for k, t in spec.optional.items()}, what
        assert _doc_fields(reply) == {k: _DOC_TYPE[t] for k, t in spec.reply.items()}, what
        m = re.fullmatch(r"(\d+)( per task)?(: .+)?", frames)
        assert m, f"{what}: id frames {frames!r}"
        if spec.id_frames is None:  # the handler counts them: two per batch task
            assert m.group(2), what
        else:
            assert int(m.group(1)) == spec.id_frames and not m.group(2), what
        assert kind.split()[0] == spec.kind.name, what
        assert lane == ("–" if spec.lane is Lane.NONE else spec.lane.value), what


class _Peer:
    """A raw DEALER to one rank: sends requests, sorts the replies by id."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replies: dict[int, Reply] = {}

    def ask(self, frames: list, req_id: int, timeout_s: float = 20.0) -> Reply:
        self.sock.send_multipart(frames)
        return self.reply(req_id, timeout_s)

    def reply(self, req_id: int, timeout_s: float = 20.0) -> Reply:
        deadline = time.monotonic() + timeout_s
        while req_id not in self.replies:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sock.poll(left_ms), f"no reply to request {req_id}"
            r = decode_reply(self.sock.recv_multipart()[0])
            self.replies[r.id] = r
        return self.replies.pop(req_id)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _check_reply(r: Reply, op: Op) -> None:
    assert r.ok, f"{op.value}: [{r.code}] {r.message}"
    want = OPS[op].reply
    assert set(r.fields) == set(want), f"{op.value} replied {sorted(r.fields)}"
    for name, t in want.items():
        value = r.fields[name]
        assert isinstance(value, t) and (t is bool or not isinstance(value, bool)), \
            f"{op.value}: reply field {name}={value!r} is not {t.__name__}"


def test_every_reply_carries_the_fields_of_its_op(namespaces):
    """Every op against a live daemon (host backend, a storage tier): an OK reply has
    exactly OpSpec.reply beyond the common fields, with those types."""
    store = f"file://{namespaces.run_root}/store"
    try:
        import mooncake.engine  # noqa: F401
        peer_transfer = "tcp"
    except ImportError:  # the peer ops are then checked by name only (they need the engine)
        peer_transfer = None
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False, host_blocks=8,
                                 storage_url=store, peer_transfer=peer_transfer)
    names = launcher.names
    sent: set[Op] = set()
    peer = _Peer(names.endpoint(0))
    try:
        with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as worker:
            k0 = worker.alloc_host_tensor("k0", (8, 64), "uint8")
            _check_reply(worker.register([CacheTensor("k0", 0, k0)]), Op.REGISTER)
            sent.add(Op.REGISTER)
            launcher.wait_ready(timeout=30)
            ids = iter(range(1, 1000))

            def ask(op: Op, frames_of) -> Reply:
                req_id = next(ids)
                sent.add(op)
                return peer.ask(frames_of(req_id), req_id)

            for op in (Op.PING, Op.STATS):
                _check_reply(ask(op, lambda i, op=op: encode_request(op, i)), op)
            dev, host = as_block_ids([0, 1], "device"), as_block_ids([2, 3], "host")
            for op in (Op.EVICT, Op.LOAD):
                _check_reply(ask(op, lambda i, op=op: encode_transfer(op, i, dev, host)), op)
            evict_id, load_id = 900, 901
            batch = ask(Op.BATCH, lambda i: encode_batch(i, [
                BatchItem(evict_id, Op.EVICT, dev, host), BatchItem(load_id, Op.LOAD, dev, host)]))
            _check_reply(batch, Op.BATCH)
            assert batch.fields["accepted"] == 2
            _check_reply(peer.reply(evict_id), Op.EVICT)  # each task under its own id
            _check_reply(peer.reply(load_id), Op.LOAD)
            cancel = ask(Op.CANCEL, lambda i: encode_request(Op.CANCEL, i, {"target": 12345}))
            _check_reply(cancel, Op.CANCEL)
            assert cancel.fields["cancelled"] is False
            keys = as_keys(block_hashes(list(range(8)), 4))
            for op, blocks in ((Op.BACKUP, host), (Op.EXISTS, None), (Op.PREFETCH, host)):
                r = ask(op, lambda i, op=op, blocks=blocks:
                        storage_message(op, i, blocks, keys).frames())
                _check_reply(r, op)
                assert r.fields["count"] == 2
            if peer_transfer:  # a push from the rank into its own pool, over its engine
                info = ask(Op.PEER_INFO, lambda i: encode_request(Op.PEER_INFO, i))
                _check_reply(info, Op.PEER_INFO)
                ticket = Ticket.issue(names.namespace, bytes.fromhex(info.fields["layout"]), [5],
                                      [RankEndpoint.from_wire(info.fields)], 30, None).to_bytes()
                recv_id = next(ids)
                sent.add(Op.PEER_RECV)
                peer.sock.send_multipart(encode_request(Op.PEER_RECV, recv_id, {}, [ticket]))
                one = np.array([4], dtype="<i8")
                _check_reply(ask(Op.PEER_SEND, lambda i: encode_request(
                    Op.PEER_SEND, i, {"ids": "<i8", "n": 1}, [one, ticket])), Op.PEER_SEND)
                _check_reply(peer.reply(recv_id), Op.PEER_RECV)
            for op in (Op.PAUSE, Op.RESUME, Op.CLEAR, Op.RESTORE, Op.SHUTDOWN):
                _check_reply(ask(op, lambda i, op=op: encode_request(op, i)), op)
            assert launcher.procs[0].wait(timeout=20) == 0
    finally:
        peer.close()
    peer_ops = set() if peer_transfer else {Op.PEER_INFO, Op.PEER_RECV, Op.PEER_SEND}
    assert sent == set(Op) - peer_ops, f"not sent: {set(Op) - sent}"


def test_signals_doc_names_every_field():
    text = (DOCS / "signals.md").read_text()
    missing = [f.name for f in (*HEADER_FIELDS, *RANK_FIELDS) if f.name not in text]
    assert not missing, f"docs/signals.md does not document: {missing}"


def test_msgpack_header_is_a_map_with_version_first_class():
    frames = encode_request(Op.PING, 9)
    body = msgpack.unpackb(frames[0])
    assert body == {"v": list(PROTOCOL_VERSION), "id": 9, "op": "ping"}


@pytest.mark.parametrize("n", [2, 16, 64, 65, 5000])
def test_small_and_large_checks_agree(n):
    """The Python path (<= 64 ids) and the numpy path find the same duplicate."""
    from kvswap.client.protocol import first_duplicate
    rng = np.random.default_rng(n)
    ids = rng.permutation(10 * n)[:n]
    assert first_duplicate(ids) is None
    ids[-1] = ids[0]
    ids[n // 2] = ids[1] if n > 2 else ids[0]
    expected = int(min(ids[0], ids[1])) if n > 2 else int(ids[0])
    assert first_duplicate(ids) == expected


@pytest.mark.parametrize("bad", [-1, -2**63, 2**63, 2**64 - 1])
def test_ids_outside_int64_are_refused_before_they_reach_a_shm_table(bad):
    """Ids key the layer-progress, agreement and journal tables (64-bit slots): a
    negative or too large one used to raise deep inside a handler (fuzz finding)."""
    from kvswap.client.protocol import RequestError, decode_batch, decode_request, packb

    with pytest.raises(RequestError) as exc:
        decode_request([packb({"v": list(PROTOCOL_VERSION), "id": bad, "op": "ping"})])
    assert exc.value.code == ErrorCode.BAD_FIELD and "2**63" in exc.value.message
    header = {"v": list(PROTOCOL_VERSION), "id": 1, "op": "batch", "ids": "<i4",
              "tasks": [{"id": bad, "op": "evict", "n": 0}]}
    req = decode_request([packb(header), b"", b""])
    with pytest.raises(RequestError) as exc:
        decode_batch(req)
    assert exc.value.code == ErrorCode.BAD_FIELD and "batch task 0" in exc.value.message


@pytest.mark.parametrize("name, value", [("cid", None), ("cs", None), ("re", None),
                                         ("cs", -1), ("cid", "1"), ("re", 1)])
def test_client_fields_present_but_mistyped_are_refused(name, value):
    """cid/cs/re present with nil or another type are BAD_FIELD at decoding (a nil cs
    used to pass as absent and fail in the journal with INTERNAL_ERROR; fuzz finding)."""
    from kvswap.client.protocol import RequestError, decode_request, packb

    header = {"v": list(PROTOCOL_VERSION), "id": 7, "op": "ping", name: value}
    with pytest.raises(RequestError) as exc:
        decode_request([packb(header)])
    assert exc.value.code == ErrorCode.BAD_FIELD and repr(name) in exc.value.message
