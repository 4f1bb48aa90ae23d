"""A named POSIX shared-memory region mapped into this process.

Used for the host backend's simulated device tensors, the host swap space
and the signal segment's neighbours.  The creator unlinks; attachers only
close.  Segments are created with mode 0600.
"""

from __future__ import annotations

import mmap

import numpy as np
import posix_ipc

SHM_MODE = 0o600


def _map_flags(populate: bool) -> int:
    # A daemon populates its mappings when it attaches, so no copy on the hot path
    # pays a page fault per 4 KiB (a 4 KiB block would cost several times its copy).
    return mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)


class ShmRegion:
    def __init__(self, name: str, buf: mmap.mmap, size: int, creator: bool):
        self.name = name
        self.size = size
        self.creator = creator
        self._buf: mmap.mmap | None = buf

    @classmethod
    def create(cls, name: str, size: int, exclusive: bool = True,
               populate: bool = False) -> "ShmRegion":
        """Create ``name`` of ``size`` bytes, zero-filled.  Pages are allocated on first
        touch, or all at once here with ``populate`` (MAP_POPULATE)."""
        if size <= 0:
            raise ValueError(f"shm region {name} must have a positive size, got {size}")
        flags = posix_ipc.O_CREX if exclusive else posix_ipc.O_CREAT
        shm = posix_ipc.SharedMemory(name, flags, mode=SHM_MODE, size=size)
        try:
            buf = mmap.mmap(shm.fd, size, flags=_map_flags(populate))
        except BaseException:
            if exclusive:
                unlink_shm(name)
            raise
        finally:
            shm.close_fd()
        return cls(name, buf, size, creator=True)

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
        finally:
            shm.close_fd()
        return cls(name, buf, size, creator=False)

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


def unlink_shm(name: str) -> bool:
    """Unlink a segment by name; False if it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
