"""Pushing to vLLM 0.32's own ECMooncakeConnector consumer (its classes, stepped outside an engine).

The consumer runs in vLLM's venv (``vllm_ec_consumer.py``): vLLM's control
channel, reservation manager, registered CPU receive buffer, transfer engine
and scheduler-side connector, exactly as its engine builds them. The
producer is an epd_trio encoder (``--api vllm``, ``ECMooncakeConnector``,
Mooncake over TCP on loopback). Each test plays vLLM's EPD proxy: it posts the
items with ``ec_transfer_params`` (``consumer_zmq``, ``ec_items``) to the
encoder, then has the consumer step the request as vLLM's scheduler and
model runner do and load what arrived.

Success: what vLLM loads is the encoder's embedding, bit for bit (Qwen3-VL's
DeepStack width included; images, a video, an audio clip), every item of the
request under the ``transfer_id`` vLLM's producer would give it, an item
repeated is written once. Failure: whatever happens, nothing stays behind, on either side:
the encoder's statistics are quiescent and the consumer holds no reservation
and its receive buffer is whole again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file

from conftest import data_uri, png_bytes
from vllm_harness import VllmEnv, vllm_env  # noqa: F401  (the fixture)
from vllm_mooncake_kit import EcConsumer, ec_consumer, producer_config

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.engine import open_engine
from epd_trio.model.samples import sample_tone, sample_video
from epd_trio.protocol.vllm_ec import Reservation
from epd_trio.protocol.vllm_requests import ChatRequest, EcParams, transfer_ids
from epd_trio.testing import assert_quiescent
from epd_trio.transport.zmq_request import RequestSockets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def consumer(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EcConsumer]:
    with ec_consumer(vllm_env, tmp_path_factory.mktemp("logs") / "consumer.log") as running:
        yield running


async def _encoder(model: str, **overrides: Any) -> Any:
    settings: dict[str, Any] = {"ec_transfer_config": producer_config(), **overrides}
    return serve_encoder(EncoderConfig(port=0, api="vllm", engine=EngineConfig(model_path=model, dtype="float32"),
                                       **settings))


def _image(seed: int) -> tuple[bytes, dict[str, Any]]:
    data = png_bytes(56, 42, seed)
    return data, {"type": "image_url", "image_url": {"url": data_uri(data)}}


def _body(parts: list[dict[str, Any]], consumer: str, transfer_ids: list[str]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1,
            "ec_transfer_params": {"consumer_zmq": consumer,
                                   "ec_items": [{"transfer_id": t} for t in transfer_ids]}}


async def _load(consumer: EcConsumer, request_id: str, answer: dict[str, Any], modalities: list[str],
                transfer_ids: list[str], out: Path) -> dict[str, Any]:
    """The consumer steps the request whose items the encoder's answer names, in request order."""
    params = answer["ec_transfer_params"]
    by_index = {i: h for h, entry in params.items() for i in entry["item_indices"]}
    items = [{"mm_hash": by_index[i], "transfer_id": tid, "modality": modality,
              "tokens": _tokens(params[by_index[i]]["metadata"], modality)}
             for i, (modality, tid) in enumerate(zip(modalities, transfer_ids, strict=True))]
    return await trio.to_thread.run_sync(lambda: consumer.command(
        op="load", request_id=request_id, items=items, wait=30, out=str(out)))


def _tokens(metadata: dict[str, Any], modality: str) -> int:
    if modality == "audio":
        return metadata["audio_num_tokens"][0]
    t, h, w = metadata[f"{modality}_grid_thw"]
    return t * h * w // 4  # Qwen's 2x2 spatial merge


async def _expected(model: str, modality: str, data: bytes) -> torch.Tensor:
    async with open_engine(model_path=model, dtype="float32") as engine:
        return (await engine.encode([data], modality)).embedding.cpu()


async def _whole_again(consumer: EcConsumer) -> dict[str, Any]:
    stats = await trio.to_thread.run_sync(consumer.stats)
    assert stats["active"] == 0 and stats["writers"] == 0, stats
    return stats


async def _given_back(consumer: EcConsumer, transfer_id: str, before: dict[str, Any]) -> None:
    """The transfer ended cancelled on the consumer, and its memory is free again."""
    after = await _whole_again(consumer)
    assert after["states"][transfer_id] == "CANCELLED" and after["free_bytes"] == before["free_bytes"]


async def test_vllm_loads_our_embeddings_deepstack_width_and_a_repeated_item_once(
        checkpoints: dict[str, str], consumer: EcConsumer, tmp_path: Path) -> None:
    model = checkpoints["qwen3_vl"]
    (a, part_a), (b, part_b) = _image(1), _image(2)
    ids = ["q3-0", "q3-1", "q3-2"]
    async with await _encoder(model) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", headers={"x-request-id": "q3"},
                                   json=_body([part_a, part_b, part_a], consumer.control, ids))
        assert response.status_code == 200, response.text
        answer = response.json()
        loaded = await _load(consumer, "q3", answer, ["image"] * 3, ids, tmp_path)
        control = server.service.deliveries.vllm_control.statistics()
        info = server.service.model_info
        assert_quiescent({"service": server.service})
    hash_a, hash_b = answer["ec_transfer_params"]
    assert answer["ec_transfer_params"][hash_a]["item_indices"] == [0, 2]
    assert answer["ec_transfer_params"][hash_a]["transfer_id"] == "q3-2"  # the last, as vLLM's producer
    assert loaded == {"arrived": True, "waited": True, "ready": True, "loaded": sorted([hash_a, hash_b]),
                      "unavailable": []}
    for data, mm_hash in ((a, hash_a), (b, hash_b)):
        got = load_file(tmp_path / f"{mm_hash}.safetensors")["embedding"]
        expected = await _expected(model, "image", data)
        assert got.shape == expected.shape and got.shape[1] == info.dim  # with its DeepStack levels
        assert len(info.embedding_layout) > 1
        assert torch.equal(got, expected)
    assert (control.pushes, control.failed_pushes, control.abandoned) == (1, 0, 0)
    await _whole_again(consumer)


async def test_an_image_and_a_video_of_one_request_arrive_under_their_positional_ids(
        qwen25_path: str, consumer: EcConsumer, tmp_path: Path) -> None:
    image, image_part = _image(3)
    video = sample_video(8, 4.0, 64, 48, seed=4)
    video_part = {"type": "video_url", "video_url": {"url": data_uri(video)}}
    ids = ["mixed-video", "mixed-image"]
    async with await _encoder(qwen25_path) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", headers={"x-request-id": "mixed"},
                                   json=_body([video_part, image_part], consumer.control, ids))
        assert response.status_code == 200, response.text
        answer = response.json()
        loaded = await _load(consumer, "mixed", answer, ["video", "image"], ids, tmp_path)
        assert_quiescent({"service": server.service})
    hashes = {entry["transfer_id"]: h for h, entry in answer["ec_transfer_params"].items()}
    assert loaded["ready"] and loaded["loaded"] == sorted(hashes.values())
    for tid, modality, data in (("mixed-video", "video", video), ("mixed-image", "image", image)):
        got = load_file(tmp_path / f"{hashes[tid]}.safetensors")["embedding"]
        assert torch.equal(got, await _expected(qwen25_path, modality, data))
    await _whole_again(consumer)


async def test_an_audio_clip_arrives_as_the_encoders_embedding(
        checkpoints: dict[str, str], consumer: EcConsumer, tmp_path: Path) -> None:
    model, clip = checkpoints["qwen2_audio"], sample_tone(1.0)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    async with await _encoder(model) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", headers={"x-request-id": "clip"},
                                   json=_body([part], consumer.control, ["clip-0"]))
        assert response.status_code == 200, response.text
        answer = response.json()
        loaded = await _load(consumer, "clip", answer, ["audio"], ["clip-0"], tmp_path)
        assert_quiescent({"service": server.service})
    [mm_hash] = answer["ec_transfer_params"]
    assert loaded["ready"] and loaded["loaded"] == [mm_hash]
    got = load_file(tmp_path / f"{mm_hash}.safetensors")["embedding"]
    assert torch.equal(got, await _expected(model, "audio", clip))
    await _whole_again(consumer)


async def _post(server: Any, body: dict[str, Any], request_id: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        with trio.fail_after(60):  # never a hang
            return await http.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})


async def _released(service: Any) -> None:
    """The face answers first; the scope lets go of the consumer's memory right after."""
    with trio.fail_after(30):
        while service.registry.statistics().live_requests:
            await trio.sleep(0.05)
    assert_quiescent({"service": service})


def _finish(consumer: EcConsumer, request_id: str, transfer_id: str) -> None:
    """The consumer's request ended (vLLM's request_finished): it cancels its transfer."""
    consumer.command(op="finish", request_id=request_id,
                     items=[{"mm_hash": "unknown", "transfer_id": transfer_id, "modality": "image", "tokens": 1}])


async def test_a_transfer_the_consumer_cancelled_first_is_not_pushed(
        qwen25_path: str, consumer: EcConsumer) -> None:
    before = await _whole_again(consumer)
    await trio.to_thread.run_sync(_finish, consumer, "early", "early-0")
    async with await _encoder(qwen25_path) as server:
        response = await _post(server, _body([_image(4)[1]], consumer.control, ["early-0"]), "early")
        await _released(server.service)
        control = server.service.deliveries.vllm_control.statistics()
    assert response.status_code == 200, response.text  # as vLLM's producer: the consumer gave it up
    assert server.service.deliveries.mooncake.statistics().writes == 0
    assert (control.pushes, control.failed_pushes, control.abandoned) == (1, 0, 0)
    await _given_back(consumer, "early-0", before)


async def test_a_transfer_cancelled_while_it_is_written_is_completed_and_freed(
        qwen25_path: str, consumer: EcConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    before = await _whole_again(consumer)
    async with await _encoder(qwen25_path) as server:
        control = server.service.deliveries.vllm_control
        reserve = control.reserve

        async def reserve_then_cancel(shard: str, items: Any) -> Any:
            answers = await reserve(shard, items)
            await trio.to_thread.run_sync(_finish, consumer, "mid", "mid-0")
            return answers

        monkeypatch.setattr(control, "reserve", reserve_then_cancel)
        response = await _post(server, _body([_image(5)[1]], consumer.control, ["mid-0"]), "mid")
        await _released(server.service)
        writes = server.service.deliveries.mooncake.statistics().writes
    assert response.status_code == 200, response.text
    assert writes == 1 and control.statistics().abandoned == 0
    await _given_back(consumer, "mid-0", before)


def _misdirected(server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The encoder's control plane, its reservations pointing where nobody registered memory."""
    control = server.service.deliveries.vllm_control
    reserve = control.reserve

    async def reserve_elsewhere(shard: str, items: Any) -> Any:
        return [dataclasses.replace(r, address=r.address + (1 << 44)) if isinstance(r, Reservation) else r
                for r in await reserve(shard, items)]

    monkeypatch.setattr(control, "reserve", reserve_elsewhere)
    return control


async def test_a_failed_write_is_a_502_and_its_reservation_is_given_back(
        qwen25_path: str, consumer: EcConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    before = await _whole_again(consumer)
    async with await _encoder(qwen25_path) as server:
        control = _misdirected(server, monkeypatch)
        response = await _post(server, _body([_image(6)[1]], consumer.control, ["bad-0"]), "bad")
        await _released(server.service)
        stats = control.statistics()
    assert response.status_code == 502, response.text
    assert "mooncake write" in response.json()["error"]["message"]
    assert (stats.failed_pushes, stats.abandoned, stats.left_behind, stats.outstanding) == (1, 1, 0, 0)
    await _given_back(consumer, "bad-0", before)


async def test_a_reservation_a_stuck_write_may_still_land_in_is_left_to_the_consumer(
        qwen25_path: str, consumer: EcConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing it could let the bytes land in the next item the consumer puts there."""
    before = await _whole_again(consumer)
    async with await _encoder(qwen25_path) as server:
        control = _misdirected(server, monkeypatch)
        monkeypatch.setattr(server.service.deliveries.mooncake, "in_use", lambda region: True)  # a stuck write
        response = await _post(server, _body([_image(9)[1]], consumer.control, ["stuck-0"]), "stuck")
        await _released(server.service)
        stats = control.statistics()
    assert response.status_code == 502, response.text
    assert (stats.abandoned, stats.left_behind, stats.outstanding) == (0, 1, 0)
    held = await trio.to_thread.run_sync(consumer.stats)
    assert held["states"]["stuck-0"] == "WRITING" and held["active"] == 1
    async with RequestSockets() as sockets:  # the test's own clean-up, for the tests after it
        await sockets.request(consumer.control, {"op": "cancel", "transfer_id": "stuck-0", "reservation_id": "",
                                                 "abandon": True}, timeout=30)
    assert (await _whole_again(consumer))["free_bytes"] == before["free_bytes"]


async def test_a_push_over_the_send_timeout_is_a_504_and_gives_back_what_it_wrote(
        qwen25_path: str, consumer: EcConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    before = await _whole_again(consumer)
    async with await _encoder(qwen25_path, send_timeout=2.0) as server:
        control = server.service.deliveries.vllm_control

        async def never_completes(shard: str, done: Any) -> Any:
            await trio.sleep_forever()

        monkeypatch.setattr(control, "complete", never_completes)
        response = await _post(server, _body([_image(7)[1]], consumer.control, ["slow-0"]), "slow")
        await _released(server.service)
        stats, writes = control.statistics(), server.service.deliveries.mooncake.statistics().writes
    assert response.status_code == 504, response.text
    assert "took over 2 s" in response.json()["error"]["message"]
    assert (writes, stats.abandoned, stats.left_behind) == (1, 1, 0)
    await _given_back(consumer, "slow-0", before)


async def test_a_full_consumer_refuses_with_a_503_and_nothing_is_held(
        qwen25_path: str, consumer: EcConsumer) -> None:
    capacity = (await _whole_again(consumer))["capacity"]
    filler = {"transfer_id": "filler", "mm_hash": "filler", "nbytes": capacity, "shape": [capacity],
              "dtype": "uint8"}
    async with RequestSockets() as sockets, await _encoder(qwen25_path) as server:
        taken = await sockets.request(consumer.control, {"op": "reserve", **filler}, timeout=30)
        assert taken["ok"], taken  # the whole buffer: what it held before is evicted
        response = await _post(server, _body([_image(8)[1]], consumer.control, ["full-0"]), "full")
        await _released(server.service)
        stats = server.service.deliveries.vllm_control.statistics()
        await sockets.request(consumer.control, {"op": "cancel", "transfer_id": "filler",
                                                 "reservation_id": "", "abandon": True}, timeout=30)
    assert response.status_code == 503, response.text
    assert "EC consumer buffer pool is full" in response.json()["error"]["message"]
    assert (stats.failed_pushes, stats.outstanding, stats.abandoned) == (1, 0, 0)
    after = await _whole_again(consumer)
    assert after["free_bytes"] == capacity and "full-0" not in after["states"]


TRANSFER_ID_CASES = [
    ([], ["h0", "h1"]),
    ([{"transfer_id": "a"}, {"transfer_id": "b"}], ["h0", "h1"]),
    ([{"transfer_id": "a", "mm_hash": "h1"}, {"transfer_id": "b", "mm_hash": "h0"}], ["h0", "h1"]),
    ([{"transfer_id": "a", "mm_hash": "other"}], ["h0", "h1"]),
    ([{"transfer_id": "a"}], ["h0", "h0"]),
    ([{"transfer_id": "a", "mm_hash": "h0"}, {"transfer_id": "b", "mm_hash": "h0"}], ["h0", "h0"]),
]
RESOLVE_WITH_VLLM = """
import json, sys
from types import SimpleNamespace
from vllm.distributed.ec_transfer.ec_connector.mooncake.scheduler import ECMooncakeScheduler
out = []
for items, hashes in json.load(sys.stdin):
    req = SimpleNamespace(request_id="r", ec_transfer_params={"ec_items": items},
                          mm_features=[SimpleNamespace(identifier=h) for h in hashes])
    out.append([ECMooncakeScheduler._request_transfer_id(req, i) or f"r:{i}" for i in range(len(hashes))])
print(json.dumps(out))
"""


def test_items_get_the_transfer_ids_vllms_producer_gives_them(vllm_env: VllmEnv) -> None:
    done = subprocess.run([str(vllm_env.python), "-c", RESOLVE_WITH_VLLM], input=json.dumps(TRANSFER_ID_CASES),
                          capture_output=True, text=True, env=vllm_env.environ(), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for (items, hashes), theirs in zip(TRANSFER_ID_CASES, json.loads(done.stdout), strict=True):
        chat = ChatRequest("r", None, (), EcParams(None, tuple((i.get("mm_hash"), i["transfer_id"])
                                                               for i in items)))
        assert [tid for tid, _ in transfer_ids(chat, hashes)] == theirs, (items, hashes)
