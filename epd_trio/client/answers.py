"""What encoders answer, checked: ``/encode`` and ``/send`` JSON, error bodies, ZMQ headers.

Pure functions over received data (no trio, no I/O), so the client's tasks
only decide *when* to read and these decide *what it means*. An encoder's
reported failure keeps its type, message and status (``RemoteEncodeError``);
anything that breaks the protocol is a ``ProtocolError``. An answer is an
``httpx.Response`` or a ``grpc_channel.GrpcAnswer``: a gRPC failure is first
turned into the status and error body the HTTP face would have answered
(``grpc_failure``, the one place that maps gRPC back onto the error tree).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, Protocol

import epd_trio.errors as error_tree
from epd_trio.errors import (
    GRPC_STATUS,
    EncodeError,
    EncodeTimeout,
    EPDError,
    PeerUnavailable,
    ProtocolError,
)
from epd_trio.protocol.codec import decode_safetensors, header_for
from epd_trio.protocol.messages import (
    DTYPE_ITEMSIZE,
    MAX_ERROR_MESSAGE,
    EmbeddingHeader,
    validate_extras,
)
from epd_trio.protocol.payload import Payload
from epd_trio.protocol.requests import EncodeMeta

__all__ = [
    "Answer",
    "EncoderUnreachable",
    "inline_message",
    "RemoteEncodeError",
    "check_message",
    "check_sized_meta",
    "check_sent",
    "grpc_failure",
    "http_error",
    "json_of",
    "parse_meta",
    "parse_sized_meta",
    "zmq_error",
]

# ``extras`` is optional: an encoder leaves it out when it has none (and older ones never send it).
_META_FIELDS: Final = tuple(f.name for f in dataclasses.fields(EncodeMeta) if f.name != "extras")


class RemoteEncodeError(EncodeError):
    """An encoder reported that a part failed; its type, message and status are kept."""

    def __init__(self, message: str, *, req_id: str, status_code: int, error_type: str,
                 encoder_url: str, part_idx: int, detail: str = "") -> None:
        super().__init__(message, req_id=req_id, status_code=status_code)
        self.error_type = error_type
        self.encoder_url = encoder_url
        self.part_idx = part_idx
        self.detail = detail or message  # the encoder's own message, without where it came from


class Answer(Protocol):
    """What the checks read of an encoder's answer (``httpx.Response`` has all of it)."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def json_of(response: Answer) -> Any:
    """A peer's JSON answer; ``ValueError`` for all that is not JSON we can take, nesting too
    deep for the parser included (a ``RecursionError`` would escape every caller's checks)."""
    try:
        return response.json()
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class EncoderUnreachable(PeerUnavailable):
    """No connection to the encoder could be made, so the call never reached it (a part
    may move to another encoder, as on an HTTP connect error)."""


# gRPC code → the HTTP status it stands for when the error class does not say (first in the table).
_GRPC_HTTP: Final = {name: status for status, name in reversed(list(GRPC_STATUS.items()))}


def grpc_failure(code: str, details: str, error_type: str | None, *, target: str,
                 req_id: str | None) -> tuple[int, dict[str, Any]]:
    """A failed RPC as the status and error body the HTTP face would have answered.

    With ``error_type`` (the encoder's ``epd-error-type`` trailer, an ``epd_trio.errors``
    class name): that class's status when its gRPC code is ``code``, else the code's
    status (an ``EncodeError`` may carry its own). Without it the call itself failed, and
    this raises: DEADLINE_EXCEEDED → ``EncodeTimeout`` (the client's deadline is the
    call's); UNAVAILABLE → ``EncoderUnreachable`` when no connection could be made, else
    ``PeerUnavailable``. Any other code is answered with the code's status, typed by its name.
    """
    if code == "DEADLINE_EXCEEDED":  # ours or the encoder's copy of it: the same deadline
        raise EncodeTimeout(f"{target}: the gRPC deadline passed ({details[:200]})", req_id=req_id)
    if error_type:
        cls = getattr(error_tree, error_type, None) if error_type in error_tree.__all__ else None
        agrees = isinstance(cls, type) and issubclass(cls, EPDError) and \
            GRPC_STATUS.get(cls.status_code, "INTERNAL") == code
        status = cls.status_code if agrees else _GRPC_HTTP.get(code, 500)  # type: ignore[union-attr]
        return status, {"error": {"type": error_type, "message": details}}
    if code == "UNAVAILABLE":
        kind = EncoderUnreachable if "failed to connect" in details.lower() else PeerUnavailable
        raise kind(f"{target} is unavailable: {details[:200]}", req_id=req_id)
    if code == "CANCELLED":  # not by us (trio's cancellation would have ended the wait)
        raise PeerUnavailable(f"{target} cancelled the call: {details[:200]}", req_id=req_id)
    return _GRPC_HTTP.get(code, 500), {"error": {"type": code, "message": details}}


def http_error(response: Answer, req_id: str, encoder_url: str,
               part_idx: int) -> RemoteEncodeError:
    """The encoder's JSON error body as an exception (or what text there was)."""
    error_type, message = "HTTPError", response.text[:500]
    try:
        error = json_of(response)["error"]
        error_type, message = str(error["type"])[:128], str(error["message"])[:MAX_ERROR_MESSAGE]
    except (ValueError, KeyError, TypeError):
        pass
    return RemoteEncodeError(
        f"{encoder_url} part {part_idx}: {response.status_code} {error_type}: {message}",
        req_id=req_id, status_code=response.status_code, error_type=error_type,
        encoder_url=encoder_url, part_idx=part_idx, detail=message)


def zmq_error(header: EmbeddingHeader, encoder_url: str) -> RemoteEncodeError:
    """An ``error`` message (its schema guarantees ``header.error``) as an exception."""
    assert header.error is not None
    e = header.error
    return RemoteEncodeError(
        f"{encoder_url} part {header.part_idx}: {e.type}: {e.message}", req_id=header.req_id,
        status_code=e.status, error_type=e.type, encoder_url=encoder_url,
        part_idx=header.part_idx)


def parse_meta(response: Answer, req_id: str, part_idx: int, num_parts: int) -> EncodeMeta:
    """A 200 ``/encode`` answer (extra keys, such as Mooncake's ``nbytes``, are ignored)."""
    return parse_sized_meta(response, req_id, part_idx, num_parts, sized=False)[0]


def parse_sized_meta(response: Answer, req_id: str, part_idx: int, num_parts: int, *,
                     sized: bool = True) -> tuple[EncodeMeta, int]:
    """A 200 Mooncake ``/encode`` answer: the meta and its ``nbytes`` (-1 when not ``sized``)."""
    try:
        body = json_of(response)
        meta = EncodeMeta(**{name: body[name] for name in _META_FIELDS},
                          extras=validate_extras(body.get("extras", {}), len(body["token_counts"])))
        nbytes = body["nbytes"] if sized else -1
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"nbytes is {nbytes!r}")
    except (ValueError, KeyError, TypeError, ProtocolError) as exc:
        raise ProtocolError(f"bad /encode answer for part {part_idx}: {exc!r:.200}",
                            req_id=req_id) from None
    if (meta.req_id, meta.part_idx, meta.num_parts) != (req_id, part_idx, num_parts):
        raise ProtocolError(f"/encode answered for {meta.req_id} part {meta.part_idx}/"
                            f"{meta.num_parts}, asked {req_id} part {part_idx}/{num_parts}",
                            req_id=req_id)
    return meta, nbytes


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
    if header.extras != meta.extras:
        raise ProtocolError(
            f"part {header.part_idx} of {header.req_id} from {encoder_url}: the ZMQ message's"
            f" extras {header.extras!r:.200} differ from the HTTP answer's {meta.extras!r:.200}",
            req_id=header.req_id)


def check_sized_meta(meta: EncodeMeta, nbytes: int, modality: str, items: int,
                     encoder_url: str) -> None:
    """A Mooncake answer must describe what the plan asked, and its ``nbytes`` its shape:
    the receiver reserves exactly that, and the encoder writes exactly that."""
    itemsize = DTYPE_ITEMSIZE.get(meta.dtype) if isinstance(meta.dtype, str) else None
    counts = meta.token_counts if isinstance(meta.token_counts, list) else []
    problem = None
    if (meta.modality, len(counts)) != (modality, items):
        problem = f"describes {len(counts)} {meta.modality} items, asked {items} {modality}"
    elif itemsize is None or not all(type(v) is int for v in (meta.tokens, meta.dim, *counts)):
        problem = f"has dtype {meta.dtype!r}, tokens {meta.tokens!r}, dim {meta.dim!r}"
    elif meta.dim < 1 or meta.tokens < 1 or sum(counts) != meta.tokens or min(counts) < 0:
        problem = f"has {meta.tokens} tokens of dim {meta.dim} but token_counts {counts}"
    elif not isinstance(meta.grid_thw, list) or len(meta.grid_thw) not in (0, items) or \
            not all(isinstance(g, list) and len(g) == 3 for g in meta.grid_thw):
        problem = f"has grid_thw {meta.grid_thw!r:.100} for {items} items"
    elif nbytes != meta.tokens * meta.dim * itemsize:
        problem = f"says nbytes {nbytes} for {meta.tokens} x {meta.dim} {meta.dtype}"
    if problem:
        raise ProtocolError(f"part {meta.part_idx} of {meta.req_id} from {encoder_url}: the /encode"
                            f" answer {problem}", req_id=meta.req_id)


def check_sent(response: Answer, req_id: str, part_idx: int, nbytes: int,
               encoder_url: str) -> None:
    """A 200 ``/send`` answer must say it wrote exactly the reserved bytes for that part."""
    try:
        body = json_of(response)
        got = (body["req_id"], body.get("part_idx", 0), body["nbytes"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"bad /send answer for part {part_idx}: {exc!r:.200}",
                            req_id=req_id) from None
    if got != (req_id, part_idx, nbytes):
        raise ProtocolError(f"{encoder_url} answered /send with (req_id, part_idx, nbytes) {got!r:.200},"
                            f" expected {(req_id, part_idx, nbytes)}", req_id=req_id)


def inline_message(response: Answer, req_id: str, part: Any, num_parts: int,
                   encoder_url: str) -> tuple[EmbeddingHeader, Payload]:
    """An inline (safetensors) answer as the same (header, payload) a ZMQ message gives."""
    tensor, meta = decode_safetensors(response.content)
    where = f"{encoder_url} part {part.part_idx}"
    if (meta.get("req_id"), meta.get("part_idx"), meta.get("num_parts")) != (req_id, part.part_idx, num_parts):
        raise ProtocolError(f"{where}: the answer is for {meta.get('req_id')!r} part {meta.get('part_idx')}")
    if meta.get("modality") != part.modality or len(meta.get("token_counts", ())) != len(part.item_indices):
        raise ProtocolError(f"{where}: the answer does not match the part's modality or item count")
    header = header_for(tensor, req_id=req_id, part_idx=part.part_idx, num_parts=num_parts,
                        modality=part.modality, token_counts=meta["token_counts"],
                        grid_thw=meta.get("grid_thw", ()), extras=meta.get("extras"))
    return header, Payload.of(tensor)
