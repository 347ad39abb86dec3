"""The inline backend: embeddings in the HTTP answers, no sockets of the client's own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
import trio

from conftest import png_bytes
from epd_trio import open_encoder_client
from epd_trio.errors import PayloadTooLargeError


async def test_inline_equals_zmq(encoder: Any) -> None:
    images = [png_bytes(56 + 28 * i, 84, seed=i) for i in range(3)]
    async with encoder() as (s1, _), encoder() as (s2, _):
        urls = [s1.url, s2.url]
        async with open_encoder_client(encoder_urls=urls, transfer_backend="inline") as inline, \
                open_encoder_client(encoder_urls=urls) as zmq:
            async with await inline.encode({"image": images}) as a, await zmq.encode({"image": images}) as b:
                assert torch.equal(a.embeddings["image"], b.embeddings["image"])
                assert a.token_counts == b.token_counts and len(a.parts) == 2
            assert inline.statistics().messages_received == 0
            assert inline.endpoint == ""


# Cut mid-body, httpx's MockTransport leaves its own nested body generator for the garbage
# collector (ours and httpx's outer ones are closed): that warning, and only it, is expected.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx._content.AsyncIteratorByteStream"
                            ".__aiter__' was garbage collected:ResourceWarning")
@pytest.mark.parametrize("declared", [True, False])
async def test_an_answer_larger_than_the_pool_could_hold_is_not_read_whole(declared: bool) -> None:
    """A broken encoder's endless (or merely enormous) inline body: refused at its
    Content-Length, or once the bytes read pass the pool's size, never read into memory whole."""
    pool_bytes, sent = 64 * 1024, []

    async def body() -> Any:
        for _ in range(64):  # 64 MiB, were it all read
            sent.append(1)
            yield bytes(1 << 20)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort":
            return httpx.Response(200, json={"aborted": 1})
        assert request.headers["accept-encoding"] == "identity"
        if declared:
            return httpx.Response(200, content=bytes(pool_bytes + (2 << 20)))
        return httpx.Response(200, content=body())

    async with open_encoder_client(encoder_urls=["http://e:1"], transfer_backend="inline",
                                   pool_bytes=pool_bytes,
                                   http_transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(PayloadTooLargeError, match="http://e:1 answered with"):
            await client.encode({"image": [png_bytes(8, 8)]})
        assert client.statistics().requests_live == 0
    assert declared or len(sent) <= 3  # read up to the cap (pool + 1 MiB), then let go


async def test_a_kept_tensor_outlives_its_result_unchanged(encoder: Any) -> None:
    """A user keeps one item's tensor (a view into the pool) and drops the result: the
    pool counts the leak but hands that memory to no later request."""
    import gc

    first, later = png_bytes(56, 56, seed=1), [png_bytes(56, 56, seed=s) for s in (2, 3, 4)]
    async with encoder() as (server, _):
        async with open_encoder_client(encoder_urls=[server.url], transfer_backend="inline",
                                       pool_bytes=64 * 1024) as client:
            result = await client.encode({"image": [first]})
            kept, expected = result.items[0].embedding, result.items[0].embedding.clone()
            size = result.slot.size
            del result
            gc.collect()
            for image in later:  # each the same size as the first: first fit would reuse its bytes
                async with await client.encode({"image": [image]}) as other:
                    assert other.slot.offset >= size  # never where `kept` lives
                    assert not torch.equal(other.items[0].embedding, expected)
                assert not other.items and not other.embeddings  # the result let go of its views
            assert torch.equal(kept, expected)
            pool = client.pool.statistics()
            assert (pool.leaked, pool.view_held, pool.used_bytes) == (1, 1, size), pool
            del kept
            with trio.fail_after(5):
                while client.pool.statistics().used_bytes:
                    await trio.sleep(0.01)
