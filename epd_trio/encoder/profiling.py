"""``POST /start_profile`` and ``POST /stop_profile``: torch.profiler to a Chrome trace.

One profile at a time per encoder: starting while one runs, or stopping when
none does, is a ``ConflictError`` (409). The trace records CPU operators on
every thread (the forwards run in worker threads) and, where CUDA is present,
the device's kernels; it is written as Chrome-trace JSON (open it in Perfetto
or ``chrome://tracing``). With ``num_steps`` the profile stops by itself after
that many forwards.

Where traces go is the operator's choice, never the network's: every trace is
written under ``profile_dir`` (``--profile-dir``; default a new temporary
directory), and a request's ``output_dir`` is a directory *inside* it — a path
that resolves outside (``..``, an absolute path elsewhere, a symlink out) is
refused with 400. The endpoints are admin endpoints: with ``--auth-token`` they
need the bearer token.

torch.profiler must be started and stopped on the same thread, so both happen
on the trio thread; only writing the trace file runs in a worker thread.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from epd_trio.errors import ConflictError, RequestError

__all__ = ["Profiler", "ProfilerStatistics", "parse_profile_request"]

log = logging.getLogger(__name__)

MAX_STEPS = 100_000


@dataclass(frozen=True)
class ProfilerStatistics:
    running: bool
    steps: int  # forwards seen by the running profile
    traces_written: int
    last_trace: str | None
    root: str | None


def parse_profile_request(body: dict[str, Any]) -> tuple[str | None, int | None]:
    """``{output_dir?: str, num_steps?: int}`` → the two values, or a RequestError."""
    unknown = set(body) - {"output_dir", "num_steps"}
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}; expected output_dir, num_steps")
    output_dir, num_steps = body.get("output_dir"), body.get("num_steps")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir
                                   or len(output_dir) > 1024 or "\x00" in output_dir):
        raise RequestError("'output_dir' must be a non-empty path string")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                  or not 1 <= num_steps <= MAX_STEPS):
        raise RequestError(f"'num_steps' must be an integer in 1..{MAX_STEPS}")
    return output_dir, num_steps


class Profiler:
    """One encoder's profiler; an engine observer (``batch`` counts steps)."""

    def __init__(self, root: str | None, nursery: trio.Nursery) -> None:
        self._root = Path(root) if root else None
        self._nursery = nursery
        self._profile: Any = None  # torch.profiler.profile while running
        self._target: Path | None = None
        self._steps = 0
        self._num_steps: int | None = None
        self._stopping = False
        self._written = 0
        self._last: Path | None = None
        self._names = itertools.count()

    @property
    def running(self) -> bool:
        return self._profile is not None

    def root(self) -> Path:
        """``profile_dir``, created on first use (a fresh temporary directory by default)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="epd-trio-profile-"))
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    def resolve(self, output_dir: str | None) -> Path:
        """``output_dir`` inside the root (relative to it, or absolute but inside), or 400."""
        root = self.root().resolve()
        target = (root / output_dir).resolve() if output_dir else root
        if not target.is_relative_to(root):
            raise RequestError("'output_dir' must be inside the encoder's profile directory")
        return target

    def start(self, output_dir: str | None = None, num_steps: int | None = None) -> Path:
        if self._profile is not None or self._stopping:
            raise ConflictError("a profile is already running (POST /stop_profile first)")
        target = self.resolve(output_dir)
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a name too long, a file in the way: the caller's 'output_dir'
            raise RequestError(f"'output_dir' cannot be used as a directory ({exc.strerror or exc})") from None
        profile = _new_profile()
        profile.start()
        self._profile, self._target = profile, target
        self._steps, self._num_steps = 0, num_steps
        log.info("profiling started; the trace goes to %s", target)
        return target

    async def stop(self) -> Path:
        """Stop the running profile and write its trace; the trace's path."""
        if self._profile is None or self._stopping:
            raise ConflictError("no profile is running (POST /start_profile first)")
        profile, target = self._profile, self._target
        assert target is not None
        self._stopping = True
        try:
            profile.stop()  # the thread that started it
            self._profile = None
            path = target / f"epd-trio-trace-{time.strftime('%Y%m%d-%H%M%S')}-{next(self._names)}.json"
            with trio.CancelScope(shield=True):  # a half-written trace helps nobody
                await trio.to_thread.run_sync(profile.export_chrome_trace, str(path))
        finally:
            self._profile, self._stopping = None, False
        self._written += 1
        self._last = path
        log.info("profile written to %s", path)
        return path

    def close(self) -> None:
        """Shutdown: a running profile is stopped and its trace written (blocking)."""
        if self._profile is None:
            return
        profile, target = self._profile, self._target
        self._profile = None
        assert target is not None
        try:
            profile.stop()
            profile.export_chrome_trace(str(target / f"epd-trio-trace-at-shutdown-{next(self._names)}.json"))
        except Exception:  # shutdown goes on (a failed device makes stop() raise)
            log.exception("the profile could not be stopped and written at shutdown")

    # ---- observer --------------------------------------------------------------
    def stage(self, name: str, seconds: float) -> None:
        pass

    def batch(self, worker: int, size: int, tokens: int) -> None:
        if self._profile is None or self._stopping:
            return
        self._steps += 1
        self._profile.step()
        if self._num_steps is not None and self._steps >= self._num_steps:
            self._nursery.start_soon(self._stop_quietly)

    async def _stop_quietly(self) -> None:
        try:
            await self.stop()
        except ConflictError:  # already stopped by /stop_profile meanwhile
            pass
        except Exception:  # this task runs in the service's nursery: never crash it
            # With CUDA, stopping synchronizes the device, which raises once a
            # worker has left it in a failed state; a full disk fails the export.
            log.exception("the profile could not be stopped and written")

    def statistics(self) -> ProfilerStatistics:
        return ProfilerStatistics(
            running=self._profile is not None or self._stopping, steps=self._steps,
            traces_written=self._written,
            last_trace=str(self._last) if self._last else None,
            root=str(self._root) if self._root else None)


def _new_profile() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    try:  # every thread, not only the one that starts it (torch >= 2.8)
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        config = None
    return profile(activities=activities, experimental_config=config)
