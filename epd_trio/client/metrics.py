"""The receiver side's Prometheus metrics: one ``CollectorRegistry`` per client.

Like the encoder's (``epd_trio.encoder.metrics``), never the global default
registry. The language server exposes it however it serves HTTP, e.g.
``prometheus_client.generate_latest(client.metrics_registry)``.

Names (prefixed ``epd_client_``): ``requests_total{outcome}`` (``ok`` or the
error type), ``request_seconds`` (histogram, ``encode`` end to end, pool wait
included), and from ``statistics()`` at scrape time: ``requests_live``,
``parts_live``, ``outstanding_parts{encoder}``, ``encoders``,
``pool_used_bytes``, ``pool_capacity_bytes``, ``pool_peak_used_bytes``,
``pool_waiters``, ``pool_waiting_bytes``, and the totals ``retries_total``,
``messages_received_total``, ``messages_dropped_total``,
``malformed_messages_total``, ``aborts_sent_total``, ``aborts_failed_total``,
``pool_leaked_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epd_trio.errors import EPDError

__all__ = ["ClientMetrics"]

PREFIX = "epd_client_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 180.0)


class ClientMetrics:
    """Built by the client with its ``statistics`` method; ``registry`` is what to scrape."""

    def __init__(self, statistics: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(PREFIX + "requests", "encode() calls by outcome", ["outcome"],
                                 registry=self.registry)
        self._seconds = Histogram(PREFIX + "request_seconds", "encode() end to end, in seconds",
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_LevelCollector(statistics))

    def request(self, seconds: float, exc: BaseException | None) -> None:
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, EPDError):
            outcome = exc.type_name
        else:
            outcome = "Cancelled" if type(exc).__name__ == "Cancelled" else "InternalError"
        self._requests.labels(outcome).inc()
        self._seconds.observe(max(0.0, seconds))


class _LevelCollector:
    def __init__(self, statistics: Callable[[], Any]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self._statistics()
        gauges = {"requests_live": s.requests_live, "parts_live": s.parts_live,
                  "encoders": len(s.encoders), "pool_used_bytes": s.pool.used_bytes,
                  "pool_capacity_bytes": s.pool.capacity, "pool_peak_used_bytes": s.pool.peak_used,
                  "pool_waiters": s.pool.waiters, "pool_waiting_bytes": s.pool.waiting_bytes}
        for name, value in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, name.replace("_", " "), value=value)
        totals = {"retries": s.retries, "messages_received": s.messages_received,
                  "messages_dropped": s.messages_dropped, "malformed_messages": s.malformed_messages,
                  "aborts_sent": s.aborts_sent, "aborts_failed": s.aborts_failed,
                  "pool_leaked": s.pool.leaked}
        for name, value in totals.items():
            yield CounterMetricFamily(PREFIX + name, name.replace("_", " "), value=value)
        outstanding = GaugeMetricFamily(PREFIX + "outstanding_parts", "parts in flight per encoder",
                                        labels=["encoder"])
        for url, count in s.outstanding.items():
            outstanding.add_metric([url], count)
        yield outstanding
