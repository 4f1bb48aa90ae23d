"""Host copy engine: execute a :class:`CopyPlan` between numpy block arrays.

Each tensor is viewed as a 2-D ``(num_blocks, bytes_per_block)`` uint8 array, so
the engine is dtype-agnostic (bf16, fp8, scales ...).  Runs of several blocks
are single slice copies; numpy releases the GIL while it copies.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvswap.kernels.planner import CopyPlan


def as_block_bytes(arr: np.ndarray) -> np.ndarray:
    """View a block-major contiguous array as (num_blocks, bytes_per_block) uint8."""
    if not arr.flags.c_contiguous:
        raise ValueError("block arrays must be C-contiguous")
    return arr.reshape(arr.shape[0], -1).view(np.uint8)


def copy_blocks(plan: CopyPlan, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """Copy every run of ``plan`` from ``src`` to ``dst`` for each (src, dst) byte view.

    Returns the number of bytes copied.
    """
    total = 0
    runs = list(zip(plan.src_start.tolist(), plan.dst_start.tolist(), plan.counts.tolist()))
    for src, dst in pairs:
        for s, d, c in runs:
            dst[d:d + c] = src[s:s + c]
        total += plan.num_blocks * src.shape[1]
    return total
