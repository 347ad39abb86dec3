"""What the EPD proxy reads of an OpenAI request, sans-IO: its media, its streaming, its id.

The proxy forwards a request's bytes to the language server unchanged, so it
reads only what it acts on and leaves every other check to that server (whose
OpenAI errors the caller then gets as they are):

- the body must be a JSON object, ``stream`` a boolean when given;
- a chat request's media: every content part whose type an encoder instance
  encodes (``vllm_requests.MEDIA_PART_TYPES``: ``image_url``, ``video_url``,
  ``audio_url``, ``input_audio``), verbatim, grouped by modality in request
  order. Other parts (text, precomputed ``image_embeds``, anything unknown)
  stay for the language server. A completion request (``/v1/completions``) has
  no media parts;
- the request id: the caller's ``x-request-id``, else a new one. It is sent
  on to the language server, and the encoders' parts are named after it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from epd_trio.errors import RequestError
from epd_trio.protocol.vllm_requests import MEDIA_PART_TYPES

__all__ = ["MAX_REQUEST_ID", "ProxiedRequest", "parse_proxied", "proxy_request_id"]

# Parts are named "{id}-{8 hex}:{part}" and an encoder takes ids of at most 256 characters.
MAX_REQUEST_ID: Final = 200


@dataclass(frozen=True)
class ProxiedRequest:
    body: Mapping[str, Any]  # the parsed request: the options the encoders' parts copy
    stream: bool
    media: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # modality → parts

    @property
    def item_count(self) -> int:
        return sum(len(parts) for parts in self.media.values())


def parse_proxied(body: Any, *, chat: bool) -> ProxiedRequest:
    """A parsed request body (see the module docstring); ``RequestError`` when it is no
    JSON object or its ``stream`` is no boolean."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean")
    return ProxiedRequest(body, stream, _media(body.get("messages")) if chat else {})


def _media(messages: Any) -> dict[str, list[dict[str, Any]]]:
    media: dict[str, list[dict[str, Any]]] = {}
    if not isinstance(messages, list):
        return media  # the language server says what is wrong with it
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            modality = MEDIA_PART_TYPES.get(kind) if isinstance(kind, str) else None
            if modality is not None:
                media.setdefault(modality, []).append(part)
    return media


def proxy_request_id(header: str | None) -> str:
    """The caller's ``x-request-id`` (checked), else a new id."""
    if header is None:
        return f"epd-{uuid.uuid4().hex}"
    if not 0 < len(header) <= MAX_REQUEST_ID or not header.isprintable():
        raise RequestError(f"x-request-id must be 1..{MAX_REQUEST_ID} printable characters")
    return header
