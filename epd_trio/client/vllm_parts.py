"""A request's parts as vLLM's EPD sends them to encoder instances (sans-IO).

An encoder instance of vLLM 0.32's disaggregated encoder — an epd_trio encoder
started with ``--api vllm``, or one of vLLM's own (``ec_role: ec_producer``) —
takes an OpenAI chat request whose content is only media parts, stores each
item's embedding where the language server's EC connector finds it (named by
the item's ``mm_hash``, or its ``uuid``), and answers 200 once they are
stored. The 200 *is* the delivery: no embedding comes back.

So a part here is one such chat request: its content parts verbatim (their
``uuid`` and URL form kept, so that the encoder names each item exactly as the
language server will), ``max_tokens`` 1, not streamed, and the request options
that change how items are processed or named (``model``,
``mm_processor_kwargs``, ``media_io_kwargs``) copied from the original request:
an encoder that cannot apply them refuses the part (a 4xx) rather than storing
items under names the language server will not look for.

Each part carries its own ``x-request-id`` (``part_request_id``): two parts of
one request may land on the same encoder, which keys its work by that id.
Sending a part twice is harmless (the same file is written again, atomically),
which is what lets the client move a part whose encoder failed (``retryable``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from epd_trio.client.answers import Answer, json_of
from epd_trio.client.result import PartReport
from epd_trio.errors import ProtocolError

__all__ = [
    "CHAT_PATH",
    "FORWARDED_OPTIONS",
    "StoredRequest",
    "merge_transfer_params",
    "part_body",
    "part_request_id",
    "retryable",
    "transfer_params",
]

CHAT_PATH: Final = "/v1/chat/completions"
# The original request's fields an encoder instance must see: they name or shape the items.
FORWARDED_OPTIONS: Final = ("model", "mm_processor_kwargs", "media_io_kwargs")


@dataclass(frozen=True)
class StoredRequest:
    """Every item of a request is stored where the language server looks for it.

    ``ec_transfer_params``: what the encoders answered, merged (per ``mm_hash``:
    ``item_indices`` within its part's request, and metadata such as
    ``image_grid_thw``); empty when they answered none.
    """

    req_id: str
    ec_transfer_params: Mapping[str, Any]
    parts: tuple[PartReport, ...]


def part_request_id(req_id: str, part_idx: int) -> str:
    """The ``x-request-id`` of one part (vLLM's proxy also derives a child id per item)."""
    return f"{req_id}:{part_idx}"


def part_body(parts: Sequence[Mapping[str, Any]], options: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request an encoder instance stores ``parts`` from."""
    body: dict[str, Any] = {name: options[name] for name in FORWARDED_OPTIONS
                            if options.get(name) is not None}
    body.update(messages=[{"role": "user", "content": list(parts)}], max_tokens=1, stream=False)
    return body


def retryable(status: int) -> bool:
    """An encoder's own failure (5xx): another encoder may store the part. A 4xx is the
    request's, the same everywhere: it goes back to the caller."""
    return status >= 500


def transfer_params(answer: Answer, part_idx: int, encoder_url: str) -> Mapping[str, Any]:
    """A 200 answer's ``ec_transfer_params`` (None or absent: none)."""
    try:
        body = json_of(answer)
    except ValueError:
        raise ProtocolError(f"{encoder_url} answered part {part_idx} with 200 and a body that is "
                            "not JSON") from None
    params = body.get("ec_transfer_params") if isinstance(body, dict) else None
    if params is not None and not isinstance(params, dict):
        raise ProtocolError(f"{encoder_url} answered part {part_idx} with ec_transfer_params that "
                            f"is not an object: {params!r:.100}")
    return MappingProxyType(params or {})


def merge_transfer_params(per_part: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The parts' ``ec_transfer_params`` as one map, in part order."""
    merged: dict[str, Any] = {}
    for params in per_part:
        merged.update(params)
    return MappingProxyType(merged)
