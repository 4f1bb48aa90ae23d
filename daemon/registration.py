"""The register in effect, as sent, and how another register differs from it.

:class:`Registration` is what :class:`~kvswap.daemon.attachment.Registrar` keeps
of the register it runs or ran: the canonical descriptors (locations included:
which memory), its reply once it ended, and the repeats waiting for it.  Two
registers are "the same" when backend and descriptors are equal; a replacing
register must keep the *layout* (:func:`layout_difference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError
from kvswap.client.layout import TensorDesc, layout_hash
from kvswap.client.signals import RankState
from kvswap.daemon.jobs import Job


@dataclass
class Registration:
    """The register this rank is running or has run (see
    :meth:`Registrar._answer_repeat`)."""

    tensors: list[dict]  # canonical descriptors (TensorDesc.to_wire), locations included
    reply: tuple[ErrorCode, str, dict] | None = None  # (code, message, fields) once it ended
    waiters: list[Job] = field(default_factory=list)  # repeats answered when it ends

    def difference(self, backend: str, header: dict) -> str:
        """How a register's header differs from this one ("" when it is the same)."""
        if header["backend"] != backend:
            return f"backend {header['backend']!r}, not {backend!r}"
        try:
            tensors = [TensorDesc.from_wire(t).to_wire() for t in header["tensors"]]
        except InvalidTask as exc:
            return f"its descriptors are invalid: {exc.message}"
        if len(tensors) != len(self.tensors):
            return f"{len(tensors)} tensors, not {len(self.tensors)}"
        for new, old in zip(tensors, self.tensors):
            if new != old:
                what = [k for k in (*old, *(k for k in new if k not in old))
                        if new.get(k) != old.get(k)]  # "replicated" is sent only when set
                return f"tensor {old['name']!r} differs in {', '.join(what)}"
        return ""


def keep_layout(rank: int, old: list[TensorDesc], new: list[TensorDesc], why: str) -> None:
    """BAD_LAYOUT, saying ``why`` and how to change layouts, unless ``new`` has the
    layout ``old`` had (the host pool keeps its meaning)."""
    if layout_hash(old) != layout_hash(new):
        raise InvalidTask(
            f"rank {rank}: {why} ({layout_difference(old, new)}); to change the layout call "
            f"clear_caches(free_host=True) then restore_caches() on the TransferClient, or "
            f"relaunch the namespace", ErrorCode.BAD_LAYOUT)


def repeat_refusal(rank: int, state: RankState, reg: Registration | None, backend: str,
                   header: dict) -> KvswapError | None:
    """Why a register on a rank that has one in effect (or is attaching one) is
    refused, or None when it repeats that one (the same descriptors, locations
    included: the very same memory) and gets its answer."""
    if state in (RankState.CLEARING, RankState.CLEARED):
        return KvswapError(f"rank {rank} is {state.name}: its caches were released; call "
                           f"restore_caches() on the TransferClient, then register",
                           ErrorCode.ALREADY_REGISTERED)
    differs = "no register" if reg is None else reg.difference(backend, header)
    if differs and header.get("replace") and state is RankState.ATTACHING:
        return KvswapError(f"rank {rank} is ATTACHING another register (a replacing one, or "
                           f"its first); a replacing register needs the rank READY or PAUSED: "
                           f"retry once that one has ended", ErrorCode.NOT_READY)
    if differs:
        return KvswapError(
            f"rank {rank} already has caches registered (state {state.name}) and this "
            f"register is not the same ({differs}); a restarted engine registers with "
            f"replace=True (same layout; the host pool is kept); to change the layout call "
            f"clear_caches() then restore_caches() on the TransferClient and register again, "
            f"or relaunch the namespace", ErrorCode.ALREADY_REGISTERED)
    return None


def layout_difference(old: list[TensorDesc], new: list[TensorDesc]) -> str:
    """The first difference between two layouts, for an error message."""
    if len(old) != len(new):
        return f"{len(new)} tensors, not {len(old)}"
    for a, b in zip(old, new):
        for what, x, y in (("name", a.name, b.name), ("layer", a.layer, b.layer),
                           ("dtype", a.dtype, b.dtype),
                           ("block shape", a.block_shape, b.block_shape)):
            if x != y:
                return f"tensor {a.name!r}: {what} {y!r}, not {x!r}"
    return "same layout"
