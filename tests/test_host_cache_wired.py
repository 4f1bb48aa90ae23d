"""HostCache wired to real daemons (host backend, TP=2): offload, fetch, the storage
tier, the trace replay, and the statistics published for status and metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvswap.client import ErrorCode, HostCache, KvswapError, NamespaceError, TransferClient
from kvswap.client import TransferFailed
from kvswap.client.block_keys import entry_name, model_fingerprint, storage_key
from kvswap.client.host_cache_stats import FIELDS, READ_PATIENCE_S, SLOTS, read_host_cache
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash
from kvswap.client.monitor import format_table, read_status
from kvswap.client.signals import RankSlot, RankState, poll_until
from kvswap.daemon.bench_trace import ReplaySetup, replay_bookkeeping, replay_daemons
from kvswap.daemon.storage import open_backend
from kvswap.daemon.trace import SyntheticConfig, synthetic_trace
from conftest import DeviceTags

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"
HOST = 16
TENSORS = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]
DOCS = Path(__file__).resolve().parent.parent / "docs"


class Device(DeviceTags):
    """Every rank's simulated device tensors; block content is derived from the hash it
    holds (tag = hash + 1; tag 0 = zeros)."""

    def __init__(self, launcher):
        super().__init__(launcher.names, 2, TENSORS, HOST)

    def write(self, blocks, hashes):
        self.fill(blocks, np.asarray(hashes, dtype=np.int64) + 1)

    def wipe(self, blocks):
        self.fill(blocks, [0] * len(blocks))

    def holds(self, blocks, hashes) -> bool:
        return self.has(blocks, np.asarray(hashes, dtype=np.int64) + 1)


@pytest.fixture
def system(namespaces, request):
    storage = getattr(request, "param", None)
    kw = {"storage_url": storage(request)} if storage else {}
    launcher = namespaces.launch(tp=2, demo_caches=LAYOUT, host_blocks=HOST, **kw)
    client = TransferClient(launcher.names.namespace, 2, run_root=str(launcher.names.run_root),
                            task_timeout=30)
    device = Device(launcher)
    try:
        client.wait_ready(20)
        yield launcher, client, device
    finally:
        client.close()
        device.close()


def _file_store(request) -> str:
    return f"file://{request.getfixturevalue('tmp_path')}/store"


STORAGE = pytest.mark.parametrize("system", [_file_store], indirect=True)


# ------------------------------------------------------------------ offload / fetch


def test_offload_then_fetch_moves_and_verifies_blocks_on_every_rank(system):
    _, client, device = system
    cache = HostCache(HOST)
    hashes = [100, 101, 102, 103, 104, 105]
    device.write([0, 1, 2, 3, 4, 5], hashes)
    res = cache.offload(client, hashes, [0, 1, 2, 3, 4, 5]).result()
    assert res.hashes == hashes and len(res.tasks) == 1 and res.nbytes > 0
    # The I/O thread only queued the completion: the index is untouched until the
    # scheduler thread's next call, which applies it before answering.
    assert cache._index.pending == 6
    assert cache.lookup(hashes) == 6
    assert cache._index.pending == 0
    again = cache.offload(client, hashes[:3] + [100], [0, 1, 2, 0])
    assert again.done() and again.result().hashes == [] and again.result().tasks == []
    device.wipe([10, 11, 12, 13, 14, 15])
    got = cache.fetch(client, hashes[::-1], [10, 11, 12, 13, 14, 15])
    assert cache.stats()["protected"] == 6  # protected while the load runs
    assert got.result().hashes == hashes[::-1]
    assert device.holds([10, 11, 12, 13, 14, 15], hashes[::-1])
    assert cache.poll() == 1 and cache.stats()["protected"] == 0


def test_offload_stores_only_what_is_new_and_evicts_for_room(system):
    _, client, device = system
    cache = HostCache(4)
    device.write([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6])
    cache.offload(client, [1, 2, 3, 4], [0, 1, 2, 3]).result()
    res = cache.offload(client, [3, 5, 6], [2, 4, 5]).result()  # 3 is stored already
    assert res.hashes == [5, 6]
    assert [e.hashes for e in cache.take_events() if e.removed] == [[1, 2]]
    device.wipe([20, 21, 22, 23])
    cache.fetch(client, [3, 4, 5, 6], [20, 21, 22, 23]).result()
    assert device.holds([20, 21, 22, 23], [3, 4, 5, 6])


def test_offload_without_room_drops_the_blocks_and_sends_nothing(system):
    _, client, device = system
    cache = HostCache(2)
    device.write([0, 1, 2], [1, 2, 3])
    cache.offload(client, [1, 2], [0, 1]).result()
    cache.poll()
    cache.prepare_load([1, 2])
    fut = cache.offload(client, [3], [2])
    assert fut.done() and fut.result().dropped == [3] and fut.result().tasks == []
    assert 3 not in cache


def test_failed_evict_releases_the_host_blocks(system):
    _, client, device = system
    cache = HostCache(HOST)
    client.pause().result(10)
    try:
        fut = cache.offload(client, [7, 8], [0, 1])
        with pytest.raises(TransferFailed) as ei:
            fut.result()
        assert {f.code for f in ei.value.failures} == {ErrorCode.PAUSED}
    finally:
        client.resume().result(10)
    cache.poll()
    assert 7 not in cache and 8 not in cache
    s = cache.stats()
    assert s["used"] == 0 and s["store_failures"] == 2 and s["stores"] == 0


def test_bad_wired_calls_are_refused_with_nothing_changed(system):
    _, client, device = system
    cache = HostCache(HOST)
    with pytest.raises(ValueError, match="2 hashes but 1 device blocks"):
        cache.offload(client, [1, 2], [0])
    with pytest.raises(ValueError) as ei:  # an InvalidTask, like every refused argument
        cache.offload(client, [1, 2], [0, 32])  # the device caches have 32 blocks
    assert ei.value.code == ErrorCode.ID_OUT_OF_RANGE
    assert cache.stats()["used"] == 0
    fut = cache.offload(client, [1, 2], [0, 1])
    with pytest.raises(ValueError, match="store still pending|not in host memory"):
        cache.fetch(client, [1, 2], [5, 6])  # not ready yet (or already released)
    fut.result()
    with pytest.raises(ValueError, match=r"hash #1 \(3\) is not in host memory"):
        cache.fetch(client, [1, 3], [5, 6])
    with pytest.raises(ValueError, match="was not prepared"):
        cache.fetch(client, [1], [5], prepared=True)
    assert cache.stats()["protected"] == 0
    before = cache.stats()
    with pytest.raises(ValueError) as ei:  # a load writes each device block once
        cache.fetch(client, [1, 2], [5, 5])
    assert ei.value.code == ErrorCode.DUPLICATE_DESTINATION
    too_big = HostCache(HOST + 1)  # its block HOST is past the namespace's host pools
    with pytest.raises(KvswapError, match=f"HostCache\\({HOST}, ...\\)") as ei:
        too_big.offload(client, [7], [3])
    assert ei.value.code == ErrorCode.ID_OUT_OF_RANGE and too_big.stats()["used"] == 0
    assert cache.stats() == before


def test_calls_with_a_closed_client_are_refused_with_nothing_changed(system):
    """With a closed client a wired call used to fail inside (an AttributeError from
    the closed signal segment) or, for a prefetch, after evicting for room."""
    launcher, _, _ = system
    cache = HostCache(2)
    other = TransferClient(launcher.names.namespace, 2, run_root=str(launcher.names.run_root))
    other.wait_ready(20)
    cache.offload(other, [1, 2], [0, 1]).result()  # full: a prefetch would evict
    other.close()
    before = cache.stats()
    for call in (lambda: cache.offload(other, [3], [2]),
                 lambda: cache.fetch(other, [1], [4]),
                 lambda: cache.prefetch(other, [5])):
        with pytest.raises(KvswapError, match="TransferClient is closed") as ei:
            call()
        assert ei.value.code == ErrorCode.SHUTTING_DOWN
    assert cache.stats() == before and cache.lookup([1, 2]) == 2


def test_fetch_of_prepared_blocks_loads_them_and_ends_their_protection(system):
    _, client, device = system
    cache = HostCache(HOST)
    device.write([0, 1], [40, 41])
    cache.offload(client, [40, 41], [0, 1]).result()
    assert cache.lookup([40, 41]) == 2
    cache.prepare_load([40, 41])  # protected first, e.g. while device blocks are freed
    cache.touch([40, 41])
    device.wipe([8, 9])
    cache.fetch(client, [40, 41], [8, 9], prepared=True).result()
    assert device.holds([8, 9], [40, 41])
    cache.poll()
    assert cache.stats()["protected"] == 0


# ------------------------------------------------------------------ the storage tier


@STORAGE
def test_write_through_then_prefetch_falls_through_to_the_file_store(system, tmp_path):
    launcher, client, device = system
    hashes = [500, 501, 502, 503]
    device.write([0, 1, 2, 3], hashes)
    first = HostCache(HOST)
    res = first.offload(client, hashes, [0, 1, 2, 3], backup=True).result()
    assert len(res.tasks) == 2 and res.tasks[1].count == 4  # evict, then backup
    store = open_backend(f"file://{tmp_path}/store")
    fp = model_fingerprint(layout_hash(TENSORS), "default|tp=2")
    try:
        assert all(store.contains([entry_name(storage_key(h), r, fp) for h in hashes]) ==
                   [True] * 4 for r in (0, 1))
    finally:
        store.close()
    # Another engine (a fresh index over the same host blocks) finds them in storage.
    device.wipe([30])
    client.evict([30] * 4, res.host_blocks).result()  # zero the host blocks first
    second = HostCache(HOST)
    got = second.prefetch(client, hashes + [999]).result()
    assert got.hashes == hashes and got.dropped == [999]
    assert second.lookup(hashes + [999]) == 4 and 999 not in second
    device.wipe([10, 11, 12, 13])
    second.fetch(client, hashes, [10, 11, 12, 13]).result()
    assert device.holds([10, 11, 12, 13], hashes)
    assert second.prefetch(client, hashes).result().tasks == []  # all in host: nothing sent


@STORAGE
def test_prefetch_keeps_only_the_agreed_prefix(system):
    _, client, device = system
    device.write([0, 1], [600, 602])
    writer = HostCache(HOST)
    writer.offload(client, [600, 602], [0, 1], backup=True).result()
    reader = HostCache(HOST)
    got = reader.prefetch(client, [600, 601, 602]).result()  # 601 was never stored
    assert got.hashes == [600] and got.dropped == [601, 602]
    assert reader.lookup([600, 601, 602]) == 1 and 602 not in reader
    assert reader.stats()["used"] == 1 and reader.stats()["store_failures"] == 2


def test_backup_without_a_storage_tier_fails_the_future_but_keeps_the_blocks(system):
    _, client, device = system
    cache = HostCache(HOST)
    device.write([0], [70])
    with pytest.raises(TransferFailed) as ei:
        cache.offload(client, [70], [0], backup=True).result()
    assert ei.value.failures[0].code == ErrorCode.STORAGE_ERROR
    assert cache.lookup([70]) == 1  # the evict succeeded: in host memory all the same


def test_a_backup_that_cannot_be_sent_fails_the_future_not_the_index(system, monkeypatch):
    _, client, device = system
    cache = HostCache(HOST)
    device.write([0], [71])

    def refuse(*args, **kw):
        raise RuntimeError("store unreachable")

    monkeypatch.setattr(client, "backup", refuse)
    with pytest.raises(KvswapError, match="write-through backup not sent") as ei:
        cache.offload(client, [71], [0], backup=True).result()
    assert ei.value.code == ErrorCode.STORAGE_ERROR
    assert cache.lookup([71]) == 1  # the evict's completion was queued all the same


# ------------------------------------------------------------------ the trace replay


@pytest.mark.parametrize("policy,storage", [("lru", None), ("arc", "auto")])
def test_replay_through_daemons_equals_the_bookkeeping_and_verifies(namespaces, policy,
                                                                    storage):
    requests = synthetic_trace(SyntheticConfig(requests=120, seed=3))
    setup = ReplaySetup(device_blocks=48, host_blocks=64, policy=policy, tp=2, storage=storage)
    names = namespaces.new()
    real = replay_daemons(requests, setup, run_root=namespaces.run_root,
                          namespace=names.namespace)
    ref = replay_bookkeeping(requests, setup)
    assert real.host_hits > 0 and real.host_hits == ref.host_hits
    assert (real.device_hits, real.storage_hits, real.misses) == (
        ref.device_hits, ref.storage_hits, ref.misses)
    if storage:
        assert real.storage_hits > 0
    assert real.verified == 2 * (real.host_hits + real.storage_hits)  # every block, both ranks
    assert real.mismatched == 0, real.mismatches


# ------------------------------------------------------------------ published statistics


def test_published_statistics_reach_status_and_metrics(system):
    from prometheus_client import generate_latest

    from kvswap.daemon.metrics import registry_for

    launcher, client, device = system
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    assert read_status(ns, root)["host_cache"] is None
    cache = HostCache(HOST, "arc")
    cache.publish(ns, root, interval_s=0)
    try:
        device.write([0, 1], [1, 2])
        cache.offload(client, [1, 2], [0, 1]).result()
        cache.lookup([1, 2, 3, 4])
        st = read_status(ns, root)["host_cache"]
        assert st["policy"] == "arc" and st["owner_pid"] == os.getpid() and st["owner_alive"]
        assert (st["capacity"], st["used"], st["hits"], st["lookup_blocks"], st["stores"]) == (
            HOST, 2, 2, 4, 2)
        assert st["hit_ratio"] == 0.5
        assert "host tier (arc, pid" in format_table(read_status(ns, root))
        assert "hit ratio 50.0% (2 of 4 blocks looked up)" in format_table(read_status(ns, root))
        text = generate_latest(registry_for(ns, root)).decode()
        assert f'kvswap_host_cache_hit_ratio{{namespace="{ns}",policy="arc"}} 0.5' in text
        assert f'kvswap_host_cache_hits_total{{namespace="{ns}",policy="arc"}} 2.0' in text
        with pytest.raises(NamespaceError, match="already published by pid"):
            HostCache(4).publish(ns, root)
    finally:
        cache.close()
    assert read_status(ns, root)["host_cache"] is None
    assert launcher.names.host_cache[1:] not in launcher.names.owned_shm()


def test_publishing_is_throttled_to_the_interval(system):
    launcher, _, _ = system
    cache = HostCache(4)
    cache.publish(launcher.names.namespace, str(launcher.names.run_root), interval_s=3600)
    try:
        cache.lookup([1])
        assert read_host_cache(launcher.names)["lookups"] == 0  # written at publish only
        cache.poll()
        assert read_host_cache(launcher.names)["lookups"] == 0
    finally:
        cache.close()


def test_a_reader_waits_out_a_paused_update_but_not_a_dead_one(system):
    """The sequence lock's reader retries for READ_PATIENCE_S: an update left half-done
    (seq odd, as by a writer that died there) reads as nothing, never as a mixed copy;
    once the update completes, the next read sees it."""
    launcher, _, _ = system
    cache = HostCache(4)
    cache.publish(launcher.names.namespace, str(launcher.names.run_root), interval_s=3600)
    try:
        slots = cache._publisher._slots  # the writer's own view: what a crash would leave
        slots[2] = int(slots[2]) + 1  # an update begun ...
        slots[10] = 7  # ... half written: lookups without lookup_blocks
        t0 = time.monotonic()
        assert read_host_cache(launcher.names) is None
        assert time.monotonic() - t0 >= READ_PATIENCE_S
        slots[11] = 7
        slots[2] = int(slots[2]) + 1  # ... and completed
        st = read_host_cache(launcher.names)
        assert st is not None and st["lookups"] == st["lookup_blocks"] == 7
    finally:
        cache.close()


def test_a_dead_publishers_segment_is_taken_over_and_swept_with_the_namespace(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    code = ("import sys, time; from kvswap.client import HostCache; c = HostCache(4); "
            f"c.publish({ns!r}, {root!r}); print('up', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        with pytest.raises(NamespaceError, match=f"pid {child.pid}"):
            HostCache(4).publish(ns, root)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    st = read_host_cache(launcher.names)
    assert st is not None and st["owner_pid"] == child.pid and not st["owner_alive"]
    mine = HostCache(8)
    mine.publish(ns, root)  # the owner is gone: taken over
    assert read_host_cache(launcher.names)["owner_pid"] == os.getpid()
    launcher.stop()  # a publisher that never closes: the namespace's sweep removes it
    assert launcher.names.owned_shm() == []
    mine.close()  # nothing left to remove; no error


def test_publishing_needs_the_namespace(namespaces):
    names = namespaces.new()
    with pytest.raises(NamespaceError, match="does not exist"):
        HostCache(4).publish(names.namespace, str(names.run_root))
    assert names.owned_shm() == []


def test_a_refused_publishing_interval_leaves_no_segment(namespaces):
    """interval_s=inf passed the old ``>= 0`` check and overflowed after the segment
    was created, leaving it mapped by nobody's writer."""
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    before = launcher.names.owned_shm()
    cache = HostCache(4)
    with pytest.raises(ValueError, match="interval_s must be finite"):
        cache.publish(ns, root, interval_s=float("inf"))
    assert launcher.names.owned_shm() == before and read_host_cache(launcher.names) is None
    cache.publish(ns, root, interval_s=0)  # the refusal left the cache free to publish
    try:
        assert read_host_cache(launcher.names)["owner_pid"] == os.getpid()
    finally:
        cache.close()


def test_signals_doc_draws_the_host_cache_segment_as_the_code_has_it():
    text = (DOCS / "signals.md").read_text()
    section = text[text.index("### Host-tier statistics"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`?(\w+)`?\s*\|", section, re.M)
    assert [(int(s), n) for s, n in rows] == [(f.slot, f.name) for f in FIELDS]
    assert f"{SLOTS} x u64" in section and f"{SLOTS * 8} bytes" in section
    assert "/kvswap.<ns>.hostcache" in text.split("## 9.")[1]  # in the table of objects


def test_readers_never_see_a_half_written_update(namespaces):
    """A publisher in another process updates as fast as it can while this one reads:
    every snapshot is one update (each lookup passes one hash, so the two counters
    are always equal in a consistent copy).  The publisher runs until this side has
    seen 200 different updates, so how many reads overlap writes does not depend on
    which process the machine runs faster."""
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST)
    ns, root = launcher.names.namespace, str(launcher.names.run_root)
    code = ("import sys, threading\n"
            "from kvswap.client import HostCache\n"
            "c = HostCache(64)\n"
            f"c.publish({ns!r}, {root!r}, interval_s=0)\n"
            "done = threading.Event()\n"
            "threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()\n"
            "print('up', flush=True)\n"
            "k = 0\n"
            "while not done.is_set():\n"
            "    c.lookup([k]); k += 1\n"
            "c.close()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        assert child.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 60
        while len(seen) < 200 and child.poll() is None and time.monotonic() < deadline:
            st = read_host_cache(launcher.names)
            if st is None:  # the publisher was preempted mid-update past READ_PATIENCE_S
                continue
            assert st["lookups"] == st["lookup_blocks"], st
            seen.add(st["lookups"])
        child.stdin.close()  # stop: the publisher closes and exits
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
    assert len(seen) >= 200


# ------------------------------------------------------------------ persisted index


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_persisted_index_survives_the_engine_and_never_names_a_rewritten_block(system, policy):
    """HostCache(persist=ns): a successor engine recovers the ready blocks, loads them
    with the right bytes, and does not recover a pending store or a block that was
    being overwritten when the first engine died; another pool discards the mirror."""
    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    first = HostCache(HOST, policy, persist=ns, run_root=rr)
    stored = list(range(100, 108))
    device.write(list(range(8)), stored)
    first.offload(client, [_key(h) for h in stored], list(range(8))).result(30)
    first.poll()
    assert first.lookup([_key(h) for h in stored]) == 8
    # the engine dies with two stores prepared (never completed) and one that evicts
    # the oldest ready block (100): 8 ready + 2 pending + 7 new > 16 host blocks
    assert first.prepare_store([_key(200), _key(201)]) is not None
    out = first.prepare_store([_key(h) for h in range(300, 307)])
    assert out is not None and out.evicted == [_key(100)]
    del first, out  # no close(): a crash leaves the mirror as it was written

    second = HostCache(HOST, policy, persist=ns, run_root=rr)
    assert second.stats()["recovered"] == 7
    assert second.stats()["quarantined"] == 9  # the stores the dead engine had prepared
    (event,) = second.take_events()
    assert not event.removed and event.hashes == [_key(h) for h in stored[1:]]
    assert second.lookup([_key(h) for h in stored[1:]]) == 7
    assert second.lookup([_key(100)]) == 0 and second.lookup([_key(200)]) == 0
    # the store order came back too: the oldest recovered block is the first victim
    extra = [_key(400)]  # no free block: 7 recovered, 9 quarantined
    assert second.prepare_store(extra).evicted == [_key(101)]
    second.complete_store(extra, success=False)
    device.wipe(list(range(8)))
    second.fetch(client, [_key(h) for h in stored[2:]], list(range(6))).result(30)
    assert device.holds(list(range(6)), stored[2:])
    with pytest.raises(ValueError, match="is not 32 bytes"):
        second.prepare_store([5])
    second.close()

    client.clear_caches(free_host=True).result(30)
    client.restore_caches().result(30)
    client.wait_ready(30)
    third = HostCache(HOST, policy, persist=ns, run_root=rr)
    assert third.stats()["recovered"] == 0 and third.lookup([_key(102)]) == 0
    third.close()


def test_a_closed_persisted_cache_leaves_its_successor_only_blocks_that_hold_their_keys(system):
    """After close() the cache went on evicting and reusing blocks, no longer
    mirrored: its successor recovered k0 -> block 0 while block 0 held k4's bytes.
    A closed cache refuses such calls, so the mirror stays what it was at close."""
    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    first = HostCache(4, persist=ns, run_root=rr)
    device.write([0, 1, 2, 3, 4], [10, 11, 12, 13, 14])
    first.offload(client, [_key(h) for h in (10, 11, 12, 13)], [0, 1, 2, 3]).result(30)
    first.poll()
    first.close()
    with pytest.raises(ValueError, match="this HostCache is closed"):
        first.offload(client, [_key(14)], [4])
    second = HostCache(4, persist=ns, run_root=rr)
    assert second.stats()["recovered"] == 4
    device.wipe([8, 9, 10, 11])
    second.fetch(client, [_key(h) for h in (10, 11, 12, 13)], [8, 9, 10, 11]).result(30)
    assert device.holds([8, 9, 10, 11], [10, 11, 12, 13])
    second.close()


def test_blocks_being_written_when_the_engine_died_are_quarantined(system, caplog):
    """A successor handed out the blocks its predecessor was writing when it died, but
    that engine's evict may still be on its way (a busy daemon, a message in its
    socket) and would land after the successor's own evict there: lookup hit, fetch
    loaded the dead engine's bytes.  They are quarantined until every rank has
    restarted (which drops whatever a dead client left in its sockets)."""
    from test_faults import Supervising

    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    first = HostCache(4, persist=ns, run_root=rr)
    device.write([0, 1], [70, 71])
    first.offload(client, [_key(70), _key(71)], [0, 1]).result(30)
    first.poll()
    out = first.prepare_store([_key(72)])  # the engine dies with this evict maybe sent
    assert out is not None and out.host_blocks.tolist() == [2]
    del first, out  # a crash: no close()

    second = HostCache(4, persist=ns, run_root=rr)
    assert "1 of 4 host blocks are quarantined" in caplog.text  # past an eighth: warned
    out = second.prepare_store([_key(73), _key(74)])  # one free block, one eviction
    assert out is not None and 2 not in out.host_blocks.tolist()
    assert out.evicted == [_key(70)]
    assert (second.stats()["recovered"], second.stats()["quarantined"]) == (2, 1)
    second.complete_store([_key(73), _key(74)], success=False)
    del second, out
    third = HostCache(4, persist=ns, run_root=rr)  # no rank restarted: still held
    # block 2, and 3 and 0 too: a store that failed (a timeout) may still run
    assert third.stats()["quarantined"] == 3
    third.close()

    assert launcher.supervise_once() is None  # the supervisor has seen every rank serve
    with Supervising(launcher):
        for proc in launcher.procs:
            os.kill(proc.pid, signal.SIGKILL)
        assert poll_until(lambda: True if all(
            int(launcher.seg.ranks[r, RankSlot.EPOCH]) == 2
            and launcher.seg.state_of(r) == RankState.READY for r in range(2)) else None,
            time.monotonic() + 30), launcher.progress()
    fourth = HostCache(4, persist=ns, run_root=rr)
    assert (fourth.stats()["recovered"], fourth.stats()["quarantined"]) == (1, 0)
    assert fourth.prepare_store([_key(75), _key(76), _key(77)]).host_blocks.tolist() == [0, 2, 3]
    fourth.close()


def test_a_second_live_persisted_cache_is_refused(system):
    """Two live HostCaches of one namespace both handed out block 0 and both wrote the
    one mirror; the successor recovered one's key for the other's bytes.  The
    mirror names its owner: a second cache is refused while that process lives."""
    launcher, _, _ = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvswap.client import HostCache; "
         f"c = HostCache(4, persist={ns!r}, run_root={rr!r}); print('owned', flush=True); "
         "sys.stdin.readline(); c.close(); print('closed', flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "owned"
        with pytest.raises(NamespaceError, match=f"owned by the live HostCache of pid "
                                                 f"{owner.pid}"):
            HostCache(4, persist=ns, run_root=rr)
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "closed"
        mine = HostCache(4, persist=ns, run_root=rr)  # given up at close()
        with pytest.raises(NamespaceError, match="another live HostCache of this process"):
            HostCache(4, persist=ns, run_root=rr)
        mine.close()
    finally:
        owner.kill()
        owner.wait(10)


def test_a_damaged_mirror_is_discarded_not_fatal(system, caplog):
    """A mirror with one key in two ready blocks made every HostCache(persist=)
    raise (from the index's adopt) and left the segment mapped; a stamp near 2**64
    made a later completion raise OverflowError half applied.  Both are damage only,
    and are discarded with a warning, as the other unusable mirrors are."""
    from kvswap.client.host_cache_persist import HEADER_SLOTS, KEY_BYTES
    from kvswap.client.shm_region import ShmRegion

    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    device.write([0, 1], [20, 21])
    keys_at = HEADER_SLOTS * 8 + 2 * 2 * 8  # TP 2: pool inodes, quarantine epochs
    for damage in ("same key", "stamp"):
        first = HostCache(4, persist=ns, run_root=rr)
        first.offload(client, [_key(20), _key(21)], [0, 1]).result(30)
        first.poll()
        first.close()
        region = ShmRegion.attach(launcher.names.host_cache_index)
        try:
            if damage == "same key":
                region.array(keys_at, (4, KEY_BYTES), np.uint8)[1] = np.frombuffer(
                    _key(20), np.uint8)
            else:  # the next stamp at or below the ready blocks' stamps
                region.array(0, (HEADER_SLOTS,), np.uint64)[4] = 1
        finally:
            region.close()
        caplog.clear()
        cache = HostCache(4, persist=ns, run_root=rr)
        assert cache.stats()["recovered"] == 0 and cache.lookup([_key(20)]) == 0
        assert "the segment is damaged" in caplog.text
        cache.close()


def test_the_mirror_works_again_after_a_weight_update(system):
    """clear_caches(model_version=) frees the pools and restore_caches() makes new
    ones; the mirror kept the old pools' inodes, so every successor discarded it until
    the engine itself was relaunched.  clear() now leaves them not known and the next
    store records the pools of that moment."""
    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    first = HostCache(HOST, persist=ns, run_root=rr)
    device.write([0, 1], [30, 31])
    first.offload(client, [_key(30), _key(31)], [0, 1]).result(30)
    client.clear_caches(model_version="v2").result(30)
    first.clear()
    client.restore_caches().result(30)
    client.wait_ready(30)
    device.write([2, 3, 4], [32, 33, 34])
    first.offload(client, [_key(h) for h in (32, 33, 34)], [2, 3, 4]).result(30)
    first.poll()
    del first  # a crash: no close()
    second = HostCache(HOST, persist=ns, run_root=rr)
    assert second.stats()["recovered"] == 3 and second.lookup([_key(30)]) == 0
    device.wipe([8, 9, 10])
    second.fetch(client, [_key(h) for h in (32, 33, 34)], [8, 9, 10]).result(30)
    assert device.holds([8, 9, 10], [32, 33, 34])
    second.close()


def test_a_scheduler_dead_between_clear_caches_and_clear_leaves_no_old_weights(system):
    """clear_caches(free_host=False) keeps the pools (and their inodes): a scheduler
    that died before its cache's clear() left a mirror its successor trusted, and
    lookup hit blocks of the old weights.  The mirror records the namespace's
    barrier generation, which every clear_caches moves: the successor discards it."""
    launcher, client, device = system
    ns, rr = launcher.names.namespace, str(launcher.names.run_root)
    first = HostCache(HOST, persist=ns, run_root=rr)
    device.write([0, 1], [80, 81])
    first.offload(client, [_key(80), _key(81)], [0, 1]).result(30)
    first.poll()
    client.clear_caches(free_host=False).result(30)
    del first  # dies before first.clear()
    client.restore_caches().result(30)
    client.wait_ready(30)
    second = HostCache(HOST, persist=ns, run_root=rr)
    assert second.stats()["recovered"] == 0 and second.lookup([_key(80)]) == 0
    second.close()


def test_a_prefetch_without_a_storage_tier_is_refused_before_it_evicts(system):
    """The namespace has no --storage: the prefetch used to evict ready blocks for
    room and only then fail STORAGE_ERROR.  The signal segment says whether there is
    a storage tier, so it is refused with nothing changed."""
    _, client, device = system
    cache = HostCache(2)
    device.write([0, 1], [40, 41])
    cache.offload(client, [40, 41], [0, 1]).result(30)
    before = cache.stats()
    with pytest.raises(KvswapError, match="launched without --storage") as ei:
        cache.prefetch(client, [50, 51])
    assert ei.value.code == ErrorCode.STORAGE_ERROR
    assert cache.stats() == before and cache.lookup([40, 41]) == 2 and not cache.take_events()[1:]


def test_wired_results_are_copies_of_what_the_index_queued(system):
    """offload().result().hashes was the list queued for the cache's own bookkeeping:
    a caller emptying it left the stores pending for good (and clear() refused);
    the same for fetch, whose blocks stayed protected."""
    _, client, device = system
    cache = HostCache(HOST)
    device.write([0, 1, 2], [60, 61, 62])
    got = cache.offload(client, [60, 61, 62], [0, 1, 2]).result(30)
    got.hashes.clear()
    assert cache.lookup([60, 61, 62]) == 3
    loaded = cache.fetch(client, [60, 61], [5, 6]).result(30)
    loaded.hashes.clear()
    cache.poll()
    assert cache.stats()["protected"] == 0
    cache.clear()
