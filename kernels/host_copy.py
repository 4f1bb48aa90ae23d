"""Host copy engine: execute a :class:`CopyPlan` between block arrays in memory.

Each tensor is a block-major, C-contiguous array, so block ``b`` of a tensor is
the byte range ``[base + b * bpb, base + (b + 1) * bpb)``.  The engine resolves
every tensor's base addresses once (:class:`HostPlanCopier`) and moves a whole
task, every run of every tensor, in one call into the compiled loop
``kvswap.kernels._hostcopy.copy_runs`` (memcpy per run, GIL released): a
per-run Python call would cost as much as copying a 4 KiB block.  A pass of
:data:`SPLIT_BYTES` or more splits its tensors over two threads (the caller and
one helper per copier), since the loop runs without the GIL; a caller that
finishes its half before the helper took the other (busy with another worker's
half) copies that one too rather than queue behind it.  It is dtype-agnostic
(bf16, fp8, scales ...).

Raw-pointer copies trust their indices, so :meth:`HostPlanCopier.copy` checks the
plan against both block counts before the first byte moves (the daemon has
validated the task already; this is the last line of defence against a bug
writing outside a mapping).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from kvswap.kernels._hostcopy import copy_runs
from kvswap.kernels.planner import CopyPlan

# A pass at least this large is split over two threads (one half of its tensors
# each); below it, a thread hand-off costs more than it saves.  On the 2-CPU
# development VM (one layer, K and V, copied 32 times) the split broke even at
# 512 KiB a pass and was 26% faster at 1 MiB, 32% at 2 MiB (the layer of
# ``kvswap bench layerwise``).
SPLIT_BYTES = 1 << 20


def as_block_bytes(arr: np.ndarray) -> np.ndarray:
    """View a block-major contiguous array as (num_blocks, bytes_per_block) uint8."""
    if not arr.flags.c_contiguous:
        raise ValueError("block arrays must be C-contiguous")
    return arr.reshape(arr.shape[0], -1).view(np.uint8)


class HostPlanCopier:
    """Runs a :class:`CopyPlan` between the two sides of several (A, B) pairs of
    block arrays in host memory (the ``host`` backend: device and host side are shm).

    ``pairs`` are (A, B) block-major arrays; they are kept referenced, so the
    memory stays mapped while the copier lives.  Thread-safe for plans that do not
    overlap.  Its counterpart on a GPU is
    :class:`~kvswap.kernels.cuda_copy.CudaTaskCopier`, which takes a task's id
    lists rather than a plan because it splits them between copy engines and a kernel.
    """

    def __init__(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]):
        self._arrays = [(as_block_bytes(a), as_block_bytes(b)) for a, b in pairs]
        for a, b in self._arrays:
            if a.shape[1] != b.shape[1]:
                raise ValueError(f"block sizes differ: {a.shape[1]} and {b.shape[1]} bytes")
        self._a = np.array([a.ctypes.data for a, _ in self._arrays], dtype=np.uint64)
        self._b = np.array([b.ctypes.data for _, b in self._arrays], dtype=np.uint64)
        self._bpb = np.array([a.shape[1] for a, _ in self._arrays], dtype=np.uint64)
        self._a_blocks = min((a.shape[0] for a, _ in self._arrays), default=0)
        self._b_blocks = min((b.shape[0] for _, b in self._arrays), default=0)
        self.bytes_per_block = int(self._bpb.sum())
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvswap-copy")

    def close(self) -> None:
        self._helper.shutdown(wait=True)
        self._arrays = []

    def copy(self, plan: CopyPlan, a_to_b: bool, tensors: Sequence[int] | None = None) -> int:
        """Run ``plan`` (sources on the side it copies from) for every pair, or only
        the pairs at ``tensors``; return bytes copied."""
        if plan.num_runs == 0:
            return 0
        src_n, dst_n = (self._a_blocks, self._b_blocks) if a_to_b else (
            self._b_blocks, self._a_blocks)
        runs = (np.ascontiguousarray(plan.src_start, dtype=np.int64),
                np.ascontiguousarray(plan.dst_start, dtype=np.int64),
                np.ascontiguousarray(plan.counts, dtype=np.int64))
        if plan.num_runs <= 16:  # numpy reductions cost several us each on tiny arrays
            s, d, c = (r.tolist() for r in runs)
            bad = (min(s) < 0 or min(d) < 0 or max(a + b for a, b in zip(s, c)) > src_n
                   or max(a + b for a, b in zip(d, c)) > dst_n)
            blocks = sum(c)
        else:
            bad = (int(runs[0].min()) < 0 or int(runs[1].min()) < 0
                   or int((runs[0] + runs[2]).max()) > src_n
                   or int((runs[1] + runs[2]).max()) > dst_n)
            blocks = plan.num_blocks
        if bad:
            raise IndexError(f"copy plan outside {src_n} source / {dst_n} destination blocks")
        src, dst = (self._a, self._b) if a_to_b else (self._b, self._a)
        bpb, row_bytes = self._bpb, self.bytes_per_block
        if tensors is not None:
            idx = np.asarray(tensors)
            src, dst, bpb = src[idx], dst[idx], bpb[idx]
            row_bytes = int(bpb.sum())
        if len(bpb) > 1 and row_bytes * blocks >= SPLIT_BYTES:
            half = len(bpb) // 2
            other = self._helper.submit(copy_runs, src[half:], dst[half:], bpb[half:], *runs)
            copied = copy_runs(src[:half], dst[:half], bpb[:half], *runs)
            if other.cancel():
                # Not started: the helper is busy with another worker's half, and copying
                # this one here is sooner than waiting for it.
                return copied + copy_runs(src[half:], dst[half:], bpb[half:], *runs)
            return copied + other.result()
        return copy_runs(src, dst, bpb, *runs)
