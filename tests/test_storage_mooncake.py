"""The Mooncake Store backend against a real mooncake_master on free local ports:
the backend alone (zero-copy and copy paths, put-if-absent, misses, damaged
entries, a dead, frozen and restarted master, URL options), then through the
daemons (TP=1 and TP=2 round trips, misses, corrupt and truncated entries, the
master killed while swaps go on, two namespaces sharing one master).

Skipped only when kvswap[mooncake] is not installed (.ci/run installs it)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("mooncake.store", reason="kvswap[mooncake] is not installed (pip install "
                    "'kvswap[mooncake]'; .ci/run installs it)")

from kvswap.client import ErrorCode, TransferClient, TransferFailed  # noqa: E402
from kvswap.client.block_keys import block_hashes, entry_name, model_fingerprint  # noqa: E402
from kvswap.client.errors import StorageError, StorageTimeout  # noqa: E402
from kvswap.client.signals import poll_until  # noqa: E402
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash  # noqa: E402
from conftest import DeviceTags  # noqa: E402
from kvswap.daemon.storage import (  # noqa: E402
    HEADER_BYTES,
    CorruptEntry,
    NotAnEntry,
    check_url,
    open_backend,
    pack_entry,
    unpack_entry,
)
from kvswap.daemon.storage.mooncake import MooncakeBackend, MooncakeSettings  # noqa: E402
from kvswap.daemon.storage.local_servers import MooncakeMaster, find_master  # noqa: E402

FP = bytes(range(16))
ROW = 4096



def _once_storage_answers(attempt: Callable[[], None], failing: ErrorCode, timeout: float,
                          what: str) -> None:
    """Run ``attempt`` until it stops failing; meanwhile every failure is ``failing``."""

    def tried() -> bool | None:
        try:
            attempt()
        except TransferFailed as exc:
            assert {f.code for f in exc.failures} == {failing}
            return None
        return True

    assert poll_until(tried, time.monotonic() + timeout, first_sleep=0.05, max_sleep=0.2), what


@pytest.fixture
def master(mooncake_master):
    return mooncake_master


@pytest.fixture
def backend(master):
    b = open_backend(master.url(segment="32M", buffer="16M", timeout_s=2,
                                connect_timeout_s=1, copy_below=0))
    yield b
    b.close()


def _pool(rows: int = 8) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 256, (rows, ROW), dtype=np.uint8)


def _until(fn, timeout: float = 20.0):
    """fn() until it returns without a StorageError; its value (the last error if none)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except StorageError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# ------------------------------------------------------------------ the backend alone

def test_zero_copy_round_trip_from_registered_memory(backend):
    pool = _pool()
    stage = np.zeros((4, HEADER_BYTES + ROW), np.uint8)
    backend.register_buffers("host", [pool])
    backend.register_buffers("staging", [stage])
    names = [f"kvswap.t.r0.{i}" for i in range(4)]
    assert backend.put([(n, pack_entry(FP, n, [pool[i]])) for i, n in enumerate(names)]) == \
        [True] * 4
    assert backend.bounced_bytes == 4 * HEADER_BYTES  # only the headers were copied
    got = backend.get(names + ["kvswap.t.r0.none"], [memoryview(r) for r in stage] +
                      [memoryview(np.zeros(HEADER_BYTES + ROW, np.uint8))])
    assert got[4] is None
    got = backend.get(names, [memoryview(r) for r in stage])
    for i, raw in enumerate(got):
        assert np.shares_memory(np.frombuffer(raw, np.uint8), stage)  # read in place
        assert bytes(unpack_entry(raw, FP, names[i], ROW)) == pool[i].tobytes()


def test_small_parts_are_gathered_into_one(master):
    """Under copy_below, an entry's parts are copied side by side and put as one."""
    b = open_backend(master.url(segment="32M", copy_below="8K"))
    try:
        pool = _pool(4)
        b.register_buffers("host", [pool])
        halves = [pool[0][:ROW // 2], pool[0][ROW // 2:]]  # adjacent anyway: split them up
        parts = [pool[1], pool[2][:100], pool[3]]
        assert b.put([("kvswap.t.r0.a", pack_entry(FP, "kvswap.t.r0.a", parts)),
                      ("kvswap.t.r0.b", pack_entry(FP, "kvswap.t.r0.b", halves))]) == \
            [True, True]
        assert b.bounced_bytes == 2 * HEADER_BYTES + 2 * ROW + 100 + ROW
        a, whole = b.get(["kvswap.t.r0.a", "kvswap.t.r0.b"])
        assert bytes(unpack_entry(a, FP, "kvswap.t.r0.a", 2 * ROW + 100)) == b"".join(bytes(p) for p in parts)
        assert bytes(unpack_entry(whole, FP, "kvswap.t.r0.b", ROW)) == pool[0].tobytes()
    finally:
        b.close()


def test_copy_path_and_put_if_absent(backend):
    pool = _pool()
    first = [("kvswap.t.r0.a", pack_entry(FP, "kvswap.t.r0.a", [pool[0]])),
             ("kvswap.t.r0.b", [b"xyz"])]
    assert backend.put(first) == [True, True]
    assert backend.bounced_bytes == HEADER_BYTES + ROW + 3  # nothing registered: all copied
    other = pack_entry(FP, "kvswap.t.r0.c", [pool[1]])
    assert backend.put([("kvswap.t.r0.a", other), ("kvswap.t.r0.c", other)]) == [False, True]
    assert backend.contains(["kvswap.t.r0.a", "kvswap.t.r0.x", "kvswap.t.r0.c"]) == \
        [True, False, True]
    a, b, missing = backend.get(["kvswap.t.r0.a", "kvswap.t.r0.b", "kvswap.t.r0.x"])
    assert bytes(unpack_entry(a, FP, "kvswap.t.r0.a", ROW)) == pool[0].tobytes()  # first put stayed
    assert bytes(b) == b"xyz" and missing is None
    backend.delete(["kvswap.t.r0.a", "kvswap.t.r0.x"])
    assert backend.contains(["kvswap.t.r0.a", "kvswap.t.r0.c"]) == [False, True]


def test_released_role_is_copied_again(backend):
    pool = _pool(2)
    backend.register_buffers("host", [pool])
    backend.put([("kvswap.t.r0.a", pack_entry(FP, "kvswap.t.r0.a", [pool[0]]))])
    assert backend.bounced_bytes == HEADER_BYTES
    backend.register_buffers("host", [])  # the owner is about to free it
    backend.put([("kvswap.t.r0.b", pack_entry(FP, "kvswap.t.r0.b", [pool[1]]))])
    assert backend.bounced_bytes == 2 * HEADER_BYTES + ROW


@pytest.mark.parametrize("damage", ["truncated", "longer", "flipped"])
def test_damaged_entries_are_rejected_whatever_the_read_path(backend, damage):
    pool = _pool(1)
    entry = b"".join(bytes(p) for p in pack_entry(FP, "kvswap.t.r0.bad", [pool[0]]))
    raw = {"truncated": entry[:len(entry) // 2], "longer": entry + b"\0" * 64,
           "flipped": entry[:-5] + bytes([entry[-5] ^ 0xFF]) + entry[-4:]}[damage]
    assert backend.put([("kvswap.t.r0.bad", [raw])]) == [True]
    stage = np.zeros((1, HEADER_BYTES + ROW), np.uint8)
    backend.register_buffers("staging", [stage])
    for into in (None, [memoryview(stage[0])]):  # copy path, then in place
        got = backend.get(["kvswap.t.r0.bad"], into)[0]
        assert got is not None
        with pytest.raises(CorruptEntry):
            unpack_entry(got, FP, "kvswap.t.r0.bad", ROW)
        if into is not None and damage == "longer":  # not fetched: it may be of any size
            assert isinstance(got, NotAnEntry) and "longer than" in got.reason


def test_dead_master_is_a_storage_error_within_the_timeout_and_a_restart_recovers(master,
                                                                                  backend):
    assert backend.put([("kvswap.t.r0.a", [b"one"])]) == [True]
    master.kill()
    t0 = time.monotonic()
    # Usually refused at once ("master unreachable"); while the client is busy noticing
    # the loss it may not answer: then StorageTimeout, within timeout_s either way.
    with pytest.raises(StorageError, match="master unreachable|no answer within 2 s"):
        backend.contains(["kvswap.t.r0.a"])
    assert time.monotonic() - t0 < 2 + 3
    master.start()
    # the client reconnects by itself; the new master starts empty
    assert _until(lambda: backend.contains(["kvswap.t.r0.a"])) == [False]
    assert _until(lambda: backend.put([("kvswap.t.r0.a", [b"two"])])) == [True]
    assert bytes(backend.get(["kvswap.t.r0.a"])[0]) == b"two"


def test_frozen_master_times_out_and_later_calls_fail_fast_until_it_answers(master, backend):
    assert backend.put([("kvswap.t.r0.a", [b"one"])]) == [True]
    master.freeze(True)
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageTimeout, match="no answer within 2 s"):
            backend.contains(["kvswap.t.r0.a"])
        assert 1.9 < time.monotonic() - t0 < 2 + 3  # timeout_s, and a margin for a busy VM
        t1 = time.monotonic()
        with pytest.raises(StorageTimeout, match="earlier call"):
            backend.get(["kvswap.t.r0.a"])
        assert time.monotonic() - t1 < 1.5  # refused at once, not queued behind the stuck call
    finally:
        master.freeze(False)
    assert _until(lambda: backend.contains(["kvswap.t.r0.a"])) == [True]


def _ready_child(code: str) -> subprocess.Popen:
    """A Python child running ``code`` (text pipes), once it printed ``ready``."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    if proc.stdout.readline() != "ready\n":
        proc.kill()
        proc.wait()
        pytest.fail("the child did not get ready")
    return proc


def test_a_call_stuck_on_a_frozen_master_does_not_hold_the_process_at_exit(master):
    """The stuck call's thread is a daemon thread: the process still exits."""
    code = (f"import sys\n"
            f"from kvswap.client.errors import StorageTimeout\n"
            f"from kvswap.daemon.storage import open_backend\n"
            f"b = open_backend({master.url(segment='0', timeout_s=1)!r})\n"
            f"b.contains(['kvswap.a'])\n"
            f"print('ready', flush=True)\n"
            f"sys.stdin.readline()\n"
            f"try:\n"
            f"    b.contains(['kvswap.a'])\n"
            f"except StorageTimeout:\n"
            f"    print('timed out', flush=True)\n")
    proc = _ready_child(code)
    try:
        master.freeze(True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0  # its exit waits out the client's own RPC timeouts
        assert proc.stdout.read() == "timed out\n"
    finally:
        master.freeze(False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_close_returns_within_the_timeout_with_the_master_killed_or_frozen(master, fault):
    """close() waits at most timeout_s (1 s) for a master that is gone or does not answer.

    The client's teardown holds the GIL while it waits for the master (1-18 s with
    the master killed, 66-99 s frozen, measured): before, close() ran it, so a daemon
    stopping after its master died needed 11 s and met the launcher's SIGKILL.  Now
    the client is left to the process exit, which the child ends with os._exit, as
    a process that must stop at once does (Mooncake's own exit handler would run the
    teardown)."""
    code = (f"import os, sys, time\n"
            f"from kvswap.client.signals import poll_until\n"
            f"from kvswap.daemon.storage import open_backend\n"
            f"b = open_backend({master.url(segment='16M', buffer='4M', timeout_s=1)!r})\n"
            f"assert b.put([('kvswap.a', [b'one'])]) == [True]\n"
            f"print('ready', flush=True)\n"
            f"sys.stdin.readline()\n"
            f"if {fault == 'kill'}:  # until the client has seen it: its pings fail\n"
            f"    assert poll_until(lambda: b._store.health_check() == 2 or None,\n"
            f"                      time.monotonic() + 10, max_sleep=0.1)\n"
            f"t0 = time.monotonic()\n"
            f"b.close()\n"
            f"print(f'{{time.monotonic() - t0:.3f}}', flush=True)\n"
            f"print(b.left_to_exit, flush=True)\n"
            f"os._exit(0)\n")
    proc = _ready_child(code)
    try:
        if fault == "kill":
            master.kill()
        else:
            master.freeze(True)
        try:
            out, _ = proc.communicate("go\n", timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail("close() did not return within 40 s")
        took, why = (out.splitlines() + ["", ""])[:2]
        assert float(took) < 1 + 1.5, out  # timeout_s, and a margin for a busy VM
        assert why.startswith({"kill": "the client's health check failed",
                               "freeze": "the master did not answer within 1 s"}[fault]), out
        assert proc.returncode == 0
    finally:
        if master.running:
            master.freeze(False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_close_with_the_master_up_closes_the_client(backend):
    """A master that answers gets the client's teardown (the segment leaves the store)."""
    assert backend.put([("kvswap.t.r0.a", [b"one"])]) == [True]
    backend.close()
    assert backend.left_to_exit is None
    with pytest.raises(StorageError, match="closed"):
        backend.contains(["kvswap.t.r0.a"])


def test_master_down_at_first_use_fails_within_the_connect_timeout(master):
    master.stop()
    b = open_backend(master.url(segment="0", connect_timeout_s=0.5))
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="master unreachable"):
            b.contains(["kvswap.t.r0.a"])
        assert time.monotonic() - t0 < 2
    finally:
        b.close()
    with pytest.raises(StorageError, match="closed"):
        b.contains(["kvswap.t.r0.a"])


def test_bad_names_are_refused_before_anything_is_sent(backend):
    with pytest.raises(ValueError, match="bad entry name"):
        backend.put([("../x", [b"1"])])


@pytest.mark.parametrize("url,match", [
    ("mooncake://", "no master host"),
    ("mooncake://h:port", "Port could not be cast"),
    ("mooncake://h:1/kv", "without a path"),
    ("mooncake://h:1?protocol=udp", "option protocol='udp'"),
    ("mooncake://h:1?metadata=localhost:8080", "option metadata="),
    ("mooncake://h:1?segment=lots", "option segment='lots'"),
    ("mooncake://h:1?buffer=0", "option buffer='0'"),
    ("mooncake://h:1?timeout_s=-1", "option timeout_s='-1'"),
    ("mooncake://h:1?connect_timeout_s=x", "option connect_timeout_s='x'"),
    ("mooncake://h:1?local_hostname=", "option local_hostname=''"),
    ("mooncake://h:1?segmnet=1G", "unknown option 'segmnet'"),
    ("mooncake://h:1?timeout_s=1&timeout_s=2", "'timeout_s' given twice"),
    # refused since they passed and could never work (port 0 quietly meant 50051)
    ("mooncake://h:0", "port 0 is no master's port"),
    ("mooncake://h:1?timeout_s=1e-300", "option timeout_s='1e-300': want 0.001 to"),
    ("mooncake://h:1?connect_timeout_s=1e9", "option connect_timeout_s='1e9': want"),
    ("mooncake://h:1#kv", "has a #fragment"),
    ("mooncake://h:1?local_hostname=a%00b", "contains a NUL byte"),
])
def test_bad_url_options_name_the_option(url, match):
    with pytest.raises(ValueError, match=match):
        check_url(url)
    with pytest.raises(ValueError, match=match):
        open_backend(url)


def test_url_defaults_and_options():
    s = MooncakeSettings.parse("mooncake://10.0.0.5")
    assert (s.master, s.metadata, s.protocol, s.segment, s.timeout_s) == \
        ("10.0.0.5:50051", "http://10.0.0.5:8080/metadata", "tcp", 1 << 30, 5.0)
    s = MooncakeSettings.parse("mooncake://m:7?metadata=P2PHANDSHAKE&protocol=rdma&device=mlx5_0"
                               "&segment=0&buffer=1G&local_hostname=10.1.1.1&timeout_s=0.5")
    assert (s.master, s.metadata, s.protocol, s.device, s.segment, s.buffer, s.local_hostname,
            s.timeout_s) == ("m:7", "P2PHANDSHAKE", "rdma", "mlx5_0", 0, 1 << 30, "10.1.1.1", 0.5)
    assert isinstance(open_backend("mooncake://m:7"), MooncakeBackend)  # connects lazily


# ------------------------------------------------------------------ through the daemons

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"
HOST = 32
TENSORS = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
BLOCK_BYTES = sum(t.bytes_per_block for t in TENSORS)


def _fingerprint(tp: int) -> bytes:
    return model_fingerprint(layout_hash(TENSORS), f"default|tp={tp}")


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return block_hashes(list(range(salt * 1000, salt * 1000 + 4 * n)), 4)


def _daemon_url(master: MooncakeMaster) -> str:
    return master.url(segment="16M", buffer="4M", timeout_s=3, connect_timeout_s=1)


class Node:
    """A launched namespace with its client and a view of every rank's device blocks."""

    def __init__(self, namespaces, url: str, tp: int):
        self.tp = tp
        self.launcher = namespaces.launch(tp=tp, demo_caches=LAYOUT, host_blocks=HOST,
                                          storage_url=url)
        self.device = DeviceTags(self.launcher.names, tp, TENSORS, HOST)
        self.fill, self.has = self.device.fill, self.device.has
        self.client = TransferClient(self.launcher.names.namespace, tp,
                                     run_root=str(self.launcher.names.run_root), task_timeout=30)
        self.client.wait_ready(20)
        self.fill([*range(32)], [*range(1, 33)])  # device block b holds tag b + 1

    def wipe_host(self, host):
        """Overwrite host blocks with zeroed device block 31."""
        self.fill([31], [0])
        self.client.evict([31] * len(host), host).result()

    def close(self):
        self.client.close()
        self.device.close()


@pytest.fixture
def nodes(namespaces):
    made: list[Node] = []

    def make(url: str, tp: int = 2) -> Node:
        made.append(Node(namespaces, url, tp))
        return made[-1]

    yield make
    for node in made:
        node.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_through_the_daemons(master, nodes, tp):
    node = nodes(_daemon_url(master), tp)
    c = node.client
    keys = _keys(6, salt=tp)
    dev, host = [1, 5, 9, 13, 17, 21], [0, 2, 4, 6, 8, 10]
    c.evict(dev, host).result()
    assert c.backup(host, keys).result().count == 6
    again = c.backup(host, keys).result()
    assert again.count == 0 and all(r.fields["skipped"] == 6 for r in again.replies.values())
    assert c.exists(keys + _keys(2, salt=9)).result().count == 6
    node.wipe_host(host)
    node.fill(dev, [0] * 6)
    assert c.prefetch(keys, [20, 21, 22, 23, 24, 25]).result().count == 6
    c.load([20, 21, 22, 23, 24, 25], [2, 3, 4, 6, 7, 8]).result()
    assert node.has([2, 3, 4, 6, 7, 8], [2, 6, 10, 14, 18, 22])


def test_misses_load_nothing(master, nodes):
    node = nodes(_daemon_url(master))
    c = node.client
    keys = _keys(4, salt=4)
    c.evict([1, 2], [0, 1]).result()
    assert c.backup([0, 1], keys[:2]).result().count == 2
    assert c.exists(keys).result().count == 2
    assert c.exists(_keys(3, salt=5)).result().count == 0
    node.wipe_host([10, 11, 12, 13])
    assert c.prefetch(_keys(3, salt=5), [10, 11, 12]).result().count == 0
    assert c.prefetch(keys, [10, 11, 12, 13]).result().count == 2  # the leading hits only
    c.load([10, 11, 12, 13], [20, 21, 22, 23]).result()
    assert node.has([20, 21], [2, 3]) and node.has([22, 23], [0, 0])


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_entry_is_a_miss_and_never_loaded(master, nodes, damage):
    node = nodes(_daemon_url(master))
    c = node.client
    store = open_backend(master.url(segment="0", timeout_s=3))
    try:
        keys = _keys(4, salt=7)
        c.evict([1, 2, 3, 4], [0, 1, 2, 3]).result()
        c.backup([0, 1, 2, 3], keys).result()
        name = entry_name(keys[2], 0, _fingerprint(2))
        raw = bytearray(bytes(store.get([name])[0]))
        assert len(raw) == HEADER_BYTES + BLOCK_BYTES
        raw = raw[:len(raw) // 2] if damage == "truncate" else raw
        if damage == "flip":
            raw[-5] ^= 0xFF
        store.delete([name])
        assert store.put([(name, [bytes(raw)])]) == [True]
        node.wipe_host([10, 11, 12, 13])
        assert c.prefetch(keys, [10, 11, 12, 13]).result().count == 2
        c.load([10, 11, 12, 13], [20, 21, 22, 23]).result()
        assert node.has([20, 21], [2, 3]) and node.has([22, 23], [0, 0])
        log = (node.launcher.names.run_dir / "rank0.log").read_text()
        assert log.count(f"storage entry {name} is unusable") == 1
        assert store.contains([name]) == [False]  # deleted, so it can be backed up again
        assert c.backup([0, 1, 2, 3], keys).result().replies[0].fields["count"] == 1
    finally:
        store.close()


def test_master_killed_fails_storage_ops_within_the_timeout_and_swaps_go_on(master, nodes):
    node = nodes(_daemon_url(master))
    c = node.client
    keys = _keys(2, salt=8)
    c.evict([1, 2], [0, 1]).result()
    assert c.backup([0, 1], keys).result().count == 2
    master.kill()
    t0 = time.monotonic()
    with pytest.raises(TransferFailed) as ei:
        c.prefetch(keys, [5, 6]).result()
    assert time.monotonic() - t0 < 10  # timeout_s=3 per store call
    # a rank whose read failed first marks the agreement ABORTED: a peer that sees the
    # mark before its own read fails answers BARRIER_ABORTED (docs/storage.md section 8)
    codes = {f.code for f in ei.value.failures}
    assert codes & {ErrorCode.STORAGE_ERROR, ErrorCode.STORAGE_TIMEOUT}, codes
    assert codes <= {ErrorCode.STORAGE_ERROR, ErrorCode.STORAGE_TIMEOUT,
                     ErrorCode.BARRIER_ABORTED}, codes
    assert c.evict([3], [3]).result().replies[0].ok  # swap tasks unaffected
    assert c.load([3], [4]).result().replies[1].ok
    master.start()
    # The ranks' clients reconnect and re-mount their segments by themselves; the new
    # master starts empty.  Until a segment is mounted a put finds no room (STORAGE_ERROR).
    def stored_again() -> None:
        assert c.exists(keys).result().count == 0
        assert c.backup([0, 1], keys).result().count == 2

    _once_storage_answers(stored_again, ErrorCode.STORAGE_ERROR, 30,
                          "storage did not come back after a restart")
    assert c.prefetch(keys, [5, 6]).result().count == 2


def test_a_daemon_whose_master_died_stops_within_the_staged_stop(master, nodes):
    """With the master killed, close() leaves the store client open (its teardown
    would wait on the master), and the library's own exit handler then held the
    daemon's exit about 11 s past its clean stop: the launcher's 10 s staged stop
    ended in SIGKILL.  The daemon ends with os._exit once its stop is done."""
    node = nodes(_daemon_url(master), tp=1)
    keys = _keys(2, salt=5)
    node.client.evict([1, 2], [0, 1]).result()
    assert node.client.backup([0, 1], keys).result().count == 2
    master.kill()
    node.client.close()
    launcher = node.launcher
    t0 = time.monotonic()
    launcher.stop()
    assert time.monotonic() - t0 < 8, "the daemon's exit waited on the dead master"
    assert launcher.procs[0].returncode == 0, launcher.procs[0].returncode


def test_frozen_master_times_out_a_prefetch_while_swaps_go_on(master, nodes):
    """A master that stops answering mid-run: the prefetch fails with STORAGE_TIMEOUT
    within the URL's timeout_s (3 s) on every rank, and swaps run meanwhile."""
    node = nodes(_daemon_url(master))
    c = node.client
    keys = _keys(2, salt=12)
    c.evict([1, 2], [0, 1]).result()
    assert c.backup([0, 1], keys).result().count == 2
    master.freeze(True)
    try:
        t0 = time.monotonic()
        fut = c.prefetch(keys, [5, 6])
        assert c.evict([3], [3]).result(10).replies[0].ok  # while the prefetch is stuck
        assert c.load([3], [4]).result(10).replies[1].ok
        with pytest.raises(TransferFailed) as ei:
            fut.result()
        assert time.monotonic() - t0 < 3 + 3  # timeout_s, and a margin for the answer
        assert {f.code for f in ei.value.failures} == {ErrorCode.STORAGE_TIMEOUT}
        assert len(ei.value.failures) == 2
    finally:
        master.freeze(False)
    def all_there() -> None:  # each rank's stuck call returns once the master answers
        assert c.exists(keys).result().count == 2

    _once_storage_answers(all_there, ErrorCode.STORAGE_TIMEOUT, 20,
                          "storage did not recover after the freeze")
    assert c.prefetch(keys, [5, 6]).result().count == 2


def test_two_namespaces_share_one_master(master, nodes):
    """Node A backs up; node B (another launch, other shm, same model) prefetches."""
    url = _daemon_url(master)
    a, b = nodes(url), nodes(url)
    keys = _keys(4, salt=3)
    a.fill([3, 4, 5, 6], [101, 102, 103, 104])
    a.client.evict([3, 4, 5, 6], [0, 1, 2, 3]).result()
    assert a.client.backup([0, 1, 2, 3], keys).result().count == 4
    assert b.client.exists(keys).result().count == 4
    assert b.client.prefetch(keys, [7, 8, 9, 10]).result().count == 4
    b.client.load([7, 8, 9, 10], [20, 21, 22, 23]).result()
    assert b.has([20, 21, 22, 23], [101, 102, 103, 104])


def test_bench_storage_mooncake_auto_measures_both_rows(capsys):
    """The bench starts and stops its own master, and the backend row copies headers only."""
    import json

    from kvswap.daemon.cli import main

    if find_master() is None:
        pytest.skip("mooncake_master is not installed (pip install 'kvswap[mooncake]')")
    assert main(["bench", "storage", "--mooncake", "auto", "--blocks", "4", "--repeat", "1",
                 "--json"]) == 0
    rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["storage"]}
    assert {"file", "mooncake", "mooncake-backend"} <= set(rows)
    assert rows["mooncake-backend"]["copied_per_entry"] == HEADER_BYTES
    assert all(rows[k]["backup_gbps"] > 0 and rows[k]["prefetch_gbps"] > 0
               for k in ("mooncake", "mooncake-backend"))
