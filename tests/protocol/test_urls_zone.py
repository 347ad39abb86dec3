"""IPv6 zone ids (``fe80::1%eth0``): one encoder URL however the zone is written, and the
same zone grammar in ZMQ endpoints and SGLang's ``host:port``."""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from epd_trio.bootstrap.registry import Registry
from epd_trio.config import BootstrapConfig, ClientConfig, EncoderConfig
from epd_trio.encoder.grpc_server import grpc_url
from epd_trio.errors import RequestError
from epd_trio.protocol.requests import validate_endpoint
from epd_trio.protocol.sglang_requests import parse_host_port, parse_sglang_encode
from epd_trio.protocol.urls import ENCODER_SCHEMES, normalize_url


@pytest.mark.parametrize(("raw", "normalized"), [
    ("http://[fe80::1%25eth0]:8000", "http://[fe80::1%eth0]:8000"),  # RFC 6874's form
    ("http://[fe80::1%eth0]:8000", "http://[fe80::1%eth0]:8000"),  # the bare form ip(8) prints
    ("HTTP://[FE80:0:0:0:0:0:0:1%25Eth0]:8000/", "http://[fe80::1%Eth0]:8000"),  # a zone keeps its case
    ("http://[fe80::1%25en%31]:8000", "http://[fe80::1%en1]:8000"),  # pct-encoded unreserved: decoded
    ("http://[fe80::1%254]:8000", "http://[fe80::1%4]:8000"),  # an interface index
    ("http://[fe80::1%4]:8000", "http://[fe80::1%4]:8000"),
    ("https://[fe80::1%25a.b_c~d-e]:443/p/", "https://[fe80::1%a.b_c~d-e]:443/p"),
    ("http://[2001:db8::1%25eth0]:8000", "http://[2001:db8::1%eth0]:8000"),  # not link-local: kept
])
def test_a_zone_id_is_written_one_way(raw: str, normalized: str) -> None:
    assert normalize_url(raw) == normalized
    assert normalize_url(normalized) == normalized  # a registry's list is normalized again


@pytest.mark.parametrize("raw", ["grpc://[fe80::1%2525]:1", "grpc://[fe80::1%25251]:1", "grpc://[fe80::1%25eth0]:1"])
def test_a_grpc_zone_reads_back_the_same_even_when_it_starts_with_25(raw: str) -> None:
    once = normalize_url(raw, schemes=ENCODER_SCHEMES)
    assert once == raw and normalize_url(once, schemes=ENCODER_SCHEMES) == once


@pytest.mark.parametrize("raw", ["grpc://[fe80::1%eth0]:50051", "grpc://[fe80::1%25eth0]:50051",
                                 "GRPC://[FE80::1%25eth0]/"])
def test_a_grpc_url_keeps_rfc_6874s_form(raw: str) -> None:
    """grpcio percent-decodes its target: a bare ``%12`` would reach it as byte 0x12."""
    assert normalize_url(raw, schemes=ENCODER_SCHEMES, require_port=False).startswith(
        "grpc://[fe80::1%25eth0]")


def test_the_registry_and_a_clients_list_hold_one_entry_for_both_forms() -> None:
    forms = ("http://[fe80::1%25eth0]:8000", "http://[fe80::1%eth0]:8000")
    registry = Registry(max_failures=1, evicted_ttl=1.0)
    assert [registry.register(normalize_url(url), 0.0) for url in forms] == [True, False]
    assert registry.urls() == ["http://[fe80::1%eth0]:8000"]
    assert ClientConfig(encoder_urls=forms).encoder_urls == ("http://[fe80::1%eth0]:8000",)


@pytest.mark.parametrize(("raw", "message"), [
    ("http://[fe80::1%25]:8000", "empty IPv6 zone id"),
    ("http://[fe80::1%]:8000", "empty IPv6 zone id"),
    ("http://[fe80::1%25e!t]:8000", "invalid IPv6 zone id"),  # a sub-delim: not RFC 6874's
    ("http://[fe80::1%e!t]:8000", "invalid IPv6 zone id"),
    ("http://[fe80::1%25e%2Ft]:8000", "invalid IPv6 zone id"),  # '/' no interface name holds
    ("http://[fe80::1%25e%zz]:8000", "invalid IPv6 zone id"),  # no pct-encoding
    ("http://[fe80::1%25%2541]:8000", "invalid IPv6 zone id"),  # encoded twice
    ("http://[fe80::1%e%31]:8000", "invalid IPv6 zone id"),  # the bare form is not decoded
    ("http://[fe80::1%25e@x]:8000", "invalid IPv6 zone id"),
    ("http://[fe80::zz%25eth0]:8000", "not a valid URL|invalid IPv6"),  # the address still counts
    ("http://[v1.x%25eth0]:8000", "invalid IPv6 host"),  # a zone needs an IPv6 address
    ("http://[1.2.3.4%25eth0]:8000", "not a valid URL|invalid IPv6"),
    ("http://[fe80::1%eth0]junk:8000", "text between its IPv6 host and its port"),  # not dropped
    ("http://[::1]junk:8000", "text between its IPv6 host and its port"),
    ("http://[::1]]:8000", "text between its IPv6 host and its port"),
    ("http://[fe80::1]%eth0]:8000", "text between its IPv6 host and its port"),  # the zone not dropped
    ("http://[fe80::1%2525]:8000", "starting with '25'"),  # bare "%25" would read back as empty
    ("https://[fe80::1%25251]:8000", "starting with '25'"),  # ... or as zone "1"
])
def test_a_bad_zone_id_is_a_400_that_says_so(raw: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        normalize_url(raw)
    assert refused.value.status_code == 400


def _link_local() -> tuple[str, str, int]:
    """A link-local address of this machine, its interface's name and index; else a skip
    (glibc's getaddrinfo takes a zone on link-local addresses only)."""
    try:
        rows = Path("/proc/net/if_inet6").read_text().split()
    except OSError:
        pytest.skip("needs Linux's /proc/net/if_inet6")
    for i in range(0, len(rows) - 5, 6):
        address, index, _, scope, _, name = rows[i:i + 6]
        if scope == "20" and re.fullmatch(r"[A-Za-z0-9._~-]+", name):
            return str(ipaddress.IPv6Address(int(address, 16))), name, int(index, 16)
    pytest.skip("no link-local IPv6 address here")


@pytest.fixture
def link_local_http() -> Iterator[tuple[str, str, int]]:
    """An HTTP server on a link-local address: (address, interface, port)."""
    address, name, index = _link_local()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    class Server(HTTPServer):
        address_family = socket.AF_INET6

    server = Server((address, 0, 0, index), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield address, name, server.server_address[1]
    server.shutdown()
    server.server_close()


def test_httpx_connects_with_the_normal_form(link_local_http: tuple[str, str, int]) -> None:
    """httpx hands the host to getaddrinfo as written: ``%25eth0`` would name interface
    ``25eth0`` there, which is why an http URL keeps the bare form."""
    address, name, port = link_local_http
    for written in (f"%25{name}", f"%{name}"):
        url = normalize_url(f"http://[{address}{written}]:{port}")
        assert httpx.get(url + "/", timeout=5.0).status_code == 204


def test_grpcio_connects_with_the_normal_form() -> None:
    """grpcio percent-decodes its target: the bare ``%04`` (index 4 to getaddrinfo) would be
    the byte 0x04 there, which is why a grpc URL keeps ``%25``."""
    grpc = pytest.importorskip("grpc")
    from concurrent.futures import ThreadPoolExecutor

    address, _, index = _link_local()
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port(f"[{address}%{index}]:0")
    server.start()
    try:
        bare = f"{index:02d}"  # a bare zone of "25…" would read as RFC 6874's %25: write that then
        written = f"%25{index}" if bare.startswith("25") else f"%{bare}"
        url = normalize_url(f"grpc://[{address}{written}]:{port}", schemes=ENCODER_SCHEMES)
        with grpc.insecure_channel(url.removeprefix("grpc://")) as channel:  # as the client opens it
            grpc.channel_ready_future(channel).result(timeout=5.0)
    finally:
        server.stop(None)


@pytest.mark.parametrize("endpoint", ["tcp://[fe80::1%eth0]:5000", "tcp://[fe80::1%4]:1",
                                      "tcp://[2001:db8::1%a.b_c~d-e]:9"])
def test_a_zmq_endpoint_may_name_a_zone_as_libzmq_reads_it(endpoint: str) -> None:
    assert validate_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://[fe80::1%]:5", "tcp://[fe80::1%e!t]:5", "tcp://[fe80::1%e%31]:5",
                                      "tcp://[1.2.3.4%eth0]:5", "tcp://[::::%eth0]:5", "tcp://host%eth0:5",
                                      # libzmq reads a zone not starting with a letter as an index:
                                      # "%25eth0" would be interface 25, "%4x" 4; index 0 is none
                                      "tcp://[fe80::1%25eth0]:5", "tcp://[fe80::1%4x]:5", "tcp://[fe80::1%0]:5",
                                      "tcp://[fe80::1%9999999999]:5",  # past an int: atoi's overflow
                                      "tcp://[fe80::1%a23456789012345z]:5"])  # over IFNAMSIZ
def test_a_zmq_endpoints_zone_follows_the_same_rules(endpoint: str) -> None:
    with pytest.raises(RequestError, match="tcp://host:port"):
        validate_endpoint(endpoint)


@pytest.mark.parametrize("value", ["[fe80::1%eth0]:7", "fe80::1%eth0:7", "[fe80::1%4]:7"])
def test_an_sglang_host_port_may_name_a_zone(value: str) -> None:
    assert parse_host_port(value, "receive_url") == value


@pytest.mark.parametrize("value", ["[fe80::1%]:7", "fe80::1%:7", "[fe80::1%e!t]:7", "[::::%eth0]:7",
                                   "host%eth0:7", "10.0.0.1%eth0:7", "[fe80::1%25eth0]:7", "fe80::1%4x:7"])
def test_an_sglang_host_ports_zone_follows_the_same_rules(value: str) -> None:
    with pytest.raises(RequestError, match="'receive_url' must be 'host:port'"):
        parse_host_port(value, "receive_url")


def test_an_sglang_prefill_host_with_a_zone_is_bracketed_with_it() -> None:
    body = {"req_id": "r_local_part_1", "modality": "IMAGE", "mm_items": ["http://h/x.png"],
            "num_parts": 1, "part_idx": 0, "prefill_host": "fe80::1%eth0", "embedding_port": [7, 8]}
    req = parse_sglang_encode(body, backend="zmq_to_tokenizer", max_items=8)
    assert req.deliver.endpoints == ("[fe80::1%eth0]:7", "[fe80::1%eth0]:8")


@pytest.mark.parametrize(("host", "url"), [
    ("0.0.0.0", "grpc://0.0.0.0:7"), ("LocalHost", "grpc://localhost:7"), ("::", "grpc://[::]:7"),
    ("0:0:0:0:0:0:0:1", "grpc://[::1]:7"), ("fe80::1%eth0", "grpc://[fe80::1%25eth0]:7"),
    ("fe80::1%251", "grpc://[fe80::1%25251]:7"), ("fe80::1%25", "grpc://[fe80::1%2525]:7"),
])
def test_the_grpc_servers_url_is_the_normal_form(host: str, url: str) -> None:
    assert grpc_url(host, 7) == url


@pytest.mark.parametrize("host", ["", "[::1]", "local host"])
@pytest.mark.parametrize("config", [EncoderConfig, BootstrapConfig])
def test_a_listen_host_that_names_no_address_is_refused(config: Any, host: str) -> None:
    with pytest.raises(ValueError, match=r"host \(--host\) must be an address or name to listen on"):
        config(host=host)


@pytest.mark.parametrize("zone", ["name", "index"])
async def test_an_encoder_listens_on_a_zoned_link_local_host(encoder: Any, zone: str) -> None:
    """``--host fe80::…%eth0`` (or ``%4``): Linux binds a link-local address only with its
    scope id, which ``getaddrinfo`` reads from the zone. Both printed URLs dial as they are
    (a bare ``%4`` would reach grpcio as the byte 0x04)."""
    grpc = pytest.importorskip("grpc")
    address, name, index = _link_local()
    written = name if zone == "name" else str(index)
    async with encoder(host=f"{address}%{written}", grpc_port=0) as (server, _):
        assert server.url == f"http://[{address}%{written}]:{server.url.rpartition(':')[2]}"
        assert server.grpc.url == f"grpc://[{address}%25{written}]:{server.grpc.port}"

        def dial() -> int:
            with grpc.insecure_channel(server.grpc.url.removeprefix("grpc://")) as channel:
                grpc.channel_ready_future(channel).result(timeout=10.0)
            return httpx.get(server.url + "/health", timeout=10.0).status_code

        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(dial) == 200
