"""Random operation sequences on HostCache, checked against a simple model (hypothesis).

The model knows, for every hash it has seen stored, whether its store is
pending or how many loads are in flight, its host id, and (for LRU) the recency
order.  After every step: no host id is held twice, ids in use and free ids are
0..N-1 exactly once, the statistics match the model.  On every call: lookup
equals the model's ready prefix (so never more than asked), prepare_store
stores exactly the hashes the model lacks and refuses exactly when the model
says room is short, evicts only ready unprotected blocks outside the call and
only as many as it must (LRU: exactly the oldest), and the events are exactly
the model's transitions.
"""

from __future__ import annotations

from collections import OrderedDict

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvswap.client import HostCache
from kvswap.client.host_cache import CacheEvent

CAPACITY = 5
HASHES = st.integers(min_value=0, max_value=11)
HASH_LISTS = st.lists(HASHES, max_size=7)
PENDING = -1


class HostCacheMachine(RuleBasedStateMachine):
    policy = ""

    def __init__(self) -> None:
        super().__init__()
        self.cache = HostCache(CAPACITY, self.policy)
        self.refs: OrderedDict[int, int] = OrderedDict()  # hash -> refs (-1 pending); LRU order
        self.ids: dict[int, int] = {}
        self.events: list[CacheEvent] = []

    # ------------------------------------------------------------------ helpers
    def ready(self) -> list[int]:
        return [h for h, r in self.refs.items() if r >= 0]

    def expected_lookup(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if self.refs.get(h, PENDING) < 0:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ rules
    @rule(hashes=HASH_LISTS)
    def lookup(self, hashes):
        n = self.cache.lookup(hashes)
        assert n == self.expected_lookup(hashes) and n <= len(hashes)

    @precondition(lambda self: any(r >= 0 for r in self.refs.values()))
    @rule(data=st.data())
    def prepare_load(self, data):
        hashes = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=4))
        ids = self.cache.prepare_load(hashes)
        assert ids.tolist() == [self.ids[h] for h in hashes]
        for h in hashes:
            self.refs[h] += 1

    @precondition(lambda self: any(r > 0 for r in self.refs.values()))
    @rule(data=st.data())
    def complete_load(self, data):
        loading = [h for h, r in self.refs.items() if r > 0]
        h = data.draw(st.sampled_from(loading))
        self.cache.complete_load([h])
        self.refs[h] -= 1

    @rule(hashes=HASH_LISTS)
    def touch(self, hashes):
        self.cache.touch(hashes)
        for h in reversed(hashes):
            if h in self.refs:
                self.refs.move_to_end(h)

    @rule(hashes=HASH_LISTS)
    def prepare_store(self, hashes):
        new = [h for h in dict.fromkeys(hashes) if h not in self.refs]
        free = CAPACITY - len(self.refs)
        evictable = [h for h, r in self.refs.items() if r == 0 and h not in hashes]
        need = max(0, len(new) - free)
        out = self.cache.prepare_store(hashes)
        if len(new) > free + len(evictable):
            assert out is None
            return
        assert out is not None and out.hashes == new
        assert len(out.evicted) == need and len(set(out.evicted)) == need
        assert set(out.evicted) <= set(evictable)  # ready, unprotected, not in the call
        if self.policy == "lru":
            assert out.evicted == evictable[:need]  # the least recently used
        for h in out.evicted:
            del self.refs[h], self.ids[h]
        if out.evicted:
            self.events.append(CacheEvent(out.evicted, True))
        ids = out.host_blocks.tolist()
        assert len(ids) == len(new) and not set(ids) & set(self.ids.values())
        assert len(set(ids)) == len(ids) and all(0 <= i < CAPACITY for i in ids)
        for h, i in zip(new, ids):
            self.refs[h] = PENDING
            self.ids[h] = i

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        pending = [h for h, r in self.refs.items() if r == PENDING]
        hashes = data.draw(st.lists(st.sampled_from(pending) if pending else HASHES,
                                    max_size=4) | HASH_LISTS)
        self.cache.complete_store(hashes, success)
        done = []
        for h in hashes:
            if self.refs.get(h) == PENDING and h not in done:
                done.append(h)
                if success:
                    self.refs[h] = 0
                else:
                    del self.refs[h], self.ids[h]
        if success and done:
            self.events.append(CacheEvent(done, False))

    @precondition(lambda self: all(r == 0 for r in self.refs.values()))
    @rule()
    def clear(self):
        self.cache.clear()
        if self.refs:
            self.events.append(CacheEvent(sorted(self.refs), True))
        self.refs.clear()
        self.ids.clear()

    @rule()
    def take_events(self):
        got = self.cache.take_events()
        normalize = (lambda evs: [(sorted(e.hashes) if e.removed else e.hashes, e.removed)
                                  for e in evs])
        assert normalize(got) == normalize(self.events)
        self.events = []

    # ------------------------------------------------------------------ invariants
    @invariant()
    def ids_are_each_held_once(self):
        held = sorted(self.ids.values())
        assert len(set(held)) == len(held)
        index = self.cache._index
        assert sorted(held + index._free) == list(range(CAPACITY))

    @invariant()
    def stats_match_the_model(self):
        s = self.cache.stats()
        assert s["used"] == len(self.refs)
        assert s["pending"] == sum(r == PENDING for r in self.refs.values())
        assert s["protected"] == sum(r > 0 for r in self.refs.values())
        if self.policy == "arc":
            assert s["t1"] + s["t2"] == len(self.refs)
            assert s["t1"] + s["b1"] <= CAPACITY
            assert s["t1"] + s["t2"] + s["b1"] + s["b2"] <= 2 * CAPACITY
            assert 0 <= s["target_t1"] <= CAPACITY


class LruMachine(HostCacheMachine):
    policy = "lru"


class ArcMachine(HostCacheMachine):
    policy = "arc"


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLru = LruMachine.TestCase
TestLru.settings = _SETTINGS
TestArc = ArcMachine.TestCase
TestArc.settings = _SETTINGS
