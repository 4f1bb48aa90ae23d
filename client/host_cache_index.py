"""The block index under :class:`~kvswap.client.host_cache.HostCache`: hash -> host block,
eviction order, protection counts.  :class:`BlockIndex` holds what every policy shares;
:class:`LruIndex` is the LRU policy, ``host_cache_arc.ArcIndex`` the ARC one.

A block is a small list, ``[host id, refs]`` (ARC adds a third item), where ``refs``
is -1 while its store is pending, 0 when it is ready and idle, and n > 0 while n
loads of it are in flight.  A list rather than an object with named fields because
the index creates one per stored block on the hot path and a two-item list costs a
fraction of an instance (the bookkeeping budget is a few hundred ns per block).

What makes the policies correct, whatever they order by:

* a hash is in ``_blocks`` exactly when it owns a host id, and the ids in
  ``_blocks``, in ``_free`` and in ``withheld`` are, together, each of
  0..capacity-1 once (``withheld``: ids :meth:`adopt` kept out of use, blocks a
  dead engine may still be writing, see ``host_cache_persist``);
* a victim is only ever chosen among blocks with ``refs == 0`` (ready, no load in
  flight), so a pending store or a protected block is never evicted;
* every mutating method either completes or raises before it has changed
  anything (victims are chosen before the first one is removed; loops that
  change blocks one by one undo their steps when a later hash fails).

Not thread-safe: the HostCache that owns the index is used by one thread.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Hashable, Sequence

Hashes = Sequence[Hashable]


def show(h: Hashable) -> str:
    """A hash as error messages print it (bytes keys as hex, shortened)."""
    if isinstance(h, bytes):
        text = h.hex()
        return f"bytes {text[:16]}..." if len(text) > 16 else f"bytes {text}"
    text = repr(h)
    return text if len(text) <= 40 else text[:37] + "..."


class BlockIndex:
    """What LRU and ARC share: the hash map, the free ids, lookup and the load
    protocol, the completion of stores.  Subclasses order blocks and pick victims."""

    policy = ""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: dict = self._new_map()
        # A stack: pop() hands out 0, 1, 2, ... first; freed ids are reused first.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.withheld: frozenset[int] = frozenset()  # never handed out (adopt)
        self.pending = 0  # blocks whose store is pending
        self.protected = 0  # ready blocks with at least one load in flight

    def _new_map(self) -> dict:
        return {}

    # ------------------------------------------------------------------ queries
    @property
    def used(self) -> int:
        """Blocks held by hashes (ready or pending)."""
        return self.capacity - len(self._free) - len(self.withheld)

    def lookup(self, hashes: Hashes) -> int:
        get = self._blocks.get
        n = 0
        for h in hashes:
            b = get(h)
            if b is None or b[1] < 0:
                break
            n += 1
        return n

    def host_id(self, h: Hashable) -> int | None:
        """The host block of a hash in the index (ready or pending), else None."""
        b = self._blocks.get(h)
        return None if b is None else b[0]

    def ready_hashes(self) -> list:
        """Ready blocks, in eviction order as far as the policy has one."""
        return [h for h, b in self._blocks.items() if b[1] >= 0]

    # ------------------------------------------------------------------ loads
    def prepare_load(self, hashes: Hashes) -> list[int]:
        get = self._blocks.get
        ids: list[int] = []
        newly = 0  # blocks that become protected (a local: this loop is hot)
        try:
            for h in hashes:
                b = get(h)
                if b is None or b[1] < 0:
                    why = "is not in host memory" if b is None else "has a store still pending"
                    raise ValueError(f"prepare_load: hash #{len(ids)} ({show(h)}) {why}; "
                                     f"load only the leading hashes lookup() counted")
                if not b[1]:
                    newly += 1
                b[1] += 1
                ids.append(b[0])
        except BaseException:
            self.protected += newly
            self._release(hashes, len(ids))
            raise
        self.protected += newly
        return ids

    def _release(self, hashes: Hashes, count: int) -> None:
        """Undo the first ``count`` steps of a refused prepare_load."""
        for h in list(hashes)[:count]:
            b = self._blocks[h]
            b[1] -= 1
            if not b[1]:
                self.protected -= 1

    def complete_load(self, hashes: Hashes) -> None:
        get = self._blocks.get
        done = freed = 0
        try:
            for h in hashes:
                b = get(h)
                if b is None or b[1] <= 0:
                    raise ValueError(f"complete_load: hash #{done} ({show(h)}) has no load in "
                                     f"flight (complete_load without prepare_load?)")
                b[1] -= 1
                if not b[1]:
                    freed += 1
                done += 1
        except BaseException:
            self.protected -= freed
            self._take_back(hashes, done)
            raise
        self.protected -= freed

    def _take_back(self, hashes: Hashes, count: int) -> None:
        """Undo the first ``count`` steps of a refused complete_load."""
        for h in list(hashes)[:count]:
            b = self._blocks[h]
            if not b[1]:
                self.protected += 1
            b[1] += 1

    def loading_ids(self, hashes: Hashes) -> list[int]:
        """Host ids of blocks that have a load in flight (``fetch(prepared=True)``)."""
        get = self._blocks.get
        ids = []
        for i, h in enumerate(hashes):
            b = get(h)
            if b is None or b[1] <= 0:
                raise ValueError(f"fetch(prepared=True): hash #{i} ({show(h)}) was not prepared "
                                 f"with prepare_load()")
            ids.append(b[0])
        return ids

    # ------------------------------------------------------------------ stores
    def prepare_store(self, hashes: Hashes) -> tuple[list, list[int], list] | None:
        """(new hashes, their host ids, evicted hashes oldest first), or None when the
        new blocks cannot all get an id (then nothing changed).  A new hash unequal to
        itself (a float NaN) is refused: it could never be found again, so its block
        would stay pending for good (and ``clear()`` refused with it)."""
        wanted = dict.fromkeys(hashes)  # call order, duplicates once; unhashable: TypeError
        blocks = self._blocks
        new = [h for h in wanted if h not in blocks]
        if not new:
            return new, [], []
        if any(map(operator.ne, new, new)):  # one C loop: this is the scheduler's hot path
            i = next(i for i, h in enumerate(hashes) if h != h)
            raise ValueError(f"prepare_store: hash #{i} ({show(hashes[i])}) is not equal to "
                             f"itself (a NaN?), so it could never be looked up or completed; "
                             f"use ints or the bytes block_hashes() returns")
        self._plan_store(new)
        free = self._free
        need = len(new) - len(free)
        evicted: list = []
        if need > 0:
            victims = self._victims(need, wanted)
            if victims is None:
                return None
            evicted = self._evict(victims)
        k = len(new)
        ids = free[-k:]
        ids.reverse()
        del free[-k:]
        self._insert(new, ids)
        self.pending += k
        return new, ids, evicted

    def complete_store(self, hashes: Hashes, success: bool) -> list:
        """Hashes whose pending store ended: on success those now ready (in call order),
        on failure those removed.  Hashes that are not pending are ignored."""
        get = self._blocks.get
        done = []
        # dict.fromkeys: duplicates once, and an unhashable value raises before any change.
        for h in dict.fromkeys(hashes):
            b = get(h)
            if b is not None and b[1] < 0:
                b[1] = 0
                if not success:
                    self._unlink(h, b)
                    self._free.append(b[0])
                done.append(h)
        self.pending -= len(done)
        return done

    def adopt(self, entries: list[tuple[Hashable, int]], withheld: Sequence[int] = ()) -> None:
        """Fill an empty index with ready blocks (hash, host id), oldest first, and keep
        the ``withheld`` ids out of use for the index's life (neither free nor held, not
        even after :meth:`clear`): a persisted index recovered by a restarted engine,
        whose predecessor may have left transfers into those blocks that still run
        (``host_cache_persist``)."""
        if self._blocks:
            raise ValueError("adopt: the index is not empty")
        hashes = [h for h, _ in entries]
        ids = [i for _, i in entries]
        kept = frozenset(withheld)
        taken = set(ids) | kept
        if len(taken) != len(ids) + len(kept) or len(set(hashes)) != len(hashes) \
                or not all(0 <= i < self.capacity for i in taken):
            raise ValueError("adopt: hashes and host ids must be unique, ids in range and "
                             "not withheld")
        self.withheld = kept
        self._free = [i for i in range(self.capacity - 1, -1, -1) if i not in taken]
        if not entries:
            return
        self._plan_store(hashes)
        self._insert(hashes, ids)
        self.pending += len(hashes)
        self.complete_store(hashes, True)

    def clear(self) -> list:
        """Forget every block; return the ready ones (they had a stored event)."""
        ready = self.ready_hashes()
        self._blocks = self._new_map()
        self._free = [i for i in range(self.capacity - 1, -1, -1) if i not in self.withheld]
        self.pending = self.protected = 0
        return ready

    # ------------------------------------------------------------------ policy hooks
    def _plan_store(self, new: list) -> None:
        """Called once the hashes to store are known, before victims are chosen."""

    def touch(self, hashes: Hashes) -> None:
        raise NotImplementedError

    def _victims(self, need: int, wanted: dict) -> list | None:
        """``need`` evictable hashes not in ``wanted`` (the call's own hashes), in
        eviction order, or None."""
        raise NotImplementedError

    def _evict(self, victims: list) -> list:
        """Remove the victims, free their ids, return their hashes oldest first."""
        raise NotImplementedError

    def _insert(self, new: list, ids: list[int]) -> None:
        raise NotImplementedError

    def _unlink(self, h: Hashable, b: list) -> None:
        """Remove one block (a failed store) from the policy's structures."""
        raise NotImplementedError

    def extra_stats(self) -> dict:
        return {}


class LruIndex(BlockIndex):
    """Least recently used first.  ``_blocks`` is an OrderedDict whose order *is* the
    recency: the oldest first, the most recent last.  A pending store sits in the
    order like any block (where it was inserted) but is skipped by eviction."""

    policy = "lru"

    def _new_map(self) -> dict:
        return OrderedDict()

    def touch(self, hashes: Hashes) -> None:
        blocks = self._blocks
        # Collect first: an unhashable value raises here, before anything moved.
        present = [h for h in reversed(hashes) if h in blocks]
        move = blocks.move_to_end
        for h in present:
            move(h)

    def _victims(self, need: int, wanted: dict) -> list | None:
        out = []
        for h, b in self._blocks.items():
            if b[1] == 0 and h not in wanted:
                out.append(h)
                if len(out) == need:
                    return out
        return None

    def _evict(self, victims: list) -> list:
        pop = self._blocks.pop
        free = self._free
        for h in victims:
            free.append(pop(h)[0])
        return victims

    def _insert(self, new: list, ids: list[int]) -> None:
        blocks = self._blocks
        for h, i in zip(new, ids):
            blocks[h] = [i, -1]

    def _unlink(self, h: Hashable, b: list) -> None:
        del self._blocks[h]
