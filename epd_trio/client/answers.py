"""What encoders answer, checked: the ``/encode`` JSON, error bodies, ZMQ headers.

Pure functions over received data (no trio, no I/O), so the client's tasks
only decide *when* to read and these decide *what it means*. An encoder's
reported failure keeps its type, message and status (``RemoteEncodeError``);
anything that breaks the protocol is a ``ProtocolError``.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import httpx

from epd_trio.errors import EncodeError, ProtocolError
from epd_trio.protocol.messages import MAX_ERROR_MESSAGE, EmbeddingHeader
from epd_trio.protocol.requests import EncodeMeta

__all__ = ["RemoteEncodeError", "check_message", "http_error", "parse_meta", "zmq_error"]

_META_FIELDS: Final = tuple(f.name for f in dataclasses.fields(EncodeMeta))


class RemoteEncodeError(EncodeError):
    """An encoder reported that a part failed; its type, message and status are kept."""

    def __init__(self, message: str, *, req_id: str, status_code: int, error_type: str,
                 encoder_url: str, part_idx: int) -> None:
        super().__init__(message, req_id=req_id, status_code=status_code)
        self.error_type = error_type
        self.encoder_url = encoder_url
        self.part_idx = part_idx


def http_error(response: httpx.Response, req_id: str, encoder_url: str,
               part_idx: int) -> RemoteEncodeError:
    """The encoder's JSON error body as an exception (or what text there was)."""
    error_type, message = "HTTPError", response.text[:500]
    try:
        error = response.json()["error"]
        error_type, message = str(error["type"])[:128], str(error["message"])[:MAX_ERROR_MESSAGE]
    except (ValueError, KeyError, TypeError):
        pass
    return RemoteEncodeError(
        f"{encoder_url} part {part_idx}: {response.status_code} {error_type}: {message}",
        req_id=req_id, status_code=response.status_code, error_type=error_type,
        encoder_url=encoder_url, part_idx=part_idx)


def zmq_error(header: EmbeddingHeader, encoder_url: str) -> RemoteEncodeError:
    """An ``error`` message (its schema guarantees ``header.error``) as an exception."""
    assert header.error is not None
    e = header.error
    return RemoteEncodeError(
        f"{encoder_url} part {header.part_idx}: {e.type}: {e.message}", req_id=header.req_id,
        status_code=e.status, error_type=e.type, encoder_url=encoder_url,
        part_idx=header.part_idx)


def parse_meta(response: httpx.Response, req_id: str, part_idx: int, num_parts: int) -> EncodeMeta:
    """A 200 ``/encode`` answer (extra keys, such as Mooncake's ``nbytes``, are ignored)."""
    try:
        body = response.json()
        meta = EncodeMeta(**{name: body[name] for name in _META_FIELDS})
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"bad /encode answer for part {part_idx}: {exc!r:.200}",
                            req_id=req_id) from None
    if (meta.req_id, meta.part_idx, meta.num_parts) != (req_id, part_idx, num_parts):
        raise ProtocolError(f"/encode answered for {meta.req_id} part {meta.part_idx}/"
                            f"{meta.num_parts}, asked {req_id} part {part_idx}/{num_parts}",
                            req_id=req_id)
    return meta


def check_message(header: EmbeddingHeader, meta: EncodeMeta, modality: str, items: int,
                  encoder_url: str) -> None:
    """The ZMQ message must describe what the plan asked and the HTTP answer said."""
    expected = (modality, meta.num_parts, items, meta.tokens, meta.dim, meta.dtype,
                list(meta.token_counts))
    got = (header.modality, header.num_parts, len(header.token_counts), header.shape[0],
           header.shape[1], header.dtype, header.token_counts)
    if got != expected:
        raise ProtocolError(
            f"part {header.part_idx} of {header.req_id} from {encoder_url}: the ZMQ message"
            f" (modality, num_parts, items, tokens, dim, dtype, token_counts) {got} does not"
            f" match the request and HTTP answer {expected}", req_id=header.req_id)
