"""Start, watch and tear down the rank daemons of one namespace.

The launcher *creates* the namespace (run dir 0700, signal segment, barrier
semaphores) and is the one that removes it: on teardown every POSIX object
named ``/kvswap.<ns>.*`` is unlinked (including swap pools and simulated device
tensors left by a crashed process) and the run dir is deleted.

Stopping is staged against one deadline: a ``shutdown`` message to each daemon,
then SIGTERM at half of the deadline, then SIGKILL at 80 %.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import posix_ipc
import zmq

from kvswap.client.errors import ErrorCode, KvswapError, NamespaceError, NotReady, RankTimeout
from kvswap.client.naming import Names
from kvswap.client.protocol import Op, encode_request
from kvswap.client.signals import (
    H,
    R,
    RankState,
    SignalSegment,
    create_semaphores,
    now_ns,
    pid_alive,
    poll_until,
    unlink_semaphores,
)
from kvswap.daemon.config import DaemonConfig, LaunchConfig
from kvswap.daemon.options import to_argv
from kvswap.daemon.supervisor import Supervisor

log = logging.getLogger("kvswap.launcher")


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in text[-lines:])


def sweep_namespace(names: Names) -> list[str]:
    """Unlink every shm segment and semaphore of the namespace; return what was removed."""
    removed = []
    for entry in names.owned_shm():
        if entry.startswith("sem."):
            try:
                posix_ipc.unlink_semaphore("/" + entry[4:])
                removed.append(entry)
            except posix_ipc.ExistentialError:
                pass
        else:
            try:
                posix_ipc.unlink_shared_memory("/" + entry)
                removed.append(entry)
            except posix_ipc.ExistentialError:
                pass
    return removed



class Launcher:
    def __init__(self, cfg: LaunchConfig):
        # cfg validated itself when it was built (kvswap.daemon.config).
        self.cfg = cfg
        self.names = Names.of(cfg.namespace, cfg.run_root)
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else self.names.run_dir
        self.procs: list[subprocess.Popen] = []
        self.seg: SignalSegment | None = None
        self.supervisor: Supervisor | None = None
        self._stopped = False

    # ------------------------------------------------------------------ start
    def _refuse_if_in_use(self) -> None:
        leftovers = self.names.owned_shm()
        if not leftovers and not self.names.run_dir.exists():
            return
        if self.names.signals[1:] in leftovers:
            try:
                other = SignalSegment.attach(self.names, readonly=True)
            except NamespaceError as exc:
                raise NamespaceError(
                    f"namespace {self.names.namespace!r} has an unreadable signal segment ({exc}); "
                    f"if no launcher uses it, remove /dev/shm/{self.names.prefix}* by hand"
                ) from None
            pid = int(other.header[H.LAUNCHER_PID])
            other.close()
            if pid and pid != os.getpid() and pid_alive(pid):
                raise NamespaceError(
                    f"namespace {self.names.namespace!r} is in use by launcher pid {pid}; "
                    f"stop it first or choose another --namespace")
        removed = sweep_namespace(self.names)
        log.warning("namespace %s: removed leftovers of a launcher that is gone: %s",
                    self.names.namespace, ", ".join(removed) or "run dir only")
        shutil.rmtree(self.names.run_dir, ignore_errors=True)

    def start(self) -> None:
        self._refuse_if_in_use()
        self.seg = SignalSegment.create(self.names, self.cfg.tp)
        try:
            create_semaphores(self.names, self.cfg.tp)
            self.names.run_dir.mkdir(mode=0o700, parents=True, exist_ok=False)
            os.chmod(self.names.run_dir, 0o700)
            self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for r in range(self.cfg.tp):
                self.procs.append(self._spawn(r))
        except BaseException:
            self.stop()
            raise
        log.info("namespace %s: started %d daemon(s), logs in %s", self.names.namespace,
                 self.cfg.tp, self.log_dir)

    def daemon_config(self, rank: int) -> DaemonConfig:
        """What rank ``rank``'s daemon runs with: the launch options, this run root."""
        return self.cfg.daemon_config(rank, str(self.names.run_root))

    def daemon_command(self, rank: int) -> list[str]:
        """kvswapd's command line, written from :meth:`daemon_config` by the same
        declarations kvswapd parses it with."""
        return [sys.executable, "-m", "kvswap.daemon", *to_argv(self.daemon_config(rank))]

    def _spawn(self, rank: int) -> subprocess.Popen:
        logf = open(self.names.log_path(rank, self.log_dir), "ab")
        try:
            # A session of its own: a terminal's Ctrl-C reaches the launcher only,
            # which then stops the daemons in stages.
            return subprocess.Popen(self.daemon_command(rank), stdin=subprocess.DEVNULL,
                                    stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            logf.close()

    # ------------------------------------------------------------------ watch
    def _describe(self, r: int) -> str:
        assert self.seg is not None
        state = self.seg.state_of(r)
        err = int(self.seg.ranks[r, R.LAST_ERROR])
        return (f"rank {r} ({state.name}{', last error ' + str(err) if err else ''}; "
                f"log {self.names.log_path(r, self.log_dir)})")

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every daemon that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]

    def progress(self) -> str:
        assert self.seg is not None
        return ", ".join(f"rank {r} {self.seg.state_of(r).name}" for r in range(self.cfg.tp))

    def wait_ready(self, timeout: float | None = None,
                   on_progress: Callable[[str], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> None:
        """Wait until every rank is READY.  Fails fast, naming the rank and its log,
        if a daemon exits or reports FAILED; raises :class:`RankTimeout` at the deadline
        and :class:`KvswapError` (SHUTTING_DOWN) as soon as ``stop()`` is true."""
        assert self.seg is not None
        timeout = self.cfg.ready_timeout_s if timeout is None else timeout
        last = ""

        def check() -> bool | None:
            nonlocal last
            if stop is not None and stop():
                raise KvswapError("interrupted while waiting for READY", ErrorCode.SHUTTING_DOWN)
            for r, rc in self.dead_ranks():
                path = self.names.log_path(r, self.log_dir)
                raise NotReady(f"rank {r} exited with status {rc} before READY; log {path}:\n"
                               f"{log_tail(path)}")
            for r in range(self.cfg.tp):
                if self.seg.state_of(r) == RankState.FAILED:
                    path = self.names.log_path(r, self.log_dir)
                    raise NotReady(f"{self._describe(r)} failed before READY:\n{log_tail(path)}")
            text = self.progress()
            if on_progress is not None and text != last:
                on_progress(text)
            last = text
            if all(self.seg.state_of(r) == RankState.READY for r in range(self.cfg.tp)):
                return True
            return None

        if poll_until(check, time.monotonic() + timeout, max_sleep=0.05) is None:
            missing = [r for r in range(self.cfg.tp) if self.seg.state_of(r) != RankState.READY]
            raise RankTimeout(f"ranks not READY after {timeout:.1f}s: "
                              + "; ".join(self._describe(r) for r in missing))

    # ------------------------------------------------------------------ supervise
    def _respawn(self, rank: int) -> subprocess.Popen:
        proc = self._spawn(rank)
        self.procs[rank] = proc
        return proc

    def supervise_once(self) -> str | None:
        """One supervision pass (call every ~200 ms once READY): restart dead or silent
        daemons with back-off.  Returns why the namespace must be torn down (a rank is
        FATAL, or the engine stopped beating), else None."""
        assert self.seg is not None
        if self.supervisor is None:
            self.supervisor = Supervisor(self.seg, self.procs, self._respawn,
                                         self.cfg.supervision)
        self.supervisor.step()
        fatal = self.supervisor.fatal()
        if fatal:
            return "; ".join(f"rank {rp.rank} is FATAL after {rp.retries} failed restarts "
                             f"(log {self.names.log_path(rp.rank, self.log_dir)})"
                             for rp in fatal)
        beat = int(self.seg.header[H.ENGINE_HEARTBEAT_NS])
        if beat and self.cfg.engine_timeout_s > 0:
            age = (now_ns() - beat) / 1e9
            if age > self.cfg.engine_timeout_s:
                return f"the engine stopped beating {age:.0f}s ago (its workers are gone)"
        return None

    # ------------------------------------------------------------------ stop
    def _send_shutdown(self, ranks: list[int]) -> None:
        ctx = zmq.Context(1)
        try:
            for r in ranks:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 200)
                s.connect(self.names.endpoint(r))
                s.send_multipart(encode_request(Op.SHUTDOWN, 0), zmq.NOBLOCK)
                s.close()
        finally:
            ctx.term()

    def _wait_exit(self, until: float) -> list[int]:
        """Wait for daemons to exit until the monotonic ``until``; return those still alive."""
        def all_gone() -> bool | None:
            return True if all(p.poll() is not None for p in self.procs) else None

        poll_until(all_gone, until, max_sleep=0.02)
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def stop(self) -> None:
        """Staged stop of every daemon, then remove the namespace.  Idempotent.

        Does nothing if :meth:`start` did not create the namespace (e.g. it was
        refused because another launcher owns it): only the creator tears down."""
        if self._stopped or self.seg is None:
            return
        self._stopped = True
        t0 = time.monotonic()
        budget = self.cfg.stop_timeout_s
        alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
        if alive:
            self._send_shutdown(alive)
            alive = self._wait_exit(t0 + 0.5 * budget)
        if alive:
            log.warning("rank(s) %s ignored shutdown; sending SIGTERM", alive)
            for r in alive:
                self.procs[r].send_signal(signal.SIGTERM)
            alive = self._wait_exit(t0 + 0.8 * budget)
        if alive:
            log.error("rank(s) %s ignored SIGTERM; sending SIGKILL", alive)
            for r in alive:
                self.procs[r].kill()
            alive = self._wait_exit(t0 + budget + 5.0)
        for r, p in enumerate(self.procs):
            if p.returncode not in (0, None):
                log.warning("rank %d exited with status %s", r, p.returncode)
        self.seg.close()
        self.seg.unlink()
        self.seg = None
        unlink_semaphores(self.names, self.cfg.tp)
        removed = sweep_namespace(self.names)
        if removed:
            log.info("removed leftovers: %s", ", ".join(removed))
        shutil.rmtree(self.names.run_dir, ignore_errors=True)
        log.info("namespace %s torn down in %.2fs", self.names.namespace, time.monotonic() - t0)

    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
