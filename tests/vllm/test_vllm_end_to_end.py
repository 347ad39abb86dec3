"""A real vLLM 0.32 server generates from epd_trio's embeddings (shared storage, ECExampleConnector).

One vLLM server (an EC consumer on a shared directory) and one epd_trio
encoder (``--api vllm``, an EC producer on the same directory) serve the
module. Each test plays vLLM's EPD proxy: it posts the item, text removed, to
the encoder's ``/v1/chat/completions``, waits for 200, then sends the original
request to vLLM. The reference is the same request with a ``uuid`` on the part
that no file answers to: vLLM then runs its own encoder (a different name, so
no cache of vLLM's can answer for the other run). Greedy tokens must be
equal, vLLM's log must say it loaded our file, and all-zero embeddings under
another name must change the tokens.

Audio is ``test_vllm_proxy_audio.py`` (vLLM's CPU build serves Qwen2-Audio, from
a server of its own); the audio hash is checked against vLLM's own hasher in
``test_vllm_hash.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from conftest import data_uri, png_bytes
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.model.samples import sample_video
from epd_trio.model.tiny import make_tiny_model, servable_spec
from vllm_harness import VllmServer, storage, vllm, vllm_env  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.slow
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("servable") / "qwen2_5_vl", servable_spec(seed=3)))


async def _encoder(model: str, storage: Path) -> Any:
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
          "ec_connector_extra_config": {"shared_storage_path": str(storage)}}
    config = EncoderConfig(port=0, api="vllm", ec_transfer_config=json.dumps(ec),
                           engine=EngineConfig(model_path=model, dtype="float32"))
    return serve_encoder(config)


def _request(part: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "describe it"}]}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def _tokens(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == TOKENS
    return ids


async def _as_proxy(http: httpx.AsyncClient, vllm: VllmServer, part: dict[str, Any],
                    request_id: str) -> dict[str, Any]:
    """vLLM's EPD proxy: the item alone to the encoder (200 awaited), then the request to vLLM."""
    primer = {"model": vllm.model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1,
              "stream": False}
    response = await http.post("/v1/chat/completions", json=primer, headers={"x-request-id": request_id})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
async def encoder(model: str, storage: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with await _encoder(model, storage) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        yield http


@pytest.mark.parametrize("modality", ["image", "video"])
async def test_vllm_generates_the_same_tokens_from_our_embeddings(
        modality: str, vllm: VllmServer, encoder: httpx.AsyncClient, storage: Path) -> None:
    if modality == "image":
        media = {"type": "image_url", "image_url": {"url": data_uri(png_bytes(90, 60, seed=21))}}
    else:
        media = {"type": "video_url", "video_url": {"url": data_uri(sample_video(8, 4.0, 64, 48, seed=4))}}
    reference = await trio.to_thread.run_sync(vllm.chat, _request({**media, "uuid": f"reference-{modality}"}))
    produced = await _as_proxy(encoder, vllm, media, f"epd-{modality}:0:1")
    [mm_hash] = produced["ec_transfer_params"]
    written = storage / mm_hash / "encoder_cache.safetensors"
    assert written.is_file()
    answer = await trio.to_thread.run_sync(vllm.chat, _request(media))
    assert _tokens(answer) == _tokens(reference)
    assert f"Success load encoder cache for hash {mm_hash}" in vllm.log_text()
    # The same file under another name, zeroed: vLLM uses what it loads, so the tokens change.
    zeros = {"ec_cache": torch.zeros_like(load_file(written)["ec_cache"])}
    (storage / f"zeros-{modality}").mkdir()
    save_file(zeros, storage / f"zeros-{modality}" / "encoder_cache.safetensors")
    zeroed = await trio.to_thread.run_sync(vllm.chat, _request({**media, "uuid": f"zeros-{modality}"}))
    assert _tokens(zeroed) != _tokens(reference)


async def test_a_bad_item_is_a_4xx_at_once_and_nothing_is_written(
        vllm: VllmServer, encoder: httpx.AsyncClient, storage: Path) -> None:
    before = set(storage.iterdir())
    part = {"type": "image_url", "image_url": {"url": data_uri(b"not an image at all")}}
    primer = {"model": vllm.model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    with trio.fail_after(10):
        response = await encoder.post("/v1/chat/completions", json=primer)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400
    assert "not an image" in response.json()["error"]["message"]
    assert set(storage.iterdir()) == before
