"""Encoder URLs as every part names them: one normal form, and what is refused.

The registry, the client's encoder list, the configuration and an encoder's
advertised URL all compare URLs as strings, so all of them go through
``normalize_url``. Pure: the standard library and the error tree only.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from epd_trio.errors import RequestError

__all__ = ["ENCODER_SCHEMES", "MAX_URL_LENGTH", "normalize_url"]

MAX_URL_LENGTH = 2048
ENCODER_SCHEMES = ("http", "https", "grpc")  # what a client reaches an encoder by
_HOSTNAME = re.compile(r"^[a-z0-9_](?:[a-z0-9._-]*[a-z0-9_])?$")


def normalize_url(raw: object, what: str = "url", *,
                  schemes: tuple[str, ...] = ("http", "https"), require_port: bool = True) -> str:
    """``scheme://host:port[/path]`` with scheme and host lower-cased and no trailing ``/``.

    Accepts ``schemes`` only (http and https unless told: a client also reads
    ``grpc://`` encoders), with a host and an explicit port (optional with
    ``require_port=False``: a client's own list may lean on the scheme's
    default, and is kept without one rather than guessed); refuses
    credentials, queries, fragments, dot path segments, whitespace and control
    characters (any of them → ``RequestError``, a 400 on the wire).
    """
    if not isinstance(raw, str) or not raw:
        raise RequestError(f"{what} must be a non-empty string")
    shown = repr(raw[:200])
    if len(raw) > MAX_URL_LENGTH:
        raise RequestError(f"{what} is longer than {MAX_URL_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in raw):
        raise RequestError(f"{what} must not contain whitespace or control characters: {shown}")
    try:
        parts = urlsplit(raw)
    except ValueError as exc:  # e.g. a bracketed host that is no IPv6 address
        raise RequestError(f"{what} is not a valid URL ({exc}): {shown}") from None
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        names = [f"{s}://" for s in schemes]
        listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise RequestError(f"{what} must be an {listed} URL, got {shown}")
    if "@" in parts.netloc:
        raise RequestError(f"{what} must not carry credentials: {shown}")
    if parts.query or parts.fragment or raw.endswith(("?", "#")):
        raise RequestError(f"{what} must not have a query or fragment: {shown}")
    host = _host(parts.hostname, what, shown)
    try:
        port = parts.port
    except ValueError:
        raise RequestError(f"{what} has an invalid port: {shown}") from None
    if not port and (require_port or port == 0):
        raise RequestError(f"{what} must name a port (1-65535): {shown}")
    if any(segment.lower().replace("%2e", ".") in (".", "..") for segment in parts.path.split("/")):
        # /., /a/.. (plain or %2e) name the same server as another string: one encoder, many entries
        raise RequestError(f"{what} must not have '.' or '..' path segments: {shown}")
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{port}" if port else ""
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def _host(hostname: str | None, what: str, shown: str) -> str:
    if not hostname:
        raise RequestError(f"{what} must name a host: {shown}")
    if ":" in hostname:
        try:
            return str(ipaddress.IPv6Address(hostname))
        except ValueError:
            raise RequestError(f"{what} has an invalid IPv6 host: {shown}") from None
    if not _HOSTNAME.match(hostname) or not _dns_lengths_ok(hostname):
        raise RequestError(f"{what} has an invalid host: {shown}")
    return hostname


def _dns_lengths_ok(hostname: str) -> bool:
    """RFC 1035's lengths (a label 1-63, a name at most 253): longer ones no resolver takes
    (httpx's IDNA encoding raises on them), so they are refused here, once, for every user."""
    return len(hostname) <= 253 and all(1 <= len(label) <= 63 for label in hostname.split("."))
