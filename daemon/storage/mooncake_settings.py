"""``mooncake://`` URLs: the Mooncake Store backend's settings and their parsing
(docs/storage.md section 7 lists the options).  Apart from the backend so that a
URL is checked (``kvswap launch``, ``check_url``) without importing Mooncake."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Callable

from kvswap.daemon.options import parse_size
from kvswap.daemon.storage.url_options import parse_seconds, url_options

DEFAULT_PORT = 50051  # mooncake_master's default RPC port
DEFAULT_METADATA_PORT = 8080  # its default --http_metadata_server_port
PROTOCOLS = ("tcp", "rdma")


def _parse_nonnegative_size(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


def _parse_protocol(text: str) -> str:
    if text not in PROTOCOLS:
        raise ValueError(f"want one of {', '.join(PROTOCOLS)}")
    return text


def _parse_metadata(text: str) -> str:
    if text != "P2PHANDSHAKE" and not text.startswith(("http://", "etcd://")):
        raise ValueError("want http://HOST:PORT/metadata (the master's HTTP metadata "
                         "server), etcd://HOST:PORT or P2PHANDSHAKE")
    return text


def _parse_hostname(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("want this machine's address as the other store clients reach it")
    return text


_OPTIONS: dict[str, Callable[[str], object]] = {
    "metadata": _parse_metadata,
    "protocol": _parse_protocol,
    "device": str,
    "local_hostname": _parse_hostname,
    "segment": _parse_nonnegative_size,
    "buffer": parse_size,
    "timeout_s": parse_seconds,
    "connect_timeout_s": parse_seconds,
    "copy_below": _parse_nonnegative_size,
}


@dataclass(frozen=True)
class MooncakeSettings:
    """A ``mooncake://`` URL, parsed (docs/storage.md lists the options)."""

    master_host: str
    master_port: int
    metadata: str
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str | None = None  # None: the address this host reaches the master from
    segment: int = 1 << 30
    buffer: int = 64 << 20
    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    copy_below: int = 64 << 10  # parts smaller than this are gathered into the bounce area

    @property
    def master(self) -> str:
        return f"{self.master_host}:{self.master_port}"

    @classmethod
    def parse(cls, url: str) -> "MooncakeSettings":
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"storage URL {url!r}: no master host (want "
                             "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata)")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"storage URL {url!r}: {exc}") from None
        if port == 0:  # before, it quietly meant the default port
            raise ValueError(f"storage URL {url!r}: port 0 is no master's port: give the "
                             f"master's --port, or none for {DEFAULT_PORT}")
        if parts.path not in ("", "/") or parts.username or parts.password:
            raise ValueError(f"storage URL {url!r}: want mooncake://MASTER_HOST:PORT?options, "
                             "without a path or user")
        # each option is named as its field, and its parser returns the field's type
        opts = url_options(url, parts.query, _OPTIONS)
        metadata = f"http://{parts.hostname}:{DEFAULT_METADATA_PORT}/metadata"
        return cls(master_host=parts.hostname, master_port=port or DEFAULT_PORT,
                   **{"metadata": metadata, **opts})  # type: ignore[arg-type]
