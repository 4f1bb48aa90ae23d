"""The client half of peer transfer: ``TransferClient.receive_into`` and ``send_to``.

Both check every argument, and the ticket's pairing with this namespace, in the
caller's thread before anything is sent (client/ticket.py names the rules).
Both need each rank's ``peer_info`` (endpoint, pool bases, layout fingerprint);
it is asked once and kept while no rank restarts (the epochs in the signal
segment are unchanged) and no receive is refused TICKET_MISMATCH (a pool that
moved at a clear), so a steady stream of transfers costs no extra round trip.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.protocol import (
    MAX_SECONDS,
    Message,
    Op,
    as_block_ids,
    check_priority,
    check_seconds,
    check_ids,
    request_header,
)
from kvswap.client.signals import RankSlot
from kvswap.client.ticket import RankEndpoint, Ticket, TicketRefused

if TYPE_CHECKING:
    from kvswap.client.transfer_client import TransferClient, TransferFuture

# client -> (rank epochs, [(endpoint, layout) per rank]) while those epochs hold
_INFOS: "weakref.WeakKeyDictionary[TransferClient, tuple[tuple[int, ...], list]]" = \
    weakref.WeakKeyDictionary()


def peer_infos(client: "TransferClient") -> tuple[list[RankEndpoint], bytes]:
    """Every rank's ticket entry and the namespace's layout fingerprint (blocking, up to
    the task timeout).  A namespace launched without ``--peer-transfer`` raises here,
    code PEER_DISABLED, with the flag named."""
    epochs = tuple(int(e) for e in client.seg.ranks[:, RankSlot.EPOCH])
    cached = _INFOS.get(client)
    if cached is not None and cached[0] == epochs:
        return cached[1]
    replies = client._control(Op.PEER_INFO).result().replies
    ranks = [RankEndpoint.from_wire(replies[r].fields) for r in range(client.tp_size)]
    layouts = {replies[r].fields["layout"] for r in range(client.tp_size)}
    if len(layouts) != 1:
        raise KvswapError(f"the ranks of namespace {client.names.namespace!r} report different "
                          f"block layouts: {sorted(layouts)}", ErrorCode.BAD_LAYOUT)
    out = (ranks, bytes.fromhex(layouts.pop()))
    _INFOS[client] = (epochs, out)
    return out


def _host_ids(client: "TransferClient", host_blocks: Any, what: str, unique: bool
              ) -> np.ndarray:
    host = as_block_ids(host_blocks, "host_blocks").astype("<i8")
    if host.size == 0:
        raise InvalidTask("host_blocks is empty: name at least one block", ErrorCode.BAD_FIELD)
    check_ids(what, "host", host, client._block_limits()[1], unique)
    return host


def _check_secret(secret: Any) -> None:
    if secret is not None and (not isinstance(secret, (bytes, bytearray)) or not secret):
        raise InvalidTask(f"secret must be non-empty bytes (the namespace's --secret-file "
                          f"contents) or None, got {type(secret).__name__}", ErrorCode.BAD_FIELD)


def receive_into(client: "TransferClient", host_blocks: Any, ttl_s: float | None,
                 secret: bytes | None) -> tuple[bytes, "TransferFuture"]:
    from kvswap.client.transfer_client import TransferFuture, _Envelope

    host = _host_ids(client, host_blocks, "receive_into", unique=True)
    ttl = (client.task_timeout if ttl_s is None
           else check_seconds(ttl_s, "ttl_s", positive=True, most=MAX_SECONDS))
    _check_secret(secret)
    ranks, layout = peer_infos(client)
    ticket = Ticket.issue(client.names.namespace, layout, host.tolist(), ranks, ttl,
                          bytes(secret) if secret else client._secret)
    raw = ticket.to_bytes()
    # The receive may wait for its sender as long as the ticket lives; the daemon
    # answers it TICKET_EXPIRED then, inside this deadline.
    fut = TransferFuture(next(client._ids), Op.PEER_RECV, range(client.tp_size),
                         time.monotonic() + ttl + client.task_timeout, client)
    header = request_header(Op.PEER_RECV, fut.task_id)
    fut.add_done_callback(lambda f: _forget_if_stale(client, f))
    client._submit([_Envelope(fut, Message(header, [raw], epoch_stamped=True))])
    return raw, fut


def _forget_if_stale(client: "TransferClient", fut: "TransferFuture") -> None:
    """A receive refused TICKET_MISMATCH: a rank's pool may have moved without a restart
    (clear, then register again), so ask peer_info again next time."""
    exc = fut.exception(0)
    if exc is not None and exc.code == ErrorCode.TICKET_MISMATCH:
        _INFOS.pop(client, None)


def send_to(client: "TransferClient", ticket: Any, host_blocks: Any, secret: bytes | None,
            priority: int) -> "TransferFuture":
    from kvswap.client.transfer_client import _Envelope

    _check_secret(secret)
    t = Ticket.from_bytes(ticket)
    host = _host_ids(client, host_blocks, "send_to", unique=False)
    prio = check_priority(priority)
    if secret is not None:
        t.verify(bytes(secret))
    ranks, layout = peer_infos(client)
    t.check_pairing(client.tp_size, layout, int(host.size))
    for r, (mine, theirs) in enumerate(zip(ranks, t.ranks)):
        if mine.block_bytes != theirs.block_bytes:
            raise TicketRefused(f"block bytes differ on rank {r}: here {list(mine.block_bytes)}, "
                                f"the ticket {list(theirs.block_bytes)}")
    fut = client._new_future(Op.PEER_SEND)
    fields: dict = {"ids": "<i8", "n": int(host.size)}
    if prio:
        fields["priority"] = prio
    header = request_header(Op.PEER_SEND, fut.task_id, fields)
    client._submit([_Envelope(fut, Message(header, [host, bytes(ticket)],
                                           epoch_stamped=True))])
    return fut
