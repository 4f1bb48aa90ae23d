"""Request traces for ``kvswap bench trace``: the Mooncake trace format and a synthetic
generator.

Format (the public Mooncake traces): JSON lines, one request per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

``timestamp`` is the arrival in milliseconds, ``input_length`` and
``output_length`` count tokens, and ``hash_ids`` has one id per block of
:data:`BLOCK_TOKENS` (512) prompt tokens.  Ids are prefix ids: two requests with
the same id at block i share the whole prompt up to the end of that block, so
the ids double as block hashes for a prefix cache.  Other keys on a line are
ignored (traces carry extras).

The synthetic generator (:func:`synthetic_trace`) produces this format from a
seed, with the reuse an engine's prefix caches meet:

* system prompts shared by many requests, chosen with Zipf popularity;
* multi-turn conversations: each turn repeats the whole conversation so far and
  appends new blocks; which conversation speaks next is drawn by popularity,
  and popularity is Zipf-distributed (rank ``r`` of ``zipf_ranks`` drawn at
  random, weight ``r ** -zipf``), so a few conversations come back often and
  most rarely: reuse driven by frequency, not by recency alone;
* one-shot requests (a document read once, behind a system prompt) that are
  never reused: the scans that push reusable blocks out of an LRU cache.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, TextIO

BLOCK_TOKENS = 512
"""Prompt tokens per hash id in the Mooncake format."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int  # ms
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp, "input_length": self.input_length,
                           "output_length": self.output_length,
                           "hash_ids": list(self.hash_ids)})


def _nonneg_int(obj: dict, key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return v


def parse_request(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: 'hash_ids' names a block twice; ids name prefixes, so "
                         f"they are distinct within a request")
    return TraceRequest(_nonneg_int(obj, "timestamp", where),
                        _nonneg_int(obj, "input_length", where),
                        _nonneg_int(obj, "output_length", where), tuple(ids))


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSON-lines trace file; blank lines are skipped.  A bad line
    raises ``ValueError`` naming the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(parse_request(line, f"{path} line {n}"))
    if not out:
        raise ValueError(f"{path}: the trace holds no request")
    return out


def write_trace(requests: Iterable[TraceRequest], out: TextIO) -> None:
    for r in requests:
        out.write(r.to_json() + "\n")


@dataclass(frozen=True)
class SyntheticConfig:
    requests: int = 2000
    seed: int = 0
    system_prompts: int = 8
    system_blocks: tuple[int, int] = (2, 6)  # blocks per system prompt (min, max)
    oneshot: float = 0.3  # share of one-shot requests (never reused)
    oneshot_blocks: tuple[int, int] = (8, 24)
    new_conversation: float = 0.15  # share of requests that open a conversation
    turn_blocks: tuple[int, int] = (1, 3)  # blocks a turn adds
    max_context_blocks: int = 48  # a conversation ends when a turn would pass this
    zipf: float = 1.2  # popularity exponent (conversations and system prompts)
    zipf_ranks: int = 1000
    rate: float = 10.0  # requests per second (Poisson arrivals)
    output_tokens: tuple[int, int] = (16, 1024)

    def check(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        for name in ("system_blocks", "oneshot_blocks", "turn_blocks", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (min, max) with 1 <= min <= max")
        if not (0 <= self.oneshot and 0 <= self.new_conversation
                and self.oneshot + self.new_conversation <= 1):
            raise ValueError("oneshot and new_conversation are shares: >= 0, sum <= 1")
        if self.max_context_blocks < self.system_blocks[1] + self.turn_blocks[1]:
            raise ValueError("max_context_blocks must hold a system prompt and one turn")
        if self.system_prompts < 1 or self.zipf_ranks < 1 or self.rate <= 0 or self.zipf < 0:
            raise ValueError("system_prompts and zipf_ranks >= 1, rate > 0, zipf >= 0")


class _Conversations:
    """Open conversations and their popularity; drawing is O(log n) (cumulative
    weights, append-only; a finished conversation keeps its weight and a draw that
    lands on it opens a new one instead)."""

    def __init__(self) -> None:
        self.context: list[list[int] | None] = []
        self.cumulative: list[float] = []

    def add(self, context: list[int], weight: float) -> None:
        self.context.append(context)
        self.cumulative.append((self.cumulative[-1] if self.cumulative else 0.0) + weight)

    def draw(self, rng: random.Random) -> int | None:
        if not self.cumulative:
            return None
        x = rng.random() * self.cumulative[-1]
        return min(bisect.bisect_right(self.cumulative, x), len(self.cumulative) - 1)


def synthetic_trace(cfg: SyntheticConfig) -> list[TraceRequest]:
    """A seeded trace in the Mooncake format (see the module docstring)."""
    cfg.check()
    rng = random.Random(cfg.seed)
    fresh = itertools.count()

    def blocks(bounds: tuple[int, int]) -> list[int]:
        return [next(fresh) for _ in range(rng.randint(*bounds))]

    prompts = [blocks(cfg.system_blocks) for _ in range(cfg.system_prompts)]
    prompt_weights = list(itertools.accumulate(
        (k + 1) ** -cfg.zipf for k in range(cfg.system_prompts)))
    convs = _Conversations()

    def system_prompt() -> list[int]:
        x = rng.random() * prompt_weights[-1]
        return list(prompts[min(bisect.bisect_right(prompt_weights, x), len(prompts) - 1)])

    def open_conversation() -> list[int]:
        context = system_prompt() + blocks(cfg.turn_blocks)
        convs.add(context, rng.randint(1, cfg.zipf_ranks) ** -cfg.zipf)
        return context

    out = []
    t_ms = 0.0
    for _ in range(cfg.requests):
        t_ms += rng.expovariate(cfg.rate) * 1000.0
        r = rng.random()
        if r < cfg.oneshot:
            ids = system_prompt() + blocks(cfg.oneshot_blocks)
        elif r < cfg.oneshot + cfg.new_conversation:
            ids = open_conversation()
        else:
            k = convs.draw(rng)
            context = convs.context[k] if k is not None else None
            if context is None or len(context) + cfg.turn_blocks[1] > cfg.max_context_blocks:
                if k is not None:
                    convs.context[k] = None  # finished: it stays in the weights, unused
                ids = open_conversation()
            else:
                context.extend(blocks(cfg.turn_blocks))
                ids = list(context)
        tokens = len(ids) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1)
        out.append(TraceRequest(int(t_ms), tokens, rng.randint(*cfg.output_tokens), tuple(ids)))
    return out


def trace_stats(requests: list[TraceRequest]) -> dict:
    """Blocks, distinct blocks and the reuse bound (share of block references that
    repeat an earlier one: the hit ratio of an infinite cache)."""
    total = sum(len(r.hash_ids) for r in requests)
    distinct = len({h for r in requests for h in r.hash_ids})
    return {"requests": len(requests), "blocks": total, "distinct_blocks": distinct,
            "max_blocks": max(len(r.hash_ids) for r in requests),
            "reuse_bound": round(1 - distinct / total, 4) if total else 0.0,
            "span_s": round((requests[-1].timestamp - requests[0].timestamp) / 1000, 1)}
