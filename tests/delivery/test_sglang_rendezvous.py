"""The SGLang rendezvous table on its own, under a MockClock: every wait bounded, nothing left."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import trio
import trio.testing

from epd_trio.delivery.sglang_rendezvous import Rendezvous, RendezvousStatistics
from epd_trio.errors import (
    ConflictError,
    DeadlineExceeded,
    EncodeError,
    OverloadedError,
    RequestError,
    UnknownRequestError,
)

EMPTY = RendezvousStatistics(0, 0, 0, 0, 0, 0, 0)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_registrations_before_and_after_the_claim(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    returned: list[tuple[str, float]] = []

    async def register(url: str) -> None:
        await table.register("r_local_part_0", 2, url, timeout=10)
        returned.append((url, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(register, "h:1")
        await trio.sleep(3)
        assert table.statistics() == RendezvousStatistics(1, 0, 1, 1, 0, 1, 0)
        entry = table.claim("r_local_part_0")
        await trio.testing.wait_all_tasks_blocked()
        assert returned == [("h:1", 3.0)]
        nursery.start_soon(register, "h:2")
        nursery.start_soon(register, "h:2")  # a retry: destinations are a set
    assert list(entry.destinations) == ["h:1", "h:2"] and entry.receive_count == 2
    assert [t for _, t in returned] == [3.0, 3.0, 3.0]
    table.release(entry)
    assert table.statistics() == RendezvousStatistics(0, 0, 0, 0, 1, 0, 0)


async def test_an_unclaimed_registration_is_withdrawn_at_its_deadline(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    with pytest.raises(DeadlineExceeded):
        await table.register("lonely", 1, "h:1", timeout=7.5)
    assert trio.current_time() == 7.5 and table.statistics() == EMPTY


async def test_a_cancelled_registration_leaves_nothing(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: table.register("gone", 1, "h:1", timeout=100))
        await trio.sleep(2)
        assert table.statistics() == RendezvousStatistics(1, 0, 1, 1, 0, 1, 0)  # live: registered, waiting
        nursery.cancel_scope.cancel()  # the rank's HTTP client went away
    assert trio.current_time() == 2  # cancelled, not timed out
    assert table.statistics() == EMPTY


async def test_another_receive_count_is_a_400_and_a_second_claim_a_409(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    entry = table.claim("r")
    await table.register("r", 2, "h:1", timeout=1)
    with pytest.raises(RequestError, match="receive_count 3"):
        await table.register("r", 3, "h:2", timeout=1)
    with pytest.raises(ConflictError):
        table.claim("r")
    table.release(entry)
    assert table.statistics() == RendezvousStatistics(0, 0, 0, 0, 1, 0, 0)


async def test_sizes_wait_until_published_or_failed_or_timed_out(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    got: list[object] = []

    async def wait(req_id: str) -> None:
        try:
            got.append((await table.wait_sizes(req_id, timeout=20), trio.current_time()))
        except (DeadlineExceeded, EncodeError, UnknownRequestError) as exc:
            got.append((type(exc).__name__, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for req_id in ("sized", "failed", "never", "released"):
            nursery.start_soon(wait, req_id)
        await trio.sleep(1)
        table.claim("sized").publish_sizes({"embedding_size": 8, "embedding_len": 2, "embedding_dim": 1})
        await trio.sleep(1)
        table.claim("failed").publish_error(EncodeError("boom"))
        await trio.sleep(1)
        table.release(table.claim("released"))
    assert sorted(got, key=str) == sorted([
        ({"embedding_size": 8, "embedding_len": 2, "embedding_dim": 1}, 1.0),
        ("EncodeError", 2.0), ("UnknownRequestError", 3.0), ("DeadlineExceeded", 20.0)], key=str)
    assert table.statistics() == RendezvousStatistics(2, 2, 0, 0, 1, 0, 0)  # sized and failed: still claimed


async def test_late_callers_hear_how_the_part_ended_at_once(clock: trio.testing.MockClock) -> None:
    table = Rendezvous(max_ended=2)
    failed = table.claim("failed")
    failed.publish_error(EncodeError("boom"))
    table.release(failed)
    table.release(table.claim("done"))
    with pytest.raises(EncodeError, match="boom"):
        await table.register("failed", 1, "h:1", timeout=50)
    with pytest.raises(UnknownRequestError):
        await table.wait_sizes("done", timeout=50)
    assert trio.current_time() == 0 and table.statistics() == RendezvousStatistics(0, 0, 0, 0, 2, 0, 0)
    table.release(table.claim("third"))  # the oldest ending is forgotten: the memory is bounded
    assert table.statistics().ended == 2
    with pytest.raises(DeadlineExceeded):
        await table.register("failed", 1, "h:1", timeout=5)


async def test_a_reused_id_waits_for_its_new_encode_once_admitted(clock: trio.testing.MockClock) -> None:
    """A new ``/encode`` of an ended id, admitted but not yet claimed (preprocessing): a rank
    that registers now waits for the new part rather than hearing the old one's ending."""
    table = Rendezvous()
    table.release(table.claim("r_local_part_0"))
    table.expect("r_local_part_0")
    returned: list[Any] = []

    async def register() -> None:  # zmq_to_scheduler's rank
        await table.register("r_local_part_0", 1, "h:1", timeout=50)
        returned.append(trio.current_time())

    async def sizes() -> None:  # mooncake's rank
        returned.append(await table.wait_sizes("r_local_part_0", timeout=50))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(register)
        nursery.start_soon(sizes)
        await trio.sleep(3)
        assert table.statistics() == RendezvousStatistics(1, 0, 2, 1, 0, 2, 0)
        entry = table.claim("r_local_part_0")
        await trio.sleep(1)
        entry.publish_sizes({"embedding_size": 8})
    assert returned == [3.0, {"embedding_size": 8}] and list(entry.destinations) == ["h:1"]


async def test_a_retried_registration_keeps_its_destination_until_the_last_call_leaves(
        clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    outcomes: list[str] = []

    async def register(timeout: float, req_id: str = "r") -> None:
        try:
            await table.register(req_id, 1, "h:1", timeout=timeout)
            outcomes.append("held")
        except DeadlineExceeded:
            outcomes.append("504")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(register, 5.0)
        await trio.sleep(1)
        nursery.start_soon(register, 10.0)  # the rank's retry, same destination, first still waiting
        await trio.sleep(6)  # the first call has timed out; the retry still waits
        assert outcomes == ["504"] and table.statistics().destinations == 1
        entry = table.claim("r")
    assert outcomes == ["504", "held"]
    assert entry.destinations == {"h:1": 1} and entry.receive_count == 1  # the retry's, not lost
    table.release(entry)
    async with trio.open_nursery() as nursery:  # both time out: each withdraws its own, no KeyError
        nursery.start_soon(register, 2.0, "s")
        nursery.start_soon(register, 3.0, "s")
    assert outcomes[2:] == ["504", "504"] and table.statistics().entries == 0


async def test_a_rank_that_leaves_takes_its_destination_with_it(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: table.register("r", 2, "stays:1", timeout=100))
        with trio.move_on_after(2):  # this rank's HTTP client went away
            await table.register("r", 2, "left:2", timeout=100)
        entry = table.claim("r")
    assert list(entry.destinations) == ["stays:1"]  # never sent to the rank that left
    table.release(entry)


async def test_a_remembered_error_is_raised_afresh_each_time(clock: trio.testing.MockClock) -> None:
    table = Rendezvous()
    failed = table.claim("f")
    failed.publish_error(EncodeError("boom"))
    table.release(failed)
    depths = []
    for _ in range(3):
        with pytest.raises(EncodeError, match="boom") as info:
            await table.register("f", 1, "h:1", timeout=1)
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
        assert info.value is not failed.error and info.value.status_code == failed.error.status_code
    assert depths[0] == depths[1] == depths[2]  # a stored error re-raised would grow each time


async def test_early_calls_are_bounded_and_a_claim_frees_their_places(clock: trio.testing.MockClock) -> None:
    table = Rendezvous(max_early=3)
    outcomes: list[str] = []

    async def call(kind: str, req_id: str) -> None:
        try:
            if kind == "url":
                await table.register(req_id, 1, "h:1", timeout=50)
            else:
                await table.wait_sizes(req_id, timeout=50)
            outcomes.append(f"{kind} {req_id} ok")
        except OverloadedError:
            outcomes.append(f"{kind} {req_id} 503 at {trio.current_time()}")

    async with trio.open_nursery() as nursery:
        for kind, req_id in (("url", "a"), ("sizes", "a"), ("url", "b")):
            nursery.start_soon(call, kind, req_id)
        await trio.sleep(1)
        assert table.statistics().early == 3
        await call("url", "c")  # a new part
        await call("sizes", "b")  # and a known but unclaimed one: both refused, nothing kept
        assert outcomes == ["url c 503 at 1.0", "sizes b 503 at 1.0"]
        assert table.statistics() == RendezvousStatistics(2, 0, 3, 2, 0, 3, 2)
        a = table.claim("a")  # its two waiters are no longer early
        await trio.testing.wait_all_tasks_blocked()
        assert table.statistics().early == 1
        nursery.start_soon(call, "sizes", "a")  # a claimed part's waiters are not bounded here
        nursery.start_soon(call, "url", "d")
        nursery.start_soon(call, "url", "e")
        await trio.sleep(1)
        assert table.statistics().early == 3
        await call("url", "f")
        a.publish_sizes({"embedding_size": 4, "embedding_len": 1, "embedding_dim": 1})
        for req_id in "bde":
            table.release(table.claim(req_id))
        table.release(a)
    assert outcomes.count("url f 503 at 2.0") == 1 and len(outcomes) == 9, outcomes
    assert sum(o.endswith(" ok") for o in outcomes) == 6
    assert trio.current_time() == 2  # every waiter was answered by a claim, none timed out
    assert table.statistics() == RendezvousStatistics(0, 0, 0, 0, 4, 0, 3)


def test_the_early_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_early"):
        Rendezvous(max_early=0)


async def test_a_remembered_error_does_not_keep_the_failed_requests_frames_alive(
        clock: trio.testing.MockClock) -> None:
    import gc
    import weakref

    class Body:  # stands in for a request's body, a local of the frame that raised
        pass

    def fail_with_a_body_in_the_frame() -> EncodeError:
        body = Body()
        seen.append(weakref.ref(body))
        try:
            raise EncodeError("boom", req_id="f")
        except EncodeError as exc:
            return exc

    seen: list[weakref.ref[Body]] = []
    table = Rendezvous()
    entry = table.claim("f")
    error = fail_with_a_body_in_the_frame()
    entry.publish_error(error)
    table.release(entry)
    del error, entry
    gc.collect()
    assert seen[0]() is None, "the endings table keeps a failed request's frame alive"
    with pytest.raises(EncodeError, match="boom"):  # and still says how the part ended
        await table.register("f", 1, "h:1", timeout=1)
