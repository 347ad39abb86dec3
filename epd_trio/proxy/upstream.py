"""The language servers behind the proxy: which are healthy, how busy, who gets a request.

``LanguageServers`` keeps the prefill/decode (vLLM) servers in the registry
the bootstrap server uses (``bootstrap.registry``), probed by its health loop
(``GET /health`` every ``health_interval``; ``max_failures`` misses in a row
take a server out of rotation, one answer brings it back; a static server is
never forgotten). A request goes to the healthy server with the fewest
requests in flight (ties: the configured order, ``client.routing``'s rule).

``open_upstream`` sends one request there. A server that cannot be connected
to counts as a missed probe and the request moves to the next one, since it
never reached the first; once the request is sent it is not sent again (a
language server's work is not free, and a stream may have begun).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Final

import httpx
import trio

from epd_trio.bootstrap.registry import Registry
from epd_trio.client.routing import pick_fallback
from epd_trio.errors import PeerUnavailable

__all__ = ["LanguageServers", "ServerState", "Upstream", "open_upstream", "relayed_headers"]

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1), ``expect`` (about the caller's own connection) and
# those the HTTP stack sets itself: never relayed.
_NOT_RELAYED: Final = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"expect", b"host", b"content-length", b"date",
    b"server",
})
_CLOSE_TIMEOUT: Final = 5.0  # seconds closing an upstream answer may take (shielded)


@dataclass(frozen=True)
class ServerState:
    url: str
    healthy: bool
    failures: int  # consecutive missed probes (a failed connect counts as one)
    in_flight: int  # requests forwarded there and not yet answered whole
    forwarded: int  # requests sent there, in all


class LanguageServers:
    """The prefill/decode servers' live state; every change is synchronous."""

    def __init__(self, urls: Sequence[str], *, max_failures: int) -> None:
        if not urls:
            raise ValueError("the proxy needs at least one prefill/decode server")
        self.registry = Registry(max_failures=max_failures, evicted_ttl=math.inf,
                                 max_encoders=len(urls))
        for url in urls:
            self.registry.register(url, 0.0)
        self._in_flight = dict.fromkeys(urls, 0)
        self._forwarded = dict.fromkeys(urls, 0)

    def pick(self, tried: Sequence[str] = ()) -> str | None:
        """The healthy server with the fewest requests in flight, not in ``tried``."""
        return pick_fallback(self.registry.healthy_urls(), self._in_flight, tried)

    def unreachable(self, url: str, now: float) -> None:
        """A connect failed: as a missed probe (``max_failures`` of them take it out)."""
        self.registry.record_probe(url, False, now)

    @contextmanager
    def holding(self, url: str) -> Iterator[None]:
        """Count a request in flight at ``url`` for the block."""
        self._in_flight[url] += 1
        try:
            yield
        finally:
            self._in_flight[url] -= 1

    def sent(self, url: str) -> None:
        self._forwarded[url] += 1

    @property
    def any_healthy(self) -> bool:
        return bool(self.registry.healthy_urls())

    def statistics(self) -> tuple[ServerState, ...]:
        return tuple(ServerState(e.url, e.healthy, e.failures, self._in_flight[e.url],
                                 self._forwarded[e.url]) for e in self.registry.entries())

    def __repr__(self) -> str:
        states = self.statistics()
        return (f"<LanguageServers {sum(s.healthy for s in states)}/{len(states)} healthy, "
                f"{sum(s.in_flight for s in states)} requests in flight>")


@dataclass(frozen=True)
class Upstream:
    """A language server's answer, its head received and its body still to be read."""

    url: str
    response: httpx.Response


def relayed_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop-by-hop ones and those the HTTP stack sets itself."""
    return [(k, v) for k, v in headers if k.lower() not in _NOT_RELAYED]


@asynccontextmanager
async def open_upstream(http: httpx.AsyncClient, servers: LanguageServers, method: str, path: str,
                        *, content: bytes = b"", headers: Sequence[tuple[bytes, bytes]] = ()
                        ) -> AsyncIterator[Upstream]:
    """Send one request to a healthy language server; its answer, open, for the block.

    ``PeerUnavailable`` when no healthy server is left to try, or the chosen one
    fails before its answer starts. Leaving the block closes the answer: a stream
    not read to its end closes the connection, which aborts the server's request.
    """
    tried: list[str] = []
    while True:
        url = servers.pick(tried)
        if url is None:
            raise PeerUnavailable(_none_left(servers, tried))
        request = http.build_request(method, url + path, content=content or None, headers=headers)
        with servers.holding(url):
            try:
                response = await http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                servers.unreachable(url, trio.current_time())
                tried.append(url)
                log.warning("language server %s unreachable (%s); trying another", url, exc)
                continue
            except httpx.HTTPError as exc:
                servers.sent(url)
                raise PeerUnavailable(f"language server {url} failed before answering: "
                                      f"{type(exc).__name__}: {exc}") from None
            servers.sent(url)
            try:
                yield Upstream(url, response)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
                    await response.aclose()
            return


def _none_left(servers: LanguageServers, tried: Sequence[str]) -> str:
    if tried:
        return f"no prefill/decode server could be reached (tried {', '.join(tried)})"
    return (f"no healthy prefill/decode server (of {len(servers.statistics())}; their /health "
            "probes fail)")
