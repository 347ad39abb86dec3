"""Bad media of every kind → RequestError naming the item; good media loads.

URLs are fetched from a real HTTP server on a loopback port (``media_server.py``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import struct
import threading
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from PIL import Image

from conftest import png_bytes, random_image
from epd_trio.errors import FetchRefusedError, PayloadTooLargeError, RequestError
from epd_trio.model.media import MediaLimits, MediaLoader, decode_image, media_http_client
from media_server import NO_LENGTH, FakeDNS, MediaServer, Route, redirect


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a huge size: a decompression bomb's header, no pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, body: (struct.pack(">I", len(body)) + kind + body  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + body)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@asynccontextmanager
async def web_client(seen: list[str] | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The engine's client; ``seen`` records every request it sends."""
    async def record(request: httpx.Request) -> None:
        if seen is not None:
            seen.append(str(request.url))

    async with media_http_client() as http:
        http.event_hooks = {"request": [record]}
        yield http


async def load(items: list, limits: MediaLimits = MediaLimits(), dns: FakeDNS | None = None,
               seen: list[str] | None = None) -> list:
    async with web_client(seen) as http:
        return await MediaLoader(limits, http, dns or FakeDNS({})).load(items)


@pytest.fixture
async def web(nursery: trio.Nursery) -> MediaServer:
    return await MediaServer().start(nursery)


async def test_every_kind_of_good_item(tmp_path: Path, web: MediaServer) -> None:
    raw = png_bytes(40, 30)
    (tmp_path / "a.png").write_bytes(raw)
    web.routes["/x.png"] = Route(body=raw)
    items = [data_uri(raw), raw, random_image(8, 8), web.url("/x.png"),
             {"url": data_uri(raw), "content_hash": "abc"}, "a.png"]
    out = await load(items, MediaLimits(media_root=tmp_path))
    assert out[0] == out[1] == out[3] == out[4] == out[5] == raw
    assert isinstance(out[2], Image.Image)


BAD = [
    ("empty list", [], "empty"),
    ("data uri without base64", ["data:image/png,abcd"], "item 0: a data: URI must be base64"),
    ("undecodable base64", ["data:image/png;base64,@@@@"], "item 0: undecodable base64"),
    ("file scheme", ["file:///etc/passwd"], "item 0: URL scheme 'file'"),
    ("ftp scheme", [png_bytes(8, 8), "ftp://x/y.png"], "item 1: URL scheme 'ftp'"),
    ("local path without a media root", ["/etc/passwd"], "item 0: local paths are not allowed"),
    ("unsupported type", [12345], "item 0: unsupported item type int"),
    ("object without url", [{"content_hash": "x"}], "item 0: an item object needs a string 'url'"),
    ("unknown name", ["http://nowhere.test/a.png"], r"item 0: cannot resolve host 'nowhere.test' \(gaierror\)"),
    ("no host", ["http://:80/a.png"], "item 0: the URL has no host"),
    ("an IDNA host that is no name", [png_bytes(8, 8), "http://xn--/a.png"],
     "item 1: the URL's host is not a valid name"),
]


@pytest.mark.parametrize(("name", "items", "message"), BAD, ids=[b[0] for b in BAD])
async def test_bad_items(name: str, items: list, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        await load(items)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FTP://x/y.png", "gopher://x/"])
async def test_a_refused_scheme_is_a_fetch_rule(url: str) -> None:
    """Rule 1 refuses like the others: a ``FetchRefusedError`` (400), before anything connects."""
    with pytest.raises(FetchRefusedError, match=r"item 0: URL scheme '(file|ftp|gopher)' is not allowed") as info:
        await load([url])
    assert info.value.status_code == 400


async def test_http_error_status(web: MediaServer) -> None:
    with pytest.raises(RequestError, match=r"item 0: fetching .*/missing.png gave HTTP 404"):
        await load([web.url("/missing.png")])


async def test_a_name_is_resolved_once_and_the_checked_address_is_used(web: MediaServer) -> None:
    """``media.test`` has no real DNS: the fetch works only by connecting to the address checked."""
    web.routes["/x.png"] = Route(body=b"pixels")
    dns, seen = FakeDNS({"media.test": ["127.0.0.1"]}), []
    assert await load([web.url("/x.png", host="media.test")], dns=dns, seen=seen) == [b"pixels"]
    assert dns.asked == ["media.test"]
    assert seen == [web.url("/x.png")]  # the address, not the name
    assert web.requests == [("/x.png", web.requests[0][1])]
    assert web.requests[0][1]["host"] == f"media.test:{web.port}"  # the server still sees the name


async def test_proxies_from_the_environment_are_not_used(web: MediaServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules judge (and pin) the encoder's own connection; a proxy would make it elsewhere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    web.routes["/x.png"] = Route(body=b"pixels")
    assert await load([web.url("/x.png", host="media.test")],
                      dns=FakeDNS({"media.test": ["127.0.0.1"]})) == [b"pixels"]


async def test_size_caps_and_lying_content_lengths(web: MediaServer) -> None:
    limits = MediaLimits(max_item_bytes=1000)
    web.routes.update({
        "/big": Route(body=b"x" * 5000),                                   # honest, over the cap
        "/claims-huge": Route(body=b"x" * 10, content_length=10**12),      # lies upwards
        "/no-length": Route(body=b"x" * 5000, content_length=NO_LENGTH),   # ends at close
        "/understates": Route(body=b"x" * 5000, content_length=500),       # lies downwards
        "/truncated": Route(body=b"x" * 50, content_length=100),           # promises more than it sends
    })
    with pytest.raises(PayloadTooLargeError, match=r"item 0: .* is 5000 bytes by its Content-Length, over 1000"):
        await load([web.url("/big")], limits)
    with pytest.raises(PayloadTooLargeError, match="is 1000000000000 bytes by its Content-Length"):
        await load([web.url("/claims-huge")], limits)
    with pytest.raises(PayloadTooLargeError, match=r"item 0: .*/no-length is over 1000 bytes"):
        await load([web.url("/no-length")], limits)
    assert await load([web.url("/understates")], limits) == [b"x" * 500]  # framed by what it said
    with pytest.raises(RequestError, match=r"item 0: fetching .*/truncated failed: RemoteProtocolError"):
        await load([web.url("/truncated")], limits)
    with pytest.raises(PayloadTooLargeError, match="item 1: data URI"):
        await load([png_bytes(4, 4), data_uri(b"y" * 5000)], limits)


async def test_a_trickling_body_is_cut_at_the_fetch_timeout(
        autojump_clock: trio.testing.MockClock, web: MediaServer) -> None:
    web.routes["/trickle"] = Route(body=b"x" * 100, trickle=1.0)   # one byte a second
    web.routes["/slow-but-done"] = Route(body=b"abc", trickle=1.0)
    web.routes["/stall"] = Route(body=b"never", stall=True)
    limits = MediaLimits(fetch_timeout=5.0)
    t0 = trio.current_time()
    assert await load([web.url("/slow-but-done")], limits) == [b"abc"]
    assert trio.current_time() - t0 == 2.0
    for path in ("/trickle", "/stall"):
        t0 = trio.current_time()
        with pytest.raises(RequestError, match=f"item 0: fetching .*{path} took over 5.0 s"):
            await load([web.url(path)], limits)
        assert trio.current_time() - t0 == 5.0


async def test_name_resolution_is_under_the_fetch_timeout(autojump_clock: trio.testing.MockClock) -> None:
    """The real resolver (trio's getaddrinfo, here answered by a resolver that never answers)."""

    class Hanging(trio.abc.HostnameResolver):
        async def getaddrinfo(self, *args: object) -> list:
            await trio.sleep_forever()
            raise AssertionError

        async def getnameinfo(self, *args: object) -> tuple[str, str]:
            raise AssertionError

    trio.socket.set_custom_hostname_resolver(Hanging())
    limits = MediaLimits(fetch_timeout=2.0)
    async with web_client() as http:
        t0 = trio.current_time()
        with pytest.raises(RequestError, match=r"item 0: fetching .* took over 2.0 s"):
            await MediaLoader(limits, http).load(["http://media.test/slow"])
        assert trio.current_time() - t0 == 2.0


async def test_media_root_escapes_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes(4, 4))
    (root / "link.png").symlink_to(secret)
    limits = MediaLimits(media_root=root)
    for item in ["../secret.png", str(secret), "link.png"]:
        with pytest.raises(RequestError, match="item 0: path is outside the media root"):
            await load([item], limits)
    with pytest.raises(RequestError, match=r"item 0: cannot read nope.png"):
        await load(["nope.png"], limits)
    (root / "a.png").write_bytes(png_bytes(4, 4))
    (root / "loop").symlink_to(root / "loop")
    for item, error in [("a.png/x", "NotADirectoryError"), ("n" * 300, "OSError"),
                        ("a\x00b", "ValueError"), ("loop", "(RuntimeError|OSError)")]:
        with pytest.raises(RequestError, match=f"item 0: cannot read .*: {error}"):  # a 400, not a 500
            await load([item], limits)


async def test_a_fifo_under_the_media_root_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO's read would block a thread no deadline can stop: refused before any read."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def writer_comes_and_goes() -> None:  # so a regression fails the test instead of hanging it
        with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading (the fix)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    unblock = threading.Timer(5.0, writer_comes_and_goes)
    unblock.start()
    try:
        with pytest.raises(RequestError, match="item 0: pipe is not a regular file"):
            await load(["pipe"], MediaLimits(media_root=tmp_path))
    finally:
        unblock.cancel()


async def test_a_file_is_read_up_to_the_cap(tmp_path: Path) -> None:
    (tmp_path / "big.png").write_bytes(b"x" * 101)
    with pytest.raises(PayloadTooLargeError, match="item 0: file is over 100 bytes"):
        await load(["big.png"], MediaLimits(media_root=tmp_path, max_item_bytes=100))
    (tmp_path / "ok.png").write_bytes(b"x" * 100)
    assert await load(["ok.png"], MediaLimits(media_root=tmp_path, max_item_bytes=100)) == [b"x" * 100]


def decode_error(data: bytes, limits: MediaLimits = MediaLimits()) -> str:
    with pytest.raises(RequestError) as info:
        decode_image(data, 3, limits)
    return str(info.value)


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "ICO"])
def test_only_the_listed_image_formats_are_opened(fmt: str) -> None:
    """EPS would run Ghostscript on a peer's bytes; formats off the list are not images here."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format=fmt) if fmt != "EPS" else buf.write(
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n")
    assert "item 3: bytes are not an image in a known format" in decode_error(buf.getvalue())


def test_decode_bad_bytes() -> None:
    assert "item 3: bytes are not an image" in decode_error(b"hello, not an image")
    truncated = png_bytes(64, 64)[:200]
    assert "item 3: image cannot be decoded" in decode_error(truncated)


def test_decompression_bomb_is_refused_from_its_header() -> None:
    message = decode_error(png_header_only(8000, 8000))  # over our cap, under PIL's own
    assert "item 3: image is 8000x8000" in message and "over the cap" in message
    assert "item 3: image is a decompression bomb" in decode_error(png_header_only(100_000, 100_000))
    with pytest.raises(PayloadTooLargeError):
        decode_image(png_bytes(100, 100), 0, MediaLimits(max_image_pixels=5000))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "I;16"])
def test_other_modes_become_rgb(mode: str) -> None:
    buf = io.BytesIO()
    image = random_image(20, 10).convert(mode)
    image.save(buf, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
    assert decode_image(buf.getvalue(), 0, MediaLimits()).mode == "RGB"


async def test_frame_lists_pass_through_the_loader_untouched() -> None:
    import numpy as np

    frames = [random_image(8, 8), random_image(8, 8, seed=1)]
    array = np.zeros((2, 4, 4, 3), np.uint8)
    out = await load([frames, array])
    assert out[0] is frames and out[1] is array
    with pytest.raises(RequestError, match="item 0: unsupported item type list"):
        await load([[1, 2]])
    with pytest.raises(RequestError, match=r"item 0: an image item must be .* \(a list of frames is a video\)"):
        decode_image(frames, 0, MediaLimits())


async def test_a_redirect_chain_is_followed_up_to_the_limit(web: MediaServer) -> None:
    web.routes.update({"/r1": redirect("/r2"), "/r2": redirect(web.url("/r3", host="media.test"), 301),
                       "/r3": redirect("/img", 307), "/img": Route(body=b"pixels")})
    dns, seen = FakeDNS({"media.test": ["127.0.0.1"]}), []
    assert await load([web.url("/r1")], MediaLimits(max_redirects=3), dns, seen) == [b"pixels"]
    assert [path for path, _ in web.requests] == ["/r1", "/r2", "/r3", "/img"]
    assert web.requests[2][1]["host"] == web.requests[3][1]["host"] == f"media.test:{web.port}"
    assert dns.asked == ["media.test", "media.test"]  # once per hop on that name
    with pytest.raises(RequestError, match=r"item 0: fetching .*/r1 took over 2 redirects"):
        await load([web.url("/r1")], MediaLimits(max_redirects=2), dns)


async def test_redirects_to_refused_places_connect_to_nothing(web: MediaServer) -> None:
    raw = png_bytes(8, 8)
    ok = web.url("/a.png", host="cdn.ok.test")
    web.routes.update({
        "/a.png": Route(body=raw),
        "/hop": redirect(ok),
        "/metadata": redirect("http://169.254.169.254/latest/meta-data/"),
        "/metadata-name": redirect("http://meta.ok.test/latest/meta-data/"),
        "/link-local-v6": redirect("http://[fe80::1]/"),
        "/file": redirect("file:///etc/passwd"),
        "/elsewhere": redirect("http://elsewhere.test/a.png"),
        "/loop": redirect("/loop"),
    })
    dns = FakeDNS({"ok.test": ["127.0.0.1"], "cdn.ok.test": ["127.0.0.1"],
                   "meta.ok.test": ["169.254.169.254"]})
    limits = MediaLimits(fetch_allow_hosts=("ok.test",), max_redirects=3)
    start = web.url("/hop", host="ok.test")
    assert await load([start], limits, dns) == [raw]  # followed, to an allowed subdomain
    for path, error, message in [
        ("/metadata", FetchRefusedError, "169.254.169.254 is a cloud metadata address .refused always."),
        ("/metadata-name", FetchRefusedError, "host 'meta.ok.test' resolves to a cloud metadata address"),
        ("/link-local-v6", FetchRefusedError, "fe80::1 is link-local .refused always."),
        ("/elsewhere", FetchRefusedError, "host 'elsewhere.test' is not in the encoder's fetch allow-list"),
        ("/file", FetchRefusedError, "URL scheme 'file'"),
        ("/loop", RequestError, "over 3 redirects"),
    ]:
        seen: list[str] = []
        with pytest.raises(error, match="item 0: .*" + message) as info:
            await load([web.url(path, host="ok.test")], limits, dns, seen)
        assert info.value.status_code == 400
        if path != "/loop":  # the one hop to our server, and nothing to where it pointed
            assert seen == [web.url(path)], path
    with pytest.raises(FetchRefusedError, match=r"item 0: host 'notok.test.attacker' is not in the"):
        await load(["http://notok.test.attacker/a.png"], limits, dns)
    assert "notok.test.attacker" not in dns.asked and "elsewhere.test" not in dns.asked


async def test_deny_private_refuses_loopback_before_connecting(web: MediaServer) -> None:
    web.routes["/x.png"] = Route(body=b"pixels")
    limits = MediaLimits(fetch_deny_private=True)
    for url, message in [(web.url("/x.png"), "127.0.0.1 is loopback"),
                         (web.url("/x.png", host="[::1]"), "::1 is loopback"),
                         (web.url("/x.png", host="localhost"), "host 'localhost' resolves to loopback")]:
        async with web_client() as http:  # the real resolver: localhost from the system's hosts file
            with pytest.raises(FetchRefusedError, match=message + r" \(refused by --fetch-deny-private\)"):
                await MediaLoader(limits, http).load([url])
    assert web.connections == 0
    assert await load([web.url("/x.png")]) == [b"pixels"]  # allowed by default


def test_request_pixel_cap_checks_headers_first(qwen25_path: str) -> None:
    from epd_trio.model.loader import load_encoder
    from epd_trio.model.preprocess import EncoderPreprocessor

    enc = load_encoder(qwen25_path)
    pre = EncoderPreprocessor(enc.adapter, enc.processors, MediaLimits(max_request_pixels=9000))
    assert pre.preprocess([png_bytes(60, 60), png_bytes(60, 60)], "image").token_counts  # 7200 px: fine
    with pytest.raises(PayloadTooLargeError, match="10800 pixels together"):
        pre.preprocess([png_bytes(60, 60)] * 3, "image")
    with pytest.raises(PayloadTooLargeError, match="pixels together"):  # bombs count by their headers
        pre.preprocess([png_bytes(8, 8), png_header_only(8000, 8000)], "image")


async def test_large_data_uris_decode_and_hash_off_the_event_loop() -> None:
    """From OFFLOAD_BYTES a data URI is decoded (and its content_hash checked) on a worker
    thread; the bytes and the errors are the same as on the loop."""
    import hashlib

    from epd_trio.model.media import OFFLOAD_BYTES

    big, small = bytes(range(256)) * (OFFLOAD_BYTES // 256 + 1), b"tiny payload"
    claimed = {"url": data_uri(big), "content_hash": "sha256:" + hashlib.sha256(big).hexdigest()}
    async with web_client() as http:
        loader = MediaLoader(MediaLimits(), http, FakeDNS({}))
        assert await loader.load([data_uri(small)]) == [small]
        assert loader.offloaded == 0
        assert await loader.load([data_uri(big), claimed]) == [big, big]
        assert loader.offloaded == 3  # two decodes and one hash check
        wrong = {**claimed, "content_hash": "sha256:" + "0" * 64}
        with pytest.raises(RequestError, match="item 0: the bytes do not match its content_hash"):
            await loader.load([wrong])
        with pytest.raises(RequestError, match="item 0: undecodable base64"):
            await loader.load(["data:image/png;base64," + "A" * (OFFLOAD_BYTES + 1)])
