"""gRPC messages ↔ protocol v1, sans-IO: both gRPC services reuse the HTTP bodies' parsers.

A request message becomes the very dict its HTTP face would have parsed from
JSON, so validation, limits and error messages are the HTTP ones by
construction; an answer becomes a message field by field.
"""

from __future__ import annotations

import json
import mimetypes
from typing import Any, Final

from epd_trio.errors import RequestError
from epd_trio.protocol.proto import encoder_pb2 as pb
from epd_trio.protocol.requests import EncodeMeta
from epd_trio.protocol.sglang_requests import sglang_validation_error

__all__ = [
    "ERROR_TYPE_KEY",
    "KEEPALIVE_PING_INTERVAL_S",
    "MESSAGE_LIMIT",
    "encode_body",
    "encode_message",
    "infer_modality",
    "meta_from_message",
    "meta_message",
    "sglang_encode_body",
]

# The trailing-metadata key in which a failed call names its error class (both ends read it).
ERROR_TYPE_KEY: Final = "epd-error-type"
# Largest gRPC message either end sends (SGLang's gRPC encoder's, both directions).
MESSAGE_LIMIT: Final = 256 << 20
# A client's keepalive pings come no more often than this, during a call (the server
# accepts pings this often; grpc's default, 5 minutes, would close the connection).
KEEPALIVE_PING_INTERVAL_S: Final = 5
_MODALITY_PREFIXES: Final = {"image/": "image", "video/": "video", "audio/": "audio"}


def encode_body(message: pb.EncodeRequest) -> dict[str, Any]:
    """``epd_trio.v1.EncodeRequest`` → the JSON ``/encode`` body it means."""
    items: list[Any] = [{"url": i.url, "content_hash": i.content_hash} if i.content_hash else i.url
                        for i in message.mm_items]
    body: dict[str, Any] = {"req_id": message.req_id, "modality": message.modality,
                            "mm_items": items, "num_parts": message.num_parts or 1,
                            "part_idx": message.part_idx}
    if message.hashes:
        body["hashes"] = list(message.hashes)
    which = message.WhichOneof("deliver")
    if which == "zmq":
        body["deliver"] = {"backend": "zmq", "endpoints": list(message.zmq.endpoints)}
    elif which == "mooncake":
        body["deliver"] = {"backend": "mooncake", "receive_count": message.mooncake.receive_count or 1}
    return body


def encode_message(body: dict[str, Any]) -> pb.EncodeRequest:
    """The inverse of ``encode_body``: a client's ``/encode`` body as the message it sends
    over gRPC (one ``deliver.endpoint`` becomes the one-element ``endpoints``)."""
    items = [pb.Item(url=i["url"], content_hash=i.get("content_hash") or "") if isinstance(i, dict)
             else pb.Item(url=i) for i in body["mm_items"]]
    message = pb.EncodeRequest(req_id=body["req_id"], modality=body["modality"], mm_items=items,
                               num_parts=body.get("num_parts", 1), part_idx=body.get("part_idx", 0),
                               hashes=body.get("hashes", ()))
    deliver = body.get("deliver") or {"backend": "inline"}
    if deliver["backend"] == "zmq":
        endpoints = deliver.get("endpoints") or [deliver["endpoint"]]
        message.zmq.CopyFrom(pb.Zmq(endpoints=endpoints))
    elif deliver["backend"] == "mooncake":
        message.mooncake.CopyFrom(pb.Mooncake(receive_count=deliver.get("receive_count", 1)))
    elif deliver["backend"] == "inline":
        message.inline.CopyFrom(pb.Inline())
    else:
        raise ValueError(f"no gRPC form for delivery {deliver['backend']!r}")
    return message


def meta_message(meta: EncodeMeta) -> pb.EncodeMeta:
    """One part's metadata as the message (``extras`` as JSON: its values are numbers or lists)."""
    return pb.EncodeMeta(
        req_id=meta.req_id, part_idx=meta.part_idx, num_parts=meta.num_parts,
        modality=meta.modality, tokens=meta.tokens, dim=meta.dim, dtype=meta.dtype,
        token_counts=meta.token_counts,
        grid_thw=[pb.Grid(t=t, h=h, w=w) for t, h, w in meta.grid_thw],
        extras_json=json.dumps(meta.extras) if meta.extras else "")


def meta_from_message(message: pb.EncodeMeta) -> EncodeMeta:
    """The inverse of ``meta_message`` (a client's view of an answer)."""
    try:
        extras = json.loads(message.extras_json) if message.extras_json else {}
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"extras_json is not JSON: {exc}") from None
    return EncodeMeta(
        req_id=message.req_id, part_idx=message.part_idx, num_parts=message.num_parts,
        modality=message.modality, tokens=message.tokens, dim=message.dim, dtype=message.dtype,
        token_counts=list(message.token_counts),
        grid_thw=[[g.t, g.h, g.w] for g in message.grid_thw], extras=extras)


def infer_modality(items: list[str]) -> str:
    """What SGLang's modality-free gRPC ``Encode`` items are: each ``data:`` URI's MIME type
    or a URL's or path's file extension; image when nothing says otherwise (SGLang's only
    case). Items that say different modalities are refused: one modality per request."""
    said: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        if (modality := _item_modality(item)) is not None:
            said.setdefault(modality, []).append(index)
    if len(said) > 1:
        which = "; ".join(f"{m}: item{'s' if len(i) > 1 else ''} {', '.join(map(str, i))}"
                          for m, i in sorted(said.items()))
        raise RequestError(f"mm_items mix modalities ({which}); SGLang's Encode carries one "
                           "modality: send one Encode per modality")
    return next(iter(said), "image")


def _item_modality(item: str) -> str | None:
    if item.startswith("data:"):
        mime = item[5:].split(";", 1)[0].split(",", 1)[0].strip().lower()
    else:
        mime = (mimetypes.guess_type(item.split("?", 1)[0].split("#", 1)[0])[0] or "").lower()
    return next((m for prefix, m in _MODALITY_PREFIXES.items() if mime.startswith(prefix)), None)


def sglang_encode_body(message: Any, backend: str) -> dict[str, Any]:
    """SGLang's ``sglang.grpc.encoder.EncodeRequest`` → its HTTP ``/encode`` body.

    SGLang's own checks see its request first (modality ``IMAGE``, as its gRPC
    server sets it), so their messages come first; then the items say the
    modality. ``embedding_port`` empty means zmq_to_scheduler's rendezvous (the
    ranks call ``SchedulerReceiveUrl``); otherwise the listed ports on
    ``prefill_host`` — for zmq_to_tokenizer the first only, as SGLang's server.
    """
    items = list(message.mm_items)
    body: dict[str, Any] = {"req_id": message.req_id, "modality": "IMAGE", "mm_items": items,
                            "num_parts": message.num_parts, "part_idx": message.part_idx}
    if sglang_validation_error(body) is None:
        body["modality"] = infer_modality(items)
    ports = list(message.embedding_port)
    if ports:
        body["prefill_host"] = message.prefill_host
        body["embedding_port"] = ports[:1] if backend == "zmq_to_tokenizer" else ports
    return body
