"""Discovery: the client's encoder list, its static URLs merged with a registry's.

``fetch_encoder_urls`` is the one call a client makes to a bootstrap registry.
``Discovery`` runs it in the background every ``refresh_interval`` seconds
(no drift) and hands each merged list to the router; a failed query keeps the
last list, since a registry hiccup is not an outage. Requests never wait for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import httpx
import trio
from trio_util import periodic

from epd_trio.client.answers import json_of
from epd_trio.protocol.urls import ENCODER_SCHEMES, normalize_url
from epd_trio.errors import (
    PeerUnavailable,
    ProtocolError,
    RequestError,
    TransferTimeout,
    TransportError,
)

__all__ = ["Discovery", "DiscoveryStatistics", "fetch_encoder_urls", "merge_urls"]

log = logging.getLogger(__name__)

# A registry may list gRPC encoders too (epd-trio's own registers http(s) only: it probes /health).


def merge_urls(urls: Sequence[str]) -> tuple[str, ...]:
    """``urls`` without trailing slashes or repeats, first occurrence first."""
    return tuple(dict.fromkeys(u.rstrip("/") for u in urls))


@dataclass(frozen=True)
class DiscoveryStatistics:
    bootstrap_url: str
    refreshes: int  # registry queries answered
    refresh_failures: int  # registry queries that failed (the last list was kept)
    found: int  # encoders the last answered query listed


class Discovery:
    """Follows one registry; ``on_list`` gets the static URLs merged with its list."""

    def __init__(self, static: Sequence[str], bootstrap_url: str, *, interval: float,
                 timeout: float, on_list: Callable[[tuple[str, ...]], None]) -> None:
        self._static = merge_urls(static)
        self._url = bootstrap_url
        self._interval = interval
        self._timeout = timeout
        self._on_list = on_list
        self._refreshes = 0
        self._failures = 0
        self._found = 0

    async def run(self, http: httpx.AsyncClient, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh forever; ``started`` once the first query is done (answered or not)."""
        async with aclosing(periodic(self._interval)) as ticks:
            async for _ in ticks:
                await self.refresh(http)
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED

    async def refresh(self, http: httpx.AsyncClient) -> None:
        """One query; on any ``TransportError`` the last list stays."""
        try:
            found = await fetch_encoder_urls(http, self._url, self._timeout)
        except TransportError as exc:
            self._failures += 1
            log.warning("encoder list not refreshed: %s", exc)
            return
        self._refreshes += 1
        self._found = len(found)
        self._on_list(merge_urls((*self._static, *found)))

    def statistics(self) -> DiscoveryStatistics:
        return DiscoveryStatistics(self._url, self._refreshes, self._failures, self._found)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Discovery {s.bootstrap_url}: {s.found} found, {s.refreshes} refreshes,"
                f" {s.refresh_failures} failed>")


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
        raise PeerUnavailable(f"registry {base} is unreachable: {exc or type(exc).__name__}") from None
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
