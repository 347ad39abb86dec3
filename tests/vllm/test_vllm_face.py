"""The vLLM face (``--api vllm``) without vLLM: its routes, errors, files and answers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file

from conftest import data_uri, png_bytes
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.delivery.vllm_storage import write_item
from epd_trio.encoder.server import serve_encoder
from epd_trio.engine import open_engine
from epd_trio.model.media import MediaLimits
from epd_trio.model.vllm_media import VllmMediaRules, hash_input
from epd_trio.protocol.vllm_hash import item_hash


def _ec(storage: Path) -> str:
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                       "ec_connector_extra_config": {"shared_storage_path": str(storage)}})


async def _serve(model: str, storage: Path, **overrides: Any) -> Any:
    return serve_encoder(EncoderConfig(port=0, api="vllm", ec_transfer_config=_ec(storage),
                                       engine=EngineConfig(model_path=model), **overrides))


def _image_part(seed: int = 0, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(png_bytes(56, 42, seed))}, **extra}


def _chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            "max_tokens": 1, **extra}


async def test_items_land_under_their_mm_hash_as_the_encoders_embeddings(
        checkpoints: dict[str, str], tmp_path: Path) -> None:
    """Qwen3-VL: the file's width is the embedding and its DeepStack levels side by side."""
    model = checkpoints["qwen3_vl"]
    images = [png_bytes(56, 42, 1), png_bytes(64, 32, 2)]
    body = _chat(*({"type": "image_url", "image_url": {"url": data_uri(d)}} for d in images))
    async with await _serve(model, tmp_path) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "r-1"})
        info = server.service.model_info
    assert response.status_code == 200, response.text
    answer = response.json()
    assert response.headers["x-request-id"] == "r-1" and answer["id"] == "chatcmpl-r-1"
    hashes = [item_hash(model, "image", hash_input("image", d, 0, MediaLimits(), VllmMediaRules()))
              for d in images]
    assert list(answer["ec_transfer_params"]) == hashes
    async with open_engine(model_path=model) as engine:
        for k, (data, mm_hash) in enumerate(zip(images, hashes)):
            expected = (await engine.encode([data], "image")).embedding
            stored = load_file(tmp_path / mm_hash / "encoder_cache.safetensors")["ec_cache"]
            assert stored.shape == expected.shape and stored.shape[1] == info.dim
            assert info.dim == sum(width for _, width in info.embedding_layout) > len(info.embedding_layout)
            assert torch.equal(stored, expected.cpu())
            entry = answer["ec_transfer_params"][mm_hash]
            assert entry["item_indices"] == [k] and len(entry["metadata"]["image_grid_thw"]) == 3
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"messages": []}, 400, "'messages' must be a non-empty list"),
    (_chat({"type": "image_embeds", "image_embeds": "x"}), 400, "is not accepted"),
    (_chat(_image_part(), stream=True), 400, "'stream' must be false"),
    (_chat(_image_part(), mm_processor_kwargs={"max_pixels": 1}), 400, "mm_processor_kwargs"),
    (_chat(_image_part(uuid="../up")), 400, "uuid"),
    (_chat(_image_part(), model="another-model"), 404, "The model `another-model` does not exist."),
    (_chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}), 400, "item 0"),
])
async def test_bad_requests_are_openai_errors(qwen25_path: str, tmp_path: Path, body: dict[str, Any],
                                              status: int, message: str) -> None:
    async with await _serve(qwen25_path, tmp_path) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        with trio.fail_after(30):
            response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert list(tmp_path.iterdir()) == []


async def test_models_health_profile_and_a_uuid_used_verbatim(qwen25_path: str, tmp_path: Path) -> None:
    async with await _serve(qwen25_path, tmp_path, served_model_name="tiny") as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["root"] == qwen25_path
        assert (await http.get("/health")).status_code == 200
        answer = await http.post("/v1/chat/completions", json=_chat(_image_part(uuid="item-7"), model="tiny"))
        assert answer.status_code == 200 and list(answer.json()["ec_transfer_params"]) == ["item-7"]
        assert (tmp_path / "item-7" / "encoder_cache.safetensors").is_file()
        assert (await http.post("/start_profile", json={})).status_code == 200
        assert (await http.post("/stop_profile")).status_code == 200
        assert (await http.get("/no-such-route")).json()["error"]["code"] == 404


def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError(5, "disk gone")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_item(tmp_path, "h1", torch.ones(3, 4))
    assert list((tmp_path / "h1").iterdir()) == []


def test_config_refuses_what_vllm_mode_cannot_serve() -> None:
    with pytest.raises(ValueError, match="--ec-transfer-config"):
        EncoderConfig(api="vllm")
    consumer = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer"})
    with pytest.raises(ValueError, match="ec_producer"):
        EncoderConfig(api="vllm", ec_transfer_config=consumer)
    with pytest.raises(ValueError, match="ec_connector"):
        EncoderConfig(api="vllm", ec_transfer_config=json.dumps({"ec_connector": "ECCPUConnector",
                                                                 "ec_role": "ec_producer"}))
    default = EncoderConfig(api="vllm", ec_transfer_config=json.dumps(
        {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}))
    assert default.vllm_storage_path == "/tmp"
