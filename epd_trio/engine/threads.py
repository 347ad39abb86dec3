"""How many torch threads each part of the engine gets: the CPU budget.

On a CPU device the forward and preprocessing share the same cores. Left
alone, every thread that calls torch starts its own OpenMP team of
``torch.get_num_threads()`` (all cores): with two preprocessing workers and a
forward, three teams fight over the cores, and a forward's parallel regions
wait at their barriers for threads the OS has parked (measured: each forward
~10 % slower than alone on 2 cores). So the budget is explicit:

* each **forward** on a CPU device runs with ``cpu_threads`` intra-op threads
  (0: the cores this process may use, shared evenly among the CPU workers);
* each **preprocessing** worker runs torch with ``preprocess_threads`` (1 by
  default: the processor's tensor ops on one image are small, and one thread
  starts no OpenMP team at all).

``torch.set_num_threads`` is per calling thread for OpenMP and MKL, so each
job sets its own count on entry (an engine's preprocessing and each device's
forwards run on thread lanes of their own, ``scheduling.lane``, but an engine
made without ``open_engine`` uses trio's thread cache, which hands the same
thread to both in turn). It also becomes the default of
threads that have not used torch yet, so a preprocessing job puts the
thread's previous count back when it ends (threads the host application
starts later are not left at 1). The OpenMP *waiting* policy cannot be
changed once torch is loaded: set ``OMP_WAIT_POLICY=PASSIVE`` in the
environment (docs/deployment.md, "Threads").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from epd_trio.config import available_cores

__all__ = ["ThreadBudget", "available_cores", "thread_budget", "use_torch_threads", "with_torch_threads"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class ThreadBudget:
    """Torch intra-op threads per forward (None: leave torch's default) and per preprocessing job."""

    forward: int | None
    preprocess: int

    def describe(self, preprocess_workers: int) -> str:
        fwd = "torch default" if self.forward is None else f"{self.forward} per forward"
        return (f"torch threads: {fwd}; {self.preprocess} per preprocessing worker "
                f"× {preprocess_workers}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")


def thread_budget(devices: Sequence[str], cores: int, *, cpu_threads: int = 0,
                  preprocess_threads: int = 1) -> ThreadBudget:
    """Pure: the budget for these devices on ``cores`` cores.

    Only CPU forwards get a count: a GPU forward's host side is launch
    overhead that more threads do not speed up, so torch's default stays.
    """
    if cpu_threads < 0 or preprocess_threads < 1:
        raise ValueError("cpu_threads must be >= 0 and preprocess_threads >= 1")
    cpu_workers = sum(1 for d in devices if d.strip().split(":")[0] == "cpu")
    if not cpu_workers:
        return ThreadBudget(None, preprocess_threads)
    return ThreadBudget(cpu_threads or max(1, cores // cpu_workers), preprocess_threads)


def use_torch_threads(n: int | None) -> None:
    """Give the calling thread ``n`` torch intra-op threads (None: leave it as it is)."""
    import torch

    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def with_torch_threads(n: int | None, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` in the calling thread with ``n`` torch threads (for ``to_thread``);
    the thread's previous count is put back afterwards."""
    import torch

    before = torch.get_num_threads()
    use_torch_threads(n)
    try:
        return fn(*args, **kwargs)
    finally:
        use_torch_threads(before)
