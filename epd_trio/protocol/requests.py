"""HTTP request bodies of wire protocol v1: parsed and validated, sans-IO.

Every check happens here, before any work is started for a request, and every
failure is a ``RequestError`` (400) whose message says which field is wrong.
Field names follow SGLang's EPD encoder.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from epd_trio.errors import ProtocolError, RequestError
from epd_trio.protocol.messages import MAX_REQ_ID, MODALITIES, validate_req_id

__all__ = [
    "AbortRequest",
    "Delivery",
    "EncodeMeta",
    "EncodeRequest",
    "SendRequest",
    "ZMQ_ZONE",
    "is_ipv6_address",
    "parse_abort_request",
    "parse_encode_request",
    "parse_json_body",
    "parse_send_request",
    "validate_endpoint",
]

BACKENDS: Final = ("inline", "zmq", "mooncake")
MAX_ENDPOINTS: Final = 64
# Most parts one request may be split into (parts go to encoders, a few per modality). A bound,
# not a guess: every message about a part carries these numbers, and msgpack stops at 2^64.
MAX_PARTS: Final = 4096
MAX_JSON_DEPTH: Final = 32
# An IPv6 host may name its zone after a bare '%', as libzmq reads it: a name starts with a
# letter (at most 15 characters, IFNAMSIZ - 1), anything else is read as an interface index
# ("25eth0" would be index 25) with atoi, so digits only, never 0, within an int.
ZMQ_ZONE: Final = r"(?:%(?:[A-Za-z][A-Za-z0-9._~-]{0,14}|0{0,8}[1-9][0-9]{0,8}))?"
_TCP: Final = re.compile(rf"tcp://(\[[0-9A-Fa-f:.]+{ZMQ_ZONE}\]|[A-Za-z0-9._-]+):([0-9]{{1,5}})")
_IPC: Final = re.compile(r"ipc://([^\x00]+)")
_MAX_IPC_PATH: Final = 107  # sun_path is 108 bytes with its NUL

# The native body names the first three; the SGLang and vLLM faces build the others.
Backend = Literal["inline", "zmq", "mooncake", "sglang_zmq", "sglang_mooncake", "vllm_storage",
                  "vllm_mooncake"]


@dataclass(frozen=True)
class Delivery:
    """Where the embedding goes: the HTTP response, ZMQ endpoints, or Mooncake."""

    backend: Backend = "inline"
    endpoints: tuple[str, ...] = ()
    receive_count: int = 1
    transfer_ids: tuple[str, ...] = ()  # vllm_mooncake: per item, the id its consumer knows it by


@dataclass(frozen=True)
class EncodeRequest:
    req_id: str
    modality: str
    mm_items: list[Any]
    num_parts: int = 1
    part_idx: int = 0
    hashes: list[str] | None = None
    deliver: Delivery = field(default_factory=Delivery)

    def __post_init__(self) -> None:  # every face builds its requests here: one bound for all
        if not 1 <= self.num_parts <= MAX_PARTS:
            shown = self.num_parts if -1e12 < self.num_parts < 1e12 else "more"  # a huge int has no str()
            raise RequestError(f"num_parts must be in 1..{MAX_PARTS}, got {shown}", req_id=self.req_id)

    @property
    def key(self) -> tuple[str, int]:
        """Live requests are keyed by (req_id, part_idx): one client request
        may send several parts (of different modalities) to one encoder."""
        return (self.req_id, self.part_idx)


@dataclass(frozen=True)
class AbortRequest:
    req_id: str
    part_idx: int | None = None


@dataclass(frozen=True)
class SendRequest:
    """A Mooncake ``/send``: where in the receiver's registered memory to write."""

    req_id: str
    part_idx: int
    session: str
    buffer_address: int
    buffer_length: int


@dataclass(frozen=True)
class EncodeMeta:
    """The JSON answer of a zmq (or mooncake) /encode.

    ``extras`` (per-item values such as ``second_per_grid_ts``; the ZMQ
    header's schema) is left out of the JSON when empty, as in the header.
    """

    req_id: str
    part_idx: int
    num_parts: int
    modality: str
    tokens: int
    dim: int
    dtype: str
    token_counts: list[int]
    grid_thw: list[list[int]]
    extras: dict[str, list[Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The answer's JSON object (without ``extras`` when there are none). Built field by
        field: ``dataclasses.asdict`` recurses through every list, ~50 µs per answer."""
        body: dict[str, Any] = {
            "req_id": self.req_id, "part_idx": self.part_idx, "num_parts": self.num_parts,
            "modality": self.modality, "tokens": self.tokens, "dim": self.dim, "dtype": self.dtype,
            "token_counts": list(self.token_counts), "grid_thw": [list(g) for g in self.grid_thw]}
        if self.extras:
            body["extras"] = {name: list(values) for name, values in self.extras.items()}
        return body


def _depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    stack, deepest = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A JSON object, or a RequestError that says what is wrong with it.

    msgspec's decoder: ~2.3 x the standard library's on a 0.6 MB body (a 448 px
    PNG as a data: URI), parsed on the event loop. It is strict JSON: ``NaN``,
    ``Infinity``, out-of-range numbers, lone surrogates and a BOM are refused.
    """
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(f"JSON nested deeper than {MAX_JSON_DEPTH}") from None
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    if _depth(body) > MAX_JSON_DEPTH:
        raise RequestError(f"JSON nested deeper than {MAX_JSON_DEPTH}")
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer")
    return value  # type: ignore[return-value]


def _req_id(body: dict[str, Any]) -> str:
    try:
        return validate_req_id(body.get("req_id"))
    except ProtocolError:
        raise RequestError(f"'req_id' must be a string of 1..{MAX_REQ_ID} characters") from None


def is_ipv6_address(host: str) -> bool:
    """``host`` (unbracketed) is an IPv6 address; the host regexes only take its characters."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def validate_endpoint(endpoint: object, *, bind: bool = False) -> str:
    """``tcp://host:port`` or ``ipc://path``; ``RequestError`` (400) otherwise.

    Port 0 (an ephemeral port) only makes sense for ``bind``; a bracketed host is an IPv6
    address (``tcp://[::::]:5`` is refused here, not left to time out), with or without a
    zone id: ``tcp://[fe80::1%eth0]:5`` as libzmq takes it (an endpoint is no URL, so no ``%25``).
    """
    if not isinstance(endpoint, str) or len(endpoint) > 512:
        raise RequestError("a ZMQ endpoint must be a string of at most 512 characters")
    tcp = _TCP.fullmatch(endpoint)
    if tcp and (not tcp.group(1).startswith("[") or is_ipv6_address(tcp.group(1)[1:-1])):
        if not (0 if bind else 1) <= int(tcp.group(2)) <= 65535:
            raise RequestError(f"bad port in ZMQ endpoint {endpoint!r}")
        return endpoint
    ipc = _IPC.fullmatch(endpoint)
    if ipc and len(ipc.group(1).encode()) <= _MAX_IPC_PATH:
        return endpoint
    raise RequestError(f"ZMQ endpoint must be tcp://host:port or ipc://path, got {endpoint!r:.80}")


def _delivery(value: object) -> Delivery:
    if value is None:
        return Delivery()
    if not isinstance(value, dict):
        raise RequestError("'deliver' must be an object")
    backend = value.get("backend", "inline")
    if backend not in BACKENDS:
        raise RequestError(f"'deliver.backend' must be one of {', '.join(BACKENDS)}, got {backend!r:.40}")
    if backend == "zmq":
        endpoints = value.get("endpoints")
        if endpoints is None:
            endpoints = [value.get("endpoint")]
        if not isinstance(endpoints, list) or not 1 <= len(endpoints) <= MAX_ENDPOINTS:
            raise RequestError(f"'deliver.endpoints' must be a list of 1..{MAX_ENDPOINTS} endpoints")
        unique = tuple(dict.fromkeys(validate_endpoint(e) for e in endpoints))
        return Delivery("zmq", unique)
    if backend == "mooncake":
        count = value.get("receive_count", 1)
        if not _is_int(count) or not 1 <= count <= MAX_ENDPOINTS:
            raise RequestError(f"'deliver.receive_count' must be an integer in 1..{MAX_ENDPOINTS}")
        return Delivery("mooncake", (), count)
    return Delivery()


def _items(body: dict[str, Any], max_items: int) -> list[Any]:
    items = body.get("mm_items")
    if not isinstance(items, list) or not items:
        raise RequestError("'mm_items' must be a non-empty list")
    if len(items) > max_items:
        raise RequestError(f"'mm_items' has {len(items)} items; at most {max_items} per request")
    for i, item in enumerate(items):
        if isinstance(item, str):
            continue
        if isinstance(item, dict) and isinstance(item.get("url"), str) and \
                isinstance(item.get("content_hash", ""), str) and set(item) <= {"url", "content_hash"}:
            continue
        raise RequestError(f"item {i}: must be a string or {{\"url\": str, \"content_hash\"?: str}}")
    return items


def _hashes(body: dict[str, Any], count: int) -> list[str] | None:
    hashes = body.get("hashes")
    if hashes is None:
        return None
    if not isinstance(hashes, list) or len(hashes) != count or \
            not all(isinstance(h, str) and 0 < len(h) <= 256 for h in hashes):
        raise RequestError(f"'hashes' must be a list of {count} non-empty strings, one per item")
    return hashes


def parse_encode_request(body: dict[str, Any], *, max_items: int = 256) -> EncodeRequest:
    """Validate a POST /encode body."""
    req_id = _req_id(body)
    modality = body.get("modality")
    if not isinstance(modality, str) or modality.lower() not in MODALITIES:
        raise RequestError(f"'modality' must be one of {', '.join(MODALITIES)}, got {modality!r:.40}")
    num_parts, part_idx = _int(body, "num_parts", 1), _int(body, "part_idx", 0)
    if not 0 <= part_idx < num_parts:
        raise RequestError(f"need 0 <= part_idx < num_parts, got part_idx={part_idx}, num_parts={num_parts}")
    items = _items(body, max_items)
    return EncodeRequest(
        req_id=req_id, modality=modality.lower(), mm_items=items, num_parts=num_parts,
        part_idx=part_idx, hashes=_hashes(body, len(items)), deliver=_delivery(body.get("deliver")),
    )


def parse_abort_request(body: dict[str, Any]) -> AbortRequest:
    """Validate a POST /abort body: ``{req_id, part_idx?}`` (no part_idx: every part)."""
    part = body.get("part_idx")
    if part is not None and not _is_int(part):
        raise RequestError("'part_idx' must be an integer")
    return AbortRequest(_req_id(body), part)


_SESSION = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
_MAX_ADDRESS = (1 << 64) - 1


def parse_send_request(body: dict[str, Any]) -> SendRequest:
    """Validate a POST /send body: ``{req_id, part_idx?, session, buffer_address, buffer_length}``."""
    session = body.get("session")
    if not isinstance(session, str) or not _SESSION.fullmatch(session) or \
            not 0 < int(session.rsplit(":", 1)[1]) <= 65535:
        raise RequestError("'session' must be the receiver's Mooncake 'host:rpc_port'")
    address, length = _int(body, "buffer_address"), _int(body, "buffer_length")
    if not 0 < address <= _MAX_ADDRESS:
        raise RequestError("'buffer_address' must be a positive 64-bit address")
    if not 0 < length <= _MAX_ADDRESS - address:
        raise RequestError("'buffer_length' must be positive and fit after the address")
    part_idx = _int(body, "part_idx", 0)
    if part_idx < 0:
        raise RequestError("'part_idx' must be >= 0")
    return SendRequest(_req_id(body), part_idx, session, address, length)
