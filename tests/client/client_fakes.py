"""Fake encoders for client tests: httpx.MockTransport in front, real ZMQ PUSH behind.

Each fake follows a script (``Behaviour``) and records what it was asked, so a
test can check the client's requests, aborts and the exact tensors it pushed.
Its answers and ZMQ headers have the real encoder's shape (``extras`` for videos
and audio included): ``test_client_fakes_contract.py`` checks them against a real encoder's.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
import trio

from epd_trio.errors import EPDError, RequestError, error_body, http_status
from epd_trio.protocol import encode_zmq_message, error_message, header_for
from epd_trio.protocol.requests import EncodeMeta
from epd_trio.transport import PushSocketCache

DIM = 8
# Ragged frames (rows are 16 or 32 bytes): every client test also checks that
# a payload split across frames is gathered into the slot in order.
FRAME_BYTES = 7
DTYPES = {"image": torch.bfloat16, "video": torch.bfloat16, "audio": torch.float32}


@dataclass(frozen=True)
class Behaviour:
    """What one fake encoder does with ``/encode``.

    ok: push the embedding, answer 200 · error: answer ``error`` as JSON, push
    nothing · zmq_error: push an error message, then never answer · hang: never
    answer · down: refuse the connection · bad_meta: like ok, but the 200
    answer's token count is off by one · twice: like ok, then push a second,
    different message for the same part, await ``FakeEncoders.before_answer``
    (the test's proof that both arrived while the part was live), then answer ·
    deep_json: answer with ``status`` and a body nested deeper than any JSON parser goes.
    """

    kind: str = "ok"
    error: EPDError = field(default_factory=lambda: RequestError("item 0: cannot decode"))
    status: int = 200


DEEP_JSON = b"[" * 200_000 + b"]" * 200_000  # valid JSON; the parsers give up (RecursionError)


def item_bytes(n: int) -> bytes:
    """Distinct items; the first byte decides the token count."""
    return bytes([n % 251 + 1]) + f"item-{n}".encode()


def item_embedding(data: bytes, modality: str) -> torch.Tensor:
    """What the fake encodes ``data`` to: 1..4 tokens, values from the content."""
    tokens = 1 + data[0] % 4
    base = torch.arange(tokens * DIM, dtype=torch.float32).view(tokens, DIM) / 64
    return (base + data[0]).to(DTYPES[modality])


def grid_of(tokens: int, modality: str) -> list[int] | None:
    return None if modality == "audio" else [1, 2, tokens * 2]


def extras_of(items: list[bytes], modality: str) -> dict[str, list[Any]]:
    """Per-item extras as the real encoders send them: Qwen2.5-VL videos' seconds per grid
    step, Qwen2-Audio items' mel-frame lengths; none for images."""
    if modality == "audio":
        return {"mel_frames": [100 * (1 + data[0] % 4) for data in items]}
    if modality != "video":
        return {}
    return {"second_per_grid_ts": [0.5 * (1 + data[0] % 4) for data in items]}


def decode_item(item: str) -> bytes:
    header, _, payload = item.partition(",")
    assert header.startswith("data:") and header.endswith(";base64"), header
    return base64.b64decode(payload)


class FakeEncoders:
    def __init__(self, push: PushSocketCache, behaviours: dict[str, Behaviour]) -> None:
        self.push = push
        self.behaviours = behaviours
        self.encode_calls: list[tuple[str, dict]] = []
        self.abort_calls: list[tuple[str, dict]] = []
        self.cancelled: list[tuple[str, int]] = []  # (url, part_idx) handlers cut short
        self.sent: dict[tuple[str, int], torch.Tensor] = {}
        # "twice" awaits this between its second push and its answer.
        self.before_answer: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def calls_to(self, url: str) -> list[dict]:
        return [body for u, body in self.encode_calls if u == url]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        behaviour = self.behaviours[url]
        if behaviour.kind == "down":
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        if request.url.path == "/abort":
            self.abort_calls.append((url, body))
            return httpx.Response(200, json={"aborted": 1})
        assert request.url.path == "/encode"
        self.encode_calls.append((url, body))
        try:
            return await self._encode(behaviour, body)
        except trio.Cancelled:
            self.cancelled.append((url, body["part_idx"]))
            raise

    async def _encode(self, behaviour: Behaviour, body: dict) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        endpoint = body["deliver"]["endpoint"]
        rid, idx, n, modality = body["req_id"], body["part_idx"], body["num_parts"], body["modality"]
        if behaviour.kind == "hang":
            await trio.sleep_forever()
        if behaviour.kind == "deep_json":
            return httpx.Response(behaviour.status, content=DEEP_JSON,
                                  headers={"content-type": "application/json"})
        if behaviour.kind == "error":
            return httpx.Response(http_status(behaviour.error), json=error_body(behaviour.error, rid))
        if behaviour.kind == "zmq_error":
            await self.push.send(endpoint, error_message(rid, idx, n, modality, behaviour.error), 5)
            await trio.sleep_forever()
        datas = [decode_item(i) for i in body["mm_items"]]
        items = [item_embedding(data, modality) for data in datas]
        tensor = torch.cat(items)
        counts = [t.shape[0] for t in items]
        grids = [g for c in counts if (g := grid_of(c, modality)) is not None]
        extras = extras_of(datas, modality)
        header = header_for(tensor, req_id=rid, part_idx=idx, num_parts=n, modality=modality,
                            token_counts=counts, grid_thw=grids, extras=extras)
        self.sent[(rid, idx)] = tensor
        await self.push.send(endpoint, encode_zmq_message(header, tensor, frame_bytes=FRAME_BYTES), 5)
        if behaviour.kind == "twice":
            await self.push.send(endpoint, encode_zmq_message(header, tensor + 1, frame_bytes=FRAME_BYTES), 5)
            await self.before_answer()
        tokens = tensor.shape[0] + (1 if behaviour.kind == "bad_meta" else 0)
        meta = EncodeMeta(req_id=rid, part_idx=idx, num_parts=n, modality=modality, tokens=tokens,
                          dim=DIM, dtype=str(tensor.dtype).removeprefix("torch."),
                          token_counts=counts, grid_thw=grids, extras=extras)
        return httpx.Response(200, json=meta.to_json())


def expected(items: Iterable[bytes], modality: str) -> torch.Tensor:
    return torch.cat([item_embedding(b, modality) for b in items])
