"""The testing tools themselves: quiescence reports and seeded fault plans."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from epd_trio.errors import EPDError, TransportError
from epd_trio.testing import (
    Fault,
    FaultPlan,
    InjectedFault,
    NotQuiescent,
    assert_quiescent,
    install_faults,
    quiescence_problems,
)


@dataclass(frozen=True)
class Inner:
    used_bytes: int = 0
    acquired: int = 7


@dataclass(frozen=True)
class Stats:
    live_requests: int = 0
    requests_done: int = 3
    outstanding: dict[str, int] = field(default_factory=dict)
    pool: Inner = Inner()


class Owner:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def statistics(self) -> Stats:
        return self.stats


def test_quiescence_names_owner_and_field() -> None:
    busy = Owner(Stats(live_requests=2, outstanding={"http://a.b:1": 1}, pool=Inner(used_bytes=64)))
    problems = quiescence_problems({"enc": Owner(Stats()), "client": busy})
    assert problems == ["client.live_requests=2 (idle is 0)", "client.outstanding.http://a.b:1=1 (idle is 0)",
                        "client.pool.used_bytes=64 (idle is 0)"]
    with pytest.raises(NotQuiescent, match=r"client.live_requests=2"):
        assert_quiescent({"client": busy})
    assert_quiescent({"remote": {"live_requests": 0, "registry": {"live_requests": 0}, "started": 9}})
    assert_quiescent({"c": Owner(Stats(live_requests=1))}, idle={"c.live_requests": 1})


async def test_plan_is_seeded_and_replays() -> None:
    def run(seed: int) -> list[str]:
        plan = FaultPlan(seed, [Fault("send", probability=0.5, error=lambda p: TransportError(p))])
        out = []
        for _ in range(20):
            try:
                plan.inject_sync("send")
                out.append("ok")
            except TransportError:
                out.append("err")
        return out

    assert run(3) == run(3) and run(3) != run(4)
    def shape(plan: FaultPlan) -> list[tuple]:
        return [(f.point, f.probability, f.delay, f.cancel, f.error is None) for f in plan.faults]

    assert shape(FaultPlan.random(11)) == shape(FaultPlan.random(11)) != shape(FaultPlan.random(12))


async def test_inject_delay_error_and_cancel(autojump_clock: trio.testing.MockClock) -> None:
    plan = FaultPlan(0, [Fault("media_load", delay=1.5), Fault("forward", error=lambda p: InjectedFault(p)),
                         Fault("send", cancel=True)])
    t0 = trio.current_time()
    await plan.inject("media_load")
    assert trio.current_time() - t0 == 1.5
    with pytest.raises(EPDError, match="forward"):
        await plan.inject("forward")
    with trio.CancelScope() as scope:
        await plan.inject("send", cancel=scope.cancel)
        pytest.fail("the cancellation did not land")
    assert scope.cancelled_caught
    await plan.inject("demux")  # a point without faults does nothing
    assert plan.hits == {"media_load": 1, "forward": 1, "send": 1, "demux": 1}
    assert "media_load: delay 1.500" in plan.describe()


def test_unknown_point_and_install() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        Fault("teleport")

    class Component:  # a ``faults`` slot no longer makes an owner: parts are wrapped
        faults = None

    plan = FaultPlan(1)
    for stranger in (Component(), object()):
        with pytest.raises(TypeError, match="no fault injection points"):
            install_faults(plan, stranger)


def test_quiescence_walks_lists() -> None:
    stats = {"workers": [{"device": "cpu", "pending": 0}, {"device": "cpu", "pending": 2}]}
    assert quiescence_problems({"enc": stats}) == ["enc.workers.1.pending=2 (idle is 0)"]
