"""Bad media of every kind → RequestError naming the item; good media loads."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import httpx
import pytest
import trio
from PIL import Image

from conftest import png_bytes, random_image
from epd_trio.errors import PayloadTooLargeError, RequestError
from epd_trio.model.media import MediaLimits, MediaLoader, decode_image


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a huge size: a decompression bomb's header, no pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, body: (struct.pack(">I", len(body)) + kind + body  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + body)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def fake_web(routes: dict[str, tuple[int, bytes]]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(str(request.url), (404, b"not found"))
        return httpx.Response(status, content=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def load(items: list, limits: MediaLimits = MediaLimits(), web: dict | None = None) -> list:
    async with fake_web(web or {}) as http:
        return await MediaLoader(limits, http).load(items)


async def test_every_kind_of_good_item(tmp_path: Path) -> None:
    raw = png_bytes(40, 30)
    (tmp_path / "a.png").write_bytes(raw)
    items = [data_uri(raw), raw, random_image(8, 8), "http://media.test/x.png",
             {"url": data_uri(raw), "content_hash": "abc"}, "a.png"]
    out = await load(items, MediaLimits(media_root=tmp_path), {"http://media.test/x.png": (200, raw)})
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
    ("http 404", ["http://media.test/missing.png"], "item 0: fetching .* gave HTTP 404"),
]


@pytest.mark.parametrize(("name", "items", "message"), BAD, ids=[b[0] for b in BAD])
async def test_bad_items(name: str, items: list, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        await load(items)


async def test_fetch_over_size_limit() -> None:
    web = {"http://media.test/big": (200, b"x" * 5000)}
    with pytest.raises(PayloadTooLargeError, match="item 0: .* over 1000 bytes"):
        await load(["http://media.test/big"], MediaLimits(max_item_bytes=1000), web)
    with pytest.raises(PayloadTooLargeError, match="item 1: data URI"):
        await load([png_bytes(4, 4), data_uri(b"y" * 5000)], MediaLimits(max_item_bytes=1000))


async def test_fetch_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(60)
        return httpx.Response(200, content=b"late")

    limits = MediaLimits(fetch_timeout=2.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as http:
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
    with pytest.raises(RequestError, match="item 0: cannot read nope.png"):
        await load(["nope.png"], limits)


def decode_error(data: bytes, limits: MediaLimits = MediaLimits()) -> str:
    with pytest.raises(RequestError) as info:
        decode_image(data, 3, limits)
    return str(info.value)


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


def redirecting_web(routes: dict[str, tuple[int, bytes, dict[str, str]]]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        status, body, headers = routes.get(str(request.url), (404, b"", {}))
        return httpx.Response(status, content=body, headers=headers)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_allow_list_and_redirects() -> None:
    raw = png_bytes(8, 8)
    routes = {
        "http://cdn.ok.test/a.png": (200, raw, {}),
        "http://ok.test/hop": (302, b"", {"location": "http://cdn.ok.test/a.png"}),
        "http://ok.test/evil": (302, b"", {"location": "http://169.254.169.254/latest"}),
        "http://ok.test/file": (302, b"", {"location": "file:///etc/passwd"}),
        "http://ok.test/loop": (302, b"", {"location": "/loop"}),
    }
    limits = MediaLimits(fetch_allow_hosts=("ok.test",), max_redirects=3)
    async with redirecting_web(routes) as http:
        loader = MediaLoader(limits, http)
        assert await loader.load(["http://ok.test/hop"]) == [raw]  # followed, to an allowed subdomain
        for url, message in [("http://elsewhere.test/a.png", "not in the encoder's fetch allow-list"),
                             ("http://ok.test/evil", "'169.254.169.254' is not in the"),
                             ("http://ok.test/file", "URL scheme 'file'"),
                             ("http://ok.test/loop", "over 3 redirects"),
                             ("http://notok.test.attacker/a.png", "not in the encoder's fetch allow-list")]:
            with pytest.raises(RequestError, match=message):
                await loader.load([url])


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
