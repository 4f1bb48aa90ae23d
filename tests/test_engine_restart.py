"""Engine restarts (#14): a worker killed with -9 and a new worker registering on the
live namespace with ``replace=True``; loads from the kept host pool are verified.

The engine workers of the first incarnation run in their own processes, so they
can be killed the way a crashed engine dies; their device tensors are shm
segments (host backend), which the test unlinks afterwards as the engine's own
restart script would (the daemon still maps them until the replace detaches them).
"""

from __future__ import annotations

import subprocess
import time
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvswap.client import CacheTensor, CacheWorker, TransferClient
from kvswap.client.errors import ErrorCode, InvalidTask, NotReady
from kvswap.client.shm_region import unlink_shm
from kvswap.client.signals import RankState, poll_until
from kvswap.daemon.launcher import Launcher

TP = 2
BLOCKS = 32
BLOCK_BYTES = 256
HOST_BLOCKS = 64
NAMES = ("k0", "v0")

# One engine worker of the first incarnation: registers tensors whose block i holds
# pattern(rank, tensor, i), says so, then waits to be killed.
_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from kvswap.client import CacheTensor, CacheWorker
    ns, run_root, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    worker = CacheWorker(ns, rank, run_root=run_root)
    tensors = []
    for t, name in enumerate({names!r}):
        arr = worker.alloc_host_tensor(name, ({blocks}, {block_bytes}), "uint8")
        for i in range({blocks}):
            arr[i] = (np.arange({block_bytes}) * 7 + rank * 31 + t * 17 + i * 3) % 251
        tensors.append(CacheTensor(name, 0, arr))
    worker.register(tensors, timeout=30)
    print("registered", flush=True)
    sys.stdin.read()
""").format(names=NAMES, blocks=BLOCKS, block_bytes=BLOCK_BYTES)


def _pattern(rank: int, t: int, i: int) -> np.ndarray:
    return ((np.arange(BLOCK_BYTES) * 7 + rank * 31 + t * 17 + i * 3) % 251).astype(np.uint8)


def _new_worker(names, rank: int, tensor_names=NAMES) -> tuple[CacheWorker, list[CacheTensor]]:
    worker = CacheWorker(names.namespace, rank, run_root=str(names.run_root))
    tensors = [CacheTensor(n, 0, worker.alloc_host_tensor(n, (BLOCKS, BLOCK_BYTES), "uint8"))
               for n in tensor_names]
    return worker, tensors


def _register_patterned(workers: list[tuple[CacheWorker, list[CacheTensor]]]) -> None:
    """Fill block i of tensor t of rank r with pattern(r, t, i) and register each rank."""
    for r, (worker, tensors) in enumerate(workers):
        for t, ct in enumerate(tensors):
            for i in range(BLOCKS):
                ct.array[i] = _pattern(r, t, i)
        worker.register(tensors, timeout=30)


def _first_engine(namespaces, **launch) -> tuple[Launcher, list[tuple[CacheWorker,
                                                                     list[CacheTensor]]]]:
    """A namespace with no caches yet (``launch``: more of its options), an engine's
    worker on every rank, registered with patterned tensors, and the namespace READY;
    the workers are released if that fails."""
    launcher = namespaces.launch(tp=TP, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False,
                                 **launch)
    first = [_new_worker(launcher.names, r) for r in range(TP)]
    try:
        _register_patterned(first)
        launcher.wait_ready(30)
    except BaseException:
        _release([w for w, _ in first], launcher.names)
        raise
    return launcher, first


def _release(workers: list[CacheWorker], names) -> None:
    """Close the workers and unlink every device tensor a worker of the test made
    (those of a killed engine process too)."""
    for w in workers:
        w.close()
    for r in range(TP):
        for n in NAMES:
            unlink_shm(names.device_segment(r, n))


def test_new_engine_replaces_a_killed_one_and_loads_from_the_kept_pool(namespaces):
    launcher = namespaces.launch(tp=TP, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False)
    names = launcher.names
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, names.namespace,
                               str(names.run_root), str(r)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(TP)]
    workers: list[CacheWorker] = []
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "registered"
        launcher.wait_ready(30)
        dev, host = list(range(16)), list(range(10, 26))
        with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
            assert all(r.ok for r in client.evict(dev, host).result(30).replies.values())
        for p in procs:  # the engine crashes
            p.kill()
            p.wait(10)
        for r in range(TP):
            for n in NAMES:
                unlink_shm(names.device_segment(r, n))

        # the new engine's workers; first two registers that must change nothing
        new_tensors = []
        for r in range(TP):
            worker, tensors = _new_worker(names, r)
            workers.append(worker)
            new_tensors.append(tensors)
            with pytest.raises(NotReady) as plain:  # other tensors, no replace
                worker.register(tensors, timeout=30)
            assert plain.value.code == ErrorCode.ALREADY_REGISTERED
            assert "replace=True" in plain.value.message
        odd, odd_tensors = _new_worker(names, 0, ("x0", "y0"))
        workers.append(odd)
        with pytest.raises(InvalidTask) as bad:  # replace, but another layout
            odd.register(odd_tensors, timeout=30, replace=True)
        assert bad.value.code == ErrorCode.BAD_LAYOUT
        assert "tensor 'k0': name 'x0', not 'k0'" in bad.value.message
        assert "clear_caches(free_host=True)" in bad.value.message
        assert [launcher.seg.state_of(r) for r in range(TP)] == [RankState.READY] * TP

        for r in range(TP):
            reply = workers[r].register(new_tensors[r], timeout=30, replace=True)
            assert reply.ok and reply.fields["host_pool_kept"] is True
            assert reply.fields["num_host_blocks"] == HOST_BLOCKS
        with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
            client.wait_ready(30)
            for tensors in new_tensors:
                assert not any(t.array[:16].any() for t in tensors)  # fresh, zeroed memory
            assert all(r.ok for r in client.load(host, dev).result(30).replies.values())
        for r, tensors in enumerate(new_tensors):
            for t, ct in enumerate(tensors):
                for i in dev:
                    assert np.array_equal(ct.array[i], _pattern(r, t, i)), (r, ct.name, i)
        log = names.log_path(0).read_text()
        assert "replaces the attached tensors (engine restart)" in log
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        _release(workers, names)


def test_a_daemon_restarted_while_the_engine_was_down_joins_the_new_engine(namespaces):
    """The engine stops (its workers close, freeing their tensors), rank 1's daemon is
    killed and respawned meanwhile, then the new engine registers with ``replace=True``.

    The respawned daemon cannot re-attach its predecessor's tensors (they are gone), so
    it waits in ATTACHING with nothing registered.  Its ranks' peers are READY and never
    enter the start-up barrier again: a register that met it there went FAILED
    BARRIER_TIMEOUT after --attach-timeout (while both registers answered OK).  Now it
    joins without the barrier, refuses a layout other than the one its peers serve, and
    says truthfully that it adopted its predecessor's pool: the data evicted before the
    crash loads into the new tensors on both ranks."""
    from kvswap.daemon.supervisor import SupervisorConfig
    from kvswap.client.signals import RankSlot
    from test_faults import Supervising

    launcher, first = _first_engine(namespaces, attach_timeout_s=8.0,
                                    supervision=SupervisorConfig(backoff_s=0.05))
    names, seg = launcher.names, launcher.seg
    workers = [w for w, _ in first]
    try:
        dev, host = list(range(8)), list(range(20, 28))
        with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
            assert all(r.ok for r in client.evict(dev, host).result(30).replies.values())
        for worker, _ in first:  # the engine stops: its tensors are unlinked
            worker.close()
        log1 = names.log_path(1, launcher.log_dir)
        with Supervising(launcher) as sup:
            launcher.procs[1].kill()
            # the respawned daemon tried its predecessor's register file, and failed
            assert poll_until(lambda: True if int(seg.ranks[1, RankSlot.EPOCH]) == 2
                              and "internal register" in log1.read_text() else None,
                              time.monotonic() + 30), launcher.progress()
            assert seg.state_of(1) is RankState.ATTACHING

            odd, odd_tensors = _new_worker(names, 1, ("x0", "y0"))
            workers.append(odd)
            with pytest.raises(InvalidTask) as bad:  # not the layout the ranks serve
                odd.register(odd_tensors, timeout=30, replace=True)
            assert bad.value.code == ErrorCode.BAD_LAYOUT
            assert "it restarted and rejoins ranks" in bad.value.message
            assert "tensor 'k0': name 'x0', not 'k0'" in bad.value.message

            second = [_new_worker(names, r) for r in range(TP)]
            workers += [w for w, _ in second]
            for worker, tensors in second:
                reply = worker.register(tensors, timeout=30, replace=True)
                assert reply.ok and reply.fields["host_pool_kept"] is True
                assert reply.fields["num_host_blocks"] == HOST_BLOCKS
            with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
                client.wait_ready(20)
                assert all(r.ok for r in client.load(host, dev).result(30).replies.values())
            assert sup.reasons == []
        assert [int(seg.ranks[r, RankSlot.EPOCH]) for r in range(TP)] == [1, 2]
        for r, (_, tensors) in enumerate(second):
            for t, ct in enumerate(tensors):
                for i in dev:
                    assert np.array_equal(ct.array[i], _pattern(r, t, i)), (r, ct.name, i)
        assert "joins the serving ranks without the start-up barrier" in log1.read_text()
    finally:
        _release(workers, names)


def test_a_replacing_register_keeps_a_paused_namespace_paused(namespaces):
    """A new engine replaces the tensors while the namespace is paused: each rank
    used to end READY, so transfers ran on a namespace the engine had paused.  It
    ends PAUSED, as it began, until resume."""
    from kvswap.client.errors import TransferFailed

    launcher, first = _first_engine(namespaces)
    names, seg = launcher.names, launcher.seg
    workers = [w for w, _ in first]
    try:
        with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
            client.pause().result(20)
            second = []
            for r, (worker, _) in enumerate(first):
                worker.close()  # the old engine is gone, its tensors with it
                new, tensors = _new_worker(names, r)
                workers.append(new)
                second.append(tensors)
                assert new.register(tensors, timeout=30, replace=True).ok
            assert [seg.state_of(r) for r in range(TP)] == [RankState.PAUSED] * TP
            with pytest.raises(TransferFailed) as ei:
                client.evict([1], [1]).result(20)
            assert {f.code for f in ei.value.failures} == {ErrorCode.PAUSED}
            client.resume().result(10)
            assert all(r.ok for r in client.evict([1], [1]).result(20).replies.values())
    finally:
        _release(workers, names)


def test_a_replace_that_failed_after_detaching_is_completed_only_with_the_same_layout(
        namespaces):
    """Rank 0's replacing register fails at attach (one of its new segments is gone),
    after the tensors in effect were detached.  The next register on that rank was
    taken with any layout (BAD_LAYOUT skipped): rank 0 then served another layout than
    rank 1 and, with its pool recreated, loads answered OK with zeros.  It must keep
    the layout the pool was written under; the failure's reply says the rank is down."""
    launcher, first = _first_engine(namespaces)
    names, seg = launcher.names, launcher.seg
    workers = [w for w, _ in first]
    try:
        with TransferClient(names.namespace, TP, run_root=str(names.run_root)) as client:
            assert all(r.ok for r in client.evict(list(range(8)), list(range(8))).result(20)
                       .replies.values())
            first[0][0].close()  # rank 0's engine worker is replaced
            new, tensors = _new_worker(names, 0)
            workers.append(new)
            unlink_shm(names.device_segment(0, "v0"))  # its attach will fail
            with pytest.raises(Exception, match="serves nothing \\(NOT_READY\\) until a "
                                                "register of their layout succeeds"):
                new.register(tensors, timeout=30, replace=True)
            assert seg.state_of(0) is RankState.ATTACHING
            other = CacheWorker(names.namespace, 0, run_root=str(names.run_root))
            workers.append(other)
            odd = [CacheTensor("x0", 0, other.alloc_host_tensor("x0", (BLOCKS, 128), "uint16"))]
            with pytest.raises(InvalidTask, match="must keep their layout") as ei:
                other.register(odd, timeout=30, replace=True)
            assert ei.value.code == ErrorCode.BAD_LAYOUT and seg.state_of(0) is RankState.ATTACHING
            new.close()
            again, tensors = _new_worker(names, 0)
            workers.append(again)
            reply = again.register(tensors, timeout=30, replace=True)
            assert reply.ok and reply.fields["host_pool_kept"]
            client.wait_ready(20)
            assert all(r.ok for r in client.load(list(range(8)), list(range(16, 24))).result(20)
                       .replies.values())
            for t, ct in enumerate(tensors):
                for i in range(8):
                    assert np.array_equal(ct.array[16 + i], _pattern(0, t, i))
    finally:
        _release(workers, names)
        unlink_shm(names.device_segment(0, "x0"))


def test_close_ends_a_register_that_waits_for_a_stopped_daemon(namespaces):
    """close() from another thread waited for a pending register's whole timeout (it
    held the worker's lock while it waited for the answer); a register after close()
    was refused for its tensors (BAD_LAYOUT), not SHUTTING_DOWN."""
    import os
    import signal
    import threading

    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False)
    names = launcher.names
    worker, tensors = _new_worker(names, 0)
    errors: list[BaseException] = []

    def register() -> None:
        try:
            worker.register(tensors, timeout=30)
        except BaseException as exc:
            errors.append(exc)

    pid = launcher.procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    t = threading.Thread(target=register)
    try:
        t.start()
        # the register is waiting for its answer (it holds the worker's lock while it
        # does): a close before it began would test only the closed check
        assert poll_until(lambda: True if worker._lock.locked() else None,
                          time.monotonic() + 10)
        t0 = time.monotonic()
        worker.close()
        t.join(10)
        assert time.monotonic() - t0 < 5 and not t.is_alive()
        assert len(errors) == 1 and getattr(errors[0], "code", None) == ErrorCode.SHUTTING_DOWN
        with pytest.raises(Exception, match="CacheWorker is closed") as ei:
            worker.register(tensors, timeout=5)
        assert ei.value.code == ErrorCode.SHUTTING_DOWN
    finally:
        os.kill(pid, signal.SIGCONT)
        worker.close()


def test_a_worker_beating_slower_than_half_the_engine_timeout_is_refused(namespaces):
    """With --engine-timeout under the worker's heartbeat interval the launcher tore a
    live engine's namespace down between two beats.  The launcher publishes its
    timeout and the worker refuses an interval over half of it; the launcher refuses a
    timeout under 1 s (twice the default interval)."""
    from kvswap.daemon.config import LaunchConfig

    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False,
                                 engine_timeout_s=4.0)
    names = launcher.names
    with pytest.raises(InvalidTask, match="at most half of the namespace's --engine-timeout 4"):
        CacheWorker(names.namespace, 0, run_root=str(names.run_root), heartbeat_interval_s=2.5)
    CacheWorker(names.namespace, 0, run_root=str(names.run_root), heartbeat_interval_s=2.0).close()
    with pytest.raises(ValueError, match="at least 1 second"):
        LaunchConfig(namespace="x", tp=1, engine_timeout_s=0.4)
    assert LaunchConfig(namespace="x", tp=1, engine_timeout_s=0).engine_timeout_s == 0


def test_alloc_host_tensor_larger_than_dev_shm_is_refused_with_nothing_made(namespaces):
    """A shape of 2**80 bytes raised a bare OverflowError, and 1 TiB was created as a
    sparse segment that the first touch past /dev/shm's room would kill."""
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False)
    names = launcher.names
    with CacheWorker(names.namespace, 0, run_root=str(names.run_root)) as worker:
        for shape in ((2**40, 2**40), (1 << 40, 1024)):
            with pytest.raises(InvalidTask, match="bytes free in /dev/shm") as ei:
                worker.alloc_host_tensor("big", shape, "uint8")
            assert ei.value.code == ErrorCode.BAD_FIELD
        assert not (Path("/dev/shm") / names.device_segment(0, "big").lstrip("/")).exists()


def test_a_replace_racing_another_is_told_to_retry_not_to_use_replace(namespaces, tmp_path,
                                                                      monkeypatch):
    """Two workers of one rank replace at once: the second, meeting the rank ATTACHING
    the first, was refused ALREADY_REGISTERED "a restarted engine registers with
    replace=True", which it had done.  It is told the rank is attaching another
    register and to retry (NOT_READY).  The first replace is held in its attach (a
    sitecustomize in the daemon waits for a file) so the race is not left to timing."""
    import threading

    go = tmp_path / "go"
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, time
        from kvswap.daemon import attachment
        _attach = attachment.Registrar._attach
        def held(self, job):
            deadline = time.monotonic() + 20
            while job.replace and not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            return _attach(self, job)
        attachment.Registrar._attach = held
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    launcher = namespaces.launch(tp=1, demo_caches=None, host_blocks=HOST_BLOCKS, wait=False)
    monkeypatch.delenv("PYTHONPATH")
    names, seg = launcher.names, launcher.seg
    first, tensors = _new_worker(names, 0)
    workers = [first]
    replies: list = []
    try:
        first.register(tensors, timeout=30)
        launcher.wait_ready(30)
        first.close()
        a, a_tensors = _new_worker(names, 0)
        workers.append(a)
        t = threading.Thread(target=lambda: replies.append(
            a.register(a_tensors, timeout=30, replace=True)))
        t.start()
        assert poll_until(lambda: True if seg.state_of(0) is RankState.ATTACHING else None,
                          time.monotonic() + 20)
        b = CacheWorker(names.namespace, 0, run_root=str(names.run_root))
        workers.append(b)
        odd = [CacheTensor("x0", 0, b.alloc_host_tensor("x0", (BLOCKS, 128), "uint16"))]
        with pytest.raises(NotReady, match="is ATTACHING another register .* retry once"):
            b.register(odd, timeout=30, replace=True)
        go.touch()
        t.join(30)
        assert len(replies) == 1 and replies[0].ok and seg.state_of(0) is RankState.READY
    finally:
        go.touch()
        _release(workers, names)
        unlink_shm(names.device_segment(0, "x0"))
