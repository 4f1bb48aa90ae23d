"""Engine-facing contract of kvswap: wire protocol, signal layout, clients, monitor.

Never imports the daemon or cupy at import time.
"""

from importlib.metadata import PackageNotFoundError, version

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
from kvswap.client.transfer_client import TaskResult, TransferClient, TransferFuture, TransferSpec

try:
    __version__ = version("kvswap")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BarrierAborted", "BarrierTimeout", "CacheTensor", "CacheWorker", "ErrorCode", "HostCache",
    "InvalidTask", "KvswapError", "NamespaceError", "NotReady", "PROTOCOL_VERSION",
    "ProtocolError", "RankFailure", "RankRestarted", "RankState", "RankTimeout", "TaskResult",
    "StorageError", "StorageTimeout", "TransferClient", "TransferFailed", "TransferFuture",
    "TransferSpec", "__version__", "block_hashes",
]
