"""Host swap space of one rank: a POSIX shm segment that outlives the daemon.

::

    /kvswap.<ns>.swap.r<rank>
    +--------------------+------------------------+-----+------------------------+
    | header (4096 B)    | tensor 0 host blocks   | ... | tensor T-1 host blocks |
    +--------------------+------------------------+-----+------------------------+
    header: magic u64 'KVSWAPHS' | format_version u64 | layout_hash 32 B | epoch u64
            | num_host_blocks u64 | num_tensors u64 | data_bytes u64
    tensor i: num_host_blocks x bytes_per_block(i), starting 4096-aligned, in
              registration order

Living in shm (not in the daemon's heap) is what lets acknowledged data survive
a daemon crash: a restarted daemon re-opens the segment, checks magic, layout
hash and block count, bumps the epoch and serves the same bytes.  A pool whose
layout does not match is discarded and recreated (logged).  The daemon that
created or adopted the pool unlinks it on a clean shutdown.

**Size.**  A pool is sized in blocks per tensor (``--host-blocks``) or in bytes
per rank (``--host-size``): then it holds the most blocks that fit in that many
bytes, header and alignment included (:func:`blocks_that_fit`).  Blocks are
derived when the layout is known, which is at register: only then does the
daemon see the tensors' block sizes (the launcher knows them beforehand only
for ``--demo-caches``).  Before a new pool is created, :func:`check_fits` holds
its size against free ``/dev/shm`` and available memory and refuses it with the
numbers, instead of creating a pool that the kernel cannot back.

**Population.**  Creating a pool only sizes the segment; :meth:`HostSwapSpace.populate`
(called by the backend's ``attach``) then allocates its pages (``fallocate``:
a full ``/dev/shm`` is an error, not a SIGBUS on some later copy) and maps them
(``MADV_POPULATE_WRITE``) chunk by chunk, reporting progress, so no copy on the
hot path pays a page fault and a 64 GiB pool does not sit in one silent call.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import posix_ipc

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.layout import TensorDesc, layout_hash
from kvswap.client.naming import Names
from kvswap.client.shm_region import ShmRegion
from kvswap.daemon.options import format_size

log = logging.getLogger("kvswap.daemon.swap")

MAGIC = int.from_bytes(b"KVSWAPHS", "little")
FORMAT_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096

# header field offsets (bytes)
_MAGIC, _VERSION, _HASH, _EPOCH, _NBLOCKS, _NTENSORS, _DATA = 0, 8, 16, 48, 56, 64, 72


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


POPULATE_CHUNK_BYTES = 256 << 20  # progress every 256 MiB
# madvise(2) advice; Python's mmap module names it from 3.12 on, Linux has it from 5.14.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SwapLayout:
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, tensors: Sequence[TensorDesc], num_host_blocks: int) -> "SwapLayout":
        return cls.of_block_bytes([t.bytes_per_block for t in tensors], num_host_blocks)

    @classmethod
    def of_block_bytes(cls, block_bytes: Sequence[int], num_host_blocks: int) -> "SwapLayout":
        """The layout for tensors of these bytes per block (in registration order)."""
        offsets = []
        pos = HEADER_BYTES
        for b in block_bytes:
            offsets.append(pos)
            pos = _align(pos + num_host_blocks * b)
        return cls(tuple(offsets), pos)


def blocks_that_fit(block_bytes: Sequence[int], nbytes: int) -> int:
    """The most blocks per tensor whose pool (header and alignment included) takes at
    most ``nbytes``; 0 if not even one block fits."""
    per_block = sum(block_bytes)
    if per_block <= 0:
        raise ValueError("a pool needs at least one tensor with a positive block size")
    # Alignment adds less than ALIGN per tensor, so the answer is this estimate or
    # a few below it.
    n = max(0, (nbytes - HEADER_BYTES) // per_block)
    while n > 0 and SwapLayout.of_block_bytes(block_bytes, n).size > nbytes:
        n -= 1
    return n


def pool_blocks(block_bytes: Sequence[int], num_host_blocks: int | None,
                host_bytes: int | None) -> int:
    """Blocks per tensor of a pool sized by ``num_host_blocks`` or by ``host_bytes``
    (exactly one); a byte size that cannot hold one block is refused with the numbers."""
    if (num_host_blocks is None) == (host_bytes is None):
        raise ValueError("size a pool by blocks or by bytes (exactly one)")
    if num_host_blocks is not None:
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}")
        return num_host_blocks
    assert host_bytes is not None
    n = blocks_that_fit(block_bytes, host_bytes)
    if n == 0:
        need = SwapLayout.of_block_bytes(block_bytes, 1).size
        raise KvswapError(
            f"--host-size {host_bytes} ({format_size(host_bytes)}) cannot hold one block of "
            f"this layout: one block of every tensor ({sum(block_bytes)} bytes over "
            f"{len(block_bytes)} tensors) needs a pool of {need} bytes; raise --host-size",
            ErrorCode.INVALID_TASK)
    return n


@dataclass(frozen=True)
class HostMemory:
    """What this host can give a new shm segment now: free space in ``/dev/shm`` and
    available memory (a tmpfs page is RAM, and ``MemAvailable`` does not count the
    shm already used, so both bounds matter)."""

    shm_free: int
    available: int | None  # None where /proc/meminfo is unreadable

    @classmethod
    def now(cls) -> "HostMemory":
        st = os.statvfs(SHM_DIR)
        available = None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        return cls(st.f_bavail * st.f_frsize, available)


def fit_problem(need: int, what: str, memory: HostMemory | None = None) -> str | None:
    """Why ``need`` bytes of new shm (described by ``what``) cannot fit on this host
    now, with the numbers and the fix, or None."""
    memory = memory or HostMemory.now()
    fix = ("size the pool smaller (--host-size, or --host-blocks), or make room (free "
           "memory; a larger /dev/shm: mount -o remount,size=N /dev/shm)")
    if need > memory.shm_free:
        return (f"{what} needs {format_size(need)} ({need} bytes) of {SHM_DIR}, which has "
                f"{format_size(memory.shm_free)} free; {fix}")
    if memory.available is not None and need > memory.available:
        return (f"{what} needs {format_size(need)} ({need} bytes) of memory, and this host "
                f"has {format_size(memory.available)} available (MemAvailable); {fix}")
    return None


def check_fits(need: int, what: str, memory: HostMemory | None = None) -> None:
    """Raise :class:`KvswapError` (INVALID_TASK) with :func:`fit_problem`'s message if
    ``need`` bytes of new shm cannot fit; nothing is created either way."""
    problem = fit_problem(need, what, memory)
    if problem:
        raise KvswapError(problem, ErrorCode.INVALID_TASK)


class HostSwapSpace:
    """The mapped pool: ``blocks[i]`` is tensor i's (num_host_blocks, bytes_per_block) uint8 view."""

    def __init__(self, region: ShmRegion, tensors: Sequence[TensorDesc], num_host_blocks: int,
                 epoch: int, reused: bool):
        self.region = region
        self.tensors = list(tensors)
        self.num_host_blocks = num_host_blocks
        self.epoch = epoch
        self.reused = reused
        layout = SwapLayout.of(tensors, num_host_blocks)
        self.blocks = [region.array(off, (num_host_blocks, t.bytes_per_block), np.uint8)
                       for off, t in zip(layout.offsets, tensors)]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @classmethod
    def open(cls, names: Names, rank: int, tensors: Sequence[TensorDesc],
             num_host_blocks: int | None = None, *, host_bytes: int | None = None,
             memory: HostMemory | None = None) -> "HostSwapSpace":
        """Adopt the rank's existing pool if it matches ``tensors``, else create a new one.

        Sized by ``num_host_blocks`` per tensor or by ``host_bytes`` (exactly one; see
        the module docstring).  A new pool that ``memory`` (default: this host now)
        cannot hold is refused before anything is created.  The pool is not populated
        yet: the backend's attach calls :meth:`populate`."""
        name = names.swap_segment(rank)
        num_host_blocks = pool_blocks([t.bytes_per_block for t in tensors], num_host_blocks,
                                      host_bytes)
        digest = layout_hash(tensors)
        layout = SwapLayout.of(tensors, num_host_blocks)
        try:
            region = ShmRegion.attach(name)
        except posix_ipc.ExistentialError:
            region = None
        if region is not None:
            hdr = region.array(0, (HEADER_BYTES,), np.uint8)
            words = hdr[:_DATA + 8].view("<u8")
            matches = (int(words[_MAGIC // 8]) == MAGIC
                       and int(words[_VERSION // 8]) == FORMAT_VERSION
                       and bytes(hdr[_HASH:_HASH + 32]) == digest
                       and int(words[_NBLOCKS // 8]) == num_host_blocks
                       and region.size >= layout.size)
            if matches:
                epoch = int(words[_EPOCH // 8]) + 1
                words[_EPOCH // 8] = epoch
                del hdr, words
                # Adopted: this daemon now owns the pool and unlinks it on clean exit.
                region.creator = True
                log.info("re-attached host swap space %s (epoch %d, %d blocks)", name, epoch,
                         num_host_blocks)
                return cls(region, tensors, num_host_blocks, epoch, reused=True)
            del hdr, words
            log.warning("host swap space %s does not match the registered layout; recreating",
                        name)
            region.close()
            posix_ipc.unlink_shared_memory(name)
        check_fits(layout.size, f"rank {rank}'s host pool ({num_host_blocks} blocks per tensor "
                                f"x {len(tensors)} tensors)", memory)
        region = ShmRegion.create(name, layout.size, allocate_now=False)  # populate() does
        hdr = region.array(0, (HEADER_BYTES,), np.uint8)
        words = hdr[:_DATA + 8].view("<u8")
        hdr[_HASH:_HASH + 32] = np.frombuffer(digest, dtype=np.uint8)
        words[_VERSION // 8] = FORMAT_VERSION
        words[_EPOCH // 8] = 0
        words[_NBLOCKS // 8] = num_host_blocks
        words[_NTENSORS // 8] = len(tensors)
        words[_DATA // 8] = layout.size - HEADER_BYTES
        words[_MAGIC // 8] = MAGIC  # last: the header is valid from here
        del hdr, words
        return cls(region, tensors, num_host_blocks, 0, reused=False)

    def populate(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Allocate and map every page of the pool now, ``POPULATE_CHUNK_BYTES`` at a
        time, calling ``on_progress(bytes done)`` after each chunk.

        Allocating (``posix_fallocate``) first turns a full ``/dev/shm`` into a clear
        error here; writing to a page tmpfs cannot back would instead kill the process
        with SIGBUS on some later copy.  Mapping writable (``MADV_POPULATE_WRITE``)
        changes no byte, so an adopted pool keeps its contents.  On a kernel without
        that advice (< 5.14) each page's first byte is OR-ed with 0 instead."""
        size = self.region.size
        t0 = time.monotonic()
        shm = posix_ipc.SharedMemory(self.region.name, 0)
        try:
            for off in range(0, size, POPULATE_CHUNK_BYTES):
                n = min(POPULATE_CHUNK_BYTES, size - off)
                try:
                    os.posix_fallocate(shm.fd, off, n)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise KvswapError(
                            f"host pool {self.region.name}: {SHM_DIR} ran out of space after "
                            f"{format_size(off)} of {format_size(size)} ({exc.strerror}): "
                            f"something else took the room since the pool was checked; make "
                            f"room or size the pool smaller (--host-size, --host-blocks)",
                            ErrorCode.INVALID_TASK) from None
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                self.region.populate(off, n, MADV_POPULATE_WRITE)
                if on_progress is not None:
                    on_progress(off + n)
        finally:
            shm.close_fd()
        log.info("host pool %s: %s populated in %.2fs%s", self.region.name, format_size(size),
                 time.monotonic() - t0, " (adopted)" if self.reused else "")

    def close(self, unlink: bool) -> None:
        self.blocks = []
        if unlink:
            self.region.unlink()
        self.region.close()
