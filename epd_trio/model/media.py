"""Fetching and decoding media items, with limits checked before expensive work.

An item is a ``data:`` URI, an ``http(s)://`` URL, a local path (only under a
configured media root), raw bytes, a PIL image, a video's frames (a list of PIL
images or arrays, or one 4-D array; in-process callers only), or
``{"url": ..., "content_hash": ...}`` (a ``sha256:<hex>`` hash is checked
against the item's bytes). Images are decoded here; videos in
``video.py``, audio in ``audio.py``.
Fetching is async (trio + httpx), bounded in bytes and time, and every hop is
checked by ``fetch_rules`` before it connects; decoding is blocking and runs in the
preprocessing thread. Every failure is a ``RequestError`` that names the item's index and the reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import stat
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import pybase64
import trio

from epd_trio._util import first_leaf
from epd_trio.errors import FetchRefusedError, PayloadTooLargeError, RequestError
from epd_trio.model.fetch_rules import FetchRules, Pinned, Resolver, pin, resolve_host

__all__ = ["IMAGE_FORMATS", "MediaLimits", "MediaLoader", "decode_image", "decoder_message",
           "is_frame_list", "item_error", "media_http_client", "open_image"]

MediaItem = Any  # str | bytes | PIL.Image.Image | dict
Loaded = Any  # bytes | PIL.Image.Image
# The image formats PIL may open from a peer's bytes. Not every plugin it has: EPS would run
# Ghostscript on them, and the rarer decoders are attack surface no model input needs.
IMAGE_FORMATS: Final = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO", "AVIF")


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on what one item may cost before and after decoding."""

    max_item_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # under PIL's own bomb warning (89 M); also per video frame
    max_request_pixels: int = 160_000_000  # all images of one request together
    fetch_timeout: float = 10.0
    # Hosts http(s) items may come from ("example.com" also allows its
    # subdomains); empty: any. The address rules apply on top (fetch_rules.py):
    # metadata and link-local always refused, private ones with deny_private.
    # Every redirect hop is checked the same way.
    fetch_allow_hosts: tuple[str, ...] = ()
    fetch_deny_private: bool = False
    max_redirects: int = 3
    media_root: Path | None = None
    # Video: the source's length (checked on the container before decoding)
    # and the pixels of all frames kept for the model (what preprocessing holds).
    max_video_seconds: float = 3600.0
    max_video_frames: int = 200_000
    max_video_pixels: int = 768 * 1280 * 720
    # Audio: longer items are refused, never silently cut (the model's own
    # window, 30 s for Qwen2-Audio, is a second bound).
    max_audio_seconds: float = 30.0


def item_error(index: int, reason: str) -> RequestError:
    return RequestError(f"item {index}: {reason}")


_SOURCE_PREFIX: Final = re.compile(r"^[\w.]+, \S+:\d+, (.+)$")  # "<op>, <file>:<line>, <message>"


def decoder_message(exc: BaseException) -> str:
    """What a native decoder or processor said, for a client's 400: its first line, without
    torch's or torchvision's source path and line (``decode_jpeg, /__w/vision/...cpp:171,
    Bogus Huffman table definition``), which is for the operator's log."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    said = _SOURCE_PREFIX.match(lines[0])
    return said.group(1) if said else lines[0]


def scheme_refused(index: int, scheme: str) -> FetchRefusedError:
    """Fetch rule 1 (http(s) only), for an item's URL and every redirect hop alike."""
    return FetchRefusedError(f"item {index}: URL scheme {scheme!r} is not allowed (use data:, http, https)")


def _url_of(item: MediaItem, index: int) -> MediaItem:
    if isinstance(item, dict):
        url = item.get("url")
        if not isinstance(url, str):
            raise item_error(index, "an item object needs a string 'url'")
        return url
    return item


def _claimed_sha256(item: MediaItem) -> str | None:
    """The hex digest an item's ``content_hash`` claims, when it is ``sha256:<64 hex>``
    (SGLang's form); other hashes are cache names only, never checked."""
    claimed = item.get("content_hash") if isinstance(item, dict) else None
    if isinstance(claimed, str) and claimed.startswith("sha256:") and len(claimed) == 71:
        return claimed[7:].lower()
    return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_data_uri(uri: str, index: int, max_bytes: int) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.endswith(";base64"):
        raise item_error(index, "a data: URI must be base64 (data:<mime>;base64,<data>)")
    if len(payload) * 3 // 4 > max_bytes:
        raise PayloadTooLargeError(f"item {index}: data URI is over {max_bytes} bytes")
    try:
        # pybase64's SIMD decoder: ~30 x CPython's on a 448 px PNG (0.05 ms against 1.4 ms
        # for 0.6 MB, on the event loop, measured on a 2-core VM). Anything it refuses
        # takes the standard path, so the error messages stay the standard library's.
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise item_error(index, f"undecodable base64 in data: URI ({exc})") from None


def media_http_client() -> httpx.AsyncClient:
    """The client a ``MediaLoader`` should fetch with: no redirects, no proxy from the environment.

    The fetch rules judge the address the encoder itself connects to and pin
    the connection to it (``fetch_rules.pin``); a proxy would make that
    connection instead, and httpx's proxy tunnel drops the pinned TLS server
    name. Certificate settings from the environment (``SSL_CERT_FILE``) still apply.
    """
    direct = {scheme: httpx.AsyncHTTPTransport() for scheme in ("http://", "https://")}
    return httpx.AsyncClient(follow_redirects=False, mounts=direct)


# From this size an item's bytes are hashed, and a data URI is base64-decoded, in a worker
# thread (both release the GIL): sha256 of a 3 MB payload would hold every other request for
# ms. pybase64 decodes that payload in ~0.25 ms here; below this size it decodes on the loop.
OFFLOAD_BYTES: Final = 1 << 20
OFFLOAD_THREADS: Final = 2


def _read_regular_file(path: os.PathLike[str], limit: int, index: int, shown: str) -> bytes:
    """A regular file's bytes, at most ``limit`` of them; anything else is refused.

    Opened without blocking and checked on the open descriptor, so a FIFO or a
    device (whose read may never end, in a thread no cancellation can stop) is
    refused even if it replaced the file after the path was resolved (as is a
    symlink put there since: ``O_NOFOLLOW``); the read is bounded too, since
    the file may have grown.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise item_error(index, f"{shown[:200]} is not a regular file")
        if info.st_size > limit:
            raise PayloadTooLargeError(f"item {index}: file is over {limit} bytes")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLargeError(f"item {index}: file is over {limit} bytes")
    return data


class MediaLoader:
    """Turns items into bytes or images; owns the HTTP client used for URLs."""

    def __init__(self, limits: MediaLimits, http: httpx.AsyncClient,
                 resolve: Resolver = resolve_host) -> None:
        self.limits = limits
        self._threads = trio.CapacityLimiter(OFFLOAD_THREADS)
        self.offloaded = 0  # items decoded or hashed off the event loop
        self._http = http
        self._resolve = resolve
        self._rules = FetchRules(limits.fetch_allow_hosts, limits.fetch_deny_private)

    async def load(self, items: Sequence[MediaItem]) -> list[Loaded]:
        """Fetch every item concurrently; the first failure cancels the rest."""
        if not items:
            raise RequestError("mm_items is empty")
        if not any(_needs_io(item) for item in items):  # inline data: no tasks needed
            return [await self._load_one(i, item) for i, item in enumerate(items)]
        out: list[Loaded] = [None] * len(items)

        async def one(i: int, item: MediaItem) -> None:
            out[i] = await self._load_one(i, item)

        try:
            async with trio.open_nursery() as nursery:
                for i, item in enumerate(items):
                    nursery.start_soon(one, i, item)
        except* RequestError as group:
            raise first_leaf(group) from None
        return out

    async def _load_one(self, index: int, item: MediaItem) -> Loaded:
        claimed = _claimed_sha256(item)
        loaded = await self._load_source(index, _url_of(item, index))
        if claimed is not None and isinstance(loaded, bytes) and \
                await self._off_loop(len(loaded), _sha256, loaded) != claimed:
            raise item_error(index, "the bytes do not match its content_hash")
        return loaded

    async def _off_loop(self, size: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, in a worker thread when ``size`` is large enough to stall the loop."""
        if size < OFFLOAD_BYTES:
            return fn(*args)
        self.offloaded += 1
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)

    async def _load_source(self, index: int, item: MediaItem) -> Loaded:
        if isinstance(item, (bytes, bytearray, memoryview)):
            return bytes(item)
        if not isinstance(item, str):
            if _is_pil(item) or is_frame_list(item):
                return item  # decoded in-process objects: checked when decoded
            raise item_error(index, f"unsupported item type {type(item).__name__}")
        if item.startswith("data:"):
            return await self._off_loop(len(item), decode_data_uri, item, index, self.limits.max_item_bytes)
        scheme = item.split(":", 1)[0].lower() if "://" in item else ""
        if scheme in ("http", "https"):
            return await self._fetch(index, item)
        if scheme:
            raise scheme_refused(index, scheme)
        return await self._read_local(index, item)

    async def _check(self, index: int, url: httpx.URL) -> Pinned:
        """The rules for one hop, before anything connects to it."""
        if url.scheme not in ("http", "https"):
            raise scheme_refused(index, url.scheme)
        try:
            return await pin(url, self._rules, self._resolve)
        except RequestError as exc:  # FetchRefusedError stays one: the rule refused it
            raise type(exc)(f"item {index}: {exc.message}") from None

    async def _fetch(self, index: int, url: str) -> bytes:
        """GET with a time and size bound; redirects followed by hand, each hop checked.

        The deadline covers the name lookups too.
        """
        try:
            with trio.fail_after(self.limits.fetch_timeout):
                target = httpx.URL(url)
                for _ in range(self.limits.max_redirects + 1):
                    hop = await self._check(index, target)
                    body = await self._get(index, target, hop)
                    if isinstance(body, bytes):
                        return body
                    target = target.join(body)  # a redirect's Location, checked next round
                raise item_error(index, f"fetching {url} took over {self.limits.max_redirects} redirects")
        except trio.TooSlowError:
            raise item_error(index, f"fetching {url} took over {self.limits.fetch_timeout} s") from None
        except httpx.InvalidURL:
            raise item_error(index, "the URL is not valid") from None
        except UnicodeError:  # an IDNA host that is no name (xn--), here or in a redirect
            raise item_error(index, "the URL's host is not a valid name") from None
        except httpx.HTTPError as exc:
            raise item_error(index, f"fetching {url} failed: {type(exc).__name__}") from None

    async def _get(self, index: int, url: httpx.URL, hop: Pinned) -> bytes | str:
        """The body, or the Location of a redirect; ``url`` is what the caller named."""
        limit = self.limits.max_item_bytes
        async with self._http.stream("GET", hop.url, headers=hop.headers,
                                     extensions=hop.extensions) as response:
            if response.is_redirect and "location" in response.headers:
                return response.headers["location"]
            if response.status_code != 200:
                raise item_error(index, f"fetching {url} gave HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise PayloadTooLargeError(f"item {index}: {url} is {declared} bytes by its "
                                           f"Content-Length, over {limit} bytes")
            return await self._read_body(index, url, response)

    async def _read_body(self, index: int, url: httpx.URL, response: httpx.Response) -> bytes:
        """The body, up to the size cap.

        httpx's body iterators are nested async generators (encode/httpx#3593):
        leaving the loop early would abandon the inner ones, unclosed. Over the
        cap, cancelling instead unwinds them all from the innermost read.
        """
        limit = self.limits.max_item_bytes
        chunks, size = [], 0
        with trio.CancelScope() as reading:
            # httpx types aiter_bytes() as an AsyncIterator; it is an async generator (aclose).
            async with aclosing(response.aiter_bytes()) as body:  # type: ignore[type-var]
                async for chunk in body:
                    size += len(chunk)
                    if size > limit:
                        reading.cancel()
                        continue
                    chunks.append(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"item {index}: {url} is over {limit} bytes")
        return b"".join(chunks)

    async def _read_local(self, index: int, path: str) -> bytes:
        root = self.limits.media_root
        if root is None:
            raise item_error(
                index, "local paths are not allowed (the encoder has no media root); "
                "send a data: URI or an http(s) URL"
            )
        try:
            resolved = await trio.Path(root, path).resolve()
            real_root = await trio.Path(root).resolve()
            if not resolved.is_relative_to(real_root):
                raise item_error(index, "path is outside the media root")
            return await trio.to_thread.run_sync(_read_regular_file, resolved,
                                                 self.limits.max_item_bytes, index, path)
        # OSError: missing, a directory, not a directory, no permission, a name too long;
        # ValueError: a NUL byte; RuntimeError: a symlink loop (Python 3.11's resolve)
        except (OSError, ValueError, RuntimeError) as exc:
            raise item_error(index, f"cannot read {path[:200]}: {type(exc).__name__}") from None


def _needs_io(item: MediaItem) -> bool:
    """Whether loading ``item`` fetches or reads a file (else it is in the request already)."""
    url = item.get("url") if isinstance(item, dict) else item
    return isinstance(url, str) and not url.startswith("data:")


def _is_pil(obj: object) -> bool:
    from PIL import Image

    return isinstance(obj, Image.Image)


def is_frame_list(obj: object) -> bool:
    """A video given as its frames: PIL images or arrays, or one 4-D array."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return obj.ndim == 4
    return (isinstance(obj, (list, tuple)) and len(obj) > 0
            and all(_is_pil(f) or isinstance(f, np.ndarray) for f in obj))


def open_image(data: bytes) -> Any:
    """``PIL.Image.open`` of a peer's bytes, trying the ``IMAGE_FORMATS`` PIL has, no others."""
    from PIL import Image

    Image.init()  # every plugin registered (once): PIL's first open knows only five formats
    return Image.open(io.BytesIO(data), formats=[f for f in IMAGE_FORMATS if f in Image.OPEN])


def decode_image(data: Loaded, index: int, limits: MediaLimits) -> Any:
    """An RGB PIL image; the pixel cap is checked on the header, before decoding."""
    from PIL import Image, UnidentifiedImageError

    if _is_pil(data):
        image = data
        _check_pixels(image.size, index, limits)
    elif not isinstance(data, bytes):
        raise item_error(index, f"an image item must be image bytes or a PIL image, not "
                                f"{type(data).__name__} (a list of frames is a video)")
    else:
        try:
            image = open_image(data)
            _check_pixels(image.size, index, limits)
            image.load()
        except UnidentifiedImageError:
            raise item_error(index, "bytes are not an image in a known format") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise PayloadTooLargeError(
                f"item {index}: image is a decompression bomb (its header claims too many pixels)"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise item_error(index, f"image cannot be decoded ({exc})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def image_pixels(data: Loaded) -> int:
    """Width × height from the image's header alone (0 when it is not an image)."""
    from PIL import Image, UnidentifiedImageError

    if _is_pil(data):
        return data.size[0] * data.size[1]
    try:
        with open_image(data) as image:
            return image.size[0] * image.size[1]
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError,
            Image.DecompressionBombError, Image.DecompressionBombWarning):
        return 0  # decode_image names the problem with the item's index


def _check_pixels(size: tuple[int, int], index: int, limits: MediaLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise item_error(index, f"image is empty ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise PayloadTooLargeError(
            f"item {index}: image is {width}x{height} = {width * height} pixels, over the cap of "
            f"{limits.max_image_pixels}"
        )
