"""Prometheus metrics shared by both daemons, derived from the lifecycle events themselves.

Every reclamation step already becomes an event with its offset from T0, so the histograms are
fed from those events in one place (`observe_event`), on the agent as it makes them and on the
coordinator as it stores them: the two can never disagree about what a step took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds. Fine at the bottom (the 50 ms SIGTERM target), coarse up to the 120 s promise.
STEP_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.8,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class ReclamationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # Every series in this registry; the steps' histograms share one set of buckets.
        step = partial(Histogram, buckets=STEP_BUCKETS, registry=registry)
        count = partial(Counter, registry=registry)
        self.notice_to_taint = step(
            "spotdrain_notice_to_taint_seconds",
            "From the notice (T0) to the node's taint in force (remote or local).",
            ["reason"],
        )
        self.notice_to_sigterm = step(
            "spotdrain_notice_to_sigterm_seconds",
            "From the notice (T0) to the first SIGTERM sent.",
            ["reason"],
        )
        self.notice_to_empty = step(
            "spotdrain_notice_to_verified_empty_seconds",
            "From the notice (T0) to the node verified empty by observation.",
            ["reason"],
        )
        self.drain_duration = step(
            "spotdrain_drain_duration_seconds",
            "From the notice (T0) to the reclamation's outcome (drained or overrun).",
            ["reason", "outcome"],
        )
        self.slot_wait = step(
            "spotdrain_slot_wait_seconds",
            "From a worker going draining to its last slot released (or its cut at G).",
        )
        self.reclamations = count(
            "spotdrain_reclamations_total",
            "Reclamations by outcome.",
            ["reason", "outcome"],
        )
        # Exported at 0 from the start: a series that first appears at 1 hides that first
        # reclamation from increase(), and an overrun is rare enough that its first one matters.
        for reason in ("notice", "pause"):
            for outcome in ("drained", "overrun"):
                self.reclamations.labels(reason, outcome)
        self.local_taints = count(
            "spotdrain_local_taints_total",
            "Taints applied locally because the coordinator did not answer in time.",
        )
        self.interrupted = count(
            "spotdrain_interrupted_streams_total",
            "Requests cut while in flight (reported as interrupted, never as finished).",
        )
        self.refused = count(
            "spotdrain_refused_requests_total",
            "Requests a slot gate refused (draining or all slots busy).",
            ["why"],
        )
        self._reason: dict[str, str] = {}
        self._seen: set[tuple[str, str]] = set()

    def observe_event(
        self, kind: str, reclaim_id: str, t_offset_s: float | None, details: dict[str, Any]
    ) -> None:
        if kind == "notice_received":
            self._reason[reclaim_id] = str(details.get("reason", "notice"))
            return
        if kind == "stream_interrupted":
            self.interrupted.inc()
            return
        if kind == "tainted" and details.get("mode") == "local":
            self.local_taints.inc()
        reason = self._reason.get(reclaim_id, "notice")
        if t_offset_s is None or not reclaim_id:
            return
        first = (reclaim_id, kind) not in self._seen
        self._seen.add((reclaim_id, kind))
        if kind == "tainted" and first:
            self.notice_to_taint.labels(reason).observe(t_offset_s)
        elif kind == "sigterm_sent" and first:
            self.notice_to_sigterm.labels(reason).observe(t_offset_s)
        elif kind == "verified_empty" and first:
            self.notice_to_empty.labels(reason).observe(t_offset_s)
        elif kind in ("drained", "overrun") and first:
            self.drain_duration.labels(reason, kind).observe(t_offset_s)
            self.reclamations.labels(reason, kind).inc()
            self._forget(reclaim_id)

    def _forget(self, reclaim_id: str) -> None:
        # Bounded memory: a finished reclamation's first-step markers are dropped (a late
        # duplicate of one of its events would be counted again; the store dedups by uid first).
        self._reason.pop(reclaim_id, None)
        self._seen = {s for s in self._seen if s[0] != reclaim_id}


class GaugeCollector(Collector):
    """Gauges computed at scrape time from the daemon's own state, never kept in step by hand."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: list[str],
        read: Callable[[], Iterable[tuple[list[str], float]]],
    ) -> None:
        self.name, self.help_text, self.labels, self.read = name, help_text, labels, read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.help_text, labels=self.labels)
        for values, number in self.read():
            family.add_metric(values, number)
        yield family


def serve(registry: CollectorRegistry, listen: str) -> int:
    """Serve /metrics on HOST:PORT in a thread; returns the bound port (0 picks one)."""
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    return int(server.server_port)


__all__ = ["CollectorRegistry", "Gauge", "GaugeCollector", "ReclamationMetrics", "serve"]
