"""The scheduler loop: admission, a bounded memory channel, and the GPU thread.

Callers are admitted against ``max_pending`` (a refusal is immediate: 503; with
several devices the ``Admission`` is shared), preprocess, then put a ``Job`` in
the scheduler's queue and wake its one loop task. The loop asks the pure policy
what to run and runs it in the device's worker thread (``run_sync``: the
engine's thread lane for the device, one thread).

A caller that leaves (cancelled) takes its job out of the queue at once, so no
payload outlives its caller and the queue never holds more jobs than callers
wait; a running job's share is dropped when the batch returns; other jobs in
the batch are unaffected. A failed batch is retried one
request at a time so one bad input fails alone. When the loop stops, every
job still waiting gets ``NotReadyError``: no caller is left hanging.

Device out-of-memory is not a device error (see ``failures``): the batch is
retried one request at a time, and one that still does not fit fails with 503.

A forward that fails with a *device* error (``is_device_error``) kills the
scheduler: the running batch fails with ``WorkerDeadError``, the jobs still
queued get ``JobNotRun`` (the dispatcher runs them on another device), later
submits get ``JobNotRun`` at once, and the loop ends.

With ``batch_learning`` (the engine's default), each modality that batches has
a ``BatchCapLearner``: every successful forward's time is reported to it, and
its token cap is handed to the policy with the queue (``batch_cap``).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import outcome
import trio

from epd_trio.errors import EncodeError, EPDError, NotReadyError, OverloadedError, WorkerDeadError
from epd_trio.model.adapters import PreprocessResult
from epd_trio.scheduling.batch_cap import BatchCapLearner, BatchCapSettings, BatchCapStatistics
from epd_trio.scheduling.dispatch import Admission, JobNotRun
from epd_trio.scheduling.failures import is_device_error, is_device_out_of_memory
from epd_trio.scheduling.policy import Batch, BatchPolicy, QueuedRequest, Wait, next_batch

__all__ = ["Forward", "Job", "Observer", "Scheduler", "SchedulerStatistics"]

log = logging.getLogger(__name__)

Forward = Callable[[Sequence[PreprocessResult]], list[Any]]
RunSync = Callable[..., Awaitable[Any]]  # run_sync(fn, *args): fn(*args) on a worker thread


class Observer(Protocol):
    """Told what happened, in the trio thread (metrics, the profiler's step count)."""

    def stage(self, name: str, seconds: float) -> None:
        """``name`` is ``queue`` or ``forward`` here (the engine and service add others)."""

    def batch(self, worker: int, size: int, tokens: int) -> None:
        """A forward of ``size`` requests, ``tokens`` output rows, ran on ``worker``."""


@dataclass(eq=False)
class Job:
    key: int
    payload: PreprocessResult
    enqueued_at: float
    done: trio.Event = field(default_factory=trio.Event)
    result: outcome.Outcome | None = None
    abandoned: bool = False

    def view(self) -> QueuedRequest:
        return QueuedRequest(self.key, self.payload.modality, self.payload.tokens, self.enqueued_at)

    def finish(self, result: outcome.Outcome) -> None:
        self.result = result
        self.done.set()


@dataclass(frozen=True)
class SchedulerStatistics:
    admitted: int
    queued: int
    running: int
    requests_done: int
    requests_failed: int
    requests_dropped: int
    batches_run: int
    batches_retried: int
    redispatched: int = 0  # queued jobs handed back (JobNotRun) when the device died
    dead: bool = False
    # The adaptive cap, per modality that has batched: most tokens per forward (0: one request).
    batch_token_caps: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Owns the queue between callers and one device's worker thread.

    ``forward`` (called in the worker thread) and ``run_sync`` are the seams a
    test may replace or wrap (``epd_trio.testing``).
    """

    def __init__(
        self, forward: Forward, policy: BatchPolicy, *, max_pending: int = 256,
        admission: Admission | None = None, index: int = 0, observers: list[Observer] | None = None,
        batch_learning: BatchCapSettings | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.forward = forward
        self.policy = policy
        self.max_pending = max_pending
        self.admission = admission or Admission(max_pending)
        self.index = index  # the device's place in the engine (metrics label it so)
        self.observers = observers if observers is not None else []  # shared with the engine
        self.dead: str | None = None  # why the device failed; None while it serves
        self.pending = 0  # callers waiting in submit(): the dispatcher's load measure
        self._keys = itertools.count()
        # Jobs waiting for a forward, oldest first. Unbounded on purpose: each has a caller
        # waiting in submit(), and admission bounds those (backpressure is its 503); a caller
        # that leaves takes its job out, so this holds no more than the callers still waiting.
        self._queue: dict[int, Job] = {}
        self._arrived = trio.Event()  # set when a job is queued; the loop waits on it when idle
        self._stopped = False
        self._inflight: list[Job] = []
        self._running = 0
        self._done = self._failed = self._dropped = self._batches = self._retried = 0
        self._redispatched = 0
        self._learning = batch_learning  # None: batches fill to the policy's ceilings
        self._learners: dict[str, BatchCapLearner] = {}
        # How a forward reaches the device's thread: the engine gives its device's thread lane.
        self.run_sync: RunSync = functools.partial(trio.to_thread.run_sync,
                                                   limiter=trio.CapacityLimiter(1))

    # ---- caller side ------------------------------------------------------
    @contextmanager
    def admit(self, *, bypass: bool = False) -> Iterator[None]:
        """Hold an admission slot for a request's whole stay; refuse at once when full."""
        with self.admission.admit(bypass=bypass):
            yield

    async def submit(self, payload: PreprocessResult) -> Any:
        """Queue a preprocessed request and wait for its share of a forward.

        Raises ``JobNotRun`` if this device is dead (or dies before the job runs).
        """
        if self.dead is not None:
            raise JobNotRun(f"device worker {self.index} has failed: {self.dead}")
        if self._stopped:
            raise NotReadyError("the scheduler has stopped")
        job = Job(next(self._keys), payload, trio.current_time())
        self._queue[job.key] = job
        self._arrived.set()
        self.pending += 1
        try:
            await job.done.wait()
        finally:
            self.pending -= 1
            if not job.done.is_set():
                job.abandoned = True
                if self._queue.pop(job.key, None) is not None:  # not running yet: gone at once
                    self._dropped += 1
        assert job.result is not None
        return job.result.unwrap()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            admitted=self.admission.admitted,
            queued=len(self._queue),
            running=self._running, requests_done=self._done, requests_failed=self._failed,
            requests_dropped=self._dropped, batches_run=self._batches,
            batches_retried=self._retried, redispatched=self._redispatched,
            dead=self.dead is not None,
            batch_token_caps={m: learner.statistics().cap_tokens for m, learner in self._learners.items()},
        )

    def batch_learning(self) -> dict[str, BatchCapStatistics]:
        """What each modality's adaptive cap has measured (empty when adaptation is off)."""
        return {m: learner.statistics() for m, learner in self._learners.items()}

    def __repr__(self) -> str:
        s = self.statistics()
        state = f" DEAD ({self.dead})" if self.dead is not None else ""
        return (f"<Scheduler {self.index}{state}: {s.admitted} admitted, {s.queued} queued, "
                f"{s.running} running, {s.batches_run} batches>")

    # ---- the loop ---------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while self.dead is None:
                decision = await self._next_decision()
                if isinstance(decision, Batch):
                    await self._run_batch([self._queue.pop(k) for k in decision.keys])
        finally:
            self._fail_all_waiting()

    async def _next_decision(self) -> Batch | None:
        while not self._queue:
            await self._next_arrival()
        queue = [j.view() for j in self._queue.values()]
        decision = next_batch(queue, trio.current_time(), self.policy, self._token_caps(queue))
        if isinstance(decision, Wait):
            with trio.move_on_at(decision.until):
                await self._next_arrival()
            return None
        return decision

    async def _next_arrival(self) -> None:
        """Until a job is queued after the last look (or one already was)."""
        await self._arrived.wait()
        self._arrived = trio.Event()

    def _token_caps(self, queue: list[QueuedRequest]) -> dict[str, int]:
        if queue:
            self._learner(queue[0].modality)  # in place before its modality's first batch
        return {m: learner.limit for m, learner in self._learners.items()}

    def _learner(self, modality: str) -> BatchCapLearner | None:
        """The modality's learner; None when adaptation is off or the modality runs alone."""
        if self._learning is None or modality in self.policy.solo_modalities:
            return None
        if modality not in self._learners:
            self._learners[modality] = BatchCapLearner(self.policy.max_batch_tokens, self._learning)
        return self._learners[modality]

    async def _run_batch(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if not j.abandoned]
        self._dropped += len(jobs) - len(live)
        if not live:
            return
        now = trio.current_time()
        for job in live:
            self._observe("stage", "queue", now - job.enqueued_at)
        self._running, self._inflight = len(live), live
        try:
            outputs = await self._call_forward(live)
        except Exception as exc:  # noqa: BLE001 - any forward failure is per-request below
            if is_device_error(exc):
                self._die(exc, ran=live, not_run=[])
            elif len(live) == 1:
                self._deliver(live[0], outcome.Error(_as_encode_error(exc)))
            else:
                log.warning("batch of %d failed (%r); retrying one request at a time", len(live), exc)
                if is_device_out_of_memory(exc) and (learner := self._learner(live[0].payload.modality)):
                    learner.out_of_memory(sum(j.payload.tokens for j in live))
                self._retried += 1
                await self._run_singly(live)
        else:
            for job, out in zip(live, outputs, strict=True):
                self._deliver(job, outcome.Value(out))
        # Not in a finally: if the loop is cancelled mid-forward, the run()
        # finally must still see these jobs to fail them.
        self._running, self._inflight = 0, []

    async def _run_singly(self, jobs: list[Job]) -> None:
        for n, job in enumerate(jobs):
            if job.abandoned:
                self._dropped += 1
                continue
            try:
                (out,) = await self._call_forward([job])
            except Exception as exc:  # noqa: BLE001
                if is_device_error(exc):
                    self._die(exc, ran=[job], not_run=jobs[n + 1:])
                    return
                self._deliver(job, outcome.Error(_as_encode_error(exc)))
            else:
                self._deliver(job, outcome.Value(out))

    async def _call_forward(self, jobs: list[Job]) -> list[Any]:
        self._batches += 1
        payloads = [j.payload for j in jobs]
        started = trio.current_time()
        try:
            # Not abandon_on_cancel: a running forward cannot be interrupted, and
            # its thread must finish before the model may be torn down.
            outputs = await self.run_sync(self.forward, payloads)
        finally:
            self._observe("stage", "forward", trio.current_time() - started)
            self._observe("batch", self.index, len(jobs), sum(p.tokens for p in payloads))
        if len(outputs) != len(jobs):  # a replaced forward's bug: the batch fails, the loop stays
            raise EncodeError(f"the forward returned {len(outputs)} outputs for {len(jobs)} requests")
        if learner := self._learner(payloads[0].modality):
            learner.observe(len(payloads), sum(p.tokens for p in payloads), trio.current_time() - started)
        return outputs

    def _observe(self, what: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, what)(*args)
            except Exception:  # an observer's bug must not fail a request
                log.exception("observer %r failed", observer)

    def _die(self, exc: BaseException, *, ran: list[Job], not_run: list[Job]) -> None:
        """The device failed: ``ran`` fail, everything not yet run goes back to the dispatcher."""
        self.dead = f"{type(exc).__name__}: {exc}"[:500]
        log.error("device worker %d failed; it takes no more requests: %s", self.index, self.dead)
        for job in ran:
            self._deliver(job, outcome.Error(WorkerDeadError(
                f"device worker {self.index} failed during this request's forward: {self.dead}")))
        for job in [*not_run, *self._queue.values()]:
            self._hand_back(job)
        self._queue.clear()

    def _hand_back(self, job: Job) -> None:
        if job.done.is_set():
            return
        if job.abandoned:
            self._dropped += 1
        else:
            self._redispatched += 1
        job.finish(outcome.Error(JobNotRun(f"device worker {self.index} failed before this "
                                           f"request ran: {self.dead}")))

    def _deliver(self, job: Job, result: outcome.Outcome) -> None:
        if job.abandoned:
            self._dropped += 1
            return
        if isinstance(result, outcome.Error):
            self._failed += 1
        else:
            self._done += 1
        job.finish(result)

    def _fail_all_waiting(self) -> None:
        self._stopped = True  # later submits fail at once with NotReadyError
        for job in [*self._inflight, *self._queue.values()]:
            if self.dead is not None:
                self._hand_back(job)
            elif not job.done.is_set():
                job.finish(outcome.Error(NotReadyError("the encoder is shutting down")))
        self._queue.clear()
        self._running, self._inflight = 0, []


def _as_encode_error(exc: BaseException) -> EPDError:
    if isinstance(exc, EPDError):
        return exc
    if is_device_out_of_memory(exc):  # alone, and still too big for what the device has free
        log.warning("a request ran out of device memory on its own: %s", exc)
        return OverloadedError(f"the device ran out of memory for this request ({exc});"
                               " retry later, or with fewer or smaller items")
    log.error("forward failed", exc_info=exc)
    return EncodeError(f"the encoder's forward failed: {type(exc).__name__}: {exc}")
