"""The supervised health loop under ``autojump_clock``: exact virtual times.

A scripted probe plays each encoder: ``script(url, now)`` says what the probe
called at virtual time ``now`` does — answer ``"ok"``, be refused (``"miss"``),
``"hang"`` past the timeout, or ``"crash"`` (a bug in the probe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import pytest
import trio

from epd_trio.bootstrap.health import HealthLoop, http_probe
from epd_trio.bootstrap.registry import Registry, Transition

Script = Callable[[str, float], str]


class RecordingRegistry(Registry):
    """A registry that remembers when each membership change happened."""

    def __init__(self, **kw: float) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.changes: list[tuple[float, str, str]] = []

    def record_probe(self, url: str, ok: bool, now: float) -> Transition | None:
        change = super().record_probe(url, ok, now)
        if change not in (None, Transition.UNCHANGED):
            self.changes.append((now, url, change.value))  # type: ignore[union-attr]
        return change

    def expire(self, now: float) -> list[str]:
        gone = super().expire(now)
        self.changes += [(now, url, "forgotten") for url in gone]
        return gone


class ScriptedProbe:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[tuple[float, str]] = []

    async def __call__(self, url: str) -> bool:
        now = trio.current_time()
        self.calls.append((now, url))
        outcome = self.script(url, now)
        if outcome == "hang":
            await trio.sleep_forever()
        if outcome == "crash":
            raise RuntimeError(f"probe bug at t={now:g}")
        return outcome == "ok"

    def times(self, url: str) -> list[float]:
        return [t for t, u in self.calls if u == url]


async def run_loop(script: Script, until: float, *, urls: tuple[str, ...] = ("http://a:1",),
                   max_failures: int = 3, evicted_ttl: float = 600.0, **kw: float
                   ) -> tuple[RecordingRegistry, ScriptedProbe, HealthLoop]:
    registry = RecordingRegistry(max_failures=max_failures, evicted_ttl=evicted_ttl)
    for url in urls:
        registry.register(url, trio.current_time())
    probe = ScriptedProbe(script)
    loop = HealthLoop(registry, probe, interval=10.0, timeout=2.0, **kw)
    with trio.move_on_after(until):
        await loop.run()
    return registry, probe, loop


async def test_eviction_at_the_third_missed_probe(autojump_clock: trio.abc.Clock) -> None:
    def script(url: str, now: float) -> str:
        if url == "http://refused:1":
            return "ok" if now < 10 else "miss"  # refused fast: counted at the probe's start
        return "ok" if now < 10 else "hang"  # hangs: counted when the 2 s timeout expires

    registry, probe, loop = await run_loop(script, 45.0, urls=("http://refused:1", "http://hung:1"))
    assert probe.times("http://refused:1") == [0.0, 10.0, 20.0, 30.0, 40.0]  # no drift
    assert probe.times("http://hung:1") == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert registry.changes == [(30.0, "http://refused:1", "evicted"), (32.0, "http://hung:1", "evicted")]
    assert registry.healthy_urls() == []
    s = loop.statistics()
    assert (s.rounds, s.probes, s.timeouts, s.crashes) == (5, 10, 4, 0)
    assert registry.get("http://hung:1").failures == 4  # type: ignore[union-attr]


async def test_one_answer_between_misses_resets_the_count(autojump_clock: trio.abc.Clock) -> None:
    registry, _, _ = await run_loop(lambda url, now: "ok" if now in (0.0, 30.0) else "miss", 65.0)
    assert registry.changes == [(60.0, "http://a:1", "evicted")]  # misses at 10, 20 | 40, 50, 60


async def test_evicted_encoder_is_still_probed_and_revived(autojump_clock: trio.abc.Clock) -> None:
    registry, probe, _ = await run_loop(
        lambda url, now: "miss" if 0 < now < 50 else "ok", 65.0)
    assert probe.times("http://a:1") == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert registry.changes == [(30.0, "http://a:1", "evicted"), (50.0, "http://a:1", "revived")]
    entry = registry.get("http://a:1")
    assert entry is not None and (entry.healthy, entry.failures, entry.last_ok) == (True, 0, 60.0)


async def test_forgotten_after_evicted_ttl(autojump_clock: trio.abc.Clock) -> None:
    registry, probe, _ = await run_loop(lambda url, now: "hang", 200.0, evicted_ttl=100.0)
    # misses at 2, 12, 22 → evicted at 22; round 120 (98 s later) still probes it,
    # round 130 (108 s) forgets it before probing.
    assert registry.changes == [(22.0, "http://a:1", "evicted"), (130.0, "http://a:1", "forgotten")]
    assert probe.times("http://a:1")[-1] == 120.0
    assert registry.urls() == [] and registry.statistics().forgotten == 1


async def test_loop_crash_is_restarted_with_capped_backoff(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    crash_at = {10.0, 11.0, 13.0, 16.0, 29.0}

    def script(url: str, now: float) -> str:
        return "crash" if now in crash_at else "ok"

    with caplog.at_level(logging.ERROR, logger="epd_trio.bootstrap.health"):
        registry, probe, loop = await run_loop(script, 45.0, restart_initial=1.0, restart_max=3.0)
    # crash at 10 → +1 → crash at 11 → +2 → crash at 13 → +3 (cap) → crash at 16 → +3 →
    # 19: a round completes, so the backoff resets: crash at 29 → +1 → 30, 40 on the new schedule.
    assert probe.times("http://a:1") == [0.0, 10.0, 11.0, 13.0, 16.0, 19.0, 29.0, 30.0, 40.0]
    s = loop.statistics()
    assert (s.crashes, s.rounds, s.last_crash) == (5, 4, "RuntimeError: probe bug at t=29")
    crashes = [r for r in caplog.records if "health loop crashed" in r.getMessage()]
    assert [r.getMessage() for r in crashes] == [
        f"health loop crashed; restarting in {d} s" for d in (1, 2, 3, 3, 1)]
    assert all(r.exc_info for r in crashes)
    assert registry.healthy_urls() == ["http://a:1"]  # the registry kept its state throughout


async def test_statistics_while_waiting_to_restart(autojump_clock: trio.abc.Clock) -> None:
    registry = Registry(max_failures=3, evicted_ttl=600.0)
    registry.register("http://a:1", 0.0)
    loop = HealthLoop(registry, ScriptedProbe(lambda url, now: "crash"), interval=10.0, timeout=2.0,
                      restart_initial=4.0, restart_max=8.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        await trio.sleep(1.0)
        s = loop.statistics()
        assert (s.running, s.restart_delay, s.crashes, s.rounds) == (False, 4.0, 1, 0)
        assert "restarting in 4.0" in repr(loop)
        await trio.sleep(4.0)  # restarted at 4, crashed again at once: now waits 8
        assert (loop.statistics().restart_delay, loop.statistics().crashes) == (8.0, 2)
        nursery.cancel_scope.cancel()


async def test_a_url_the_http_stack_refuses_is_a_miss_not_a_crash() -> None:
    """What ``normalize_url`` lets through must not stop the rounds: a host IDNA refuses
    (as one registered before the label check could be) is an unhealthy encoder."""
    async with httpx.AsyncClient(timeout=5) as http:
        probe = http_probe(http)
        assert await probe("http://" + "a" * 64 + ":1") is False  # UnicodeError inside httpx
        assert await probe("http://127.0.0.1:1") is False  # refused: the ordinary "no"
