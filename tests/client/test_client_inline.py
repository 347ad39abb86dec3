"""The inline backend: embeddings in the HTTP answers, no sockets of the client's own."""

from __future__ import annotations

from typing import Any

import torch

from conftest import png_bytes
from epd_trio import open_encoder_client


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
