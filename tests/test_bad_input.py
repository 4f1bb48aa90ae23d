"""Bad input costs at most its own request (issue #12).

Each case runs against a real daemon process: a register repeated after it
timed out on the client.
"""

from __future__ import annotations

import pytest

from kvswap.client import CacheTensor, CacheWorker, ErrorCode, TransferClient
from kvswap.client.errors import NotReady, RankTimeout
from kvswap.client.signals import R, RankState

HOST_BLOCKS = 64


# ------------------------------------------------------------------ register


def _tensors(worker: CacheWorker, blocks: int, block_bytes: int) -> list[CacheTensor]:
    return [CacheTensor(name, 0, worker.alloc_host_tensor(name, (blocks, block_bytes), "uint8"))
            for name in ("k0", "v0")]


def test_register_repeated_after_it_succeeded_gets_the_same_reply(namespaces):
    """A worker whose register timed out on its side sends it again after the daemon
    finished it: the same tensors get the same reply, not ALREADY_REGISTERED; other
    tensors get ALREADY_REGISTERED with what to do, and the rank is unchanged."""
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False)
    names = launcher.names
    with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as worker:
        tensors = _tensors(worker, 32, 256)
        first = worker.register(tensors, timeout=30)
        launcher.wait_ready(30)
        again = worker.register(tensors, timeout=10)
        assert again.ok and again.fields == first.fields == {
            "num_device_blocks": 32, "num_host_blocks": HOST_BLOCKS}
        other = CacheTensor("k1", 0, worker.alloc_host_tensor("k1", (32, 256), "uint8"))
        with pytest.raises(NotReady) as ei:
            worker.register([tensors[0], other], timeout=10)
        assert ei.value.code == ErrorCode.ALREADY_REGISTERED
        assert "clear_caches()" in ei.value.message and "restore_caches()" in ei.value.message
        assert "tensor 'v0' differs in name" in ei.value.message
        assert launcher.seg.state_of(0) == RankState.READY
        with TransferClient(names.namespace, 1, run_root=str(names.run_root)) as client:
            assert client.evict([1], [2]).result(10).replies[0].ok


def test_register_sent_again_while_the_first_runs_is_answered_when_it_ends(namespaces):
    """The register times out on the worker while the daemon is still attaching (a
    128 MiB host pool to populate); the worker sends it again at once.  The repeat
    waits for the first and gets its reply."""
    blocks, block_bytes = 256, 128 << 10  # 2 x 32 MiB device tensors
    host_blocks = 512  # 2 x 64 MiB host pool
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=host_blocks, wait=False)
    names = launcher.names
    with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as worker:
        tensors = _tensors(worker, blocks, block_bytes)
        with pytest.raises(RankTimeout):
            worker.register(tensors, timeout=0.005)
        reply = worker.register(tensors, timeout=60)
        assert reply.ok and reply.fields == {"num_device_blocks": blocks,
                                             "num_host_blocks": host_blocks}
        launcher.wait_ready(30)
        assert "repeats the one being attached" in names.log_path(0).read_text()
        assert int(launcher.seg.ranks[0, R.FAILED]) == 0
