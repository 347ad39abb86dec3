"""``GET /metrics``: the encoder's Prometheus metrics, in a registry of its own.

Each service owns one ``CollectorRegistry`` (never prometheus-client's global
default registry: two encoders in one process must not share counters). What
happens once is recorded as it happens — requests by outcome and modality,
per-stage latency histograms, batch sizes — through the engine's observer
hooks; everything that is a level (queue depth, live requests, workers alive,
device busy fraction, the cache) is read from the owners' ``statistics()`` at
scrape time, so it can never drift from what ``/stats`` says.

Names (all prefixed ``epd_encoder_``):

- ``requests_total{modality, outcome}``: outcome ``ok`` or the error type
  (``RequestError``, ``OverloadedError``, ``DeadlineExceeded``, ...; a bug is
  ``InternalError``); modality ``unknown`` when the body did not parse.
- ``stage_seconds{stage}``: histogram; stage ``queue`` (waiting for a batch),
  ``preprocess`` (fetch + decode + processor), ``forward`` (one batch on its
  device), ``send`` (delivery: ZMQ, Mooncake writes, or building the inline
  body), ``end_to_end`` (a request scope's whole life).
- ``batch_size{worker}``: histogram of requests per forward.
- gauges ``live_requests``, ``admitted_requests``, ``queue_depth``,
  ``running_requests``, ``workers_alive``, ``draining``;
  ``worker_up{worker, device}``, ``device_busy_fraction{worker, device}``
  (share of the last 10 s in forwards), counters
  ``device_busy_seconds_total`` and ``forwards_total`` per worker;
  ``batch_token_cap{worker, device, modality}``, the adaptive cap (most tokens
  per forward; 0: each request alone), for each modality that has batched
  while adaptation is on.
- with the cache on: ``cache_hits_total``, ``cache_misses_total``,
  ``cache_evictions_total``, ``cache_bytes``, ``cache_capacity_bytes``,
  ``cache_entries``, ``cache_hit_ratio``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epd_trio.errors import EPDError

if TYPE_CHECKING:
    from epd_trio.encoder.service import EncoderService

__all__ = ["CONTENT_TYPE", "ServiceMetrics", "outcome_of"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "epd_encoder_"
STAGES = ("queue", "preprocess", "forward", "send", "end_to_end")
# Seconds: from sub-millisecond queue waits to the 180 s request deadline.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 180.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def outcome_of(exc: BaseException | None) -> str:
    """``ok``, an error type of the tree, or ``InternalError`` (a bounded set of label values)."""
    if exc is None:
        return "ok"
    return exc.type_name if isinstance(exc, EPDError) else "InternalError"


class ServiceMetrics:
    """One service's metrics; also an engine observer (``stage``, ``batch``)."""

    def __init__(self, service: EncoderService) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Encode requests by modality and outcome",
                                ["modality", "outcome"], registry=self.registry)
        self.stages = Histogram(PREFIX + "stage_seconds", "Seconds spent per request (per batch for "
                                "forward) in each stage", ["stage"], buckets=LATENCY_BUCKETS,
                                registry=self.registry)
        self.batch_sizes = Histogram(PREFIX + "batch_size", "Requests per forward", ["worker"],
                                     buckets=BATCH_BUCKETS, registry=self.registry)
        self.registry.register(_LevelCollector(service))
        # Labelled children, looked up once: ``labels()`` takes a lock and builds a key per call.
        self._stage_children: dict[str, Any] = {}
        self._request_children: dict[tuple[str, str], Any] = {}
        self._batch_children: dict[int, Any] = {}

    # ---- observer --------------------------------------------------------------
    def stage(self, name: str, seconds: float) -> None:
        child = self._stage_children.get(name)
        if child is None:
            child = self._stage_children[name] = self.stages.labels(name)
        child.observe(max(0.0, seconds))

    def batch(self, worker: int, size: int, tokens: int) -> None:
        child = self._batch_children.get(worker)
        if child is None:
            child = self._batch_children[worker] = self.batch_sizes.labels(str(worker))
        child.observe(size)

    def request(self, modality: str, exc: BaseException | None) -> None:
        key = (modality, outcome_of(exc))
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(*key)
        child.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class _LevelCollector:
    """Levels and totals read from ``statistics()`` at scrape time."""

    def __init__(self, service: EncoderService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service, engine = self._service, self._service.engine
        e = engine.statistics()
        yield _gauge("live_requests", "Request scopes alive", service.registry.statistics().live_requests)
        yield _gauge("admitted_requests", "Requests admitted (preprocessing, queued or running)", e.admitted)
        yield _gauge("queue_depth", "Requests queued for a forward, all devices", e.queued)
        yield _gauge("running_requests", "Requests in a running forward, all devices", e.running)
        yield _gauge("workers_alive", "Device workers still serving", e.workers_alive)
        yield _gauge("draining", "1 while the encoder drains for shutdown", float(service.draining))
        yield from self._workers(engine)
        if e.cache is not None:
            yield from _cache(e.cache)

    def _workers(self, engine: Any) -> Iterator[Metric]:
        labels = ["worker", "device"]
        up = GaugeMetricFamily(PREFIX + "worker_up", "1 while the device worker serves, 0 once dead",
                               labels=labels)
        busy = GaugeMetricFamily(PREFIX + "device_busy_fraction",
                                 "Share of the last 10 s the device spent in forwards", labels=labels)
        seconds = CounterMetricFamily(PREFIX + "device_busy_seconds", "Seconds spent in forwards",
                                      labels=labels)
        forwards = CounterMetricFamily(PREFIX + "forwards", "Forwards completed", labels=labels)
        caps = GaugeMetricFamily(PREFIX + "batch_token_cap", "The adaptive batch cap: most tokens "
                                 "in one forward (0: each request alone)", labels=[*labels, "modality"])
        for state in engine.worker_states():
            key = [str(state.index), state.device]
            up.add_metric(key, float(state.state == "alive"))
            busy.add_metric(key, state.busy_fraction)
            seconds.add_metric(key, state.busy_seconds)
            forwards.add_metric(key, state.forwards)
            for modality, learned in state.batch_learning.items():
                caps.add_metric([*key, modality], learned.cap_tokens)
        yield from (up, busy, seconds, forwards, caps)


def _cache(c: Any) -> Iterator[Metric]:
    yield _counter("cache_hits", "Items answered from the embedding cache", c.hits)
    yield _counter("cache_misses", "Items looked up and not found", c.misses)
    yield _counter("cache_evictions", "Items evicted to make room", c.evictions)
    yield _gauge("cache_bytes", "Bytes of embeddings held", c.bytes)
    yield _gauge("cache_capacity_bytes", "The cache's bound in bytes", c.capacity_bytes)
    yield _gauge("cache_entries", "Items held", c.entries)
    yield _gauge("cache_hit_ratio", "hits / (hits + misses) since start", c.hit_ratio)
