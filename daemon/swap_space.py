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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import posix_ipc

from kvswap.client.layout import TensorDesc, layout_hash
from kvswap.client.naming import Names
from kvswap.client.shm_region import ShmRegion

log = logging.getLogger("kvswap.daemon.swap")

MAGIC = int.from_bytes(b"KVSWAPHS", "little")
FORMAT_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096

# header field offsets (bytes)
_MAGIC, _VERSION, _HASH, _EPOCH, _NBLOCKS, _NTENSORS, _DATA = 0, 8, 16, 48, 56, 64, 72


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SwapLayout:
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, tensors: Sequence[TensorDesc], num_host_blocks: int) -> "SwapLayout":
        offsets = []
        pos = HEADER_BYTES
        for t in tensors:
            offsets.append(pos)
            pos = _align(pos + num_host_blocks * t.bytes_per_block)
        return cls(tuple(offsets), pos)


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
             num_host_blocks: int) -> "HostSwapSpace":
        """Adopt the rank's existing pool if it matches ``tensors``, else create a new one."""
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}")
        name = names.swap_segment(rank)
        digest = layout_hash(tensors)
        layout = SwapLayout.of(tensors, num_host_blocks)
        try:
            region = ShmRegion.attach(name, populate=True)
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
        region = ShmRegion.create(name, layout.size, populate=True)
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

    def close(self, unlink: bool) -> None:
        self.blocks = []
        if unlink:
            self.region.unlink()
        self.region.close()
