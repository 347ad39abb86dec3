"""``EncoderClient.encode_for_vllm``: a request's media as chat requests to encoder instances.

The encoders here are ``proxy_fakes.FakeEncoder``s (real HTTP) that record what
they are sent and answer as told; ``test_proxy.py`` and ``tests/vllm`` use real ones.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from epd_trio import EncodeTimeout, PeerUnavailable, RemoteEncodeError, open_encoder_client
from epd_trio.client import EncoderClient
from proxy_fakes import FakeEncoder, closing_peer, serving


def _image(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,AAA{n}"}, **extra}


def _clean(client: EncoderClient) -> None:
    s = client.statistics()
    assert (s.requests_live, s.parts_live, sum(s.outstanding.values())) == (0, 0, 0)


async def test_parts_are_chat_requests_with_the_items_verbatim() -> None:
    first, second = FakeEncoder(status=200), FakeEncoder(status=200)
    images = [_image(0, uuid="u0"), _image(1), _image(2)]
    audio = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    options = {"model": "m", "mm_processor_kwargs": None, "temperature": 0, "messages": ["ignored"]}
    async with serving(first) as a, serving(second) as b, \
            open_encoder_client(encoder_urls=[a, b], transfer_backend="inline") as client:
        stored = await client.encode_for_vllm({"image": images, "audio": audio}, options=options,
                                              req_id="r1")
        _clean(client)
    seen = first.seen + second.seen
    assert sorted(s.headers["x-request-id"] for s in seen) == ["r1:0", "r1:1", "r1:2"]
    sent = []
    for call in seen:
        assert call.path == "/v1/chat/completions"
        body = json.loads(call.raw)
        [message] = body.pop("messages")
        assert body == {"model": "m", "max_tokens": 1, "stream": False}
        sent.extend(message["content"])
    assert sorted(map(json.dumps, sent)) == sorted(map(json.dumps, images + audio))
    assert len(stored.ec_transfer_params) == 4 and len(stored.parts) == 3
    assert {p.encoder_url for p in stored.parts} == {a, b}


async def test_an_encoders_4xx_fails_the_request_with_its_status() -> None:
    refusing, willing = FakeEncoder(status=400), FakeEncoder(status=200)
    async with serving(refusing) as a, serving(willing) as b, \
            open_encoder_client(encoder_urls=[a, b], transfer_backend="inline") as client:
        with trio.fail_after(10), pytest.raises(RemoteEncodeError) as caught:
            await client.encode_for_vllm({"image": [_image(0), _image(1)]})
        _clean(client)
        assert client.statistics().retries == 0
    assert caught.value.status_code == 400 and caught.value.detail == "fake failure 400"
    assert caught.value.error_type == "FakeError"
    assert refusing.calls == 1 and willing.calls <= 1  # the refused part went nowhere else


async def test_a_5xx_a_dropped_connection_and_a_grpc_encoder_move_the_part() -> None:
    failing, willing = FakeEncoder(status=503), FakeEncoder(status=200)
    async with serving(failing) as a, closing_peer() as (b, dropped), serving(willing) as c:
        urls = [a, b, "grpc://127.0.0.1:1", c]
        async with open_encoder_client(encoder_urls=urls, transfer_backend="inline") as client:
            stored = await client.encode_for_vllm({"image": [_image(k) for k in range(4)]})
            _clean(client)
            retries = client.statistics().retries
    # Every part ends where it can be stored; none is sent twice to one encoder.
    assert willing.calls == 4 and {p.encoder_url for p in stored.parts} == {c}
    ids = [call.headers["x-request-id"] for call in failing.seen]
    assert 1 <= len(ids) == len(set(ids)) and 1 <= len(dropped) <= 4
    assert 3 <= retries <= 3 * 4


async def test_with_no_encoder_left_the_last_failure_counts() -> None:
    async with serving(FakeEncoder(status=500)) as a, \
            open_encoder_client(encoder_urls=[a], transfer_backend="inline") as client:
        with pytest.raises(RemoteEncodeError) as caught:
            await client.encode_for_vllm({"image": [_image(0)]})
    assert caught.value.status_code == 500
    async with closing_peer() as (b, _), \
            open_encoder_client(encoder_urls=[b], transfer_backend="inline") as client:
        with pytest.raises(PeerUnavailable, match="no encoder reachable"):
            await client.encode_for_vllm({"image": [_image(0)]})
        _clean(client)


async def test_a_deadline_closes_the_parts_calls() -> None:
    stuck = FakeEncoder(hang=True)
    async with serving(stuck) as a, \
            open_encoder_client(encoder_urls=[a], transfer_backend="inline") as client:
        with trio.fail_after(10), pytest.raises(EncodeTimeout):
            await client.encode_for_vllm({"image": [_image(0)]}, timeout=0.3)
        with trio.fail_after(5):
            await stuck.gone.wait()  # the call's connection closed: an encoder drops the work
        _clean(client)
        assert client.statistics().requests_failed == 1
