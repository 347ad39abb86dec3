"""Encoder URLs as every part names them: one normal form, and what is refused.

The registry, the client's encoder list, the configuration and an encoder's
advertised URL all compare URLs as strings, so all of them go through
``normalize_url``. Pure: the standard library and the error tree only.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote, urlsplit

from epd_trio.errors import RequestError

__all__ = ["ENCODER_SCHEMES", "MAX_URL_LENGTH", "normalize_url"]

MAX_URL_LENGTH = 2048
ENCODER_SCHEMES = ("http", "https", "grpc")  # what a client reaches an encoder by
_HOSTNAME = re.compile(r"^[a-z0-9_](?:[a-z0-9._-]*[a-z0-9_])?$")
# scheme://[address%zone]rest: the zone as written, up to the bracket that closes the host
_ZONED = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://\[[^\]/?#%]*)%([^\]/?#]*)(\].*)", re.DOTALL)
_AFTER_BRACKET = re.compile(r"(?::[0-9]*)?")  # what may follow "[v6 address]" in a netloc
_ZONE_ID = re.compile(r"[A-Za-z0-9._~-]+")  # RFC 3986's unreserved characters, as RFC 6874 allows


def normalize_url(raw: object, what: str = "url", *,
                  schemes: tuple[str, ...] = ("http", "https"), require_port: bool = True) -> str:
    """``scheme://host:port[/path]`` with scheme and host lower-cased and no trailing ``/``.

    Accepts ``schemes`` only (http and https unless told: a client also reads
    ``grpc://`` encoders), with a host and an explicit port (optional with
    ``require_port=False``: a client's own list may lean on the scheme's
    default, and is kept without one rather than guessed); refuses
    credentials, queries, fragments, dot path segments, whitespace and control
    characters (any of them → ``RequestError``, a 400 on the wire).

    An IPv6 zone id (``fe80::1%25eth0``, or bare ``fe80::1%eth0``) is one zone however
    written, kept as its scheme's client connects with it: bare for http(s), as httpx
    hands the host to ``getaddrinfo`` undecoded; ``%25`` for grpc, as grpcio
    percent-decodes its target (a bare ``%12`` would reach it as the byte 0x12).
    """
    if not isinstance(raw, str) or not raw:
        raise RequestError(f"{what} must be a non-empty string")
    shown = repr(raw[:200])
    if len(raw) > MAX_URL_LENGTH:
        raise RequestError(f"{what} is longer than {MAX_URL_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in raw):
        raise RequestError(f"{what} must not contain whitespace or control characters: {shown}")
    unzoned, zone = _split_zone(raw, what, shown)
    try:
        parts = urlsplit(unzoned)
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
    if "]" in parts.netloc and not _AFTER_BRACKET.fullmatch(parts.netloc.partition("]")[2]):
        # urlsplit would drop "junk" from "[::1]junk:1": another string, the same encoder
        raise RequestError(f"{what} has text between its IPv6 host and its port: {shown}")
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
    if zone:
        if ":" not in host:  # "[v1.x%eth0]": urlsplit reads an IPvFuture literal as a name
            raise RequestError(f"{what} has an invalid IPv6 host: {shown}")
        if scheme != "grpc" and zone.startswith("25"):  # written bare, it would read back as %25…
            raise RequestError(f"{what} has an IPv6 zone id starting with '25', which an http(s) "
                               f"URL cannot hold unambiguously (name the interface): {shown}")
        host += ("%25" if scheme == "grpc" else "%") + zone
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{port}" if port else ""
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def _split_zone(raw: str, what: str, shown: str) -> tuple[str, str]:
    """``raw`` without its IPv6 zone id, and the zone (``""``: none), for ``urlsplit`` to
    read an address it checks the same on every Python release.

    ``%25`` starts RFC 6874's form (``%251`` is zone ``1``, not index 251), whose
    zone may be pct-encoded; anything else after the ``%`` is the bare zone, undecoded.
    Either way the zone must be unreserved characters, all an interface name needs.
    """
    zoned = _ZONED.fullmatch(raw)
    if zoned is None:
        return raw, ""
    written = zoned.group(2)
    zone = unquote(written[2:]) if written.startswith("25") else written
    if not zone:
        raise RequestError(f"{what} has an empty IPv6 zone id: {shown}")
    if not _ZONE_ID.fullmatch(zone):
        raise RequestError(f"{what} has an invalid IPv6 zone id (letters, digits, '-', '.', '_' "
                           f"and '~' only): {shown}")
    return zoned.group(1) + zoned.group(3), zone


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
