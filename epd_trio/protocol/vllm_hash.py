"""vLLM 0.32's multimodal item hash (``mm_hash``), computed without vLLM, sans-IO.

A vLLM language server names each multimodal item of a request by this hash;
an EC consumer (``--ec-transfer-config``, ``ec_role: ec_consumer``) asks its
connector for the encoder output under that name. Writing it under any other
name means vLLM never finds it, so the hash is reproduced here byte for byte
(``vllm/multimodal/hasher.py`` and ``processing/inputs.py``):

- the digest (blake3 by default; sha256 or sha512 with vLLM's
  ``--mm-hasher-algorithm``) of keyword fields sorted by key, each field its
  framed key then its framed value: ``model_id`` (the consumer's ``--model``
  string) and one field named for the modality;
- framing: every byte chunk is preceded by its length (8 bytes, little
  endian); a value is tagged ``0`` None, ``1`` sequence (then its length),
  ``2`` mapping (then its length; entries in insertion order) or ``3`` leaf;
  numbers are numpy's bytes of the number (``int`` as int64, ``float`` as
  float64, ``bool`` as one byte);
- an **image** is its original encoded bytes; when vLLM converted its mode
  on load (anything but RGB becomes RGB), the value is ``{"io_config":
  {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}, "data":
  bytes}`` instead;
- a **video** is the pair (its original bytes, the metadata vLLM's video
  loader reported: frame count, fps, duration, backend, sampled frame
  indices, whether all frames were sampled);
- an **audio** clip is its decoded mono float32 waveform at the model's
  sampling rate, as a numpy array (dtype, shape, data);
- a ``uuid`` given on the request's content part is the hash itself.

What vLLM's loaders would report about an item (the image's mode, the video's
metadata, the waveform) is found by ``epd_trio.model.vllm_media``; this
module only frames and digests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from epd_trio.config import MM_HASH_ALGORITHMS

__all__ = [
    "ALGORITHMS",
    "AudioSamples",
    "EncodedImage",
    "EncodedVideo",
    "hash_fields",
    "item_hash",
    "item_hashes",
]

ALGORITHMS: Final = MM_HASH_ALGORITHMS
# What vLLM's image loader records when it converted an image to RGB (its defaults).
RGB_CONVERSION: Final = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}

_NONE: Final = b"\x00"
_SEQUENCE: Final = b"\x01"
_MAPPING: Final = b"\x02"
_LEAF: Final = b"\x03"


@dataclass(frozen=True)
class EncodedImage:
    """An image as vLLM hashes it: its bytes, and whether its mode was converted on load."""

    data: bytes
    converted: bool = False


@dataclass(frozen=True)
class EncodedVideo:
    """A video as vLLM hashes it: its bytes and its loader's metadata (in the loader's key order)."""

    data: bytes
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class AudioSamples:
    """An audio clip as vLLM hashes it: the waveform its parser hands the processor."""

    waveform: np.ndarray


HashInput = EncodedImage | EncodedVideo | AudioSamples


def _length(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _framed(chunk: bytes | memoryview) -> Iterator[bytes | memoryview]:
    yield _length(chunk.nbytes if isinstance(chunk, memoryview) else len(chunk))
    yield chunk


def _scalar(value: bool | int | float | str | bytes | memoryview) -> Iterator[bytes | memoryview]:
    """A leaf's own bytes (vLLM's ``serialize_item`` for the types used here)."""
    if isinstance(value, (bytes, memoryview)):
        yield from _framed(value)
    elif isinstance(value, str):
        yield from _framed(value.encode("utf-8"))
    elif isinstance(value, (bool, int, float)):
        yield from _framed(np.array(value).tobytes())
    else:
        raise TypeError(f"no vLLM hash encoding for {type(value).__name__}")


def _field(key: str, value: Any) -> Iterator[bytes | memoryview]:
    """One keyword field: its framed key, then its value (vLLM's ``iter_item_to_bytes``)."""
    yield from _framed(key.encode("utf-8"))
    yield from _value(value)


def _value(value: Any) -> Iterator[bytes | memoryview]:
    if value is None:
        yield _NONE
    elif isinstance(value, (list, tuple)):
        yield _SEQUENCE
        yield _length(len(value))
        for element in value:
            yield from _value(element)
    elif isinstance(value, Mapping):
        yield _MAPPING
        yield _length(len(value))
        for key, element in value.items():
            yield from _framed(str(key).encode("utf-8"))
            yield from _value(element)
    else:
        yield _LEAF
        yield from _leaf(value)


def _leaf(value: Any) -> Iterator[bytes | memoryview]:
    if isinstance(value, EncodedImage):
        yield from _field("image", {"io_config": RGB_CONVERSION, "data": value.data}
                          if value.converted else value.data)
    elif isinstance(value, EncodedVideo):  # the loader's bytes; the metadata is its tuple's sibling
        yield from _field("video", value.data)
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        yield from _field("ndarray", {"dtype": array.dtype.str, "shape": array.shape,
                                      "data": array.view(np.uint8).data})
    else:
        yield from _scalar(value)


def _digest(algorithm: str) -> Callable[[], Any]:
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3
    if algorithm in ("sha256", "sha512"):
        return getattr(hashlib, algorithm)
    raise ValueError(f"unknown mm_hash algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def hash_fields(algorithm: str, **fields: Any) -> str:
    """vLLM's ``MultiModalHasher.hash_kwargs``: the hex digest of ``fields`` sorted by key."""
    hasher = _digest(algorithm)()
    for key in sorted(fields):
        for chunk in _field(key, fields[key]):
            hasher.update(chunk)
    return str(hasher.hexdigest())


def item_hash(model_id: str, modality: str, item: HashInput, *, uuid: str | None = None,
              algorithm: str = "blake3") -> str:
    """The ``mm_hash`` a vLLM server whose ``--model`` is ``model_id`` gives ``item``.

    A ``uuid`` from the request is used verbatim, as vLLM does when the request
    carries no processor options (this encoder refuses those).
    """
    if uuid is not None:
        return uuid
    value: Any = item
    if isinstance(item, EncodedVideo):
        value = (item, dict(item.metadata))
    elif isinstance(item, AudioSamples):
        value = item.waveform
    return hash_fields(algorithm, model_id=model_id, **{modality: value})


def item_hashes(model_id: str, modality: str, items: Sequence[HashInput],
                uuids: Sequence[str | None], *, algorithm: str = "blake3") -> list[str]:
    """One ``mm_hash`` per item, in order."""
    return [item_hash(model_id, modality, item, uuid=uuid, algorithm=algorithm)
            for item, uuid in zip(items, uuids, strict=True)]
