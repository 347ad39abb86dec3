"""Asking a registry for the healthy encoders: the one call a client makes."""

from __future__ import annotations

import httpx
import trio

from epd_trio.bootstrap.registry import normalize_url
from epd_trio.errors import PeerUnavailable, ProtocolError, RequestError, TransferTimeout

__all__ = ["fetch_encoder_urls"]


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
        body = response.json()
    except ValueError:
        raise ProtocolError(f"registry {base} answered something that is not JSON") from None
    urls = body.get("encoder_urls") if isinstance(body, dict) else None
    if not isinstance(urls, list):
        raise ProtocolError(f"registry {base} answered without an 'encoder_urls' list")
    try:
        return list(dict.fromkeys(normalize_url(url, "encoder url") for url in urls))
    except RequestError as exc:
        raise ProtocolError(f"registry {base} listed a bad URL: {exc.message}") from None
