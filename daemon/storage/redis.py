"""Storage backend on Redis or Valkey (redis-py; install ``kvswap[redis]``); URL schemes
``redis://``, ``rediss://`` and ``unix://`` (registered in :data:`kvswap.daemon.storage.BACKENDS`).

One Redis string per entry (the packed entry: header and payload joined once per
put).  Every call is one round trip for the whole batch: a non-transactional
pipeline of ``SET name value NX [EX ttl]`` for ``put`` (MSETNX would refuse the
whole batch when one name exists; NX per key skips just that one), ``MGET`` for
``get``, a pipeline of ``TYPE`` for ``contains`` (a name holds an entry only if it
holds a string) and ``UNLINK`` for ``delete`` (frees large values off Redis's main
thread).

A value of another type under an entry name (a list, a hash: another program's
key, an operator's mistake) is not an entry.  ``MGET`` answers nil for it, as for
a missing name, so ``get`` asks ``TYPE`` about the names that came back nil (a
second round trip only when a batch has a miss; hits cost what they did) and
returns :class:`~kvswap.daemon.storage.NotAnEntry` for those that hold something:
the daemon then reports it once and deletes it like any damaged entry, so the
block can be backed up again.  Before, it was a silent miss for ever (``EXISTS``
counted it, so every backup skipped the name).  A name that became a string
between the two calls was written meanwhile: a miss, as ``MGET`` saw it.
``contains`` counts strings only, so ``exists`` agrees with what a prefetch loads.
Large puts are cut into pipelines of at most ``PIPELINE_BYTES`` so that a batch
never sits in memory twice over.

Failures: a connection error (refused, reset, the server restarted) is retried
with exponential backoff, on a fresh connection, up to ``retries`` times and
never past ``timeout_s`` from the start of the call, then raised as
StorageError; a server that accepts but does not answer for ``timeout_s``
(socket timeout) raises StorageTimeout at once (no retry: retrying would double
the wait); an error reply (out of memory, read-only replica) raises
StorageError.  redis-py's own retries are off so that these bounds hold.  A
broken connection is dropped and the next call reconnects.

A single Redis/Valkey server (or a proxy that speaks to one) is supported; a
Redis Cluster is not (``MGET`` across hash slots).
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Callable, Sequence, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvswap.daemon.storage import (
    Buffer,
    NotAnEntry,
    Stored,
    StorageError,
    StorageTimeout,
    as_byte_views,
    check_names,
)
from kvswap.daemon.storage.url_options import parse_count, parse_seconds, url_options

PIPELINE_BYTES = 64 << 20  # values per put pipeline (a single entry may exceed it)
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 1.0
_SOCKET_READ_SIZE = 1 << 20  # fewer recv calls for multi-MB values than redis-py's 64 KiB

MAX_DB = 2**31 - 1
"""The highest database number: Redis numbers its databases with a C int (its
``databases`` setting is at most 2147483647), so no higher one can ever be selected."""
MAX_TTL_S = 10**15
"""The longest ``ttl_s`` (31 million years): Redis refuses an expiry whose milliseconds
since 1970 overflow a 64-bit integer (from about 9.2e15 s), failing every put."""
CERT_REQS = ("none", "optional", "required")  # redis-py's names for ssl.VerifyMode


def _parse_db(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_DB:
        raise ValueError(f"want a database number from 0 to {MAX_DB}: Redis numbers its "
                         "databases with a 32-bit int, so no higher one can be selected")
    return int(text)


def _parse_ttl(text: str) -> int:
    ttl = parse_count(text)
    if ttl > MAX_TTL_S:
        raise ValueError(f"want at most {MAX_TTL_S} seconds: Redis refuses a longer expiry, "
                         "so every put would fail")
    return ttl


def _parse_cert_reqs(text: str) -> str:
    if text not in CERT_REQS:
        raise ValueError(f"want one of {', '.join(CERT_REQS)}")
    return text


# Our options: parsed and removed from the URL before redis-py sees it.
_OPTIONS: dict[str, Callable[[str], float | int]] = {
    "timeout_s": parse_seconds,
    "connect_timeout_s": parse_seconds,
    "retries": parse_count,
    "max_connections": parse_count,
    "ttl_s": _parse_ttl,
    "db": _parse_db,
}
# redis-py's TLS options, checked here and handed to it for rediss:// (redis-py passes
# them to a plain connection too, which then fails every call with a TypeError).
_TLS: dict[str, Callable[[str], str]] = {
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": _parse_cert_reqs,
}

T = TypeVar("T")


class RedisBackend:
    """Entries in one Redis database; see the module docstring.

    Thread-safe: redis-py's connection pool hands each concurrent call its own
    connection (at most ``max_connections``).
    """

    def __init__(self, pool: redis.ConnectionPool, where: str, *, timeout_s: float = 5.0,
                 retries: int = 3, ttl_s: int = 0):
        self._client = redis.Redis(connection_pool=pool)
        self._pool = pool
        self.where = where
        self.timeout_s = timeout_s
        self.retries = retries
        self.ttl_s = ttl_s
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> "RedisBackend":
        """``redis://[[user]:password@]host:port/db``, ``rediss://...`` (TLS) or
        ``unix:///path/redis.sock?db=N``, with the options of docs/storage.md."""
        parts = urllib.parse.urlsplit(url)
        unix = parts.scheme == "unix"
        if not unix and not parts.hostname:
            raise ValueError(f"storage URL {url!r}: no host (want redis://host:port/db)")
        if unix and not parts.path:
            raise ValueError(f"storage URL {url!r}: no socket path (want unix:///path/sock)")
        try:
            port = parts.port  # the property raises ValueError for a malformed port
        except ValueError as exc:
            raise ValueError(f"storage URL {url!r}: {exc}") from None
        if port == 0 and not unix:
            raise ValueError(f"storage URL {url!r}: port 0 is no server's port (redis-py "
                             "would quietly use 6379): give the server's port, or none for "
                             "6379")
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        tls_keys = sorted({k for k, _ in query if k in _TLS})
        if tls_keys and parts.scheme != "rediss":
            raise ValueError(f"storage URL {url!r}: {', '.join(tls_keys)} "
                             f"{'is a TLS option' if len(tls_keys) == 1 else 'are TLS options'}"
                             f", and only rediss:// connects with TLS: write rediss://... to "
                             f"use TLS, or drop the option")
        opts = url_options(url, parts.query, {**_OPTIONS, **_TLS})
        tls = {k: str(opts.pop(k)) for k in _TLS if k in opts}
        if not unix and parts.path not in ("", "/"):
            try:
                path_db = _parse_db(parts.path.lstrip("/"))
            except ValueError as exc:
                raise ValueError(f"storage URL {url!r}: the path must be a database "
                                 f"number: {exc}") from None
            if "db" in opts:
                raise ValueError(f"storage URL {url!r}: the database is given twice, as the "
                                 f"path and as option db: give one")
            opts["db"] = path_db
        db = int(opts.get("db", 0))
        timeout_s = float(opts.get("timeout_s", 5.0))
        # Not urlunsplit: it would drop the empty host of unix:///path.  The db goes as
        # a keyword (redis-py would take one in the URL over it).
        rest = f"?{urllib.parse.urlencode(tls)}" if tls else ""
        pool = redis.ConnectionPool.from_url(
            f"{parts.scheme}://{parts.netloc}{parts.path if unix else ''}{rest}",
            db=db,
            socket_timeout=timeout_s,
            socket_connect_timeout=float(opts.get("connect_timeout_s", timeout_s)),
            **({} if unix else {"socket_keepalive": True}),
            socket_read_size=_SOCKET_READ_SIZE,
            retry=Retry(NoBackoff(), 0),
            max_connections=int(opts.get("max_connections", 0)) or None,
        )
        host = parts.path if unix else parts.netloc.rpartition("@")[2]
        return cls(pool, f"{parts.scheme}://{host} db {db}", timeout_s=timeout_s,
                   retries=int(opts.get("retries", 3)), ttl_s=int(opts.get("ttl_s", 0)))

    @classmethod
    def check_url(cls, url: str) -> None:
        """:meth:`from_url`'s ValueErrors: opening connects lazily, so this parses the
        URL and builds the connection pool, then closes it, without connecting."""
        cls.from_url(url).close()

    def __repr__(self) -> str:
        return f"RedisBackend({self.where})"  # never the URL: it may hold a password

    def _check(self, names: Sequence[str]) -> None:
        if self._closed:
            raise StorageError(f"redis storage {self.where}: backend is closed")
        check_names(names)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one round trip) under the retry and timeout rules of the module."""
        deadline = time.monotonic() + self.timeout_s
        failures = 0
        while True:
            try:
                return fn()
            except redis.TimeoutError as exc:
                raise StorageTimeout(f"redis storage {self.where}: {what} got no answer within "
                                     f"{self.timeout_s:g} s: {exc}") from exc
            except redis.ConnectionError as exc:
                failures += 1
                delay = min(_BACKOFF_BASE_S * 2 ** (failures - 1), _BACKOFF_CAP_S)
                if failures > self.retries or time.monotonic() + delay >= deadline:
                    raise StorageError(f"redis storage {self.where}: {what} failed after "
                                       f"{failures} attempt(s): {exc}") from exc
                time.sleep(delay)
            except redis.RedisError as exc:
                raise StorageError(f"redis storage {self.where}: {what}: {exc}") from exc

    def _pipeline(self) -> redis.client.Pipeline:
        return self._client.pipeline(transaction=False)

    # ------------------------------------------------------------ interface

    def contains(self, names: Sequence[str]) -> list[bool]:
        self._check(names)
        if not names:
            return []

        def run() -> list[bool]:
            return [t == b"string" for t in self._types(names)]

        return self._call(f"contains ({len(names)} names)", run)

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self._check([name for name, _ in items])
        views = [as_byte_views(parts) for _, parts in items]  # all checked before any is sent
        stored: list[bool] = []
        batch: list[tuple[str, bytes]] = []
        batch_bytes = 0

        def flush() -> None:
            def run() -> list[bool]:
                pipe = self._pipeline()
                for name, value in batch:
                    pipe.set(name, value, nx=True, ex=self.ttl_s or None)
                # SET NX answers True when set, None when the name existed.  After a
                # reconnect, an entry this call already stored reads as existing.
                return [r is True for r in pipe.execute()]

            stored.extend(self._call(f"put ({len(batch)} entries)", run))
            batch.clear()

        for (name, _), entry in zip(items, views):
            value = b"".join(entry)
            batch.append((name, value))
            batch_bytes += len(value)
            if batch_bytes >= PIPELINE_BYTES:
                flush()
                batch_bytes = 0
        if batch:
            flush()
        return stored

    def get(self, names: Sequence[str],
            into: Sequence[memoryview] | None = None) -> list[Stored | NotAnEntry | None]:
        # `into` is ignored: redis-py returns each value as a new bytes object.
        self._check(names)
        if not names:
            return []
        # Values are bytes: the pool does not decode responses.
        got = self._call(f"get ({len(names)} names)",
                         lambda: cast("list[Stored | NotAnEntry | None]",
                                      self._client.mget(names)))
        nil = [i for i, v in enumerate(got) if v is None]
        if nil:
            types = self._call(f"type ({len(nil)} names)",
                               lambda: self._types([names[i] for i in nil]))
            for i, kind in zip(nil, types):
                if kind not in (b"none", b"string"):  # string: written since the MGET
                    got[i] = NotAnEntry(f"a Redis {kind.decode(errors='replace')} value, "
                                        f"not a string")
        return got

    def _types(self, names: Sequence[str]) -> list[bytes]:
        """``TYPE`` of each name, in one pipeline (b"none" for a missing one)."""
        pipe = self._pipeline()
        for name in names:
            pipe.type(name)
        return [t if isinstance(t, bytes) else str(t).encode() for t in pipe.execute()]

    def delete(self, names: Sequence[str]) -> None:
        self._check(names)
        if names:
            self._call(f"delete ({len(names)} names)", lambda: self._client.unlink(*names))

    def register_buffers(self, role: str, buffers: Sequence[Buffer]) -> None:
        """Nothing to do: plain reads and writes need no registered memory."""

    def close(self) -> None:
        self._closed = True
        self._pool.disconnect()
