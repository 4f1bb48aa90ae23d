"""The embedded storage backend: one file per entry in a directory (e.g. on NVMe); URL
scheme ``file://`` or a bare absolute path (registered in :data:`kvswap.daemon.storage.BACKENDS`).

Layout::

    <root>/<shard>/<name>                       an entry (complete, never modified)
    <root>/<shard>/.tmp.<name>.<pid>.<random>   a write in progress (or a crash's leftover)

``<shard>`` is two hex digits of a BLAKE2b hash of the name: 256 directories,
evenly filled whatever the names look like (entry names share a long
model-specific prefix), so no directory holds millions of files before the
store holds hundreds of millions.

Sharing: any number of processes (daemons of several namespaces and ranks) may
use one directory at once.  They share nothing in memory; a write goes to a
temp file with a unique name in the entry's shard and is renamed over the name
(``os.replace``, atomic), so a reader sees a complete entry or none, and two
writers of one name both succeed with one complete entry left.  A crash
between write and rename leaves only a temp file, invisible to readers and
removed by a later eviction scan once older than ``stale_tmp_s``.

Capacity: with ``capacity_bytes``, the entries (and temp files) are kept under
that many bytes of file size by evicting the least recently used.  Recency is
the file's mtime, set on write and refreshed by every ``get`` (``os.utime``;
atime is unreliable under noatime/relatime mounts).  Each process tracks an
estimate of the usage (its last scan plus what it wrote since) and scans the
directory when the estimate exceeds the capacity or when it has written 10% of
the capacity since its last scan (bounding the drift caused by other writers);
a scan that finds the store over capacity deletes the oldest entries until it is
at 90%, so scans stay rare.  A victim is re-checked just before it is deleted
and spared if it was read or rewritten since the scan; every step tolerates
entries vanishing under it (another process evicted them).  Without a capacity
nothing is ever deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
import time
import urllib.parse
from typing import Any, Iterator, NamedTuple, Sequence

from kvswap.daemon.storage import (
    Buffer,
    Stored,
    StorageError,
    as_byte_views,
    check_names,
)
from kvswap.daemon.options import parse_size
from kvswap.daemon.storage.url_options import parse_bool, url_options

log = logging.getLogger("kvswap.daemon.storage")

TMP_PREFIX = ".tmp."
LOW_WATERMARK = 0.9  # an eviction pass stops at this fraction of the capacity
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def shard_of(name: str) -> str:
    """The subdirectory of ``name``: 2 hex digits of its BLAKE2b hash."""
    return hashlib.blake2b(name.encode(), digest_size=1).hexdigest()


def _write_all(fd: int, views: list[memoryview]) -> None:
    """writev until everything is written (short writes, IOV_MAX-sized batches)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        written = os.writev(fd, pending[:_IOV_MAX])
        while written:
            if written >= pending[0].nbytes:
                written -= pending.pop(0).nbytes
            else:
                pending[0] = pending[0][written:]
                written = 0


@contextlib.contextmanager
def _io_errors(what: str) -> Iterator[None]:
    """Turn an unexpected OSError into StorageError naming the operation."""
    try:
        yield
    except OSError as exc:
        raise StorageError(f"file storage: {what}: {exc}") from exc


class _Victim(NamedTuple):  # a tuple: millions are made per scan, sorted by mtime first
    mtime_ns: int
    size: int
    inode: int
    path: str


class FileBackend:
    """Entries as files under ``root``; see the module docstring for the rules.

    Thread-safe: all state is on disk except the usage estimate, which a lock guards.
    """

    def __init__(self, root: str, *, capacity_bytes: int | None = None, fsync: bool = False,
                 stale_tmp_s: float = 600.0):
        if not os.path.isabs(root):
            raise ValueError(f"file storage root must be an absolute path, got {root!r}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = os.path.normpath(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.stale_tmp_s = stale_tmp_s
        self._lock = threading.Lock()
        self._usage: int | None = None  # estimate; None until the first scan
        self._written_since_scan = 0
        self._closed = False
        with _io_errors(f"cannot create {self.root}"):
            os.makedirs(self.root, mode=0o700, exist_ok=True)

    @staticmethod
    def _parse_url(url: str) -> tuple[str, dict[str, Any]]:
        """The directory and the options of ``file:///abs/dir?capacity_bytes=500G&fsync=1``
        (path percent-decoded)."""
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: a file URL names a local directory as "
                             f"file:///absolute/path (got host {parts.netloc!r})")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"storage URL {url!r}: the directory must be an absolute path")
        if not os.path.normpath(path).strip("/"):
            raise ValueError(f"storage URL {url!r}: the filesystem root cannot be the store: "
                             "the backend makes its 256 shard directories (00 to ff) right "
                             "in the store's directory, and with capacity_bytes deletes the "
                             "oldest files in them; name a directory of its own, e.g. "
                             "file:///var/cache/kvswap")
        opts = url_options(url, parts.query, {"capacity_bytes": parse_size, "fsync": parse_bool})
        return path, opts

    @classmethod
    def from_url(cls, url: str) -> "FileBackend":
        """Open ``file:///abs/dir?capacity_bytes=500G&fsync=1``, creating the directory."""
        path, opts = cls._parse_url(url)
        return cls(path, **opts)

    @classmethod
    def check_url(cls, url: str) -> None:
        """:meth:`from_url`'s ValueErrors, without creating the directory."""
        cls._parse_url(url)

    def __repr__(self) -> str:
        return f"FileBackend({self.root!r}, capacity_bytes={self.capacity_bytes})"

    def _path(self, name: str) -> str:
        return os.path.join(self.root, shard_of(name), name)

    def _check(self, names: Sequence[str]) -> None:
        if self._closed:
            raise StorageError(f"file storage {self.root}: backend is closed")
        check_names(names)

    @staticmethod
    def _exists(path: str) -> bool:
        # Not os.path.exists: that answers False for EACCES or EIO too.
        try:
            os.stat(path)
        except FileNotFoundError:
            return False
        return True

    # ------------------------------------------------------------ interface

    def contains(self, names: Sequence[str]) -> list[bool]:
        self._check(names)
        with _io_errors("contains"):
            return [self._exists(self._path(n)) for n in names]

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        names = [name for name, _ in items]
        self._check(names)
        views = [as_byte_views(parts) for _, parts in items]
        if self.capacity_bytes is not None:
            for name, entry in zip(names, views):
                size = sum(v.nbytes for v in entry)
                if size > self.capacity_bytes:
                    raise ValueError(f"entry {name} of {size} bytes exceeds the file storage "
                                     f"capacity of {self.capacity_bytes} bytes")
        stored: list[bool] = []
        written = 0
        try:
            for name, entry in zip(names, views):
                path = self._path(name)
                with _io_errors(f"put {path}"):
                    if self._exists(path):
                        stored.append(False)
                        continue
                    self._write(path, name, entry)
                stored.append(True)
                written += sum(v.nbytes for v in entry)
        finally:
            if written and self.capacity_bytes is not None:
                self._account(written)
        return stored

    def get(self, names: Sequence[str],
            into: Sequence[memoryview] | None = None) -> list[Stored | None]:
        self._check(names)
        out: list[Stored | None] = []
        for i, name in enumerate(names):
            path = self._path(name)
            with _io_errors(f"get {path}"):
                out.append(self._read(path, into[i] if into is not None else None))
        return out

    def delete(self, names: Sequence[str]) -> None:
        self._check(names)
        for name in names:
            path = self._path(name)
            with _io_errors(f"delete {path}"), contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def register_buffers(self, role: str, buffers: Sequence[Buffer]) -> None:
        """Nothing to do: plain reads and writes need no registered memory."""

    def close(self) -> None:
        self._closed = True

    # ------------------------------------------------------------ files

    def _write(self, path: str, name: str, views: list[memoryview]) -> None:
        shard = os.path.dirname(path)
        tmp = os.path.join(shard, f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # first entry of this shard
            os.makedirs(shard, mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                _write_all(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if self.fsync:
            dfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @staticmethod
    def _read(path: str, into: memoryview | None) -> memoryview | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if into is not None and into.nbytes >= size:
                view = into.cast("B")
            elif into is not None:
                # Longer than any entry the caller can use (``into`` is an entry's size):
                # one byte past it is enough for unpack_entry to reject it, so that it is
                # deleted; reading it whole could need gigabytes (a file extended by
                # accident, or sparse) and failed every prefetch with a MemoryError.
                size = into.nbytes + 1
                view = memoryview(bytearray(size))
            else:
                view = memoryview(bytearray(size))
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:  # cannot happen to a file that is never modified; unpack says truncated
                    break
                got += n
            try:
                # A use: refresh the recency that eviction goes by.  An explicit time,
                # since the kernel's own "now" is only as fine as a clock tick.
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            except PermissionError:
                # Another user's entry (shared directory): readable, but its recency
                # cannot be refreshed, so it ages as if unread.
                pass
        finally:
            os.close(fd)
        return view[:got]

    # ------------------------------------------------------------ capacity

    def _account(self, written: int) -> None:
        assert self.capacity_bytes is not None
        with self._lock:
            self._written_since_scan += written
            if self._usage is not None:
                self._usage += written
            if (self._usage is None or self._usage > self.capacity_bytes
                    or self._written_since_scan >= self.capacity_bytes * (1 - LOW_WATERMARK)):
                with _io_errors(f"eviction scan of {self.root}"):
                    self._usage = self._scan_and_evict()
                self._written_since_scan = 0

    def _scan_and_evict(self) -> int:
        """Scan every shard; if over capacity, delete the least recently used entries down
        to LOW_WATERMARK of it.  Return the usage left.  Removes stale temp files."""
        assert self.capacity_bytes is not None
        victims: list[_Victim] = []
        total = 0
        stale_before = time.time() - self.stale_tmp_s
        for shard in range(256):
            try:
                it = os.scandir(os.path.join(self.root, f"{shard:02x}"))
            except FileNotFoundError:
                continue
            with it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(TMP_PREFIX):
                        if st.st_mtime < stale_before:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.path)
                            log.info("removed stale temp file %s", entry.path)
                            continue
                    else:
                        victims.append(_Victim(st.st_mtime_ns, st.st_size, st.st_ino,
                                               entry.path))
                    total += st.st_size
        target = int(self.capacity_bytes * LOW_WATERMARK)
        if total <= self.capacity_bytes:
            return total
        evicted = 0
        victims.sort()
        for victim in victims:
            if total <= target:
                break
            try:
                st = os.stat(victim.path)
            except FileNotFoundError:  # evicted by another process
                total -= victim.size
                continue
            if st.st_ino != victim.inode or st.st_mtime_ns != victim.mtime_ns:
                continue  # read or rewritten since the scan: no longer least recently used
            try:
                os.unlink(victim.path)
            except FileNotFoundError:  # evicted by another process since the stat
                pass
            else:
                evicted += 1
            total -= victim.size
        log.info("file storage %s: evicted %d entries, %d bytes left (capacity %d)",
                 self.root, evicted, total, self.capacity_bytes)
        return total
