"""A named POSIX shared-memory region mapped into this process.

Used for the host backend's simulated device tensors, the host swap space
and the signal segment's neighbours.  The creator unlinks; attachers only
close.  Segments are created with mode 0600.

**Leftovers.**  A process that dies without unlinking what it created (a
crashed CacheWorker, a killed daemon) leaves its segments behind, and creating
one of the same name again would fail.  :meth:`ShmRegion.create` then looks
for the segment's users (:func:`segment_users`: every process that maps it or
holds it open): with none, its owner is provably gone and the leftover is
removed and created afresh (logged); otherwise it raises
:class:`SegmentExists` naming the segment, its users and the command that
removes it.  Only processes of this user are looked at, which are the only
ones (with root) that a 0600 segment of this user admits.

**Room.**  A page of a tmpfs segment is allocated when first touched, and
touching one a full ``/dev/shm`` cannot back kills the process with SIGBUS, at
whatever write comes first, with no error to read.  So :meth:`ShmRegion.create`
allocates every page up front (:func:`allocate`), and a full ``/dev/shm`` is a
:class:`ShmFull` naming the segment and the room it needed, before anything
maps it.  Only the host pool opts out: it allocates in chunks itself, with
progress, when it is populated (``daemon/swap_space.py``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os

import numpy as np
import posix_ipc

from kvswap.client.errors import NamespaceError

SHM_MODE = 0o600
SHM_DIR = "/dev/shm"

log = logging.getLogger("kvswap.shm")


class SegmentExists(NamespaceError):
    """A segment to be created exists and some process still uses it."""


class ShmFull(NamespaceError):
    """``/dev/shm`` has no room for a segment being created."""


def allocate(fd: int, size: int, name: str) -> None:
    """Allocate every page of the segment open at ``fd`` (``posix_fallocate``; module
    docstring "Room").  A file system that cannot (EOPNOTSUPP, EINVAL) is left to
    allocate on first touch, as before."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            try:
                st = os.statvfs(SHM_DIR)
                free = f"{st.f_bavail * st.f_frsize} bytes free"
            except OSError:
                free = "free space unknown"
            raise ShmFull(f"shared memory segment {name}: {SHM_DIR} has no room for its "
                          f"{size} bytes ({free}; {exc.strerror}); make room there (df -h "
                          f"{SHM_DIR}) or give it more (a container's --shm-size)") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if len(text) <= 80 else text[:77] + "..."


def segment_users(name: str) -> list[int]:
    """Pids of this user's processes that map the segment ``name`` or hold it open."""
    path = f"{SHM_DIR}/{name.lstrip('/')}"
    me = os.getuid()
    users = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != me:
                continue
            with open(f"/proc/{entry.name}/maps") as f:
                mapped = any(line.split(maxsplit=5)[5:] == [path] for line in map(str.rstrip, f))
            held = mapped or any(os.readlink(fd.path) == path
                                 for fd in os.scandir(f"/proc/{entry.name}/fd"))
        except OSError:  # the process exited while being looked at
            continue
        if held:
            users.append(int(entry.name))
    return users


def _map_flags(populate: bool) -> int:
    # A daemon populates its mappings when it attaches, so no copy on the hot path
    # pays a page fault per 4 KiB (a 4 KiB block would cost several times its copy).
    return mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)


class ShmRegion:
    def __init__(self, name: str, buf: mmap.mmap, size: int, creator: bool, inode: int = 0):
        self.name = name
        self.size = size
        self.creator = creator
        # The segment's inode in /dev/shm: a name can be unlinked and created again (an
        # engine restarted after a crash), the inode says which segment it was.
        self.inode = inode
        self._buf: mmap.mmap | None = buf

    @classmethod
    def create(cls, name: str, size: int, exclusive: bool = True,
               populate: bool = False, allocate_now: bool = True) -> "ShmRegion":
        """Create ``name`` of ``size`` bytes, zero-filled, its pages allocated
        (:class:`ShmFull` if ``/dev/shm`` has no room; ``allocate_now=False``: on first
        touch) and mapped at once with ``populate`` (MAP_POPULATE)."""
        if size <= 0:
            raise ValueError(f"shm region {name} must have a positive size, got {size}")
        flags = posix_ipc.O_CREX if exclusive else posix_ipc.O_CREAT
        try:
            shm = posix_ipc.SharedMemory(name, flags, mode=SHM_MODE, size=size)
        except posix_ipc.ExistentialError:
            _remove_leftover(name)
            shm = posix_ipc.SharedMemory(name, flags, mode=SHM_MODE, size=size)
        try:
            if allocate_now:
                allocate(shm.fd, size, name)
            buf = mmap.mmap(shm.fd, size, flags=_map_flags(populate))
            inode = os.fstat(shm.fd).st_ino
        except BaseException:
            if exclusive:
                unlink_shm(name)
            raise
        finally:
            shm.close_fd()
        return cls(name, buf, size, creator=True, inode=inode)

    @classmethod
    def attach(cls, name: str, min_size: int = 0, readonly: bool = False,
               populate: bool = False) -> "ShmRegion":
        """Map an existing region; raises ``posix_ipc.ExistentialError`` if it is missing
        and ``ValueError`` if it is smaller than ``min_size``.  ``populate`` maps every
        page now (MAP_POPULATE) instead of faulting them in on first use."""
        shm = posix_ipc.SharedMemory(name, 0, read_only=readonly)
        try:
            if shm.size < min_size:
                raise ValueError(f"shm region {name} has {shm.size} bytes, expected >= {min_size}")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            buf = mmap.mmap(shm.fd, shm.size, flags=_map_flags(populate), prot=prot)
            size = shm.size
            inode = os.fstat(shm.fd).st_ino
        finally:
            shm.close_fd()
        return cls(name, buf, size, creator=False, inode=inode)

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        """A view of the region.  Built with ``np.frombuffer``, whose base is a
        memoryview that holds a buffer export on the mapping for as long as the array
        or any view of it lives: the mmap then refuses to close under it (see
        :meth:`close`).  ``np.ndarray(buffer=mmap)`` would not; it releases the export
        at once and keeps only a pointer, which a later unmap leaves dangling."""
        if self._buf is None:
            raise ValueError(f"shm region {self.name} is closed")
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._buf, dtype=dt, count=count, offset=offset).reshape(shape)

    def populate(self, offset: int, length: int, advice: int) -> None:
        """Fault ``[offset, offset + length)`` in, writable, without changing a byte:
        ``madvise(advice)`` (MADV_POPULATE_WRITE), or on a kernel that refuses it, a
        write of each page's first byte OR-ed with 0.  ``offset`` is page-aligned."""
        if self._buf is None:
            raise ValueError(f"shm region {self.name} is closed")
        try:
            self._buf.madvise(advice, offset, length)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: advice unknown to this kernel
                raise
        firsts = self.array(offset, (length,), np.uint8)[::mmap.PAGESIZE]
        np.bitwise_or(firsts, 0, out=firsts)

    def close(self) -> None:
        """Unmap.  If arrays into the region are still alive, their buffer export makes
        the mmap refuse to close; the region drops its reference instead and the
        mapping goes when the last array does (unmapping under them would crash the
        process)."""
        if self._buf is None:
            return
        try:
            self._buf.close()
        except BufferError:
            pass
        self._buf = None

    def unlink(self) -> None:
        """Remove the name; creator only.  Existing mappings stay valid."""
        if not self.creator:
            raise PermissionError(f"only the creator of {self.name} may unlink it")
        unlink_shm(self.name)


def _remove_leftover(name: str) -> None:
    """Unlink the existing segment ``name`` if no process uses it (module docstring);
    else raise :class:`SegmentExists` naming its users and the command that removes it."""
    path = f"{SHM_DIR}/{name.lstrip('/')}"
    users = segment_users(name)
    if not users:
        log.warning("removed the leftover shared memory segment %s: no process uses it", name)
        unlink_shm(name)
        return
    who = "; ".join(f"pid {pid} ({_cmdline(pid)})" for pid in users[:4])
    raise SegmentExists(
        f"shared memory segment {name} already exists and is used by {who}. If it is a "
        f"leftover (the process that created it is gone, and these only still map it, "
        f"like the daemon of a CacheWorker that crashed), remove it with: rm {path} "
        f"(processes that map it keep their mapping); else choose another name, or stop "
        f"those processes")


def unlink_shm(name: str) -> bool:
    """Unlink a segment by name; False if it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
