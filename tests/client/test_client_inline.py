"""The inline backend: embeddings in the HTTP answers, no sockets of the client's own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

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
