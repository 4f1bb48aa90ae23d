"""How a daemon reports and contains failures: the ``last_error`` slot, log lines a
peer cannot forge, a start whose own caches cannot be attached, the bound on an
``exists``, a prefetch whose store fails on one rank, and a stop held up by a
thread stuck for good."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvswap.client import ErrorCode, TransferClient, TransferFailed
from kvswap.client.block_keys import block_hashes, entry_name, model_fingerprint
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash
from kvswap.client.protocol import KEY_BYTES, Op, encode_request, packb
from kvswap.client.signals import RankSlot, RankState, poll_until
from kvswap.daemon.logs import LINE
from kvswap.daemon.storage.file import shard_of

from conftest import SMALL_LAYOUT, RawPeer

HOST = 32


@pytest.fixture
def peer(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=HOST)
    p = RawPeer(launcher.names.endpoint(0))
    try:
        yield launcher, p
    finally:
        p.close()


def test_a_rejected_request_leaves_its_code_in_last_error(peer):
    launcher, p = peer
    assert launcher.seg.ranks[0, RankSlot.LAST_ERROR] == 0
    assert p.ask([packb({"v": [99, 0], "id": 1, "op": "ping"})]).code == \
        ErrorCode.VERSION_MISMATCH
    assert launcher.seg.ranks[0, RankSlot.LAST_ERROR] == ErrorCode.VERSION_MISMATCH
    assert p.ask(encode_request(Op.PING, 2)).code == ErrorCode.OK  # success changes nothing
    assert launcher.seg.ranks[0, RankSlot.LAST_ERROR] == ErrorCode.VERSION_MISMATCH


def test_values_a_peer_sends_cannot_forge_or_flood_a_log_line(peer):
    launcher, p = peer
    forged = "2026-01-01 00:00:00.000 rank0 ERROR kvswap.daemon: FORGED"
    evil = "x" * 5000 + "\n" + forged + "\r\n" + forged
    assert p.ask([packb({"v": [1, 0], "id": 3, "op": evil})]).code == ErrorCode.UNKNOWN_OP
    assert p.ask(encode_request(Op.PING, 4)).code == ErrorCode.OK  # logged before this reply
    log = launcher.names.log_path(0).read_text()
    lines = log.splitlines()
    assert any("rejected request 3" in line and "unknown op" in line for line in lines), log
    assert all(LINE.match(line) for line in lines if "FORGED" in line), "a forged line"
    assert max(len(line) for line in lines) < 1000, "a peer's value flooded a log line"


def test_a_demo_register_that_fails_makes_the_rank_failed(namespaces):
    """--host-size gives more host blocks than --max-device-blocks allows: the
    daemon's own register fails, and nobody else would ever register."""
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=None,
                                 host_size=1 << 20, max_device_blocks=32, wait=False)
    seg = launcher.seg
    failed = poll_until(lambda: True if seg.state_of(0) == RankState.FAILED else None,
                        time.monotonic() + 30)
    assert failed, f"rank 0 is {seg.state_of(0).name}, not FAILED"
    assert seg.ranks[0, RankSlot.LAST_ERROR] == ErrorCode.BAD_LAYOUT
    log = launcher.names.log_path(0).read_text()
    assert "internal register 0 failed: [" in log and "--max-device-blocks" in log


def test_exists_refuses_more_keys_than_host_blocks_naming_the_limit(namespaces, tmp_path):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=HOST,
                                 storage_url=f"file://{tmp_path}/store")
    p = RawPeer(launcher.names.endpoint(0))
    try:
        for n, want in ((HOST, ErrorCode.OK), (HOST + 1, ErrorCode.MESSAGE_TOO_LARGE)):
            keys = np.zeros((n, KEY_BYTES), dtype=np.uint8)
            reply = p.ask(encode_request(Op.EXISTS, n, {"n": n}, [keys]))
            assert reply.code == want, reply.message
        assert f"{HOST + 1} keys, more than the {HOST} host blocks" in reply.message
    finally:
        p.close()


def test_a_rank_whose_store_fails_aborts_the_prefetch_on_every_rank(namespaces, tmp_path):
    """Rank 1 cannot read its entry; rank 0 stops waiting for rank 1's round at once
    (the agreement abort), not after --storage-timeout (120 s here)."""
    store = tmp_path / "store"
    launcher = namespaces.launch(tp=2, demo_caches=SMALL_LAYOUT, host_blocks=HOST,
                                 storage_url=f"file://{store}", storage_timeout_s=120.0)
    client = TransferClient(launcher.names.namespace, 2, run_root=str(launcher.names.run_root),
                            task_timeout=60)
    try:
        client.wait_ready(20)
        keys = block_hashes(list(range(8)), 4)
        client.evict([1, 2], [0, 1]).result(10)
        assert client.backup([0, 1], keys).result(10).count == 2
        tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape)
                   for t in demo_layout(SMALL_LAYOUT)]
        fingerprint = model_fingerprint(layout_hash(tensors), "default|tp=2")
        name = entry_name(keys[0], 1, fingerprint)
        entry = Path(store, shard_of(name), name)
        entry.unlink()
        entry.mkdir()  # opens, then fails to read: a store error on rank 1 only
        with pytest.raises(TransferFailed) as ei:
            client.prefetch(keys, [5, 6]).result(30)  # a wait of 120 s fails here
        codes = {f.rank: f.code for f in ei.value.failures}
        assert codes[1] == ErrorCode.STORAGE_ERROR
        assert codes[0] == ErrorCode.BARRIER_ABORTED
        # a failed task leaves its code in last_error too
        assert launcher.seg.ranks[1, RankSlot.LAST_ERROR] == ErrorCode.STORAGE_ERROR
        assert launcher.seg.ranks[0, RankSlot.LAST_ERROR] == ErrorCode.BARRIER_ABORTED
        entry.rmdir()
        assert client.evict([3], [3]).result(10)  # both ranks still serve
    finally:
        client.close()


def _blocked_in_fifo_open(pid: int) -> bool | None:
    """True once a thread of ``pid`` waits in open() of a FIFO nobody writes."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "wait_for_partner":  # fs/pipe.c
                return True
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return None


def test_a_stop_stuck_past_its_deadline_ends_the_daemon_as_a_kill_would(namespaces, tmp_path):
    """A storage read that never returns (the entry is a FIFO nobody writes to: a
    hung file system) holds the storage worker, so the stop's wait for running tasks
    never ends.  The daemon must still exit once --drain-timeout has passed, with
    status 3 and every thread's stack in its log, not stay STOPPING forever."""
    drain = 1.5
    store = tmp_path / "store"
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT, host_blocks=HOST,
                                 storage_url=f"file://{store}", drain_timeout_s=drain)
    client = TransferClient(launcher.names.namespace, 1, run_root=str(launcher.names.run_root),
                            task_timeout=60)
    try:
        client.wait_ready(20)
        keys = block_hashes(list(range(4)), 4)
        client.evict([1], [0]).result(10)
        assert client.backup([0], keys).result(10).count == 1
        tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape)
                   for t in demo_layout(SMALL_LAYOUT)]
        name = entry_name(keys[0], 0, model_fingerprint(layout_hash(tensors), "default|tp=1"))
        entry = Path(store, shard_of(name), name)
        entry.unlink()
        os.mkfifo(entry)
        client.prefetch(keys, [5])
        daemon = launcher.procs[0]
        assert poll_until(lambda: _blocked_in_fifo_open(daemon.pid), time.monotonic() + 10)
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(drain + 15) == 3
        took = time.monotonic() - t0
        assert drain <= took < drain + 10, took
        log = launcher.names.log_path(0, launcher.log_dir).read_text()
        assert "the stop has not finished" in log and "storage-0" in log
        assert "_read" in log  # the stuck thread's stack: the file store's read
    finally:
        client.close()
