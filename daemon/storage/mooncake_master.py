"""A throw-away ``mooncake_master`` on free loopback ports, for the tests and for
``kvswap bench storage --mooncake auto``.

It runs with its HTTP metadata server on (no etcd needed) and logs to a file in
its own temporary directory.  It imports nothing from Mooncake: it only needs
the ``mooncake_master`` program that ``kvswap[mooncake]`` installs (found on
PATH, beside the running Python, or in the ``mooncake`` package), which in
turn needs the system's ``libibverbs1`` even for TCP.
"""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1: RPC, HTTP metadata and metrics on free ports,
    kept across :meth:`stop` / :meth:`start` (a restart is the same master address)."""

    def __init__(self, binary: str):
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="kvs-mooncake-", dir="/tmp")
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, **options: object) -> str:
        """A ``mooncake://`` URL of this master; ``options`` are more URL options."""
        query = "&".join([f"metadata=http://127.0.0.1:{self.metadata_port}/metadata",
                          *(f"{k}={v}" for k, v in options.items())])
        return f"mooncake://127.0.0.1:{self.port}?{query}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = Path(self.dir, "master.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 20.0) -> None:
        """Start and wait until both the RPC and the metadata port accept connections."""
        with open(os.path.join(self.dir, "master.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--port={self.port}", "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.metadata_port}",
                 f"--metrics_port={self.metrics_port}", "--logtostderr"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: "
                                   f"{self.log()[-2000:]}")
            if _accepts(self.port) and _accepts(self.metadata_port):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen within {timeout:g} s: "
                           f"{self.log()[-2000:]}")

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP / SIGCONT: a master that accepts connections but answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the master dies without a word, as in a crash."""
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
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
