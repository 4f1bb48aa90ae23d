"""ARC (adaptive replacement cache) policy of :class:`~kvswap.client.host_cache.HostCache`.

Four lists, each oldest first:

* T1: blocks stored once and not used since (recency);
* T2: blocks used again while stored, or stored again soon after being evicted
  (frequency);
* B1, B2: ghosts, the hashes (no host block) most recently evicted from T1 and T2.

``target`` (p, 0..capacity) is the size T1 should have.  Eviction takes the oldest
evictable block of T1 while T1 is larger than p, else of T2 (then of the other
list if the chosen one has nothing evictable), and remembers it in B1 or B2.
Storing a hash that is in a ghost list means the cache gave it up too early:
a B1 ghost moves p up (T1 deserved more room) by max(1, |B2|/|B1|), a B2 ghost
moves p down by max(1, |B1|/|B2|), and the block goes straight to T2.  The
directory is bounded as in ARC: |T1| + |B1| <= capacity and all four lists
together <= 2 x capacity (the oldest ghosts go first).

Where this differs from vLLM's ARCOffloadingManager, on purpose (the HostCache
contract is the same):

* the target adapts when a ghost is *stored* again (an actual miss being brought
  back, as in the ARC paper), not when it is touched: an engine touches every
  hash of a request each step, and a hash kept on the device would otherwise
  move p again at every step without any host-tier miss;
* a ghost stored again goes to T2 (ARC's rule), not T1;
* victims are chosen before anything is removed, so a refused prepare_store
  changes nothing (no half-done eviction, no ghost recorded, p unchanged), and
  when the preferred list has nothing evictable the other one is tried.

A block is ``[host id, refs, in_t2]``; see ``host_cache_index`` for ``refs``.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Hashable

from kvswap.client.host_cache_index import BlockIndex, Hashes


class ArcIndex(BlockIndex):
    policy = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._reset_lists()

    def _reset_lists(self) -> None:
        self._t1: OrderedDict = OrderedDict()
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()
        self.target = 0
        self._next_target = 0

    def ready_hashes(self) -> list:
        return [h for lst in (self._t1, self._t2) for h, b in lst.items() if b[1] >= 0]

    def clear(self) -> list:
        ready = super().clear()
        self._reset_lists()
        return ready

    def touch(self, hashes: Hashes) -> None:
        get = self._blocks.get
        present = [(h, b) for h in reversed(hashes) if (b := get(h)) is not None]
        t1, t2 = self._t1, self._t2
        for h, b in present:
            if b[2]:
                t2.move_to_end(h)
            elif b[1] < 0:
                t1.move_to_end(h)  # its store is pending: not a second use yet
            else:
                del t1[h]  # used again: recency -> frequency
                t2[h] = b
                b[2] = True

    def _plan_store(self, new: list) -> None:
        # ARC adapts the target on a ghost hit before it replaces anything.  Each ghost
        # among ``new`` moves it, in call order, with the ghost lists as they are now;
        # the result is used by _victims and kept by _insert, so a refused call
        # leaves the target as it was.
        b1, b2 = self._b1, self._b2
        p, n1, n2 = self.target, len(b1), len(b2)
        for h in new:
            if h in b1:
                p = min(self.capacity, p + max(1, n2 // n1))
                n1 -= 1
            elif h in b2:
                p = max(0, p - max(1, n1 // n2))
                n2 -= 1
        self._next_target = p

    def _victims(self, need: int, wanted: dict) -> list | None:
        # One victim at a time, ARC takes T1's oldest while |T1| > target, else T2's,
        # falling back to the other list when the preferred one has nothing
        # evictable.  In bulk: T1 down to the target, then T2, then T1 again.
        t1_left = (h for h, b in self._t1.items() if b[1] == 0 and h not in wanted)
        t2_left = (h for h, b in self._t2.items() if b[1] == 0 and h not in wanted)
        out = list(islice(t1_left, max(0, min(need, len(self._t1) - self._next_target))))
        out += islice(t2_left, need - len(out))
        if len(out) < need:
            out += islice(t1_left, need - len(out))
            if len(out) < need:
                return None
        return out

    def _evict(self, victims: list) -> list:
        blocks, free, t1, t2, b1, b2 = (self._blocks, self._free, self._t1, self._t2,
                                        self._b1, self._b2)
        for h in victims:
            b = blocks.pop(h)
            if b[2]:
                del t2[h]
                b2[h] = None
            else:
                del t1[h]
                b1[h] = None
            free.append(b[0])
        return victims

    def _insert(self, new: list, ids: list[int]) -> None:
        self.target = self._next_target
        blocks, t1, t2, b1, b2 = self._blocks, self._t1, self._t2, self._b1, self._b2
        for h, i in zip(new, ids):
            if h in b1:
                del b1[h]
                hot = True
            elif h in b2:
                del b2[h]
                hot = True
            else:
                hot = False
            b = [i, -1, hot]
            blocks[h] = b
            (t2 if hot else t1)[h] = b
        cap = self.capacity
        for _ in range(min(len(b1), len(t1) + len(b1) - cap)):
            b1.popitem(last=False)
        for _ in range(min(len(b2), len(t1) + len(t2) + len(b1) + len(b2) - 2 * cap)):
            b2.popitem(last=False)

    def _unlink(self, h: Hashable, b: list) -> None:
        del self._blocks[h]
        del (self._t2 if b[2] else self._t1)[h]

    def extra_stats(self) -> dict:
        return {"t1": len(self._t1), "t2": len(self._t2), "b1": len(self._b1),
                "b2": len(self._b2), "target_t1": self.target}
