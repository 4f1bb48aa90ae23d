"""Copy planner and host copy engine: plans equal per-block copying."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.kernels.host_copy import HostPlanCopier, as_block_bytes
from kvswap.kernels.planner import plan_copy

N_SRC, N_DST = 40, 50


@st.composite
def id_pairs(draw):
    n = draw(st.integers(0, 30))
    # destinations unique (as validated on the wire); sources may repeat
    dst = draw(st.permutations(range(N_DST)).map(lambda p: list(p)[:n]))
    use_runs = draw(st.booleans())
    if use_runs and n:
        start = draw(st.integers(0, N_SRC - n))
        src = list(range(start, start + n))
    else:
        src = draw(st.lists(st.integers(0, N_SRC - 1), min_size=n, max_size=n))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


def copy_blocks(plan, pairs):
    """Run ``plan`` from each pair's first array to its second; bytes copied."""
    copier = HostPlanCopier(pairs)
    try:
        return copier.copy(plan, a_to_b=True)
    finally:
        copier.close()


@settings(max_examples=300, deadline=None)
@given(id_pairs(), st.sampled_from([1, 3, 8, 64]))
def test_plan_execution_equals_per_block_copy(pair, block_bytes):
    src_ids, dst_ids = pair
    rng = np.random.default_rng(len(src_ids))
    src = rng.integers(0, 255, size=(N_SRC, block_bytes), dtype=np.uint8)
    dst = rng.integers(0, 255, size=(N_DST, block_bytes), dtype=np.uint8)
    expected = dst.copy()
    for s, d in zip(src_ids, dst_ids):
        expected[d] = src[s]
    plan = plan_copy(src_ids, dst_ids)
    nbytes = copy_blocks(plan, [(src, dst)])
    assert np.array_equal(dst, expected)
    assert nbytes == len(src_ids) * block_bytes
    assert plan.num_blocks == len(src_ids)


@settings(max_examples=200, deadline=None)
@given(id_pairs())
def test_runs_are_maximal_and_ordered(pair):
    src_ids, dst_ids = pair
    plan = plan_copy(src_ids, dst_ids)
    # expanding the runs gives back the original pairs, in order
    s = np.concatenate([np.arange(a, a + c) for a, c in zip(plan.src_start, plan.counts)]
                       or [np.empty(0, np.int64)])
    d = np.concatenate([np.arange(a, a + c) for a, c in zip(plan.dst_start, plan.counts)]
                       or [np.empty(0, np.int64)])
    assert s.tolist() == src_ids.tolist() and d.tolist() == dst_ids.tolist()
    # maximal: no run could be merged with the next one
    for i in range(plan.num_runs - 1):
        end_s = plan.src_start[i] + plan.counts[i]
        end_d = plan.dst_start[i] + plan.counts[i]
        assert not (end_s == plan.src_start[i + 1] and end_d == plan.dst_start[i + 1])


def test_contiguous_ids_make_one_run():
    plan = plan_copy(np.arange(10, 20), np.arange(0, 10))
    assert plan.num_runs == 1 and plan.counts.tolist() == [10]


def test_copy_is_dtype_agnostic_and_covers_every_tensor():
    a = np.arange(4 * 6, dtype=np.float16).reshape(4, 2, 3)
    b = np.zeros((5, 2, 3), dtype=np.float16)
    c = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
    d = np.zeros((5, 2), dtype=np.float32)
    plan = plan_copy(np.array([3, 0]), np.array([1, 4]))
    copy_blocks(plan, [(as_block_bytes(a), as_block_bytes(b)), (as_block_bytes(c), as_block_bytes(d))])
    assert np.array_equal(b[1], a[3]) and np.array_equal(b[4], a[0])
    assert np.array_equal(d[1], c[3]) and np.array_equal(d[4], c[0])
    assert not b[[0, 2, 3]].any() and not d[[0, 2, 3]].any()


def test_plan_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        plan_copy(np.arange(3), np.arange(2))


def test_as_block_bytes_rejects_non_contiguous():
    with pytest.raises(ValueError):
        as_block_bytes(np.zeros((4, 6))[:, ::2])


def test_copier_refuses_a_plan_outside_either_side():
    from kvswap.kernels.host_copy import HostPlanCopier
    a = np.zeros((4, 8), np.uint8)
    b = np.zeros((6, 8), np.uint8)
    copier = HostPlanCopier([(a, b)])
    try:
        for src, dst in (([4], [0]), ([0], [6]), ([3, 4], [0, 1]), ([-1], [0])):
            with pytest.raises(IndexError):
                copier.copy(plan_copy(np.array(src), np.array(dst)), a_to_b=True)
        copier.copy(plan_copy(np.array([5]), np.array([3])), a_to_b=False)  # B -> A in range
        assert not a.any() and not b.any()  # nothing was written by the refused plans
    finally:
        copier.close()


def test_large_tasks_split_over_two_threads_copy_the_same_bytes():
    from kvswap.kernels.host_copy import SPLIT_BYTES, HostPlanCopier
    bpb = 64 << 10
    n = SPLIT_BYTES // bpb  # with 4 tensors the task is 4x the split threshold
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(0, 255, (n, bpb), dtype=np.uint8), np.zeros((n, bpb), np.uint8))
             for _ in range(4)]
    src = rng.permutation(n)
    dst = rng.permutation(n)
    copier = HostPlanCopier(pairs)
    try:
        moved = copier.copy(plan_copy(src, dst), a_to_b=True)
        layer = copier.copy(plan_copy(src[:3], dst[:3]), a_to_b=True, tensors=[2])
    finally:
        copier.close()
    assert moved == 4 * n * bpb and layer == 3 * bpb
    for a, b in pairs:
        assert np.array_equal(b[dst], a[src])


def test_a_split_half_the_busy_helper_has_not_started_is_copied_by_the_caller():
    """Two workers splitting at once share one helper: the second must not queue
    behind the first's half.  The helper is held by a gate, so only the caller can
    copy; the copy has to finish (and be right) while the gate is still closed."""
    import threading

    from kvswap.kernels.host_copy import SPLIT_BYTES, HostPlanCopier
    bpb = 64 << 10
    n = SPLIT_BYTES // bpb
    rng = np.random.default_rng(5)
    pairs = [(rng.integers(0, 255, (n, bpb), dtype=np.uint8), np.zeros((n, bpb), np.uint8))
             for _ in range(2)]
    copier = HostPlanCopier(pairs)
    gate, busy = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        gate.wait(30)

    try:
        held = copier._helper.submit(hold)
        assert busy.wait(10)
        src, dst = rng.permutation(n), rng.permutation(n)
        done: list[int] = []
        worker = threading.Thread(target=lambda: done.append(
            copier.copy(plan_copy(src, dst), a_to_b=True)))
        worker.start()
        worker.join(10)
        assert not worker.is_alive() and not gate.is_set()
        assert done == [2 * n * bpb]
        for a, b in pairs:
            assert np.array_equal(b[dst], a[src])
    finally:
        gate.set()
        held.result(10)
        copier.close()
