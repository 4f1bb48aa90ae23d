"""Content keys of KV blocks for the storage tier, and the names entries are stored under.

A block's KV data depends on every token before it, so its key chains: key n
hashes key n-1 together with block n's token ids (and block n's extra keys, e.g.
the hashes of multimodal items whose embeddings sit in that block).  Two requests
that share a prefix therefore share the keys of its full blocks, and any change
of a token changes the key of its block and of every block after it.

Everything here is SHA-256 over bytes spelled out below (and in
``docs/storage.md``), never Python's ``hash()``: keys must agree across processes,
machines and Python versions, because a block stored by one engine is found by
another.

Bytes hashed for block n (all integers little-endian)::

    b"kvswap-block-v1\\0"                 16 B  domain tag
    block_size                           u64
    previous key                         32 B  key n-1, ``parent`` for n = 0, or ROOT_KEY
    block n's token ids                  block_size x i64
    number of extra keys                 u32
    per extra key: type tag, length, bytes
        b"i" u32 len, signed two's complement, minimal length   (int)
        b"s" u32 len, UTF-8                                      (str)
        b"b" u32 len, raw                                        (bytes)

Keys say nothing about the model: :func:`entry_name` adds the model fingerprint
and the TP rank, so two models or two TP layouts never read each other's data.
"""

from __future__ import annotations

import hashlib
import numbers
import struct
from typing import Sequence

__all__ = [
    "FINGERPRINT_BYTES", "KEY_BYTES", "ROOT_KEY", "block_hashes", "entry_name",
    "model_fingerprint", "storage_key",
]

KEY_BYTES = 32
"""Length of a block key (SHA-256)."""

FINGERPRINT_BYTES = 16
"""Length of a model fingerprint: 128 bits make a collision between two models
negligible and keep entry names short (32 hex characters)."""

ROOT_KEY = hashlib.sha256(b"kvswap-block-root-v1").digest()
"""The "previous key" of a sequence's first block when no ``parent`` is given."""

_BLOCK_TAG = b"kvswap-block-v1\x00"
_HASH_TAG = b"kvswap-hash-key-v1\x00"
_MODEL_TAG = b"kvswap-model-v1\x00"
_MAX_TOKEN = (1 << 63) - 1
_NO_EXTRAS = struct.pack("<I", 0)

ExtraKey = int | str | bytes


def _encode_extra(block: int, item: object) -> bytes:
    # bool is an int subclass: refuse it rather than hash True like 1.
    if isinstance(item, bool):
        raise ValueError(f"extra_keys[{block}]: bool is not an allowed extra key (use int)")
    if isinstance(item, numbers.Integral):  # int, numpy integers
        value = int(item)
        data = value.to_bytes((value + (value < 0)).bit_length() // 8 + 1, "little", signed=True)
        tag = b"i"
    elif isinstance(item, str):
        data = item.encode("utf-8")
        tag = b"s"
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        tag = b"b"
    else:
        raise ValueError(f"extra_keys[{block}]: extra keys must be int, str or bytes, "
                         f"got {type(item).__name__}")
    if len(data) > 0xFFFFFFFF:
        raise ValueError(f"extra_keys[{block}]: an extra key of {len(data)} bytes is too long")
    return tag + struct.pack("<I", len(data)) + data


def _encode_extras(block: int, items: Sequence[ExtraKey] | None) -> bytes:
    if items is None:
        return _NO_EXTRAS
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        # A bare string would otherwise be taken as a sequence of characters.
        raise ValueError(f"extra_keys[{block}] must be a sequence of keys (or None), "
                         f"got a bare {type(items).__name__}")
    parts = [_encode_extra(block, item) for item in items]
    return struct.pack("<I", len(parts)) + b"".join(parts)


def _pack_tokens(token_ids: Sequence[int], count: int) -> bytes:
    """The first ``count`` token ids as little-endian i64, validated without a Python loop
    on the good path (struct refuses non-integers and values >= 2**63; min finds negatives)."""
    tokens = token_ids[:count]
    try:
        packed = struct.pack(f"<{count}q", *tokens)
        if not count or min(tokens) >= 0:
            return packed
    except struct.error:
        pass
    for i, t in enumerate(tokens):  # slow path, only to name the culprit
        if not hasattr(type(t), "__index__"):
            raise ValueError(f"token_ids[{i}] must be an int, got {type(t).__name__}")
        if not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"token_ids[{i}] = {t} is outside [0, 2**63)")
    raise ValueError("token_ids must be ints in [0, 2**63)")


def block_hashes(token_ids: Sequence[int], block_size: int, *, parent: bytes | None = None,
                 extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None) -> list[bytes]:
    """One 32-byte key per full block of ``token_ids``; an incomplete last block gets none.

    ``token_ids``: a sequence of ints in [0, 2**63) (Python ints or numpy integers).
    ``parent``: the key of the block just before ``token_ids[0]``, to continue a
    chain: ``block_hashes(t[k*bs:], bs, parent=keys[k-1])`` equals ``keys[k:]``
    (slice ``extra_keys`` the same way).  ``None`` starts a sequence (``ROOT_KEY``).
    ``extra_keys[n]``: what else block n's KV depends on (multimodal item hashes,
    a LoRA id, a cache salt), as a sequence of int/str/bytes, or ``None``; ``None``
    and an empty sequence hash alike.  The list may be shorter than the number
    of blocks (missing trailing entries mean no extras) and may hold one entry
    for the incomplete last block (ignored: that block gets no key), but no more
    entries than blocks: anything beyond the tokens is a caller's indexing bug.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if parent is None:
        parent = ROOT_KEY
    elif not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key (or None), got {parent!r}")
    num_full = len(token_ids) // block_size
    if extra_keys is not None:
        num_blocks = -(-len(token_ids) // block_size)
        if len(extra_keys) > num_blocks:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries but the "
                             f"{len(token_ids)} tokens fill only {num_blocks} block(s) "
                             f"of {block_size}")
        extras = [_encode_extras(n, extra_keys[n]) if n < len(extra_keys) else _NO_EXTRAS
                  for n in range(num_full)]
    else:
        extras = [_NO_EXTRAS] * num_full
    packed = memoryview(_pack_tokens(token_ids, num_full * block_size))
    stride = 8 * block_size
    base = hashlib.sha256(_BLOCK_TAG + struct.pack("<Q", block_size))
    keys: list[bytes] = []
    prev = parent
    for n in range(num_full):
        h = base.copy()
        h.update(prev)
        h.update(packed[n * stride:(n + 1) * stride])
        h.update(extras[n])
        prev = h.digest()
        keys.append(prev)
    return keys


def model_fingerprint(layout_hash: bytes, model_id: str) -> bytes:
    """16-byte identity of what a rank's stored blocks mean.

    ``layout_hash`` (:func:`kvswap.client.layout.layout_hash`, 32 bytes) covers the
    tensor names, layers, dtypes and block shapes of one rank.  ``model_id`` must
    name everything else that changes a block's bytes: the weights (name and
    revision), the KV-cache quantization, and the TP size, since ranks of two TP
    sizes can have the same per-rank layout while holding different heads (KV
    heads replicated when TP exceeds their count).  Hashed: ``b"kvswap-model-v1\\0"
    | layout_hash | model_id as UTF-8``, first 16 bytes of the SHA-256.
    """
    if not isinstance(layout_hash, bytes) or len(layout_hash) != 32:
        raise ValueError(f"layout_hash must be 32 bytes (layout_hash()), got {layout_hash!r}")
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    return hashlib.sha256(_MODEL_TAG + layout_hash + model_id.encode("utf-8")).digest()[
        :FINGERPRINT_BYTES]


def entry_name(key: bytes, rank: int | None, fingerprint: bytes) -> str:
    """The storage name of one rank's copy of one block: ``kvswap.<fp hex>.r<rank>.<key hex>``;
    ``rank=None`` names the one copy of a block's replicated tensors that every rank
    shares: ``kvswap.<fp hex>.all.<key hex>``.

    Only ``[a-z0-9.]``, at most 120 characters: safe as a file name and as a Redis
    key.  The common ``kvswap.<fp>.`` prefix lets an operator list or drop one
    model's entries (``SCAN MATCH kvswap.<fp>.*``).
    """
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 0 <= rank < 1 << 16):
        raise ValueError(f"rank must be an int in [0, 65536) or None, got {rank!r}")
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes "
                         f"(model_fingerprint()), got {fingerprint!r}")
    owner = "all" if rank is None else f"r{rank}"
    return f"kvswap.{fingerprint.hex()}.{owner}.{key.hex()}"


def _encode_hash(value: object, depth: int = 0) -> bytes:
    """Type tag, u32 length, bytes (tuples: tag, u32 count, then each item encoded)."""
    if isinstance(value, bool) or depth > 16:
        raise TypeError(f"a block hash must be an int, str, bytes or a tuple of them, "
                        f"got {value!r}")
    if isinstance(value, numbers.Integral):
        v = int(value)
        data = v.to_bytes((v + (v < 0)).bit_length() // 8 + 1, "little", signed=True)
        tag = b"i"
    elif isinstance(value, str):
        data, tag = value.encode("utf-8"), b"s"
    elif isinstance(value, bytes):
        data, tag = value, b"b"
    elif isinstance(value, tuple):
        return b"t" + struct.pack("<I", len(value)) + b"".join(
            _encode_hash(item, depth + 1) for item in value)
    else:
        raise TypeError(f"a block hash must be an int, str, bytes or a tuple of them to have "
                        f"a storage key, got {type(value).__name__} ({value!r})")
    if len(data) > 0xFFFFFFFF:
        raise ValueError(f"a block hash of {len(data)} bytes is too long")
    return tag + struct.pack("<I", len(data)) + data


def storage_key(block_hash: object) -> bytes:
    """The storage-tier key of a :class:`~kvswap.client.host_cache.HostCache` hash.

    A ``bytes`` of :data:`KEY_BYTES` (what :func:`block_hashes` returns) is the key as
    it is, so an engine that uses kvswap's block keys finds the entries that
    ``TransferClient.backup`` wrote under them.  Anything else (an engine's int
    hashes, a trace's hash ids) is digested: SHA-256 of ``b"kvswap-hash-key-v1\\0"``
    followed by the value encoded with a type tag, so ``1``, ``"1"`` and ``b"\\x01"``
    get different keys:

    * int (and numpy integers): ``b"i"``, u32 length, minimal signed two's complement;
    * str: ``b"s"``, u32 length, UTF-8;
    * bytes of any other length: ``b"b"``, u32 length, the bytes;
    * tuple: ``b"t"``, u32 count, then each item encoded the same way (nesting <= 16).

    Lengths and counts are little-endian.  Other types (float, bool, objects) raise
    ``TypeError``: their hash is not stable across processes.
    """
    if isinstance(block_hash, bytes) and len(block_hash) == KEY_BYTES:
        return bytes(block_hash)
    return hashlib.sha256(_HASH_TAG + _encode_hash(block_hash)).digest()
