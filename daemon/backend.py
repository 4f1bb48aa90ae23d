"""The interface between the daemon core and a data-moving backend.

Everything above it (protocol, scheduling, signals, supervision) is shared; a
backend only maps a rank's caches and moves blocks.  Two implementations:
``host`` (below: simulated device tensors in shm, numpy copies) and ``cuda``.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from typing import Callable, Protocol, Sequence

import numpy as np
import posix_ipc

from kvswap.client.errors import ErrorCode, InvalidTask, NotReady
from kvswap.client.layout import TensorDesc
from kvswap.client.naming import Names
from kvswap.client.protocol import Op
from kvswap.client.shm_region import ShmRegion
from kvswap.daemon.swap_space import HostSwapSpace
from kvswap.kernels.host_copy import HostPlanCopier
from kvswap.kernels.planner import plan_copy

log = logging.getLogger("kvswap.daemon.backend")


class Backend(Protocol):
    """What the daemon core needs from a backend."""

    name: str

    def attach(self, tensors: Sequence[TensorDesc], swap: HostSwapSpace) -> None:
        """Populate ``swap`` (:meth:`HostSwapSpace.populate`; cuda: and pin it), reporting
        progress, map the rank's device tensors and bind them to ``swap``; raise
        :class:`KvswapError` (BAD_LAYOUT for the tensors) and leave nothing mapped on
        failure."""

    def copy(self, op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
             tensors: Sequence[int] | None = None) -> int:
        """Move the blocks of a validated task for every tensor (or only the tensors
        at indices ``tensors``, e.g. one layer); return bytes moved.  Thread-safe for
        tasks that do not overlap (the scheduler never runs overlapping ones at once)."""

    def detach(self) -> None:
        """Release every device mapping (idempotent)."""


class HostBackend:
    """Simulated device: the "GPU" tensors are shm segments exported by name.

    This runs the whole multi-process system on a machine without a GPU; it is a
    simulation, not GPU support.  Only segments of this namespace and rank
    (``/kvswap.<ns>.dev.r<rank>.*``) may be mapped.
    """

    name = "host"

    def __init__(self, names: Names, rank: int,
                 on_progress: Callable[[int], None] | None = None):
        self.names = names
        self.rank = rank
        self._on_progress = on_progress  # bytes of the pool populated so far
        self._regions: list[ShmRegion] = []
        self._copier: HostPlanCopier | None = None  # (device, host) pairs

    def attach(self, tensors: Sequence[TensorDesc], swap: HostSwapSpace) -> None:
        prefix = f"/{self.names.prefix}dev.r{self.rank}."
        total = swap.nbytes
        swap.populate(None if self._on_progress is None else
                      lambda done: self._on_progress(total * done // swap.region.size))
        regions: list[ShmRegion] = []
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            for t, host in zip(tensors, swap.blocks):
                seg = t.location.get("shm")
                if not isinstance(seg, str) or not seg.startswith(prefix):
                    raise InvalidTask(
                        f"tensor {t.name}: host backend needs location.shm naming a segment "
                        f"'{prefix}<name>' (use CacheWorker.alloc_host_tensor), got {seg!r}",
                        ErrorCode.BAD_LAYOUT)
                try:
                    region = ShmRegion.attach(seg, min_size=t.nbytes, populate=True)
                except posix_ipc.ExistentialError:
                    raise InvalidTask(f"tensor {t.name}: shm segment {seg} does not exist",
                                      ErrorCode.BAD_LAYOUT) from None
                except ValueError as exc:
                    raise InvalidTask(f"tensor {t.name}: {exc}", ErrorCode.BAD_LAYOUT) from None
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                    raise InvalidTask(
                        f"tensor {t.name}: cannot map {seg}: {os.strerror(exc.errno)}: the "
                        f"host backend holds one open file per registered tensor ({len(tensors)} "
                        f"here) and the daemon's limit is {soft}, connections included (they "
                        f"may hold a quarter of it); raise its hard open-file limit (ulimit "
                        f"-Hn, systemd LimitNOFILE=) and relaunch, or register fewer, larger "
                        f"tensors") from None
                regions.append(region)
                ino = t.location.get("ino")
                if ino is not None and ino != region.inode:
                    raise InvalidTask(
                        f"tensor {t.name}: shm segment {seg} is not the one the worker "
                        f"described (inode {region.inode}, not {ino!r}): it was unlinked and "
                        f"created again; register again with the segment as it is now",
                        ErrorCode.BAD_LAYOUT)
                pairs.append((region.array(0, t.shape, t.dtype), host))
        except BaseException:
            pairs.clear()
            for r in regions:
                r.close()
            raise
        self.detach()
        self._regions, self._copier = regions, HostPlanCopier(pairs)

    def copy(self, op: Op, device_ids: np.ndarray, host_ids: np.ndarray,
             tensors: Sequence[int] | None = None) -> int:
        if self._copier is None:
            raise NotReady("host backend: no caches attached")
        if op is Op.EVICT:
            return self._copier.copy(plan_copy(device_ids, host_ids), True, tensors)
        return self._copier.copy(plan_copy(host_ids, device_ids), False, tensors)

    def detach(self) -> None:
        if self._copier is not None:
            self._copier.close()
        self._copier = None
        for r in self._regions:
            r.close()
        self._regions = []


def make_backend(kind: str, names: Names, rank: int, device: int | None = None,
                 on_pin_progress: Callable[[int], None] | None = None) -> Backend:
    """``device``: the GPU ordinal (cuda; else found from the caches' UUID; ignored by
    host).  ``on_pin_progress(bytes)``: how much of the swap pool is ready, as attach
    prepares it: populated (host), populated then pinned (cuda: the first half of the
    pool's size counts the population, the second half the pinning)."""
    if kind == "host":
        return HostBackend(names, rank, on_pin_progress)
    if kind == "cuda":
        # Imported here: it needs cupy, which only the cuda backend requires.
        from kvswap.daemon.cuda_backend import CudaBackend

        return CudaBackend(names, rank, device=device, on_pin_progress=on_pin_progress)
    raise ValueError(f"unknown backend {kind!r} (host, cuda)")
