"""Wire protocol: encoding round trips, decode-time rejections, docs in sync with code."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvswap.client.errors import ErrorCode, InvalidTask, TransferFailed, RankFailure, error_for_code
from kvswap.client.protocol import (
    OPS,
    PROTOCOL_VERSION,
    HandlerKind,
    Op,
    RequestError,
    as_block_ids,
    decode_reply,
    decode_request,
    decode_transfer,
    encode_reply,
    encode_request,
    encode_transfer,
    packb,
    validate_transfer,
)
from kvswap.client.signals import HEADER_FIELDS, RANK_FIELDS

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


def test_signals_doc_names_every_field():
    text = (DOCS / "signals.md").read_text()
    missing = [f.name for f in (*HEADER_FIELDS, *RANK_FIELDS) if f.name not in text]
    assert not missing, f"docs/signals.md does not document: {missing}"


def test_msgpack_header_is_a_map_with_version_first_class():
    frames = encode_request(Op.PING, 9)
    body = msgpack.unpackb(frames[0])
    assert body == {"v": list(PROTOCOL_VERSION), "id": 9, "op": "ping"}


@pytest.mark.parametrize("n", [2, 16, 17, 5000])
def test_small_and_large_checks_agree(n):
    """The Python path (<= 16 ids) and the numpy path find the same duplicate."""
    from kvswap.client.protocol import first_duplicate
    rng = np.random.default_rng(n)
    ids = rng.permutation(10 * n)[:n]
    assert first_duplicate(ids) is None
    ids[-1] = ids[0]
    ids[n // 2] = ids[1] if n > 2 else ids[0]
    expected = int(min(ids[0], ids[1])) if n > 2 else int(ids[0])
    assert first_duplicate(ids) == expected
