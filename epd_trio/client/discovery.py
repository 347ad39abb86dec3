"""Discovery: the client's encoder list, its static URLs merged with what it finds.

Two sources, either or both: a bootstrap registry (``fetch_encoder_urls``, the
one call a client makes to it) and a DNS name whose every address is an encoder
(``resolve_encoder_urls``: a Kubernetes headless Service has one A/AAAA record
per ready pod). ``Discovery`` queries them in the background every
``refresh_interval`` seconds (no drift), concurrently, and hands the merged
list (static, then the registry's, then the name's) to the router. A source
that fails keeps its last list, since a registry or resolver hiccup is not an
outage; a name that does not exist (NXDOMAIN) is an empty list. Requests never
wait for it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import trio
from trio_util import periodic

from epd_trio.client.answers import json_of
from epd_trio.errors import (
    PeerUnavailable,
    ProtocolError,
    RequestError,
    TransferTimeout,
    TransportError,
)
from epd_trio.protocol.urls import ENCODER_SCHEMES, normalize_url

__all__ = [
    "Discovery",
    "DiscoveryStatistics",
    "fetch_encoder_urls",
    "merge_urls",
    "resolve_encoder_urls",
]

log = logging.getLogger(__name__)

# A registry may list gRPC encoders too (epd-trio's own registers http(s) only: it probes /health).
# The resolver's answers that mean "no such name" (so no encoder), not "ask again later".
_NO_SUCH_NAME = frozenset(code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
                          if code is not None)

Resolve = Callable[[str, float], Awaitable[list[str]]]


def merge_urls(urls: Sequence[str]) -> tuple[str, ...]:
    """``urls`` without trailing slashes or repeats, first occurrence first."""
    return tuple(dict.fromkeys(u.rstrip("/") for u in urls))


@dataclass(frozen=True)
class DiscoveryStatistics:
    bootstrap_url: str | None
    refreshes: int  # registry queries answered
    refresh_failures: int  # registry queries that failed (the last list was kept)
    found: int  # encoders the last answered registry query listed
    dns: str | None = None  # the discovery_dns URL
    dns_refreshes: int = 0  # resolutions answered (NXDOMAIN included: no encoder)
    dns_failures: int = 0  # resolutions that failed (the last list was kept)
    dns_found: int = 0  # addresses the last answered resolution gave


class _Source:
    """One source's last good list and its counters."""

    def __init__(self, name: str, query: Callable[[], Awaitable[list[str]]]) -> None:
        self.name, self.query = name, query
        self.urls: list[str] = []
        self.answered = self.failed = 0

    async def refresh(self) -> None:
        try:
            self.urls = await self.query()
        except TransportError as exc:
            self.failed += 1
            log.warning("encoder list not refreshed from %s: %s", self.name, exc)
            return
        self.answered += 1


class Discovery:
    """Follows a registry and/or a DNS name; ``on_list`` gets the static URLs merged with theirs."""

    def __init__(self, static: Sequence[str], bootstrap_url: str | None, *, interval: float,
                 timeout: float, on_list: Callable[[tuple[str, ...]], None],
                 dns: str | None = None, resolve: Resolve | None = None) -> None:
        self._static = merge_urls(static)
        self._url = bootstrap_url
        self._dns = dns
        self._interval = interval
        self._timeout = timeout
        self._on_list = on_list
        self._http: httpx.AsyncClient | None = None
        resolver = resolve or resolve_encoder_urls
        self._registry = _Source(f"registry {bootstrap_url}", self._ask_registry) \
            if bootstrap_url else None
        self._name = _Source(f"DNS name {dns}", lambda: resolver(dns, timeout)) if dns else None

    async def _ask_registry(self) -> list[str]:
        assert self._http is not None and self._url is not None
        return await fetch_encoder_urls(self._http, self._url, self._timeout)

    async def run(self, http: httpx.AsyncClient, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh forever; ``started`` once the first queries are done (answered or not)."""
        async with aclosing(periodic(self._interval)) as ticks:
            async for _ in ticks:
                await self.refresh(http)
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED

    async def refresh(self, http: httpx.AsyncClient) -> None:
        """One query per source, concurrently; a source that fails keeps its last list."""
        self._http = http
        sources = [s for s in (self._registry, self._name) if s is not None]
        async with trio.open_nursery() as nursery:
            for source in sources:
                nursery.start_soon(source.refresh)
        self._on_list(merge_urls((*self._static, *(u for s in sources for u in s.urls))))

    def statistics(self) -> DiscoveryStatistics:
        return DiscoveryStatistics(self._url, *_counts(self._registry), self._dns,
                                   *_counts(self._name))

    def __repr__(self) -> str:
        s = self.statistics()
        shown = []
        if s.bootstrap_url:
            shown.append(f"{s.bootstrap_url}: {s.found} found, {s.refreshes} refreshes,"
                         f" {s.refresh_failures} failed")
        if s.dns:
            shown.append(f"{s.dns}: {s.dns_found} found, {s.dns_refreshes} refreshes,"
                         f" {s.dns_failures} failed")
        return f"<Discovery {'; '.join(shown)}>"


def _counts(source: _Source | None) -> tuple[int, int, int]:
    return (source.answered, source.failed, len(source.urls)) if source is not None else (0, 0, 0)


async def resolve_encoder_urls(dns_url: str, timeout: float) -> list[str]:
    """Every address ``dns_url``'s host resolves to (A and AAAA), as ``scheme://address:port``
    in the resolver's order; ``[]`` when the name does not exist.

    Raises ``TransferTimeout`` after ``timeout`` seconds and ``PeerUnavailable`` when the
    resolver fails otherwise (both ``TransportError``: the caller keeps its last list).
    """
    parts = urlsplit(dns_url)
    host, port = parts.hostname or "", parts.port
    try:
        with trio.fail_after(timeout):  # the resolver's thread is abandoned on cancel
            found = await trio.socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except trio.TooSlowError:
        raise TransferTimeout(f"{host} was not resolved within {timeout:g} s") from None
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            return []
        raise PeerUnavailable(f"{host} could not be resolved: {exc.strerror or exc}") from None
    addresses = dict.fromkeys(str(info[4][0]) for info in found)
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses]


async def fetch_encoder_urls(http: httpx.AsyncClient, bootstrap_url: str, timeout: float) -> list[str]:
    """``GET {bootstrap_url}/list_encoder_urls`` → the healthy encoders' URLs, normalized,
    deduplicated, in the registry's order.

    Raises ``TransferTimeout`` after ``timeout`` seconds, ``PeerUnavailable`` when the
    registry cannot be reached or answers an error, ``ProtocolError`` when its answer
    is not ``{"encoder_urls": [url, ...]}`` — all ``TransportError``, so a caller
    refreshing in the background can keep its previous list on any of them.
    """
    base = bootstrap_url.rstrip("/")
    try:
        with trio.fail_after(timeout):
            response = await http.get(base + "/list_encoder_urls")
    except trio.TooSlowError:
        raise TransferTimeout(f"registry {base} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise PeerUnavailable(f"registry {base} is unreachable: {str(exc) or type(exc).__name__}") from None
    if response.status_code != 200:
        raise PeerUnavailable(f"registry {base} answered HTTP {response.status_code}")
    return _parse_list(response, base)


def _parse_list(response: httpx.Response, base: str) -> list[str]:
    try:
        body = json_of(response)
    except ValueError:
        raise ProtocolError(f"registry {base} answered something that is not JSON") from None
    urls = body.get("encoder_urls") if isinstance(body, dict) else None
    if not isinstance(urls, list):
        raise ProtocolError(f"registry {base} answered without an 'encoder_urls' list")
    try:
        return list(dict.fromkeys(normalize_url(url, "encoder url", schemes=ENCODER_SCHEMES)
                                  for url in urls))
    except RequestError as exc:
        raise ProtocolError(f"registry {base} listed a bad URL: {exc.message}") from None
