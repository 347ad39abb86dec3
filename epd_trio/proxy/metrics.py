"""The proxy's Prometheus metrics, in a registry of its own (never the global default).

What happens once is counted as it happens; what is a level (requests live,
each language server's health and load) is read from ``statistics()`` at
scrape time. ``GET /metrics`` serves these and the encoder client's
(``epd_client_*``, ``client.metrics``) one after the other.

Names (prefixed ``epd_proxy_``):

- ``requests_total{route, status}``: answered requests by HTTP status
  (``499`` when the caller left first);
- ``request_seconds{route}``: histogram, arrival to the answer's last byte;
- ``first_byte_seconds{route}``: histogram, arrival to the first byte of the
  language server's answer (time to first token, for a stream);
- ``encode_seconds``: histogram, the encoders storing a request's media;
- ``items_total{modality}``: media items sent to encoders;
- gauges ``requests_live``, ``server_healthy{server}``,
  ``server_in_flight{server}``; counter ``server_forwarded_total{server}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ProxyMetrics"]

PREFIX = "epd_proxy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)


class ProxyMetrics:
    """Built by the proxy with its ``statistics`` method; ``registry`` is what to scrape."""

    def __init__(self, statistics: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(PREFIX + "requests", "answered requests by route and HTTP status",
                                 ["route", "status"], registry=self.registry)
        self._seconds = Histogram(PREFIX + "request_seconds", "arrival to the answer's last byte",
                                  ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._first_byte = Histogram(PREFIX + "first_byte_seconds",
                                     "arrival to the language server's first answer byte",
                                     ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._encode = Histogram(PREFIX + "encode_seconds", "encoders storing a request's media",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self._items = Counter(PREFIX + "items", "media items sent to encoders", ["modality"],
                              registry=self.registry)
        self.registry.register(_LevelCollector(statistics))

    def answered(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._seconds.labels(route).observe(max(0.0, seconds))

    def first_byte(self, route: str, seconds: float) -> None:
        self._first_byte.labels(route).observe(max(0.0, seconds))

    def encoded(self, items: dict[str, int], seconds: float) -> None:
        for modality, count in items.items():
            self._items.labels(modality).inc(count)
        self._encode.observe(max(0.0, seconds))


class _LevelCollector:
    def __init__(self, statistics: Callable[[], Any]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self._statistics()
        yield GaugeMetricFamily(PREFIX + "requests_live", "requests in flight", value=s.requests_live)
        healthy = GaugeMetricFamily(PREFIX + "server_healthy", "1 while a language server is in "
                                    "rotation", labels=["server"])
        in_flight = GaugeMetricFamily(PREFIX + "server_in_flight", "requests in flight per "
                                      "language server", labels=["server"])
        forwarded = CounterMetricFamily(PREFIX + "server_forwarded", "requests sent per language "
                                        "server", labels=["server"])
        for server in s.servers:
            healthy.add_metric([server.url], int(server.healthy))
            in_flight.add_metric([server.url], server.in_flight)
            forwarded.add_metric([server.url], server.forwarded)
        yield from (healthy, in_flight, forwarded)
