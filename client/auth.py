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

import hashlib
import hmac
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvswap.client.errors import ErrorCode, KvswapError

MAC_BYTES = 32
_SECOND_NS = 10**9  # the replay guard forgets a second's macs at once
MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 64 << 10


class AuthFailed(KvswapError):
    default_code = ErrorCode.AUTH_FAILED


def load_secret(path: str | os.PathLike) -> bytes:
    """Read a shared secret; the file must be a regular file of at most
    :data:`MAX_SECRET_FILE_BYTES`, not readable by group or others.  Checked before
    it is read: a FIFO would block the read for ever and ``/dev/zero`` never end it."""
    p = Path(path)
    try:
        # One open, and every check on what it opened (a path checked and then read
        # could be swapped in between); O_NONBLOCK so that opening a FIFO cannot block.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_FILE_BYTES:
                raise AuthFailed(f"secret file {p} is not a regular file of at most "
                                 f"{MAX_SECRET_FILE_BYTES} bytes; write the secret into a file "
                                 f"of its own (e.g. head -c 32 /dev/urandom > F; chmod 600 F)")
            mode = st.st_mode
            data = os.read(fd, MAX_SECRET_FILE_BYTES).strip()
        finally:
            os.close(fd)
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
    """Macs seen within the window; a repeat or a stale ``ts`` is refused.

    A mac is remembered until its ``ts`` leaves the window, not for a window after
    it arrived: a request stamped ahead of the daemon's clock (a client's clock runs
    fast) passes the ``ts`` check until ``ts + window``, and so could be replayed
    after an arrival-based memory forgot it.

    The memory is the signed request rate times about the window, so a mac is kept
    small: the int of its first 8 bytes, in a set and in the list of the second it
    expires in, about 80 bytes (the mac's bytes, a tuple and two deque slots took
    200: tracemalloc over 60,000 macs).  Two fresh macs share a prefix with a chance
    of 2**-64 (the later request is refused, as a replay), and making a mac with a
    chosen prefix takes the secret.  ``clock``: wall-clock ns (tests pass their own).

    The memory dies with the daemon, so a restarted daemon (or a relaunched
    namespace) would take a replay of what its predecessor received inside the
    window.  ``not_before_ns`` closes that: the daemon's start, before which no
    request to it was signed (a client re-sends with a fresh ``ts``), so an older
    ``ts`` is refused.  The cost is a client clock behind the daemon's by more than
    a daemon's start-up (half a second and more: journal, attach): its first
    requests after a restart are refused too, and their tasks time out.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], int] = time.time_ns,
                 not_before_ns: int = 0):
        self.window_ns = int(window_s * 1e9)
        self._clock = clock
        self.not_before_ns = not_before_ns  # the daemon's start: older is an earlier one's
        self._seen: set[int] = set()
        self._expiring: dict[int, list[int]] = {}  # second it may be forgotten -> prefixes
        self._swept = clock() // _SECOND_NS  # seconds up to this one are forgotten

    def check(self, digest: bytes, ts_ns: Any) -> None:
        now = self._clock()
        self._forget(now // _SECOND_NS)
        if not isinstance(ts_ns, int) or isinstance(ts_ns, bool):
            raise AuthFailed("signed request without a 'ts' timestamp")
        if abs(now - ts_ns) > self.window_ns:
            raise AuthFailed(f"request timestamp is {abs(now - ts_ns) / 1e9:.0f}s away from the "
                             f"daemon's clock (window {self.window_ns / 1e9:.0f}s)")
        if ts_ns < self.not_before_ns:
            raise AuthFailed(f"request signed {(self.not_before_ns - ts_ns) / 1e9:.3f}s before "
                             f"this daemon started: a replay of traffic to an earlier daemon "
                             f"of this rank, whose replay memory died with it (or a client "
                             f"clock behind the daemon's: keep clocks in sync, e.g. NTP)")
        key = int.from_bytes(digest[:8], "little")
        if key in self._seen:
            raise AuthFailed("replayed message")
        self._seen.add(key)
        # forgotten in the first second that starts after ts + window
        self._expiring.setdefault((ts_ns + self.window_ns) // _SECOND_NS + 1, []).append(key)

    def _forget(self, second: int) -> None:
        """Drop the macs whose ``ts`` left the window by the start of ``second``."""
        if second <= self._swept:
            return
        for s in [s for s in self._expiring if s <= second]:  # a few hundred keys at most
            self._seen.difference_update(self._expiring.pop(s))
        self._swept = second

    def __len__(self) -> int:
        return len(self._seen)
