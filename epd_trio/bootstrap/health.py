"""The registry's supervised health loop.

Every ``interval`` seconds (trio-util ``periodic``: the schedule does not
drift by the time a round takes) the loop forgets encoders evicted
``evicted_ttl`` ago, then probes every known encoder concurrently, each under
``move_on_after(timeout)``, and applies each result as it arrives. A probe
that raises anything but "no" is a bug in the probe: it crashes the round,
and the supervisor logs it and restarts the loop after a capped exponential
backoff (reset once a round completes), while the registry keeps serving.

The probe is injectable (``Probe``: ``async (url) -> bool``); the default,
``http_probe``, is ``GET {url}/health`` → 200.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

import httpx
import trio
from trio_util import periodic

from epd_trio._util import first_leaf
from epd_trio.bootstrap.backoff import backoff_delay
from epd_trio.bootstrap.registry import Registry, Transition

__all__ = ["HealthLoop", "HealthLoopStatistics", "Probe", "http_probe"]

log = logging.getLogger(__name__)

Probe = Callable[[str], Awaitable[bool]]

RESTART_INITIAL = 1.0  # seconds before the first restart after a crash
RESTART_MAX = 60.0  # the backoff's cap


def http_probe(http: httpx.AsyncClient) -> Probe:
    """``GET {url}/health``: healthy iff 200. Network failures are a plain "no", and so is a
    URL the HTTP stack cannot use (``ValueError``, e.g. a host IDNA refuses; ``OSError``)."""

    async def probe(url: str) -> bool:
        try:
            response = await http.get(url + "/health")
        except (httpx.HTTPError, ValueError, OSError) as exc:
            log.debug("probe %s: %s", url, exc)
            return False
        return response.status_code == 200

    return probe


@dataclass(frozen=True)
class HealthLoopStatistics:
    running: bool  # False while waiting to restart after a crash (or before start)
    rounds: int  # completed rounds
    probes: int  # probes finished (answered, refused or timed out)
    timeouts: int  # probes cut off by ``timeout``
    crashes: int
    restart_delay: float | None  # the pending restart's delay, while not running
    last_crash: str | None  # "ExceptionType: message" of the latest crash


class HealthLoop:
    """``await nursery.start(loop.run)``: probes ``registry``'s encoders until cancelled."""

    def __init__(self, registry: Registry, probe: Probe, *, interval: float, timeout: float,
                 restart_initial: float = RESTART_INITIAL, restart_max: float = RESTART_MAX,
                 what: str = "encoder") -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        self.registry = registry
        self.what = what  # what the logs call the probed servers
        self.interval = interval
        self.timeout = timeout
        self._probe = probe
        self._restart = (restart_initial, restart_max)
        self._running = False
        self._rounds = self._probes = self._timeouts = self._crashes = 0
        self._restart_delay: float | None = None
        self._last_crash: str | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The supervisor: run the loop; on a crash, log, back off, run it again."""
        task_status.started()
        attempt = 0
        while True:
            rounds_before = self._rounds
            crash = await self._run_until_crash()
            self._crashes += 1
            leaf = first_leaf(crash)  # the probe's own error, not trio's group around it
            self._last_crash = f"{type(leaf).__name__}: {leaf}"
            attempt = 0 if self._rounds > rounds_before else attempt  # it worked for a while
            self._restart_delay = backoff_delay(attempt, *self._restart)
            attempt += 1
            log.error("health loop crashed; restarting in %.3g s", self._restart_delay, exc_info=crash)
            del crash, leaf
            await trio.sleep(self._restart_delay)
            self._restart_delay = None

    async def _run_until_crash(self) -> Exception:
        self._running = True
        try:
            async with aclosing(periodic(self.interval)) as ticks:
                async for _ in ticks:
                    await self.round()
        except Exception as exc:  # noqa: BLE001 — a crash must not take the registry down
            return exc
        finally:
            self._running = False
        raise AssertionError("periodic() never ends")  # pragma: no cover

    async def round(self) -> None:
        """One round: forget the long-evicted, then probe everyone concurrently."""
        for url in self.registry.expire(trio.current_time()):
            log.info("forgot %s %s (evicted for %.0f s)", self.what, url, self.registry.evicted_ttl)
        async with trio.open_nursery() as nursery:
            for url in self.registry.urls():
                nursery.start_soon(self._probe_one, url)
        self._rounds += 1

    async def _probe_one(self, url: str) -> None:
        ok = False
        with trio.move_on_after(self.timeout) as scope:
            ok = await self._probe(url)
        self._probes += 1
        self._timeouts += scope.cancelled_caught
        change = self.registry.record_probe(url, bool(ok), trio.current_time())
        if change is Transition.EVICTED:
            log.warning("evicted %s %s after %d missed probes", self.what, url,
                        self.registry.max_failures)
        elif change is Transition.REVIVED:
            log.info("revived %s %s", self.what, url)

    def statistics(self) -> HealthLoopStatistics:
        return HealthLoopStatistics(
            running=self._running, rounds=self._rounds, probes=self._probes,
            timeouts=self._timeouts, crashes=self._crashes, restart_delay=self._restart_delay,
            last_crash=self._last_crash)

    def __repr__(self) -> str:
        s = self.statistics()
        state = "running" if s.running else f"restarting in {s.restart_delay}"
        return (f"<HealthLoop {state}: {s.rounds} rounds, {s.probes} probes "
                f"({s.timeouts} timed out), {s.crashes} crashes>")
