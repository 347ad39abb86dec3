"""Turning a caller's media items into what ``POST /encode`` carries: strings.

Bytes become base64 ``data:`` URIs and PIL images PNG ``data:`` URIs (lossless,
so the encoder sees the caller's pixels); strings (``data:`` URIs, ``http(s)``
URLs, paths an encoder may allow) pass through unchanged for the encoder to
validate. PNG encoding and base64 of big inputs is CPU work, so a caller runs
``to_wire_items`` in a thread when ``is_heavy`` says so.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias

import pybase64
from PIL import Image

from epd_trio.errors import RequestError
from epd_trio.protocol.messages import MODALITIES

__all__ = ["Item", "is_heavy", "to_wire_item", "to_wire_items"]

Item: TypeAlias = "bytes | bytearray | memoryview | str | Image.Image"

# Below this, base64 takes well under a millisecond: not worth a thread hop.
_HEAVY_BYTES: Final = 1 << 20


# The modes PNG stores as they are; any other (CMYK, YCbCr, HSV, LAB, F, ...) is sent as RGB,
# which is what the models' processors convert every image to anyway.
_PNG_MODES: Final = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})


def _png(image: Image.Image, modality: str, index: int) -> bytes:
    buf = io.BytesIO()
    try:
        (image if image.mode in _PNG_MODES else image.convert("RGB")).save(buf, format="PNG")
    except (OSError, ValueError) as exc:  # a truncated or unreadable image behind the object
        raise RequestError(f"{modality} item {index}: the PIL image cannot be encoded as PNG "
                           f"({exc})") from None
    return buf.getvalue()


def to_wire_item(item: object, modality: str, index: int) -> str:
    """One item as a string for ``mm_items``; ``RequestError`` for other types."""
    if isinstance(item, str):
        if not item:
            raise RequestError(f"{modality} item {index}: empty string")
        return item
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _data_uri(bytes(item), "application/octet-stream")
    if isinstance(item, Image.Image):
        return _data_uri(_png(item, modality, index), "image/png")
    raise RequestError(
        f"{modality} item {index}: expected bytes, a data:/http(s) URL string or a PIL image,"
        f" got {type(item).__name__}")


def to_wire_items(items: Mapping[str, Sequence[object]]) -> dict[str, list[str]]:
    """Every modality's items as strings; modality names are case-insensitive."""
    if not isinstance(items, Mapping):
        raise RequestError("items must map a modality to a list of items")
    wire: dict[str, list[str]] = {}
    for key, values in items.items():
        modality = key.lower() if isinstance(key, str) else key
        if modality not in MODALITIES:
            raise RequestError(f"unknown modality {key!r}; use {', '.join(MODALITIES)}")
        if modality in wire:
            raise RequestError(f"modality {modality!r} given twice")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise RequestError(f"{modality}: items must be a list")
        wire[modality] = [to_wire_item(v, modality, i) for i, v in enumerate(values)]
    if not any(wire.values()):
        raise RequestError("a request needs at least one item")
    return wire


def is_heavy(items: Mapping[str, Sequence[object]]) -> bool:
    """Whether converting ``items`` is worth a worker thread."""
    if not isinstance(items, Mapping):
        return False  # to_wire_items will refuse it at once
    total = 0
    for values in items.values():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            return False  # to_wire_items will refuse it at once
        for v in values:
            if isinstance(v, Image.Image):
                return True
            if isinstance(v, (bytes, bytearray, memoryview)):
                total += memoryview(v).nbytes
    return total >= _HEAVY_BYTES


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{pybase64.b64encode_as_string(data)}"
