"""Mooncake delivery end to end: the client in this process, encoders in their own.

A real TransferEngine over TCP on loopback on both sides; the encoders are
``epd-trio encoder --transfer-backend mooncake`` subprocesses (started once for
the module), so every byte crosses a process boundary the way it does in
production. The same encoders serve the ZMQ and inline references.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import trio
import trio.testing

from conftest import data_uri, png_bytes
from epd_trio.client import ClientConfig, EncoderClient, RemoteEncodeError, open_encoder_client
from epd_trio.errors import EncodeTimeout, PayloadTooLargeError, TransportError
from epd_trio.protocol.codec import decode_safetensors

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

KiB = 1024
IMAGES = [png_bytes(56, 56, seed=1), png_bytes(84, 56, seed=2), png_bytes(56, 112, seed=3)]


@pytest.fixture(scope="module")
def encoder_urls(qwen25_path: str) -> Iterator[list[str]]:
    """Three Mooncake-capable encoder processes (started together: start-up dominates)."""
    env = {**os.environ, "EPD_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "epd_trio.cli", "encoder", "--port", "0",
               "--transfer-backend", "mooncake", "--model-path", qwen25_path]
    procs: list[tuple[subprocess.Popen[str], Any]] = []
    try:
        for _ in range(3):
            log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with its process, below
            procs.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                           env=env), log))
        urls = []
        for proc, log in procs:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if "listening on http://" not in line:
                log.seek(0)
                pytest.fail(f"encoder did not start: {line!r}\n{log.read()[-3000:]}")
            urls.append(line.rsplit(" ", 1)[1].strip())
        yield urls
    finally:
        for proc, _ in procs:  # graceful shutdown is tested elsewhere (test_encoder_cli)
            proc.kill()
        for proc, log in procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()


def mooncake_client(urls: list[str], http_transport: httpx.AsyncBaseTransport | None = None,
                    **config: Any) -> EncoderClient:
    config.setdefault("pool_bytes", 1 << 20)
    return open_encoder_client(encoder_urls=urls, transfer_backend="mooncake",
                               http_transport=http_transport, **config)


def assert_clean(client: EncoderClient) -> None:
    s = client.statistics()
    assert (s.requests_live, s.parts_live, sum(s.outstanding.values())) == (0, 0, 0), s
    assert (s.pool.slots, s.pool.used_bytes, s.pool.waiters, s.pool.leaked) == (0, 0, 0, 0), s


async def encoder_stats(http: httpx.AsyncClient, urls: list[str]) -> list[dict[str, Any]]:
    return [(await http.get(f"{url}/stats")).json() for url in urls]


async def staged_regions(http: httpx.AsyncClient, urls: list[str]) -> int:
    return sum(s["mooncake"]["registered_regions"] for s in await encoder_stats(http, urls))


async def wait_encoders_released(urls: list[str], timeout: float = 10.0) -> None:
    """Well under the encoders' 60 s send_timeout: only an /abort releases them this fast."""
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(timeout):
            while True:
                stats = await encoder_stats(http, urls)
                if all(s["live_requests"] == 0 and s["mooncake"]["registered_regions"] == 0
                       for s in stats):
                    return
                await trio.sleep(0.02)


async def wait_until_staged(urls: list[str], count: int, client: EncoderClient) -> None:
    """Every part answered /encode, ran its forward and waits for /send; the client
    waits for a pool slot."""
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(15):
            while await staged_regions(http, urls) < count or client.pool.statistics().waiters < 1:
                await trio.sleep(0.02)


async def inline_reference(urls_items: list[tuple[str, list[bytes]]]) -> torch.Tensor:
    """The same grouping, delivered inline by direct POSTs."""
    parts = []
    async with httpx.AsyncClient(timeout=30) as http:
        for n, (url, items) in enumerate(urls_items):
            r = await http.post(f"{url}/encode", json={
                "req_id": f"inline-{n}", "modality": "image", "mm_items": [data_uri(i) for i in items]})
            assert r.status_code == 200, r.text
            parts.append(decode_safetensors(r.content)[0])
    return torch.cat(parts)


async def test_mooncake_equals_zmq_and_inline_and_lands_contiguous_in_one_slot(
        encoder_urls: list[str]) -> None:
    async with mooncake_client(encoder_urls) as client:
        assert client.statistics().mooncake.registered_regions == 1  # the pool, once
        # A slot ahead of ours, so the request's slot starts at a nonzero offset.
        async with client.pool.reserve(1000), await client.encode({"image": IMAGES}) as result:
            slot, got = result.slot, result.embeddings["image"]
            assert slot.offset > 0 and len(result.parts) == 3
            assert {p.encoder_url for p in result.parts} == set(encoder_urls)
            # No copy: the modality tensor is a view starting at the slot's first byte, and
            # the three parts' bytes fill the slot end to end.
            assert got.data_ptr() == slot.address and got.is_contiguous()
            assert slot.nbytes == got.numel() * got.element_size()
            slot_bytes = slot.bytes().clone()
            grouping = [(p.encoder_url, [IMAGES[i] for i in p.item_indices]) for p in result.parts]
            mooncake_out = got.clone()
            counts = result.token_counts["image"]
        del got  # a view this test kept: until it goes, its bytes stay out of the pool
        stats = client.statistics()
        assert stats.mooncake.registered_regions == 1 and stats.messages_received == 0
        assert_clean(client)
    assert client.statistics().mooncake.registered_regions == 0  # unregistered at close

    async with open_encoder_client(encoder_urls=encoder_urls, pool_bytes=1 << 20) as zmq_client:
        async with await zmq_client.encode({"image": IMAGES}) as zmq_result:
            zmq_out = zmq_result.embeddings["image"].clone()
            assert [(p.encoder_url, p.item_indices) for p in zmq_result.parts] == \
                [(p.encoder_url, p.item_indices) for p in result.parts]
    inline = await inline_reference(grouping)

    assert torch.equal(mooncake_out, zmq_out) and torch.equal(mooncake_out, inline)
    assert torch.equal(slot_bytes, inline.contiguous().view(-1).view(torch.uint8))
    assert sum(counts) == inline.shape[0]
    await wait_encoders_released(encoder_urls)


async def test_caller_cancellation_between_encode_and_send_releases_both_sides(
        encoder_urls: list[str]) -> None:
    async with mooncake_client(encoder_urls, pool_bytes=64 * KiB) as client:
        blocker = await client.pool.acquire(client.pool.capacity - 256)  # no room: parts stay staged
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.encode, {"image": IMAGES[:2]})
                await wait_until_staged(encoder_urls, 2, client)
                scope.cancel()
        blocker.release()
        stats = client.statistics()
        assert (stats.requests_failed, stats.aborts_sent, stats.aborts_failed) == (1, 2, 0), stats
        assert_clean(client)
        await wait_encoders_released(encoder_urls)
        async with await client.encode({"image": IMAGES[:1]}) as result:  # still fine
            assert result.embeddings["image"].shape[1] == 40
        assert client.statistics().mooncake.registered_regions == 1


@pytest.fixture
def steerable_clock() -> trio.testing.MockClock:
    """Trio's clock at real speed, which a test can ``jump`` past a deadline (pytest-trio
    runs a test that takes it under it)."""
    return trio.testing.MockClock(rate=1.0)


async def test_a_timeout_while_waiting_for_the_slot_releases_both_sides(
        encoder_urls: list[str], steerable_clock: trio.testing.MockClock) -> None:
    # The request's deadline is on trio's clock: however long the encoders take to stage
    # the parts (a loaded machine), the test makes it pass only once all three are staged
    # and the request waits for its slot. A deadline that came early would leave
    # wait_until_staged waiting for a request that is gone, and fail.
    timeout, expired = 60.0, False
    async with mooncake_client(encoder_urls, pool_bytes=64 * KiB) as client:
        blocker = await client.pool.acquire(client.pool.capacity - 256)

        async def expire_once_staged() -> None:
            nonlocal expired
            await wait_until_staged(encoder_urls, 3, client)
            expired = True
            steerable_clock.jump(timeout)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(expire_once_staged)
            with pytest.raises(EncodeTimeout):
                await client.encode({"image": IMAGES}, timeout=timeout)
        blocker.release()
        assert expired  # the deadline, and the abort, came between /encode and /send
        assert client.statistics().aborts_sent == 3
        assert_clean(client)
        await wait_encoders_released(encoder_urls)


async def test_a_failed_part_aborts_the_staged_ones(encoder_urls: list[str]) -> None:
    async with mooncake_client(encoder_urls) as client:
        with pytest.raises(RemoteEncodeError) as info:
            await client.encode({"image": [IMAGES[0], b"not an image", IMAGES[2]]})
        assert (info.value.status_code, info.value.part_idx) == (400, 1)
        assert_clean(client)
        await wait_encoders_released(encoder_urls)


async def test_a_request_too_big_for_the_pool_is_refused_and_its_parts_aborted(
        encoder_urls: list[str]) -> None:
    async with mooncake_client(encoder_urls, pool_bytes=256) as client:
        with pytest.raises(PayloadTooLargeError):  # known only once every part has its size
            await client.encode({"image": IMAGES})
        assert client.statistics().aborts_sent == 3
        assert_clean(client)
        await wait_encoders_released(encoder_urls)


async def test_a_failed_write_fails_the_request_and_releases_both_sides(
        encoder_urls: list[str]) -> None:
    async with mooncake_client(encoder_urls) as client:
        assert client.receiver.engine is not None
        real = client.receiver.engine.session
        # Encoders are told to write to a Mooncake peer that does not exist.
        client.receiver.engine.session = "127.0.0.1:1"
        try:
            with pytest.raises(RemoteEncodeError) as info:
                await client.encode({"image": IMAGES[:2]}, timeout=20)
        finally:
            client.receiver.engine.session = real
        assert info.value.status_code >= 500, info.value
        assert_clean(client)
        await wait_encoders_released(encoder_urls)


class Partitioned(httpx.AsyncBaseTransport):
    """The real network, but /send never gets through and /abort cannot reach the encoder:
    the failure that leaves the client unsure whether a write may still land."""

    def __init__(self) -> None:
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/send":
            await trio.sleep_forever()  # until the caller gives up
        if request.url.path == "/abort":
            raise httpx.ConnectError("injected: the encoder cannot be reached", request=request)
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


async def test_an_unconfirmed_abort_holds_the_slot_before_the_pool_reuses_it(
        encoder_urls: list[str], steerable_clock: trio.testing.MockClock) -> None:
    timeout = 60.0  # passed by a jump once the request holds its slot, however slow the encoder

    async def expire_once_the_slot_is_held() -> None:
        with trio.fail_after(15):
            while client.pool.statistics().slots < 1:  # staged, sized, its /send never lands
                await trio.sleep(0.02)
        steerable_clock.jump(timeout)

    async with mooncake_client(encoder_urls[:1], http_transport=Partitioned(), abort_hold=1.0) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expire_once_the_slot_is_held)
            with pytest.raises(EncodeTimeout):
                await client.encode({"image": IMAGES[:1]}, req_id="held", timeout=timeout)
        held = client.statistics()
        assert held.slots_held_after_abort == 1 and held.aborts_failed == 1, held
        assert held.pool.slots == 1 and held.pool.used_bytes > 0  # not handed to the next request
        with trio.fail_after(10):
            while client.pool.statistics().slots:
                await trio.sleep(0.05)
        assert_clean(client)
    async with httpx.AsyncClient(timeout=5) as http:  # the encoder still waits for that /send
        assert (await http.post(f"{encoder_urls[0]}/abort", json={"req_id": "held"})).status_code == 200
    await wait_encoders_released(encoder_urls)


async def test_an_abort_answered_before_the_write_stopped_holds_the_slot(encoder: Any) -> None:
    """The encoder answers the /abort before its write has stopped (``released: false``):
    the client takes that as unconfirmed and holds the slot for ``abort_hold``, so the write
    that lands afterwards lands in memory no other request has been given."""
    from epd_trio.testing.transport_faults import held_writes

    # The encoder's /abort answers within send_timeout, inside the client's abort_timeout; the
    # last, unheld request must also fit in send_timeout on a loaded machine (0.5 s did not).
    async with encoder(transfer_backend="mooncake", send_timeout=2.0) as (server, _), \
            mooncake_client([server.url], abort_hold=2.0, abort_timeout=6.0) as client:
        with held_writes(server.service.deliveries.mooncake) as gate:
            with pytest.raises(EncodeTimeout):  # the write is held: the request runs out
                await client.encode({"image": IMAGES[:1]}, timeout=3.0)
            assert gate.held == 1
            held = client.statistics()
            assert held.slots_held_after_abort == 1 and held.aborts_sent == 1, held
            assert client.router.statistics().aborts_unreleased == 1
            assert held.pool.slots == 1  # not handed to the next request
        with trio.fail_after(10):  # the gate is open: the late write lands, then the hold ends
            while client.pool.statistics().slots:
                await trio.sleep(0.05)
        assert_clean(client)
        async with await client.encode({"image": IMAGES[:1]}) as result:  # still fine
            assert result.embeddings["image"].shape[1] == 40


async def test_without_the_package_the_client_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as if not installed
    client = open_encoder_client(encoder_urls=["http://127.0.0.1:9"], transfer_backend="mooncake",
                                 pool_bytes=4 * KiB)
    with pytest.raises(TransportError, match="pip install 'epd-trio\\[mooncake"):
        async with client:
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="transfer_backend"):
        ClientConfig(transfer_backend="rdma")
