"""The storage tier end to end (host backend, TP=2): backup, prefetch, exists,
cross-rank agreement, corruption, a shared Redis between two "nodes", a dead Redis."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvswap.client import ErrorCode, TransferClient, TransferFailed
from kvswap.client.block_keys import block_hashes, entry_name, model_fingerprint
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash
from kvswap.client.signals import poll_until
from kvswap.daemon.storage import open_backend
from conftest import DeviceTags

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"
HOST = 32
TENSORS = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
FINGERPRINT = model_fingerprint(layout_hash(TENSORS), "default|tp=2")


def _keys(n: int, salt: int = 0) -> list[bytes]:
    tokens = list(range(salt * 1000, salt * 1000 + 4 * n))
    return block_hashes(tokens, 4)


def _launch(namespaces, url: str, **kw):
    return namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST, storage_url=url, **kw)


def _client(launcher) -> TransferClient:
    c = TransferClient(launcher.names.namespace, 2, run_root=str(launcher.names.run_root),
                       task_timeout=30)
    c.wait_ready(20)
    return c


def _tags(launcher, host: int = HOST) -> DeviceTags:
    """Every rank's device blocks, with block b holding tag b + 1."""
    tags = DeviceTags(launcher.names, 2, TENSORS, host)
    tags.fill(list(range(32)), list(range(1, 33)))
    return tags


def _round_trip(namespaces, url: str):
    launcher = _launch(namespaces, url)
    tags = _tags(launcher)
    client = _client(launcher)
    try:
        keys = _keys(6)
        dev, host = [1, 5, 9, 13, 17, 21], [0, 2, 4, 6, 8, 10]
        client.evict(dev, host).result()
        r = client.backup(host, keys).result()
        assert r.count == 6 and all(x.fields["skipped"] == 0 for x in r.replies.values())
        again = client.backup(host, keys).result()  # already stored: skipped, reported
        assert again.count == 0 and all(x.fields["skipped"] == 6 for x in again.replies.values())
        assert client.exists(keys).result().count == 6
        assert client.exists(keys + _keys(2, salt=9)).result().count == 6
        # wipe host (evict zeroed device blocks over it) and the device blocks
        tags.fill([30, 31], [0, 0])
        client.evict([30] * 6, host).result()
        tags.fill(dev, [0] * 6)
        got = client.prefetch(keys, [20, 21, 22, 23, 24, 25]).result()
        assert got.count == 6
        client.load([20, 21, 22, 23, 24, 25], [2, 3, 4, 6, 7, 8]).result()
        assert tags.has([2, 3, 4, 6, 7, 8], [2, 6, 10, 14, 18, 22])
    finally:
        client.close()
        tags.close()
    return launcher


def test_file_backend_round_trip(namespaces, tmp_path):
    _round_trip(namespaces, f"file://{tmp_path}/store")


def test_redis_backend_round_trip(namespaces, redis_url):
    _round_trip(namespaces, redis_url)


def test_two_nodes_share_one_redis(namespaces, redis_url):
    """Node A (one launch) backs up; node B (another launch, other shm) prefetches."""
    a = _launch(namespaces, redis_url)
    b = _launch(namespaces, redis_url)
    keys = _keys(4, salt=3)
    ta = _tags(a)
    tb = _tags(b)
    ca, cb = _client(a), _client(b)
    try:
        ta.fill([3, 4, 5, 6], [101, 102, 103, 104])
        ca.evict([3, 4, 5, 6], [0, 1, 2, 3]).result()
        assert ca.backup([0, 1, 2, 3], keys).result().count == 4
        assert cb.prefetch(keys, [7, 8, 9, 10]).result().count == 4
        cb.load([7, 8, 9, 10], [20, 21, 22, 23]).result()
        assert tb.has([20, 21, 22, 23], [101, 102, 103, 104])
    finally:
        ca.close()
        cb.close()
        ta.close()
        tb.close()


def test_rank_disagreement_loads_the_agreed_prefix_only(namespaces, tmp_path):
    url = f"file://{tmp_path}/store"
    launcher = _launch(namespaces, url)
    tags = _tags(launcher)
    client = _client(launcher)
    store = open_backend(url)
    try:
        keys = _keys(5, salt=5)
        client.evict([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]).result()
        client.backup([0, 1, 2, 3, 4], keys).result()
        store.delete([entry_name(keys[3], 1, FINGERPRINT)])  # rank 1 loses key 3
        assert client.exists(keys).result().count == 3
        tags.fill([31], [0])
        client.evict([31] * 5, [10, 11, 12, 13, 14]).result()  # zero the destinations
        got = client.prefetch(keys, [10, 11, 12, 13, 14]).result()
        assert got.count == 3 and [r.fields["count"] for r in got.replies.values()] == [3, 3]
        client.load([10, 11, 12, 13, 14], [20, 21, 22, 23, 24]).result()
        assert tags.has([20, 21, 22], [2, 3, 4])
        assert tags.has([23, 24], [0, 0])  # nothing past the agreed prefix
    finally:
        store.close()
        client.close()
        tags.close()


def test_a_backup_of_many_keys_is_stored_a_chunk_at_a_time_and_read_back_whole(namespaces,
                                                                               tmp_path):
    """A backup packs and puts its entries in chunks (at most 16,384 tensor views each:
    256 entries at 64 tensors), so a backup of every block of a large pool no longer
    holds all its entries at once (~48 KB a key at 64 tensors, 755 MiB of peak memory
    for 16,384 keys of 8 MiB of data).  600 keys are three chunks here: every block is
    stored once, and a prefetch brings every byte back."""
    from kvswap.daemon.demo import RankView

    layout = "layers=32,block_tokens=1,heads=1,head_dim=8,dtype=uint8,blocks=64"
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(layout)]
    n = 600
    launcher = namespaces.launch(tp=1, demo_caches=layout, host_blocks=n,
                                 storage_url=f"file://{tmp_path}/store")
    view = RankView(launcher.names, 0, tensors, n)
    client = TransferClient(launcher.names.namespace, 1, run_root=str(launcher.names.run_root),
                            task_timeout=60)
    try:
        client.wait_ready(20)
        rng = np.random.default_rng(3)
        for dev in view.device:
            dev[:] = rng.integers(0, 1 << 63, dev.shape, dtype=np.uint64)
        client.evict([i % 64 for i in range(n)], list(range(n))).result()
        before = [h.copy() for h in view.host]
        keys = _keys(n, salt=7)
        assert client.backup(list(range(n)), keys).result().count == n
        assert client.backup(list(range(n)), keys).result().replies[0].fields["skipped"] == n
        assert client.exists(keys).result().count == n
        for dev in view.device:
            dev[0] = 0
        client.evict([0] * n, list(range(n))).result()  # wipe every host block
        assert not any(np.array_equal(b, h) for b, h in zip(before, view.host))
        assert client.prefetch(keys, list(range(n))).result().count == n
        assert all(np.array_equal(b, h) for b, h in zip(before, view.host))
    finally:
        client.close()
        view.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "rank", "huge"])
def test_corrupt_entry_is_a_miss_and_never_loaded(namespaces, tmp_path, damage):
    """A damaged entry (flipped, truncated, extended to a sparse 1 TiB: that one failed
    every prefetch with a MemoryError and was never deleted) and an intact one under
    another name (rank 0's entries of keys 2 and 3 swapped; rank 0's entry of key 2
    copied over rank 1's, with the same layout: before entry format 3 both loaded the
    wrong block) are misses from that block on, logged once and deleted."""
    url = f"file://{tmp_path}/store"
    launcher = _launch(namespaces, url)
    tags = _tags(launcher)
    client = _client(launcher)
    store = open_backend(url)
    try:
        keys = _keys(4, salt=7)
        client.evict([1, 2, 3, 4], [0, 1, 2, 3]).result()
        client.backup([0, 1, 2, 3], keys).result()
        rank = 1 if damage == "rank" else 0
        name = entry_name(keys[2], rank, FINGERPRINT)
        raw = bytearray(bytes(store.get([entry_name(keys[2], 0, FINGERPRINT)])[0]))
        raw = raw[:len(raw) // 2] if damage == "truncate" else raw
        if damage == "flip":
            raw[-5] ^= 0xFF
        if damage == "swap":
            third = entry_name(keys[3], 0, FINGERPRINT)
            raw, other = bytearray(bytes(store.get([third])[0])), bytes(raw)
            store.delete([third])
            assert store.put([(third, [other])]) == [True]
        store.delete([name])
        assert store.put([(name, [bytes(raw)])]) == [True]
        if damage == "huge":
            os.truncate(store._path(name), 1 << 40)
        tags.fill([31], [0])
        client.evict([31] * 4, [10, 11, 12, 13]).result()
        assert client.prefetch(keys, [10, 11, 12, 13]).result().count == 2
        client.load([10, 11, 12, 13], [20, 21, 22, 23]).result()
        assert tags.has([20, 21], [2, 3]) and tags.has([22, 23], [0, 0])
        log = (launcher.names.run_dir / f"rank{rank}.log").read_text()
        assert log.count(f"storage entry {name} is unusable") == 1
        assert store.contains([name]) == [False]  # deleted, so it can be backed up again
        assert client.backup([0, 1, 2, 3], keys).result().replies[rank].fields["count"] == 1
    finally:
        store.close()
        client.close()
        tags.close()


def test_a_redis_value_of_another_type_is_a_corrupt_entry(namespaces, redis_url):
    """A list under rank 1's entry name of key 1: MGET reads it as nil and EXISTS counts
    it, so it was a silent miss for ever (never logged or deleted, skipped by every
    backup, counted by exists).  Now it is a corrupt entry: a miss, logged once and
    deleted, and exists stops before it, as a prefetch does."""
    import redis

    launcher = _launch(namespaces, redis_url)
    tags = _tags(launcher)
    client = _client(launcher)
    r = redis.Redis.from_url(redis_url)
    keys = _keys(4, salt=11)
    name = entry_name(keys[1], 1, FINGERPRINT)
    try:
        r.rpush(name, b"junk")
        client.evict([1, 2, 3, 4], [0, 1, 2, 3]).result()
        client.backup([0, 1, 2, 3], keys).result()
        assert client.exists(keys).result().count == 1  # only strings are entries
        assert client.prefetch(keys, [10, 11, 12, 13]).result().count == 1
        log = (launcher.names.run_dir / "rank1.log").read_text()
        assert log.count(f"storage entry {name} is unusable (a Redis list value") == 1
        assert r.type(name) == b"none"  # deleted, so it can be backed up again
        assert client.backup([0, 1, 2, 3], keys).result().replies[1].fields["count"] == 1
        assert client.exists(keys).result().count == 4
        tags.fill([31], [0])
        client.evict([31] * 4, [10, 11, 12, 13]).result()
        assert client.prefetch(keys, [10, 11, 12, 13]).result().count == 4
        client.load([10, 11, 12, 13], [20, 21, 22, 23]).result()
        assert tags.has([20, 21, 22, 23], [2, 3, 4, 5])
    finally:
        r.delete(name)
        r.close()
        client.close()
        tags.close()


def test_a_corrupt_entry_in_a_later_read_chunk_ends_the_prefix_there(namespaces, tmp_path):
    """A prefetch reads in chunks and verifies one while reading the next (under a
    deadline policy the chunks grow 1, 2, 4 ... blocks; wait_complete's are 64 MiB):
    a corrupt entry of a later chunk (rows 31-47, in the second of its two check
    runs), on one rank, ends the agreed prefix at it on both ranks, is reported once
    and deleted, and nothing past it is loaded."""
    url = f"file://{tmp_path}/store"
    n, host = 48, 96
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=host, storage_url=url)
    tags = _tags(launcher, host)
    client = _client(launcher)
    store = open_backend(url)
    try:
        keys = _keys(n, salt=9)
        client.evict([i % 32 for i in range(n)], list(range(n))).result()  # tag i % 32 + 1
        assert client.backup(list(range(n)), keys).result().count == n
        name = entry_name(keys[40], 1, FINGERPRINT)
        raw = bytearray(bytes(store.get([name])[0]))
        raw[100] ^= 0x01
        store.delete([name])
        assert store.put([(name, [bytes(raw)])]) == [True]
        tags.fill([31], [0])
        client.evict([31] * n, list(range(n, 2 * n))).result()  # zero the destinations
        got = client.prefetch(keys, list(range(n, 2 * n)), policy="timeout",
                              timeout=60).result()
        assert [r.fields["count"] for r in got.replies.values()] == [40, 40]
        client.load([n + 38, n + 39, n + 40], [0, 1, 2]).result()
        assert tags.has([0, 1, 2], [38 % 32 + 1, 39 % 32 + 1, 0])
        log = (launcher.names.run_dir / "rank1.log").read_text()
        assert log.count(f"storage entry {name} is unusable") == 1
        assert store.contains([name]) == [False]
    finally:
        store.close()
        client.close()
        tags.close()


def test_dead_redis_fails_storage_ops_and_swaps_go_on(namespaces, redis_server):
    url = redis_server.start_another()
    launcher = _launch(namespaces, url)
    client = _client(launcher)
    try:
        keys = _keys(2, salt=8)
        client.evict([1, 2], [0, 1]).result()
        assert client.backup([0, 1], keys).result().count == 2
        redis_server.stop_another()
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as ei:
            client.prefetch(keys, [5, 6]).result()
        assert time.monotonic() - t0 < 20
        assert {f.code for f in ei.value.failures} <= {ErrorCode.STORAGE_ERROR,
                                                       ErrorCode.STORAGE_TIMEOUT}
        assert client.evict([3], [3]).result().replies[0].ok  # swap tasks unaffected
        assert client.load([3], [4]).result().replies[1].ok
    finally:
        client.close()


def test_storage_ops_without_a_storage_tier_are_refused(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST)
    with TransferClient(launcher.names.namespace, 1, run_root=str(launcher.names.run_root)) as c:
        with pytest.raises(TransferFailed) as ei:
            c.exists(_keys(1)).result(10)
        assert ei.value.failures[0].code == ErrorCode.STORAGE_ERROR
        assert c.evict([1], [1]).result(10)


def test_running_prefetch_can_be_cancelled(namespaces, tmp_path):
    launcher = _launch(namespaces, f"file://{tmp_path}/store")
    client = _client(launcher)
    try:
        keys = _keys(2, salt=11)
        client.evict([1, 2], [0, 1]).result()
        client.backup([0, 1], keys).result()
        pid1 = launcher.procs[1].pid
        os.kill(pid1, signal.SIGSTOP)  # rank 1 never reaches the agreement
        try:
            fut = client.prefetch(keys, [5, 6])
            posted = poll_until(  # rank 0 has posted round 0 and waits for rank 1
                lambda: True if (launcher.seg.agree[0][:, 0] == fut.task_id).any() else None,
                time.monotonic() + 20)
            assert posted
            cancel = fut.cancel()
            # resume rank 1 only once rank 0 has taken the cancel (it answers at once)
            assert poll_until(lambda: True if 0 in cancel._replies else None,
                              time.monotonic() + 20)
        finally:
            os.kill(pid1, signal.SIGCONT)
        assert cancel.result(30).replies[0].fields["cancelled"] is True
        with pytest.raises(TransferFailed) as ei:
            fut.result(30)
        codes = {f.rank: f.code for f in ei.value.failures}
        assert codes[0] == ErrorCode.CANCELLED
        assert codes.get(1) in (ErrorCode.CANCELLED, ErrorCode.BARRIER_ABORTED)  # aborted too
        assert client.evict([3], [3]).result().replies[0].ok
    finally:
        client.close()


def test_a_server_interrupted_while_it_starts_does_not_outlive_the_caller(redis_server):
    """Ctrl-C while a throw-away server started (the bench's, a test's) left the
    process running: nothing held it any more."""
    from kvswap.daemon.storage.local_servers import RedisServer

    server = RedisServer(redis_server.binary)

    def interrupted() -> bool:
        raise KeyboardInterrupt

    server.answers = interrupted  # the first look at whether it answers
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
        assert not server.running
    finally:
        server.close()
