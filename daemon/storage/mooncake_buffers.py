"""Memory the Mooncake Store backend hands to the store: addresses of buffers, the
registered regions by role, the backend's own registered bounce area, and what is
kept until the process exits because a client that may still use it was not closed."""

from __future__ import annotations

import bisect
import ctypes

import numpy as np

from kvswap.daemon.storage import Buffer, as_byte_views

def address(buf: Buffer) -> tuple[int, int]:
    """(address, length) of a C-contiguous buffer, without keeping an export of it
    (holding one would stop the owner from unmapping it)."""
    view = as_byte_views([buf])[0]
    try:
        if view.nbytes == 0:
            return 0, 0
        return int(np.frombuffer(view, np.uint8).ctypes.data), view.nbytes
    finally:
        view.release()


class Regions:
    """Registered address ranges by role, for "is this part in registered memory?"."""

    def __init__(self) -> None:
        self._by_role: dict[str, list[tuple[int, int]]] = {}
        self._starts: list[int] = []
        self._spans: list[tuple[int, int]] = []

    def set(self, role: str, spans: list[tuple[int, int]]) -> None:
        if spans:
            self._by_role[role] = spans
        else:
            self._by_role.pop(role, None)
        self._spans = sorted(s for spans_ in self._by_role.values() for s in spans_)
        self._starts = [a for a, _ in self._spans]

    def all(self) -> list[tuple[int, int]]:
        return list(self._spans)

    def covers(self, addr: int, size: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + size <= self._spans[i][0] + self._spans[i][1]


class Bounce:
    """A registered area of the backend's own, for entry headers and any part that is
    not in registered memory; grows by doubling (re-registered when it does)."""

    def __init__(self) -> None:
        self.array = np.empty(0, np.uint8)

    def reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True if the area moved (register it again)."""
        if nbytes <= self.array.nbytes:
            return False
        self.array = np.empty(max(nbytes, 2 * self.array.nbytes, 64 << 10), np.uint8)
        return True


_KEPT: list[object] = []


def keep_until_exit(*objects: object) -> None:
    """Keep ``objects`` (a backend, its store client) alive until the process ends, even
    while the interpreter finalizes (which empties module globals: hence the reference
    leaked on purpose).  Their release would run the client's teardown wherever it
    happened, holding the GIL as long as the master makes it wait, and free the bounce
    area, which a call stuck in the client may still read.  Mooncake's own exit handler
    tears the client down after the interpreter; ``os._exit`` skips that."""
    kept = tuple(objects)
    _KEPT.append(kept)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def kept_until_exit() -> bool:
    """Whether :func:`keep_until_exit` kept anything: the daemon then ends with
    ``os._exit`` (daemon/main.py), past the library's exit handler."""
    return bool(_KEPT)
