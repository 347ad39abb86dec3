"""SGLang 0.5.23's encoder request bodies, validated the SGLang way, sans-IO.

``/encode`` is checked first with SGLang's own rules and messages
(``validate_encode_request`` in its ``runtime.py``), then with ours (item
shapes, the item limit, destinations). Items become what our engine reads:
``data:`` URIs, http(s) URLs and paths pass as they are, ``file://`` URLs
become paths, a bare base64 string (SGLang's last resort) becomes a ``data:``
URI, and ``{"url", "content_hash": "sha256:<hex>", …options}`` keeps its URL
and hash (checked against the bytes when they are loaded); other per-item
options are ignored. Every failure is a ``RequestError`` (400).
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from typing import Any, Final, TypeGuard
from urllib.parse import unquote, urlsplit

import pybase64

from epd_trio.errors import RequestError
from epd_trio.protocol.messages import MAX_REQ_ID
from epd_trio.protocol.requests import ZMQ_ZONE, Delivery, EncodeRequest, is_ipv6_address

__all__ = [
    "DELIVERIES",
    "MAX_RECEIVE_COUNT",
    "ReceiveUrl",
    "SGLangSend",
    "check_send",
    "parse_host_port",
    "parse_meta_request",
    "parse_receive_url",
    "parse_sglang_encode",
    "parse_sglang_send",
    "sglang_validation_error",
]

MODALITIES: Final = ("IMAGE", "VIDEO", "AUDIO")
DELIVERIES: Final = ("sglang_zmq", "sglang_mooncake")  # the deliveries this face's requests name
MAX_RECEIVE_COUNT: Final = 64
MIN_BASE64: Final = 32  # shorter strings are taken as paths
_HOST_PORT: Final = re.compile(rf"(\[[0-9A-Fa-f:.]+{ZMQ_ZONE}\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*{ZMQ_ZONE}"
                               r"|[A-Za-z0-9._-]+):([0-9]{1,5})")
_SHA256: Final = re.compile(r"sha256:([0-9A-Fa-f]{64})")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def sglang_validation_error(body: dict[str, Any]) -> str | None:
    """SGLang's own first check of an ``/encode`` body, with its messages."""
    req_id = body.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        return "missing or invalid req_id"
    modality = body.get("modality")
    if not isinstance(modality, str):
        return "missing or invalid modality"
    if modality.upper() not in MODALITIES or not modality.isascii():  # "ımage".upper() is IMAGE
        return f"unsupported modality: {modality}"
    items = body.get("mm_items")
    if items is None or (isinstance(items, list) and not items):
        return "missing or empty mm_items"
    num_parts, part_idx = body.get("num_parts"), body.get("part_idx")
    if not _is_int(num_parts) or num_parts <= 0:
        return "num_parts must be a positive integer"
    if not _is_int(part_idx) or not 0 <= part_idx < num_parts:
        return f"part_idx must be in [0, {num_parts})"
    hashes = body.get("hashes")
    if hashes is not None and not isinstance(hashes, (list, str, int)):
        return f"hashes must be list/scalar, got {type(hashes).__name__}"
    return None


def _is_base64(text: str) -> bool:
    """Standard, padded base64 and nothing else: what ``b64decode(validate=True)`` takes.

    pybase64 decodes it in C with SIMD and without the regex pass the standard
    library's ``validate=True`` makes first: on the event loop a 0.6 MB image
    cost ~3.5 ms the old way (regex, whitespace strip, decode), ~0.05 ms here.
    """
    try:
        pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _string_item(item: str) -> str:
    if item.startswith(("data:", "http://", "https://")):
        return item
    if item.startswith("file://"):
        try:
            return unquote(urlsplit(item).path)
        except ValueError as exc:  # "file://[x/...": an unclosed IPv6 bracket
            raise RequestError(f"a file:// item is not a valid URL ({exc})") from None
    if len(item) >= MIN_BASE64:
        # Whitespace (a MIME encoder's line breaks) is dropped, but only when the
        # string is not already plain base64, as SGLang's clients send it.
        if _is_base64(item):
            return f"data:application/octet-stream;base64,{item}"
        compact = "".join(item.split())
        if len(compact) >= MIN_BASE64 and compact != item and _is_base64(compact):
            return f"data:application/octet-stream;base64,{compact}"
    return item  # a path: read only under the encoder's media root


def _item(item: Any, index: int) -> Any:
    if isinstance(item, str):
        return _string_item(item)
    if isinstance(item, dict) and isinstance(item.get("url"), str):
        out: dict[str, str] = {"url": _string_item(item["url"])}
        claimed = item.get("content_hash")
        if claimed is not None:
            match = _SHA256.fullmatch(claimed) if isinstance(claimed, str) else None
            if match is None:
                raise RequestError(f"item {index}: content_hash must use the form "
                                   "'sha256:<64 hex digits>'")
            out["content_hash"] = "sha256:" + match.group(1).lower()
        return out
    raise RequestError(f"item {index}: must be a string or an object with a string 'url'")


def _hashes(value: Any, count: int) -> list[str] | None:
    """SGLang's cache keys, when they name each item; anything else is ignored, as SGLang
    then hashes the content itself."""
    if isinstance(value, list) and len(value) == count and \
            all(isinstance(h, str) and 0 < len(h) <= 256 for h in value):
        return value
    return None


def _host_ok(host: str) -> bool:
    """A host with a colon, bracketed or not, is an IPv6 address (``::::`` is not), a zone
    id (``fe80::1%eth0``) included: the endpoints it becomes are libzmq's, which reads it."""
    if host.startswith("["):
        return is_ipv6_address(host[1:-1])
    return ":" not in host or is_ipv6_address(host)


def parse_host_port(value: object, name: str) -> str:
    """SGLang's ``host:port`` (an IPv6 host bracketed or not); 400 otherwise."""
    if not isinstance(value, str) or len(value) > 300 or not (m := _HOST_PORT.fullmatch(value)) \
            or not 0 < int(m.group(2)) <= 65535 or not _host_ok(m.group(1)):
        raise RequestError(f"'{name}' must be 'host:port', got {value!r:.80}")
    return value


def _destinations(body: dict[str, Any], backend: str) -> Delivery:
    if backend == "mooncake":
        return Delivery("sglang_mooncake")
    host, ports = body.get("prefill_host"), body.get("embedding_port")
    if ports is None:
        if backend == "zmq_to_tokenizer":
            raise RequestError("zmq_to_tokenizer needs 'prefill_host' and 'embedding_port'")
        return Delivery("sglang_zmq")  # zmq_to_scheduler: the ranks register with /scheduler_receive_url
    ports = ports if isinstance(ports, list) else [ports]
    if not isinstance(host, str) or not ports or len(ports) > MAX_RECEIVE_COUNT or \
            not all(_is_int(p) and 0 < p <= 65535 for p in ports):
        raise RequestError("'prefill_host' must be a host and 'embedding_port' a port or a list of ports")
    host = host.removeprefix("[").removesuffix("]")
    shown = f"[{host}]" if ":" in host else host
    endpoints = tuple(dict.fromkeys(parse_host_port(f"{shown}:{p}", "prefill_host") for p in ports))
    return Delivery("sglang_zmq", endpoints, len(endpoints))


def check_send(backend: str, req_id: str | None) -> None:
    """SGLang's ``Send`` (gRPC) belongs to its mooncake ``backend``; with a zmq one ``Encode``
    delivers, and a ``Send`` is a 400."""
    if backend != "mooncake":
        raise RequestError(f"Send is the mooncake transfer backend's; this encoder serves "
                           f"{backend}, whose Encode delivers", req_id=req_id)


def parse_sglang_encode(body: dict[str, Any], *, backend: str, max_items: int) -> EncodeRequest:
    """An SGLang ``/encode`` body as our request for ``backend`` (SGLang's transfer backend)."""
    if error := sglang_validation_error(body):
        raise RequestError(error)
    req_id = body["req_id"]
    if len(req_id) > MAX_REQ_ID:
        raise RequestError(f"req_id is longer than {MAX_REQ_ID} characters")
    items = body["mm_items"] if isinstance(body["mm_items"], list) else [body["mm_items"]]
    if len(items) > max_items:
        raise RequestError(f"'mm_items' has {len(items)} items; at most {max_items} per request")
    return EncodeRequest(
        req_id=req_id, modality=body["modality"].lower(),
        mm_items=[_item(item, i) for i, item in enumerate(items)],
        num_parts=body["num_parts"], part_idx=body["part_idx"],
        hashes=_hashes(body.get("hashes"), len(items)), deliver=_destinations(body, backend))


def _req_id(body: dict[str, Any]) -> str:
    req_id = body.get("req_id")
    if not isinstance(req_id, str) or not 0 < len(req_id) <= MAX_REQ_ID:
        raise RequestError(f"'req_id' must be a string of 1..{MAX_REQ_ID} characters")
    return req_id


def _count(body: dict[str, Any]) -> int:
    count = body.get("receive_count")
    if not _is_int(count) or not 1 <= count <= MAX_RECEIVE_COUNT:
        raise RequestError(f"'receive_count' must be an integer in 1..{MAX_RECEIVE_COUNT}")
    return count


@dataclass(frozen=True)
class ReceiveUrl:
    """``/scheduler_receive_url``: one rank's PULL endpoint for one part."""

    req_id: str
    receive_count: int
    receive_url: str


def parse_receive_url(body: dict[str, Any]) -> ReceiveUrl:
    return ReceiveUrl(_req_id(body), _count(body), parse_host_port(body.get("receive_url"), "receive_url"))


def parse_meta_request(body: dict[str, Any]) -> tuple[str, int]:
    """``/scheduler_receive_meta_data``: ``(req_id, part_idx)``."""
    part_idx = body.get("part_idx")
    if not _is_int(part_idx) or part_idx < 0:
        raise RequestError("'part_idx' must be an integer >= 0")
    return _req_id(body), part_idx


@dataclass(frozen=True)
class SGLangSend:
    """One rank's Mooncake ``/send``: where to write, and where to say it is done."""

    req_id: str
    part_idx: int
    session: str
    buffer_address: int
    length: int
    completion: str  # prefill_host:embedding_port
    receive_count: int


def parse_sglang_send(body: dict[str, Any]) -> SGLangSend:
    req_id, part_idx = parse_meta_request(body)
    session = parse_host_port(body.get("session_id"), "session_id")
    address, size, port = body.get("buffer_address"), body.get("embedding_size"), body.get("embedding_port")
    if not _is_int(address) or not 0 < address < 1 << 64:
        raise RequestError("'buffer_address' must be a positive 64-bit address")
    if not _is_int(size) or not 0 < size < (1 << 64) - address:
        raise RequestError("'embedding_size' must be positive and fit after the address")
    host = body.get("prefill_host")
    if not isinstance(host, str) or not _is_int(port):
        raise RequestError("'prefill_host' and 'embedding_port' must name the rank's PULL socket")
    host = host.removeprefix("[").removesuffix("]")
    completion = parse_host_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", "prefill_host")
    return SGLangSend(req_id, part_idx, session, address, size, completion, _count(body))
