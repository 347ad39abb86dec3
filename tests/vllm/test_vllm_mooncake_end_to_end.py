"""A real vLLM 0.32 server generates from embeddings epd_trio pushed over Mooncake (ECMooncakeConnector).

One vLLM server, an EC consumer with ``ECMooncakeConnector`` (a CPU receive
buffer, Mooncake over TCP, ``--enable-mm-embeds``), and one epd_trio encoder
(``--api vllm``, ``ECMooncakeConnector`` producer) serve the module. Each test
plays vLLM's EPD proxy as it runs with a Mooncake consumer: the item alone,
with ``ec_transfer_params`` (the consumer's control address, a fresh
``transfer_id``), to the encoder; then the request to vLLM with the item
rewritten to its metadata only (``image_embeds`` / ``video_embeds``: the grid
the encoder reported, the ``mm_hash`` as its uuid) and ``ec_items`` naming
the transfer. Such a request carries no media: vLLM can only generate from
the embedding that was pushed (without it, it fails the request once its
``push_wait_timeout_s`` has passed), so equal greedy tokens to the same
request served by vLLM alone prove the push was used and right.

A Mooncake consumer serves no multimodal request without a push (it waits for
one even when the media is in the request), so the reference comes from a
vLLM server of its own that runs its own encoder: started first, asked once
per modality, stopped before the consumer starts (one ~4 GB server at a time).

vLLM's CPU build runs its V1 model runner (V2 needs Triton), which calls the
EC connector only on steps that run a forward: a request whose only work is
waiting for a pushed item is never loaded, and fails once
``push_wait_timeout_s`` has passed (V2, on GPUs, also runs the connector on
empty steps). So each request runs beside a text request that keeps vLLM
stepping, the reference too.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from conftest import data_uri, png_bytes
from vllm_harness import VllmEnv, VllmServer, free_port, vllm_consumer, vllm_env  # noqa: F401  (the fixture)
from vllm_mooncake_kit import consumer_config, producer_config

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.model.samples import sample_video
from epd_trio.model.tiny import make_tiny_model, servable_spec
from epd_trio.testing import assert_quiescent

pytestmark = pytest.mark.slow
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("servable") / "qwen2_5_vl", servable_spec(seed=3)))


PARTS = {
    "image": {"type": "image_url", "image_url": {"url": data_uri(png_bytes(90, 60, seed=21))}},
    "video": {"type": "video_url", "video_url": {"url": data_uri(sample_video(8, 4.0, 64, 48, seed=4))}},
}


@pytest.fixture(scope="module")
def control_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def reference(vllm_env: VllmEnv, model: str,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy tokens of vLLM alone: a shared-storage consumer with nothing stored encodes each item itself."""
    empty, logs = tmp_path_factory.mktemp("nothing-stored"), tmp_path_factory.mktemp("logs")
    with vllm_consumer(vllm_env, model, empty, logs / "vllm-alone.log") as alone:
        return {modality: trio.run(_beside_busy, alone, _request(part)) for modality, part in PARTS.items()}


async def _beside_busy(vllm: VllmServer, body: dict[str, Any]) -> list[int]:
    """``body``'s greedy tokens, generated while a text request keeps vLLM stepping (cancelled after)."""
    busy = {"model": vllm.model, "messages": [{"role": "user", "content": "count"}], "max_tokens": 1900,
            "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=vllm.url, timeout=180) as http, trio.open_nursery() as nursery:
        nursery.start_soon(partial(http.post, "/v1/chat/completions", json=busy))
        await trio.sleep(1.0)  # scheduled and decoding
        response = await http.post("/v1/chat/completions", json={"model": vllm.model, **body})
        nursery.cancel_scope.cancel()  # the client leaves: vLLM aborts it
    assert response.status_code == 200, response.text
    return _tokens(response.json())


@pytest.fixture(scope="module")
def vllm(vllm_env: VllmEnv, model: str, control_port: int, reference: dict[str, list[int]],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    with vllm_consumer(vllm_env, model, None, log, ec=consumer_config(control_port, 64 << 20),
                       args=("--enable-mm-embeds",)) as server:
        yield server


@pytest.fixture
async def encoder(model: str) -> AsyncIterator[Any]:
    config = EncoderConfig(port=0, api="vllm", ec_transfer_config=producer_config(),
                           engine=EngineConfig(model_path=model, dtype="float32"))
    async with serve_encoder(config) as server:
        yield server


def _request(part: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "describe it"}]}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}


def _tokens(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == TOKENS
    return ids


@pytest.mark.parametrize("modality", list(PARTS))
async def test_vllm_generates_the_same_tokens_from_embeddings_pushed_over_mooncake(
        modality: str, vllm: VllmServer, encoder: Any, control_port: int,
        reference: dict[str, list[int]]) -> None:
    part = PARTS[modality]
    transfer_id = f"epd-{modality}-0"
    primer = {"model": vllm.model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1,
              "ec_transfer_params": {"consumer_zmq": f"tcp://127.0.0.1:{control_port}",
                                     "ec_items": [{"transfer_id": transfer_id}]}}
    async with httpx.AsyncClient(base_url=encoder.url, timeout=120) as http:
        response = await http.post("/v1/chat/completions", json=primer, headers={"x-request-id": transfer_id})
    assert response.status_code == 200, response.text
    [(mm_hash, reported)] = response.json()["ec_transfer_params"].items()
    assert reported["transfer_id"] == transfer_id
    embeds = f"{modality}_embeds"
    rewritten = {"type": embeds, embeds: reported["metadata"], "uuid": mm_hash}
    tokens = await _beside_busy(vllm, _request(
        rewritten, ec_transfer_params={"ec_items": [{"mm_hash": mm_hash, "transfer_id": transfer_id}]}))
    assert tokens == reference[modality]
    assert_quiescent({"service": encoder.service})
