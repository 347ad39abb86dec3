"""Every family and modality through the real encoder (Hypercorn on port 0, ZMQ on
loopback) and the real receiver library: video extras on the wire, Qwen3-VL's
deepstack layout in ``/model_info``, a Qwen2-Audio encoder that probes with audio."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest
import torch

from conftest import png_bytes
from epd_trio.client import open_encoder_client
from epd_trio.model.samples import sample_tone, sample_video
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.transport.zmq import PullReceiver

# 2 s at 6 fps, and 2.5 s at 8 fps in another shape: their second_per_grid_ts differ.
VIDEO_A = sample_video(12, fps=6.0, width=56, height=56, seed=1)
VIDEO_B = sample_video(20, fps=8.0, width=84, height=56, seed=2)


def uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def body(req_id: str, modality: str, items: list[str], **kw: Any) -> dict[str, Any]:
    return {"req_id": req_id, "modality": modality, "mm_items": items, **kw}


async def test_video_extras_reach_inline_and_zmq_receivers(encoder_for: Any) -> None:
    videos = [uri(VIDEO_A, "video/mp4"), uri(VIDEO_B, "video/mp4")]
    async with encoder_for("qwen2_5_vl") as (server, http), PullReceiver() as pull:
        r = await http.post("/encode", json=body("inline", "video", videos))
        assert r.status_code == 200, r.text
        inline, meta = decode_safetensors(r.content)
        r = await http.post("/encode", json=body("zmq", "video", videos, deliver={
            "backend": "zmq", "endpoint": pull.last_endpoint}))
        assert r.status_code == 200, r.text
        answer = r.json()
        header, payload = await pull.receive()
        assert payload is not None
        pushed = payload.tensor()
        local = await server.service.engine.encode([VIDEO_A, VIDEO_B], "video")
    extras = local.extras
    assert set(extras) == {"second_per_grid_ts"} and len(set(extras["second_per_grid_ts"])) == 2
    assert meta["extras"] == header.extras == answer["extras"] == extras
    assert meta["grid_thw"] == header.grid_thw == answer["grid_thw"] == [list(g) for g in local.grid_thw]
    assert torch.equal(inline, local.embedding) and torch.equal(pushed, local.embedding)


async def test_video_and_audio_settings_reach_the_engine(encoder_for: Any) -> None:
    video = [uri(VIDEO_A, "video/mp4")]  # 12 frames over 2 s
    async with encoder_for("qwen2_5_vl", video_fps=4.0, max_video_seconds=2.2) as (_, http):
        r = await http.post("/encode", json=body("fps", "video", video, deliver={"backend": "inline"}))
        assert r.status_code == 200, r.text
        _, meta = decode_safetensors(r.content)
        r = await http.post("/encode", json=body("long", "video", [uri(VIDEO_B, "video/mp4")]))
        assert r.status_code == 413 and "2.2 s" in r.json()["error"]["message"], r.text
    # 4 fps over 2 s: 8 frames, 4 temporal steps of 2 frames, each 0.5 s (2 fps would be 1 s)
    assert meta["grid_thw"][0][0] == 4 and meta["extras"] == {"second_per_grid_ts": [0.5]}
    async with encoder_for("qwen2_audio", max_audio_seconds=1.0) as (_, http):
        r = await http.post("/encode", json=body("a", "audio", [uri(sample_tone(1.5), "audio/wav")]))
        assert r.status_code == 413 and "1 s" in r.json()["error"]["message"], r.text


async def test_qwen3_vl_reports_its_deepstack_layout_and_timestamps(encoder_for: Any) -> None:
    async with encoder_for("qwen3_vl") as (server, http), PullReceiver() as pull:
        info = (await http.get("/model_info")).json()
        r = await http.post("/encode", json=body("v", "video", [uri(VIDEO_A, "video/mp4")], deliver={
            "backend": "zmq", "endpoint": pull.last_endpoint}))
        assert r.status_code == 200, r.text
        header, payload = await pull.receive()
        assert payload is not None
        pushed = payload.tensor()
        local = await server.service.engine.encode([VIDEO_A], "video")
    assert info["model_type"] == "qwen3_vl" and info["dim"] == 3 * 40 == pushed.shape[1]
    assert info["embedding_layout"] == [{"name": "embedding", "width": 40},
                                        {"name": "deepstack_0", "width": 40},
                                        {"name": "deepstack_1", "width": 40}]
    assert "deepstack_1[40]" in info["embedding_description"]
    assert set(header.extras) == {"timestamps"} and header.extras == r.json()["extras"] == local.extras
    assert len(header.extras["timestamps"][0]) == header.grid_thw[0][0]  # one per temporal step
    assert torch.equal(pushed, local.embedding)


async def test_qwen2_audio_probes_with_audio_and_encodes_over_zmq(encoder_for: Any) -> None:
    tones = [sample_tone(0.8, hz=300.0), sample_tone(2.0, rate=22050, channels=2)]
    async with encoder_for("qwen2_audio") as (server, http), PullReceiver() as pull:
        health = await http.get("/health")
        info = (await http.get("/model_info")).json()
        r = await http.post("/encode", json=body("a", "audio", [uri(t, "audio/wav") for t in tones],
                                                 deliver={"backend": "zmq", "endpoint": pull.last_endpoint}))
        assert r.status_code == 200, r.text
        answer = r.json()
        header, payload = await pull.receive()
        assert payload is not None
        pushed = payload.tensor()
        local = await server.service.engine.encode(tones, "audio")
        image = await http.post("/encode", json=body("i", "image", [uri(png_bytes(56, 56), "image/png")]))
        stats = (await http.get("/stats")).json()
    assert health.status_code == 200, health.text
    assert health.json()["probed"] and "(audio)" in health.json()["detail"]
    assert stats["health"]["probe_modality"] == "audio" and stats["health"]["probe_failures"] == 0
    assert info["modalities"] == ["audio"] and info["embedding_layout"] == [{"name": "embedding", "width": 40}]
    assert answer["token_counts"] == header.token_counts == local.token_counts
    assert answer["grid_thw"] == header.grid_thw == []
    # each item's real mel-frame length (SGLang's audio grid): 100 frames a second at 16 kHz
    assert answer["extras"] == header.extras == local.extras == {"mel_frames": [80, 200]}
    assert torch.equal(pushed, local.embedding)
    assert image.status_code == 400 and "does not encode 'image'" in image.json()["error"]["message"]


async def test_client_stitches_images_and_videos_with_per_item_extras(encoder_for: Any) -> None:
    images = [png_bytes(56, 84, seed=5), png_bytes(112, 56, seed=6)]
    async with encoder_for("qwen2_5_vl") as (s0, _), encoder_for("qwen2_5_vl") as (s1, _), \
            open_encoder_client(encoder_urls=[s0.url, s1.url], pool_bytes=1 << 20) as client:
        async with await client.encode({"image": images, "video": [VIDEO_A, VIDEO_B]}) as result:
            got = {m: t.clone() for m, t in result.embeddings.items()}
            extras = {m: dict(e) for m, e in result.extras.items()}
            items = [(it.modality, it.index, it.grid_thw, dict(it.extras), it.embedding.clone())
                     for it in result.items]
            grids = dict(result.grid_thw)
            parts = [(p.modality, p.encoder_url, p.item_indices) for p in result.parts]
        engine = s0.service.engine
        singles = {("image", i): await engine.encode([x], "image") for i, x in enumerate(images)}
        singles |= {("video", i): await engine.encode([x], "video")
                    for i, x in enumerate([VIDEO_A, VIDEO_B])}
        stats = client.statistics()
    assert (stats.requests_live, stats.parts_live, stats.pool.slots) == (0, 0, 0)
    # modality-major parts, each modality split over both encoders: stitching is exercised
    assert sorted((m, idx) for m, _, idx in parts) == [
        ("image", (0,)), ("image", (1,)), ("video", (0,)), ("video", (1,))], parts
    for modality in ("image", "video"):
        assert {url for m, url, _ in parts if m == modality} == {s0.url, s1.url}, parts
    assert [(m, i) for m, i, *_ in items] == [("image", 0), ("image", 1), ("video", 0), ("video", 1)]
    videos = [singles["video", 0], singles["video", 1]]
    assert extras == {"video": {"second_per_grid_ts": [v.extras["second_per_grid_ts"][0] for v in videos]}}
    assert grids["video"] == [list(v.grid_thw[0]) for v in videos]
    for modality, index, grid, item_extras, emb in items:
        single = singles[modality, index]
        assert grid == tuple(single.grid_thw[0])
        assert item_extras == {k: v[0] for k, v in single.extras.items()}
        torch.testing.assert_close(emb, single.embedding, rtol=1e-4, atol=1e-5)
    for modality in ("image", "video"):
        expected = torch.cat([singles[modality, 0].embedding, singles[modality, 1].embedding])
        torch.testing.assert_close(got[modality], expected, rtol=1e-4, atol=1e-5)


async def test_a_mooncake_answer_carries_the_extras_before_the_forward(encoder_for: Any) -> None:
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra")
    async with encoder_for("qwen2_5_vl", transfer_backend="mooncake") as (server, http):
        r = await http.post("/encode", json=body("m", "video", [uri(VIDEO_B, "video/mp4")],
                                                 deliver={"backend": "mooncake"}))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (await http.post("/abort", json={"req_id": "m"})).json()["aborted"] == 1
        local = await server.service.engine.encode([VIDEO_B], "video")
    assert answer["extras"] == local.extras and answer["grid_thw"] == [list(g) for g in local.grid_thw]
    assert answer["nbytes"] == local.embedding.numel() * local.embedding.element_size()
