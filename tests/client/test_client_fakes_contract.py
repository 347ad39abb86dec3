"""The client tests' fake encoders speak the real encoder's format.

``client_fakes.FakeEncoders`` stands in for encoders in the client tests; if its
answers drifted from a real encoder's (a field missing, a type changed), those
tests would prove nothing about real encoders. Here the same ``/encode`` goes to
a real encoder (Hypercorn on port 0, ZMQ on loopback) and to a fake: both HTTP
answers and both ZMQ headers must have the same fields and value types, and
both must pass the protocol's parser and the client's own answer checks.
"""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio

from client_fakes import Behaviour, FakeEncoders
from conftest import png_bytes
from epd_trio.client.answers import (
    check_message,
    check_sized_meta,
    http_error,
    inline_message,
    parse_meta,
    parse_sized_meta,
)
from epd_trio.errors import RequestError
from epd_trio.model.samples import sample_tone, sample_video
from epd_trio.protocol import EmbeddingHeader, header_to_map
from epd_trio.transport import PullReceiver, PushSocketCache

FAKE = "http://127.0.0.10:8000"  # loopback: finding the route to it asks no resolver
REQ_ID, PART, PARTS = "contract", 1, 2
CASES = {
    "image": ("qwen2_5_vl", [(png_bytes(56, 56, seed=1), "image/png"), (png_bytes(84, 56, seed=2), "image/png")]),
    "video": ("qwen2_5_vl", [(sample_video(8, fps=4.0, width=56, height=56, seed=1), "video/mp4"),
                             (sample_video(12, fps=6.0, width=56, height=56, seed=2), "video/mp4")]),
    "audio": ("qwen2_audio", [(sample_tone(0.8, hz=300.0), "audio/wav"), (sample_tone(1.5), "audio/wav")]),
}


def shape(value: Any) -> Any:
    """The structure of a JSON value: its keys and value types, not its values."""
    if isinstance(value, dict):
        return {key: shape(sub) for key, sub in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return sorted({repr(shape(sub)) for sub in value})
    return type(value).__name__


def encode_body(modality: str, **deliver: Any) -> dict[str, Any]:
    items = [f"data:{mime};base64,{base64.b64encode(data).decode()}" for data, mime in CASES[modality][1]]
    return {"req_id": REQ_ID, "part_idx": PART, "num_parts": PARTS, "modality": modality,
            "mm_items": items, "deliver": deliver or {"backend": "inline"}}


async def zmq_answer(http: httpx.AsyncClient, pull: PullReceiver,
                     body: dict[str, Any]) -> tuple[httpx.Response, EmbeddingHeader]:
    response = await http.post("/encode", json=body)
    assert response.status_code == 200, response.text
    with trio.fail_after(30):
        header, payload = await pull.receive()
    assert payload is not None and header.req_id == REQ_ID
    return response, header


@pytest.mark.parametrize("modality", sorted(CASES))
async def test_the_fakes_answers_have_the_real_encoders_shape(encoder_for: Any, modality: str) -> None:
    async with encoder_for(CASES[modality][0]) as (_, http), PullReceiver() as pull, \
            PushSocketCache() as push:
        fakes = FakeEncoders(push, {FAKE: Behaviour()})
        body = encode_body(modality, backend="zmq", endpoint=pull.last_endpoint)
        async with httpx.AsyncClient(transport=fakes.transport(), base_url=FAKE) as fake_http:
            real = await zmq_answer(http, pull, body)
            fake = await zmq_answer(fake_http, pull, body)
    items = len(body["mm_items"])
    for url, (response, header) in {"real": real, "fake": fake}.items():
        check_message(header, parse_meta(response, REQ_ID, PART, PARTS), modality, items, url)
    assert shape(fake[0].json()) == shape(real[0].json())
    assert shape(header_to_map(fake[1])) == shape(header_to_map(real[1]))
    if modality == "video":  # the field the fakes once left out
        assert "extras" in real[0].json() and "extras" in fake[0].json()


async def test_the_fakes_error_answer_has_the_real_encoders_shape(encoder: Any) -> None:
    junk = "data:image/png;base64," + base64.b64encode(b"junk").decode()
    async with encoder() as (_, http), PullReceiver() as pull, PushSocketCache() as push:
        body = {**encode_body("image", backend="zmq", endpoint=pull.last_endpoint), "mm_items": [junk]}
        fakes = FakeEncoders(push, {FAKE: Behaviour("error")})
        async with httpx.AsyncClient(transport=fakes.transport(), base_url=FAKE) as fake_http:
            real, fake = await http.post("/encode", json=body), await fake_http.post("/encode", json=body)
        with trio.fail_after(30):
            notice, payload = await pull.receive()  # the real encoder also tells the receiver
    assert real.status_code == fake.status_code == RequestError.status_code
    assert shape(fake.json()) == shape(real.json())
    errors = [http_error(r, REQ_ID, url, PART) for url, r in (("real", real), ("fake", fake))]
    assert [(e.status_code, e.error_type) for e in errors] == [(400, "RequestError")] * 2
    assert payload is None and notice.error is not None and notice.error.type == "RequestError"


async def test_every_backends_answer_passes_the_clients_checks(encoder: Any) -> None:
    """The fakes deliver over ZMQ only; the real inline and Mooncake answers must pass the
    client's checks too, and Mooncake's be the ZMQ answer's shape plus ``nbytes``."""
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra")
    items = len(CASES["image"][1])
    async with encoder(transfer_backend="mooncake") as (_, http), PullReceiver() as pull:
        inline = await http.post("/encode", json=encode_body("image"))
        zmq, _ = await zmq_answer(http, pull, encode_body("image", backend="zmq", endpoint=pull.last_endpoint))
        mooncake = await http.post("/encode", json={**encode_body("image", backend="mooncake"), "req_id": "m"})
        assert (await http.post("/abort", json={"req_id": "m"})).status_code == 200
    part = SimpleNamespace(part_idx=PART, modality="image", item_indices=tuple(range(items)))
    meta, nbytes = parse_sized_meta(mooncake, "m", PART, PARTS)
    check_sized_meta(meta, nbytes, "image", items, "real")
    header, payload = inline_message(inline, REQ_ID, part, PARTS, "real")
    assert list(header.shape) == list(payload.tensor().shape) and header.token_counts == meta.token_counts
    assert shape(mooncake.json()) == {**shape(zmq.json()), "nbytes": "int"}
