"""Trio-native ZMQ REQ sockets for JSON control planes, against real REP sockets on loopback."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing
import zmq

from epd_trio.errors import ProtocolError, RequestError, TransferTimeout
from epd_trio.transport._zmq_socket import TrioSocket
from epd_trio.transport.zmq_request import RequestSockets

Handler = Callable[[list[bytes]], Awaitable[list[bytes]]]


async def echo(frames: list[bytes]) -> list[bytes]:
    return [json.dumps({"ok": True, "echo": json.loads(frames[0])}).encode()]


@asynccontextmanager
async def rep_server(handler: Handler = echo) -> AsyncIterator[tuple[str, list[list[bytes]]]]:
    """A REP socket answering each request with ``handler``; yields its endpoint and what it got."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    rep, received = TrioSocket(sock), []

    async def serve() -> None:
        while True:
            frames = [bytes(f.buffer) for f in await rep.receive_multipart()]
            received.append(frames)
            await rep.send_multipart(await handler(frames), timeout=5)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield sock.getsockopt_string(zmq.LAST_ENDPOINT), received
            nursery.cancel_scope.cancel()
    finally:
        rep.close()
        ctx.term()


def nobody() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_replies_come_back_decoded_and_a_socket_serves_the_next_exchange() -> None:
    async with rep_server() as (endpoint, received), RequestSockets() as sockets:
        first = await sockets.request(endpoint, {"op": "peers"}, timeout=5)
        second = await sockets.request(endpoint, {"op": "reserve", "n": 2}, timeout=5)
        stats = sockets.statistics()
    assert first == {"ok": True, "echo": {"op": "peers"}} and second["echo"] == {"op": "reserve", "n": 2}
    assert [json.loads(f[0]) for f in received] == [{"op": "peers"}, {"op": "reserve", "n": 2}]
    assert (stats.exchanges, stats.failures, stats.idle_sockets, stats.busy_sockets) == (2, 0, 1, 0)


async def test_no_reply_is_a_timeout_at_the_deadline_and_its_socket_is_closed(
        autojump_clock: trio.testing.MockClock) -> None:
    async with RequestSockets() as sockets:
        start = trio.current_time()
        with pytest.raises(TransferTimeout, match=r"no reply from tcp://127.0.0.1:.* within 3 s"):
            await sockets.request(nobody(), {"op": "peers"}, timeout=3.0)
        assert trio.current_time() - start == 3.0
        stats = sockets.statistics()
    assert (stats.timeouts, stats.failures, stats.idle_sockets, stats.busy_sockets) == (1, 1, 0, 0)


@pytest.mark.parametrize("reply", [[b"not json"], [b"{}", b"{}"], [b"\xff\xfe"]])
async def test_a_reply_that_is_not_one_json_frame_is_a_protocol_error(reply: list[bytes]) -> None:
    async def answer(frames: list[bytes]) -> list[bytes]:
        return reply if json.loads(frames[0])["bad"] else await echo(frames)

    async with rep_server(answer) as (endpoint, _), RequestSockets() as sockets:
        with pytest.raises(ProtocolError, match="replied with"):
            await sockets.request(endpoint, {"bad": True}, timeout=5)
        assert sockets.statistics().idle_sockets == 0  # its turn-taking is spent: closed
        assert (await sockets.request(endpoint, {"bad": False}, timeout=5))["ok"]  # a new socket
        stats = sockets.statistics()
    assert (stats.exchanges, stats.failures, stats.idle_sockets) == (1, 1, 1)


async def test_a_cancelled_exchange_closes_its_socket() -> None:
    arrived = trio.Event()

    async def stall(frames: list[bytes]) -> list[bytes]:
        arrived.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with rep_server(stall) as (endpoint, _), RequestSockets() as sockets:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(sockets.request, endpoint, {"op": "reserve"}, timeout=60))
            await arrived.wait()
            assert sockets.statistics().busy_sockets == 1
            nursery.cancel_scope.cancel()
        stats = sockets.statistics()
    assert (stats.busy_sockets, stats.idle_sockets, stats.failures, stats.exchanges) == (0, 0, 1, 0)


async def test_idle_sockets_are_bounded() -> None:
    gate = trio.Event()

    async def later(frames: list[bytes]) -> list[bytes]:
        await gate.wait()
        return await echo(frames)

    async with rep_server(later) as (endpoint, received), RequestSockets(max_idle=2) as sockets:
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(partial(sockets.request, endpoint, {"n": n}, timeout=30))
            await trio.testing.wait_all_tasks_blocked()
            assert sockets.statistics().busy_sockets == 3  # one socket per concurrent exchange
            gate.set()
        stats = sockets.statistics()
    assert (stats.exchanges, stats.idle_sockets, stats.busy_sockets) == (3, 2, 0)
    assert len(received) == 3


@pytest.mark.parametrize("endpoint", ["udp://127.0.0.1:5", "tcp://127.0.0.1:0", "tcp://[::::]:5"])
async def test_a_bad_endpoint_is_refused_before_any_socket(endpoint: str) -> None:
    async with RequestSockets() as sockets:
        with pytest.raises(RequestError):
            await sockets.request(endpoint, {"op": "peers"}, timeout=1)
        assert sockets.statistics().busy_sockets == 0
