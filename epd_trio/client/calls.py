"""One way to call any encoder by its URL: ``post(url, path, body)`` → an answer.

The router and the Mooncake writer speak protocol v1 bodies (``/encode``,
``/send``, ``/abort``) and read answers (``answers.Answer``); which face carries
them is the URL's business: ``http(s)://`` through the client's httpx client,
``grpc://`` through its gRPC channels (``grpc_channel``). A request may mix
both. Failures of the call itself are httpx errors (HTTP) or ``EPDError``s
(gRPC: ``EncoderUnreachable`` when no connection could be made).
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from epd_trio.client.answers import Answer
from epd_trio.client.grpc_channel import GRPC_SCHEME, GrpcChannels

__all__ = ["EncoderCalls"]

_JSON = (("content-type", "application/json"),)


class EncoderCalls:
    """The client's two faces behind one call, chosen by URL scheme."""

    def __init__(self, http: httpx.AsyncClient, grpc: GrpcChannels) -> None:
        self.http = http
        self.grpc = grpc

    async def post(self, url: str, path: str, body: dict[str, Any]) -> Answer:
        if url.startswith(GRPC_SCHEME):
            return await self.grpc.post(url, path, body)
        # msgspec, not httpx's json.dumps: a 448 px PNG's data: URI (0.6 MB) cost the
        # caller's event loop ~3.6 ms to encode that way, ~0.25 ms here (same JSON).
        return await self.http.post(url + path, content=msgspec.json.encode(body),
                                    headers=_JSON)
