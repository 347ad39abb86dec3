"""The client's parts (router, demultiplexer, discovery) and its fault seams.

Each part reports its own typed statistics; the client's are composed from
them. A fault plan wraps the client's seams and, removed, leaves the class's
own methods: nothing in the client looks for a plan.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import torch
import trio
import trio.testing

from client_fakes import Behaviour, FakeEncoders, expected, item_bytes
from epd_trio.client import open_encoder_client
from epd_trio.client.demux import DemuxStatistics
from epd_trio.client.discovery import DiscoveryStatistics
from epd_trio.client.router import Router, RouterStatistics
from epd_trio.client.state import PartState
from epd_trio.errors import AbortedError, TransportError
from epd_trio.testing import Fault, FaultPlan, InjectedFault, install_faults
from epd_trio.transport import PushSocketCache

# Loopback addresses, so that finding the route to them asks no resolver.
E0, E1 = "http://127.0.0.10:8000", "http://127.0.0.11:8000"


@pytest.fixture
async def push() -> AsyncIterator[PushSocketCache]:
    async with PushSocketCache() as cache:
        yield cache


def images(n: int) -> list[bytes]:
    return [item_bytes(i) for i in range(n)]


async def test_the_parts_report_what_the_client_composes(push: PushSocketCache) -> None:
    fakes = FakeEncoders(push, {E0: Behaviour("down"), E1: Behaviour()})
    async with open_encoder_client(encoder_urls=[E0, E1], http_transport=fakes.transport(),
                                   pool_bytes=64 << 10) as client:
        async with await client.encode({"image": images(3)}):
            pass
        routed, demux = client.router.statistics(), client.receiver.demux.statistics()
        assert routed == RouterStatistics((E0, E1), {E0: 0, E1: 0}, retries=1, aborts_sent=0,
                                          aborts_failed=0)
        assert demux == DemuxStatistics(parts_live=0, messages_received=2, messages_dropped=0,
                                        malformed_messages=0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            routed.retries = 0  # type: ignore[misc]
        s = client.statistics()
        assert (s.encoders, s.retries, s.messages_received, s.parts_live) == ((E0, E1), 1, 2, 0)
        assert client.discovery is None and s.refresh_failures == 0
        assert repr(client.router) == \
            "<Router 2 encoders, 0 parts out, 1 retries, aborts 0 sent / 0 failed>"
        assert repr(client.receiver.demux).endswith("0 parts live, received 2, dropped 0 (+0 malformed)>")


def test_the_router_keeps_counts_of_encoders_that_left() -> None:
    router = Router((E0, E1))
    parts = router.plan({"image": 2})
    assert [p.encoder_url for p in parts] == [E0, E1]
    router.set_encoders((E1,))
    assert router.statistics().outstanding == {E0: 1, E1: 1}  # E0 still has a part out
    for part in parts:
        state = PartState(part, part.encoder_url)
        router.settle(state)
        router.settle(state)  # once only
    assert router.statistics().outstanding == {E0: 0, E1: 0}
    router.set_encoders((E1,))
    assert router.statistics().outstanding == {E1: 0}


async def test_discovery_counts_its_queries(autojump_clock: trio.testing.MockClock) -> None:
    answers = iter([json.dumps({"encoder_urls": ["http://e1:1/"]}), None])

    def handler(request: httpx.Request) -> httpx.Response:
        body = next(answers, None)
        if body is None:
            raise httpx.ConnectError("registry down")
        return httpx.Response(200, content=body)

    async with open_encoder_client(encoder_urls=[E0], bootstrap_url="http://reg:1",
                                   refresh_interval=5.0,
                                   http_transport=httpx.MockTransport(handler)) as client:
        assert client.discovery is not None
        assert client.discovery.statistics() == DiscoveryStatistics("http://reg:1", 1, 0, 1)
        await trio.sleep(5.5)
        assert client.discovery.statistics() == DiscoveryStatistics("http://reg:1", 1, 1, 1)
        assert client.encoders == (E0, "http://e1:1")
        assert repr(client.discovery) == "<Discovery http://reg:1: 1 found, 1 refreshes, 1 failed>"


async def test_a_dispatch_fault_fails_the_request_and_removing_it_restores_the_client(
        push: PushSocketCache) -> None:
    fakes = FakeEncoders(push, {E0: Behaviour()})
    async with open_encoder_client(encoder_urls=[E0], http_transport=fakes.transport(),
                                   pool_bytes=64 << 10) as client:
        plan = FaultPlan(0, [Fault("client_dispatch", error=lambda p: InjectedFault(p))])
        install_faults(plan, client)
        with pytest.raises(InjectedFault):
            await client.encode({"image": images(2)})
        assert plan.hits == {"client_dispatch": 1} and fakes.encode_calls == []
        install_faults(None, client)
        assert "gather" not in vars(client.receiver) and "post" not in vars(client.router)
        assert "hand_off" not in vars(client.receiver.demux)
        async with await client.encode({"image": images(2)}) as result:
            assert torch.equal(result.embeddings["image"], expected(images(2), "image"))
        assert plan.hits == {"client_dispatch": 1}
        assert client.statistics().requests_failed == 1


async def test_a_gather_cancellation_is_an_aborted_request(push: PushSocketCache) -> None:
    fakes = FakeEncoders(push, {E0: Behaviour()})
    async with open_encoder_client(encoder_urls=[E0], http_transport=fakes.transport(),
                                   pool_bytes=64 << 10) as client:
        plan = FaultPlan(0, [Fault("client_gather", cancel=True)])
        install_faults(plan, client)
        install_faults(plan, client)  # installing again wraps once, not twice
        with pytest.raises(AbortedError, match="injected cancellation"):
            await client.encode({"image": images(2)})
        assert plan.hits == {"client_dispatch": 1, "demux": 1, "client_gather": 1}
        assert client.statistics().pool.slots == 0


async def test_a_demux_fault_loses_the_message_not_the_demultiplexer(push: PushSocketCache) -> None:
    fakes = FakeEncoders(push, {E0: Behaviour()})
    async with open_encoder_client(encoder_urls=[E0], http_transport=fakes.transport(),
                                   pool_bytes=64 << 10) as client:
        plan = FaultPlan(0, [Fault("demux", error=lambda p: TransportError(p))])
        install_faults(plan, client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.encode, {"image": images(1)})
            with trio.fail_after(5):
                while client.receiver.demux.statistics().messages_dropped < 1:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert client.statistics().messages_received == 1
        install_faults(None, client)
        async with await client.encode({"image": images(2)}) as result:
            assert torch.equal(result.embeddings["image"], expected(images(2), "image"))
        assert plan.hits == {"client_dispatch": 1, "demux": 1}  # the request never gathered
