"""Engine-facing contract of kvswap: wire protocol, signal layout, clients, monitor.

Never imports the daemon or cupy at import time.  The names below are imported on
first use (PEP 562): every daemon, launcher and CLI process imports this package
for the protocol and the signal layout, and the engine-side classes (the clients,
the host cache) and the package's version lookup are a tenth of a second of a
daemon's start that it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvswap.client.block_keys import block_hashes
    from kvswap.client.cache_worker import CacheTensor, CacheWorker
    from kvswap.client.errors import (
        BarrierAborted,
        BarrierTimeout,
        ErrorCode,
        InvalidTask,
        KvswapError,
        NamespaceError,
        NotReady,
        ProtocolError,
        RankFailure,
        RankRestarted,
        RankTimeout,
        StorageError,
        StorageTimeout,
        TransferFailed,
    )
    from kvswap.client.host_cache import HostCache
    from kvswap.client.protocol import PROTOCOL_VERSION
    from kvswap.client.signals import RankState
    from kvswap.client.transfer_client import (
        TaskResult,
        TransferClient,
        TransferFuture,
        TransferSpec,
    )

# public name -> the module of this package that defines it
_WHERE = {
    "block_hashes": "block_keys",
    "CacheTensor": "cache_worker", "CacheWorker": "cache_worker",
    **{name: "errors" for name in (
        "BarrierAborted", "BarrierTimeout", "ErrorCode", "InvalidTask", "KvswapError",
        "NamespaceError", "NotReady", "ProtocolError", "RankFailure", "RankRestarted",
        "RankTimeout", "StorageError", "StorageTimeout", "TransferFailed")},
    "HostCache": "host_cache",
    "PROTOCOL_VERSION": "protocol",
    "RankState": "signals",
    **{name: "transfer_client" for name in (
        "TaskResult", "TransferClient", "TransferFuture", "TransferSpec")},
}

__all__ = [
    "BarrierAborted", "BarrierTimeout", "CacheTensor", "CacheWorker", "ErrorCode", "HostCache",
    "InvalidTask", "KvswapError", "NamespaceError", "NotReady", "PROTOCOL_VERSION",
    "ProtocolError", "RankFailure", "RankRestarted", "RankState", "RankTimeout", "TaskResult",
    "StorageError", "StorageTimeout", "TransferClient", "TransferFailed", "TransferFuture",
    "TransferSpec", "__version__", "block_hashes",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvswap")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _WHERE:
        value = getattr(importlib.import_module(f"kvswap.client.{_WHERE[name]}"), name)
    else:  # a submodule (kvswap.client.protocol.MAX_HEADER_BYTES after `import kvswap.client`)
        try:
            value = importlib.import_module(f"kvswap.client.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvswap.client.{name}":
                raise
            raise AttributeError(f"module 'kvswap.client' has no attribute {name!r}") from None
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
