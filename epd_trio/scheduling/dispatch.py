"""One admission bound for all devices, and least-pending dispatch over their schedulers.

Data parallel: one ``EncoderWorker`` and one ``Scheduler`` per device, all behind one
``Admission`` bound (``max_pending`` counts requests, whichever device they end up on).
A request is preprocessed once, then handed to the live scheduler with the fewest requests pending; ties rotate, so
sequential requests spread over the devices too.

When a device fails (``is_device_error``), its scheduler marks itself dead:
the batch that was running fails with ``WorkerDeadError`` (503: the device may
have been killed *by* that input, so it is not retried on another device),
while requests still queued there — they never touched the device — come back
here as ``JobNotRun`` and are dispatched again to a live device. Later
requests go to live devices only; with none left, ``WorkerDeadError``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd_trio.errors import OverloadedError, WorkerDeadError
from epd_trio.model.adapters import PreprocessResult

if TYPE_CHECKING:
    from epd_trio.scheduling.batch_cap import BatchCapStatistics
    from epd_trio.scheduling.scheduler import Scheduler
    from epd_trio.scheduling.worker import EncoderWorker

__all__ = ["Admission", "AdmissionStatistics", "Dispatcher", "JobNotRun", "WorkerState"]


class JobNotRun(WorkerDeadError):
    """The device died before this request's forward started: safe to run elsewhere."""


@dataclass(frozen=True)
class AdmissionStatistics:
    admitted: int
    max_pending: int
    refused: int


class Admission:
    """Requests admitted (preprocessing, queued or running); full → ``OverloadedError`` at once."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.max_pending = max_pending
        self.admitted = 0
        self._refused = 0

    @contextmanager
    def admit(self, *, bypass: bool = False) -> Iterator[None]:
        """Hold a slot for a request's whole stay; ``bypass`` (health probes) is not counted against the bound."""
        if not bypass and self.admitted >= self.max_pending:
            self._refused += 1
            raise OverloadedError(f"encoder queue is full ({self.max_pending} pending requests)")
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1

    @asynccontextmanager
    async def enter(self, *, bypass: bool = False) -> AsyncIterator[None]:
        """``admit`` for async callers (the engine): an awaitable seam a test can wrap."""
        with self.admit(bypass=bypass):
            yield

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(self.admitted, self.max_pending, self._refused)

    def __repr__(self) -> str:
        return f"<Admission {self.admitted}/{self.max_pending} admitted>"


@dataclass(frozen=True)
class WorkerState:
    """One device's worker and scheduler, as ``/stats`` lists them under ``workers``."""

    index: int
    device: str
    state: str  # "alive" or "dead"
    error: str | None  # why it died
    pending: int  # requests dispatched to it and not yet answered
    queued: int
    running: int
    forwards: int
    items: int
    busy_seconds: float
    busy_fraction: float  # over the last 10 s
    requests_done: int
    requests_failed: int
    redispatched: int  # queued requests moved to another device when it died
    # The adaptive cap's measurements per modality (empty when adaptation is off).
    batch_learning: dict[str, BatchCapStatistics] = field(default_factory=dict)


class Dispatcher:
    """Sends preprocessed requests to the least-pending live scheduler."""

    def __init__(self, workers: Sequence[EncoderWorker], schedulers: Sequence[Scheduler]) -> None:
        if not schedulers or len(workers) != len(schedulers):
            raise ValueError("need one scheduler per worker, and at least one")
        self.workers = tuple(workers)
        self.schedulers = tuple(schedulers)
        self._turn = itertools.count()

    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.schedulers) if s.dead is None]

    def pick(self) -> Scheduler:
        """The live scheduler with the fewest pending requests; ties take turns."""
        live = self.live()
        if not live:
            raise WorkerDeadError("every device worker has failed: " + self.describe_dead())
        start = next(self._turn) % len(self.schedulers)
        order = sorted(live, key=lambda i: (self.schedulers[i].pending, (i - start) % len(self.schedulers)))
        return self.schedulers[order[0]]

    async def submit(self, payload: PreprocessResult) -> Any:
        """Run ``payload`` on a live device; re-dispatched if its device dies before the forward.

        Bounded: each retry follows a device's death, and dead devices are never picked again.
        """
        while True:
            scheduler = self.pick()
            try:
                return await scheduler.submit(payload)
            except JobNotRun:
                continue

    def describe_dead(self) -> str:
        dead = [f"worker {i} ({w.statistics().device}): {s.dead}" for i, (w, s)
                in enumerate(zip(self.workers, self.schedulers)) if s.dead is not None]
        return "; ".join(dead) or "none dead"

    def states(self) -> list[WorkerState]:
        out = []
        for i, (worker, scheduler) in enumerate(zip(self.workers, self.schedulers)):
            w, s = worker.statistics(), scheduler.statistics()
            out.append(WorkerState(
                index=i, device=w.device, state="alive" if scheduler.dead is None else "dead",
                error=scheduler.dead, pending=scheduler.pending, queued=s.queued, running=s.running,
                forwards=w.forwards, items=w.items, busy_seconds=w.busy_seconds,
                busy_fraction=worker.busy_fraction(), requests_done=s.requests_done,
                requests_failed=s.requests_failed, redispatched=s.redispatched,
                batch_learning=scheduler.batch_learning()))
        return out
