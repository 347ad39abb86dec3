"""A thread lane: a fixed set of threads that run one kind of blocking work for trio.

Why not ``trio.to_thread.run_sync``: it is general (a capacity limiter, a
thread from a global cache, a context copy, a channel for ``trio.from_thread``
calls), and that generality cost the trio thread ~95 µs of CPU per call on the
project's 2-core VM, twice per request (preprocessing, then the forward). A
lane's threads are its bound, a job travels over a ``queue.SimpleQueue``, and
its outcome comes back with one ``TrioToken.run_sync_soon``: ~50 µs
(``tools/bench_capacity.py`` measures the whole request).

The semantics are ``trio.to_thread.run_sync``'s without ``abandon_on_cancel``:
a job cancelled while it waits for a thread never runs; one already running
is waited for (a forward cannot be interrupted, and the model must outlive
it), and the cancellation is delivered at the caller's next checkpoint. The
threads are the lane's own and end with its block (``open_thread_lane``);
they are not trio's, so a job that calls back into trio passes
``trio_token=`` to ``trio.from_thread``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import outcome
import trio

__all__ = ["ThreadLane", "open_thread_lane"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT: Final = 5.0  # seconds a closing lane waits for its threads (a job still running)


class _Job:
    __slots__ = ("args", "fn", "task")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], task: trio.lowlevel.Task) -> None:
        self.fn = fn
        self.args = args
        self.task = task


class ThreadLane:
    """``threads`` threads named ``name-N``; ``run_sync`` is the engine's and scheduler's seam."""

    def __init__(self, name: str, threads: int, token: trio.lowlevel.TrioToken) -> None:
        if threads < 1:
            raise ValueError("a thread lane needs at least one thread")
        self.name = name
        self._token = token
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Jobs not yet taken by a thread. Taking one (or cancelling it) is one set.remove, which
        # the GIL makes atomic: exactly one of the thread and the canceller gets it.
        self._waiting: set[_Job] = set()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on one of the lane's threads; its result, or its exception."""
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, args, trio.lowlevel.current_task())
        self._waiting.add(job)
        self._jobs.put(job)

        def abort(_: Any) -> trio.lowlevel.Abort:
            try:
                self._waiting.remove(job)  # not started: it never will
            except KeyError:
                return trio.lowlevel.Abort.FAILED  # running: its outcome still comes
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # the outcome, unwrapped

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._waiting.remove(job)
            except KeyError:
                continue  # cancelled while it waited
            result = outcome.capture(job.fn, *job.args)
            try:
                self._token.run_sync_soon(trio.lowlevel.reschedule, job.task, result)
            except trio.RunFinishedError:  # the run ended under us: nobody waits
                return

    def close(self, timeout: float) -> bool:
        """End the threads once each has finished its job; False if one still runs after
        ``timeout`` seconds. Blocking, but only for that: a lane is closed once every task
        that called it has returned, so its threads are idle, or skipping cancelled jobs."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def __repr__(self) -> str:
        return f"<ThreadLane {self.name!r}: {len(self._threads)} threads, {len(self._waiting)} waiting>"


@asynccontextmanager
async def open_thread_lane(name: str, threads: int) -> AsyncIterator[ThreadLane]:
    """A lane for the duration of the block; its threads end with it (joined, bounded)."""
    lane = ThreadLane(name, threads, trio.lowlevel.current_trio_token())
    try:
        yield lane
    finally:
        if not lane.close(_JOIN_TIMEOUT):
            log.warning("thread lane %r: a job still runs after %g s; its thread is left to end",
                        name, _JOIN_TIMEOUT)
