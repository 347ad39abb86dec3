"""One proxied request's course: admit, store its media on the encoders, forward, relay.

Why this shape. vLLM's disaggregated encoder (EPD) names every media item of
a request by its ``mm_hash`` and has its language server look each one up in
an EC connector before running its own encoder; an *encoder instance* is
anything that, given a chat request, stores its items there and answers 200.
So the proxy needs no embeddings of its own: it sends a request's media parts,
verbatim, to encoder instances and waits for their 200s, then forwards the
original request, unchanged, to a language server, which finds every item
stored. The fan-out is the encoder client's (``EncoderClient.encode_for_vllm``:
the items split over the least-loaded encoders, registry discovery, failover,
one deadline, clean-up), driving the vLLM face over HTTP; so epd_trio
encoders (``--api vllm``) and vLLM's own encoder instances both serve, and a
part that reached an encoder is named by it exactly as vLLM would name it.

Errors reach the caller as OpenAI error objects: an encoder's own answer
with its status (a 4xx is the request's fault: a bad image, a model the
encoder does not serve), 503 when no encoder or language server can be
reached, 504 when the encoders or the language server run out of time. A
language server's answers, errors included, are relayed as they are
(``relay``). The caller leaving cancels everything (the app's watcher):
the encoders' calls and the forwarded request close, and both abort.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx
import trio

from epd_trio._http import parse_json_off_loop
from epd_trio.client import EncoderClient
from epd_trio.config import ProxyConfig
from epd_trio.errors import DeadlineExceeded, OverloadedError, PeerUnavailable
from epd_trio.protocol.proxy_requests import ProxiedRequest, parse_proxied
from epd_trio.proxy.metrics import ProxyMetrics
from epd_trio.proxy.relay import Relay
from epd_trio.proxy.upstream import (
    LanguageServers,
    ServerState,
    open_upstream,
    relayed_headers,
)

__all__ = ["CHAT_ROUTE", "COMPLETIONS_ROUTE", "EPDProxy", "ProxyStatistics"]

log = logging.getLogger(__name__)

CHAT_ROUTE: Final = "/v1/chat/completions"
COMPLETIONS_ROUTE: Final = "/v1/completions"
Send = Callable[[dict[str, Any]], Awaitable[None]]
_JSON_THREADS: Final = 2  # large bodies are parsed off the event loop, two at a time


@dataclass(frozen=True)
class ProxyStatistics:
    requests_live: int
    requests_done: int  # answered by a language server (any status)
    requests_failed: int  # answered by the proxy with an error of its own
    servers: tuple[ServerState, ...]


class EPDProxy:
    """The proxy's behaviour; its HTTP face is ``app.ProxyApp``, its lifetime ``server``."""

    def __init__(self, config: ProxyConfig, client: EncoderClient, servers: LanguageServers,
                 http: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.servers = servers
        self.http = http
        self.metrics = ProxyMetrics(self.statistics)
        self._threads = trio.CapacityLimiter(_JSON_THREADS)
        self._live = self._done = self._failed = 0

    def admit(self) -> None:
        """Count a request in, or refuse it at once (``max_requests``)."""
        if self._live >= self.config.max_requests:
            raise OverloadedError(f"the proxy has {self._live} requests in flight "
                                  f"(--max-requests {self.config.max_requests})")
        self._live += 1

    def leave(self, answered_by_server: bool) -> None:
        self._live -= 1
        if answered_by_server:
            self._done += 1
        else:
            self._failed += 1

    async def parse(self, raw: bytes, route: str) -> ProxiedRequest:
        body = await parse_json_off_loop(raw, self._threads)
        return parse_proxied(body, chat=route == CHAT_ROUTE)

    async def store_media(self, request: ProxiedRequest, request_id: str) -> None:
        """The encoders store the request's media items where the language server looks."""
        started = trio.current_time()
        stored = await self.client.encode_for_vllm(request.media, options=request.body,
                                                   req_id=request_id)
        seconds = trio.current_time() - started
        self.metrics.encoded({m: len(p) for m, p in request.media.items()}, seconds)
        log.info("request %s: %d media items stored by %s in %.3f s", request_id,
                 request.item_count, ", ".join(sorted({p.encoder_url for p in stored.parts})), seconds)

    async def forward(self, route: str, raw: bytes, headers: Sequence[tuple[bytes, bytes]],
                      request_id: str, relay: Relay) -> None:
        """The request to a language server, its answer through ``relay``.

        Raises (before anything was sent) ``PeerUnavailable`` or ``DeadlineExceeded``.
        """
        forwarded = [(k, v) for k, v in relayed_headers(headers) if k.lower() != b"x-request-id"]
        forwarded.append((b"x-request-id", request_id.encode()))
        failure: PeerUnavailable | DeadlineExceeded | None = None
        with trio.move_on_after(self.config.upstream_timeout) as timer:
            try:
                async with open_upstream(self.http, self.servers, "POST", route, content=raw,
                                         headers=forwarded) as upstream:
                    log.info("request %s: forwarded to %s", request_id, upstream.url)
                    await relay.answer(upstream)
            except httpx.HTTPError as exc:  # mid-answer: its head is out
                failure = PeerUnavailable(f"the language server's answer broke off: "
                                          f"{type(exc).__name__}: {exc}", req_id=request_id)
        if timer.cancelled_caught:
            failure = DeadlineExceeded(f"the language server did not answer within "
                                       f"{self.config.upstream_timeout:g} s (--upstream-timeout)",
                                       req_id=request_id)
        if failure is not None:
            if not relay.started:
                raise failure
            await relay.cut(failure)

    async def models(self, send: Send) -> None:
        """``GET /v1/models``, passed through to a healthy language server."""
        relay = Relay(send, "models", lambda: None)
        with trio.move_on_after(self.config.upstream_timeout):
            try:
                async with open_upstream(self.http, self.servers, "GET", "/v1/models") as upstream:
                    await relay.answer(upstream)
                    return
            except httpx.HTTPError as exc:
                if not relay.started:
                    raise PeerUnavailable(f"/v1/models failed: {type(exc).__name__}: {exc}") from None
                return
        if not relay.started:
            raise DeadlineExceeded("no language server listed its models in time")

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(self._live, self._done, self._failed, self.servers.statistics())

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<EPDProxy {s.requests_live} live, {s.requests_done} done, {s.requests_failed} "
                f"failed; {self.servers!r}; {self.client!r}>")
