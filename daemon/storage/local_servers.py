"""Throw-away store servers on free loopback ports, for the tests and for
``kvswap bench storage --redis auto`` / ``--mooncake auto``.

Each runs in a temporary directory of its own, logs to a file there, and is
stopped the same way (:class:`ServerProcess`): woken if a test froze it, asked to
terminate, killed after 10 s; closed, it is killed at once.  :class:`MooncakeMaster` runs ``mooncake_master``
with its HTTP metadata server on (no etcd needed); it imports nothing from
Mooncake, it only needs the program that ``kvswap[mooncake]`` installs (found on
PATH, beside the running Python, or in the ``mooncake`` package), which in turn
needs the system's ``libibverbs1`` even for TCP.  :class:`RedisServer` runs
``redis-server`` without persistence, on a port and a unix socket.
"""

from __future__ import annotations

import abc
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in state T (stopped), from /proc."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread ended
            continue
        if state != "T":
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(abc.ABC):
    """One server program in its own temporary directory, logging to ``<name>.log``
    there; :meth:`start` and :meth:`stop` may alternate (a restart keeps the
    directory, and the ports the subclass chose)."""

    def __init__(self, name: str):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"kvs-{name}-", dir="/tmp")
        self.proc: subprocess.Popen | None = None

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line that starts the server."""

    @abc.abstractmethod
    def answers(self) -> bool:
        """True once the server serves (polled by :meth:`start`)."""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = Path(self.dir, f"{self.name}.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 20.0) -> None:
        """Start the program and wait until it answers; RuntimeError with the end of
        its log if it exits or does not answer within ``timeout``."""
        with open(os.path.join(self.dir, f"{self.name}.log"), "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.dir)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                       f"{self.log()[-2000:]}")
                if self.answers():
                    return
                time.sleep(0.05)
        except BaseException:  # Ctrl-C while it starts: it must not outlive the caller
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {timeout:g} s: "
                           f"{self.log()[-2000:]}")

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP / SIGCONT: a server that accepts connections but answers nothing.

        A freeze returns once every thread of the server has stopped: ``kill`` only
        queues the stop, and each thread takes it when the kernel next schedules it,
        which a busy machine can delay past the next request the caller sends."""
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        if not frozen:
            return
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} (pid {pid}) did not stop within 10 s of SIGSTOP")
            time.sleep(0.001)

    def kill(self) -> None:
        """SIGKILL: the server dies without a word, as in a crash."""
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)  # in case it was left frozen
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        """Throw the server away: killed (it keeps nothing worth a clean exit, and
        ``mooncake_master`` takes a second to end on SIGTERM, once per test that
        starts one), its directory removed."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def find_master() -> str | None:
    """The ``mooncake_master`` program, or None when kvswap[mooncake] is not installed."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found:
        return found
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for where in spec.submodule_search_locations:
            candidate = Path(where) / "mooncake_master"
            if candidate.is_file():
                return str(candidate)
    return None


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` on 127.0.0.1: RPC, HTTP metadata and metrics on free ports,
    kept across :meth:`stop` / :meth:`start` (a restart is the same master address)."""

    def __init__(self, binary: str):
        super().__init__("mooncake_master")
        self.binary = binary
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()

    def url(self, **options: object) -> str:
        """A ``mooncake://`` URL of this master; ``options`` are more URL options."""
        query = "&".join([f"metadata=http://127.0.0.1:{self.metadata_port}/metadata",
                          *(f"{k}={v}" for k, v in options.items())])
        return f"mooncake://127.0.0.1:{self.port}?{query}"

    def argv(self) -> list[str]:
        return [self.binary, f"--port={self.port}", "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--metrics_port={self.metrics_port}", "--logtostderr"]

    def answers(self) -> bool:
        return _accepts(self.port) and _accepts(self.metadata_port)


class RedisServer(ServerProcess):
    """``redis-server`` on a free loopback port and a unix socket, without persistence."""

    def __init__(self, binary: str):
        super().__init__("redis-server")
        self.binary = binary
        self.socket = os.path.join(self.dir, "redis.sock")
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--unixsocket", self.socket,
                "--unixsocketperm", "700"]

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

