"""``tools/probe_grpc.py``'s candidates A and C, tiny and in-process: real grpcio clients get the
right bytes, a cancel and a deadline reach the trio task, Watch pushes a change (no timings)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from types import ModuleType

import grpc
import pytest
import trio

from conftest import load_tool


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    return load_tool("probe_grpc")


Serve = Callable[..., contextlib.AbstractAsyncContextManager[int]]


@pytest.fixture(params=["A", "C"])
def candidate(request: pytest.FixtureRequest, probe: ModuleType) -> Serve:
    return probe.CANDIDATES[request.param].serve


@contextlib.asynccontextmanager
async def serving(probe: ModuleType, candidate: Serve) -> AsyncIterator[tuple[object, str]]:
    service = probe.TrioService()
    async with candidate(service) as port:
        yield service, f"127.0.0.1:{port}"


async def test_unary_echo_answers_the_bytes(probe: ModuleType, candidate: Serve) -> None:
    async with serving(probe, candidate) as (_service, target):
        payloads = [b"", b"a", bytes(range(256)) * 40]
        answers, _ = await trio.to_thread.run_sync(probe.echo_calls, target, payloads)
    assert answers == payloads


async def test_unknown_method_is_an_error_not_a_hang(probe: ModuleType, candidate: Serve) -> None:
    def call() -> grpc.StatusCode:
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary("/probe.Probe/Nope")(b"", timeout=10)
        return caught.value.code()

    async with serving(probe, candidate) as (_service, target):
        assert await trio.to_thread.run_sync(call) == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("deadline_s", [None, 0.2], ids=["client-cancel", "deadline"])
async def test_the_end_of_the_call_cancels_its_trio_task(
        probe: ModuleType, candidate: Serve, deadline_s: float | None) -> None:
    async with serving(probe, candidate) as (service, target):
        result = await trio.to_thread.run_sync(probe.cancel_probe, target, deadline_s)
        [record] = service.calls.values()
    assert result.cancelled and result.delay_s is not None
    assert record.cancelled and record.ended is not None
    assert result.client_code == ("CANCELLED" if deadline_s is None else "DEADLINE_EXCEEDED")


async def test_watch_pushes_a_change_and_ends_on_cancel(probe: ModuleType,
                                                        candidate: Serve) -> None:
    async with serving(probe, candidate) as (service, target):
        result = await trio.to_thread.run_sync(probe.watch_probe, target)
        assert service.watchers == 0
    assert result.statuses == [probe.SERVING, probe.NOT_SERVING]
    assert result.watchers_left == 0


def test_frames_round_trip_and_the_timeout_header_parses(probe: ModuleType) -> None:
    assert probe.unframe(probe.frame(b"abc")) == b"abc"
    with pytest.raises(ValueError):
        probe.unframe(b"\x01\x00\x00\x00\x01a")  # compressed
    assert probe.grpc_timeout([(b"grpc-timeout", b"250m")]) == pytest.approx(0.25)
    assert probe.grpc_timeout([(b"grpc-timeout", b"3S")]) == 3.0
    assert probe.grpc_timeout([]) == float("inf")
