"""``kvswap status``: read a namespace's signal segment and render it.

Reads shared memory only, read-only: it never talks to a daemon, so it works
when a daemon is wedged and costs the daemons nothing.
"""

from __future__ import annotations

import json

from kvswap.client.naming import Names
from kvswap.client.signals import SignalSegment

_GIB = float(1 << 30)


def read_status(namespace: str, run_root: str | None = None) -> dict:
    seg = SignalSegment.attach(Names.of(namespace, run_root), readonly=True)
    try:
        return seg.snapshot()
    finally:
        seg.close()


def _age(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def format_table(status: dict) -> str:
    cols = ("rank", "pid", "state", "epoch", "heartbeat", "inflight", "completed", "failed",
            "GiB evicted", "GiB loaded", "last error")
    rows = []
    for r in status["ranks"]:
        rows.append((
            str(r["rank"]), str(r["pid"] or "-"), r["state"], str(r["epoch"]),
            _age(r["heartbeat_age_s"]), str(r["inflight"]), str(r["completed"]), str(r["failed"]),
            f"{r['bytes_evicted'] / _GIB:.3f}", f"{r['bytes_loaded'] / _GIB:.3f}",
            "-" if r["last_error"] == "OK" else r["last_error"],
        ))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = [
        f"namespace {status['namespace']}  tp {status['tp_size']}  launcher pid "
        f"{status['launcher_pid']}  engine heartbeat {_age(status['engine_heartbeat_age_s'])}  "
        f"kv caches {status['kvcache_status']}",
        line,
    ]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def format_json(status: dict) -> str:
    return json.dumps(status, sort_keys=True)
