"""A corpus of known-bad and odd media through the real engine: a correct
embedding or a RequestError naming the item — never a crash, never a hang."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import trio
from PIL import Image

from conftest import random_image
from epd_trio import RequestError, open_engine


def _save(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    chunk = lambda kind, body: (struct.pack(">I", len(body)) + kind + body  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + body)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IEND", b"")


def _huge_exif() -> bytes:
    exif = Image.Exif()
    exif[0x010E] = "x" * 60000  # ImageDescription
    return _save(random_image(32, 32), "JPEG", exif=exif.tobytes())


BASE = random_image(40, 30, seed=1)
# (name, bytes, expected: "ok" or a substring of the RequestError)
CORPUS = [
    ("truncated png", _save(BASE, "PNG")[:120], "item 0"),
    ("truncated jpeg", _save(BASE, "JPEG")[:200], "item 0"),
    ("png header only", _png_claiming(64, 64), "item 0"),
    ("decompression bomb", _png_claiming(100_000, 100_000), "decompression bomb"),
    ("0x0 image", _png_claiming(0, 0), "item 0"),
    ("cmyk jpeg", _save(BASE.convert("CMYK"), "JPEG"), "ok"),
    ("16-bit png", _save(BASE.convert("I;16"), "PNG"), "ok"),
    ("palette png", _save(BASE.convert("P"), "PNG"), "ok"),
    ("alpha png", _save(BASE.convert("RGBA"), "PNG"), "ok"),
    ("grayscale", _save(BASE.convert("L"), "PNG"), "ok"),
    ("huge exif", _huge_exif(), "ok"),
    ("polyglot png+zip", _save(BASE, "PNG") + b"PK\x03\x04" + b"\x00" * 64, "ok"),
    ("html pretending", b"<html><script>alert(1)</script></html>", "item 0: bytes are not an image"),
    ("empty", b"", "item 0"),
    ("gif animation", _save(BASE.convert("P"), "GIF", save_all=True,
                            append_images=[random_image(40, 30, seed=2).convert("P")]), "ok"),
    ("1x1", _save(random_image(1, 1), "PNG"), "ok"),  # the processor scales it up
    ("extreme aspect", _save(random_image(3000, 10), "PNG"), "item 0"),
]


@pytest.mark.parametrize(("name", "data", "expected"), CORPUS, ids=[c[0] for c in CORPUS])
async def test_bad_media_corpus(name: str, data: bytes, expected: str, qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path) as engine:
        with trio.fail_after(60):
            if expected == "ok":
                out = await engine.encode([data], "image")
                assert out.embedding.shape[0] == sum(out.token_counts) > 0
            else:
                with pytest.raises(RequestError, match=expected):
                    await engine.encode([data], "image")
            after = await engine.encode([_save(BASE, "PNG")], "image")  # still serving
        stats = engine.statistics()
    assert after.token_counts and (stats.admitted, stats.preprocessing, stats.queued) == (0, 0, 0)
