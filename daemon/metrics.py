"""``kvswap metrics``: the signal segment of a namespace in Prometheus text format.

A custom collector reads :meth:`SignalSegment.snapshot` on every scrape, through
a fresh read-only attach: it never talks to a daemon (so it costs them nothing
and keeps answering when one is wedged), and it follows a namespace that is
torn down and launched again under the same name.  While the namespace does
not exist only ``kvswap_up 0`` is served, so the exporter may start first.

Series (labels ``namespace`` and, per rank, ``rank``), named after the Prometheus
naming guide (base unit, then ``_total`` for a counter; one series per fact):

====================================== ======= ===========================================
name                                   type    value
====================================== ======= ===========================================
kvswap_build_info                      gauge   1, labels ``version`` (of kvswap) and
                                               ``protocol_version``; served even while
                                               the namespace does not exist
kvswap_up                              gauge   1 if the signal segment could be read
kvswap_tp_size                         gauge   ranks of the namespace
kvswap_engine_heartbeat_age_seconds    gauge   age of the last CacheWorker beat (absent: never)
kvswap_rank_state                      gauge   1 for the ``state`` label of the current
                                               state, 0 for every other RankState
kvswap_rank_epoch                      gauge   daemon starts on this rank
kvswap_rank_heartbeat_age_seconds      gauge   age of the daemon's beat (absent: never)
kvswap_rank_inflight                   gauge   accepted tasks not yet answered
kvswap_rank_completed_total            counter transfer tasks completed
kvswap_rank_failed_total               counter requests rejected or failed
kvswap_rank_evicted_bytes_total        counter bytes copied device -> host
kvswap_rank_loaded_bytes_total         counter bytes copied host -> device
kvswap_rank_swap_pool_bytes            gauge   size of the host swap pool
kvswap_rank_swap_pinned_bytes          gauge   bytes of the pool made ready so far
                                               (populated; cuda: then pinned)
kvswap_rank_task_seconds               histo.  daemon time per task, labels ``op`` and
                                               ``phase`` (queued: received to started;
                                               exec: started to done), from the
                                               segment's log2 microsecond buckets
kvswap_rank_errors_total               counter failures by ``code`` (ErrorCode name)
kvswap_host_cache_*                    mixed   the host tier, when the scheduler's HostCache
                                               publishes it (label ``policy``): capacity,
                                               used, pending, protected blocks (gauges),
                                               hit_ratio (gauge), lookup_blocks, hits,
                                               loads, stores, store_failures, evictions
                                               (counters, ``_total``)
====================================== ======= ===========================================

Renamed in 0.1 (issue #14): ``kvswap_rank_bytes_evicted_total`` and
``kvswap_rank_bytes_loaded_total`` are ``kvswap_rank_evicted_bytes_total`` and
``kvswap_rank_loaded_bytes_total``; ``kvswap_rank_state_code`` is gone (the
``kvswap_rank_state`` series per state say the same).
"""

from __future__ import annotations

import itertools
import threading
from typing import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvswap.client import __version__
from kvswap.client.errors import NamespaceError
from kvswap.client.monitor import read_status
from kvswap.client.protocol import PROTOCOL_VERSION
from kvswap.client.signals import HIST_BUCKETS, RankState

_RANK_LABELS = ("namespace", "rank")

# (snapshot field, metric name without the kvswap_rank_ prefix, help)
_RANK_GAUGES = (
    ("epoch", "epoch", "Daemon starts on this rank."),
    ("inflight", "inflight", "Accepted tasks not yet answered."),
    ("swap_bytes_total", "swap_pool_bytes", "Size of the rank's host swap pool in bytes."),
    ("swap_bytes_pinned", "swap_pinned_bytes",
     "Bytes of the host swap pool made ready so far: populated (cuda: then pinned)."),
)
_RANK_COUNTERS = (
    ("completed", "completed", "Transfer tasks completed."),
    ("failed", "failed", "Requests rejected or transfer tasks failed."),
    ("bytes_evicted", "evicted_bytes", "Bytes copied device -> host."),
    ("bytes_loaded", "loaded_bytes", "Bytes copied host -> device."),
)
# (published field, metric name without the kvswap_host_cache_ prefix, help)
_HOST_GAUGES = (
    ("capacity", "capacity_blocks", "Host blocks the scheduler's HostCache manages."),
    ("used", "used_blocks", "Host blocks holding a block (ready or being stored)."),
    ("pending", "pending_blocks", "Blocks whose store to the host tier is in flight."),
    ("protected", "protected_blocks", "Ready host blocks with a load in flight."),
)
_HOST_COUNTERS = (
    ("lookup_blocks", "lookup_blocks", "Hashes the scheduler looked up in the host tier."),
    ("hits", "hits", "Hashes found ready in the host tier."),
    ("loads", "loads", "Blocks prepared for loading from the host tier."),
    ("stores", "stores", "Blocks stored in the host tier."),
    ("store_failures", "store_failures", "Blocks whose store to the host tier failed."),
    ("evictions", "evictions", "Blocks evicted from the host tier."),
)


def _bucket_bounds() -> list[str]:
    """Upper bounds ("le", seconds) of the segment's histogram buckets: bucket b < last
    holds durations below 2^b µs; the last one is open."""
    return [repr(2 ** b / 1e6) for b in range(HIST_BUCKETS - 1)] + ["+Inf"]


_LE = _bucket_bounds()


class SignalCollector:
    """Collects one namespace's signal segment at every scrape."""

    def __init__(self, namespace: str, run_root: str | None = None):
        self.namespace = namespace
        self.run_root = run_root

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("kvswap_build_info",
                                  "kvswap's version and wire protocol version; always 1.",
                                  labels=["version", "protocol_version"])
        build.add_metric([__version__, "%d.%d" % PROTOCOL_VERSION], 1)
        yield build
        up = GaugeMetricFamily("kvswap_up", "1 if the namespace's signal segment was read.",
                               labels=["namespace"])
        try:
            status = read_status(self.namespace, self.run_root)
        except NamespaceError:
            up.add_metric([self.namespace], 0)
            yield up
            return
        up.add_metric([self.namespace], 1)
        yield up
        yield from self._namespace_metrics(status)
        yield from self._rank_metrics(status["ranks"])
        if status["host_cache"] is not None:
            yield from self._host_cache_metrics(status["host_cache"])

    def _namespace_metrics(self, status: dict) -> Iterator[Metric]:
        tp = GaugeMetricFamily("kvswap_tp_size", "Ranks of the namespace.", labels=["namespace"])
        tp.add_metric([self.namespace], status["tp_size"])
        yield tp
        engine = GaugeMetricFamily("kvswap_engine_heartbeat_age_seconds",
                                   "Seconds since the last CacheWorker heartbeat.",
                                   labels=["namespace"])
        if status["engine_heartbeat_age_s"] is not None:
            engine.add_metric([self.namespace], status["engine_heartbeat_age_s"])
        yield engine

    def _rank_metrics(self, ranks: list[dict]) -> Iterator[Metric]:
        states = GaugeMetricFamily("kvswap_rank_state",
                                   "1 for the rank daemon's current state, 0 for the others.",
                                   labels=[*_RANK_LABELS, "state"])
        beat = GaugeMetricFamily("kvswap_rank_heartbeat_age_seconds",
                                 "Seconds since the rank daemon's last heartbeat.",
                                 labels=_RANK_LABELS)
        per_field: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            (field, GaugeMetricFamily(f"kvswap_rank_{name}", doc, labels=_RANK_LABELS))
            for field, name, doc in _RANK_GAUGES]
        per_field += [(field, CounterMetricFamily(f"kvswap_rank_{name}", doc, labels=_RANK_LABELS))
                      for field, name, doc in _RANK_COUNTERS]
        for row in ranks:
            labels = [self.namespace, str(row["rank"])]
            for s in RankState:  # every state, so an alert on a state has a series to watch
                states.add_metric([*labels, s.name], int(s.name == row["state"]))
            if row["heartbeat_age_s"] is not None:
                beat.add_metric(labels, row["heartbeat_age_s"])
            for field, family in per_field:
                family.add_metric(labels, row[field])
        yield states
        yield beat
        for _, family in per_field:
            yield family
        yield from self._task_metrics(ranks)

    def _task_metrics(self, ranks: list[dict]) -> Iterator[Metric]:
        times = HistogramMetricFamily(
            "kvswap_rank_task_seconds",
            "Daemon time per task by op and phase (queued: received to started; "
            "exec: started to done).", labels=[*_RANK_LABELS, "op", "phase"])
        errors = CounterMetricFamily("kvswap_rank_errors", "Failures by error code.",
                                     labels=[*_RANK_LABELS, "code"])
        for row in ranks:
            labels = [self.namespace, str(row["rank"])]
            for op, phases in row["histograms"].items():
                for phase, h in phases.items():
                    cumulative = itertools.accumulate(h["buckets"])
                    times.add_metric([*labels, op, phase], list(zip(_LE, cumulative)),
                                     sum_value=h["sum_us"] / 1e6)
            for name, count in row["errors"].items():
                errors.add_metric([*labels, name], count)
        yield times
        yield errors


    def _host_cache_metrics(self, hc: dict) -> Iterator[Metric]:
        labels = [self.namespace, hc["policy"]]
        for field, name, doc in _HOST_GAUGES:
            g = GaugeMetricFamily(f"kvswap_host_cache_{name}", doc,
                                  labels=["namespace", "policy"])
            g.add_metric(labels, hc[field])
            yield g
        ratio = GaugeMetricFamily("kvswap_host_cache_hit_ratio",
                                  "Hits over hashes looked up in the host tier.",
                                  labels=["namespace", "policy"])
        if hc["hit_ratio"] is not None:
            ratio.add_metric(labels, hc["hit_ratio"])
        yield ratio
        for field, name, doc in _HOST_COUNTERS:
            c = CounterMetricFamily(f"kvswap_host_cache_{name}", doc,
                                    labels=["namespace", "policy"])
            c.add_metric(labels, hc[field])
            yield c


def registry_for(namespace: str, run_root: str | None = None) -> CollectorRegistry:
    """A registry holding only the namespace's collector (no process or GC metrics
    of the exporter itself: they say nothing about the daemons)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SignalCollector(namespace, run_root))
    return registry


def serve(namespace: str, port: int, host: str = "127.0.0.1",
          run_root: str | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; port 0 picks a free
    one (``server.server_port``).  Stop with ``server.shutdown()``."""
    return start_http_server(port, addr=host, registry=registry_for(namespace, run_root))
