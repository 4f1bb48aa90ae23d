"""Storage tier: block keys, entry format, file and Redis backends.

The Redis tests run against a real ``redis-server`` (the session fixture
``redis_server`` of conftest.py); they skip when the binary is missing
(``.ci/run`` installs it).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing as mp
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.client.block_keys import (
    FINGERPRINT_BYTES,
    KEY_BYTES,
    ROOT_KEY,
    block_hashes,
    entry_name,
    model_fingerprint,
)
from kvswap.client.errors import ErrorCode, StorageError, StorageTimeout, error_for_code
from kvswap.client.layout import TensorDesc, layout_hash
from kvswap.daemon.storage import (
    BACKENDS,
    HEADER_BYTES,
    CorruptEntry,
    NotAnEntry,
    StorageBackend,
    check_url,
    open_backend,
    pack_entry,
    registered_schemes,
    unpack_entry,
)
from kvswap.daemon.storage.file import TMP_PREFIX, FileBackend, shard_of
from kvswap.daemon.storage.url_options import MIN_SECONDS, parse_seconds

FP = model_fingerprint(bytes(range(32)), "test-model@tp2")
OTHER_FP = model_fingerprint(bytes(range(32)), "other-model@tp2")


def _name(i: int | str, rank: int = 0, fp: bytes = FP) -> str:
    return entry_name(hashlib.sha256(str(i).encode()).digest(), rank, fp)


def _parts(name: str, sizes: tuple[int, ...] = (1024, 512, 3000)) -> list[np.ndarray]:
    """Payload parts whose bytes follow from the name (so any stored copy is checkable)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def _payload(name: str, sizes: tuple[int, ...] = (1024, 512, 3000)) -> bytes:
    return b"".join(p.tobytes() for p in _parts(name, sizes))


PAYLOAD_LEN = 1024 + 512 + 3000
ENTRY_LEN = HEADER_BYTES + PAYLOAD_LEN


# ------------------------------------------------------------------ block keys

tokens_st = st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 50), max_size=70)
block_size_st = st.integers(1, 8)


@settings(max_examples=200, deadline=None)
@given(tokens_st, tokens_st, block_size_st)
def test_shared_prefix_gives_shared_keys(a, b, bs):
    keys_a, keys_b = block_hashes(a, bs), block_hashes(b, bs)
    assert len(keys_a) == len(a) // bs and len(keys_b) == len(b) // bs  # no partial-block key
    assert all(len(k) == KEY_BYTES for k in keys_a)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_blocks = common // bs
    assert keys_a[:shared_blocks] == keys_b[:shared_blocks]
    # the first block that differs, and every later one, differs
    for n in range(shared_blocks, min(len(keys_a), len(keys_b))):
        assert keys_a[n] != keys_b[n]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=60), block_size_st, st.data())
def test_changing_a_token_changes_its_block_and_every_later_one(tokens, bs, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = tokens[i] + data.draw(st.integers(1, 5))
    before, after = block_hashes(tokens, bs), block_hashes(changed, bs)
    block = i // bs
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=4, max_size=40), st.integers(1, 4), st.data())
def test_extra_keys_matter_from_their_block_on(tokens, bs, data):
    n = len(tokens) // bs
    j = data.draw(st.integers(0, n - 1))
    extra = data.draw(st.integers(-2**70, 2**70) | st.text(max_size=5) | st.binary(max_size=5))
    extras = [None] * n
    extras[j] = [extra]
    plain, with_extra = block_hashes(tokens, bs), block_hashes(tokens, bs, extra_keys=extras)
    assert plain[:j] == with_extra[:j]
    assert all(x != y for x, y in zip(plain[j:], with_extra[j:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=50), st.integers(1, 6), st.data())
def test_parent_continues_a_chain(tokens, bs, data):
    keys = block_hashes(tokens, bs)
    k = data.draw(st.integers(1, max(1, len(keys))))
    if keys:
        assert block_hashes(tokens[k * bs:], bs, parent=keys[k - 1]) == keys[k:]
    other_parent = hashlib.sha256(b"elsewhere").digest()
    moved = block_hashes(tokens, bs, parent=other_parent)
    assert len(moved) == len(keys) and not set(moved) & set(keys)
    assert block_hashes(tokens, bs, parent=ROOT_KEY) == keys


def test_extra_keys_are_typed_and_length_prefixed():
    tokens = list(range(8))

    def key(extra):
        return block_hashes(tokens, 8, extra_keys=[extra])[0]

    plain = block_hashes(tokens, 8)[0]
    assert key(None) == key([]) == plain == block_hashes(tokens, 8, extra_keys=[])[0]
    variants = [[1], ["1"], [b"\x01"], ["ab", "c"], ["a", "bc"], ["abc"], [b"ab", b"c"],
                [0], [-1], [255], [256], [2**64], [1, 2], [2, 1], [""], [b""]]
    keys = [key(v) for v in variants]
    assert len(set(keys)) == len(keys) and plain not in keys
    assert key([np.int64(7)]) == key([7])
    # one entry for the incomplete last block is allowed and ignored
    assert block_hashes(list(range(10)), 8, extra_keys=[None, ["x"]]) == [plain]


def test_key_bytes_are_as_documented():
    """Re-derive keys from the byte layout in block_keys / docs/storage.md."""
    tokens, bs = [1, 2, 3, 4, 5, 6, 7, 8, 9], 4
    extras = [None, ["img", b"\x00\x01", 300]]
    k0 = hashlib.sha256(b"kvswap-block-v1\x00" + struct.pack("<Q", bs) + ROOT_KEY
                        + struct.pack("<4q", 1, 2, 3, 4) + struct.pack("<I", 0)).digest()
    extra_bytes = (struct.pack("<I", 3) + b"s" + struct.pack("<I", 3) + b"img"
                   + b"b" + struct.pack("<I", 2) + b"\x00\x01"
                   + b"i" + struct.pack("<I", 2) + (300).to_bytes(2, "little", signed=True))
    k1 = hashlib.sha256(b"kvswap-block-v1\x00" + struct.pack("<Q", bs) + k0
                        + struct.pack("<4q", 5, 6, 7, 8) + extra_bytes).digest()
    assert block_hashes(tokens, bs, extra_keys=extras) == [k0, k1]
    assert ROOT_KEY == hashlib.sha256(b"kvswap-block-root-v1").digest()


_KEYS_SCRIPT = textwrap.dedent("""
    import json, sys
    from kvswap.client.block_keys import block_hashes, entry_name, model_fingerprint
    keys = block_hashes(list(range(1000, 1100)), 16, extra_keys=[["a", 1, b"b"]] * 6)
    fp = model_fingerprint(bytes(32), "m")
    print(json.dumps({"keys": [k.hex() for k in keys], "name": entry_name(keys[0], 3, fp)}))
""")


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_keys_are_deterministic_across_processes(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=60, check=True)
    theirs = json.loads(out.stdout)
    keys = block_hashes(list(range(1000, 1100)), 16, extra_keys=[["a", 1, b"b"]] * 6)
    assert theirs["keys"] == [k.hex() for k in keys]
    assert theirs["name"] == entry_name(keys[0], 3, model_fingerprint(bytes(32), "m"))


@pytest.mark.parametrize("call, match", [
    (lambda: block_hashes([1, 2], 0), "block_size"),
    (lambda: block_hashes([1, 2], True), "block_size"),
    (lambda: block_hashes([1, -2], 2), r"token_ids\[1\] = -2"),
    (lambda: block_hashes([1, 2**63], 2), r"token_ids\[1\]"),
    (lambda: block_hashes([1, 2.0], 2), r"token_ids\[1\] must be an int"),
    (lambda: block_hashes(["1", 2], 2), r"token_ids\[0\] must be an int"),
    (lambda: block_hashes([1, 2, 3], 2, extra_keys=[None, None, None]), "extra_keys has 3"),
    (lambda: block_hashes([1, 2], 2, extra_keys=["ab"]), "bare str"),
    (lambda: block_hashes([1, 2], 2, extra_keys=[[True]]), "bool"),
    (lambda: block_hashes([1, 2], 2, extra_keys=[[1.5]]), "int, str or bytes"),
    (lambda: block_hashes([1, 2], 2, parent=b"short"), "parent"),
    (lambda: model_fingerprint(b"x" * 31, "m"), "layout_hash"),
    (lambda: model_fingerprint(b"x" * 32, ""), "model_id"),
    (lambda: entry_name(b"k" * 31, 0, FP), "key"),
    (lambda: entry_name(b"k" * 32, -1, FP), "rank"),
    (lambda: entry_name(b"k" * 32, 0, b"f" * 32), "fingerprint"),
])
def test_bad_key_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fingerprints_and_names_separate_models_and_ranks():
    lay = layout_hash([TensorDesc("k0", 0, "<f2", (8, 16, 2, 64)),
                       TensorDesc("v0", 0, "<f2", (8, 16, 2, 64))])
    other = layout_hash([TensorDesc("k0", 0, "<f2", (8, 16, 4, 64)),
                         TensorDesc("v0", 0, "<f2", (8, 16, 4, 64))])
    fps = {model_fingerprint(lay, "m"), model_fingerprint(lay, "m2"),
           model_fingerprint(other, "m")}
    assert len(fps) == 3 and all(len(f) == FINGERPRINT_BYTES for f in fps)
    key = block_hashes(list(range(16)), 16)[0]
    names = {entry_name(key, r, f) for r in range(4) for f in fps}
    assert len(names) == 12
    for name in names:
        assert len(name) <= 120 and all(c in "abcdefghijklmnopqrstuvwxyz0123456789." for c in name)
    assert entry_name(key, 3, FP) == f"kvswap.{FP.hex()}.r3.{key.hex()}"


# ------------------------------------------------------------------ entry format

def _packed(name: str = "x") -> bytes:
    return b"".join(bytes(p) for p in pack_entry(FP, name, _parts(name)))


def test_entry_round_trip_is_zero_copy():
    parts = _parts("a")
    packed = pack_entry(FP, "a", parts)
    assert len(packed) == 1 + len(parts) and len(packed[0]) == HEADER_BYTES
    assert np.shares_memory(np.frombuffer(packed[1], np.uint8), parts[0])  # a view, not a copy
    raw = b"".join(packed)
    payload = unpack_entry(raw, FP, "a", PAYLOAD_LEN)
    assert isinstance(payload, memoryview) and payload.obj is raw
    assert bytes(payload) == _payload("a")
    # parts of any dtype and shape, as long as they are contiguous
    f16 = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    raw2 = b"".join(pack_entry(FP, "b", [f16, b"xy"]))
    assert bytes(unpack_entry(raw2, FP, "b", f16.nbytes + 2)) == f16.tobytes() + b"xy"
    assert bytes(unpack_entry(b"".join(pack_entry(FP, "c", [])), FP, "c", 0)) == b""
    with pytest.raises(ValueError, match="not C-contiguous"):
        pack_entry(FP, "d", [np.zeros((4, 4), np.uint8)[:, 1]])
    with pytest.raises(ValueError, match="fingerprint"):
        pack_entry(b"short", "e", [b"x"])


@pytest.mark.parametrize("pos", range(HEADER_BYTES))
def test_every_header_byte_is_checked(pos):
    raw = bytearray(_packed())
    raw[pos] ^= 0x01
    with pytest.raises(CorruptEntry):
        unpack_entry(raw, FP, "x", PAYLOAD_LEN)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, ENTRY_LEN - 1), st.integers(1, 255))
def test_any_flipped_byte_is_caught(pos, xor):
    raw = bytearray(_packed())
    raw[pos] ^= xor
    with pytest.raises(CorruptEntry):
        unpack_entry(raw, FP, "x", PAYLOAD_LEN)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, ENTRY_LEN - 1))
def test_truncation_is_caught(length):
    with pytest.raises(CorruptEntry, match="truncated"):
        unpack_entry(_packed()[:length], FP, "x", PAYLOAD_LEN)


def test_foreign_length_and_trailing_bytes_are_caught():
    raw = _packed()
    with pytest.raises(CorruptEntry, match="foreign fingerprint"):
        unpack_entry(raw, OTHER_FP, "x", PAYLOAD_LEN)
    with pytest.raises(CorruptEntry, match="payload length"):
        unpack_entry(raw, FP, "x", PAYLOAD_LEN - 1)
    with pytest.raises(CorruptEntry, match="trailing bytes"):
        unpack_entry(raw + b"\x00", FP, "x", PAYLOAD_LEN)
    with pytest.raises(CorruptEntry, match="bad magic"):
        unpack_entry(b"\x00" * ENTRY_LEN, FP, "x", PAYLOAD_LEN)
    assert CorruptEntry("why").reason == "why"


def test_an_entry_read_under_another_name_is_refused():
    """The fingerprint names the model and layout, not the block, and a rank's layout is
    often every rank's: an entry copied under another key's or another rank's name used
    to pass every check (format 2).  Its checksum is seeded with its name."""
    raw = _packed("kvswap.fp.r0.key1")
    assert bytes(unpack_entry(raw, FP, "kvswap.fp.r0.key1", PAYLOAD_LEN)) == \
        _payload("kvswap.fp.r0.key1")
    for other in ("kvswap.fp.r0.key2", "kvswap.fp.r1.key1", "kvswap.fp.all.key1"):
        with pytest.raises(CorruptEntry, match="written under another name"):
            unpack_entry(raw, FP, other, PAYLOAD_LEN)
    old = bytearray(raw)  # a format-2 entry is a miss for this reader
    old[8:12] = (2).to_bytes(4, "little")
    with pytest.raises(CorruptEntry, match="format version 2, this reader knows 3"):
        unpack_entry(bytes(old), FP, "kvswap.fp.r0.key1", PAYLOAD_LEN)


# ------------------------------------------------------------------ errors

def test_storage_error_codes_travel():
    assert ErrorCode.STORAGE_ERROR == 403 and ErrorCode.STORAGE_TIMEOUT == 504
    err = error_for_code(403, "down")
    assert type(err) is StorageError and err.code == ErrorCode.STORAGE_ERROR
    err = error_for_code(504, "slow")
    assert isinstance(err, StorageTimeout) and isinstance(err, TimeoutError)
    assert isinstance(err, StorageError) and err.code == ErrorCode.STORAGE_TIMEOUT


# ------------------------------------------------------------------ URLs

@pytest.fixture
def store_dir():
    path = tempfile.mkdtemp(prefix="kvs-store-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_open_file_backends(store_dir):
    b = open_backend(f"file://{store_dir}/a?capacity_bytes=2M&fsync=1")
    assert isinstance(b, FileBackend) and b.capacity_bytes == 2 << 20 and b.fsync
    assert Path(store_dir, "a").is_dir()
    b = open_backend(f"file://localhost{store_dir}/b%20c")
    assert b.root == f"{store_dir}/b c" and b.capacity_bytes is None and not b.fsync
    assert open_backend(f"{store_dir}/d").root == f"{store_dir}/d"


@pytest.mark.parametrize("url, match", [
    ("", "non-empty"),
    ("ftp://x/y", "unknown scheme"),
    ("file://host/tmp/x", "local directory"),
    ("file:relative", "absolute path"),
    ("relative/dir", "absolute path"),
    ("file:///tmp/kvs-never?capacity=1", "unknown option 'capacity'"),
    ("file:///tmp/kvs-never?capacity_bytes=0", "capacity_bytes"),
    ("file:///tmp/kvs-never?capacity_bytes=1X", "capacity_bytes"),
    ("file:///tmp/kvs-never?fsync=maybe", "fsync"),
    ("file:///tmp/kvs-never?fsync=1&fsync=0", "given twice"),
    ("redis://", "no host"),
    ("redis://h:notaport/0", "port"),
    ("redis://h:6379/zero", "database number"),
    ("redis://h:6379/0?timeout_s=-1", "timeout_s"),
    ("redis://h:6379/0?timeout=1", "unknown option 'timeout'"),
    ("redis://h:6379/0?retries=1&retries=2", "given twice"),
    ("unix://", "socket path"),
])
def test_bad_urls_are_refused(url, match):
    with pytest.raises(ValueError, match=match):
        open_backend(url)
    assert not Path("/tmp/kvs-never").exists()


# URLs that passed check_url and could never work: each failed only once used (at
# register, or on every call), or was quietly read as another URL.
NEVER_WORK = [
    # a NUL ends every C string and file name: "ValueError: embedded null byte" at register
    ("file:///tmp/kvs-never/a%00b", "contains a NUL byte (%00)"),
    ("/tmp/kvs-never/a\0b", "contains a NUL byte (%00)"),  # a bare path, quoted
    ("redis://:pa%00ss@h:6379/0", "contains a NUL byte"),
    # urllib drops fragments, tabs and newlines without a word
    ("file:///tmp/kvs-never#b", "has a #fragment"),
    ("redis://h:6379/0#x", "has a #fragment"),
    ("file:///tmp/kvs-never/a\tb", "control character '\\t'"),
    ("file:///", "the filesystem root cannot be the store"),
    ("file:///tmp/..", "the filesystem root cannot be the store"),
    ("/", "the filesystem root cannot be the store"),
    # redis-py hands TLS options to a plain connection: a TypeError on every call
    ("redis://h:6379/0?ssl_cert_reqs=required", "ssl_cert_reqs is a TLS option, and only "
                                                "rediss:// connects with TLS"),
    ("unix:///tmp/r.sock?ssl_ca_certs=/ca.pem&ssl_keyfile=/k",
     "ssl_ca_certs, ssl_keyfile are TLS options"),
    ("rediss://h:6379/0?ssl_cert_reqs=bogus", "want one of none, optional, required"),
    ("redis://h:0/0", "port 0 is no server's port"),  # redis-py read it as 6379
    ("redis://h:6379/99999999999", "database number from 0 to 2147483647"),
    ("redis://h:6379/2147483648", "database number from 0 to 2147483647"),
    ("unix:///tmp/r.sock?db=-1", "option db='-1': want a database number"),
    ("redis://h:6379/3?db=4", "the database is given twice"),
    ("redis://h:6379/0?ttl_s=99999999999999999999", "Redis refuses a longer expiry"),
    ("redis://h:6379/0?timeout_s=1e-300", "option timeout_s='1e-300': want 0.001 to "
                                          "31622400 seconds"),
    ("redis://h:6379/0?timeout_s=0.0009", "a shorter timeout fails every call"),
    ("redis://h:6379/0?connect_timeout_s=1e300", "a longer one overflows the waits"),
]


@pytest.mark.parametrize("url, match", NEVER_WORK)
def test_urls_that_could_never_work_are_refused_by_check_url(url, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        check_url(url)
    with pytest.raises(ValueError, match=re.escape(match)):
        open_backend(url)
    assert not Path("/tmp/kvs-never").exists()


@pytest.mark.parametrize("url", ["file:///tmp/kvs-never/a%00b", "redis://h:0/0",
                                 "redis://h/0?ssl_cert_reqs=required"])
def test_launch_exits_2_naming_storage_for_a_url_that_could_never_work(url, capsys):
    from kvswap.daemon import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["launch", "--namespace", "ns", "--tp", "2", "--storage", url])
    assert ei.value.code == 2
    assert "argument --storage: storage URL" in capsys.readouterr().err


def test_urls_at_the_edges_still_work(store_dir):
    from kvswap.daemon.storage.redis import RedisBackend

    assert open_backend(f"file://{store_dir}/a%23b%09c").root == f"{store_dir}/a#b\tc"
    assert open_backend(f"{store_dir}/x#y").root == f"{store_dir}/x#y"  # a bare path
    for url, where in [("redis://h:6379/2147483647?", "redis://h:6379 db 2147483647"),
                       ("redis://h?db=5&", "redis://h db 5"),
                       ("unix:///tmp/r.sock?db=7&", "unix:///tmp/r.sock db 7"),
                       ("rediss://u:p@h:1/2?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem&",
                        "rediss://h:1 db 2")]:
        check_url(url)
        b = open_backend(url + "timeout_s=0.001")  # connects lazily
        assert isinstance(b, RedisBackend) and (b.where, b.timeout_s) == (where, 0.001)
        if url.startswith("rediss"):  # the TLS options reach redis-py
            kwargs = b._pool.connection_kwargs
            assert (kwargs["ssl_cert_reqs"], kwargs["ssl_ca_certs"]) == ("none", "/ca.pem")
        b.close()


def test_parse_seconds_bounds():
    assert parse_seconds("0.001") == MIN_SECONDS == 0.001
    assert parse_seconds("31622400") == 366 * 86400
    for text in ("0.000999", "31622401", "nan", "-inf", "0", "x"):
        with pytest.raises(ValueError, match="seconds"):
            parse_seconds(text)


def test_unknown_scheme_lists_the_registered_ones():
    assert {"file", "redis", "rediss", "unix", "mooncake"} <= set(registered_schemes())
    with pytest.raises(ValueError) as ei:
        open_backend("s3://bucket/kv")
    msg = str(ei.value)
    assert "unknown scheme 's3'" in msg
    assert all(f"{s}://" in msg for s in registered_schemes()), msg


def test_a_scheme_registered_twice_is_refused():
    from kvswap.daemon.storage import BackendEntry, _by_scheme

    with pytest.raises(ValueError, match="'file' is registered twice in BACKENDS"):
        _by_scheme([*BACKENDS, BackendEntry(("s3", "file"), "s3", "S3Backend")])


@pytest.mark.parametrize("entry", BACKENDS, ids=lambda e: e.module)
def test_every_registered_backend_implements_the_interface(entry):
    """A registration line names a module and class that exist and have the interface
    (and the from_url that open_backend calls, the check_url that check_url calls), so a
    typo fails here, not in production."""
    try:
        module = importlib.import_module(f"kvswap.daemon.storage.{entry.module}")
    except ImportError as exc:
        if entry.extra is None or (exc.name or "kvswap").split(".")[0] == "kvswap":
            raise
        pytest.skip(f"kvswap[{entry.extra}] is not installed ({exc})")
    cls = getattr(module, entry.cls)
    interface = [n for n in vars(StorageBackend) if not n.startswith("_")]
    assert set(interface) == {"contains", "put", "get", "delete", "register_buffers", "close"}
    missing = [n for n in (*interface, "from_url", "check_url")
               if not callable(getattr(cls, n, None))]
    assert not missing, f"{entry.cls} lacks {missing}"


def test_redis_url_without_redis_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "kvswap.daemon.storage.redis", raising=False)
    with pytest.raises(ValueError, match=r"kvswap\[redis\]"):
        open_backend("redis://127.0.0.1:1/0")


# ------------------------------------------------------------------ file backend

def _put(backend, names, sizes=(1024, 512, 3000)):
    return backend.put([(n, pack_entry(FP, n, _parts(n, sizes))) for n in names])


def _check_entry(raw, name, sizes=(1024, 512, 3000)):
    assert raw is not None, f"{name} missing"
    assert bytes(unpack_entry(raw, FP, name, sum(sizes))) == _payload(name, sizes)


def test_file_put_get_contains_delete(store_dir):
    b = FileBackend(store_dir)
    names = [_name(i) for i in range(20)]
    assert _put(b, names[:10]) == [True] * 10
    assert _put(b, names[5:15]) == [False] * 5 + [True] * 5  # existing ones skipped
    assert b.contains(names) == [True] * 15 + [False] * 5
    got = b.get(names)
    for name, raw in zip(names[:15], got):
        _check_entry(raw, name)
    assert got[15:] == [None] * 5
    for name in names[:15]:  # sharded by a hash of the name
        path = Path(store_dir, shard_of(name), name)
        assert path.is_file() and path.stat().st_size == ENTRY_LEN
        assert len(path.parent.name) == 2
    assert not [p for p in Path(store_dir).rglob(f"{TMP_PREFIX}*")]
    b.delete(names[:3] + [_name("never")])
    assert b.contains(names[:4]) == [False, False, False, True]
    assert b.put([]) == [] and b.get([]) == [] and b.contains([]) == []
    b.close()
    with pytest.raises(StorageError, match="closed"):
        b.get(names[:1])


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", ".tmp.x", "", "x" * 201, "a b", 7])
def test_file_refuses_bad_names(store_dir, bad):
    b = FileBackend(store_dir)
    with pytest.raises(ValueError, match="bad entry name"):
        b.put([(_name(1), [b"x"]), (bad, [b"x"])])
    assert b.contains([_name(1)]) == [False]  # nothing written: the batch is refused whole
    with pytest.raises(ValueError):
        b.get([bad])


def test_file_io_failure_is_a_storage_error(store_dir):
    b = FileBackend(store_dir)
    name = _name(1)
    Path(store_dir, shard_of(name)).write_bytes(b"a file where the shard directory goes")
    with pytest.raises(StorageError) as ei:
        _put(b, [name])
    assert ei.value.code == ErrorCode.STORAGE_ERROR and shard_of(name) in str(ei.value)


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    from kvswap.daemon.storage.file import FileBackend
    b = FileBackend(sys.argv[1])
    os.replace = lambda src, dst: os._exit(17)  # die between the write and the rename
    b.put([(sys.argv[2], [b"header", b"payload" * 1000])])
""")


def test_file_crash_between_write_and_rename_leaves_no_entry(store_dir):
    name = _name("crash")
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, store_dir, name],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    leftovers = list(Path(store_dir).rglob(f"{TMP_PREFIX}{name}.*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 6 + 7000
    b = FileBackend(store_dir, capacity_bytes=1 << 20, stale_tmp_s=3600)
    assert b.contains([name]) == [False] and b.get([name]) == [None]
    _put(b, [_name(1)])  # a scan: the temp file is young, so it stays
    assert leftovers[0].exists()
    b = FileBackend(store_dir, capacity_bytes=1 << 20, stale_tmp_s=0)
    _put(b, [_name(2)])  # a scan: now it is stale and removed
    assert not leftovers[0].exists()
    assert _put(b, [name]) == [True] and b.contains([name]) == [True]


def test_file_lru_eviction_keeps_recently_read_entries(store_dir):
    capacity = 10 * ENTRY_LEN
    b = FileBackend(store_dir, capacity_bytes=capacity)
    names = [_name(i) for i in range(30)]
    past = time.time_ns() - 60 * 10**9
    for i, name in enumerate(names[:10]):
        _put(b, [name])
        # written in order, a minute ago: a kernel's write time is only as fine as its
        # clock tick, so entries written within one tick would tie
        os.utime(b._path(name), ns=(past + i, past + i))
    b.get([names[0], names[1]])  # used: these must outlive older-written ones
    for name in names[10:14]:
        _put(b, [name])
    alive = b.contains(names)
    assert alive[0] and alive[1], "recently read entries were evicted"
    assert not alive[2], "the least recently used entry survived"
    assert all(alive[10:14]), "fresh entries were evicted"
    usage = sum(p.stat().st_size for p in Path(store_dir).rglob("*") if p.is_file())
    assert usage <= capacity
    for name, raw in zip(names, b.get(names)):
        if raw is not None:
            _check_entry(raw, name)
    # a fresh backend (another process) learns the usage by scanning
    b2 = FileBackend(store_dir, capacity_bytes=capacity)
    for name in names[14:30]:
        _put(b2, [name])
    usage = sum(p.stat().st_size for p in Path(store_dir).rglob("*") if p.is_file())
    assert usage <= capacity
    assert b2.contains(names[-3:]) == [True] * 3
    with pytest.raises(ValueError, match="exceeds"):
        b2.put([(_name("huge"), [bytes(capacity + 1)])])


def test_file_entry_far_too_long_is_read_only_one_byte_past_its_buffer(store_dir):
    """An entry file extended to 1 TiB (sparse: a damaged or mistaken file) is read no
    further than one byte past the caller's buffer, which is an entry's size: it is
    rejected as too long, instead of failing every read with a MemoryError (it used
    to be read whole)."""
    b = FileBackend(store_dir)
    name = _name("long")
    _put(b, [name])
    os.truncate(b._path(name), 1 << 40)
    row = np.zeros(ENTRY_LEN, np.uint8)
    got = b.get([name], [memoryview(row)])[0]
    assert got is not None and len(got) == ENTRY_LEN + 1
    with pytest.raises(CorruptEntry, match="trailing bytes"):
        unpack_entry(got, FP, name, PAYLOAD_LEN)
    # a file that fits its buffer is still read in place, whole
    other = _name("fits")
    _put(b, [other])
    big = np.zeros(ENTRY_LEN + 100, np.uint8)
    view = b.get([other], [memoryview(big)])[0]
    assert len(view) == ENTRY_LEN
    _check_entry(view, other)


def test_not_an_entry_is_rejected_by_unpack_entry():
    with pytest.raises(CorruptEntry, match="a Redis list value"):
        unpack_entry(NotAnEntry("a Redis list value, not a string"), FP, _name(1), 10)


def _writer(root: str, worker: int, names: list[str], capacity: int | None, start) -> None:
    b = FileBackend(root, capacity_bytes=capacity)
    start.wait(30)
    rng = np.random.default_rng(worker)
    for _ in range(3):
        order = rng.permutation(len(names))
        for i in range(0, len(order), 7):
            chunk = [names[j] for j in order[i:i + 7]]
            _put(b, chunk)
            for name, raw in zip(chunk, b.get(chunk)):
                if raw is not None:  # may have been evicted by a neighbour
                    _check_entry(raw, name)


@pytest.mark.parametrize("capacity", [None, 40 * ENTRY_LEN])
def test_file_concurrent_processes_share_a_directory(store_dir, capacity):
    ctx = mp.get_context("fork")
    shared = [_name(f"shared{i}") for i in range(60)]
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_writer,
                         args=(store_dir, w, shared + [_name(f"own{w}.{i}") for i in range(30)],
                               capacity, start))
             for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    b = FileBackend(store_dir)
    everything = shared + [_name(f"own{w}.{i}") for w in range(3) for i in range(30)]
    got = b.get(everything)
    for name, raw in zip(everything, got):
        if capacity is None or raw is not None:
            _check_entry(raw, name)
    assert not list(Path(store_dir).rglob(f"{TMP_PREFIX}*"))
    if capacity is not None:
        usage = sum(p.stat().st_size for p in Path(store_dir).rglob("*") if p.is_file())
        # each process may overshoot by what it writes between two scans (10% of capacity)
        assert usage <= capacity * 1.3
        assert sum(r is not None for r in got) >= 30


# ------------------------------------------------------------------ redis backend

def test_redis_put_get_contains_delete(redis_url, redis_server):
    b = open_backend(redis_url + "?timeout_s=2")
    names = [_name(i) for i in range(20)]
    assert _put(b, names[:10]) == [True] * 10
    assert _put(b, names[5:15]) == [False] * 5 + [True] * 5
    assert b.contains(names) == [True] * 15 + [False] * 5
    got = b.get(names)
    for name, raw in zip(names[:15], got):
        _check_entry(raw, name)
    assert got[15:] == [None] * 5
    b.delete(names[:3] + [_name("never")])
    assert b.contains(names[:4]) == [False, False, False, True]
    assert b.put([]) == [] and b.get([]) == [] and b.contains([]) == []
    with pytest.raises(ValueError, match="bad entry name"):
        b.put([(_name(1), [b"x"]), ("a b", [b"x"])])
    assert "127.0.0.1" in repr(b)
    b.close()
    with pytest.raises(StorageError, match="closed"):
        b.get(names[:1])
    # the same server over its unix socket, with a TTL
    u = open_backend(f"unix://{redis_server.socket}?db=0&ttl_s=100&max_connections=2")
    _check_entry(u.get(names[3:4])[0], names[3])
    assert _put(u, [_name("ttl")]) == [True]
    import redis

    assert 0 < redis.Redis.from_url(redis_url).ttl(_name("ttl")) <= 100
    u.close()


def test_redis_value_of_another_type_is_not_an_entry(redis_url):
    """A list (or any non-string) under an entry name: MGET reads it as nil, as if
    missing, while EXISTS counted it, so it was a silent miss that no prefetch deleted
    and every backup skipped.  Now ``get`` reports it as NotAnEntry (the daemon then
    deletes it), and ``contains`` counts strings only."""
    import redis

    b = open_backend(redis_url)
    names = [_name(f"type{i}") for i in range(4)]
    _put(b, names[:1] + names[2:3])
    r = redis.Redis.from_url(redis_url)
    try:
        r.rpush(names[1], b"junk")
        r.hset(names[3], "k", "v")
        got = b.get(names)
        _check_entry(got[0], names[0])
        _check_entry(got[2], names[2])
        assert got[1] == NotAnEntry("a Redis list value, not a string")
        assert got[3] == NotAnEntry("a Redis hash value, not a string")
        assert b.get([_name("absent")]) == [None]  # a true miss is still None
        assert b.contains(names + [_name("absent")]) == [True, False, True, False, False]
        b.delete(names[1:2])  # what the daemon does with it
        assert _put(b, names[1:2]) == [True]  # so it can be backed up again
        _check_entry(b.get(names[1:2])[0], names[1])
    finally:
        r.delete(*names)
        r.close()
        b.close()


def test_redis_calls_are_pipelined(redis_url, monkeypatch):
    import redis

    from kvswap.daemon.storage import redis as storage_redis

    calls = []
    execute = redis.client.Pipeline.execute

    def counting(self, *a, **kw):
        calls.append(len(self.command_stack))
        return execute(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
    b = open_backend(redis_url)
    names = [_name(i) for i in range(100)]
    assert _put(b, names) == [True] * 100
    assert calls == [100]  # one round trip for the batch
    assert b.contains(names) == [True] * 100 and calls == [100, 100]
    monkeypatch.setattr(storage_redis, "PIPELINE_BYTES", 10 * ENTRY_LEN)
    calls.clear()
    more = [_name(i) for i in range(100, 125)]
    assert _put(b, more) == [True] * 25 and calls == [10, 10, 5]  # bounded memory per pipeline
    for name, raw in zip(names + more, b.get(names + more)):
        _check_entry(raw, name)
    b.close()


def test_redis_down_mid_operation_fails_in_time_and_reconnects(redis_url, redis_server):
    timeout = 1.0
    b = open_backend(f"{redis_url}?timeout_s={timeout}")
    names = [_name(i) for i in range(5)]
    assert _put(b, names) == [True] * 5  # connections are now pooled and live

    redis_server.freeze(True)  # accepts connections, answers nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageTimeout) as ei:
            b.get(names)
        elapsed = time.monotonic() - t0
        assert ei.value.code == ErrorCode.STORAGE_TIMEOUT and elapsed < timeout + 1.0
        assert isinstance(ei.value, StorageError)
    finally:
        redis_server.freeze(False)
    for name, raw in zip(names, b.get(names)):  # the dropped connection is replaced
        _check_entry(raw, name)

    redis_server.stop()  # gone: connection refused
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        b.contains(names)
    elapsed = time.monotonic() - t0
    assert ei.value.code == ErrorCode.STORAGE_ERROR and elapsed < timeout + 1.0
    assert "attempt" in str(ei.value)

    redis_server.start()  # back (empty: no persistence); the same backend reconnects
    assert b.contains(names) == [False] * 5
    assert _put(b, names) == [True] * 5
    _check_entry(b.get(names[:1])[0], names[0])
    b.close()
