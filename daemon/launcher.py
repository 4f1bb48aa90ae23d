"""Start, watch and tear down the rank daemons of one namespace.

The launcher *creates* the namespace (run dir 0700, signal segment, barrier
semaphores) and is the one that removes it: on teardown every POSIX object
named ``/kvswap.<ns>.*`` is unlinked (including swap pools and simulated device
tensors left by a crashed process) and the run dir is deleted.

Before it creates anything it checks what it can know of the shared memory the
namespace will take (:func:`shm_needs`: journals, and the host pools and demo
caches where their sizes are known without a CacheWorker) against this host's
free ``/dev/shm`` and memory, and refuses with the numbers.  Every option was
checked when the :class:`LaunchConfig` was built.

While it waits for READY it reads every rank's state and log (:class:`RankLog`):
a daemon that exits or reports FAILED ends the wait at once with the error
lines of its log (:func:`error_lines`), and warnings are passed on as they are
written, so a failing start is seen in the launch output, not only in a log.

Stopping is staged against one deadline: SIGTERM to each daemon (its clean stop,
as a ``shutdown`` request runs it), then SIGKILL at 80 %.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import posix_ipc

from kvswap.client.auth import load_secret
from kvswap.client.errors import ErrorCode, KvswapError, NamespaceError, NotReady, RankTimeout
from kvswap.client.layout import demo_layout
from kvswap.client.monitor import rank_activity
from kvswap.client.naming import Names
from kvswap.client.protocol import MAX_SECONDS, check_seconds
from kvswap.client.signals import (
    HeaderSlot,
    RankSlot,
    RankState,
    SignalSegment,
    create_semaphores,
    now_ns,
    pid_alive,
    poll_until,
    unlink_semaphores,
)
from kvswap.daemon.config import DaemonConfig, LaunchConfig
from kvswap.daemon.journal import Journal
from kvswap.daemon.logs import LINE
from kvswap.daemon.options import format_size, to_argv
from kvswap.daemon.supervisor import SERVED, Supervisor
from kvswap.daemon.swap_space import SwapLayout, fit_problem, pool_blocks

log = logging.getLogger("kvswap.launcher")

_ERROR_LEVELS = ("ERROR", "CRITICAL")
_TAIL_BYTES = 64 << 10  # how much of a log's end error_lines reads


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in text[-lines:])


def error_lines(path: Path, rank: int, most: int = 3) -> str:
    """The last ``most`` errors of a rank's log, each as ``rank R: message`` followed by
    its traceback if it has one, or the log's last lines if it holds no error.

    An error is a line logged at ERROR or CRITICAL, with the lines that continue it
    (a traceback), or lines at the end of the log that are not log lines at all:
    what Python prints when an exception escapes the daemon."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            text = f.read().decode(errors="replace").splitlines()
    except OSError:
        return f"rank {rank}: (no log at {path})"
    entries: list[list[str]] = []
    current: list[str] | None = None  # the entry that continuation lines extend
    for line in text:
        m = LINE.match(line)
        if m is None:
            if current is None:
                current = []
                entries.append(current)
            current.append("    " + line)
        elif m.group(3) in _ERROR_LEVELS:
            current = [f"rank {rank}: {m.group(5)}"]
            entries.append(current)
        else:
            current = None
    if not entries:
        return log_tail(path, 10)
    return "\n".join(line for entry in entries[-most:] for line in entry)


def daemons_left(names: Names, seg: SignalSegment) -> list[tuple[int, int]]:
    """(rank, pid) of every rank slot whose pid still runs a daemon of this namespace:
    alive, and its command line names the namespace (a pid the system has given to
    another process since does not count)."""
    ns = names.namespace.encode()
    left = []
    for r in range(seg.tp_size):
        pid = int(seg.ranks[r, RankSlot.PID])
        if not pid or pid == os.getpid() or not pid_alive(pid):
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if any(a == b"--namespace=" + ns or (a == b"--namespace" and b == ns)
               for a, b in zip(args, args[1:])):
            left.append((r, pid))
    return left


@dataclass(frozen=True)
class Teardown:
    """Why a supervised namespace ends: ``failed`` (a rank FATAL, the engine gone) or
    not (a rank stopped on request), which is `kvswap launch`'s exit status 1 or 0."""

    why: str
    failed: bool


class RankLog:
    """Reads a rank's log as it grows: :meth:`new_lines` returns the complete lines
    written since the last call (a log the daemon has not created yet reads as empty)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(_TAIL_BYTES)
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [ln.decode(errors="replace") for ln in lines]


@dataclass(frozen=True)
class ShmNeeds:
    """Bytes of ``/dev/shm`` each rank of a launch will take, as far as the launcher
    can know before any daemon runs: the host pool only when its size does not
    depend on a CacheWorker's layout (``--host-size``, or ``--demo-caches``)."""

    pool: int | None  # None: sized at register, from the registered layout
    pool_blocks: int | None  # blocks per tensor, where the layout is known
    demo_caches: int  # the simulated device tensors of --demo-caches
    journal: int

    def per_rank(self) -> int:
        return (self.pool or 0) + self.demo_caches + self.journal

    def describe(self) -> str:
        parts = [f"journal {format_size(self.journal)}"]
        if self.pool is not None:
            blocks = "" if self.pool_blocks is None else f" ({self.pool_blocks} blocks per tensor)"
            parts.insert(0, f"host pool {format_size(self.pool)}{blocks}")
        if self.demo_caches:
            parts.append(f"demo caches {format_size(self.demo_caches)}")
        return " + ".join(parts)


def shm_needs(cfg: LaunchConfig) -> ShmNeeds:
    """What :class:`ShmNeeds` says for ``cfg``.  Raises :class:`KvswapError` if
    ``--host-size`` cannot hold one block of the ``--demo-caches`` layout."""
    journal = Journal.segment_bytes(cfg.journal_records, cfg.journal_mib << 20)
    if cfg.demo_caches is None:
        return ShmNeeds(cfg.host_size, None, 0, journal)
    tensors = demo_layout(cfg.demo_caches or None)
    block_bytes = [int(np.prod(t.shape[1:])) * np.dtype(t.dtype).itemsize for t in tensors]
    blocks = pool_blocks(block_bytes, cfg.pool_blocks, cfg.host_size)
    demo = sum(t.shape[0] * b for t, b in zip(tensors, block_bytes))
    return ShmNeeds(SwapLayout.of_block_bytes(block_bytes, blocks).size, blocks, demo, journal)


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



# Prefixes of the namespaces a Launcher of this process runs, from start() to stop()
# (the shm names depend on the namespace alone, whatever the run root):
# the launcher pid in a namespace's segment cannot tell two Launchers of one process
# apart, nor this process's live one from the leftover of one that never stopped.
_running: set[str] = set()


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        # cfg validated itself when it was built (kvswap.daemon.config).
        self.cfg = cfg
        self.names = Names.of(cfg.namespace, cfg.run_root)
        # absolute: restarts reopen it, and an embedding process may change directory
        self.log_dir = Path(cfg.log_dir).absolute() if cfg.log_dir else self.names.run_dir
        self.procs: list[subprocess.Popen] = []
        self.seg: SignalSegment | None = None
        self.supervisor: Supervisor | None = None
        self._stopped = False
        self.logs = [RankLog(self.names.log_path(r, self.log_dir)) for r in range(cfg.tp)]

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
                    f"if no process of the namespace runs, remove its leftovers: "
                    f"rm -f /dev/shm/{self.names.prefix}* /dev/shm/sem.{self.names.prefix}*"
                ) from None
            try:
                pid = int(other.header[HeaderSlot.LAUNCHER_PID])
                left = daemons_left(self.names, other)
            finally:
                other.close()
            if pid == os.getpid() and self.names.prefix in _running:
                raise NamespaceError(
                    f"namespace {self.names.namespace!r} is in use by another Launcher of this "
                    f"process; stop() it first or choose another namespace")
            if pid and pid != os.getpid() and pid_alive(pid):
                raise NamespaceError(
                    f"namespace {self.names.namespace!r} is in use by launcher pid {pid}; "
                    f"stop it first or choose another --namespace")
            if left:
                # Sweeping now would let them, when they stop, unlink the new
                # incarnation's segments and files, which reuse their names.
                ranks = ", ".join(f"rank {r} pid {p}" for r, p in left)
                raise NamespaceError(
                    f"namespace {self.names.namespace!r}: its launcher (pid {pid}) is gone but "
                    f"its daemons still run ({ranks}): an engine may still use them, and each "
                    f"exits by itself once the engine's heartbeat has been silent for "
                    f"--orphan-timeout; stop them first (kill "
                    f"{' '.join(str(p) for _, p in left)}) or choose another --namespace")
        removed = sweep_namespace(self.names)
        log.warning("namespace %s: removed leftovers of a launcher that is gone: %s",
                    self.names.namespace, ", ".join(removed) or "run dir only")
        shutil.rmtree(self.names.run_dir, ignore_errors=True)

    def _preflight(self) -> None:
        """Refuse, before anything is created, what would make a daemon fail at start:
        an unusable secret file, or shared memory this host cannot hold."""
        if self.cfg.tcp is not None:
            assert self.cfg.secret_file is not None  # LaunchConfig requires it with --tcp
            load_secret(self.cfg.secret_file)
        needs = shm_needs(self.cfg)
        tp = self.cfg.tp
        problem = fit_problem(tp * needs.per_rank(),
                              f"namespace {self.names.namespace!r} ({tp} rank(s) x "
                              f"{needs.describe()})")
        if problem:
            raise KvswapError(problem, ErrorCode.INVALID_TASK)
        if needs.pool is None:
            log.info("host pool per rank: %s, worked out at register from the caches' layout",
                     self.cfg.pool_text())
        else:
            log.info("shared memory per rank: %s", needs.describe())

    def start(self) -> None:
        if self.seg is not None or self._stopped:
            raise NamespaceError(
                f"this Launcher of namespace {self.names.namespace!r} was already started; "
                f"each Launcher starts once: make a new one to launch again")
        self._preflight()
        self._refuse_if_in_use()
        self.seg = SignalSegment.create(self.names, self.cfg.tp,
                                        storage_tier=self.cfg.storage_url is not None,
                                        engine_timeout_s=self.cfg.engine_timeout_s)
        _running.add(self.names.prefix)
        try:
            create_semaphores(self.names, self.cfg.tp)
            self._make_dir(self.names.run_dir, "--run-root", exist_ok=False)
            os.chmod(self.names.run_dir, 0o700)
            self._make_dir(self.log_dir, "--log-dir", exist_ok=True)
            if not os.path.samefile(self.log_dir, self.names.run_dir):
                # clients name <run dir>/rank<r>.log in their errors (they do not know
                # --log-dir): a link there leads to the log
                for r in range(self.cfg.tp):
                    self.names.log_path(r).symlink_to(self.names.log_path(r, self.log_dir))
            for r in range(self.cfg.tp):
                self.procs.append(self._spawn(r))
        except BaseException:
            self.stop()
            raise
        log.info("namespace %s: started %d daemon(s), logs in %s", self.names.namespace,
                 self.cfg.tp, self.log_dir)

    @staticmethod
    def _make_dir(path: Path, flag: str, exist_ok: bool) -> None:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=exist_ok)
        except OSError as exc:  # exists as a file, a parent missing or not ours, read-only
            raise NamespaceError(f"cannot create the directory {path} ({flag}): {exc.strerror}; "
                                 f"give {flag} a directory this user may write") from None

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
        row = self.rank_rows()[r]
        activity = f": {row['activity']}" if row["activity"] else ""
        error = f", last error {row['last_error']}" if row["last_error"] != "OK" else ""
        return (f"rank {r} ({row['state']}{activity}{error}; "
                f"log {self.names.log_path(r, self.log_dir)})")

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every daemon that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]

    def progress(self) -> str:
        assert self.seg is not None
        return ", ".join(f"rank {r} {self.seg.state_of(r).name}" for r in range(self.cfg.tp))

    def rank_rows(self) -> list[dict]:
        """Every rank's :meth:`SignalSegment.rank_snapshot` with its ``activity``."""
        assert self.seg is not None
        rows = [self.seg.rank_snapshot(r) for r in range(self.cfg.tp)]
        for row in rows:
            row["activity"] = rank_activity(rows, row["rank"])
        return rows

    def _failure(self, r: int, what: str) -> NotReady:
        path = self.names.log_path(r, self.log_dir)
        return NotReady(f"rank {r} {what} before READY:\n{error_lines(path, r)}\n(log {path})")

    def wait_ready(self, timeout: float | None = None,
                   on_progress: Callable[[list[dict]], None] | None = None,
                   stop: Callable[[], bool] | None = None,
                   on_log: Callable[[int, str], None] | None = None) -> None:
        """Wait until every rank is READY, or already past it (:data:`SERVED`: an engine
        may pause or clear the namespace between two polls right after READY, and that
        namespace is up and must be supervised).

        Each turn it reads the ranks' new log lines (``on_log(rank, line)`` gets those
        logged at WARNING or above) and states (``on_progress(rows)`` gets
        :meth:`rank_rows`).  Fails fast with :class:`NotReady` naming the rank, its
        error lines and its log if a daemon exits before it served or reports FAILED
        (one that exits after it served is restarted by the supervision); raises
        :class:`RankTimeout` at the deadline and :class:`KvswapError`
        (SHUTTING_DOWN) as soon as ``stop()`` is true."""
        if self.seg is None:
            raise NamespaceError(f"namespace {self.names.namespace!r} is not running: "
                                 f"call start() before wait_ready()")
        timeout = check_seconds(self.cfg.ready_timeout_s if timeout is None else timeout,
                                "wait_ready timeout", positive=True, most=MAX_SECONDS)

        def pass_logs() -> None:
            if on_log is None:
                return
            for r, rank_log in enumerate(self.logs):
                for line in rank_log.new_lines():
                    m = LINE.match(line)
                    if m is not None and m.group(3) in ("WARNING", *_ERROR_LEVELS):
                        on_log(r, f"{m.group(3)} {m.group(5)}")

        def check() -> bool | None:
            pass_logs()
            if stop is not None and stop():
                pass_logs()  # what was logged before the stop, to the last line
                raise KvswapError("interrupted while waiting for READY", ErrorCode.SHUTTING_DOWN)
            for r, rc in self.dead_ranks():
                if self.seg.state_of(r) not in SERVED:  # one that served: the supervisor's
                    raise self._failure(r, f"exited with status {rc}")
            for r in range(self.cfg.tp):
                if self.seg.state_of(r) == RankState.FAILED:
                    raise self._failure(r, "FAILED")
            if on_progress is not None:
                on_progress(self.rank_rows())
            if all(self.seg.state_of(r) in SERVED for r in range(self.cfg.tp)):
                return True
            return None

        if poll_until(check, time.monotonic() + timeout, max_sleep=0.1) is None:
            missing = [r for r in range(self.cfg.tp) if self.seg.state_of(r) not in SERVED]
            raise RankTimeout(f"ranks not READY after {timeout:.1f}s: "
                              + "; ".join(self._describe(r) for r in missing))

    # ------------------------------------------------------------------ supervise
    def _respawn(self, rank: int) -> subprocess.Popen:
        proc = self._spawn(rank)
        self.procs[rank] = proc
        return proc

    def supervise_once(self) -> Teardown | None:
        """One supervision pass (call every ~200 ms once READY): restart dead or silent
        daemons with back-off.  Returns why the namespace must be torn down (a rank is
        FATAL, the engine stopped beating, or a rank stopped on request), else None."""
        assert self.seg is not None
        if self.supervisor is None:
            self.supervisor = Supervisor(self.seg, self.procs, self._respawn,
                                         self.cfg.supervision)
        self.supervisor.step()
        fatal = self.supervisor.fatal()
        if fatal:
            return Teardown("; ".join(
                f"rank {rp.rank} is FATAL after {rp.retries} failed restarts "
                f"(log {self.names.log_path(rp.rank, self.log_dir)})" for rp in fatal), failed=True)
        beat = int(self.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS])
        if beat and self.cfg.engine_timeout_s > 0:
            age = (now_ns() - beat) / 1e9
            if age > self.cfg.engine_timeout_s:
                return Teardown(f"the engine stopped beating {age:.0f}s ago (its workers are "
                                f"gone)", failed=True)
        stopped = [rp.rank for rp in self.supervisor.stopped()]
        if stopped:
            return Teardown(f"rank(s) {', '.join(map(str, stopped))} stopped on request (a "
                            f"client's shutdown(), or SIGTERM/SIGINT sent to the daemon) and "
                            f"the namespace cannot serve without them; to restart a daemon, "
                            f"kill it with SIGKILL instead", failed=False)
        return None

    # ------------------------------------------------------------------ stop
    def _terminate(self, ranks: list[int]) -> None:
        """SIGTERM, which a daemon takes as ``shutdown`` (held from the moment it opens
        its rank until its I/O loop can run the clean stop; before that it has nothing
        to clean and ends at once).  A signal, not a ``shutdown`` message: a message
        needs a ZeroMQ context, whose I/O thread may be what the host ran out of
        (libzmq then aborts the launcher, leaving the namespace), and is lost on a
        daemon that has not bound its socket yet."""
        for r in ranks:
            self.procs[r].send_signal(signal.SIGTERM)

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
        try:
            alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
            if alive:
                self._terminate(alive)
                self._wait_exit(t0 + 0.8 * budget)
        finally:
            # Also when the staged stop was interrupted (a second Ctrl-C or SIGTERM):
            # a later stop() returns at once, so this one must finish the job.
            alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
            if alive:
                log.error("rank(s) %s still running; sending SIGKILL", alive)
                for r in alive:
                    self.procs[r].kill()
                self._wait_exit(t0 + budget + 5.0)
            self._remove(t0)

    def _remove(self, t0: float) -> None:
        """Remove the namespace once its daemons are gone (the end of :meth:`stop`)."""
        assert self.seg is not None
        for r, p in enumerate(self.procs):
            if p.returncode not in (0, None):
                log.warning("rank %d exited with status %s", r, p.returncode)
        self.seg.close()
        self.seg.unlink()
        self.seg = None
        _running.discard(self.names.prefix)
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
