"""The ZMQ message header of wire protocol v1, and its strict schema.

Sans-IO: no trio, no clock, no sockets. Everything a peer sends is checked here
*before* anything is sized or allocated from it, and any deviation is a
``ProtocolError`` -- a receiver must never crash, hang or over-allocate on a
malformed message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

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
    "MAX_REQ_ID",
    "MODALITIES",
    "PROTOCOL_VERSION",
    "header_from_map",
    "header_to_map",
    "validate_extras",
    "validate_req_id",
]

PROTOCOL_VERSION: Final = 1
Kind = Literal["embedding", "error"]
Dtype = Literal["bfloat16", "float16", "float32"]
KINDS: Final = ("embedding", "error")
MODALITIES: Final = ("image", "video", "audio")
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
_REQUIRED: Final = frozenset(
    {"v", "kind", "req_id", "part_idx", "num_parts", "modality", "dtype", "shape"}
    | {"token_counts", "grid_thw"}
)
_ALLOWED: Final = _REQUIRED | {"error", "extras"}

Extras = dict[str, list[Any]]
"""Name → one value per item: a float, or a list of floats (``validate_extras``)."""


@dataclass(frozen=True)
class ErrorInfo:
    """Why an encode failed, so the receiver fails fast with the right status."""

    type: str
    message: str
    status: int


@dataclass(frozen=True)
class EmbeddingHeader:
    """Frame 0 of a ZMQ message: what the tensor in the frames after it is, and for whom."""

    req_id: str
    part_idx: int
    num_parts: int
    modality: str
    dtype: Dtype
    shape: tuple[int, int]
    token_counts: list[int] = field(default_factory=list)
    grid_thw: list[list[int]] = field(default_factory=list)
    kind: Kind = "embedding"
    error: ErrorInfo | None = None
    v: int = PROTOCOL_VERSION
    extras: Extras = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact length of the tensor bytes (all payload frames together)."""
        return self.shape[0] * self.shape[1] * DTYPE_ITEMSIZE[self.dtype]


def header_to_map(header: EmbeddingHeader) -> dict[str, Any]:
    """The msgpack-ready map; validated so we never send what a peer must reject."""
    m: dict[str, Any] = {
        "v": header.v,
        "kind": header.kind,
        "req_id": header.req_id,
        "part_idx": header.part_idx,
        "num_parts": header.num_parts,
        "modality": header.modality,
        "dtype": header.dtype,
        "shape": list(header.shape),
        "token_counts": list(header.token_counts),
        "grid_thw": [list(g) for g in header.grid_thw],
    }
    if header.extras:  # absent when empty: a v1 peer without extras reads it unchanged
        m["extras"] = validate_extras(
            {key: [list(v) if isinstance(v, tuple) else v for v in values]
             for key, values in header.extras.items()}, len(header.token_counts))
    if header.error is not None:
        e = header.error
        m["error"] = {"type": e.type, "message": e.message, "status": e.status}
    header_from_map(m)
    return m


def header_from_map(m: object) -> EmbeddingHeader:
    """Validate a decoded frame 0 against the v1 schema; ``ProtocolError`` if off."""
    if not isinstance(m, dict):
        raise ProtocolError(f"header must be a map, got {type(m).__name__}")
    _check_keys(m)
    if _int(m, "v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {m['v']!r}")
    kind = _choice(m, "kind", KINDS)
    part_idx, num_parts = _int(m, "part_idx"), _int(m, "num_parts")
    if not 0 <= part_idx < num_parts:
        raise ProtocolError(f"need 0 <= part_idx < num_parts, got {part_idx}, {num_parts}")
    shape = _shape(m.get("shape"))
    token_counts = _int_list(m.get("token_counts"), "token_counts")
    error = _error(m.get("error"))
    if kind == "embedding" and error is not None:
        raise ProtocolError("an embedding message must not carry an error")
    if kind == "error" and error is None:
        raise ProtocolError("an error message must carry an error")
    if kind == "error" and shape != (0, 0):
        raise ProtocolError("an error message must have shape [0, 0]")
    if kind == "embedding" and sum(token_counts) != shape[0]:
        raise ProtocolError(f"token_counts sum to {sum(token_counts)}, shape has {shape[0]}")
    if kind == "error" and "extras" in m:
        raise ProtocolError("an error message must not carry extras")
    extras = validate_extras(m.get("extras", {}), len(token_counts))
    return EmbeddingHeader(
        req_id=validate_req_id(m.get("req_id")),
        part_idx=part_idx,
        num_parts=num_parts,
        modality=_choice(m, "modality", MODALITIES),
        dtype=_choice(m, "dtype", DTYPES),  # type: ignore[arg-type]
        shape=shape,
        token_counts=token_counts,
        grid_thw=_grid_thw(m.get("grid_thw"), len(token_counts)),
        kind=kind,  # type: ignore[arg-type]
        error=error,
        extras=extras,
    )


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


def _check_keys(m: dict[Any, Any]) -> None:
    keys = set(m)
    if missing := _REQUIRED - keys:
        raise ProtocolError(f"header lacks {sorted(missing)}")
    if unknown := keys - _ALLOWED:
        raise ProtocolError(f"header has unknown keys {sorted(map(str, unknown))}")


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; on the wire it is a different type.
    return isinstance(value, int) and not isinstance(value, bool)


def _int(m: Mapping[str, object], key: str) -> int:
    value = m.get(key)
    if not _is_int(value):
        raise ProtocolError(f"{key} must be an int, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def _choice(m: Mapping[str, object], key: str, allowed: tuple[str, ...]) -> str:
    value = m.get(key)
    if not isinstance(value, str) or value not in allowed:
        raise ProtocolError(f"{key} must be one of {list(allowed)}, got {value!r:.40}")
    return value


def _shape(value: object) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("shape must be a list [tokens, dim]")
    if not all(_is_int(x) and 0 <= x <= MAX_AXIS for x in value):
        raise ProtocolError(f"shape entries must be ints in 0..{MAX_AXIS}")
    return (value[0], value[1])


def _int_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(x) and x >= 0 for x in value):
        raise ProtocolError(f"{name} must be a list of non-negative ints")
    return list(value)


def _grid_thw(value: object, items: int) -> list[list[int]]:
    """One ``[t, h, w]`` per item, or none at all (audio has no grid)."""
    if not isinstance(value, list):
        raise ProtocolError("grid_thw must be a list of [t, h, w] lists")
    grid = [_int_list(g, "grid_thw entry") for g in value]
    if any(len(g) != 3 for g in grid):
        raise ProtocolError("grid_thw entries must have exactly 3 ints")
    if grid and len(grid) != items:
        raise ProtocolError(f"grid_thw has {len(grid)} entries for {items} items")
    return grid


def _error(value: object) -> ErrorInfo | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"type", "message", "status"}:
        raise ProtocolError("error must be a map {type, message, status}")
    kind, message, status = value["type"], value["message"], value["status"]
    if not isinstance(kind, str) or not 1 <= len(kind) <= _MAX_ERROR_TYPE:
        raise ProtocolError(f"error.type must be a str of 1..{_MAX_ERROR_TYPE} chars")
    if not isinstance(message, str) or len(message) > MAX_ERROR_MESSAGE:
        raise ProtocolError(f"error.message must be a str of at most {MAX_ERROR_MESSAGE} chars")
    if not _is_int(status) or not 400 <= status <= 599:
        raise ProtocolError("error.status must be an int HTTP error status (400..599)")
    return ErrorInfo(type=kind, message=message, status=status)
