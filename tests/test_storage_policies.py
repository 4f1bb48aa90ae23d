"""Storage-tier behaviours engines rely on, end to end at TP=2 (host backend):
MLA dedup (replicated tensors stored once), invalidation on a weight update
(model versions), and prefetch policies (deadline, best effort, min_blocks)."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from kvswap.client import CacheTensor, CacheWorker, ErrorCode, TransferClient, TransferFailed
from kvswap.client.block_keys import block_hashes, entry_name, model_fingerprint
from kvswap.client.errors import InvalidTask, RankRestarted
from kvswap.client.host_cache import HostCache
from kvswap.client.layout import TensorDesc, demo_layout, layout_hash
from kvswap.client.protocol import PROTOCOL_VERSION, packb
from kvswap.client.signals import RankSlot, poll_until
from conftest import DeviceTags
from kvswap.daemon.storage import open_backend
from kvswap.daemon.storage.file import shard_of
from kvswap.daemon.supervisor import SupervisorConfig
from test_daemon import RawPeer
from test_faults import Supervising

TP = 2
HOST = 32
BLOCKS = 32
LATENT = 256  # bytes per block of a replicated (latent) tensor
OWN = 64  # bytes per block of a per-rank tensor


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return block_hashes(list(range(salt * 1000, salt * 1000 + 4 * n)), 4)


def _client(launcher) -> TransferClient:
    c = TransferClient(launcher.names.namespace, TP, run_root=str(launcher.names.run_root),
                       task_timeout=30)
    c.wait_ready(30)
    return c


def _stored(url: str) -> list[str]:
    """Every entry name in the store."""
    if url.startswith("file://"):
        return [p.name for p in Path(url[len("file://"):]).rglob("kvswap.*")]
    import redis

    conn = redis.Redis.from_url(url)
    try:
        return [k.decode() for k in conn.keys("kvswap.*")]
    finally:
        conn.close()


# ------------------------------------------------------------------ MLA dedup

def _latent(tag: int) -> np.ndarray:  # the same on every rank
    return ((np.arange(LATENT) * 5 + tag * 11) % 251).astype(np.uint8)


def _own(rank: int, tag: int) -> np.ndarray:  # differs between ranks
    return ((np.arange(OWN) * 3 + tag * 7 + rank * 101) % 253).astype(np.uint8)


class MlaEngine:
    """Two in-process TP workers whose latent tensors (kv0, kv1) are registered as
    replicated; ``mixed`` adds a per-rank tensor (idx0) that is not."""

    def __init__(self, launcher, mixed: bool):
        names = launcher.names
        self.workers = [CacheWorker(names.namespace, r, run_root=str(names.run_root))
                        for r in range(TP)]
        self.tensors: list[list[CacheTensor]] = []
        for w in self.workers:
            ts = [CacheTensor(f"kv{layer}", layer,
                              w.alloc_host_tensor(f"kv{layer}", (BLOCKS, LATENT), "uint8"),
                              replicated=True) for layer in range(2)]
            if mixed:
                ts.append(CacheTensor("idx0", 0, w.alloc_host_tensor("idx0", (BLOCKS, OWN),
                                                                     "uint8")))
            self.tensors.append(ts)
        for w, ts in zip(self.workers, self.tensors):
            assert w.register(ts, timeout=30).ok
        launcher.wait_ready(30)

    def fill(self, blocks, tags) -> None:
        for rank, ts in enumerate(self.tensors):
            for t in ts:
                for b, tag in zip(blocks, tags):
                    t.array[b] = _latent(tag) if t.replicated else _own(rank, tag)

    def has(self, blocks, tags) -> bool:
        return all(np.array_equal(t.array[b], _latent(tag) if t.replicated else _own(rank, tag))
                   for rank, ts in enumerate(self.tensors) for t in ts
                   for b, tag in zip(blocks, tags))

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _mla_names(keys: list[bytes], mixed: bool) -> tuple[list[str], list[str]]:
    """The names the store must hold: the replicated part once per key, and (mixed)
    each rank's own part."""
    latent = [TensorDesc(f"kv{layer}", layer, "|u1", (BLOCKS, LATENT), replicated=True)
              for layer in range(2)]
    fp_rep = model_fingerprint(layout_hash(latent), f"default|tp={TP}|replicated")
    shared = [entry_name(k, None, fp_rep) for k in keys]
    own: list[str] = []
    if mixed:
        fp_own = model_fingerprint(layout_hash([TensorDesc("idx0", 0, "|u1", (BLOCKS, OWN))]),
                                   f"default|tp={TP}")
        own = [entry_name(k, r, fp_own) for r in range(TP) for k in keys]
    return shared, own


def _mla_round_trip(namespaces, url: str, mixed: bool, listable: bool = True) -> None:
    launcher = namespaces.launch(tp=TP, demo_caches=None, host_blocks=HOST, storage_url=url,
                                 wait=False)
    engine = MlaEngine(launcher, mixed)
    client = _client(launcher)
    store = open_backend(url)
    try:
        n = 6
        keys = _keys(n, salt=1)
        shared, own = _mla_names(keys, mixed)
        engine.fill(range(n), range(1, n + 1))
        client.evict(list(range(n)), list(range(n))).result()
        got = client.backup(list(range(n)), keys).result()
        assert got.count == n
        assert all(store.contains(shared + own))
        if listable:  # and nothing else: the replicated part once for all ranks
            assert sorted(_stored(url)) == sorted(shared + own)
        again = client.backup(list(range(n)), keys).result()
        assert again.replies[0].fields == {"count": 0, "skipped": n}
        assert client.exists(keys).result().count == n

        # zero the host blocks, prefetch them back, load elsewhere: every rank's bytes
        # (rank 1's latent blocks come from the entries rank 0 wrote)
        engine.fill([31], [0])
        client.evict([31] * n, list(range(n))).result()
        got = client.prefetch(keys, list(range(n))).result()
        assert [r.fields["count"] for r in got.replies.values()] == [n, n]
        client.load(list(range(n)), list(range(10, 10 + n))).result()
        assert engine.has(range(10, 10 + n), range(1, n + 1))

        # the shared entry of key 2 gone: every rank commits the same 2 blocks
        store.delete([shared[2]])
        client.evict([31] * n, list(range(n))).result()
        got = client.prefetch(keys, list(range(n))).result()
        assert [r.fields["count"] for r in got.replies.values()] == [2, 2]
        client.load(list(range(n)), list(range(20, 20 + n))).result()
        assert engine.has(range(20, 22), range(1, 3))
        assert engine.has(range(22, 26), [0] * 4)  # nothing past the agreed prefix
    finally:
        store.close()
        client.close()
        engine.close()


@pytest.mark.parametrize("mixed", [True, False], ids=["latent+per-rank", "latent-only"])
def test_replicated_tensors_are_stored_once_and_loaded_on_every_rank(namespaces, tmp_path,
                                                                     mixed):
    _mla_round_trip(namespaces, f"file://{tmp_path}/store", mixed)


def test_replicated_tensors_with_redis(namespaces, redis_url):
    _mla_round_trip(namespaces, redis_url, mixed=True)


def test_replicated_tensors_with_mooncake(namespaces, mooncake_master):
    """Zero-copy reads into two staging areas (one per part), both registered."""
    url = mooncake_master.url(segment="16M", buffer="4M", timeout_s=3, connect_timeout_s=1)
    _mla_round_trip(namespaces, url, mixed=True, listable=False)


def test_replicated_must_be_a_bool(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST, wait=False)
    w = CacheWorker(launcher.names.namespace, 0, run_root=str(launcher.names.run_root))
    try:
        arr = w.alloc_host_tensor("kv0", (BLOCKS, LATENT), "uint8")
        with pytest.raises(InvalidTask, match="replicated must be a bool"):
            w.register([CacheTensor("kv0", 0, arr, replicated=1)], timeout=10)
        with pytest.raises(InvalidTask, match="replicated must be a bool"):
            TensorDesc.from_wire({"name": "kv0", "layer": 0, "dtype": "|u1", "shape": [4, 8],
                                  "replicated": "yes"})
    finally:
        w.close()


def test_a_register_repeat_that_changes_replicated_names_the_field():
    from kvswap.daemon.registration import Registration

    desc = {"name": "kv0", "layer": 0, "dtype": "|u1", "shape": [4, 8], "location": {}}
    reg = Registration([desc])
    changed = {"backend": "host", "tensors": [{**desc, "replicated": True}]}
    assert reg.difference("host", changed) == "tensor 'kv0' differs in replicated"


# ------------------------------------------------------------------ invalidation

LAYOUT = "layers=2,block_tokens=4,heads=2,head_dim=8,blocks=32"
TENSORS = [TensorDesc(t.name, t.layer, t.dtype, t.shape) for t in demo_layout(LAYOUT)]


def _fp(version: str) -> bytes:
    return model_fingerprint(layout_hash(TENSORS), f"default|tp=2|version={version}")


def test_entries_of_an_old_model_version_are_never_matched(namespaces, tmp_path):
    url = f"file://{tmp_path}/store"
    launcher = namespaces.launch(tp=TP, demo_caches=LAYOUT, host_blocks=HOST, storage_url=url,
                                 model_version="v1")
    tags = DeviceTags(launcher.names, TP, TENSORS, HOST)
    client = _client(launcher)
    try:
        keys = _keys(4, salt=2)
        tags.fill([0, 1, 2, 3], [11, 12, 13, 14])
        client.evict([0, 1, 2, 3], [0, 1, 2, 3]).result()
        assert client.backup([0, 1, 2, 3], keys).result().count == 4  # under --model-version
        names = set(_stored(url))
        assert names == {entry_name(k, r, _fp("v1")) for k in keys for r in range(TP)}

        client.set_model_version("v2")
        assert client.exists(keys).result().count == 0
        assert client.prefetch(keys, [4, 5, 6, 7]).result().count == 0
        assert client.backup([0, 1, 2, 3], keys).result().count == 4  # stored anew, not skipped
        assert set(_stored(url)) - names == {entry_name(k, r, _fp("v2"))
                                             for k in keys for r in range(TP)}
        client.set_model_version("v1")  # the old entries are still there, under v1 only
        assert client.exists(keys).result().count == 4

        # a weight update: the host pool's contents and every v1/v2 entry are out of reach
        client.clear_caches(model_version="v3").result(60)
        client.restore_caches().result(60)
        client.wait_ready(30)
        assert client.exists(keys).result().count == 0
        assert client.prefetch(keys, [8, 9, 10, 11]).result().count == 0
        tags.fill([20, 21, 22, 23], [1, 1, 1, 1])
        client.load([0, 1, 2, 3], [20, 21, 22, 23]).result()
        assert tags.has([20, 21, 22, 23], [0, 0, 0, 0])  # a fresh pool: nothing old loaded
        with pytest.raises(InvalidTask, match="model version must be a string"):
            client.set_model_version("v" * 201)
        with pytest.raises(InvalidTask, match="model version must be a string"):
            client.clear_caches(model_version=3)
        # '|' separates the fingerprint's fields: model "m" at version "x|tp=2" named its
        # entries as model "m|tp=2|version=x" at no version did
        with pytest.raises(InvalidTask, match=r"contains '\|'"):
            client.set_model_version("x|tp=2")
        with pytest.raises(InvalidTask, match=r"contains '\|'"):
            client.clear_caches(model_version="v4|tp=2")
        assert client.exists(keys).result().count == 0  # still v3: nothing changed
    finally:
        client.close()
        tags.close()


def test_a_backup_a_crash_interrupted_is_not_replayed_under_another_version(
        namespaces, tmp_path, monkeypatch):
    """The journal does not hold a backup's model version, so a restarted daemon must
    not replay it (under --model-version it would store v2's blocks under v1's names):
    it ends OUTCOME_UNKNOWN, and backing up again skips what was stored."""
    url = f"file://{tmp_path}/store"
    monkeypatch.setenv("KVSWAP_CRASH_AT", "record.before:2")  # 1: the evict, 2: the backup
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST, storage_url=url,
                                 model_version="v1",
                                 supervision=SupervisorConfig(backoff_s=0.05, reset_after_s=0.2))
    monkeypatch.delenv("KVSWAP_CRASH_AT")
    client = TransferClient(launcher.names.namespace, 1, run_root=str(launcher.names.run_root),
                            task_timeout=60)
    try:
        with Supervising(launcher) as sup:
            client.wait_ready(30)
            client.set_model_version("v2")
            keys = _keys(3, salt=4)
            client.evict([0, 1, 2], [0, 1, 2]).result()
            with pytest.raises(RankRestarted) as ei:
                client.backup([0, 1, 2], keys).result(60)
            assert ei.value.failures[0].code == ErrorCode.OUTCOME_UNKNOWN
            assert "its model version is not kept" in ei.value.failures[0].message
            v2 = model_fingerprint(layout_hash(TENSORS), "default|tp=1|version=v2")
            assert set(_stored(url)) == {entry_name(k, 0, v2) for k in keys}  # ran before the kill
            again = client.backup([0, 1, 2], keys).result(60)
            assert again.replies[0].fields == {"count": 0, "skipped": 3}  # stored under v2
            assert not sup.reasons
        assert launcher.supervisor.restarts == 1
    finally:
        client.close()


# ------------------------------------------------------------------ prefetch policies

def _policy_system(namespaces, tmp_path, n: int):
    url = f"file://{tmp_path}/store"
    launcher = namespaces.launch(tp=TP, demo_caches=LAYOUT, host_blocks=HOST, storage_url=url)
    tags = DeviceTags(launcher.names, TP, TENSORS, HOST)
    client = _client(launcher)
    keys = _keys(n, salt=3)
    tags.fill(list(range(n)), list(range(1, n + 1)))
    client.evict(list(range(n)), list(range(n))).result()
    assert client.backup(list(range(n)), keys).result().count == n
    fp = model_fingerprint(layout_hash(TENSORS), "default|tp=2")

    def path_of(key: bytes, rank: int) -> Path:
        name = entry_name(key, rank, fp)
        return tmp_path / "store" / shard_of(name) / name

    return client, tags, keys, path_of


def _open_writer(path: Path) -> int | None:
    """A writer on the FIFO once a reader has opened it (ENXIO until then)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
def test_deadline_commits_the_prefix_every_rank_completed_in_time(namespaces, tmp_path, policy):
    """Rank 1's read of block 3 is held at a FIFO (the gate: open() blocks until a
    writer comes) until its deadline has passed; rank 0 reads all six.  Both commit blocks 0-2, and block 3 is late, not
    corrupt: its entry is left alone."""
    client, tags, keys, path_of = _policy_system(namespaces, tmp_path, 6)
    try:
        gate = path_of(keys[3], 1)
        gate.unlink()
        os.mkfifo(gate)
        deadline_s = 3.0
        fut = client.prefetch(keys, list(range(10, 16)), policy=policy, timeout=deadline_s)
        seg = client.seg  # the namespace's signal segment, read only
        assert poll_until(lambda: True if seg.ranks[1, RankSlot.INFLIGHT] else None,
                          time.monotonic() + 20)
        # rank 1 has admitted the prefetch, so its deadline passes deadline_s from now;
        # its read of block 3 stays blocked in open() until then
        passed = time.monotonic() + deadline_s
        assert poll_until(lambda: True if time.monotonic() > passed else None, passed + 5)
        fd = poll_until(lambda: _open_writer(gate), time.monotonic() + 20)
        assert fd is not None, "rank 1 never reached the gate"
        os.close(fd)  # the read ends (empty), after the deadline
        got = fut.result(30)
        assert [r.fields["count"] for r in got.replies.values()] == [3, 3]
        assert stat.S_ISFIFO(os.stat(gate).st_mode)  # not judged corrupt, not deleted
        client.load(list(range(10, 16)), list(range(20, 26))).result()
        assert tags.has([20, 21, 22], [1, 2, 3])
    finally:
        client.close()
        tags.close()


def test_best_effort_ends_at_a_store_error_and_wait_complete_fails(namespaces, tmp_path):
    client, tags, keys, path_of = _policy_system(namespaces, tmp_path, 6)
    try:
        broken = path_of(keys[3], 1)
        broken.unlink()
        broken.mkdir()  # reading it fails (EISDIR): a store error on rank 1 only
        got = client.prefetch(keys, list(range(10, 16)), policy="best_effort").result(30)
        # rank 1 read blocks 0 (batch of 1) and 1-2 (batch of 2); the batch of 3-5 failed
        assert [r.fields["count"] for r in got.replies.values()] == [3, 3]
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as ei:
            client.prefetch(keys, list(range(10, 16))).result(30)
        codes = {f.rank: f.code for f in ei.value.failures}
        assert codes[1] == ErrorCode.STORAGE_ERROR
        assert codes[0] == ErrorCode.BARRIER_ABORTED  # told at once, not after a timeout
        assert time.monotonic() - t0 < 20  # well under --storage-timeout (30 s)
    finally:
        client.close()
        tags.close()


def test_min_blocks(namespaces, tmp_path):
    client, tags, keys, path_of = _policy_system(namespaces, tmp_path, 6)
    try:
        path_of(keys[3], 1).unlink()  # every rank agrees on 3 blocks
        tags.fill([31], [0])
        client.evict([31] * 6, list(range(10, 16))).result()  # zero the destinations
        got = client.prefetch(keys, list(range(10, 16)), min_blocks=4).result()
        assert [r.fields["count"] for r in got.replies.values()] == [0, 0]
        assert client.prefetch(keys[:2], [10, 11], min_blocks=3).result().count == 0
        client.load(list(range(10, 16)), list(range(20, 26))).result()
        assert tags.has(list(range(20, 26)), [0] * 6)  # nothing written below min_blocks
        assert client.prefetch(keys, list(range(10, 16)), min_blocks=3).result().count == 3
        for bad, match in (
                (dict(policy="eager"), "policy must be one of"),
                (dict(policy="timeout"), "needs timeout"),
                (dict(timeout=1.0), "takes no timeout"),
                (dict(policy="best_effort", timeout=-1), "positive number of seconds"),
                (dict(min_blocks=-1), "non-negative int")):
            with pytest.raises(InvalidTask, match=match):
                client.prefetch(keys, list(range(10, 16)), **bad)
    finally:
        client.close()
        tags.close()


def test_host_cache_prefetch_passes_the_policy_through(namespaces, tmp_path):
    client, tags, keys, path_of = _policy_system(namespaces, tmp_path, 4)
    cache = HostCache(HOST)
    try:
        hashes = list(keys)  # 32-byte hashes are their own storage keys
        path_of(keys[2], 0).unlink()  # every rank agrees on 2 blocks
        with pytest.raises(InvalidTask, match="policy must be one of"):
            cache.prefetch(client, hashes, policy="eager")
        res = cache.prefetch(client, hashes, min_blocks=5).result(30)  # 4 missing < 5
        assert res.hashes == [] and res.dropped == hashes and not res.tasks
        res = cache.prefetch(client, hashes, min_blocks=3).result(30)  # agreed 2 < 3
        assert res.hashes == [] and res.dropped == hashes
        res = cache.prefetch(client, hashes, policy="timeout", timeout=20.0,
                             min_blocks=2).result(30)
        assert res.hashes == hashes[:2] and res.tasks[0].count == 2
        cache.poll()
        assert cache.lookup(hashes) == 2
    finally:
        cache.close()
        client.close()
        tags.close()


def test_the_daemon_refuses_bad_policy_fields_from_a_raw_peer(namespaces, tmp_path):
    """A peer that skips the client's checks: each bad field is BAD_FIELD, nothing runs."""
    launcher = namespaces.launch(tp=1, demo_caches=LAYOUT, host_blocks=HOST,
                                 storage_url=f"file://{tmp_path}/store")
    peer = RawPeer(launcher.names.endpoint(0))
    try:
        keys = b"".join(_keys(2, salt=5))
        ids = np.array([0, 1], "<i4").tobytes()
        for bad, message in (({"policy": "eager"}, "policy must be one of"),
                             ({"policy": "timeout"}, "needs timeout"),
                             ({"policy": "best_effort", "timeout": -1.0}, "positive number"),
                             ({"min": -1}, "min_blocks must be"),
                             ({"mv": "v" * 201}, "model version must be")):
            header = {"v": list(PROTOCOL_VERSION), "id": 5, "op": "prefetch", "ids": "<i4",
                      "n": 2, **bad}
            reply = peer.ask([packb(header), ids, keys])
            assert not reply.ok and reply.code == ErrorCode.BAD_FIELD, (bad, reply)
            assert message in reply.message, (bad, reply.message)
        assert int(launcher.seg.ranks[0, RankSlot.INFLIGHT]) == 0
    finally:
        peer.close()


def test_prefetches_that_reached_the_ranks_in_opposite_orders_do_not_stall(namespaces,
                                                                           tmp_path):
    """Two clients' prefetches A and B reach rank 0 as A, B and rank 1 as B, A (sent
    here rank by rank from raw sockets, each after the other rank is waiting in its
    agreement).  Each rank's storage worker waited in one agreement for the other
    until --storage-timeout and both failed.  The larger task id gives way at once
    (BARRIER_ABORTED naming the cause) and the other completes."""
    from kvswap.client.errors import ErrorCode as Code
    from kvswap.client.protocol import Op, as_keys, decode_reply, storage_message
    from kvswap.client.signals import AgreeSlot, AgreeState

    launcher = namespaces.launch(tp=TP, demo_caches=LAYOUT, host_blocks=HOST,
                                 storage_url=f"file://{tmp_path}/store", storage_timeout_s=20.0)
    seg = launcher.seg
    client = _client(launcher)
    peers = [RawPeer(launcher.names.endpoint(r)) for r in range(TP)]
    try:
        key_a, key_b = _keys(4, salt=1), _keys(4, salt=2)
        client.evict([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]).result()
        assert client.backup([0, 1, 2, 3], key_a).result().count == 4
        assert client.backup([4, 5, 6, 7], key_b).result().count == 4
        epochs = [int(seg.ranks[r, RankSlot.EPOCH]) for r in range(TP)]
        a_id, b_id = 7_000_001, 7_000_000  # A's id is the larger: A gives way
        a = storage_message(Op.PREFETCH, a_id, np.array([10, 11, 12, 13]), as_keys(key_a))
        b = storage_message(Op.PREFETCH, b_id, np.array([14, 15, 16, 17]), as_keys(key_b))

        def waits_in(rank: int, task_id: int) -> bool | None:
            table = seg.agree[rank]
            return True if any(int(table[i, AgreeSlot.TASK_ID]) == task_id
                               and int(table[i, AgreeSlot.STATE]) == AgreeState.POSTED
                               for i in range(table.shape[0])) else None

        t0 = time.monotonic()
        peers[0].sock.send_multipart(a.frames(epochs=epochs))
        peers[1].sock.send_multipart(b.frames(epochs=epochs))
        assert poll_until(lambda: waits_in(0, a_id), time.monotonic() + 20)
        assert poll_until(lambda: waits_in(1, b_id), time.monotonic() + 20)
        peers[0].sock.send_multipart(b.frames(epochs=epochs))  # queued behind A on rank 0
        peers[1].sock.send_multipart(a.frames(epochs=epochs))  # and behind B on rank 1
        replies: dict[tuple[int, int], object] = {}
        for r, peer in enumerate(peers):
            for _ in range(2):
                assert peer.sock.poll(30_000), f"rank {r} did not answer both prefetches"
                reply = decode_reply(peer.sock.recv_multipart()[0])
                replies[r, reply.id] = reply
        assert time.monotonic() - t0 < 10, "a rank waited out --storage-timeout"
        for r in range(TP):
            assert replies[r, b_id].ok and replies[r, b_id].fields["count"] == 4, replies
            assert replies[r, a_id].code == Code.BARRIER_ABORTED, replies[r, a_id]
        assert "opposite orders" in replies[0, a_id].message, replies[0, a_id]
    finally:
        for peer in peers:
            peer.close()
        client.close()
