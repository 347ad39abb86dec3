"""The ZMQ message header of wire protocol v1, and its strict schema.

Sans-IO: no trio, no clock, no sockets. Everything a peer sends is checked here
*before* anything is sized or allocated from it, and any deviation is a
``ProtocolError`` -- a receiver must never crash, hang or over-allocate on a
malformed message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, get_args

import msgspec

from epd_trio.errors import ProtocolError

__all__ = [
    "DTYPES",
    "DTYPE_ITEMSIZE",
    "Dtype",
    "EmbeddingHeader",
    "ErrorInfo",
    "KINDS",
    "Kind",
    "MAX_AXIS",
    "MAX_ERROR_MESSAGE",
    "MAX_EXTRAS",
    "MAX_EXTRA_NAME",
    "MAX_EXTRA_NUMBERS",
    "MAX_EXTRA_VALUES",
    "MAX_HEADER_BYTES",
    "MAX_REQ_ID",
    "MODALITIES",
    "PROTOCOL_VERSION",
    "decode_header",
    "encode_header",
    "header_from_map",
    "header_to_map",
    "validate_extras",
    "validate_req_id",
]

PROTOCOL_VERSION: Final = 1
Kind = Literal["embedding", "error"]
Dtype = Literal["bfloat16", "float16", "float32"]
Modality = Literal["image", "video", "audio"]
KINDS: Final = get_args(Kind)
MODALITIES: Final = get_args(Modality)
DTYPE_ITEMSIZE: Final[Mapping[str, int]] = MappingProxyType(
    {"bfloat16": 2, "float16": 2, "float32": 4}
)
DTYPES: Final = tuple(DTYPE_ITEMSIZE)
MAX_REQ_ID: Final = 256
# No real embedding comes near 2**24 tokens or channels; the cap keeps a hostile
# shape from describing a multi-terabyte buffer before the length check.
MAX_AXIS: Final = 1 << 24
MAX_ERROR_MESSAGE: Final = 4096
_MAX_ERROR_TYPE: Final = 128
# ``extras``: per-item values for the language side (``second_per_grid_ts``,
# ``timestamps``). A video item has at most a few hundred timestamps (768
# frames / temporal patch 2); the bounds leave room and cap a hostile header.
MAX_EXTRAS: Final = 8
MAX_EXTRA_NAME: Final = 64
MAX_EXTRA_VALUES: Final = 4096  # numbers in one item's list
MAX_EXTRA_NUMBERS: Final = 1 << 16  # numbers in all of a header's extras
# A real header is a few hundred bytes (a long video adds ~20 bytes per item).
MAX_HEADER_BYTES: Final = 1 << 20
_MAX_ITEMS: Final = 1 << 16  # entries of one header list (items of one request part)

Extras = dict[str, list[Any]]
"""Name → one value per item: a float, or a list of floats (``validate_extras``)."""


ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQ_ID)]
_Axis = Annotated[int, msgspec.Meta(ge=0, le=MAX_AXIS)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
_ExtraName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_EXTRA_NAME)]
_ExtraEntry = float | Annotated[list[float], msgspec.Meta(max_length=MAX_EXTRA_VALUES)]


class ErrorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Why an encode failed, so the receiver fails fast with the right status."""

    type: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ERROR_TYPE)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_MESSAGE)]
    status: Annotated[int, msgspec.Meta(ge=400, le=599)]


class EmbeddingHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Frame 0 of a ZMQ message: what the tensor in the frames after it is, and for whom.

    The class is the v1 schema itself: msgspec checks every field's type and
    bounds as it decodes (in C, ~1 us, where the hand-written checks took tens),
    and ``_check`` the rules that span fields. Constructing one checks nothing:
    ``encode_header``/``header_to_map`` validate what we send, with the
    receiver's own rules. ``error`` and empty ``extras`` are left off the wire.
    """

    v: int
    kind: Kind
    req_id: ReqId
    part_idx: int
    num_parts: int
    modality: Modality
    dtype: Dtype
    shape: tuple[_Axis, _Axis]
    token_counts: Annotated[list[_Count], msgspec.Meta(max_length=_MAX_ITEMS)]
    grid_thw: Annotated[list[Annotated[list[_Count], msgspec.Meta(min_length=3, max_length=3)]],
                        msgspec.Meta(max_length=_MAX_ITEMS)]
    error: ErrorInfo | None = None
    extras: Annotated[dict[_ExtraName, Annotated[list[_ExtraEntry],
                                                  msgspec.Meta(max_length=_MAX_ITEMS)]],
                      msgspec.Meta(max_length=MAX_EXTRAS)] = {}

    @property
    def nbytes(self) -> int:
        """Exact length of the tensor bytes (all payload frames together)."""
        return self.shape[0] * self.shape[1] * DTYPE_ITEMSIZE[self.dtype]


_DECODER: Final = msgspec.msgpack.Decoder(EmbeddingHeader)
_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_header(header: EmbeddingHeader) -> bytes:
    """Frame 0's msgpack bytes, checked by decoding them as a receiver will (a few us):
    we never send what a peer must reject."""
    raw = _ENCODER.encode(header)
    decode_header(raw)
    return raw


def decode_header(raw: bytes | memoryview) -> EmbeddingHeader:
    """Frame 0 as a header; ``ProtocolError`` for anything off the v1 schema."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {len(raw)} bytes (max {MAX_HEADER_BYTES})")
    try:
        header = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            raise ProtocolError(f"invalid header: {exc}") from None
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    return _check(header)


def header_to_map(header: EmbeddingHeader) -> dict[str, Any]:
    """The header as plain values (lists, not tuples), validated like a received one."""
    m = msgspec.to_builtins(header)
    m["shape"] = list(m["shape"])
    header_from_map(m)
    return m


def header_from_map(m: object) -> EmbeddingHeader:
    """Validate a decoded map (e.g. an inline body's metadata) against the v1 schema."""
    try:
        header = msgspec.convert(m, EmbeddingHeader, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid header: {exc}") from None
    return _check(header)


def _check(h: EmbeddingHeader) -> EmbeddingHeader:
    """The rules no field type can say: version, part bounds, sums, kind against error."""
    if h.v != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {h.v!r}")
    if not 0 <= h.part_idx < h.num_parts:
        raise ProtocolError(f"need 0 <= part_idx < num_parts, got {h.part_idx}, {h.num_parts}")
    items = len(h.token_counts)
    if h.kind == "embedding":
        if h.error is not None:
            raise ProtocolError("an embedding message must not carry an error")
        if (tokens := sum(h.token_counts)) != h.shape[0]:
            raise ProtocolError(f"token_counts sum to {tokens}, shape has {h.shape[0]}")
    else:
        if h.error is None:
            raise ProtocolError("an error message must carry an error")
        if h.shape != (0, 0):
            raise ProtocolError("an error message must have shape [0, 0]")
        if h.extras:
            raise ProtocolError("an error message must not carry extras")
    if h.grid_thw and len(h.grid_thw) != items:
        raise ProtocolError(f"grid_thw has {len(h.grid_thw)} entries for {items} items")
    if h.extras:
        validate_extras(h.extras, items)  # one entry per item, finite numbers, the budget
    return h


def validate_extras(value: object, items: int) -> Extras:
    """Per-item extras, checked strictly; a normalized copy (numbers as floats).

    A map of at most ``MAX_EXTRAS`` names (str of 1..``MAX_EXTRA_NAME`` chars)
    to lists of exactly ``items`` entries; under one name every entry is a
    finite number, or every entry a list of at most ``MAX_EXTRA_VALUES``
    finite numbers. At most ``MAX_EXTRA_NUMBERS`` numbers in all.
    """
    if not isinstance(value, dict):
        raise ProtocolError("extras must be a map of name to per-item list")
    if len(value) > MAX_EXTRAS:
        raise ProtocolError(f"extras has {len(value)} names (max {MAX_EXTRAS})")
    out: Extras = {}
    budget = MAX_EXTRA_NUMBERS
    for name, values in value.items():
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_EXTRA_NAME:
            raise ProtocolError(f"extras names must be str of 1..{MAX_EXTRA_NAME} chars")
        if not isinstance(values, list) or len(values) != items:
            raise ProtocolError(f"extras {name!r:.70} must be a list of one entry per item "
                                f"({items})")
        if values and isinstance(values[0], list):
            entries: list[Any] = [_numbers(v, name) for v in values]
            budget -= sum(map(len, entries))
        else:
            entries = [_number(v, name) for v in values]
            budget -= len(entries)
        if budget < 0:
            raise ProtocolError(f"extras hold over {MAX_EXTRA_NUMBERS} numbers")
        out[name] = entries
    return out


def _number(value: object, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float range (JSON has no int bound)
            number = math.inf
        if math.isfinite(number):
            return number
    raise ProtocolError(f"extras {name!r:.70}: entries must be finite numbers, or all lists "
                        f"of them, got {value!r:.40}")


def _numbers(value: object, name: str) -> list[float]:
    if not isinstance(value, list) or len(value) > MAX_EXTRA_VALUES:
        raise ProtocolError(f"extras {name!r:.70}: entries must be all numbers or all lists of "
                            f"at most {MAX_EXTRA_VALUES} numbers")
    return [_number(v, name) for v in value]


def validate_req_id(value: object) -> str:
    """A request id is a str of 1..256 chars (same rule as ``POST /encode``)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REQ_ID:
        raise ProtocolError(f"req_id must be a str of 1..{MAX_REQ_ID} chars")
    return value









