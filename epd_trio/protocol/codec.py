"""Bytes <-> messages: the msgpack ZMQ framing and the inline safetensors body.

Sans-IO. Decoding validates every header field before anything is sized from
it, never unpickles, and turns any malformed input into ``ProtocolError``.
Encoding avoids copies: the tensor frames are views of the tensor's own memory,
and decoding keeps the received frames as a ``Payload``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, cast

import msgspec
import safetensors
import torch
from safetensors.torch import load as load_safetensors

from epd_trio.errors import ProtocolError, error_body, http_status
from epd_trio.protocol.messages import (
    DTYPES,
    MAX_ERROR_MESSAGE,
    MAX_HEADER_BYTES,
    MODALITIES,
    PROTOCOL_VERSION,
    Dtype,
    EmbeddingHeader,
    ErrorInfo,
    Modality,
    decode_header,
    encode_header,
    header_from_map,
    header_to_map,
)
from epd_trio.protocol.payload import PAYLOAD_FRAME_BYTES, Payload, split_frames, tensor_bytes

__all__ = [
    "FrameLike",
    "MAX_HEADER_BYTES",
    "TORCH_DTYPES",
    "decode_safetensors",
    "decode_zmq_message",
    "dtype_name",
    "encode_safetensors",
    "encode_zmq_message",
    "error_message",
    "header_for",
    "tensor_bytes",
]

FrameLike = bytes | bytearray | memoryview
"""A frame's bytes; a received ``zmq.Frame`` is passed as its ``.buffer``."""

TORCH_DTYPES: Final[Mapping[str, torch.dtype]] = MappingProxyType(
    {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
)
_ST_DTYPES: Final[Mapping[str, str]] = MappingProxyType(
    {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
)
_ST_META_KEYS: Final = ("req_id", "part_idx", "num_parts", "modality", "token_counts", "grid_thw")
_ST_JSON_KEYS: Final = frozenset({"part_idx", "num_parts", "token_counts", "grid_thw", "extras"})
# Optional: written only when non-empty, so a v1 reader without extras is unaffected.
_ST_OPTIONAL_KEYS: Final = ("extras",)


_DTYPE_NAMES: Final[Mapping[torch.dtype, str]] = MappingProxyType(
    {dtype: name for name, dtype in TORCH_DTYPES.items()})


def dtype_name(dtype: torch.dtype) -> Dtype:
    """The wire name of a torch dtype; only the three embedding dtypes exist."""
    try:
        return _DTYPE_NAMES[dtype]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"unsupported embedding dtype {dtype}; use one of {list(DTYPES)}") from None


def header_for(
    tensor: torch.Tensor,
    *,
    req_id: str,
    part_idx: int,
    num_parts: int,
    modality: str,
    token_counts: Sequence[int],
    grid_thw: Sequence[Sequence[int]] = (),
    extras: Mapping[str, Sequence[Any]] | None = None,
) -> EmbeddingHeader:
    """The header describing ``tensor``, so dtype and shape can't disagree with it.

    ``extras`` maps a name to one value per item (a float or a list of floats);
    empty or None leaves the header key out.
    """
    if tensor.dim() != 2:
        raise ValueError(f"an embedding is [tokens, dim], got shape {tuple(tensor.shape)}")
    return EmbeddingHeader(
        v=PROTOCOL_VERSION,
        kind="embedding",
        req_id=req_id,
        part_idx=part_idx,
        num_parts=num_parts,
        modality=_wire_modality(modality),
        dtype=dtype_name(tensor.dtype),
        shape=(tensor.shape[0], tensor.shape[1]),
        token_counts=list(token_counts),
        grid_thw=[list(g) for g in grid_thw],
        extras={key: list(values) for key, values in (extras or {}).items()},
    )


def encode_zmq_message(header: EmbeddingHeader, tensor: torch.Tensor | None, *,
                       frame_bytes: int = PAYLOAD_FRAME_BYTES) -> list[FrameLike]:
    """Frames for ``send_multipart``: [msgpack header] or [header, *tensor bytes].

    The tensor bytes are views of its memory, ``frame_bytes`` each (see
    ``epd_trio.protocol.payload`` for why not one frame).
    """
    head = encode_header(header)
    if header.kind == "error":
        if tensor is not None:
            raise ValueError("an error message carries no tensor")
        return [head]
    if tensor is None:
        raise ValueError("an embedding message needs its tensor")
    if tensor.dtype != TORCH_DTYPES[header.dtype] or tuple(tensor.shape) != header.shape:
        raise ValueError(
            f"tensor {tensor.dtype} {tuple(tensor.shape)} does not match the header"
            f" {header.dtype} {header.shape}"
        )
    return [head, *split_frames(tensor_bytes(tensor), frame_bytes)]


def _wire_modality(modality: str) -> Modality:
    """``modality`` as the header's schema types it; requests were checked on the way in."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {', '.join(MODALITIES)}, got {modality!r}")
    return cast(Modality, modality)


def error_message(
    req_id: str, part_idx: int, num_parts: int, modality: str, exc: BaseException
) -> list[FrameLike]:
    """Frames telling a receiver its part failed, so it fails fast, not by timeout.

    The message is the same safe text as the HTTP error body: never a traceback.
    """
    body = cast(dict[str, str], error_body(exc)["error"])
    info = ErrorInfo(
        type=str(body["type"])[:128],
        message=str(body["message"])[:MAX_ERROR_MESSAGE],
        status=min(max(http_status(exc), 400), 599),
    )
    header = EmbeddingHeader(
        v=PROTOCOL_VERSION,
        kind="error",
        req_id=req_id,
        part_idx=part_idx,
        num_parts=num_parts,
        modality=_wire_modality(modality),
        dtype="float32",  # required by the schema; meaningless without a tensor
        shape=(0, 0),
        token_counts=[],
        grid_thw=[],
        error=info,
    )
    return encode_zmq_message(header, None)


def decode_zmq_message(frames: Sequence[FrameLike]) -> tuple[EmbeddingHeader, Payload | None]:
    """Parse a received multipart message; ``ProtocolError`` for anything malformed.

    The payload keeps the received frames (no copy): frames 1..N in order hold
    the tensor's bytes; v1 senders that send one tensor frame are read alike.
    """
    if not frames:
        raise ProtocolError("an empty message")
    header = decode_header(_flat(frames[0]))
    if header.kind == "error":
        if len(frames) != 1:
            raise ProtocolError("an error message must have no tensor frame")
        return header, None
    if len(frames) < 2:
        raise ProtocolError("an embedding message needs a tensor frame")
    payload = Payload.gather([_flat(f) for f in frames[1:]], TORCH_DTYPES[header.dtype],
                             header.shape)
    return header, payload


def encode_safetensors(embedding: torch.Tensor, metadata: Mapping[str, Any]) -> bytes:
    """The inline ``/encode`` body: tensor ``embedding`` plus string metadata.

    ``metadata`` holds ``req_id``, ``part_idx``, ``num_parts``, ``modality``,
    ``token_counts``, ``grid_thw`` and optionally ``extras`` as Python values;
    they are checked with the ZMQ header rules, and non-strings stored
    JSON-encoded. Empty ``extras`` are left out.
    """
    keys = set(metadata)
    if not set(_ST_META_KEYS) <= keys <= set(_ST_META_KEYS) | set(_ST_OPTIONAL_KEYS):
        raise ValueError(f"metadata must have exactly the keys {list(_ST_META_KEYS)}"
                         f" (and optionally {list(_ST_OPTIONAL_KEYS)})")
    header = header_for(embedding, **metadata)
    checked = header_to_map(header)  # same rules as a ZMQ header: token sums, grid, ids, extras
    strings = {  # msgspec's encoder: ~10 x json.dumps on these small values (each answer has 4)
        key: _json(metadata[key]) if key in _ST_JSON_KEYS else metadata[key]
        for key in _ST_META_KEYS
    }
    if "extras" in checked:  # finite numbers only: header_to_map has checked them
        strings["extras"] = _json(checked["extras"])
    return _write_safetensors(header, tensor_bytes(embedding), strings)


_ST_NAMES: Final = {name: st for st, name in _ST_DTYPES.items()}


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _write_safetensors(header: EmbeddingHeader, data: memoryview, metadata: Mapping[str, str]) -> bytes:
    """One-tensor safetensors file, written directly: the 8-byte header length, the JSON
    header padded with spaces to 8 bytes, the tensor's bytes. ``safetensors.torch.save``
    writes the same format, but its per-call work (numpy conversions, several copies) cost
    a small inline answer more than the rest of its delivery; here the bytes are copied once,
    and no torch op runs (``tensor_bytes``: each would release the GIL).
    """
    head = msgspec.json.encode({
        "__metadata__": dict(metadata),
        "embedding": {"dtype": _ST_NAMES[header.dtype], "shape": list(header.shape),
                      "data_offsets": [0, data.nbytes]},
    })
    head += b" " * (-len(head) % 8)
    return b"".join((len(head).to_bytes(8, "little"), head, data))


def decode_safetensors(data: bytes) -> tuple[torch.Tensor, dict[str, Any]]:
    """Parse an inline body into (embedding, metadata with Python values).

    The JSON header is validated before the tensor is read; unknown metadata
    keys (a writer's ``format``) are ignored. ``extras`` is in the metadata
    only when the body has it (validated, numbers as floats).
    """
    dtype, shape, meta = _safetensors_header(data)
    values = _safetensors_metadata(meta)
    m = {"v": 1, "kind": "embedding", "dtype": dtype, "shape": shape, **values}
    header = header_from_map(m)
    if "extras" in values:
        values["extras"] = header.extras
    try:
        tensor = load_safetensors(data)["embedding"]
    except safetensors.SafetensorError as exc:
        raise ProtocolError(f"unreadable safetensors body: {exc}") from None
    return tensor, values


def _flat(frame: FrameLike) -> memoryview:
    try:
        return memoryview(frame).cast("B")
    except TypeError as exc:
        raise ProtocolError(f"frame is not a contiguous buffer: {exc}") from None


def _safetensors_header(data: bytes) -> tuple[str, object, dict[str, Any]]:
    """(dtype, shape, metadata) from the JSON header, before any tensor is built."""
    if not isinstance(data, bytes) or len(data) < 8:
        raise ProtocolError("safetensors body must be bytes of at least 8")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ProtocolError(f"safetensors header length {size} is out of range")
    try:
        head = json.loads(data[8 : 8 + size])
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"safetensors header is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("safetensors header is nested too deeply") from None
    if not isinstance(head, dict) or set(head) != {"__metadata__", "embedding"}:
        raise ProtocolError("safetensors body must hold one tensor 'embedding' and metadata")
    entry, meta = head["embedding"], head["__metadata__"]
    if not isinstance(entry, dict) or entry.get("dtype") not in _ST_DTYPES:
        raise ProtocolError(f"embedding dtype must be one of {list(_ST_DTYPES)}")
    if not isinstance(meta, dict):
        raise ProtocolError("safetensors __metadata__ must be a map")
    return _ST_DTYPES[entry["dtype"]], entry.get("shape"), meta


def _safetensors_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    if missing := [k for k in _ST_META_KEYS if k not in meta]:
        raise ProtocolError(f"safetensors metadata lacks {missing}")
    values: dict[str, Any] = {}
    for key in (*_ST_META_KEYS, *(k for k in _ST_OPTIONAL_KEYS if k in meta)):
        raw = meta[key]
        if not isinstance(raw, str):
            raise ProtocolError(f"safetensors metadata {key} must be a string")
        if key not in _ST_JSON_KEYS:
            values[key] = raw
            continue
        try:
            values[key] = json.loads(raw)
        except (ValueError, RecursionError):
            raise ProtocolError(f"safetensors metadata {key} is not JSON") from None
    return values
