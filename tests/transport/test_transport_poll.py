"""poll_until: looks often while a transfer is young, rarely once it is long."""

from __future__ import annotations

import itertools

import trio
import trio.testing

from epd_trio.transport._poll import LATE, SPIN_PASSES, poll_until


async def test_returns_at_once_when_already_done() -> None:
    calls = []
    await poll_until(lambda: calls.append(1) or True, max_pause=1.0)
    assert calls == [1]


async def test_a_long_wait_is_seen_late_by_at_most_an_eighth(
        autojump_clock: trio.testing.MockClock) -> None:
    looks: list[float] = []

    def done() -> bool:
        looks.append(trio.current_time())
        return trio.current_time() >= 1.0

    start = trio.current_time()
    await poll_until(done, max_pause=1.0)
    seen = trio.current_time() - start
    assert 1.0 <= seen <= 1.0 * (1 + 1 / LATE) + 1e-6
    # the first looks spin (the mock clock stands still), then the pauses grow
    assert looks[SPIN_PASSES] == start and len(looks) < SPIN_PASSES + 200


async def test_pauses_never_exceed_max_pause(autojump_clock: trio.testing.MockClock) -> None:
    looks: list[float] = []

    def done() -> bool:
        looks.append(trio.current_time())
        return trio.current_time() >= 10.0

    await poll_until(done, max_pause=0.05)
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert max(gaps) <= 0.05 + 1e-9 and trio.current_time() <= 10.05 + 1e-9


async def test_it_is_cancellable(autojump_clock: trio.testing.MockClock) -> None:
    with trio.move_on_after(3) as scope:
        await poll_until(lambda: False, max_pause=0.5)
    assert scope.cancelled_caught and trio.current_time() == 3


async def test_without_spin_the_pauses_start_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """spin=0 (a watched ZMQ send on few cores): no look at every pass, the trio thread sleeps."""
    looks: list[float] = []

    def done() -> bool:
        looks.append(trio.current_time())
        return trio.current_time() >= 1.0

    await poll_until(done, max_pause=1.0, spin=0)
    assert len(set(looks)) == len(looks)  # time passed between every two looks
    assert trio.current_time() <= 1.0 * (1 + 1 / LATE) + 1e-6
