"""HMAC-SHA256 signatures for ``tcp://`` traffic, with replay protection.

``ipc://`` sockets live in the namespace's run dir (mode 0700), so only the
owner can reach them; a ``tcp://`` listener is reachable by anyone who can
route to it, so every message on it carries a signature made with a shared
secret:

    signed message = [mac (32 bytes), header, *id frames]
    mac            = HMAC-SHA256(secret, for each frame: len as u64 LE || bytes)

Length-prefixing each frame makes the split between frames part of what is
signed.  The header of a signed request carries ``ts`` (wall-clock ns); the
daemon refuses a request whose ``ts`` is outside +-``window_s`` of its clock
or whose mac it has already seen inside the window (a replay), so its memory
of past macs is bounded by the request rate times the window.  Replies are
signed the same way and clients drop replies whose mac does not verify.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import stat
import time
from pathlib import Path
from typing import Any, Sequence

from kvswap.client.errors import ErrorCode, KvswapError

MAC_BYTES = 32
MIN_SECRET_BYTES = 16


class AuthFailed(KvswapError):
    default_code = ErrorCode.AUTH_FAILED


def load_secret(path: str | os.PathLike) -> bytes:
    """Read a shared secret; the file must not be readable by group or others."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes().strip()
    except OSError as exc:
        raise AuthFailed(f"cannot read secret file {p}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthFailed(f"secret file {p} is accessible by group or others "
                         f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if len(data) < MIN_SECRET_BYTES:
        raise AuthFailed(f"secret in {p} is shorter than {MIN_SECRET_BYTES} bytes")
    return data


def mac(secret: bytes, frames: Sequence[Any]) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        view = memoryview(f).cast("B")
        h.update(len(view).to_bytes(8, "little"))
        h.update(view)
    return h.digest()


def sign(secret: bytes, frames: Sequence[Any]) -> list:
    return [mac(secret, frames), *frames]


def verify(secret: bytes, frames: Sequence[Any]) -> tuple[bytes, list]:
    """Check and strip the signature: (mac, frames) or :class:`AuthFailed`."""
    if len(frames) < 2 or len(memoryview(frames[0])) != MAC_BYTES:
        raise AuthFailed("unsigned message on a tcp:// listener")
    digest = bytes(memoryview(frames[0]))
    if not hmac.compare_digest(digest, mac(secret, frames[1:])):
        raise AuthFailed("bad signature")
    return digest, list(frames[1:])


class ReplayGuard:
    """Macs seen within the last ``window_s``; a repeat or a stale ``ts`` is refused."""

    def __init__(self, window_s: float = 60.0):
        self.window_ns = int(window_s * 1e9)
        self._seen: set[bytes] = set()
        self._order: collections.deque[tuple[int, bytes]] = collections.deque()

    def check(self, digest: bytes, ts_ns: Any) -> None:
        now = time.time_ns()
        while self._order and self._order[0][0] < now - self.window_ns:
            self._seen.discard(self._order.popleft()[1])
        if not isinstance(ts_ns, int) or isinstance(ts_ns, bool):
            raise AuthFailed("signed request without a 'ts' timestamp")
        if abs(now - ts_ns) > self.window_ns:
            raise AuthFailed(f"request timestamp is {abs(now - ts_ns) / 1e9:.0f}s away from the "
                             f"daemon's clock (window {self.window_ns / 1e9:.0f}s)")
        if digest in self._seen:
            raise AuthFailed("replayed message")
        self._seen.add(digest)
        self._order.append((now, digest))

    def __len__(self) -> int:
        return len(self._seen)
