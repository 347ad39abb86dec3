"""Closing the PUSH cache: the wait for unsent messages has a bound (real sockets)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import trio
import trio.testing
import zmq

from epd_trio.errors import TransferTimeout
from epd_trio.transport import PushSocketCache
from epd_trio.transport.zmq import TERM_GRACE

MiB = 1 << 20
LINGER_MS = 60_000


@pytest.fixture
def stalled_peer() -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A PULL socket that reads nothing until the test drains it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", pull
    finally:
        pull.close(linger=0)
        ctx.term()


def drain(pull: zmq.Socket[bytes]) -> int:
    """Read until nothing more comes: lets the abandoned term() finish.

    The queued frames arrive within ~0.1 s, each a few ms after the last; 0.5 s of
    silence means the queue is empty.
    """
    pull.setsockopt(zmq.RCVTIMEO, 500)
    received = 0
    try:
        while True:
            pull.recv_multipart(copy=False)
            received += 1
    except zmq.Again:
        return received


async def test_closing_waits_for_unsent_messages_only_up_to_linger_plus_grace(
        autojump_clock: trio.testing.MockClock, stalled_peer: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, pull = stalled_peer
    frame = bytes(4 * MiB)
    # Real time while queueing: 64 MiB against a peer that reads nothing stays mostly
    # queued in our sockets (far more than the kernel's loopback buffers take).
    autojump_clock.autojump_threshold, autojump_clock.rate = math.inf, 1.0
    async with PushSocketCache(linger_ms=LINGER_MS) as cache:
        await cache.send(endpoint, [b"first", frame], timeout=60)  # connected, flowing
        for _ in range(15):
            with contextlib.suppress(TransferTimeout):  # queued, not sent: what closing waits for
                await cache.send(endpoint, [b"more", frame], timeout=0.05)
        assert cache.statistics().send_timeouts > 0, "the peer took everything: nothing lingers"
        autojump_clock.rate, autojump_clock.autojump_threshold = 0.0, 0.0
        closing = trio.current_time()
    # term() would wait the whole linger for the peer (60 s); the close is bounded.
    assert trio.current_time() - closing == LINGER_MS / 1000 + TERM_GRACE
    assert await trio.to_thread.run_sync(drain, pull) > 1
