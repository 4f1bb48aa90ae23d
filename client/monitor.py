"""``kvswap status``: read a namespace's signal segment and render it.

Reads shared memory only, read-only: it never talks to a daemon, so it works
when a daemon is wedged and costs the daemons nothing.
"""

from __future__ import annotations

import json

from kvswap.client.host_cache_stats import read_host_cache
from kvswap.client.naming import Names
from kvswap.client.signals import SignalSegment, pid_alive

_GIB = float(1 << 30)


def read_status(namespace: str, run_root: str | None = None) -> dict:
    """The namespace's :meth:`SignalSegment.snapshot`, each rank with its ``activity``
    (:func:`rank_activity`), ``launcher_alive``: False for the leftovers of a launcher
    that is gone (killed, or its machine's processes crashed), and ``host_cache``: the
    host-tier statistics a scheduler's HostCache publishes
    (``client/host_cache_stats.py``), or None."""
    names = Names.of(namespace, run_root)
    seg = SignalSegment.attach(names, readonly=True)
    try:
        status = seg.snapshot()
    finally:
        seg.close()
    for row in status["ranks"]:
        row["activity"] = rank_activity(status["ranks"], row["rank"])
    status["launcher_alive"] = pid_alive(status["launcher_pid"])
    status["host_cache"] = read_host_cache(names)
    return status


def _gib(n: float) -> str:
    return f"{n / _GIB:.2f}"


def rank_activity(ranks: list[dict], r: int) -> str:
    """What rank ``r`` is doing, in words, where its state alone does not say (else
    ""), from the rows of :meth:`SignalSegment.snapshot`.

    An ATTACHING rank goes through three steps, told apart by its slots:

    ==========================  ===========  ==========  ==================  ===================
    step                        cache_ready  swap_ready  swap_bytes_pinned   reads
                                                         (a) of _total (b)
    ==========================  ===========  ==========  ==================  ===================
    no register yet             0            0           a = b = 0           waiting for its ...
    (a pool kept by a clear)    0            1           a = b               waiting for its ...
    register: pool being made   0            any         a < b               preparing host pool
    register: caches mapped     0            0           a = b > 0           attaching its caches
    registered, at the barrier  1            1           a = b               registered, waiting
    ==========================  ===========  ==========  ==================  ===================

    ``swap_bytes_pinned`` counts the pool's bytes made ready (populated; cuda: then
    pinned), so a/b is the progress of a register.  The barrier waits for every
    rank to register, so the ranks named are those whose ``cache_ready`` is 0."""
    row = ranks[r]
    state = row["state"]
    if state == "FAILED":
        return f"failed ({row['last_error']}): see its log"
    if state not in ("ATTACHING", "CLEARED"):
        return ""
    total, ready = row["swap_bytes_total"], row["swap_bytes_pinned"]
    if not row["cache_ready"]:
        if ready < total:
            return (f"preparing host pool {_gib(ready)}/{_gib(total)} GiB, "
                    f"{100 * ready // total}%")
        if total and not row["swap_ready"]:
            return "attaching its caches"
        return ("waiting for its caches to be registered" if state == "ATTACHING"
                else "cleared: waiting for restore and register")
    missing = [str(o["rank"]) for o in ranks if not o["cache_ready"]]
    if missing:
        return f"registered, waiting for rank{'s' if len(missing) > 1 else ''} " + \
            ", ".join(missing) + " to register"
    return "registered, at the start-up barrier"


def _age(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def transfer_rates(prev: dict, cur: dict, dt_s: float) -> dict[int, tuple[float | None,
                                                                          float | None]]:
    """GiB/s (2^30 bytes/s, the unit of the GiB counters) evicted and loaded per rank
    between two snapshots of one namespace taken ``dt_s`` apart, from the bytes counters.

    A rate is None where it cannot be known: the namespace was launched anew
    between the snapshots (another creation time), a rank is new, or a counter
    went back.  Counters survive a daemon restart, so a restart alone does not
    blank the rate.
    """
    if dt_s <= 0 or prev["created_unix_ns"] != cur["created_unix_ns"]:
        return {r["rank"]: (None, None) for r in cur["ranks"]}
    before = {r["rank"]: r for r in prev["ranks"]}
    out: dict[int, tuple[float | None, float | None]] = {}
    for r in cur["ranks"]:
        old = before.get(r["rank"])
        pair = []
        for field in ("bytes_evicted", "bytes_loaded"):
            delta = None if old is None else r[field] - old[field]
            pair.append(None if delta is None or delta < 0 else delta / dt_s / _GIB)
        out[r["rank"]] = (pair[0], pair[1])
    return out


def _rate(v: float | None) -> str:
    if v is None:
        return "-"
    return "<0.01" if 0 < v < 0.005 else f"{v:.2f}"  # traffic never reads as 0.00


def format_table(status: dict,
                 rates: dict[int, tuple[float | None, float | None]] | None = None) -> str:
    """The status table, then a line per rank that has an ``activity``; with ``rates``
    (see :func:`transfer_rates`; ``{}`` before the second refresh of ``--watch``) it
    gains a GiB/s column per direction.  Every byte figure is in GiB (2^30 bytes)."""
    cols = ["rank", "pid", "state", "epoch", "heartbeat", "inflight", "completed", "failed",
            "GiB evicted", "GiB loaded"]
    if rates is not None:
        cols += ["evict GiB/s", "load GiB/s"]
    cols.append("last error")
    rows = []
    for r in status["ranks"]:
        row = [
            str(r["rank"]), str(r["pid"] or "-"), r["state"], str(r["epoch"]),
            _age(r["heartbeat_age_s"]), str(r["inflight"]), str(r["completed"]), str(r["failed"]),
            f"{r['bytes_evicted'] / _GIB:.3f}", f"{r['bytes_loaded'] / _GIB:.3f}",
        ]
        if rates is not None:
            evict, load = rates.get(r["rank"], (None, None))
            row += [_rate(evict), _rate(load)]
        row.append("-" if r["last_error"] == "OK" else r["last_error"])
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = [
        f"namespace {status['namespace']}  tp {status['tp_size']}  launcher pid "
        f"{status['launcher_pid']}  engine heartbeat {_age(status['engine_heartbeat_age_s'])}  "
        f"kv caches {status['kvcache_status']}",
        line,
    ]
    if status.get("launcher_alive") is False:
        ns = status["namespace"]
        out.insert(1, f"the launcher is gone: this is what it left; 'kvswap launch --namespace "
                      f"{ns}' removes it and starts afresh (its daemons exit by themselves "
                      f"once orphaned)")
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    out += [f"rank {r['rank']}: {r['activity']}" for r in status["ranks"] if r.get("activity")]
    if status.get("host_cache") is not None:
        out.append(format_host_cache(status["host_cache"]))
    return "\n".join(out)


def format_host_cache(hc: dict) -> str:
    """One line on the host tier, as the scheduler's HostCache published it."""
    ratio = "-" if hc["hit_ratio"] is None else f"{100 * hc['hit_ratio']:.1f}%"
    owner = f"pid {hc['owner_pid']}" + ("" if hc["owner_alive"] else " (gone)")
    return (f"host tier ({hc['policy']}, {owner}, updated {_age(hc['age_s'])} ago): "
            f"{hc['used']}/{hc['capacity']} blocks used, {hc['pending']} storing, "
            f"{hc['protected']} loading; hit ratio {ratio} ({hc['hits']} of "
            f"{hc['lookup_blocks']} blocks looked up), {hc['stores']} stored, "
            f"{hc['evictions']} evicted")


def format_json(status: dict) -> str:
    """One line of JSON, keys sorted (a stream of them is JSON Lines)."""
    return json.dumps(status, sort_keys=True)
