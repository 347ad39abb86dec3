"""CPU seconds per stage, measured in the thread where each stage runs.

A capacity question ("how many images per second can this host feed its
device?") needs CPU time, not wall time: on a busy host a stage waits for a
core without using one. ``time.thread_time()`` read before and after a call
*inside its worker thread* is that call's own CPU time, whatever else the
process does meanwhile. The engine wraps its thread-run stages with ``timed``
(``preprocess``: decode + processor in a preprocessing thread,
``forward``: the device thread); ``/stats`` reports the totals (``cpu_seconds``), and
``tools/bench_capacity.py`` reads their growth per image.

What this cannot see, by design: work the stage hands to other threads
(torch's intra-op / OpenMP pools, ZMQ's I/O thread) or other processes. The
benchmark reads those from ``/proc`` per thread and process instead.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["StageCpu"]

P = ParamSpec("P")
R = TypeVar("R")


class StageCpu:
    """Cumulative CPU seconds and calls per stage; thread-safe (stages run in several threads)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds
            self._calls[stage] = self._calls.get(stage, 0) + 1

    def timed(self, stage: str, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` with its own thread's CPU time added to ``stage`` (failures count too)."""

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(stage, time.thread_time() - started)

        return run

    def statistics(self) -> dict[str, Any]:
        """``{stage: {"seconds": float, "calls": int}}``, a snapshot."""
        with self._lock:
            return {stage: {"seconds": self._seconds[stage], "calls": self._calls[stage]}
                    for stage in sorted(self._seconds)}

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {v['seconds']:.3f} s/{v['calls']}" for k, v in self.statistics().items())
        return f"<StageCpu {parts or 'nothing yet'}>"
