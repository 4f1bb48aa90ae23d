"""The storage tier behind host swap space: entry format, backend interface, backends.

This package's core (this module) owns what every backend shares: the entry
format, the :class:`StorageBackend` interface and :func:`open_backend`, which
picks a backend by the URL's scheme from :data:`BACKENDS` (the URL options'
parsers are :mod:`.url_options`).  Each backend is a module of the package (:mod:`.file`,
:mod:`.redis`) that imports from this core and never the other way round: the
core names a backend's module as a string and imports it only when a URL asks
for it, so a backend whose client library is not installed costs nothing until
it is used, and no import cycle exists.  A new backend (Mooncake, S3) is one
module plus one :class:`BackendEntry` line in :data:`BACKENDS`.

An **entry** is one rank's copy of one block: a fixed 52-byte header followed by
the payload, which is that block of every tensor of the rank concatenated in
registration order.  Entries are stored under names from
:func:`kvswap.client.block_keys.entry_name` by a :class:`StorageBackend`, which
treats them as opaque bytes; everything that decides whether stored bytes may be
used (magic, version, model fingerprint, length, checksums) lives here, in
:func:`unpack_entry`, so a new backend cannot get it wrong.

Header (little-endian)::

    off  size  field
      0     8  magic            b"KVSWAPEN"
      8     4  version          u32, 3
     12     4  flags            u32, 0 (a v3 reader rejects any other value)
     16    16  fingerprint      model_fingerprint() of the writer
     32     8  payload_len      u64
     40     8  payload_xxh3     XXH3-64 of the payload, seeded with XXH3-64 of the name
     48     4  header_crc32     zlib.crc32 of bytes 0..47

The seed binds an entry to the name it was written under: the fingerprint names
the model and layout, not the block, and a rank's layout is often every rank's,
so an entry copied or renamed under another key's or another rank's name would
pass every other check and load one block's bytes as another's (format version
2 had no seed).

The checksums guard against accidental damage (torn writes after a power loss,
bit rot, a truncated transfer), not against an adversary who can write to the
store.  Every block is checksummed on every backup and every prefetch, so the
payload checksum must run near memory speed: XXH3-64 hashes about 23 GB/s
here, CRC-32 (zlib, format version 1) about 2.2 GB/s, which made the checksum
the largest cost of a prefetch (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import re
import struct
import urllib.parse
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, Union

import xxhash

from kvswap.client.block_keys import FINGERPRINT_BYTES
from kvswap.client.errors import StorageError, StorageTimeout

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BACKENDS", "BackendEntry", "Buffer", "CorruptEntry", "ENTRY_MAGIC", "ENTRY_VERSION",
    "HEADER_BYTES", "NotAnEntry", "StorageBackend", "Stored", "StorageError",
    "StorageTimeout", "as_byte_views", "check_names", "check_url", "open_backend",
    "pack_entry", "registered_schemes", "unpack_entry",
]

Buffer = Union[bytes, bytearray, memoryview, "np.ndarray"]
"""Anything C-contiguous with the buffer protocol (a host block is a numpy uint8 row)."""

Stored = Union[bytes, bytearray, memoryview]
"""What ``get`` returns for a hit: the entry's bytes, in whatever buffer the backend read."""

ENTRY_MAGIC = b"KVSWAPEN"
ENTRY_VERSION = 3
_HEADER = struct.Struct("<8sII16sQQ")  # everything up to the header checksum
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 52


class CorruptEntry(Exception):
    """Stored bytes that must not be used; ``reason`` says why.

    Not a :class:`StorageError`: the backend worked, this one entry is bad.  The
    caller treats it as a miss and may delete the entry.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class NotAnEntry:
    """``get``'s answer for a name holding what cannot be an entry, told without reading
    it all (a Redis non-string, a Mooncake object longer than its buffer):
    :func:`unpack_entry` rejects it, so it is deleted like any damaged entry (a miss
    never deleted would block its block for good: a backup skips an existing name)."""

    reason: str


def as_byte_views(parts: Sequence[Buffer]) -> list[memoryview]:
    """Flat unsigned-byte views of ``parts`` (no copy); ValueError for a non-contiguous one."""
    views = []
    for i, part in enumerate(parts):
        # ndarray exports the buffer protocol; its type stubs do not say so.
        view = memoryview(part)  # type: ignore[arg-type]
        if not view.c_contiguous:
            raise ValueError(f"entry part {i} is not C-contiguous")
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def _check_fingerprint(fingerprint: bytes) -> None:
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes "
                         f"(model_fingerprint()), got {fingerprint!r}")


def _seed(name: str) -> int:
    """The payload checksum's seed: the entry's name (see the header above)."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8"))


def pack_entry(fingerprint: bytes, name: str, parts: Sequence[Buffer]
               ) -> list[bytes | memoryview]:
    """The entry stored as ``name`` for one block: ``[header, *parts]`` with the parts
    as zero-copy views.

    The parts are read twice (checksum now, write later by the backend): the
    caller must not change them until the backend's ``put`` returns.  If it does,
    the stored checksum no longer matches and :func:`unpack_entry` rejects the
    entry, so a race costs a miss, never wrong data.
    """
    _check_fingerprint(fingerprint)
    views = as_byte_views(parts)
    digest = xxhash.xxh3_64(seed=_seed(name))
    length = 0
    for view in views:
        digest.update(view)
        length += view.nbytes
    head = _HEADER.pack(ENTRY_MAGIC, ENTRY_VERSION, 0, fingerprint, length,
                        digest.intdigest())
    return [head + _HEADER_CRC.pack(zlib.crc32(head)), *views]


def unpack_entry(raw: "Buffer | NotAnEntry", fingerprint: bytes, name: str,
                 expected_payload_len: int) -> memoryview:
    """The payload of ``raw``, read as ``name`` (a view, no copy), after checking
    everything; else CorruptEntry (always, for a :class:`NotAnEntry`).

    ``expected_payload_len`` is the sum of the rank's bytes per block: a stored
    entry of another length belongs to another layout, whatever its header says.
    """
    _check_fingerprint(fingerprint)
    if isinstance(raw, NotAnEntry):
        raise CorruptEntry(raw.reason)
    view = as_byte_views([raw])[0]
    if len(view) < HEADER_BYTES:
        raise CorruptEntry(f"truncated: {len(view)} bytes, the header alone needs {HEADER_BYTES}")
    magic, version, flags, stored_fp, length, payload_sum = _HEADER.unpack_from(view)
    if magic != ENTRY_MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}, expected {ENTRY_MAGIC!r}")
    if version != ENTRY_VERSION:
        raise CorruptEntry(f"format version {version}, this reader knows {ENTRY_VERSION}")
    (header_crc,) = _HEADER_CRC.unpack_from(view, _HEADER.size)
    if zlib.crc32(view[:_HEADER.size]) != header_crc:
        raise CorruptEntry("header checksum mismatch")
    if flags != 0:
        raise CorruptEntry(f"unsupported flags {flags:#x}")
    if stored_fp != fingerprint:
        raise CorruptEntry(f"foreign fingerprint {stored_fp.hex()}, expected {fingerprint.hex()}")
    if length != expected_payload_len:
        raise CorruptEntry(f"payload length {length} in the header, expected "
                           f"{expected_payload_len}")
    if len(view) != HEADER_BYTES + length:
        what = "truncated" if len(view) < HEADER_BYTES + length else "trailing bytes"
        raise CorruptEntry(f"{what}: {len(view) - HEADER_BYTES} payload bytes stored, "
                           f"the header says {length}")
    payload = view[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload, seed=_seed(name)) != payload_sum:
        raise CorruptEntry("payload checksum mismatch: damaged, or written under another "
                           "name (another block's key, rank or part)")
    return payload


# ------------------------------------------------------------------ backends

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


def check_names(names: Sequence[str]) -> None:
    """Reject names a backend could misuse (paths, empty, over 200 characters, leading dot).

    Entry names from :func:`~kvswap.client.block_keys.entry_name` always pass; the
    leading dot is reserved for a backend's own files (temp files).
    """
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"bad entry name {name!r}: want 1-200 characters of "
                             "[A-Za-z0-9._-], not starting with '.'")


class StorageBackend(Protocol):
    """A store of named, immutable entries (opaque bytes).  Batch-shaped so that a
    networked backend can pipeline a whole batch in one round trip.

    Every method raises :class:`StorageError` when the store fails or is
    unreachable (:class:`StorageTimeout` when it did not answer in time) and
    ``ValueError`` for bad names; a failed call may have done part of a batch.
    Entries are never modified in place: a name either holds a complete entry as
    once put, or nothing.
    """

    def contains(self, names: Sequence[str]) -> list[bool]:
        """Whether each name holds an entry (does not count as a use for eviction)."""

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """Store each (name, parts) atomically as the concatenation of its parts.

        True = stored; False = the name already held an entry, left as it was
        (names are content keys, so the stored entry is as good).
        """

    def get(self, names: Sequence[str],
            into: Sequence[memoryview] | None = None) -> list[Stored | NotAnEntry | None]:
        """Each entry's bytes, None for a miss (a use, for eviction), or NotAnEntry.

        ``into``: one writable buffer per name, of an entry's size, that the backend
        may read the entry into (the returned view then points into it; reused, they
        spare an allocation and its page faults per entry); a backend that cannot
        read in place ignores it.  A longer value is never read whole: its first
        ``len(buffer) + 1`` bytes or a NotAnEntry, which unpack_entry rejects."""

    def delete(self, names: Sequence[str]) -> None:
        """Remove entries; a missing name is not an error."""

    def register_buffers(self, role: str, buffers: Sequence[Buffer]) -> None:
        """Tell the backend which long-lived memory its parts and ``into`` buffers come
        from, so a backend whose transfers need registered memory (Mooncake) moves
        them without a copy; a no-op for the others.

        ``role`` names the owner (``"host"``: the rank's host swap pool,
        ``"staging"``: the prefetch staging area); a call replaces what the role
        registered before, and ``[]`` releases it, which the owner must do before
        it frees or unmaps that memory.  Buffers outside registered memory still
        work (copied)."""

    def close(self) -> None:
        """Release connections and files; any later call raises StorageError."""


# ------------------------------------------------------------------ registry


@dataclass(frozen=True)
class BackendEntry:
    """One backend: the URL schemes it serves and where its code is.

    ``module`` is a module of this package, imported on first use; ``cls`` is the
    class in it that implements :class:`StorageBackend`, opens a URL with the
    classmethod ``from_url(url)`` and checks one with the classmethod
    ``check_url(url)``: the same parsing and the same ValueErrors as ``from_url``,
    without connecting or creating anything (``kvswap launch`` checks ``--storage``
    that way before it starts a daemon).  ``extra`` names the ``kvswap[...]`` extra
    that installs the backend's client library, for the error a missing one gets.
    """

    schemes: tuple[str, ...]
    module: str
    cls: str
    extra: str | None = None


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry(("file",), "file", "FileBackend"),
    BackendEntry(("redis", "rediss", "unix"), "redis", "RedisBackend", extra="redis"),
    BackendEntry(("mooncake",), "mooncake", "MooncakeBackend", extra="mooncake"),
)


def _by_scheme(entries: Sequence[BackendEntry]) -> dict[str, BackendEntry]:
    out: dict[str, BackendEntry] = {}
    for entry in entries:
        for scheme in entry.schemes:
            if scheme in out:
                raise ValueError(f"storage scheme {scheme!r} is registered twice in BACKENDS "
                                 f"({out[scheme].module} and {entry.module})")
            out[scheme] = entry
    return out


_BY_SCHEME = _by_scheme(BACKENDS)


def registered_schemes() -> list[str]:
    """Every URL scheme :func:`open_backend` knows, sorted."""
    return sorted(_BY_SCHEME)


def _backend_class(entry: BackendEntry, url: str) -> type:
    """Import ``entry``'s module; a missing client library becomes a ValueError saying
    which extra to install (an import failure inside kvswap itself is a bug: raised)."""
    try:
        module = importlib.import_module(f"{__name__}.{entry.module}")
    except ImportError as exc:
        if entry.extra is None or exc.name is None or exc.name.split(".")[0] == "kvswap":
            raise
        raise ValueError(f"storage URL {url!r} needs the {entry.extra} package: "
                         f"pip install 'kvswap[{entry.extra}]' ({exc})") from exc
    return getattr(module, entry.cls)


def _check_characters(url: str) -> None:
    """Refuse what urllib drops or passes on and no backend can use: a ``#fragment`` and
    raw control characters (dropped), a NUL byte as ``%00`` (file names, host names and
    the C++ clients' strings end at one: the path ``/a%00b`` failed only when opened)."""
    if (bad := next((c for c in url if ord(c) < 0x20 or ord(c) == 0x7F), None)) is not None:
        raise ValueError(f"storage URL {url!r} contains the control character {bad!r}: "
                         f"percent-encode it (a tab as %09) if it belongs to a path")
    if "%00" in url:
        raise ValueError(f"storage URL {url!r} contains a NUL byte (%00), which no path, "
                         "host, password or option can hold: remove it")
    if "#" in url:
        raise ValueError(f"storage URL {url!r} has a #fragment, which a store would drop: "
                         "remove it, or write a '#' of the path or password as %23")


def _resolve(url: str) -> tuple[BackendEntry, str]:
    """The registry entry a storage URL names, and the URL with a bare absolute path
    written as ``file://``; ValueError for a malformed URL or an unknown scheme."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
    scheme, sep, _ = url.partition("://")
    if not sep:
        if not url.startswith("/"):
            raise ValueError(f"storage URL {url!r} is neither scheme://... nor an absolute path")
        scheme, url = "file", "file://" + urllib.parse.quote(url)
    _check_characters(url)
    entry = _BY_SCHEME.get(scheme.lower())
    if entry is None:
        known = ", ".join(f"{s}://" for s in registered_schemes())
        raise ValueError(f"storage URL {url!r}: unknown scheme {scheme.lower()!r} "
                         f"(registered: {known}, or a bare absolute path)")
    return entry, url


def open_backend(url: str) -> StorageBackend:
    """The backend a storage URL names, by its scheme (:data:`BACKENDS`).

    - ``file:///abs/dir?capacity_bytes=500G&fsync=0``, or a bare absolute path (the
      same as ``file://`` with that path): a directory (:mod:`.file`); created if missing.
    - ``redis://[[user]:password@]host:port/db?timeout_s=5``, ``rediss://`` (TLS),
      ``unix:///path/redis.sock?db=0``: Redis or Valkey (:mod:`.redis`, needs
      ``kvswap[redis]``); connects lazily.
    - ``mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata&protocol=tcp``:
      Mooncake Store (:mod:`.mooncake`, needs ``kvswap[mooncake]``); connects lazily.

    ValueError for a malformed URL, an unknown scheme (the message lists the
    registered ones) or an unknown option.
    """
    entry, url = _resolve(url)
    return _backend_class(entry, url).from_url(url)


def check_url(url: str) -> None:
    """Raise the ValueError :func:`open_backend` would raise for ``url`` (malformed,
    unknown scheme or option, missing client library), without connecting to the
    store or creating anything."""
    entry, url = _resolve(url)
    _backend_class(entry, url).check_url(url)
