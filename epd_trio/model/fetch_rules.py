"""Where an encoder may fetch media from, decided before any connection.

Callers name the URLs an encoder fetches, and encoders sit inside cluster
networks: a URL could point one at the cloud's metadata service (credentials)
or at any other service only the cluster can reach (SSRF). So every hop of a
fetch is checked here first:

- every address the host is (an IP literal) or resolves to, against the
  address rules: cloud-metadata and link-local addresses are refused always;
  loopback, private and other non-global addresses only with ``deny_private``
  (encoders and media servers often share a private network);
- the host against the allow-list, when one is set; a name outside it is
  refused before any DNS lookup, and one inside it must pass the address
  rules too.

A name is resolved once, and the fetch connects to the address that was
checked; the name still goes to the server as the ``Host`` header and the TLS
server name. So a second DNS answer can never differ from the one checked (DNS
rebinding). IPv4 addresses embedded in IPv6 ones (mapped, NAT64, 6to4) are
judged as the IPv4 address they reach.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from epd_trio.errors import FetchRefusedError, RequestError

__all__ = ["FetchRules", "Pinned", "Resolver", "address_refusal", "pin", "resolve_host"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[bytes, int], Awaitable[Sequence[str]]]
"""``(host, port) → addresses``: the seam tests replace (no real DNS needed)."""

METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, ...
    "fd00:ec2::254",    # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
))
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
ALWAYS = "refused always"
PRIVATE_RULE = "refused by --fetch-deny-private"


@dataclass(frozen=True)
class FetchRules:
    """The hosts and addresses fetches may reach (``MediaLimits`` holds the settings)."""

    allow_hosts: tuple[str, ...] = ()  # lower case, no trailing dot; empty: any name
    deny_private: bool = False


@dataclass(frozen=True)
class Pinned:
    """A checked hop: what to connect to, and what to tell the server."""

    url: httpx.URL  # the checked address in place of the name
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)


def _reached(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries traffic to, if it embeds one."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def address_refusal(address: IPAddress, deny_private: bool) -> str | None:
    """What ``address`` is and the rule that refuses it, or None when it may be fetched from."""
    ip = _reached(address)
    if ip in METADATA or address in METADATA:
        return f"a cloud metadata address ({ALWAYS})"
    if any(ip in net for net in LINK_LOCAL):
        return f"link-local ({ALWAYS})"
    if not deny_private or ip.is_global:
        return None
    if ip.is_loopback or ip.is_unspecified:
        kind = "loopback"
    elif ip.is_private:
        kind = "private"
    else:
        kind = "not globally routable"
    return f"{kind} ({PRIVATE_RULE})"


def _check_name(host: str, rules: FetchRules) -> None:
    allowed = rules.allow_hosts
    if allowed and not any(host == a or host.endswith("." + a) for a in allowed):
        raise FetchRefusedError(f"host {host!r} is not in the encoder's fetch allow-list")


async def resolve_host(host: bytes, port: int) -> list[str]:
    """The addresses ``host`` resolves to, in the resolver's order.

    ``trio.socket.getaddrinfo`` runs the lookup in a thread that a cancelled
    caller abandons, so the fetch's deadline bounds it and the loop never blocks.
    """
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def _addresses(url: httpx.URL, port: int, resolve: Resolver) -> list[IPAddress]:
    try:
        answers = await resolve(url.raw_host, port)
        addresses = [ipaddress.ip_address(a.partition("%")[0]) for a in answers]
    except (OSError, UnicodeError, ValueError) as exc:
        raise RequestError(f"cannot resolve host {url.host!r} ({type(exc).__name__})") from None
    if not addresses:
        raise RequestError(f"cannot resolve host {url.host!r} (no address)")
    return addresses


async def pin(url: httpx.URL, rules: FetchRules, resolve: Resolver = resolve_host) -> Pinned:
    """Check one hop and fix the address it connects to; ``FetchRefusedError`` says which rule refused it.

    Every address a name resolves to must pass (one refused answer refuses the
    name); the first is used.
    """
    host = url.host.lower().rstrip(".")
    if not host:
        raise RequestError("the URL has no host")
    literal = _literal(host)
    if literal is not None:  # the address rules first: they say more than the allow-list
        why = address_refusal(literal, rules.deny_private)
        if why:
            raise FetchRefusedError(f"{url} is refused: {literal} is {why}")
    _check_name(host, rules)
    if literal is not None:
        return Pinned(url)
    port = url.port or (443 if url.scheme == "https" else 80)
    addresses = await _addresses(url, port, resolve)
    for address in addresses:
        why = address_refusal(address, rules.deny_private)
        if why:  # the address itself stays unsaid: it may be an internal one
            raise FetchRefusedError(f"{url} is refused: host {host!r} resolves to {why}")
    headers = {"Host": url.netloc.decode("ascii")}
    extensions: dict[str, Any] = {}
    if url.scheme == "https":
        extensions["sni_hostname"] = url.raw_host.decode("ascii")
        # The pool keys connections by address: a kept connection, verified for
        # this name, must not serve another name that resolves to the same address.
        headers["Connection"] = "close"
    return Pinned(url.copy_with(host=str(addresses[0])), headers, extensions)
