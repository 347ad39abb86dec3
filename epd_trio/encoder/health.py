"""``/health``: a real tiny encode through the same pipeline, shared by callers.

While real batches are completing, the encoder is evidently healthy and no
probe runs. Otherwise one probe (request id ``HEALTH_CHECK-n``: the cheapest
real request the model family encodes, ``samples.probe_request`` — an image
for the Qwen-VL families, a short tone for Qwen2-Audio) goes through
the engine exactly like a request, but skips the admission bound (a full queue
is not a sick encoder) and never touches the embedding cache (a cached answer
would prove nothing). Concurrent ``/health`` calls share the probe in flight,
and the probe runs in the service's nursery, so a caller that gives up does
not cancel it for the others.

With several devices, a dead device worker does not make the encoder
unhealthy while another serves (the report names the dead ones); with none
alive it is unhealthy at once, without a probe.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from epd_trio.errors import EPDError
from epd_trio.model.samples import probe_request

if TYPE_CHECKING:
    from epd_trio.engine import Engine

__all__ = ["HealthMonitor", "HealthReport", "HealthStatistics"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthStatistics:
    probes: int
    probe_failures: int
    last_ok: float | None
    probe_modality: str


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    probed: bool
    detail: str
    dead_workers: tuple[str, ...] = ()  # "worker 1 (cuda:1): <why>" for each dead device worker


class HealthMonitor:
    def __init__(self, engine: Engine, nursery: trio.Nursery, *, timeout: float, fresh: float) -> None:
        self._engine = engine
        self._nursery = nursery
        self._timeout = timeout
        self._fresh = fresh
        self._modality, self._items = probe_request(engine.encoder.adapter.modalities)
        self._ids = itertools.count()
        self._last_ok: float | None = None
        self._inflight: trio.Event | None = None
        self._last_report = HealthReport(False, False, "no probe yet")
        self._probes = self._failures = 0

    def batch_completed(self) -> None:
        self._last_ok = trio.current_time()

    async def check(self) -> HealthReport:
        dead = self._dead_workers()
        if dead and len(dead) == len(self._engine.workers):
            return HealthReport(False, False, "every device worker has failed", dead)
        if self._last_ok is not None and trio.current_time() - self._last_ok < self._fresh:
            report = HealthReport(True, False, "batches are completing")
        else:
            if self._inflight is None:
                self._inflight = trio.Event()
                self._nursery.start_soon(self._probe, self._inflight)
            await self._inflight.wait()  # bounded: the probe has its own timeout
            report = self._last_report
        if dead:
            report = HealthReport(report.healthy, report.probed,
                                  f"{report.detail}; {len(dead)} of {len(self._engine.workers)} "
                                  f"device workers dead", self._dead_workers())
        return report

    def _dead_workers(self) -> tuple[str, ...]:
        return tuple(f"worker {w.index} ({w.device}): {w.error}"
                     for w in self._engine.worker_states() if w.state == "dead")

    async def _probe(self, done: trio.Event) -> None:
        req_id = f"HEALTH_CHECK-{next(self._ids)}"
        self._probes += 1
        try:
            with trio.fail_after(self._timeout):
                await self._engine.encode(self._items, self._modality, bypass_admission=True,
                                          use_cache=False)
        except trio.TooSlowError:
            self._report(HealthReport(False, True, f"{req_id} took over {self._timeout} s"))
        except EPDError as exc:
            self._report(HealthReport(False, True, f"{req_id} failed: {type(exc).__name__}: {exc}"))
        except Exception as exc:  # a bug must read as "unhealthy", not kill the server
            log.exception("health probe %s crashed", req_id)
            self._report(HealthReport(False, True, f"{req_id} crashed: {type(exc).__name__}"))
        else:
            self.batch_completed()
            self._report(HealthReport(True, True, f"{req_id} encoded ({self._modality})"))
        finally:
            self._inflight = None
            done.set()

    def _report(self, report: HealthReport) -> None:
        if not report.healthy:
            self._failures += 1
            log.warning("health probe: %s", report.detail)
        self._last_report = report

    def statistics(self) -> HealthStatistics:
        return HealthStatistics(self._probes, self._failures, self._last_ok, self._modality)
