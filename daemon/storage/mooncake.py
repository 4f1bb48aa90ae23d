"""Storage backend on Mooncake Store (``mooncake-transfer-engine-non-cuda`` or a CUDA
build; install ``kvswap[mooncake]``); URL scheme ``mooncake://`` (registered in
:data:`kvswap.daemon.storage.BACKENDS`).

Mooncake Store keeps objects in memory *segments* that its clients mount, with a
master that places objects and maps names to replicas; engines share KV caches
through it across nodes.  Each entry is one object.

**Zero-copy.**  The daemon registers its rank's host swap pool (role ``"host"``)
and its prefetch staging area (role ``"staging"``) with
:meth:`MooncakeBackend.register_buffers`.  ``put`` then hands Mooncake each
entry as a list of (address, length) parts, ``batch_put_from_multi_buffers``,
which the transfer engine reads where they lie; only the 52-byte entry header,
any part outside registered memory and any part under ``copy_below`` bytes are
first copied into a registered *bounce* area owned by the backend, where an
entry's copied parts lie side by side and travel as one (the TCP transport moves
each part as a transfer of its own: for 8 parts of 32 KiB per entry, gathering
them was 1.4x faster here).  ``get`` with registered ``into`` buffers reads each
entry in place (``batch_get_into``), else ``get_batch`` (new bytes objects).

**Put-if-absent.**  A Mooncake put of an existing name keeps the stored object
and reports success, so ``put`` asks ``batch_is_exist`` first and puts only the
absent names: False for a name that already held an entry.  A name stored by
someone else between the two calls reads as stored by this put (the two
entries are of the same content key, so either is as good).

**Failures and timeouts.** The master or the segment holder gone (killed, unreachable)
usually makes a call fail at once with an RPC error: StorageError (or, while the client
is still noticing the loss, StorageTimeout). A master that accepts connections but does
not answer would block the calling thread inside the C++ client, so every call runs on
the backend's own call thread and the caller waits at most ``timeout_s``: then
StorageTimeout.  The stuck call keeps its buffers (bounce area, staging) until it
returns, so until then every further call fails at once with StorageTimeout instead of
queueing behind it or touching those buffers.  The client reconnects to a restarted
master by itself (it pings the master every second and re-mounts its segment); a client
whose first connection failed is set up again on the next call, after a quick TCP probe
of the master so that a dead master costs ``connect_timeout_s``, not the client's own
retries (about 90 s); ``close`` tears it down only if the master answers.

**Where entries live.**  In the clients' segments: a rank's (``segment`` > 0) vanish
when it stops, a standalone ``mooncake_client``'s outlive the daemons (docs/storage.md).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence, TypeVar

import numpy as np
from mooncake.store import MooncakeDistributedStore

from kvswap.daemon.storage import (
    Buffer,
    NotAnEntry,
    Stored,
    StorageError,
    StorageTimeout,
    as_byte_views,
    check_names,
)
from kvswap.daemon.storage.mooncake_buffers import Bounce, Regions, address, keep_until_exit
from kvswap.daemon.storage.mooncake_settings import MooncakeSettings

log = logging.getLogger("kvswap.daemon.storage")

# Return codes of the store client (negative = error).
NO_ROOM = -200  # no segment can take the object: the store is full, or none is mounted
RPC_FAIL = -900  # the master did not take the call (down, unreachable)
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # batch_get_into: the object is larger than the buffer given
TEARDOWN_S = 5.0  # close()'s wait past timeout_s for a teardown (0.8-2.9 s, master up)

T = TypeVar("T")


class _CallThread:
    """One daemon thread that runs the store calls in order.  Not a ThreadPoolExecutor:
    the interpreter joins those at exit, so a call stuck on a frozen master would
    keep the process from exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvswap-mooncake", daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future:
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def stop(self) -> None:
        self._queue.put(None)


class MooncakeBackend:
    """Entries in a Mooncake Store; see the module docstring.

    Thread-safe: calls are serialized on the backend's call thread (the daemon has
    one storage thread per rank, so nothing waits on another caller there).
    """

    def __init__(self, settings: MooncakeSettings):
        self.settings = settings
        self.where = f"mooncake://{settings.master}"
        self._lock = threading.Lock()
        self._calls = _CallThread()
        self._stuck: Future | None = None  # a call that outlived timeout_s, still running
        self._store: MooncakeDistributedStore | None = None
        self._regions = Regions()
        self._registered: list[tuple[int, int]] = []  # what the store client holds now
        self._bounce = Bounce()
        self._dirty = False  # roles changed since the client last registered
        self.bounced_bytes = 0  # copied into the bounce area by puts (headers, stray parts)
        self._closed = False
        self.left_to_exit: str | None = None  # why close() left the client open

    @classmethod
    def from_url(cls, url: str) -> "MooncakeBackend":
        """``mooncake://MASTER_HOST[:PORT]?metadata=URL&...`` with the options of
        docs/storage.md; connects on first use."""
        return cls(MooncakeSettings.parse(url))

    @classmethod
    def check_url(cls, url: str) -> None:
        """:meth:`from_url`'s ValueErrors, without connecting."""
        MooncakeSettings.parse(url)

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.where})"

    # ------------------------------------------------------------ registration

    def register_buffers(self, role: str, buffers: Sequence[Buffer]) -> None:
        """Make ``buffers`` the registered memory of ``role`` (``"host"``, ``"staging"``),
        replacing what that role had; ``[]`` releases the role's memory, which the
        caller must do before it frees or unmaps it.  Parts and ``into`` buffers in
        registered memory move without a copy."""
        spans = [s for s in (address(b) for b in buffers) if s[1]]
        with self._lock:  # held by _call while a call runs: no transfer is using them now
            self._regions.set(role, spans)
            self._dirty = True
            connected = self._store is not None
        if connected:
            # Registering talks to the metadata server (the master's, usually): on the
            # call thread, within timeout_s.  If that fails, the next call registers
            # first (and fails if it cannot), so no transfer uses stale registrations.
            try:
                self._call(f"register {role} buffers", lambda store: None)
            except StorageError as exc:
                log.warning("%s: registering %s buffers deferred to the next call: %s",
                            self.where, role, exc)

    def _sync_registration(self, store: MooncakeDistributedStore) -> None:
        """Bring the client's registered ranges to the roles' ranges plus the bounce area."""
        bounce = self._bounce.array
        want = self._regions.all()
        if bounce.nbytes:
            want.append((int(bounce.ctypes.data), bounce.nbytes))
        for addr, size in self._registered:
            if (addr, size) not in want:
                store.unregister_buffer(addr)
        for addr, size in want:
            if (addr, size) not in self._registered:
                rc = store.register_buffer(addr, size)
                if rc != 0:
                    self._registered = [s for s in self._registered if s in want]
                    raise StorageError(f"{self.where}: register_buffer of {size} bytes "
                                       f"failed ({rc})")
        self._registered = want
        self._dirty = False

    # ------------------------------------------------------------ calls

    def _connect(self) -> MooncakeDistributedStore:
        """The store client, set up on first use (or again after a failed setup)."""
        if self._store is not None:
            if self._dirty:
                self._sync_registration(self._store)
            return self._store
        s = self.settings
        try:
            with socket.create_connection((s.master_host, s.master_port),
                                          timeout=s.connect_timeout_s) as probe:
                local = s.local_hostname or probe.getsockname()[0]
        except OSError as exc:
            raise StorageError(f"{self.where}: master unreachable: {exc}") from exc
        store = MooncakeDistributedStore()
        rc = store.setup(local, s.metadata, s.segment, s.buffer, s.protocol, s.device, s.master)
        if rc != 0:
            raise StorageError(f"{self.where}: store client setup failed ({rc}); check the "
                               f"master address and metadata={s.metadata}")
        self._store = store
        self._registered = []
        self._sync_registration(store)
        return store

    def _call(self, what: str, fn: Callable[[MooncakeDistributedStore], T]) -> T:
        """Run ``fn(store)`` on the call thread, waiting at most ``timeout_s``."""
        with self._lock:
            if self._closed:
                raise StorageError(f"{self.where}: backend is closed")
            if self._stuck is not None:
                if not self._stuck.done():
                    raise StorageTimeout(f"{self.where}: {what} refused: an earlier call has "
                                         f"not been answered by the master yet")
                self._stuck = None
            future = self._calls.submit(lambda: fn(self._connect()))
            try:
                return future.result(self.settings.timeout_s)
            except FutureTimeout:
                self._stuck = future
                raise StorageTimeout(f"{self.where}: {what} got no answer within "
                                     f"{self.settings.timeout_s:g} s") from None

    def _failed(self, what: str, rc: int) -> StorageError:
        why = {RPC_FAIL: " (master unreachable)",
               NO_ROOM: " (no segment has room: the store is full, or no client with "
                        "segment > 0 is connected)"}.get(rc, "")
        return StorageError(f"{self.where}: {what} failed with code {rc}{why}")

    # ------------------------------------------------------------ interface

    def _check(self, names: Sequence[str]) -> None:
        if self._closed:
            raise StorageError(f"{self.where}: backend is closed")
        check_names(names)

    def _exist(self, store: MooncakeDistributedStore, names: Sequence[str]) -> list[bool]:
        codes = store.batch_is_exist(list(names))
        bad = next((c for c in codes if c not in (0, 1)), None)
        if bad is not None or len(codes) != len(names):
            raise self._failed(f"exists ({len(names)} names)", bad if bad is not None else -1)
        return [c == 1 for c in codes]

    def contains(self, names: Sequence[str]) -> list[bool]:
        self._check(names)
        if not names:
            return []
        return self._call(f"contains ({len(names)} names)", lambda st: self._exist(st, names))

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self._check([name for name, _ in items])
        entries = [[address(p) for p in as_byte_views(parts)] for _, parts in items]
        if not items:
            return []

        def run(store: MooncakeDistributedStore) -> list[bool]:
            absent = [i for i, there in enumerate(self._exist(store, [n for n, _ in items]))
                      if not there]
            if not absent:
                return [False] * len(items)
            ptrs, sizes = self._place(store, [items[i][1] for i in absent],
                                      [entries[i] for i in absent])
            codes = store.batch_put_from_multi_buffers([items[i][0] for i in absent],
                                                       ptrs, sizes)
            bad = next((c for c in codes if c != 0), None)
            if bad is not None:
                raise self._failed(f"put ({len(absent)} entries)", bad)
            stored = [False] * len(items)
            for i in absent:
                stored[i] = True
            return stored

        return self._call(f"put ({len(items)} entries)", run)

    def _place(self, store: MooncakeDistributedStore, parts: list[Sequence[Buffer]],
               spans: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[list[int]]]:
        """Per entry, the addresses and lengths to put: registered parts as they lie,
        the others (and those under ``copy_below``) copied into the bounce area, where
        an entry's copied parts lie side by side and go as one (call thread only)."""
        small = self.settings.copy_below
        outside = [(e, j) for e, entry in enumerate(spans) for j, (addr, size) in
                   enumerate(entry)
                   if size and (size < small or not self._regions.covers(addr, size))]
        offsets = np.cumsum([0] + [spans[e][j][1] for e, j in outside])
        if self._bounce.reserve(int(offsets[-1])):
            self._sync_registration(store)
        base = int(self._bounce.array.ctypes.data) if self._bounce.array.nbytes else 0
        moved = {}
        for (e, j), off in zip(outside, offsets[:-1].tolist()):
            view = as_byte_views([parts[e][j]])[0]
            self._bounce.array[off:off + view.nbytes] = np.frombuffer(view, np.uint8)
            self.bounced_bytes += view.nbytes
            moved[e, j] = base + off
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for e, entry in enumerate(spans):
            p: list[int] = []
            n: list[int] = []
            for j, (addr, size) in enumerate(entry):
                addr = moved.get((e, j), addr)
                if p and p[-1] + n[-1] == addr:  # adjacent parts go as one
                    n[-1] += size
                elif size:
                    p.append(addr)
                    n.append(size)
            ptrs.append(p)
            sizes.append(n)
        return ptrs, sizes

    def get(self, names: Sequence[str],
            into: Sequence[memoryview] | None = None) -> list[Stored | NotAnEntry | None]:
        self._check(names)
        if not names:
            return []
        if into is not None and len(into) == len(names):
            spans = [address(b) for b in into]
            if all(size and self._regions.covers(a, size) for a, size in spans):
                return self._call(f"get ({len(names)} names)",
                                  lambda st: self._get_into(st, names, into, spans))
        return self._call(f"get ({len(names)} names)", lambda st: self._get_copies(st, names))

    def _get_into(self, store: MooncakeDistributedStore, names: Sequence[str],
                  into: Sequence[memoryview], spans: list[tuple[int, int]]
                  ) -> list[Stored | NotAnEntry | None]:
        codes = store.batch_get_into(list(names), [a for a, _ in spans], [s for _, s in spans])
        out: list[Stored | NotAnEntry | None] = []
        for name, buf, code in zip(names, into, codes):
            if code >= 0:
                out.append(memoryview(buf)[:code])
            elif code == OBJECT_NOT_FOUND:
                out.append(None)
            elif code == BUFFER_TOO_SMALL:  # longer than any entry: not read, but deleted
                out.append(NotAnEntry(f"trailing bytes: the object is longer than the "
                                      f"{memoryview(buf).nbytes} bytes of an entry of this layout"))
            else:
                raise self._failed(f"get of {name}", code)
        return out

    def _get_copies(self, store: MooncakeDistributedStore,
                    names: Sequence[str]) -> list[Stored | None]:
        values = store.get_batch(list(names))
        empty = [i for i, v in enumerate(values) if not v]
        # An entry is never empty (it has a header): b"" is a miss or a failed read.
        if empty and any(self._exist(store, [names[i] for i in empty])):
            raise self._failed(f"get ({len(names)} names)", -1)
        return [v if v else None for v in values]

    def delete(self, names: Sequence[str]) -> None:
        self._check(names)
        if not names:
            return

        def run(store: MooncakeDistributedStore) -> None:
            # force: an entry is removed even while the master holds a read lease on it
            codes = store.batch_remove(list(names), True)
            bad = next((c for c in codes if c not in (0, OBJECT_NOT_FOUND)), None)
            if bad is not None:
                raise self._failed(f"delete ({len(names)} names)", bad)

        self._call(f"delete ({len(names)} names)", run)

    def close(self) -> None:
        """Close the store client and the call thread, waiting at most ``timeout_s`` for a
        master that is gone or does not answer: the client's teardown holds the GIL while
        the master makes it wait (1-18 s killed, 66-99 s frozen), so it runs only once
        the master has answered, else the client is kept until the process exits
        (:attr:`left_to_exit` says why; docs/storage.md section 7, "Closing")."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, stuck = self._store, self._stuck
            self._store = None
        try:
            why = self._why_not_close(store, stuck)
            if why is None and store is not None:
                teardown = self._calls.submit(store.close)
                wait = self.settings.timeout_s + TEARDOWN_S
                try:
                    teardown.result(wait)
                except FutureTimeout:  # it cannot wake while the teardown holds the GIL
                    if teardown.done():
                        teardown.result()  # its error, if it failed
                    else:  # the master went away after it answered
                        why = f"its teardown had not ended after {wait:g} s"
            if why is not None:
                self.left_to_exit = why
                log.warning("%s: client kept open until the process exits: %s", self.where, why)
                keep_until_exit(self, store)  # self: the bounce area; a stuck setup's client
        finally:
            self._calls.stop()

    def _why_not_close(self, store: MooncakeDistributedStore | None, stuck: Future | None
                       ) -> str | None:
        """Why the client's teardown would wait for the master; None if it answers now
        (one killed under a second ago, or frozen, passes the client's health check)."""
        if stuck is not None and not stuck.done():
            return "an earlier call is still in the client, and may still use the buffers"
        if store is None:
            return None

        def ask(client: MooncakeDistributedStore = store) -> str | None:
            if client.health_check() != 0:  # 2: its pings (one a second) got no answer
                return "the client's health check failed: master unreachable"
            self._exist(client, ["kvswap.close-probe"])
            return None

        try:
            return self._calls.submit(ask).result(self.settings.timeout_s)
        except FutureTimeout:
            return f"the master did not answer within {self.settings.timeout_s:g} s"
        except StorageError as exc:
            return str(exc)
