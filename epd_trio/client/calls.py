"""One way to call any encoder by its URL: ``post(url, path, body)`` → an answer.

The router and the Mooncake writer speak protocol v1 bodies (``/encode``,
``/send``, ``/abort``) and read answers (``answers.Answer``); which face carries
them is the URL's business: ``http(s)://`` through the client's httpx client,
``grpc://`` through its gRPC channels (``grpc_channel``). A request may mix
both. Failures of the call itself are httpx errors (HTTP) or ``EPDError``s
(gRPC: ``EncoderUnreachable`` when no connection could be made, or when the
path has no RPC there, so that a part moves to an encoder that serves it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import httpx
import msgspec

from epd_trio.client.answers import Answer, EncoderUnreachable
from epd_trio.client.grpc_channel import GRPC_SCHEME, GrpcChannels
from epd_trio.client.liveness import tcp_socket_options
from epd_trio.errors import PayloadTooLargeError, PeerUnavailable

__all__ = ["EncoderCalls", "encoder_transport"]

log = logging.getLogger(__name__)


def encoder_transport() -> httpx.AsyncHTTPTransport:
    """httpx's transport with dead-peer detection on every connection (``liveness``)."""
    return httpx.AsyncHTTPTransport(socket_options=tcp_socket_options())

# identity: a body is never inflated past what the cap counted
_JSON = (("content-type", "application/json"), ("accept-encoding", "identity"))
_URLS_KEPT = 1024  # parsed request URLs kept per client


class _Capped(httpx.AsyncByteStream):
    """An answer's body, refused once it passes ``limit`` bytes (a broken encoder's endless
    body would otherwise be read into the client's memory whole)."""

    def __init__(self, inner: httpx.AsyncByteStream, limit: int, url: str) -> None:
        self.inner, self.limit, self.url = inner, limit, url

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async with aclosing(self.inner.__aiter__()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                seen += len(chunk)
                if seen > self.limit:
                    raise PayloadTooLargeError(f"{self.url} answered with over {self.limit} bytes "
                                               "(more than the client's pool could ever hold)")
                yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class EncoderCalls:
    """The client's two faces behind one call, chosen by URL scheme."""

    def __init__(self, http: httpx.AsyncClient, grpc: GrpcChannels, *,
                 max_answer_bytes: int = 1 << 40, probes: httpx.AsyncClient | None = None) -> None:
        self.http = http
        self.grpc = grpc
        # Probes get their own connection pool: one full of calls would hold a probe back
        # until a live encoder looked dead.
        self.probes = probes or http
        self.max_answer_bytes = max_answer_bytes  # an HTTP answer's body, at most
        # What http.build_request would merge into every request, merged once: it cost the
        # caller's trio thread ~80 µs per request (URL parsing, header and cookie merging).
        self._headers = httpx.Headers(http.headers)
        self._headers.update(_JSON)
        self._extensions = {"timeout": http.timeout.as_dict()}
        self._urls: dict[str, httpx.URL] = {}  # parsed once per encoder URL and path

    async def post(self, url: str, path: str, body: dict[str, Any],
                   headers: Mapping[str, str] | None = None) -> Answer:
        """``body`` to ``url + path``; ``headers`` are added to the JSON ones (HTTP only)."""
        if url.startswith(GRPC_SCHEME):
            if not self.grpc.serves(path):
                raise EncoderUnreachable(f"{url} is a gRPC encoder: it has no {path}")
            return await self.grpc.post(url, path, body)  # grpcio bounds its messages itself
        merged = self._headers
        if headers:
            merged = httpx.Headers(self._headers)
            merged.update(headers)
        # msgspec, not httpx's json.dumps: a 448 px PNG's data: URI (0.6 MB) cost the
        # caller's event loop ~3.6 ms to encode that way, ~0.25 ms here (same JSON).
        request = httpx.Request("POST", self._url(url + path), content=msgspec.json.encode(body),
                                headers=merged, extensions=self._extensions)
        response = await self.http.send(request, stream=True)
        try:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_answer_bytes):
                raise PayloadTooLargeError(f"{url} answered with {declared} bytes, over the "
                                           f"{self.max_answer_bytes} the client's pool could ever hold")
            response.stream = _Capped(response.stream, self.max_answer_bytes, url)  # type: ignore[arg-type]
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def probe(self, url: str) -> None:
        """Return once the encoder at ``url`` answers anything (``/model_info``, the cheapest
        route every face serves; any status will do): its host and process are alive.
        ``PeerUnavailable`` when no answer could come; the caller bounds the wait."""
        if url.startswith(GRPC_SCHEME):
            await self.grpc.probe(url)
            return
        try:
            async with self.probes.stream("GET", url + "/model_info") as response:  # its body is not read
                log.debug("%s answered a probe (%d)", url, response.status_code)
        except httpx.TransportError as exc:
            raise PeerUnavailable(f"{url} did not answer: {exc!r}") from exc

    def _url(self, text: str) -> httpx.URL:
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) >= _URLS_KEPT:  # encoders come and go (discovery): stay bounded
                self._urls.clear()
            url = self._urls[text] = httpx.URL(text)
        return url
