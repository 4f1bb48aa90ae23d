"""Names of everything a namespace owns: shm segments, semaphores, run dir, sockets.

One engine instance is one *namespace*.  Every POSIX object it owns is called
``/kvswap.<ns>.<what>`` and every file lives under ``<run_root>/<ns>/`` (mode
0700), so two namespaces on one node never collide and teardown can find all
of them by name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvswap.client.errors import NamespaceError

_NS_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
NAMESPACE_RULE = "1-40 characters from [A-Za-z0-9_-]"
_TENSOR_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107
SHM_PREFIX = "kvswap."


def default_run_root() -> Path:
    """``$KVSWAP_RUN_ROOT``, else ``$XDG_RUNTIME_DIR/kvswap``, else ``/tmp/kvswap-<uid>``."""
    env = os.environ.get("KVSWAP_RUN_ROOT")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvswap"
    return Path(f"/tmp/kvswap-{os.getuid()}")


def tcp_endpoints(spec: str, tp: int) -> list[str]:
    """``HOST:BASEPORT`` -> one tcp:// endpoint per rank (BASEPORT + rank)."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535 - tp:
        raise ValueError(f"tcp listen address must be HOST:BASEPORT, got {spec!r}")
    return [f"tcp://{host}:{int(port) + r}" for r in range(tp)]


def is_valid_namespace(namespace: object) -> bool:
    """Whether ``namespace`` can name a namespace (:data:`NAMESPACE_RULE`)."""
    return isinstance(namespace, str) and _NS_RE.match(namespace) is not None


def check_tensor_name(name: str) -> str:
    if not isinstance(name, str) or not _TENSOR_RE.match(name):
        raise ValueError(
            f"invalid tensor name {name!r}: use 1-64 characters from [A-Za-z0-9_.-]"
        )
    return name


@dataclass(frozen=True)
class Names:
    """All names of one namespace, derived from its name and run root."""

    namespace: str
    run_root: Path

    @classmethod
    def of(cls, namespace: str, run_root: str | os.PathLike | None = None) -> "Names":
        if not is_valid_namespace(namespace):
            raise NamespaceError(f"invalid namespace {namespace!r}: use {NAMESPACE_RULE}")
        root = Path(run_root) if run_root is not None else default_run_root()
        names = cls(namespace, root.absolute())
        longest = names.endpoint_path(9999)
        if len(str(longest)) > _MAX_IPC_PATH:
            raise NamespaceError(
                f"run dir {names.run_dir} is too long for an ipc:// socket path "
                f"({len(str(longest))} > {_MAX_IPC_PATH} bytes); choose a shorter --run-root"
            )
        return names

    @property
    def prefix(self) -> str:
        """Prefix of every shm segment and semaphore name, without the leading '/'."""
        return f"{SHM_PREFIX}{self.namespace}."

    @property
    def signals(self) -> str:
        return f"/{self.prefix}signals"

    def wake_sem(self, rank: int) -> str:
        return f"/{self.prefix}wake.r{rank}"

    def layer_sem(self, rank: int) -> str:
        """Posted by the rank's daemon after each layer of a layer-wise load."""
        return f"/{self.prefix}layer.r{rank}"

    def swap_segment(self, rank: int) -> str:
        return f"/{self.prefix}swap.r{rank}"

    def journal_segment(self, rank: int) -> str:
        """The rank's completion journal (``kvswap.daemon.journal``); outlives a crash."""
        return f"/{self.prefix}journal.r{rank}"

    def ring_segment(self, rank: int) -> str:
        """The rank's request and completion rings (``kvswap.client.rings``)."""
        return f"/{self.prefix}ring.r{rank}"

    def ring_bell(self, rank: int, ring: str) -> Path:
        """The doorbell FIFO of one of the rank's rings (``ring`` is "rq" or "cq")."""
        return self.run_dir / f"rank{rank}.{ring}.bell"

    def device_segment(self, rank: int, tensor: str) -> str:
        """Host-backend simulated GPU tensor of ``rank`` called ``tensor``."""
        return f"/{self.prefix}dev.r{rank}.{check_tensor_name(tensor)}"

    @property
    def host_cache(self) -> str:
        """Host-tier statistics published by the engine's HostCache (host_cache_stats)."""
        return f"/{self.prefix}hostcache"

    @property
    def host_cache_index(self) -> str:
        """A HostCache's persisted index (host_cache_persist), kept across engine restarts."""
        return f"/{self.prefix}hcindex"

    @property
    def run_dir(self) -> Path:
        return self.run_root / self.namespace

    def endpoint_path(self, rank: int) -> Path:
        return self.run_dir / f"rank{rank}.sock"

    def endpoint(self, rank: int) -> str:
        return f"ipc://{self.endpoint_path(rank)}"

    def log_path(self, rank: int, log_dir: Path | None = None) -> Path:
        return (log_dir or self.run_dir) / f"rank{rank}.log"

    def owned_shm(self) -> list[str]:
        """Names (without '/') of every shm segment in /dev/shm that belongs to this namespace."""
        try:
            entries = os.listdir("/dev/shm")
        except FileNotFoundError:
            return []
        # posix_ipc semaphores appear as 'sem.<name>' in /dev/shm on Linux.
        return sorted(
            e for e in entries if e.startswith(self.prefix) or e.startswith("sem." + self.prefix)
        )
