"""What a rank stores for one block: its entry parts, their names and fingerprints.

A block of a rank is stored as at most two entries ("parts"):

* the rank's own part: the block of every tensor not registered as replicated,
  concatenated in registration order, named ``kvswap.<fp>.r<rank>.<key>``;
* the replicated part: the block of every tensor registered with
  ``replicated=True`` (an MLA latent cache, the same bytes on every TP rank),
  named ``kvswap.<fp>.all.<key>``.  Rank 0 alone backs it up; every rank
  prefetches it from that one name, so the store holds it once instead of TP
  times.

Each part has its own fingerprint (``model_fingerprint``): the layout hash of
its tensors and an identity string of the model id, the TP size, ``|replicated``
for the replicated part, and ``|version=V`` when a model version is set.  A
rank with no replicated tensor therefore names and fingerprints its entries
exactly as before replication existed, and entries written under one model
version are never matched under another (a different name, and a header that
``unpack_entry`` would refuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvswap.client.block_keys import entry_name, model_fingerprint
from kvswap.client.layout import TensorDesc, layout_hash


@dataclass(frozen=True)
class EntryPart:
    """One entry of a block: which tensors it holds and where each sits in its payload."""

    replicated: bool
    layout: bytes  # layout_hash() of the part's tensors
    spans: tuple[tuple[int, int, int], ...]  # (tensor index, offset in payload, bytes)
    payload_bytes: int

    def fingerprint(self, model_id: str, tp: int, version: str) -> bytes:
        identity = f"{model_id}|tp={tp}"
        if self.replicated:
            identity += "|replicated"
        if version:
            identity += f"|version={version}"
        return model_fingerprint(self.layout, identity)

    def names(self, keys: np.ndarray, rank: int, fingerprint: bytes) -> list[str]:
        owner = None if self.replicated else rank
        return [entry_name(k.tobytes(), owner, fingerprint) for k in keys]


@dataclass(frozen=True)
class EntryLayout:
    """The parts of a rank's block, and the identity their fingerprints name."""

    parts: tuple[EntryPart, ...]  # own part first (when the rank has one), then replicated
    model_id: str
    tp: int
    rank: int

    @classmethod
    def of(cls, tensors: Sequence[TensorDesc], model_id: str, tp: int,
           rank: int) -> "EntryLayout":
        parts = []
        for replicated in (False, True):
            chosen = [(i, t) for i, t in enumerate(tensors) if t.replicated == replicated]
            if not chosen:
                continue
            offsets = np.cumsum([0] + [t.bytes_per_block for _, t in chosen])
            parts.append(EntryPart(
                replicated, layout_hash([t for _, t in chosen]),
                tuple((i, int(off), t.bytes_per_block) for (i, t), off in zip(chosen, offsets)),
                int(offsets[-1])))
        return cls(tuple(parts), model_id, tp, rank)

    def writes(self, part: EntryPart) -> bool:
        """Whether this rank backs ``part`` up: its own part always, the replicated one
        on rank 0 only."""
        return not part.replicated or self.rank == 0

    def names(self, keys: np.ndarray, version: str) -> list[tuple[EntryPart, bytes, list[str]]]:
        """Per part: the part, its fingerprint under ``version`` and the names of ``keys``."""
        out = []
        for part in self.parts:
            fp = part.fingerprint(self.model_id, self.tp, version)
            out.append((part, fp, part.names(keys, self.rank, fp)))
        return out
