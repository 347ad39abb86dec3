"""The client against real encoder servers: Hypercorn on port 0, ZMQ on loopback,
the tiny generated qwen2_5_vl checkpoint. No fakes."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
import trio

from conftest import png_bytes, random_image
from epd_trio.client import EncoderClient, RemoteEncodeError, open_encoder_client
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.errors import EncodeTimeout

KiB = 1024


@asynccontextmanager
async def encoders(model_path: str, count: int, **overrides: Any
                   ) -> AsyncIterator[list[EncoderServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_encoder(
            EncoderConfig(port=0, engine=EngineConfig(model_path=model_path), **overrides)))
            for _ in range(count)]


def assert_clean(client: EncoderClient) -> None:
    s = client.statistics()
    assert (s.requests_live, s.parts_live, sum(s.outstanding.values())) == (0, 0, 0), s
    assert (s.pool.slots, s.pool.used_bytes, s.pool.waiters, s.pool.leaked) == (0, 0, 0, 0), s


async def live_requests(server: EncoderServer) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{server.url}/stats")).json()["live_requests"]


async def wait_idle(servers: list[EncoderServer], timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while any([await live_requests(s) for s in servers]):
            await trio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_five_images_over_two_encoders_equal_the_engines_own_output(qwen25_path: str) -> None:
    sizes = [(56, 56), (84, 56), (56, 112), (112, 84), (28, 56)]
    images = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    async with encoders(qwen25_path, 2) as (s0, s1), \
            open_encoder_client(encoder_urls=[s0.url, s1.url], pool_bytes=1 << 20) as client:
        pil = random_image(70, 42, seed=9)
        async with await client.encode({"image": [*images[:4], pil, images[4]]}) as result:
            got = result.embeddings["image"].clone()
            items = [(it.index, it.token_count, it.grid_thw, it.embedding.clone())
                     for it in result.items]
            counts = result.token_counts["image"]
        # the plan: items 0-2 on s0 (part 0), items 3-5 on s1 (part 1)
        part0 = await s0.service.engine.encode(images[:3], "image")
        part1 = await s1.service.engine.encode([images[3], pil, images[4]], "image")
        singles = [await s0.service.engine.encode([x], "image")
                   for x in [*images[:4], pil, images[4]]]
        assert_clean(client)
        assert client.statistics().messages_dropped == 0
    assert torch.equal(got, torch.cat([part0.embedding, part1.embedding]))
    assert counts == part0.token_counts + part1.token_counts
    for (index, tokens, grid, emb), single in zip(items, singles):
        assert tokens == single.token_counts[0] and grid == tuple(single.grid_thw[0]), index
        torch.testing.assert_close(emb, single.embedding, rtol=1e-4, atol=1e-4)
    assert len({tuple(g) for _, _, g, _ in items}) > 1  # sizes differ, so slicing is exercised


async def test_a_bad_item_fails_the_request_and_leaves_no_live_part(qwen25_path: str) -> None:
    async with encoders(qwen25_path, 2) as servers, \
            open_encoder_client(encoder_urls=[s.url for s in servers], pool_bytes=1 << 20) as client:
        with pytest.raises(RemoteEncodeError) as info:
            await client.encode({"image": [png_bytes(56, 56), b"not an image"]}, req_id="bad")
        assert (info.value.status_code, info.value.error_type) == (400, "RequestError")
        assert info.value.part_idx == 1 and info.value.encoder_url == servers[1].url
        await wait_idle(servers)
        assert_clean(client)
        async with await client.encode({"image": [png_bytes(56, 56)]}) as result:  # still fine
            assert result.embeddings["image"].shape[1] == 40


async def test_a_timeout_aborts_the_parts_on_their_encoders(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Encoders push to an endpoint nobody binds, so each part stays live in its send
    # (send_timeout 60 s) until our /abort cancels it.
    # A failed scope's last error notice to that receiver waits out its bound (5 s)
    # before the scope is released: 0.1 s here.
    monkeypatch.setattr("epd_trio.encoder.service._ERROR_NOTICE_TIMEOUT", 0.1)
    async with encoders(qwen25_path, 2) as servers, \
            open_encoder_client(encoder_urls=[s.url for s in servers], pool_bytes=1 << 20,
                                zmq_bind="tcp://127.0.0.1:0",
                                zmq_advertise=f"tcp://127.0.0.1:{free_port()}") as client:
        with pytest.raises(EncodeTimeout):
            await client.encode({"image": [png_bytes(56, 56), png_bytes(56, 56, 1)]}, timeout=1.5)
        assert client.statistics().aborts_sent == 2
        assert_clean(client)
        await wait_idle(servers)
    for s in servers:
        assert s.service.registry.statistics().aborted == 1


async def test_an_unreachable_encoder_is_skipped(qwen25_path: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with encoders(qwen25_path, 1) as (server,), \
            open_encoder_client(encoder_urls=[dead, server.url], pool_bytes=1 << 20) as client:
        images = [png_bytes(56, 56, seed=i) for i in range(3)]
        async with await client.encode({"image": images}) as result:
            reference = await server.service.engine.encode(images[:2], "image")
            assert torch.equal(result.embeddings["image"][:reference.embedding.shape[0]],
                               reference.embedding)
        assert client.statistics().retries == 1
        assert_clean(client)
