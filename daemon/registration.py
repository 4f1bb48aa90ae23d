"""The register in effect, as sent, and how another register differs from it.

:class:`Registration` is what :class:`~kvswap.daemon.attachment.Registrar` keeps
of the register it runs or ran: the canonical descriptors (locations included:
which memory), its reply once it ended, and the repeats waiting for it.  Two
registers are "the same" when backend and descriptors are equal; a replacing
register must keep the *layout* (:func:`layout_difference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvswap.client.errors import ErrorCode, InvalidTask
from kvswap.client.layout import TensorDesc
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
