"""Host-tier statistics in shared memory, ``/kvswap.<ns>.hostcache``.

The scheduler's :class:`~kvswap.client.host_cache.HostCache` is the only one who
knows the host tier's hit ratio; ``kvswap status`` and ``kvswap metrics`` read
it from this small segment, which the publishing process creates
(:meth:`HostCache.publish`) and removes (:meth:`HostCache.close`).  It is apart
from the signal segment, whose layout stays as it is; its name has the
namespace's prefix, so the launcher's sweep removes it with the namespace if the
publisher died without closing.

::

    offset 0                                                            256
    +-------+---------+-----+-----------+------------+--------+-- ... --+-----------+
    | magic | version | seq | owner_pid | updated_ns | policy | counters | reserved  |
    | slot 0| 1       | 2   | 3         | 4          | 5      | 6 .. 17  | 18 .. 31  |
    +-------+---------+-----+-----------+------------+--------+-- ... --+-----------+
    32 little-endian u64 slots; field by field in FIELDS (and docs/signals.md)

One writer (the publishing scheduler thread), any number of readers.  The
fields from ``updated_ns`` on are written under a sequence lock: ``seq`` is made
odd, the fields are stored, ``seq`` is made even again.  A reader copies the
fields between two reads of ``seq`` and retries if it was odd or changed, so it
never mixes two updates (e.g. ``hits`` of one and ``lookup_blocks`` of the
next, which would show a wrong ratio).  The writer never waits for a reader.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from kvswap.client.errors import NamespaceError
from kvswap.client.naming import Names
from kvswap.client.protocol import MAX_SECONDS, check_seconds
from kvswap.client.shm_region import SegmentExists, ShmRegion, unlink_shm
from kvswap.client.signals import SignalSegment, now_ns, pid_alive

if TYPE_CHECKING:
    from kvswap.client.host_cache import HostCache

MAGIC = int.from_bytes(b"KVSWAPHC", "little")
LAYOUT_VERSION = 1
SLOTS = 32
SIZE = SLOTS * 8
POLICY_CODES = {"lru": 0, "arc": 1}
# A writer preempted mid-update (seq odd) resumes within a scheduler time slice or a
# few; one that died there never does.  A count of tries instead of a time bound gave
# up after about 10 ms, which a busy 2-core machine exceeds (measured: a status read
# showed no host tier while the publisher ran).
READ_PATIENCE_S = 0.25


def check_interval(interval_s: object) -> float:
    """The publishing interval: seconds, finite, >= 0, at most :data:`MAX_SECONDS`.
    Checked before the segment is created, so a refusal leaves no segment behind
    (``inf`` used to pass a ``>= 0`` test and overflow once the segment existed)."""
    return check_seconds(interval_s, "publish: interval_s", positive=False, most=MAX_SECONDS)


@dataclass(frozen=True)
class Field:
    slot: int
    name: str
    doc: str


FIELDS: tuple[Field, ...] = (
    Field(0, "magic", "0x434850415753564B ('KVSWAPHC' little-endian), written last at creation"),
    Field(1, "layout_version", "1"),
    Field(2, "seq", "sequence lock: odd while the writer updates slots 4-17"),
    Field(3, "owner_pid", "pid of the publishing scheduler process"),
    Field(4, "updated_ns", "CLOCK_MONOTONIC ns of the last update"),
    Field(5, "policy", "0 lru, 1 arc"),
    Field(6, "capacity", "host blocks the HostCache manages"),
    Field(7, "used", "host blocks holding a block (ready or store pending)"),
    Field(8, "pending", "blocks whose store is in flight"),
    Field(9, "protected", "ready blocks with a load in flight"),
    Field(10, "lookups", "lookup() calls"),
    Field(11, "lookup_blocks", "hashes passed to lookup()"),
    Field(12, "hits", "hashes lookup() found ready (hit ratio = hits / lookup_blocks)"),
    Field(13, "loads", "blocks prepared for loading"),
    Field(14, "stores", "blocks whose store completed"),
    Field(15, "store_failures", "blocks whose store failed (freed)"),
    Field(16, "store_refusals", "prepare_store() calls that found no room"),
    Field(17, "evictions", "blocks evicted"),
)
_SLOT = {f.name: f.slot for f in FIELDS}
_COUNTERS = [f.name for f in FIELDS if f.slot >= 6]


class HostCacheStatsWriter:
    """The publishing side: created by :meth:`HostCache.publish`, one per namespace."""

    def __init__(self, names: Names, region: ShmRegion, interval_s: float):
        self.names = names
        self._region = region
        self._slots = region.array(0, (SLOTS,), "<u8")
        self._interval_ns = int(interval_s * 1e9)
        self._next_ns = 0

    @classmethod
    def create(cls, namespace: str, run_root: str | None, interval_s: float) -> "HostCacheStatsWriter":
        interval_s = check_interval(interval_s)  # before the segment exists
        names = Names.of(namespace, run_root)
        SignalSegment.attach(names, readonly=True).close()  # the namespace must exist
        try:
            region = ShmRegion.create(names.host_cache, SIZE)
        except SegmentExists:  # a leftover nobody maps was already replaced by create()
            owner = _owner(names)
            if owner is not None:
                raise NamespaceError(
                    f"the host tier of namespace {namespace!r} is already published by pid "
                    f"{owner}; one HostCache per namespace may publish") from None
            unlink_shm(names.host_cache)  # left by a publisher that is gone
            region = ShmRegion.create(names.host_cache, SIZE)
        writer = cls(names, region, interval_s)
        s = writer._slots
        s[1] = LAYOUT_VERSION
        s[3] = os.getpid()
        s[0] = MAGIC  # last: readers take the segment as valid from here
        return writer

    def write(self, cache: "HostCache") -> None:
        stats = cache.counts()
        s = self._slots
        s[2] = int(s[2]) + 1  # odd: update in progress
        s[4] = now_ns()
        s[5] = POLICY_CODES[stats["policy"]]
        for name in _COUNTERS:
            s[_SLOT[name]] = stats[name]
        s[2] = int(s[2]) + 1
        self._next_ns = time.monotonic_ns() + self._interval_ns

    def maybe_write(self, cache: "HostCache") -> None:
        """Write if ``interval_s`` has passed since the last write (one clock read
        otherwise: this runs on every lookup)."""
        if time.monotonic_ns() >= self._next_ns:
            self.write(cache)

    def close(self) -> None:
        """Remove the segment, unless it is no longer ours (swept and re-created by
        another publisher after a relaunch of the namespace)."""
        del self._slots
        self._region.close()
        if _owner(self.names) in (os.getpid(), None):
            unlink_shm(self.names.host_cache)


def _read_slots(names: Names) -> np.ndarray | None:
    """A consistent copy of the slots (sequence lock), or None if there is no valid
    segment."""
    try:
        region = ShmRegion.attach(names.host_cache, readonly=True)
    except posix_ipc.ExistentialError:
        return None
    try:
        return _consistent_copy(region) if region.size >= SIZE else None
    finally:
        region.close()


def _consistent_copy(region: ShmRegion) -> np.ndarray | None:
    live = region.array(0, (SLOTS,), "<u8")
    if int(live[0]) != MAGIC or int(live[1]) != LAYOUT_VERSION:
        return None
    deadline = time.monotonic() + READ_PATIENCE_S
    while True:
        before = int(live[2])
        copy = live.copy()
        if before % 2 == 0 and int(live[2]) == before:
            return copy
        if time.monotonic() >= deadline:
            return None  # a writer that died mid-update (seq stays odd): nothing reliable
        time.sleep(0.0001)


def _owner(names: Names) -> int | None:
    """Pid of the live publisher of the namespace's segment, else None."""
    try:
        region = ShmRegion.attach(names.host_cache, readonly=True)
    except posix_ipc.ExistentialError:
        return None
    try:
        if region.size < SIZE:
            return None
        slots = region.array(0, (SLOTS,), "<u8")
        pid = int(slots[3]) if int(slots[0]) == MAGIC else 0
        del slots
    finally:
        region.close()
    return pid if pid and pid_alive(pid) else None


def read_host_cache(names: Names) -> dict | None:
    """The published statistics of a namespace as plain data, or None when no
    HostCache publishes them.  ``hit_ratio`` is None before the first lookup;
    ``owner_alive`` False means the publisher is gone (its last values stay)."""
    s = _read_slots(names)
    if s is None:
        return None
    out = {name: int(s[_SLOT[name]]) for name in _COUNTERS}
    code = int(s[_SLOT["policy"]])
    out["policy"] = next((p for p, c in POLICY_CODES.items() if c == code), str(code))
    out["owner_pid"] = int(s[_SLOT["owner_pid"]])
    out["owner_alive"] = pid_alive(out["owner_pid"])
    updated = int(s[_SLOT["updated_ns"]])
    out["age_s"] = max(0, now_ns() - updated) / 1e9 if updated else None
    out["hit_ratio"] = out["hits"] / out["lookup_blocks"] if out["lookup_blocks"] else None
    return out
