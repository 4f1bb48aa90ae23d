"""Transfer semantics end to end (host backend): hazard ordering under concurrency,
layer-wise loads across processes, cancellation, batches, write policies."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

from kvswap.client import (
    CacheTensor,
    CacheWorker,
    ErrorCode,
    InvalidTask,
    RankTimeout,
    TransferClient,
    TransferFailed,
    TransferSpec,
)
from kvswap.client.layout import TensorDesc, demo_layout
from kvswap.client.protocol import BatchItem, Op, decode_reply, encode_batch
from kvswap.client.signals import RankSlot, RankState, poll_until
from kvswap.daemon.demo import RankView, pattern

from conftest import DeviceTags, wait_for_state
from test_daemon import RawPeer

TINY = "layers=3,block_tokens=2,heads=2,head_dim=4,blocks=16"
TINY_HOST = 16


def _fill(views, tensors, dev_tag):
    for rank, view in enumerate(views):
        for ti, t in enumerate(tensors):
            view.device[ti][:] = pattern(rank, ti, dev_tag, t.bytes_per_block // 8)


def _check(views, tensors, dev_tag, host_tag):
    for rank, view in enumerate(views):
        for ti, t in enumerate(tensors):
            w = t.bytes_per_block // 8
            assert np.array_equal(view.device[ti], pattern(rank, ti, dev_tag, w)), (rank, t.name)
            assert np.array_equal(view.host[ti], pattern(rank, ti, host_tag, w)), (rank, t.name)


@pytest.fixture(autouse=True, params=["ring", "zmq"])
def path(request, monkeypatch):
    """Every test here runs over the shared-memory rings and over ZeroMQ alone."""
    monkeypatch.setattr(f"{__name__}._PATH", request.param)
    return request.param


_PATH = "ring"


def _client(launcher, **kw) -> TransferClient:
    c = TransferClient(launcher.names.namespace, launcher.cfg.tp,
                       run_root=str(launcher.names.run_root), path=_PATH, **kw)
    c.wait_ready(10)
    assert c.ping().result(10)
    rings = [p is not None for p in c._wire.rings]
    assert rings == [_PATH == "ring"] * launcher.cfg.tp, f"path {_PATH}: rings in use {rings}"
    return c


def test_concurrent_overlapping_tasks_equal_sequential_model(namespaces):
    """Threads submit random evicts, loads (some layer-wise, some prioritized, some in
    batches) over 16 device and 16 host blocks.  The daemons are frozen (SIGSTOP) while
    each burst is submitted, so they find long queues to reorder, merge and run
    concurrently.  The final contents must equal applying every task one by one in
    submission order."""
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST)
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(TINY)]
    views = [RankView(launcher.names, r, tensors, TINY_HOST) for r in range(2)]
    dev_tag = np.zeros(16, dtype=np.int64)
    host_tag = np.zeros(TINY_HOST, dtype=np.int64)
    order_lock = threading.Lock()  # submission order == model order
    client = _client(launcher)

    def apply(spec: TransferSpec) -> None:
        dev, host = np.asarray(spec.device_blocks), np.asarray(spec.host_blocks)
        if spec.op is Op.EVICT:
            host_tag[host] = dev_tag[dev]
        else:
            dev_tag[dev] = host_tag[host]

    def random_spec(rng: random.Random) -> TransferSpec:
        k = rng.randint(1, 4)
        dev, host = rng.sample(range(16), k), rng.sample(range(TINY_HOST), k)
        prio = rng.choice([0, 0, 1, 5])
        if rng.random() < 0.5:
            return TransferSpec.evict(dev, host, priority=prio)
        return TransferSpec.load(host, dev, priority=prio, layerwise=rng.random() < 0.3)

    def burst(seed: int, out: list) -> None:
        rng = random.Random(seed)
        for _ in range(6):
            with order_lock:
                if rng.random() < 0.2:
                    specs = [random_spec(rng) for _ in range(rng.randint(2, 4))]
                    out += client.submit_batch(specs)
                else:
                    specs = [random_spec(rng)]
                    sp = specs[0]
                    out.append(client.evict(sp.device_blocks, sp.host_blocks,
                                            priority=sp.priority) if sp.op is Op.EVICT
                               else client.load(sp.host_blocks, sp.device_blocks,
                                                priority=sp.priority, layerwise=sp.layerwise))
                for sp in specs:
                    apply(sp)

    pids = [p.pid for p in launcher.procs]
    try:
        for rnd in range(12):
            # fresh content in every device block (as the engine writing new KV), so
            # the tags cannot converge to one value and hide a wrong order
            dev_tag[:] = np.arange(1, 17) + 100 * (rnd + 1)
            _fill(views, tensors, dev_tag)
            futures: list = []
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                threads = [threading.Thread(target=burst, args=(rnd * 10 + i, futures))
                           for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            for f in futures:
                f.result(timeout=30)
            _check(views, tensors, dev_tag, host_tag)
        counters = [r.fields["counters"] for r in client.stats().result(10).replies.values()]
        assert all(c["failed"] == 0 for c in counters)
        assert all(c["merged_batches"] > 0 for c in counters)  # the queues really built up
    finally:
        client.close()
        for v in views:
            v.close()


# ------------------------------------------------------------------ layer-wise

LAYERS = 8
LW_BLOCKS, LW_HOST = 16, 16


def _lw_worker(ns, root, ready_q, task_q, out_q):
    """A TP worker: register 8 layers of K/V, then for each layer-wise load it is
    told about, wait for every layer and check that layer's bytes right away."""
    with CacheWorker(ns, 0, run_root=root) as w:
        tensors = []
        for layer in range(LAYERS):
            for kind in "kv":
                arr = w.alloc_host_tensor(f"{kind}{layer}", (LW_BLOCKS, 4, 16), "uint16")
                tensors.append(CacheTensor(f"{kind}{layer}", layer, arr))
        w.register(tensors)
        ready_q.put(True)
        task_id, dev, expected = task_q.get(timeout=60)
        seen = []
        for layer in range(LAYERS):
            w.wait_layer(task_id, layer, timeout=20)
            for ti in (2 * layer, 2 * layer + 1):
                got = tensors[ti].array[dev].view(np.uint8).reshape(len(dev), -1)
                seen.append(bool(np.array_equal(got, expected[ti])))
        try:
            w.wait_layer(task_id + 999_999, 0, timeout=0.05)
            out_q.put((seen, "no timeout"))
        except RankTimeout as exc:
            out_q.put((seen, str(exc)))


def test_layerwise_load_across_processes(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False, host_blocks=LW_HOST)
    wait_for_state(launcher, RankState.ATTACHING)
    names = launcher.names
    ctx = mp.get_context("fork")
    ready_q, task_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_lw_worker, args=(names.namespace, str(names.run_root), ready_q,
                                             task_q, out_q))
    p.start()
    try:
        assert ready_q.get(timeout=30)
        client = _client(launcher)
        try:
            # known bytes in device blocks 10-12, evicted to the host pool, then loaded
            # back layer-wise into other device blocks
            tensors = [TensorDesc(f"{k}{layer}", layer, "<u2", (LW_BLOCKS, 4, 16))
                       for layer in range(LAYERS) for k in "kv"]
            host = np.array([3, 9, 4])
            dev = np.array([0, 7, 15])
            rng = np.random.default_rng(0)
            view = RankView(names, 0, tensors, LW_HOST)
            expected = []
            for ti in range(len(tensors)):
                blocks = view.device[ti].view(np.uint8)
                expected.append(rng.integers(0, 255, size=(3, blocks.shape[1]), dtype=np.uint8))
                blocks[[10, 11, 12]] = expected[ti]
            view.close()
            client.evict([10, 11, 12], host).result(10)
            fut = client.load(host, dev, layerwise=True)
            task_q.put((fut.task_id, dev, expected))
            fut.result(timeout=30)
            seen, timeout_msg = out_q.get(timeout=60)
            assert seen == [True] * (2 * LAYERS)
            assert "rank 0" in timeout_msg and "layer 0" in timeout_msg
            assert str(fut.task_id + 999_999) in timeout_msg
        finally:
            client.close()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_layerwise_is_load_only(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=TINY, host_blocks=TINY_HOST)
    with _client(launcher) as client:
        with pytest.raises(InvalidTask):
            client.submit_batch([TransferSpec(Op.EVICT, [1], [1], layerwise=True)])


# ------------------------------------------------------------------ cancellation

BIG = "layers=4,block_tokens=16,heads=8,head_dim=128,blocks=160"  # 2 MiB per block


def test_cancel_unstarted_task_and_not_a_running_one(namespaces):
    """A load queued behind a ~300 MiB evict is cancelled before it starts.  Whether
    the cancel arrives before the evict finishes depends on delivery timing, so each
    attempt must be consistent (cancelled: CANCELLED and nothing copied; otherwise:
    completed) and one of five attempts must cancel.  The ordering rules themselves
    are tested deterministically in test_scheduler.py."""
    launcher = namespaces.launch(tp=1, demo_caches=BIG, host_blocks=160)
    pid = launcher.procs[0].pid
    cancelled = 0
    with _client(launcher) as client:
        for attempt in range(5):
            os.kill(pid, signal.SIGSTOP)  # the three messages should reach it together
            try:
                big = client.evict(list(range(150)), list(range(150)))
                after = client.load([0], [155])  # host block 0: must wait for `big`
                cancel = after.cancel()  # all three are sent when these calls return
            finally:
                os.kill(pid, signal.SIGCONT)
            was_cancelled = cancel.result(30).replies[0].fields["cancelled"]
            assert big.result(60).replies[0].ok  # running: completes, never half-applied
            if was_cancelled:
                with pytest.raises(TransferFailed) as ei:
                    after.result(30)
                assert ei.value.failures[0].code == ErrorCode.CANCELLED and after.cancelled()
                cancelled += 1
                break
            assert after.result(30).replies[0].ok and not after.cancelled()
        late = big.cancel()
        assert late.result(10).replies[0].fields["cancelled"] is False
        assert not big.cancelled()
        counters = client.stats().result(10).replies[0].fields["counters"]
        assert counters["failed"] == 0 and counters["inflight"] == 0
        assert counters["completed"] == 2 * attempt + 1  # cancelled tasks are not counted
    assert cancelled == 1


# ------------------------------------------------------------------ batches


def test_batch_answers_each_task_by_its_own_id(namespaces):
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST)
    with _client(launcher) as client:
        futs = client.submit_batch([TransferSpec.evict([1, 2], [1, 2]),
                                    TransferSpec.load([1], [5]),
                                    TransferSpec.evict([6], [7], priority=3)])
        results = [f.result(10) for f in futs]
        assert [sorted(r.replies) for r in results] == [[0, 1]] * 3
        assert client.submit_batch([]) == []
        with pytest.raises(InvalidTask):  # validated whole before anything is sent
            client.submit_batch([TransferSpec.evict([1], [1]), TransferSpec.evict([99], [1])])
    counters = launcher.seg.ranks[:, RankSlot.COMPLETED]
    assert counters.tolist() == [3, 3]

    peer = RawPeer(launcher.names.endpoint(0))
    try:
        items = [BatchItem(11, Op.EVICT, np.array([1]), np.array([1])),
                 BatchItem(12, Op.EVICT, np.array([100]), np.array([2])),  # out of range
                 BatchItem(13, Op.LOAD, np.array([3]), np.array([1]))]
        peer.sock.send_multipart(encode_batch(10, items))
        replies = {}
        for _ in range(4):
            assert peer.sock.poll(10000)
            r = decode_reply(peer.sock.recv_multipart()[0])
            replies[r.id] = r
        assert replies[10].ok and replies[10].fields["accepted"] == 2
        assert replies[11].ok and replies[13].ok
        assert replies[12].code == ErrorCode.ID_OUT_OF_RANGE
    finally:
        peer.close()


@pytest.mark.parametrize("merge", [True, False])
def test_a_burst_of_small_tasks_is_copied_in_one_pass(namespaces, merge):
    """The small independent tasks of one burst (here one batch) are claimed by the
    I/O thread and copied in one pass, which each reply's ``merged`` counts; a task
    that overlaps one of them is never claimed with it and runs after it.  A cancel
    or a pause served in the same burst finds the claimed tasks done (a pause that
    waited for them would be answered by nothing: only a worker's completion looks
    at waiting pauses).  With merging off, each is copied on its own."""
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST, merge=merge)
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(TINY)]
    views = [RankView(launcher.names, r, tensors, TINY_HOST) for r in range(2)]
    dev_tag = np.arange(1, 17) * 7
    host_tag = np.zeros(TINY_HOST, dtype=np.int64)
    pids = [p.pid for p in launcher.procs]

    def one_burst(submit):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # so that everything submit sends is one burst
        try:
            return submit()
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def replies(future):
        return list(future.result(30).replies.values())

    try:
        _fill(views, tensors, dev_tag)
        with _client(launcher) as client:
            def first():
                independent = client.submit_batch([TransferSpec.evict([i], [i])
                                                   for i in range(8)])
                # host 3 again (after independent[3]), then device 12 from it (after that)
                overlap = client.submit_batch([TransferSpec.evict([10], [3]),
                                               TransferSpec.load([3], [12])])
                return independent, overlap, independent[5].cancel()

            independent, overlap, cancel = one_burst(first)
            assert [r.fields["merged"] for f in independent for r in replies(f)] == \
                [8 if merge else 1] * 16
            assert all(r.ok for f in overlap for r in replies(f))
            assert [r.fields["cancelled"] for r in replies(cancel)] == [False, False]
            assert not independent[5].cancelled()
            more, paused = one_burst(lambda: (
                client.submit_batch([TransferSpec.evict([i], [i]) for i in range(13, 16)]),
                client.pause()))
            assert all(r.ok for r in replies(paused))
            assert all(f.done() for f in more)  # answered only once they were
            assert client.resume().result(10)
        host_tag[:8] = dev_tag[:8]
        host_tag[13:16] = dev_tag[13:16]
        host_tag[3] = dev_tag[10]
        dev_tag[12] = dev_tag[10]
        _check(views, tensors, dev_tag, host_tag)
    finally:
        for v in views:
            v.close()


def test_a_claimed_pass_holds_one_direction_and_at_most_max_merge_blocks(namespaces):
    """The I/O thread ends a pass of claimed tasks when the direction changes and before
    it would carry more than --max-merge-blocks blocks; each reply's ``merged`` is the
    size of the pass its task ran in."""
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST,
                                 max_merge_blocks=3)
    with _client(launcher) as client:
        evict = [TransferSpec.evict([i], [i]) for i in (0, 1, 4, 5, 6, 7)]
        load = [TransferSpec.load([h], [h]) for h in (12, 13)]
        futs = client.submit_batch(evict[:2] + load + evict[2:])
        merged = [sorted({r.fields["merged"] for r in f.result(30).replies.values()})
                  for f in futs]
    assert merged == [[2], [2], [2], [2], [3], [3], [3], [1]]


# ------------------------------------------------------------------ write policies


def test_a_write_back_load_held_for_its_evict_is_cancelled_on_the_client(namespaces):
    """A write-back load waits on the client until its evict has completed, so no
    rank knows its id: its cancel was sent, answered ``cancelled: false``, and the
    load ran later, over device blocks the engine may have reused.  Held, it is
    cancelled on the client: CANCELLED on every rank, the cancel's replies true,
    and its destination keeps what it held."""
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST)
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(TINY)]
    views = [RankView(launcher.names, r, tensors, TINY_HOST) for r in range(2)]
    pid1 = launcher.procs[1].pid
    try:
        with _client(launcher) as client:
            before = [v.device[0][6].copy() for v in views]
            os.kill(pid1, signal.SIGSTOP)  # the evict cannot complete: the load is held
            try:
                ev, ld = client.submit_swap(evict=([1], [4]), load=([2], [6]),
                                            policy="write_back")
                replies = ld.cancel().result(10).replies
                assert {r: rep.fields["cancelled"] for r, rep in replies.items()} == {0: True,
                                                                                        1: True}
                assert ld.cancelled()
            finally:
                os.kill(pid1, signal.SIGCONT)
            assert ev.result(20)
            assert client.ping().result(20)  # every rank has answered what came before
            assert all(np.array_equal(v.device[0][6], b) for v, b in zip(views, before))
    finally:
        for v in views:
            v.close()


def _storage_namespace(namespaces, tmp_path):
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST,
                                 storage_url=f"file://{tmp_path}/store")
    tensors = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(TINY)]
    return launcher, DeviceTags(launcher.names, 2, tensors, TINY_HOST)


def test_a_write_through_backup_of_a_cancelled_evict_stores_nothing(namespaces, tmp_path):
    """``evict(..., backup_keys=K)``: an evict cancelled while it waited left the host
    blocks holding their old bytes, and its backup, ordered after it by the host
    blocks alone, stored those under K: entries every node sharing the store would
    load as K's.  The backup names its evict and runs only if that succeeded on the
    rank: here it is CANCELLED on both ranks and nothing is stored."""
    from kvswap.client.block_keys import block_hashes

    launcher, tags = _storage_namespace(namespaces, tmp_path)
    old_keys, new_keys = block_hashes(list(range(8)), 2), block_hashes(list(range(8, 16)), 2)
    host = [0, 1, 2, 3]
    pid1 = launcher.procs[1].pid
    try:
        with _client(launcher) as client:
            client.evict([1, 2, 3, 4], host).result(20)
            assert client.backup(host, old_keys).result(20).count == 4
            os.kill(pid1, signal.SIGSTOP)  # rank 0's prefetch waits in its agreement for rank 1
            try:
                prefetch = client.prefetch(old_keys, host)
                evict = client.evict([5, 6, 7, 8], host, backup_keys=new_keys)  # after it on host
                evict.cancel()
                # rank 0 has answered the evict (cancelled while it waited for the prefetch)
                assert poll_until(lambda: evict.missing_ranks() == [1] or None,
                                  time.monotonic() + 20)
            finally:
                os.kill(pid1, signal.SIGCONT)
            assert prefetch.result(20).count == 4
            with pytest.raises(TransferFailed) as failed:
                evict.result(20)
            assert {f.code for f in failed.value.failures} == {ErrorCode.CANCELLED}
            with pytest.raises(TransferFailed) as failed:
                evict.backup.result(20)
            assert [(f.rank, f.code) for f in failed.value.failures] == [
                (0, ErrorCode.CANCELLED), (1, ErrorCode.CANCELLED)]
            assert "backup not run: the evict it backs up" in str(failed.value)
            assert client.exists(new_keys).result(20).count == 0  # no stale entry under K
    finally:
        tags.close()


def test_a_write_through_backup_runs_before_later_writers_of_its_host_blocks(namespaces,
                                                                             tmp_path):
    """The backup is sent with its evict, so a later evict into the same host blocks
    runs after it on every rank.  (Held on the client until the evict had completed
    everywhere, it let that later evict run first on a rank that was ahead, and
    stored the later bytes under its keys.)"""
    from kvswap.client.block_keys import block_hashes

    launcher, tags = _storage_namespace(namespaces, tmp_path)
    keys = block_hashes(list(range(4)), 2)
    tags.fill([1, 2, 3, 4], [11, 12, 13, 14])
    pid1 = launcher.procs[1].pid
    try:
        with _client(launcher) as client:
            os.kill(pid1, signal.SIGSTOP)  # rank 0 runs ahead: the first evict is not done
            try:
                first = client.evict([1, 2], [0, 1], backup_keys=keys)
                later = client.evict([3, 4], [0, 1])
                assert poll_until(lambda: later.missing_ranks() == [1] or None,
                                  time.monotonic() + 20)
            finally:
                os.kill(pid1, signal.SIGCONT)
            assert first.result(20) and later.result(20)
            assert first.backup.result(20).count == 2
            assert client.prefetch(keys, [8, 9]).result(20).count == 2
            client.load([8, 9], [10, 11]).result(20)
            assert tags.has([10, 11], [11, 12])  # the first evict's bytes, on every rank
    finally:
        tags.close()


@pytest.mark.parametrize("policy, rank0_done_while_rank1_stopped", [
    ("write_through", 2),  # both tasks went out at once
    ("write_back", 1),  # the load waits for the evict on every rank
])
def test_write_policies(namespaces, policy, rank0_done_while_rank1_stopped):
    launcher = namespaces.launch(tp=2, demo_caches=TINY, host_blocks=TINY_HOST)
    seg = launcher.seg
    pid1 = launcher.procs[1].pid
    with _client(launcher) as client:
        os.kill(pid1, signal.SIGSTOP)
        try:
            ev, ld = client.submit_swap(evict=([1, 2], [4, 5]), load=([6], [0]), policy=policy)
            assert poll_until(lambda: True if int(seg.ranks[0, RankSlot.COMPLETED]) >=
                              rank0_done_while_rank1_stopped else None, time.monotonic() + 20)
            # rank 1 is stopped: the evict cannot complete, so write_back holds the load
            assert int(seg.ranks[0, RankSlot.COMPLETED]) == rank0_done_while_rank1_stopped
            assert not ev.done() and not ld.done()
        finally:
            os.kill(pid1, signal.SIGCONT)
        assert ev.result(20) and ld.result(20)
        with pytest.raises(ValueError):
            client.submit_swap(([1], [1]), ([1], [1]), policy="sometimes")
    assert seg.ranks[:, RankSlot.COMPLETED].tolist() == [2, 2]
