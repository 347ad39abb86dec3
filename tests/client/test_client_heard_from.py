"""``wait_heard_from``: a late delivery has its encoder asked, on trio's clock (no sockets)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trio
import trio.testing

from epd_trio.client.liveness import PEER_LOST_AFTER, wait_heard_from
from epd_trio.errors import PeerUnavailable
from epd_trio.protocol.grpc_messages import KEEPALIVE_PING_INTERVAL_S

INTERVAL = KEEPALIVE_PING_INTERVAL_S


def probe(answer_after: float | None, asked: list[float],
          fail: bool = False) -> Callable[[], Coroutine[Any, Any, None]]:
    """A peer that answers each probe after ``answer_after`` s (None: never), or refuses."""
    async def ask() -> None:
        asked.append(trio.current_time())
        if fail:
            raise PeerUnavailable("connection refused")
        if answer_after is None:
            await trio.sleep_forever()
        await trio.sleep(answer_after)
    return ask


async def arrive_at(event: trio.Event, t: float) -> None:
    await trio.sleep_until(t)
    event.set()


async def test_a_message_that_comes_in_time_asks_nothing(autojump_clock: trio.testing.MockClock) -> None:
    arrived, asked = trio.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrive_at, arrived, INTERVAL - 0.1)
        await wait_heard_from(arrived, probe(0.0, asked), "m")
    assert asked == [] and trio.current_time() == pytest.approx(INTERVAL - 0.1)


async def test_a_live_encoder_is_asked_every_interval_and_waited_for(
        autojump_clock: trio.testing.MockClock) -> None:
    arrived, asked = trio.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrive_at, arrived, 3 * PEER_LOST_AFTER)
        await wait_heard_from(arrived, probe(0.5, asked), "m")
    assert trio.current_time() == pytest.approx(3 * PEER_LOST_AFTER)
    assert asked == pytest.approx([INTERVAL + i * (INTERVAL + 0.5) for i in range(len(asked))])
    assert len(asked) == 6  # at 5, 10.5, ... 32.5 s: none gave it up


async def test_a_silent_encoder_is_given_up_on_peer_lost_after_the_answer(
        autojump_clock: trio.testing.MockClock) -> None:
    asked: list[float] = []
    with pytest.raises(PeerUnavailable, match=r"m: the encoder was not heard from for 11 s \(no answer\)"):
        await wait_heard_from(trio.Event(), probe(None, asked), "m")
    assert asked == [INTERVAL] and trio.current_time() == pytest.approx(PEER_LOST_AFTER)


async def test_an_unreachable_encoder_is_given_up_on_at_its_first_probe(
        autojump_clock: trio.testing.MockClock) -> None:
    asked: list[float] = []
    with pytest.raises(PeerUnavailable, match="connection refused") as info:
        await wait_heard_from(trio.Event(), probe(0.0, asked, fail=True), "m")
    assert "not heard from" in str(info.value)
    assert asked == [INTERVAL] and trio.current_time() == pytest.approx(INTERVAL)


async def test_the_message_arriving_mid_probe_ends_the_wait_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    arrived, asked = trio.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrive_at, arrived, INTERVAL + 2.0)
        await wait_heard_from(arrived, probe(None, asked), "m")
    assert asked == [INTERVAL] and trio.current_time() == pytest.approx(INTERVAL + 2.0)
