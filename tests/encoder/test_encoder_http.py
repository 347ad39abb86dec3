"""The encoder over real HTTP (its HTTP server on port 0) and real ZMQ on loopback."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformers
import trio

from conftest import data_uri, image_uri, png_bytes, random_image
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.transport.zmq import PullReceiver


async def stats(http: Any) -> dict[str, Any]:
    return (await http.get("/stats")).json()


async def wait_live(http: Any, count: int, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while (await stats(http))["live_requests"] != count:
            await trio.sleep(0.01)


def solid_uri(width: int, height: int) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return data_uri(buf.getvalue())


def encode_body(req_id: str = "r1", **kw: Any) -> dict[str, Any]:
    return {"req_id": req_id, "modality": "image", "mm_items": [image_uri()], **kw}


@pytest.fixture
def short_error_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed scope's final error notice to a receiver that never reads waits out
    min(send_timeout, 5 s) before the scope is released: 0.1 s here, not a wait."""
    monkeypatch.setattr("epd_trio.encoder.service._ERROR_NOTICE_TIMEOUT", 0.1)


async def test_inline_and_zmq_equal_the_engine_and_transformers(encoder: Any, qwen25_path: str) -> None:
    image = png_bytes(120, 90, seed=3)
    async with encoder() as (server, http), PullReceiver() as pull:
        r = await http.post("/encode", json=encode_body(mm_items=[data_uri(image)], num_parts=2, part_idx=1))
        assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
        inline, meta = decode_safetensors(r.content)
        assert (meta["req_id"], meta["part_idx"], meta["num_parts"]) == ("r1", 1, 2)
        zmq_body = encode_body("r2", mm_items=[data_uri(image)],
                               deliver={"backend": "zmq", "endpoint": pull.last_endpoint})
        r = await http.post("/encode", json=zmq_body)
        assert r.status_code == 200, r.text
        info = r.json()
        header, payload = await pull.receive()
        assert payload is not None
        pushed = payload.tensor()
        local = await server.service.engine.encode([image])
    assert header.req_id == "r2" and header.kind == "embedding"
    assert info["tokens"] == pushed.shape[0] == sum(info["token_counts"]) and info["dim"] == pushed.shape[1]
    assert info["grid_thw"] == [list(g) for g in local.grid_thw] == meta["grid_thw"]
    assert torch.equal(inline, local.embedding) and torch.equal(pushed, local.embedding)
    model = transformers.AutoModelForImageTextToText.from_pretrained(qwen25_path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(qwen25_path)
    inputs = processor(images=[random_image(120, 90, seed=3)], return_tensors="pt")
    with torch.inference_mode():
        (ref,) = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert ((inline - ref).norm() / ref.norm()).item() < 1e-4


BAD = [
    ("invalid json", b"{not json", 400, "not valid JSON", None),
    ("not an object", b"[1, 2]", 400, "must be a JSON object", None),
    ("missing req_id", {"modality": "image", "mm_items": ["x"]}, 400, "'req_id'", None),
    ("mistyped part_idx", encode_body(part_idx="0"), 400, "'part_idx' must be an integer", "r1"),
    ("bool is not an int", encode_body(num_parts=True), 400, "'num_parts' must be an integer", "r1"),
    ("part_idx out of range", encode_body(part_idx=2, num_parts=2), 400, "part_idx < num_parts", "r1"),
    ("unknown modality", encode_body(modality="smell"), 400, "'modality' must be one of", "r1"),
    ("unsupported modality", encode_body(modality="audio"), 400, "does not encode 'audio'", "r1"),
    ("empty mm_items", encode_body(mm_items=[]), 400, "non-empty list", "r1"),
    ("item of a wrong type", encode_body(mm_items=[7]), 400, "item 0: must be a string", "r1"),
    ("undecodable base64", encode_body(mm_items=["data:image/png;base64,!!!"]), 400, "item 0: undecodable", "r1"),
    ("not an image", encode_body(mm_items=[image_uri(), data_uri(b"plain text")]), 400,
     "item 1: bytes are not an image", "r1"),
    ("over the pixel cap", encode_body(mm_items=[solid_uri(400, 400)]), 413, "item 0: image is 400x400", "r1"),
    ("zmq endpoint not tcp/ipc", encode_body(deliver={"backend": "zmq", "endpoint": "http://x:1"}), 400,
     "tcp://host:port or ipc://path", "r1"),
    ("zmq port out of range", encode_body(deliver={"backend": "zmq", "endpoint": "tcp://h:70000"}), 400,
     "bad port", "r1"),
    ("unknown backend", encode_body(deliver={"backend": "carrier-pigeon"}), 400, "deliver.backend", "r1"),
    ("local path without media root", encode_body(mm_items=["/etc/hostname"]), 400, "local paths", "r1"),
    ("body over the size limit", encode_body(mm_items=["data:image/png;base64," + "A" * 300_000]), 413,
     "over the size limit", None),
]


async def test_bad_input_gets_a_clear_4xx_and_nothing_is_lost(encoder: Any) -> None:
    async with encoder(max_image_pixels=100_000, max_body_bytes=200_000) as (_server, http):
        for name, body, status, message, req_id in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post("/encode", content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (name, r.text)
            error = r.json()
            assert set(error) == {"error", "req_id"} and set(error["error"]) == {"type", "message"}, name
            assert message in error["error"]["message"], (name, error)
            assert error["req_id"] == req_id, name
        assert (await http.get("/health")).status_code == 200
        after = await stats(http)
        ok = await http.post("/encode", json=encode_body("fine"))
    assert after["live_requests"] == 0 and after["engine"]["admitted"] == 0
    assert ok.status_code == 200


async def test_failed_encode_still_delivers_an_error_message(encoder: Any) -> None:
    async with encoder() as (_, http), PullReceiver() as pull:
        body = encode_body(mm_items=[data_uri(b"junk")], num_parts=3, part_idx=2,
                           deliver={"backend": "zmq", "endpoint": pull.last_endpoint})
        r = await http.post("/encode", json=body)
        with trio.fail_after(5):
            header, tensor = await pull.receive()
    assert r.status_code == 400
    assert header.kind == "error" and tensor is None and (header.req_id, header.part_idx) == ("r1", 2)
    assert header.error is not None and header.error.status == 400 and "item 0" in header.error.message


async def test_duplicate_live_request_and_abort(encoder: Any, short_error_notices: None) -> None:
    # Nobody listens on this endpoint: the request stays live in its send.
    stuck = encode_body("dup", deliver={"backend": "zmq", "endpoint": "tcp://127.0.0.1:9"})
    async with encoder(send_timeout=30) as (_, http):
        answers: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            async def post(name: str, body: dict[str, Any]) -> None:
                answers[name] = await http.post("/encode", json=body)

            nursery.start_soon(post, "first", stuck)
            await wait_live(http, 1)
            dup = await http.post("/encode", json=stuck)
            # another part of the same request may be live on the same encoder
            nursery.start_soon(post, "other_part", {**stuck, "num_parts": 2, "part_idx": 1})
            await wait_live(http, 2)
            aborted = await http.post("/abort", json={"req_id": "dup"})
        # answered at once; released once the (bounded) error notice to the
        # silent receiver has been tried
        await wait_live(http, 0)
        unknown = await http.post("/abort", json={"req_id": "dup"})
        final = await stats(http)
    assert dup.status_code == 409 and "already live" in dup.json()["error"]["message"]
    assert aborted.status_code == 200 and aborted.json()["aborted"] == 2
    for name in ("first", "other_part"):
        assert answers[name].status_code == 499 and answers[name].json()["error"]["type"] == "AbortedError"
    assert unknown.status_code == 404
    assert final["live_requests"] == 0 and final["registry"]["aborted"] == 2


async def test_vanished_receiver_times_out_and_releases(encoder: Any, short_error_notices: None) -> None:
    async with encoder(send_timeout=0.5) as (_, http):
        async with PullReceiver() as pull:
            endpoint = pull.last_endpoint
        r = await http.post("/encode", json=encode_body(deliver={"backend": "zmq", "endpoint": endpoint}))
        await wait_live(http, 0)  # after the bounded error notice
        final = await stats(http)
    assert r.status_code == 504 and r.json()["error"]["type"] == "TransferTimeout"
    assert final["live_requests"] == 0 and final["zmq"]["send_timeouts"] >= 1


@pytest.mark.parametrize("server", ["builtin", "hypercorn"])
async def test_client_disconnect_cancels_the_scope(encoder: Any, short_error_notices: None, server: str) -> None:
    """``/encode`` watches its client in its own task (``until_gone``), under either server."""
    stuck = encode_body("gone", deliver={"backend": "zmq", "endpoint": "tcp://127.0.0.1:9"})
    async with encoder(send_timeout=2, http_server=server) as (_, http):
        import httpx

        with pytest.raises(httpx.ReadTimeout):
            await http.post("/encode", json=stuck, timeout=0.5)
        await wait_live(http, 0)
        final = await stats(http)
    assert final["registry"]["aborted"] == 1


async def test_request_deadline_is_a_504(encoder: Any, short_error_notices: None) -> None:
    stuck = encode_body("late", deliver={"backend": "zmq", "endpoint": "tcp://127.0.0.1:9"})
    async with encoder(send_timeout=2, request_timeout=0.5) as (_, http):
        r = await http.post("/encode", json=stuck)
        await wait_live(http, 0)
        final = await stats(http)
    assert r.status_code == 504 and r.json()["error"]["type"] == "DeadlineExceeded"
    assert final["live_requests"] == 0


async def test_health_probe_and_its_failure(encoder: Any) -> None:
    async with encoder() as (_, http):
        r = await http.get("/health")
        assert r.status_code == 200 and r.json()["probed"] is True
        r = await http.get("/health")  # a batch just completed: no second probe
        assert r.status_code == 200 and r.json()["probed"] is False
    async with encoder(health_timeout=1e-6) as (_, http):
        r = await http.get("/health")
        s = await stats(http)
    assert r.status_code == 503 and "HEALTH_CHECK" in r.json()["detail"]
    assert s["health"]["probe_failures"] == 1


async def test_model_info_and_stats(encoder: Any) -> None:
    async with encoder(max_batch_size=3) as (_, http):
        info = (await http.get("/model_info")).json()
        await http.post("/encode", json=encode_body())
        s = await stats(http)
    assert info["model_type"] == "qwen2_5_vl" and info["modalities"] == ["image", "video"]
    assert info["max_batch_size"] == 3 and info["dim"] == 40 and info["version"]
    for key in ("live_requests", "queued", "requests_done", "batches_run", "errors"):
        assert key in s
    assert s["requests_done"] == 1 and s["batches_run"] == 1 and s["errors"] == 0


async def test_graceful_shutdown_finishes_in_flight_and_refuses_new(encoder: Any) -> None:
    big = encode_body(mm_items=[image_uri(900, 900, seed=i) for i in range(3)])
    results: dict[str, Any] = {}
    async with encoder() as (server, http):
        async with trio.open_nursery() as nursery:
            async def call(name: str, body: dict[str, Any]) -> None:
                results[name] = await http.post("/encode", json=body)

            for i in range(3):
                nursery.start_soon(call, f"inflight{i}", {**big, "req_id": f"big{i}"})
            await wait_live(http, 3)
            drain = trio.Event()

            async def drain_service() -> None:
                await server.service.drain()
                drain.set()

            nursery.start_soon(drain_service)
            with trio.fail_after(10):  # the drain has begun: /stats says so
                while not (await stats(http))["draining"]:
                    await trio.sleep(0.01)
            results["new"] = await http.post("/encode", json=encode_body("late"))
            results["health"] = await http.get("/health")
            await drain.wait()
    assert all(results[f"inflight{i}"].status_code == 200 for i in range(3))
    assert results["new"].status_code == 503 and results["health"].status_code == 503


async def test_hypercorn_serves_the_same_answers(encoder: Any) -> None:
    """``--http-server hypercorn``, the other server: the same embedding, errors and limits."""
    answers = {}
    for server in ("builtin", "hypercorn"):
        async with encoder(http_server=server, max_body_bytes=200_000) as (_, http):
            ok = await http.post("/encode", json=encode_body("same"))
            bad = await http.post("/encode", json=encode_body(mm_items=[data_uri(b"junk")]))
            big = await http.post("/encode", content=b"x" * 300_000)
            missing = await http.get("/nowhere")
            assert (ok.status_code, bad.status_code, big.status_code, missing.status_code) == (200, 400, 413, 404)
            assert big.headers["connection"] == "close"
            answers[server] = decode_safetensors(ok.content)[0]
    assert torch.equal(answers["builtin"], answers["hypercorn"])
