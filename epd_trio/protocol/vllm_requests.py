"""vLLM 0.32's side of an EPD encoder instance, sans-IO: what comes in, what goes out.

In: an OpenAI chat completion body, as vLLM's EPD proxy sends each item of a
request to an encoder instance (``max_tokens: 1``, text removed; a whole
request is taken too, its text ignored). Media parts: ``image_url``,
``video_url``, ``audio_url`` (``{"url": ...}`` or the URL itself) and
``input_audio`` (``{"data": base64, "format": "wav"}``), each with an optional
``uuid``; ``text`` parts are ignored; any other part is refused. The request id
is the ``x-request-id`` header, else the body's ``request_id``, else a new one.
Per-request processor options (``mm_processor_kwargs``, ``media_io_kwargs``)
and streaming are refused: this encoder would not apply them the way vLLM
does, and they change the items' ``mm_hash``. For vLLM's Mooncake connector,
``ec_transfer_params`` names the consumer (``consumer_zmq``, its control
address) and each item's ``transfer_id`` (``ec_items``, as vLLM's producer
matches them: by position, else by ``mm_hash``, else ``{request_id}:{index}``).

Out: a chat completion object carrying ``ec_transfer_params`` — per
``mm_hash``, the request's item indices, the placeholder metadata vLLM's
producer publishes for the model family (``image_grid_thw``,
``video_grid_thw``, ``audio_num_tokens``) and the ``transfer_id`` the request
named — and errors in OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid as uuid_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from epd_trio.config import EcTransfer
from epd_trio.errors import RequestError, error_body, http_status
from epd_trio.protocol.messages import MAX_REQ_ID
from epd_trio.protocol.requests import Delivery, EncodeMeta, EncodeRequest, validate_endpoint

__all__ = [
    "DELIVERIES",
    "MEDIA_PART_TYPES",
    "ChatItem",
    "ChatRequest",
    "EcParams",
    "EcProducer",
    "ec_transfer_params",
    "chat_completion",
    "item_request",
    "openai_error",
    "parse_chat_request",
    "transfer_ids",
]

DELIVERIES: Final = ("vllm_storage", "vllm_mooncake")  # the deliveries this face's requests name
_PARTS: Final = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
# Every content part type an encoder instance encodes, and its modality.
MEDIA_PART_TYPES: Final = MappingProxyType({**_PARTS, "input_audio": "audio"})
_IGNORED: Final = ("text", "input_text", "refusal", "thinking")
_MAX_UUID: Final = 256
# vLLM's per-item metadata for the families this encoder serves; other keys are not published.
_METADATA: Final = {"image": "image_grid_thw", "video": "video_grid_thw"}


@dataclass(frozen=True)
class ChatItem:
    """One media part: its modality, where its bytes are, its uuid, its place in the request."""

    modality: str
    source: str  # a data: URI, an http(s) URL, or a path (read only under the media root)
    uuid: str | None
    index: int


@dataclass(frozen=True)
class EcParams:
    """What a request's ``ec_transfer_params`` tells a Mooncake producer."""

    consumer_zmq: str | None = None  # the consumer's control address, tcp://host:port
    items: tuple[tuple[str | None, str], ...] = ()  # ec_items: (mm_hash or None, transfer_id)


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    model: str | None
    items: tuple[ChatItem, ...]
    ec: EcParams = EcParams()

    def by_modality(self) -> dict[str, list[ChatItem]]:
        """The items grouped by modality, each group in request order."""
        groups: dict[str, list[ChatItem]] = {}
        for item in self.items:
            groups.setdefault(item.modality, []).append(item)
        return groups


def _url(value: Any, kind: str, index: int) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"content part {index} ({kind}) needs a URL: {{\"url\": \"...\"}}")
    if url.startswith("file://"):
        try:
            return unquote(urlsplit(url).path)
        except ValueError as exc:
            raise RequestError(f"content part {index}: a file:// URL that is not valid ({exc})") from None
    return url


def _input_audio(value: Any, index: int) -> str:
    if not isinstance(value, dict) or not isinstance(value.get("data"), str) or \
            not isinstance(value.get("format", "wav"), str):
        raise RequestError(f"content part {index} (input_audio) needs {{\"data\": base64, \"format\": str}}")
    fmt = value.get("format", "wav")
    if not fmt.isascii() or not fmt.isalnum():
        raise RequestError(f"content part {index} (input_audio): format must be a word like wav or mp3")
    return f"data:audio/{fmt.lower()};base64,{value['data']}"


def _uuid(part: dict[str, Any], index: int) -> str | None:
    value = part.get("uuid")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_UUID or "/" in value or value in (".", ".."):
        raise RequestError(f"content part {index}: uuid must be a string of 1..{_MAX_UUID} "
                           "characters without '/' (it names a directory of the shared storage)")
    return value


def _part(part: Any, index: int) -> ChatItem | None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise RequestError(f"content part {index} must be an object with a 'type'")
    kind = part["type"]
    if kind in _IGNORED:
        return None
    if kind in _PARTS:
        return ChatItem(_PARTS[kind], _url(part.get(kind), kind, index), _uuid(part, index), -1)
    if kind == "input_audio":
        return ChatItem("audio", _input_audio(part.get(kind), index), _uuid(part, index), -1)
    raise RequestError(f"content part {index}: type {kind!r:.40} is not accepted by this encoder "
                       f"(image_url, video_url, audio_url, input_audio; text is ignored)")


def _items(messages: Any, max_items: int) -> list[ChatItem]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    items: list[ChatItem] = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError("every message must be an object")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError("a message's content must be a string or a list of parts")
        for part in content:
            item = _part(part, len(items))
            if item is not None:
                items.append(ChatItem(item.modality, item.source, item.uuid, len(items)))
                if len(items) > max_items:
                    raise RequestError(f"the request has over {max_items} media items")
    return items


def _request_id(header: str | None, body: Mapping[str, Any]) -> str:
    chosen = header if header is not None else body.get("request_id")
    if chosen is None:
        return uuid_module.uuid4().hex
    if not isinstance(chosen, str) or not 0 < len(chosen) <= MAX_REQ_ID or not chosen.isprintable():
        raise RequestError(f"the request id (x-request-id) must be 1..{MAX_REQ_ID} printable characters")
    return chosen


def parse_chat_request(body: dict[str, Any], *, header_request_id: str | None,
                       max_items: int) -> ChatRequest:
    """A chat completion body, as an encoder instance takes it (see the module docstring)."""
    if body.get("stream"):
        raise RequestError("an encoder instance answers whole: 'stream' must be false")
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(name):
            raise RequestError(f"'{name}' is not supported by this encoder (it changes how vLLM "
                               "processes and hashes the items)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string")
    items = tuple(_items(body.get("messages"), max_items))
    return ChatRequest(_request_id(header_request_id, body), model, items,
                       _ec_params(body.get("ec_transfer_params"), max_items))


def _ec_params(value: Any, max_items: int) -> EcParams:
    if value is None:
        return EcParams()
    if not isinstance(value, dict):
        raise RequestError("'ec_transfer_params' must be an object")
    consumer = value.get("consumer_zmq")
    if consumer is not None and (not isinstance(consumer, str) or not consumer.startswith("tcp://")):
        raise RequestError("'ec_transfer_params.consumer_zmq' must be the consumer's tcp://host:port")
    entries = value.get("ec_items") or []
    if not isinstance(entries, list) or len(entries) > max_items:
        raise RequestError(f"'ec_transfer_params.ec_items' must be a list of at most {max_items} objects")
    items = []
    for entry in entries:
        mm_hash, tid = (entry.get("mm_hash"), entry.get("transfer_id")) if isinstance(entry, dict) \
            else (None, None)
        if not isinstance(tid, str) or not 0 < len(tid) <= _MAX_UUID or \
                (mm_hash is not None and not isinstance(mm_hash, str)):
            raise RequestError("every 'ec_transfer_params.ec_items' entry needs a transfer_id (a string "
                               f"of 1..{_MAX_UUID} characters) and may name a string mm_hash")
        items.append((mm_hash, tid))
    return EcParams(None if consumer is None else validate_endpoint(consumer), tuple(items))


def transfer_ids(chat: ChatRequest, hashes: Sequence[str]) -> list[tuple[str, bool]]:
    """Per item, its transfer_id and whether the request named it, as vLLM's producer finds it:
    the ``ec_items`` entry at its position unless that names another ``mm_hash``, else the
    first entry naming its ``mm_hash``, else ``{request_id}:{index}``."""
    named = chat.ec.items
    found: list[tuple[str, bool]] = []
    for index, mm_hash in enumerate(hashes):
        if index < len(named) and named[index][0] in (None, mm_hash):
            found.append((named[index][1], True))
            continue
        by_hash = next((tid for h, tid in named if h == mm_hash), None)
        found.append((by_hash, True) if by_hash is not None else (f"{chat.request_id}:{index}", False))
    return found


@dataclass(frozen=True)
class EcProducer:
    """How an encoder instance hands its items to vLLM's consumer (its ``--ec-transfer-config``):
    written where the consumer reads them (ECExampleConnector), or pushed into the memory of
    the consumer each request names (ECMooncakeConnector), as the ``transfer_id``s it names."""

    pushes: bool
    described: str  # for the log: the connector, or the storage

    @classmethod
    def of(cls, ec: EcTransfer | None) -> EcProducer:
        if ec is None or ec.storage_path is not None:
            return cls(False, f"shared storage {ec.storage_path if ec is not None else None}")
        return cls(True, f"{ec.connector} ({ec.mooncake_protocol})")

    def check(self, chat: ChatRequest) -> None:
        """A push needs the consumer the request names (a 400, before any item is fetched)."""
        if self.pushes and chat.ec.consumer_zmq is None:
            raise RequestError("this encoder pushes to vLLM's ECMooncakeConnector: the request needs "
                               "ec_transfer_params.consumer_zmq, the consumer's control address",
                               req_id=chat.request_id)

    def delivery(self, chat: ChatRequest, items: Sequence[ChatItem], ids: Sequence[str]) -> Delivery:
        """Where ``items`` of ``chat`` go (``ids``: every item's ``transfer_id``, by index)."""
        if not self.pushes:
            return Delivery("vllm_storage")
        self.check(chat)
        assert chat.ec.consumer_zmq is not None  # checked
        return Delivery("vllm_mooncake", (chat.ec.consumer_zmq,), transfer_ids=tuple(ids[i.index] for i in items))

    def answered_ids(self, ids: Sequence[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
        """The ``transfer_id``s the answer reports (``transfer_ids``): a push's, else none."""
        return tuple(ids) if self.pushes else ()


def item_request(request_id: str, modality: str, items: list[Any], hashes: list[str],
                 part_idx: int, num_parts: int, deliver: Delivery) -> EncodeRequest:
    """One modality's items of a chat request, named ``hashes``, for a vLLM delivery."""
    return EncodeRequest(req_id=request_id, modality=modality, mm_items=items, num_parts=num_parts,
                         part_idx=part_idx, hashes=hashes, deliver=deliver)


def _family_metadata(modality: str, grid: Sequence[int] | None, tokens: int) -> dict[str, Any]:
    if modality == "audio":
        return {"audio_num_tokens": [tokens]}
    return {_METADATA[modality]: [int(g) for g in grid]} if grid else {}


def ec_transfer_params(items: Sequence[ChatItem], hashes: Sequence[str], metas: Mapping[str, EncodeMeta],
                       named: Sequence[tuple[str, bool]] = ()) -> dict[str, Any]:
    """Per ``mm_hash``: the request's indices of that item, its placeholder metadata and the
    ``transfer_id`` the request named for it, as vLLM's producer reports them
    (``collect_ec_item_metadata``; ``named`` from ``transfer_ids``, for Mooncake)."""
    position = dict.fromkeys(metas, 0)
    params: dict[str, Any] = {}
    for item, mm_hash in zip(items, hashes, strict=True):
        meta, k = metas[item.modality], position[item.modality]
        position[item.modality] += 1
        grid = meta.grid_thw[k] if k < len(meta.grid_thw) else None
        entry = params.setdefault(mm_hash, {"item_indices": []})
        entry["metadata"] = _family_metadata(item.modality, grid, meta.token_counts[k])
        entry["item_indices"].append(item.index)
    for (tid, was_named), mm_hash in zip(named, hashes):
        if was_named:
            params[mm_hash]["transfer_id"] = tid
    return params


def chat_completion(request_id: str, model: str, tokens: int,
                    params: dict[str, Any] | None) -> dict[str, Any]:
    """The answer of a vLLM EC producer: a chat completion with ``ec_transfer_params``.

    An encoder generates no text: the message is empty and no completion token is counted.
    """
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        "kv_transfer_params": None, "ec_transfer_params": params,
    }


def openai_error(exc: BaseException) -> tuple[dict[str, Any], int]:
    """OpenAI's error object (as vLLM sends it) for any error, and its HTTP status."""
    inner: Any = error_body(exc)["error"]
    status = http_status(exc)
    return {"error": {"message": inner["message"], "type": inner["type"], "param": None,
                      "code": status}}, status
