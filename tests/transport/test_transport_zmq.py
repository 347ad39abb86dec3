"""Trio-native ZMQ over real sockets: loopback tcp and ipc, no mocks."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from functools import partial

import numpy as np
import pytest
import torch
import trio
import trio.testing
import zmq

from epd_trio.config import EncoderConfig
from epd_trio.delivery import open_deliveries
from epd_trio.errors import RequestError, TransferTimeout, TransportError
from epd_trio.protocol import encode_zmq_message, error_message, header_for
from epd_trio.protocol.codec import FrameLike
from epd_trio.protocol.payload import tensor_bytes
from epd_trio.transport import PullReceiver, PushSocketCache, TrioSocket, validate_endpoint
from epd_trio.transport.zmq import expired_endpoints, next_expiry

MiB = 1 << 20


def embedding(
    tokens: int, dim: int, req_id: str = "r", seed: int = 0
) -> tuple[torch.Tensor, list[FrameLike]]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-(1 << 15), 1 << 15, (tokens, dim), dtype=torch.int16, generator=g)
    t = t.view(torch.bfloat16)
    header = header_for(t, req_id=req_id, part_idx=0, num_parts=1, modality="image",
                        token_counts=[tokens])
    return t, encode_zmq_message(header, t)


@pytest.fixture
def ipc_endpoint() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="epd-") as d:  # short: sun_path is 108 bytes
        yield f"ipc://{d}/rx.sock"


@pytest.fixture
async def receiver() -> AsyncIterator[PullReceiver]:
    async with PullReceiver() as rx:
        yield rx


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://encoder-3.local:80", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/epd/rx.sock", True),
        ("tcp://127.0.0.1:0", False),
        ("tcp://127.0.0.1:65536", False),
        ("tcp://127.0.0.1", False),
        ("tcp://*:5555", False),
        ("udp://127.0.0.1:5555", False),
        ("http://127.0.0.1:5555", False),
        ("inproc://x", False),
        ("ipc://", False),
        ("ipc:///" + "x" * 200, False),
        ("tcp://127.0.0.1:5555 ", False),
        ("", False),
    ],
)
def test_validate_endpoint(endpoint: str, ok: bool) -> None:
    if ok:
        assert validate_endpoint(endpoint) == endpoint
    else:
        with pytest.raises(RequestError):
            validate_endpoint(endpoint)


def test_validate_endpoint_allows_port_zero_only_to_bind() -> None:
    assert validate_endpoint("tcp://127.0.0.1:0", bind=True) == "tcp://127.0.0.1:0"
    with pytest.raises(RequestError):
        validate_endpoint(5555)


async def test_16_mib_over_tcp_is_bit_exact(receiver: PullReceiver) -> None:
    await _send_big_and_check(receiver)


async def test_16_mib_over_ipc_is_bit_exact(ipc_endpoint: str) -> None:
    async with PullReceiver(ipc_endpoint) as rx:
        assert rx.last_endpoint == ipc_endpoint
        await _send_big_and_check(rx)


async def _send_big_and_check(rx: PullReceiver) -> None:
    tensor, frames = embedding(4096, 2048)  # bfloat16: 16 MiB
    assert len(frames) == 17 and sum(memoryview(f).nbytes for f in frames[1:]) == 16 * MiB
    async with PushSocketCache() as cache, trio.open_nursery() as nursery:
        with trio.fail_after(20):
            nursery.start_soon(cache.send, rx.last_endpoint, frames, 20.0)
            header, got = await rx.receive()
    assert header.shape == (4096, 2048) and got is not None
    assert len(got.frames) == 16  # 16 MiB in 1 MiB frames
    sent = tensor_bytes(tensor)
    start, end = tensor.data_ptr(), tensor.data_ptr() + sent.nbytes
    for frame in got.frames:  # what arrived is the socket's own memory, not the sender's
        at = np.frombuffer(frame, dtype=np.uint8).ctypes.data
        assert not start <= at < end
    arrived = b"".join(bytes(frame) for frame in got.frames)
    assert len(arrived) == 16 * MiB and arrived == bytes(sent)  # the very bytes, in order
    assert cache.statistics().sends == 1 and rx.statistics().received == 1


async def test_error_message_over_the_wire(receiver: PullReceiver) -> None:
    async with PushSocketCache() as cache:
        await cache.send(receiver.last_endpoint, error_message("e", 0, 1, "audio",
                                                                TransferTimeout("late")), 5.0)
        header, tensor = await receiver.receive()
    assert tensor is None and header.error is not None and header.error.status == 504


async def test_send_to_nobody_times_out_at_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    """Virtual time: the wait on the socket's FD ends exactly at the deadline."""
    with socket_nobody_listens_on() as endpoint:
        _, frames = embedding(64, 64)
        async with PushSocketCache() as cache:
            start = trio.current_time()
            with pytest.raises(TransferTimeout):
                await cache.send(endpoint, frames, 0.3)
            elapsed = trio.current_time() - start
            stats = cache.statistics()
    assert elapsed == 0.3
    assert (stats.send_timeouts, stats.sends, stats.busy_sockets) == (1, 0, 0)


def socket_nobody_listens_on() -> tempfile.TemporaryDirectory:
    class Endpoint(tempfile.TemporaryDirectory):
        def __enter__(self) -> str:  # type: ignore[override]
            return f"ipc://{super().__enter__()}/nobody.sock"

    return Endpoint(prefix="epd-")


async def test_cancelled_send_leaves_nothing_busy() -> None:
    with socket_nobody_listens_on() as endpoint:
        _, frames = embedding(64, 64)
        async with PushSocketCache() as cache:
            with trio.move_on_after(0.1) as scope:
                await cache.send(endpoint, frames, 30.0)
            stats = cache.statistics()
    assert scope.cancelled_caught
    assert (stats.open_sockets, stats.busy_sockets, stats.send_timeouts) == (1, 0, 0)


async def test_invalid_endpoint_is_a_request_error() -> None:
    async with PushSocketCache() as cache:
        with pytest.raises(RequestError):
            await cache.send("tcp://nowhere", [b"x"], 1.0)
        assert cache.statistics().open_sockets == 0


async def test_many_concurrent_senders_share_one_socket(ipc_endpoint: str) -> None:
    """Senders pile up waiting for room (1 MiB each, tiny HWMs, nobody reading yet)."""
    n = 12
    sent = {f"r{i}": embedding(256, 2048, f"r{i}", seed=i) for i in range(n)}
    got = {}
    async with PushSocketCache(sndhwm=1) as cache:
        async with trio.open_nursery() as nursery:
            for _, frames in sent.values():
                nursery.start_soon(cache.send, ipc_endpoint, frames, 20.0)
            # Nobody listens yet (IMMEDIATE): no send can complete. Once every task
            # is blocked, all n senders are waiting on the one socket.
            await trio.testing.wait_all_tasks_blocked()
            waiting = cache.statistics()
            async with PullReceiver(ipc_endpoint, rcvhwm=1) as receiver:
                with trio.fail_after(20):
                    for _ in range(n):
                        header, tensor = await receiver.receive()
                        assert tensor is not None
                        got[header.req_id] = tensor.tensor()
        stats = cache.statistics()  # every sender has returned
    assert (waiting.sends, waiting.open_sockets, waiting.busy_sockets) == (0, 1, 1)
    assert set(got) == set(sent)
    for req_id, (tensor, _) in sent.items():
        assert torch.equal(got[req_id].view(torch.int16), tensor.view(torch.int16))
    assert (stats.sends, stats.open_sockets, stats.busy_sockets) == (n, 1, 0)


async def test_one_socket_waits_both_ways_at_once(ipc_endpoint: str) -> None:
    """A receive and a send sleeping on one FD together: no BusyResourceError."""
    ctx = zmq.Context()
    dealer = TrioSocket(ctx.socket(zmq.DEALER))
    dealer.socket.setsockopt(zmq.IMMEDIATE, 1)
    dealer.socket.connect(ipc_endpoint)  # nobody there yet: the send must wait
    router = TrioSocket(ctx.socket(zmq.ROUTER))
    try:
        async with trio.open_nursery() as nursery:
            replies: list[bytes] = []

            async def receive() -> None:
                replies.append(bytes((await dealer.receive_multipart())[0].buffer))

            nursery.start_soon(receive)
            nursery.start_soon(partial(dealer.send_multipart, [b"ping"], timeout=10.0))
            await trio.testing.wait_all_tasks_blocked()
            router.socket.bind(ipc_endpoint)
            with trio.fail_after(10):
                identity, ping = await router.receive_multipart()
                assert bytes(ping.buffer) == b"ping"
                await router.send_multipart([identity, b"pong"], timeout=5.0)
        assert replies == [b"pong"]
    finally:
        dealer.close()
        router.close()
        ctx.term()


async def test_closing_with_a_pending_receiver_does_not_hang() -> None:
    outcomes: list[str] = []
    async with PullReceiver() as rx:

        async def receive_one() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await rx.receive()
            outcomes.append("closed")

        async def iterate() -> None:
            async for _ in rx:
                outcomes.append("message")
            outcomes.append("ended")

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                nursery.start_soon(iterate)
                await trio.testing.wait_all_tasks_blocked()
                await rx.aclose()
    assert sorted(outcomes) == ["closed", "ended"]


async def test_malformed_messages_are_dropped_and_counted(receiver: PullReceiver) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    try:
        raw.connect(receiver.last_endpoint)
        _tensor, frames = embedding(4, 8, "good")
        for garbage in ([b"\xc1"], [b"a", b"b", b"c"], [frames[0]], [frames[0], b"short"]):
            raw.send_multipart(garbage)
        raw.send_multipart(frames)
        with trio.fail_after(10):
            header, got = await receiver.receive()
    finally:
        raw.close(linger=0)
        ctx.term()
    assert header.req_id == "good" and got is not None
    stats = receiver.statistics()
    assert (stats.received, stats.dropped) == (1, 4)
    assert stats.last_drop_reason is not None and "5 bytes" in stats.last_drop_reason
    assert "dropped 4" in repr(receiver)


def test_idle_decision_is_pure() -> None:
    last_used = {"tcp://a:1": 10.0, "tcp://b:1": 25.0}
    assert expired_endpoints(last_used, now=39.9, idle_close=30.0) == []
    assert expired_endpoints(last_used, now=40.0, idle_close=30.0) == ["tcp://a:1"]
    assert expired_endpoints(last_used, now=55.0, idle_close=30.0) == ["tcp://a:1", "tcp://b:1"]
    assert next_expiry(last_used, idle_close=30.0) == 40.0
    assert next_expiry({}, idle_close=30.0) == float("inf")


async def test_idle_sockets_close_on_virtual_time(
    receiver: PullReceiver, mock_clock: trio.testing.MockClock
) -> None:
    """Real sockets, virtual time: the clock only moves when the test jumps it.

    Only small messages here: a zero-copy send polls its tracker with
    trio.sleep, which would never return on a stopped clock.
    """
    async with PushSocketCache(idle_close=60.0) as cache:
        await cache.send(receiver.last_endpoint, error_message("x", 0, 1, "image",
                                                                RuntimeError()), 5.0)
        await receiver.receive()
        mock_clock.jump(59.5)
        await trio.testing.wait_all_tasks_blocked()
        assert cache.statistics().open_sockets == 1
        await cache.send(receiver.last_endpoint, error_message("y", 0, 1, "image",
                                                                RuntimeError()), 5.0)
        mock_clock.jump(59.5)  # 119 in all, but the socket was used at 59.5
        await trio.testing.wait_all_tasks_blocked()
        assert cache.statistics().open_sockets == 1
        mock_clock.jump(0.5)
        await trio.testing.wait_all_tasks_blocked()
        stats = cache.statistics()
    assert (stats.open_sockets, stats.idle_closed, stats.sends) == (0, 1, 2)


async def test_lru_evicts_the_least_recently_used(receiver: PullReceiver) -> None:
    async with PullReceiver() as rx2, PullReceiver() as rx3:
        endpoints = [receiver.last_endpoint, rx2.last_endpoint, rx3.last_endpoint]
        async with PushSocketCache(max_sockets=2) as cache:
            for endpoint in [*endpoints, endpoints[0]]:
                await cache.send(endpoint, [b"not a header"], 5.0)
            stats = cache.statistics()
            assert "sockets: 2/2" in repr(cache)
    # a, b, c (evicts a), a again (evicts b)
    assert (stats.open_sockets, stats.evicted, stats.sends) == (2, 2, 4)


async def test_body_exception_is_not_wrapped_in_a_group() -> None:
    with pytest.raises(KeyError):
        async with PushSocketCache():
            raise KeyError("mine")


async def test_bind_failure_is_reported(receiver: PullReceiver) -> None:
    with pytest.raises(TransportError, match="cannot bind"):
        async with PullReceiver(receiver.last_endpoint):
            pass


async def test_send_outside_the_block_is_refused() -> None:
    cache = PushSocketCache()
    with pytest.raises(RuntimeError, match="async with"):
        await cache.send("tcp://127.0.0.1:5555", [b"x"], 1.0)


async def test_the_encoder_config_bounds_what_a_stuck_receiver_queues(ipc_endpoint: str) -> None:
    """``--zmq-sndhwm``: how many messages to one receiver that stopped reading are queued
    before a send waits (and times out). Over ipc at least that many are taken, and a few
    more at most (kernel buffers: measured 2 → 7, 8 → 12, 16 → 16, 34 → 34, 64 → 64)."""
    async def sends_before_a_timeout(sndhwm: int, endpoint: str) -> int:
        ctx = zmq.Context()
        stuck = ctx.socket(zmq.PULL)  # bound, never read
        for option, value in ((zmq.RCVHWM, 1), (zmq.RCVBUF, 4096), (zmq.LINGER, 0)):
            stuck.setsockopt(option, value)
        stuck.bind(endpoint)
        try:
            async with open_deliveries(EncoderConfig(zmq_sndhwm=sndhwm)) as deliveries:
                for sent in range(1000):
                    try:
                        await deliveries.zmq.send(endpoint, [b"x" * 16384], timeout=0.3)
                    except TransferTimeout:
                        return sent
        finally:
            stuck.close()
            ctx.term()
        raise AssertionError(f"1000 sends with --zmq-sndhwm {sndhwm} and none waited")

    for sndhwm in (2, 34):  # both under the default 64
        sent = await sends_before_a_timeout(sndhwm, f"{ipc_endpoint}{sndhwm}")
        assert sndhwm <= sent < sndhwm + 16, (sndhwm, sent)
