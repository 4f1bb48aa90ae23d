"""Peer-transfer tickets: what a prefill node needs to push KV blocks into a decode node.

The decode side (``TransferClient.receive_into``) names host blocks that will
receive; the ticket it returns is opaque bytes that describe themselves, so an
engine can forward it through its own router (it is msgpack)::

    ticket = msgpack map {
      kind: "kvswap-peer-ticket", v: 1,
      ns: receiving namespace, tp: TP size,
      layout: 32-byte fingerprint of the block layout (client.layout.layout_hash:
              tensor names, layers, dtypes, block shapes; never block counts),
      ids: [host block ids of the receiver, in order],
      exp: expiry, wall-clock ns (time.time_ns) -- two nodes share wall time, not
           monotonic time,
      nonce: 16 random bytes (the ticket's identity: a receive is armed once per nonce),
      ranks: [per rank r: {te: "HOST:PORT" of rank r's Transfer Engine,
                           notify: "tcp://HOST:PORT" of its completion listener,
                           bases: [address of tensor i's first host block],
                           block_bytes: [bytes of one block of tensor i],
                           epoch: the daemon incarnation that armed it}],
      mac: HMAC-SHA256 (client.auth.mac) over the packed map without ``mac``,
           present when the receiving namespace has a secret }

Pairing (:meth:`Ticket.check_pairing`): rank r sends to rank r, so the TP sizes
must be equal; the layout fingerprints must be equal (the same bytes mean the
same thing on both sides); the sender names as many host blocks as the ticket;
the ticket must not have expired.  Each difference is refused with
:class:`TicketRefused` naming both values, in the caller's thread, before
anything is sent.  The MAC is checked by the sender when it is given the
receiving namespace's secret and always by the receiving daemon.
"""

from __future__ import annotations

import hmac
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import msgpack

from kvswap.client.auth import mac
from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.protocol import packb

KIND = "kvswap-peer-ticket"
VERSION = 1
NONCE_BYTES = 16
LAYOUT_BYTES = 32
INT64_END = 2**63  # ids, addresses and sizes past it do not fit the int64 spans are planned in

# A rank entry's endpoints, as the daemon writes them (``--peer-host`` and a port the OS
# picked): a host name, an IPv4 address or an IPv6 one (bracketed or not), then a port.
_HOST = r"(?:\[[0-9A-Fa-f:.%]+\]|[A-Za-z0-9._:%-]+)"
_TE = re.compile(rf"{_HOST}:([0-9]{{1,5}})")
_NOTIFY = re.compile(rf"tcp://{_HOST}:([0-9]{{1,5}})")
MAX_ENDPOINT = 256


class TicketRefused(KvswapError):
    """A ticket that cannot be used here; ``code`` says why (TICKET_MISMATCH,
    TICKET_EXPIRED, AUTH_FAILED) and the message names the difference."""

    default_code = ErrorCode.TICKET_MISMATCH


def _int(x: Any) -> int:
    """An integer field, as it was packed: ``int()`` would turn 1.7 into 1 and raise
    OverflowError (not a refusal) for an infinite float."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{x!r:.40} is not an integer")
    return x


def _bounded(x: Any, lowest: int, what: str) -> int:
    """An integer field in [``lowest``, 2**63): a sender plans its write in int64 (numpy),
    where a larger one raises OverflowError or wraps into a wrong address."""
    x = _int(x)
    if not lowest <= x < INT64_END:
        raise ValueError(f"{what} {x} is out of range [{lowest}, 2**63)")
    return x


def _endpoint(x: Any, field: str, pattern: re.Pattern, form: str) -> str:
    """An endpoint field of a rank entry.  The sender connects to it; a string ZMQ or the
    Transfer Engine cannot use (``"bogus"``) raised in the sender's peer worker instead
    of refusing the ticket, so it is checked where the entry is read."""
    match = pattern.fullmatch(x) if isinstance(x, str) and len(x) <= MAX_ENDPOINT else None
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise TicketRefused(f"ticket rank entry: {field} must be {form}, got {x!r:.80}; the "
                            f"ticket was altered or not made by receive_into: ask the "
                            f"receiver for a new one")
    return x


def _bytes(x: Any) -> bytes:
    """A bytes field: ``bytes()`` of an int would allocate that many zero bytes."""
    if not isinstance(x, (bytes, bytearray)):
        raise TypeError(f"{type(x).__name__} is not bytes")
    return bytes(x)


@dataclass(frozen=True)
class RankEndpoint:
    """Where and how rank r of the receiving namespace is written (peer_info's reply)."""

    te: str
    notify: str
    bases: tuple[int, ...]
    block_bytes: tuple[int, ...]
    epoch: int

    def to_wire(self) -> dict:
        return {"te": self.te, "notify": self.notify, "bases": list(self.bases),
                "block_bytes": list(self.block_bytes), "epoch": self.epoch}

    @classmethod
    def from_wire(cls, m: Any) -> "RankEndpoint":
        if not isinstance(m, dict):
            raise TicketRefused("ticket rank entry is not a map")
        try:
            te, notify = m["te"], m["notify"]
            out = cls(te, notify, tuple(_bounded(x, 1, "a base address") for x in m["bases"]),
                      tuple(_bounded(x, 1, "block bytes") for x in m["block_bytes"]),
                      _int(m["epoch"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TicketRefused(f"ticket rank entry is malformed: {exc!r}") from None
        _endpoint(te, "te (its Transfer Engine)", _TE, "'HOST:PORT'")
        _endpoint(notify, "notify (its completion listener)", _NOTIFY, "'tcp://HOST:PORT'")
        if len(out.bases) != len(out.block_bytes) or not out.bases:
            raise TicketRefused("ticket rank entry: bases and block_bytes must be equally long "
                                "and not empty")
        return out


@dataclass(frozen=True)
class Ticket:
    namespace: str
    tp_size: int
    layout: bytes
    block_ids: tuple[int, ...]
    expires_ns: int
    nonce: bytes
    ranks: tuple[RankEndpoint, ...]
    mac: bytes = b""

    # ------------------------------------------------------------------ making
    @classmethod
    def issue(cls, namespace: str, layout: bytes, block_ids: Sequence[int],
              ranks: Sequence[RankEndpoint], ttl_s: float, secret: bytes | None) -> "Ticket":
        """A new ticket valid for ``ttl_s`` seconds, signed when ``secret`` is given."""
        t = cls(namespace, len(ranks), bytes(layout), tuple(int(b) for b in block_ids),
                time.time_ns() + int(ttl_s * 1e9), os.urandom(NONCE_BYTES), tuple(ranks))
        return t.signed(secret) if secret else t

    def body(self) -> dict:
        return {"kind": KIND, "v": VERSION, "ns": self.namespace, "tp": self.tp_size,
                "layout": self.layout, "ids": list(self.block_ids), "exp": self.expires_ns,
                "nonce": self.nonce, "ranks": [r.to_wire() for r in self.ranks]}

    def _digest(self, secret: bytes) -> bytes:
        return mac(secret, [packb(self.body())])

    def signed(self, secret: bytes) -> "Ticket":
        return replace(self, mac=self._digest(secret))

    def to_bytes(self) -> bytes:
        body = self.body()
        if self.mac:
            body["mac"] = self.mac
        return packb(body)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_bytes(cls, raw: Any) -> "Ticket":
        """Decode a ticket; :class:`TicketRefused` (TICKET_MISMATCH) if it is not one."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise TicketRefused(f"a ticket is bytes (from receive_into), got "
                                f"{type(raw).__name__}")
        try:
            m = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise TicketRefused(f"ticket is not msgpack: {exc}") from None
        if not isinstance(m, dict) or m.get("kind") != KIND:
            raise TicketRefused("bytes are not a kvswap peer ticket (from receive_into)")
        if m.get("v") != VERSION:
            raise TicketRefused(f"ticket format version {m.get('v')!r}, this side reads "
                                f"{VERSION}")
        try:
            ranks = tuple(RankEndpoint.from_wire(r) for r in m["ranks"])
            t = cls(str(m["ns"]), _bounded(m["tp"], 1, "TP size"), _bytes(m["layout"]),
                    tuple(_bounded(b, 0, "a block id") for b in m["ids"]), _int(m["exp"]),
                    _bytes(m["nonce"]),
                    ranks, _bytes(m.get("mac", b"")))
        except (KeyError, TypeError, ValueError) as exc:
            raise TicketRefused(f"ticket is malformed: {exc!r}") from None
        if t.tp_size != len(t.ranks) or len(t.nonce) != NONCE_BYTES \
                or len(t.layout) != LAYOUT_BYTES:
            raise TicketRefused("ticket is malformed: TP size, nonce or layout fingerprint "
                                "has the wrong size")
        return t

    # ------------------------------------------------------------------ checks
    def verify(self, secret: bytes) -> None:
        """The MAC must be there and right (AUTH_FAILED otherwise)."""
        if not self.mac:
            raise TicketRefused(f"ticket of namespace {self.namespace!r} is not signed, but "
                                f"that namespace has a secret: issue it from a TransferClient "
                                f"given secret=", ErrorCode.AUTH_FAILED)
        if not hmac.compare_digest(self.mac, self._digest(secret)):
            raise TicketRefused(f"ticket of namespace {self.namespace!r}: bad HMAC (altered, "
                                f"or signed with another secret)", ErrorCode.AUTH_FAILED)

    def check_expiry(self, now_ns: int | None = None) -> None:
        now = time.time_ns() if now_ns is None else now_ns
        if now >= self.expires_ns:
            raise TicketRefused(f"ticket of namespace {self.namespace!r} expired "
                                f"{(now - self.expires_ns) / 1e9:.3f}s ago; ask the receiver "
                                f"for a new one", ErrorCode.TICKET_EXPIRED)

    def check_pairing(self, tp_size: int, layout: bytes, count: int,
                      now_ns: int | None = None) -> None:
        """Can a sender of ``tp_size`` ranks, block layout ``layout``, pushing ``count``
        blocks, use this ticket?  Raises :class:`TicketRefused` naming the difference."""
        if tp_size != self.tp_size:
            raise TicketRefused(f"TP size differs: the sender has {tp_size} ranks, the ticket's "
                                f"namespace {self.namespace!r} has {self.tp_size} (rank r sends "
                                f"to rank r)")
        if layout != self.layout:
            raise TicketRefused(f"block layout differs: sender fingerprint {layout.hex()[:16]}, "
                                f"ticket {self.layout.hex()[:16]} (tensor names, layers, dtypes "
                                f"or block shapes are not the same)")
        if count != len(self.block_ids):
            raise TicketRefused(f"count differs: the sender names {count} host blocks, the "
                                f"ticket {len(self.block_ids)}", ErrorCode.LENGTH_MISMATCH)
        self.check_expiry(now_ns)
