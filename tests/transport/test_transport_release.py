"""Small zero-copy sends are not watched until released; large ones (and any over the budget) are."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import pytest
import torch
import trio
import zmq

from epd_trio.protocol import encode_zmq_message, header_for
from epd_trio.transport import PullReceiver, PushSocketCache
from epd_trio.transport._poll import SPIN
from epd_trio.transport._zmq_socket import ReleaseLedger, tracker_spin

MiB = 1 << 20


@dataclass
class FakeTracker:
    done: bool = False


def test_a_message_within_the_budget_goes_unwatched_until_released() -> None:
    ledger = ReleaseLedger(8 * MiB)
    first, second, third = FakeTracker(), FakeTracker(), FakeTracker()
    assert ledger.leave_unwatched(first, 4 * MiB)
    assert ledger.leave_unwatched(second, 4 * MiB)
    assert ledger.unreleased_bytes == 8 * MiB
    assert not ledger.leave_unwatched(third, 1)  # over the budget: this sender watches its own
    assert ledger.unreleased_bytes == 8 * MiB  # ...and it is not counted
    first.done = True
    assert ledger.unreleased_bytes == 4 * MiB
    assert ledger.leave_unwatched(third, 4 * MiB)


def test_released_messages_are_forgotten_in_send_order() -> None:
    ledger = ReleaseLedger(3)
    a, b = FakeTracker(), FakeTracker()
    ledger.leave_unwatched(a, 1)
    ledger.leave_unwatched(b, 1)
    b.done = True  # libzmq releases in send order; a later release waits for the earlier
    assert ledger.unreleased_bytes == 2
    a.done = True
    assert ledger.unreleased_bytes == 0


@pytest.mark.parametrize(("budget", "nbytes", "done", "unwatched"), [
    (0, 1, False, False),  # budget 0: every zero-copy send is watched (TrioSocket's default)
    (0, 10 * MiB, True, True),  # already released (a copied small frame): nothing to watch
    (8 * MiB, 8 * MiB, False, True),
    (8 * MiB, 8 * MiB + 1, False, False),  # a large message waits as before
])
def test_the_budget_decides(budget: int, nbytes: int, done: bool, unwatched: bool) -> None:
    ledger = ReleaseLedger(budget)
    assert ledger.leave_unwatched(FakeTracker(done), nbytes) is unwatched
    assert ledger.unreleased_bytes == (nbytes if unwatched and not done else 0)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        ReleaseLedger(-1)
    with pytest.raises(ValueError):
        PushSocketCache(release_budget=-1)


def frames_of(mib: int, req_id: str) -> tuple[torch.Tensor, list]:
    t = torch.arange(mib * MiB // 2, dtype=torch.int16).view(torch.bfloat16).view(-1, 1024)
    header = header_for(t, req_id=req_id, part_idx=0, num_parts=1, modality="image",
                        token_counts=[t.shape[0]])
    return t, encode_zmq_message(header, t)


async def test_a_send_within_the_budget_returns_before_the_peer_reads() -> None:
    """The peer holds about one message (RCVHWM 1) and the kernel a few MiB: the last
    message's bytes cannot all leave until the peer reads, yet its send returns (with
    budget 0, as ``TrioSocket`` defaults to, it would wait), and all arrive intact."""
    async with PullReceiver(rcvhwm=1) as rx:
        sent = [frames_of(16, name) for name in "abc"]
        async with PushSocketCache(sndhwm=4, release_budget=64 * MiB) as cache:
            with trio.fail_after(20):
                for _, frames in sent:
                    await cache.send(rx.last_endpoint, frames, 20.0)
                assert rx.statistics().received == 0
                got = [await rx.receive() for _ in sent]
    for (tensor, _), (_header, payload) in zip(sent, got):
        assert payload is not None and torch.equal(payload.tensor().view(torch.int16),
                                                   tensor.view(torch.int16))


async def test_a_socket_with_unreleased_messages_is_not_evicted() -> None:
    """Closing it would drop what libzmq still holds after its linger: it stays while busy."""
    async with PullReceiver(rcvhwm=1) as stalled, PullReceiver() as other:
        sent = [frames_of(16, name) for name in "abc"]
        async with PushSocketCache(max_sockets=1, release_budget=64 * MiB) as cache:
            with trio.fail_after(20):
                for _, frames in sent:
                    await cache.send(stalled.last_endpoint, frames, 20.0)
                await cache.send(other.last_endpoint, [b"not a header"], 5.0)
                stats = cache.statistics()
                got = [await stalled.receive() for _ in sent]
    assert (stats.open_sockets, stats.evicted) == (2, 0)  # overfilled rather than evicted
    assert 0 < stats.unreleased_bytes <= 64 * MiB
    assert [header.req_id for header, _ in got] == ["a", "b", "c"]


async def test_a_watched_send_returns_once_every_part_is_released() -> None:
    """Only the last zero-copy part is tracked: libzmq lets go of parts in order, so when
    a watched send returns, pyzmq has already dropped the earlier parts' buffers."""
    t = torch.arange(2049 * 1024, dtype=torch.int16).view(torch.bfloat16).view(-1, 1024)
    header = header_for(t, req_id="parts", part_idx=0, num_parts=1, modality="image",
                        token_counts=[t.shape[0]])
    frames = encode_zmq_message(header, t, frame_bytes=2 * MiB)  # 2 MiB, 2 MiB, 2 KiB
    assert [memoryview(f).nbytes for f in frames[1:]] == [2 * MiB, 2 * MiB, 2048]
    first = weakref.ref(frames[1])
    async with PullReceiver() as rx, PushSocketCache(release_budget=0) as cache:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cache.send, rx.last_endpoint, frames, 20.0)
                _, payload = await rx.receive()
            del frames
            assert first() is None  # released before the tracked part
            assert cache.statistics().unreleased_bytes == 0
    assert payload is not None
    assert torch.equal(payload.tensor().view(torch.int16), t.view(torch.int16))


def test_libzmq_releases_the_parts_of_a_message_in_order() -> None:
    """What tracking only the last zero-copy part relies on: whenever a later part of a
    message is reported released, the earlier ones are too (checked all along the way)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("tcp://127.0.0.1:*")
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        data = memoryview(bytearray(6 * MiB))
        trackers = []
        for _ in range(8):
            trackers.append([push.send(data[i:i + 2 * MiB], zmq.SNDMORE if i < 4 * MiB else 0,
                                       copy=False, track=True) for i in range(0, 6 * MiB, 2 * MiB)])
        for _ in trackers:
            pull.recv_multipart(copy=False)
            for parts in trackers:
                done = [t.done for t in reversed(parts)]  # the later part looked at first
                assert done == sorted(done), done  # a released part's predecessors are too
        for parts in trackers:
            parts[-1].wait(10)
            assert all(t.done for t in parts)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(("cores", "spin"), [(1, 0.0), (2, 0.0), (3, 0.0), (4, SPIN), (64, SPIN)])
def test_a_watched_send_spins_only_with_cores_to_spare(cores: int, spin: float) -> None:
    assert tracker_spin(cores) == spin
