"""HostCache's contract, case by case (pure bookkeeping, no daemons)."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from kvswap.client import HostCache
from kvswap.client.block_keys import KEY_BYTES, block_hashes, storage_key
from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.host_cache import CacheEvent, CacheFuture, CacheTransfer
from kvswap.client.signals import RankSlot

BOTH = pytest.mark.parametrize("policy", ["lru", "arc"])


def stored(cache: HostCache, hashes) -> np.ndarray:
    out = cache.prepare_store(hashes)
    assert out is not None
    cache.complete_store(out.hashes)
    return out.host_blocks


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("n", [0, -1, 2.0, True, "4"])
def test_num_blocks_must_be_a_positive_int(n):
    with pytest.raises(ValueError, match="num_blocks"):
        HostCache(n)


def test_num_blocks_past_the_bound_is_refused_naming_it():
    """HostCache(10**9) tried to build a 36 GB free list (MemoryError), 2**63 raised
    OverflowError: a ValueError naming the bound comes first."""
    from kvswap.client.host_cache import MAX_BLOCKS

    assert HostCache(MAX_BLOCKS // 1024).capacity == MAX_BLOCKS // 1024
    for n in (MAX_BLOCKS + 1, 10**9, 2**63):
        with pytest.raises(ValueError, match=r"over 67108864 \(2\*\*26\)"):
            HostCache(n)


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="lru, arc"):
        HostCache(4, "fifo")


# ------------------------------------------------------------------ lookup


@BOTH
def test_lookup_counts_leading_ready_hashes(policy):
    c = HostCache(8, policy)
    stored(c, [1, 2, 3])
    assert c.lookup([1, 2, 3, 4]) == 3
    assert c.lookup([2, 9, 3]) == 1  # stops at the first missing one
    assert c.lookup([9, 1]) == 0
    assert c.lookup([]) == 0


@BOTH
def test_lookup_stops_at_a_pending_store(policy):
    c = HostCache(8, policy)
    stored(c, [1])
    out = c.prepare_store([2, 3])
    assert c.lookup([1, 2, 3]) == 1
    c.complete_store(out.hashes)
    assert c.lookup([1, 2, 3]) == 3


@BOTH
def test_bytes_hashes_work_like_ints(policy):
    keys = block_hashes(list(range(64)), 16)
    c = HostCache(8, policy)
    stored(c, keys[:3])
    assert c.lookup(keys) == 3
    assert c.lookup([bytes(k) for k in keys[:2]]) == 2  # equal bytes, other objects


# ------------------------------------------------------------------ prepare_store


@BOTH
def test_prepare_store_skips_stored_and_repeated_hashes(policy):
    c = HostCache(8, policy)
    stored(c, [1, 2])
    pending = c.prepare_store([3])
    out = c.prepare_store([2, 4, 3, 4, 5, 1])
    assert out.hashes == [4, 5]  # 2 and 1 stored, 3 pending, 4 named twice
    assert out.host_blocks.dtype == np.int64 and len(out.host_blocks) == 2
    assert out.evicted == []
    assert pending.hashes == [3]


@BOTH
def test_prepare_store_uses_free_ids_first(policy):
    c = HostCache(4, policy)
    a = stored(c, [1, 2])
    out = c.prepare_store([3, 4])
    assert out.evicted == []
    assert sorted([*a.tolist(), *out.host_blocks.tolist()]) == [0, 1, 2, 3]


@BOTH
def test_prepare_store_of_nothing_new_changes_nothing(policy):
    c = HostCache(2, policy)
    stored(c, [1, 2])
    before = c.stats()
    out = c.prepare_store([2, 1])
    assert (out.hashes, out.evicted, len(out.host_blocks)) == ([], [], 0)
    assert c.stats() == before


def test_lru_evicts_the_least_recent_and_only_as_many_as_needed():
    c = HostCache(4, "lru")
    stored(c, [1, 2, 3, 4])  # 4 is the newest
    out = c.prepare_store([5, 6])
    assert out.evicted == [1, 2]
    assert c.lookup([3, 4]) == 2 and c.lookup([1]) == 0 and c.lookup([2]) == 0


def test_lru_new_blocks_are_newest_in_list_order():
    c = HostCache(3, "lru")
    stored(c, [1, 2, 3])
    assert c.prepare_store([4]).evicted == [1]  # 1 was first in its call: oldest
    c.complete_store([4])
    assert c.prepare_store([5, 6]).evicted == [2, 3]


def test_lru_evicted_ids_are_reused():
    c = HostCache(2, "lru")
    ids = stored(c, [1, 2])
    out = c.prepare_store([3])
    assert out.evicted == [1] and out.host_blocks.tolist() == [ids[0]]


@BOTH
def test_the_calls_own_stored_hashes_are_not_evicted_to_store_the_rest(policy):
    c = HostCache(2, policy)
    stored(c, [1, 2])
    out = c.prepare_store([1, 3])  # 1 is the oldest, but the call wants it kept
    assert out.evicted == [2] and out.hashes == [3]
    c.complete_store(out.hashes)
    assert c.lookup([1, 3]) == 2


@BOTH
def test_prepare_store_refuses_the_whole_call_when_room_is_short(policy):
    c = HostCache(3, policy)
    stored(c, [1, 2, 3])
    c.prepare_load([1, 2])  # protected
    c.take_events()
    before = c.stats()
    assert c.prepare_store([4, 5]) is None  # only 3 is evictable
    after = c.stats()
    assert after.pop("store_refusals") == before.pop("store_refusals") + 1
    assert after == before
    assert c.take_events() == []
    assert c.lookup([1, 2, 3]) == 3  # 3 was not evicted by the refused call
    out = c.prepare_store([4])
    assert out.evicted == [3]


@BOTH
def test_more_new_hashes_than_capacity_is_refused(policy):
    c = HostCache(2, policy)
    assert c.prepare_store([1, 2, 3]) is None
    assert c.stats()["used"] == 0


@BOTH
def test_pending_stores_are_neither_evicted_nor_looked_up(policy):
    c = HostCache(2, policy)
    c.prepare_store([1, 2])
    assert c.prepare_store([3]) is None  # both blocks pending: nothing evictable
    assert c.lookup([1]) == 0


@BOTH
def test_protected_blocks_are_not_evicted_until_complete_load(policy):
    c = HostCache(2, policy)
    stored(c, [1, 2])
    c.prepare_load([1])
    c.prepare_load([1])  # two loads in flight
    assert c.prepare_store([3]).evicted == [2]
    c.complete_store([3])
    c.complete_load([1])
    assert c.prepare_store([4]).evicted == [3]  # 1 still has a load in flight
    c.complete_store([4])
    c.complete_load([1])
    c.prepare_load([4])
    assert c.prepare_store([5]).evicted == [1]  # its last load completed: evictable again


# ------------------------------------------------------------------ complete_store


@BOTH
def test_failed_store_frees_its_blocks_for_reuse(policy):
    c = HostCache(2, policy)
    out = c.prepare_store([1, 2])
    c.complete_store(out.hashes, success=False)
    assert c.stats()["used"] == 0 and c.lookup([1]) == 0
    again = c.prepare_store([3, 4])
    assert sorted(again.host_blocks.tolist()) == sorted(out.host_blocks.tolist())
    assert again.evicted == []
    assert c.take_events() == []  # a failed store was never announced
    assert c.stats()["store_failures"] == 2


@BOTH
def test_complete_store_ignores_hashes_that_are_not_pending(policy):
    c = HostCache(4, policy)
    stored(c, [1])
    out = c.prepare_store([1, 2])
    c.take_events()
    c.complete_store([1, 2, 2, 9])  # the list given to prepare_store, plus noise
    assert c.take_events() == [CacheEvent([2], False)]
    c.complete_store([1, 2], success=False)  # ready blocks are not pending: kept
    assert c.lookup([1, 2]) == 2 and out.hashes == [2]


# ------------------------------------------------------------------ loads


@BOTH
def test_prepare_load_returns_ids_in_order(policy):
    c = HostCache(4, policy)
    ids = stored(c, [10, 11, 12])
    got = c.prepare_load([12, 10])
    assert got.dtype == np.int64 and got.tolist() == [ids[2], ids[0]]
    assert c.stats()["protected"] == 2


@BOTH
@pytest.mark.parametrize("case", ["missing", "pending"])
def test_prepare_load_of_a_block_not_ready_is_refused_and_changes_nothing(policy, case):
    c = HostCache(4, policy)
    stored(c, [1, 2])
    if case == "pending":
        c.prepare_store([3])
    with pytest.raises(ValueError, match=r"hash #2 \(3\)"):
        c.prepare_load([1, 2, 3])
    assert c.stats()["protected"] == 0
    with pytest.raises(ValueError, match="no load in flight"):
        c.complete_load([1])  # the refused call left no reference behind


@BOTH
def test_complete_load_without_prepare_load_is_refused_and_changes_nothing(policy):
    c = HostCache(4, policy)
    stored(c, [1, 2])
    c.prepare_load([1])
    with pytest.raises(ValueError, match=r"hash #1 \(2\)"):
        c.complete_load([1, 2])
    assert c.stats()["protected"] == 1  # 1's reference was given back
    c.complete_load([1])
    assert c.stats()["protected"] == 0


@BOTH
def test_unhashable_hashes_change_nothing(policy):
    c = HostCache(4, policy)
    stored(c, [1, 2])
    for call in (c.prepare_load, c.touch, c.prepare_store):
        with pytest.raises(TypeError):
            call([1, [2]])
    assert c.stats()["protected"] == 0 and c.stats()["used"] == 2


# ------------------------------------------------------------------ touch


def test_lru_touch_makes_the_first_hash_the_most_recent():
    c = HostCache(4, "lru")
    stored(c, [1, 2, 3, 4])
    c.touch([2, 1, 99])  # 99 is not stored: ignored
    assert c.prepare_store([5, 6]).evicted == [3, 4]
    c.complete_store([5, 6])
    assert c.prepare_store([7]).evicted == [1]  # then 2, the most recent of the touched


def test_lru_touch_reorders_pending_blocks_too():
    c = HostCache(3, "lru")
    stored(c, [1])
    c.prepare_store([2, 3])
    c.touch([1])
    c.complete_store([2, 3])
    assert c.prepare_store([4]).evicted == [2]


def test_arc_touch_promotes_ready_blocks_to_the_frequent_list():
    c = HostCache(4, "arc")
    stored(c, [1, 2, 3])
    c.prepare_store([4])  # pending: a touch is not a second use
    c.touch([1, 4, 9])
    s = c.stats()
    assert (s["t1"], s["t2"]) == (3, 1)
    c.complete_store([4])
    # T1 (2, 3, 4) is above the target (0): its oldest go first, T2's 1 stays
    assert c.prepare_store([5, 6]).evicted == [2, 3]
    assert c.stats()["b1"] == 1  # |T1| + |B1| <= capacity: ghost 2, the older, is dropped


def test_arc_ghost_hit_adapts_the_target_and_returns_to_the_frequent_list():
    c = HostCache(2, "arc")
    stored(c, [1, 2])
    c.touch([1])  # 1 -> T2; T1 = [2]
    assert c.prepare_store([3]).evicted == [2]  # |T1| 1 > target 0: T1 gives 2, to B1
    c.complete_store([3])
    assert (c.stats()["b1"], c.stats()["target_t1"]) == (1, 0)
    out = c.prepare_store([2])  # 2 comes back: T1 gave it up too early
    s = c.stats()
    assert s["target_t1"] == 1  # T1 deserves one block more
    assert out.evicted == [1]  # now |T1| 1 <= target 1: T2 gives its oldest
    assert (s["t1"], s["t2"], s["b1"], s["b2"]) == (1, 1, 0, 1)  # 2 went straight to T2


def test_arc_refused_call_keeps_the_target_and_the_ghosts():
    c = HostCache(2, "arc")
    stored(c, [1, 2])
    c.touch([1])
    c.complete_store(c.prepare_store([3]).hashes)  # 2 -> B1
    c.prepare_load([1, 3])
    before = c.stats()
    assert before["b1"] == 1
    assert c.prepare_store([2]) is None  # a ghost hit, but nothing is evictable
    after = c.stats()
    assert after.pop("store_refusals") == before.pop("store_refusals") + 1
    assert after == before


def test_arc_directory_stays_within_twice_the_capacity():
    c = HostCache(4, "arc")
    for k in range(50):
        stored(c, [k])
        if k % 3 == 0:
            c.touch([k])
        s = c.stats()
        assert s["t1"] + s["b1"] <= 4
        assert s["t1"] + s["t2"] + s["b1"] + s["b2"] <= 8


# ------------------------------------------------------------------ events, stats, clear


@BOTH
def test_events_in_order_and_emptied_by_take(policy):
    c = HostCache(2, policy)
    stored(c, [1, 2])
    out = c.prepare_store([3])
    c.complete_store([3])
    assert c.take_events() == [CacheEvent([1, 2], False), CacheEvent(out.evicted, True),
                               CacheEvent([3], False)]
    assert c.take_events() == []


def test_events_can_be_switched_off():
    c = HostCache(2, events=False)
    stored(c, [1, 2])
    stored(c, [3])
    assert c.take_events() == []


@BOTH
def test_stats_count_what_happened(policy):
    c = HostCache(3, policy)
    stored(c, [1, 2, 3])
    c.lookup([1, 2, 9])
    c.lookup([9])
    c.prepare_load([1])
    c.prepare_store([4])
    s = c.stats()
    assert {k: s[k] for k in ("capacity", "used", "ready", "pending", "protected", "lookups",
                              "lookup_blocks", "hits", "loads", "stores", "evictions")} == {
        "capacity": 3, "used": 3, "ready": 2, "pending": 1, "protected": 1, "lookups": 2,
        "lookup_blocks": 4, "hits": 2, "loads": 1, "stores": 3, "evictions": 1}
    assert s["hit_ratio"] == 0.5 and s["policy"] == policy


@BOTH
def test_clear_forgets_everything_with_a_removed_event(policy):
    c = HostCache(3, policy)
    stored(c, [1, 2, 3])
    c.take_events()
    c.clear()
    assert c.lookup([1]) == 0 and c.stats()["used"] == 0
    [ev] = c.take_events()
    assert ev.removed and sorted(ev.hashes) == [1, 2, 3]
    assert sorted(stored(c, [4, 5, 6]).tolist()) == [0, 1, 2]


@BOTH
def test_clear_is_refused_while_transfers_are_in_flight(policy):
    c = HostCache(3, policy)
    stored(c, [1])
    c.prepare_load([1])
    c.prepare_store([2])
    with pytest.raises(ValueError, match="1 store.*1 block"):
        c.clear()
    assert c.lookup([1]) == 1


@BOTH
def test_contains_sees_ready_and_pending_blocks(policy):
    c = HostCache(3, policy)
    stored(c, [1])
    c.prepare_store([2])
    assert 1 in c and 2 in c and 3 not in c


# ------------------------------------------------------------------ storage keys


def test_storage_key_keeps_32_byte_keys_and_digests_the_rest():
    key = block_hashes(list(range(16)), 16)[0]
    assert len(key) == KEY_BYTES and storage_key(key) == key
    # the documented encoding: tag, u32 length, minimal two's complement
    assert storage_key(5) == hashlib.sha256(
        b"kvswap-hash-key-v1\x00" + b"i" + (1).to_bytes(4, "little") + b"\x05").digest()
    assert storage_key(np.int64(5)) == storage_key(5)
    keys = {storage_key(v) for v in (1, "1", b"\x01", (1,), -1, 256, b"x" * 31)}
    assert len(keys) == 7 and all(len(k) == KEY_BYTES for k in keys)


@pytest.mark.parametrize("bad", [1.5, True, None, object(), (1, 2.0)])
def test_storage_key_refuses_values_without_a_stable_encoding(bad):
    with pytest.raises(TypeError, match="int, str, bytes or a tuple"):
        storage_key(bad)


# ------------------------------------------------------------------ bad arguments change nothing


class _FakePersist:
    """Stands in for the shm mirror of ``persist=`` (which needs a namespace)."""

    def unready(self, ids) -> None:
        pass

    def ready(self, keys, ids) -> None:
        pass


class _FailingClient:
    """A client that passes HostCache's checks (open, no pool sizes published yet)
    and whose sends fail, as a send on a client closed meanwhile does."""

    closed = False
    task_timeout = 5.0

    def __init__(self):
        self.seg = type("Seg", (), {"ranks": np.zeros((1, max(RankSlot) + 1), np.int64)})()

    def load(self, *args, **kw):
        raise KvswapError("send failed", ErrorCode.SHUTTING_DOWN)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1, "1", True])
@pytest.mark.parametrize("call", ["result", "exception"])
def test_cache_future_timeout_is_checked_before_waiting(bad, call):
    """inf used to overflow in Event.wait, "1" raised a bare TypeError, nan and -1
    timed out at once; exception() must raise the refusal, not return it."""
    fut = CacheFuture(60.0)
    with pytest.raises(InvalidTask, match="timeout.*pass None to wait") as ei:
        getattr(fut, call)(bad)
    assert ei.value.code == ErrorCode.BAD_FIELD and not fut.done()


def test_cache_future_wait_is_capped_where_threading_can_wait():
    """A huge finite timeout is accepted, as TransferFuture.result accepts it, and
    waits at most threading.TIMEOUT_MAX (1e300 used to raise OverflowError)."""
    fut = CacheFuture(60.0)
    asked = []

    class Recording(threading.Event):
        def wait(self, timeout=None):
            asked.append(timeout)
            fut._finish(CacheTransfer([], np.empty(0, np.int64)))
            return True

    fut._event = Recording()
    assert fut.result(1e300).hashes == [] and asked == [threading.TIMEOUT_MAX]


@pytest.mark.parametrize("policy", [["lru"], None, 1, b"lru"])
def test_policy_of_another_type_is_refused_naming_the_choices(policy):
    with pytest.raises(ValueError, match="lru, arc"):  # a list used to raise "unhashable"
        HostCache(4, policy)


@pytest.mark.parametrize("flag", ["no", 0, None])
def test_events_must_be_a_bool(flag):
    with pytest.raises(ValueError, match="events must be True or False"):
        HostCache(4, events=flag)


@BOTH
@pytest.mark.parametrize("flag", ["no", 1, None])
def test_complete_store_success_must_be_a_bool_and_a_refusal_keeps_the_store_pending(
        policy, flag):
    c = HostCache(4, policy)
    c.prepare_store([1])
    with pytest.raises(ValueError, match="success must be True or False"):
        c.complete_store([1], success=flag)  # "no" used to count as success
    assert c.lookup([1]) == 0 and c.stats()["pending"] == 1
    c.complete_store([1], success=np.bool_(False))  # numpy bools are bools
    assert 1 not in c and c.stats()["store_failures"] == 1


@BOTH
def test_a_refused_prepare_load_of_an_iterator_protects_nothing(policy):
    """The undo of a refused prepare_load re-read the hashes: an iterator was empty
    by then, the protection stayed, and clear() refused forever."""
    c = HostCache(4, policy)
    stored(c, [1, 2])
    with pytest.raises(ValueError, match=r"hash #1 \(9\) is not in host memory"):
        c.prepare_load(iter([1, 9]))
    assert c.stats()["protected"] == 0 and c.stats()["loads"] == 0
    c.clear()


@BOTH
def test_iterables_work_like_lists_in_every_call(policy):
    c = HostCache(4, policy)
    out = c.prepare_store(h for h in [1, 2, 3])
    assert out.hashes == [1, 2, 3]
    c.complete_store(iter(out.hashes))
    assert c.lookup(iter([1, 2, 9])) == 2
    s = c.stats()
    assert (s["lookups"], s["lookup_blocks"], s["hits"]) == (1, 3, 2)
    assert c.prepare_load(iter([3, 1])).tolist() == [out.host_blocks[2], out.host_blocks[0]]
    c.touch(iter([1]))
    with pytest.raises(ValueError, match=r"complete_load: hash #2 \(2\)"):
        c.complete_load(iter([3, 1, 2]))  # 2 has no load: 3's and 1's stay protected
    assert c.stats()["protected"] == 2
    c.complete_load(np.array([3, 1]))
    assert c.stats()["protected"] == 0
    c.clear()


def test_a_persisted_prepare_store_of_an_iterator_stores_its_hashes():
    """The persist= key check used to read the iterator to its end, and prepare_store
    then stored nothing and returned an empty output."""
    keys = block_hashes(list(range(32)), 16)
    c = HostCache(4)
    c._persist = _FakePersist()  # type: ignore[assignment]
    out = c.prepare_store(iter(keys))
    assert out.hashes == keys
    c.complete_store(out.hashes)
    assert c.lookup(keys) == 2


@BOTH
@pytest.mark.parametrize("bad, why", [
    (b"\x01" * 32, "one bytes value"), ("ab", "one str value"), ({1, 2}, "no order"),
    (5, "got int 5"), (np.array(3), "got ndarray")])
def test_hashes_that_are_not_a_sequence_are_refused_with_nothing_counted(policy, bad, why):
    """One bytes hash used to be read as 32 int hashes (lookup counted 32 misses);
    a set has no block order."""
    c = HostCache(4, policy)
    stored(c, [1])
    before = c.stats()
    for call in (c.lookup, c.prepare_load, c.complete_load, c.touch, c.prepare_store,
                 c.complete_store):
        with pytest.raises(ValueError, match=f"hashes .*{why}.*pass a list"):
            call(bad)
    assert c.stats() == before


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1, "x", None])
def test_publish_interval_is_checked_before_the_namespace_is_touched(bad):
    """"x" raised a bare TypeError, inf passed the check and overflowed once the
    segment existed (the wired test shows none is left behind)."""
    c = HostCache(4)
    with pytest.raises(ValueError, match="interval_s must be"):
        c.publish("no-such-namespace", interval_s=bad)


@pytest.mark.parametrize("call", ["offload_backup", "fetch_prepared"])
def test_wired_flags_must_be_bools(call):
    """backup="no" used to mean a write-through backup, prepared="no" a prepared
    fetch; both are refused before the client is looked at."""
    c = HostCache(4)
    stored(c, [1])
    before = c.stats()
    with pytest.raises(ValueError, match="must be True or False"):
        if call == "offload_backup":
            c.offload(None, [2], [0], backup="no")  # type: ignore[arg-type]
        else:
            c.fetch(None, [1], [0], prepared="no")  # type: ignore[arg-type]
    assert c.stats() == before


@BOTH
def test_a_fetch_whose_send_fails_gives_back_its_protection_and_count(policy):
    c = HostCache(4, policy)
    stored(c, [1, 2])
    before = c.stats()
    with pytest.raises(KvswapError, match="send failed"):
        c.fetch(_FailingClient(), [1, 2], [0, 1])  # type: ignore[arg-type]
    assert c.stats() == before  # "loads" used to keep the two blocks


# ------------------------------------------------------------------ misuse


class _Gate:
    """A hash whose hashing blocks until released: a call that hashes it stays inside
    the cache, so another thread's call finds it busy, deterministically."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __hash__(self):
        self.inside.set()
        assert self.release.wait(10)
        return 7


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_call_from_a_second_thread_while_one_is_inside_is_refused(policy):
    """Two threads interleaving in the index handed one host block to several hashes
    and lost others, with only internal errors (a KeyError, "OrderedDict mutated
    during iteration").  A call made while another thread is inside the cache is
    refused, naming the misuse, before it changes anything."""
    cache = HostCache(4, policy)
    out = cache.prepare_store([1, 2])
    cache.complete_store(out.hashes)
    gate = _Gate()
    found: list[int] = []
    t = threading.Thread(target=lambda: found.append(cache.lookup([gate])))
    t.start()
    try:
        assert gate.inside.wait(10)
        before = cache.counts()
        for call in (lambda: cache.prepare_store([3]), lambda: cache.lookup([1]),
                     lambda: cache.clear(), lambda: 1 in cache):
            with pytest.raises(ValueError, match="another thread is inside this HostCache: "
                                                 "it is not thread-safe"):
                call()
        assert cache.counts() == before
    finally:
        gate.release.set()
        t.join(10)
    assert found == [0] and cache.lookup([1, 2]) == 2  # the first call ended normally


def test_a_closed_cache_refuses_calls_that_would_change_it():
    """close() left the index usable but no longer mirrored: with persist= the mirror
    then named blocks the cache had since given to other hashes (a successor loaded
    another key's bytes).  Now every call but close, stats and take_events is refused."""
    cache = HostCache(2)
    cache.complete_store(cache.prepare_store([1]).hashes)
    cache.close()
    for call in (lambda: cache.prepare_store([2]), lambda: cache.lookup([1]),
                 lambda: cache.clear(), lambda: cache.poll(), lambda: cache.touch([1])):
        with pytest.raises(ValueError, match="this HostCache is closed"):
            call()
    assert cache.stats()["ready"] == 1 and [e.hashes for e in cache.take_events()] == [[1]]
    cache.close()  # twice is fine


def test_results_are_copies_not_the_index_lists():
    """The evicted list prepare_store returns was the removed event's own list: a
    caller editing one edited the other."""
    cache = HostCache(1)
    cache.complete_store(cache.prepare_store([1]).hashes)
    cache.take_events()
    out = cache.prepare_store([2])
    out.evicted.clear()
    cache.complete_store(out.hashes)
    events = cache.take_events()
    assert [(e.hashes, e.removed) for e in events] == [([1], True), ([2], False)]


def test_a_hash_unequal_to_itself_is_refused():
    """A NaN hash was stored and could never be completed (NaN != NaN): pending for
    good, and clear() refused for good."""
    cache = HostCache(4)
    with pytest.raises(ValueError, match=r"hash #1 \(nan\) is not equal to itself"):
        cache.prepare_store([1.0, float("nan")])
    assert cache.stats()["used"] == 0
    cache.clear()
