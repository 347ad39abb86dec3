"""What an encoder tells its registries (``advertised_url``) and names its Mooncake engine.

Routes to a registry on another host come from a table here (as the kernel would
answer on that host); ``tests/multihost`` runs the same code between real hosts.
"""

from __future__ import annotations

import ipaddress
import socket

import pytest

from epd_trio._routes import Route
from epd_trio.config import EncoderConfig
from epd_trio.encoder import server as server_module
from epd_trio.encoder.server import _with_mooncake_host, advertised_url
from epd_trio.errors import PeerUnavailable

REMOTE_REGISTRY = "http://198.18.0.1:8997"
LOCAL_REGISTRY = "http://127.0.0.1:8997"
HOSTNAME = socket.gethostname().lower()


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """198.18.0.1 is another host, reached from this host's 198.18.0.3; 127.0.0.1 is here;
    anything else does not resolve."""
    async def table(host: str, *, timeout: float) -> Route:
        if host == "198.18.0.1":
            return Route(host, ipaddress.ip_address(host), ipaddress.ip_address("198.18.0.3"))
        if host == "127.0.0.1":
            return Route(host, ipaddress.ip_address(host), ipaddress.ip_address(host))
        raise PeerUnavailable(f"{host} does not resolve")
    monkeypatch.setattr(server_module, "find_route", table)


@pytest.mark.parametrize(("config", "bound", "told"), [
    ({}, "http://127.0.0.1:4321", "http://127.0.0.1:4321"),  # no registry: as bound
    ({"host": "0.0.0.0"}, "http://0.0.0.0:4321", f"http://{HOSTNAME}:4321"),
    # a wildcard host: this host's address on the route to the registry on another host
    ({"host": "0.0.0.0", "register_url": (REMOTE_REGISTRY,)}, "http://0.0.0.0:4321",
     "http://198.18.0.3:4321"),
    ({"host": "::", "register_url": ("http://unresolved:8997", LOCAL_REGISTRY, REMOTE_REGISTRY)},
     "http://[::]:4321", "http://198.18.0.3:4321"),
    # a registry on this host only (or none known): the hostname, as before
    ({"host": "0.0.0.0", "register_url": (LOCAL_REGISTRY,)}, "http://0.0.0.0:4321",
     f"http://{HOSTNAME}:4321"),
    ({"advertise_url": "http://Encoder-3.internal:80/", "register_url": (REMOTE_REGISTRY,)},
     "http://0.0.0.0:4321", "http://encoder-3.internal:80"),
    ({"register_url": (LOCAL_REGISTRY,)}, "http://127.0.0.1:4321", "http://127.0.0.1:4321"),
])
async def test_what_registries_are_told(routes: None, config: dict[str, object], bound: str,
                                        told: str) -> None:
    assert await advertised_url(EncoderConfig(port=0, **config), bound) == told  # type: ignore[arg-type]


@pytest.mark.parametrize(("config", "flag"), [
    ({}, "--host"),  # listening on loopback only, the default
    ({"advertise_url": "http://127.0.0.1:8000"}, "--advertise-url"),
    ({"advertise_url": "http://localhost:8000"}, "--advertise-url"),
])
async def test_loopback_told_to_a_registry_on_another_host_is_refused_at_start(
        routes: None, config: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=f"on another host.*\\({flag}\\).*198.18.0.3"):
        await advertised_url(EncoderConfig(port=0, register_url=(REMOTE_REGISTRY,), **config),  # type: ignore[arg-type]
                             "http://127.0.0.1:8000")


@pytest.mark.parametrize(("config", "host"), [
    ({"transfer_backend": "mooncake", "host": "0.0.0.0"}, "198.18.0.3"),  # the advertised host
    ({"transfer_backend": "mooncake", "host": "127.0.0.1"}, "127.0.0.1"),
    ({"transfer_backend": "mooncake", "host": "0.0.0.0", "mooncake_host": "10.0.0.9"}, "10.0.0.9"),
    ({"api": "sglang", "encoder_transfer_backend": "mooncake", "host": "::"}, "198.18.0.3"),
    ({"host": "0.0.0.0"}, None),  # no Mooncake engine
])
def test_the_mooncake_engine_is_named_as_peers_reach_it(config: dict[str, object],
                                                        host: str | None) -> None:
    named = _with_mooncake_host(EncoderConfig(port=0, **config), "http://198.18.0.3:8000")  # type: ignore[arg-type]
    assert named.mooncake_host == host
