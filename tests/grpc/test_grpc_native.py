"""``epd_trio.v1.Encoder`` end to end with the standard grpcio client: every delivery (inline,
ZMQ to real PULL sockets, Mooncake over a real TCP TransferEngine), every modality, abort and
model info, each checked against what the HTTP face answers for the same item."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch
import trio

from conftest import data_uri, png_bytes
from epd_trio.model.samples import sample_tone, sample_video
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.grpc_messages import encode_body, meta_from_message
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc
from epd_trio.protocol.requests import parse_encode_request
from epd_trio.transport.zmq import PullReceiver

VIDEO = sample_video(12, fps=6.0, width=56, height=56, seed=1)


def uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def rpc(server: Any, method: str, message: Any, *, metadata: tuple[tuple[str, str], ...] = (),
              timeout: float = 60.0) -> Any:
    """One call on a fresh grpcio channel in a worker thread: the answer, or the ``RpcError``."""
    target = server.grpc.url.removeprefix("grpc://")

    def call() -> Any:
        with grpc.insecure_channel(target) as channel:
            try:
                return getattr(pb_grpc.EncoderStub(channel), method)(message, metadata=metadata,
                                                                      timeout=timeout)
            except grpc.RpcError as exc:
                return exc

    return await trio.to_thread.run_sync(call)


def meta_json(meta: pb.EncodeMeta) -> dict[str, Any]:
    """An answer's meta as HTTP's JSON answer writes it."""
    return meta_from_message(meta).to_json()


def same_inline(ours: bytes, http: bytes) -> bool:
    """Two inline bodies say the same: equal tensors, equal metadata (safetensors writes its
    metadata map in no fixed order, so the bytes of two equal answers may differ)."""
    (a, meta_a), (b, meta_b) = decode_safetensors(ours), decode_safetensors(http)
    return torch.equal(a, b) and meta_a == meta_b


async def live(server: Any) -> int:
    return server.service.registry.statistics().live_requests


async def wait_live(server: Any, count: int) -> None:
    with trio.fail_after(30):
        while await live(server) != count:
            await trio.sleep(0.01)


# ---- the message ↔ body mapping (sans-IO) ------------------------------------------
def test_a_message_means_the_http_body_it_mirrors() -> None:
    """Defaults the proto cannot say (0 = unset) become HTTP's; every field is carried."""
    message = pb.EncodeRequest(
        req_id="r", modality="IMAGE", num_parts=0, hashes=["h0", "h1"],
        mm_items=[pb.Item(url="data:image/png;base64,AA"),
                  pb.Item(url="data:image/png;base64,AB", content_hash="sha256:" + "0" * 64)],
        mooncake=pb.Mooncake(receive_count=0))
    body = encode_body(message)
    assert body == {"req_id": "r", "modality": "IMAGE", "num_parts": 1, "part_idx": 0,
                    "mm_items": ["data:image/png;base64,AA",
                                 {"url": "data:image/png;base64,AB", "content_hash": "sha256:" + "0" * 64}],
                    "hashes": ["h0", "h1"], "deliver": {"backend": "mooncake", "receive_count": 1}}
    parsed = parse_encode_request(body)
    assert (parsed.num_parts, parsed.modality, parsed.deliver.receive_count) == (1, "image", 1)
    zmq = encode_body(pb.EncodeRequest(req_id="z", modality="audio", mm_items=[pb.Item(url="x")],
                                       num_parts=3, part_idx=2, zmq=pb.Zmq(endpoints=["tcp://a:1", "ipc://b"])))
    assert zmq["deliver"] == {"backend": "zmq", "endpoints": ["tcp://a:1", "ipc://b"]}
    assert (zmq["num_parts"], zmq["part_idx"], "hashes" in zmq) == (3, 2, False)
    for inline in (pb.EncodeRequest(req_id="i", modality="image"),
                   pb.EncodeRequest(req_id="i", modality="image", inline=pb.Inline())):
        assert "deliver" not in encode_body(inline)


# ---- deliveries ---------------------------------------------------------------------
async def test_inline_answer_is_http_inline_answer(encoder: Any) -> None:
    """Same item, same req_id: the safetensors body is HTTP's (same tensor, same metadata)."""
    image = data_uri(png_bytes(84, 56, seed=3))
    async with encoder(grpc_port=0) as (server, http):
        r = await http.post("/encode", json={"req_id": "same", "modality": "image", "mm_items": [image]})
        assert r.status_code == 200, r.text
        answer = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="same", modality="image", mm_items=[pb.Item(url=image)], inline=pb.Inline()))
        hashed = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="hashed", modality="image", num_parts=2, part_idx=1, hashes=["k"],
            mm_items=[pb.Item(url=image)]))
        assert await live(server) == 0
    assert not isinstance(answer, grpc.RpcError), answer
    assert same_inline(answer.safetensors, r.content) and answer.nbytes == 0
    tensor, meta = decode_safetensors(answer.safetensors)
    assert list(tensor.shape) == [answer.meta.tokens, answer.meta.dim]
    ours = meta_json(answer.meta)
    assert {k: ours[k] for k in ("req_id", "part_idx", "num_parts", "modality", "token_counts", "grid_thw")} \
        == {k: meta[k] for k in ("req_id", "part_idx", "num_parts", "modality", "token_counts", "grid_thw")}
    assert (ours["tokens"], ours["dim"], ours["dtype"]) == (*tensor.shape, "float32")
    assert (hashed.meta.num_parts, hashed.meta.part_idx) == (2, 1)
    assert torch.equal(decode_safetensors(hashed.safetensors)[0], tensor)


async def test_zmq_delivery_reaches_every_pull_socket(encoder: Any) -> None:
    image = data_uri(png_bytes(56, 56, seed=4))
    async with encoder(grpc_port=0) as (server, http), PullReceiver() as a, PullReceiver() as b:
        inline, _ = decode_safetensors((await http.post("/encode", json={
            "req_id": "ref", "modality": "image", "mm_items": [image]})).content)
        answer = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="z", modality="image", mm_items=[pb.Item(url=image)], num_parts=2, part_idx=1,
            zmq=pb.Zmq(endpoints=[a.last_endpoint, b.last_endpoint])))
        assert not isinstance(answer, grpc.RpcError), answer
        with trio.fail_after(30):
            received = [await a.receive(), await b.receive()]
        await wait_live(server, 0)
    assert answer.safetensors == b"" and answer.nbytes == 0
    meta = meta_json(answer.meta)
    assert meta == {"req_id": "z", "part_idx": 1, "num_parts": 2, "modality": "image",
                    "tokens": inline.shape[0], "dim": inline.shape[1], "dtype": "float32",
                    "token_counts": [inline.shape[0]], "grid_thw": meta["grid_thw"]}
    for header, payload in received:
        assert (header.req_id, header.part_idx, header.num_parts) == ("z", 1, 2)
        assert header.grid_thw == meta["grid_thw"] and header.token_counts == meta["token_counts"]
        assert payload is not None and torch.equal(payload.tensor(), inline)


@asynccontextmanager
async def mooncake_receiver(nbytes: int) -> AsyncIterator[tuple[Any, torch.Tensor]]:
    """The language server's side: a real TransferEngine with one registered buffer."""
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra")
    from epd_trio.transport.mooncake import open_mooncake

    async with open_mooncake("127.0.0.1") as mooncake:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        async with mooncake.registered(buffer.data_ptr(), nbytes):
            yield mooncake, buffer


async def test_mooncake_answers_the_size_then_send_writes_it(encoder: Any) -> None:
    """The forward is held (the scheduler's ``run_sync`` waits on an event) until the Encode
    answer is in: the size comes before the forward, the bytes with Send."""
    image = data_uri(png_bytes(100, 70, seed=5))
    async with encoder(grpc_port=0, transfer_backend="mooncake") as (server, http), \
            mooncake_receiver(1 << 20) as (mc, buf):
        inline, _ = decode_safetensors((await http.post("/encode", json={
            "req_id": "ref", "modality": "image", "mm_items": [image]})).content)
        scheduler = server.service.engine.scheduler
        real_run_sync, forward_may_run, batches = scheduler.run_sync, trio.Event(), []

        async def held(fn: Any, payloads: Any, **kw: Any) -> Any:
            await forward_may_run.wait()
            batches.append(len(payloads))
            return await real_run_sync(fn, payloads, **kw)

        scheduler.run_sync = held
        try:
            answer = await rpc(server, "Encode", pb.EncodeRequest(  # receive_count 0 means 1
                req_id="m", modality="image", mm_items=[pb.Item(url=image)], mooncake=pb.Mooncake()))
            assert batches == []  # answered while the forward had not run
        finally:
            forward_may_run.set()
        assert not isinstance(answer, grpc.RpcError), answer
        assert answer.nbytes == inline.numel() * inline.element_size() and answer.safetensors == b""
        offset = 4096  # the receiver chooses its slot: an offset proves the addressing
        sent = await rpc(server, "Send", pb.SendRequest(
            req_id="m", session=mc.session, buffer_address=buf.data_ptr() + offset,
            buffer_length=answer.nbytes))
        assert not isinstance(sent, grpc.RpcError), sent
        await wait_live(server, 0)  # one receiver, served: released
        gone = await rpc(server, "Send", pb.SendRequest(
            req_id="m", session=mc.session, buffer_address=buf.data_ptr(), buffer_length=answer.nbytes))
        stats = (await http.get("/stats")).json()
    assert (sent.req_id, sent.part_idx, sent.nbytes) == ("m", 0, answer.nbytes)
    assert batches == [1]
    meta = answer.meta
    landed = buf[offset:offset + answer.nbytes].view(torch.float32).view(meta.tokens, meta.dim)
    assert torch.equal(landed, inline)
    assert gone.code() == grpc.StatusCode.NOT_FOUND
    assert stats["mooncake"]["writes"] == 1 and stats["mooncake"]["registered_regions"] == 0


# ---- modalities -----------------------------------------------------------------------
async def test_video_inline_carries_its_extras(encoder_for: Any) -> None:
    video = uri(VIDEO, "video/mp4")
    async with encoder_for("qwen2_5_vl", grpc_port=0) as (server, http):
        r = await http.post("/encode", json={"req_id": "v", "modality": "video", "mm_items": [video]})
        assert r.status_code == 200, r.text
        answer = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="v", modality="video", mm_items=[pb.Item(url=video)]))
    assert not isinstance(answer, grpc.RpcError), answer
    assert same_inline(answer.safetensors, r.content)
    _, meta = decode_safetensors(r.content)
    assert json.loads(answer.meta.extras_json) == meta["extras"] and "second_per_grid_ts" in meta["extras"]
    assert meta_json(answer.meta)["grid_thw"] == meta["grid_thw"]


async def test_audio_over_zmq_and_inline(encoder_for: Any) -> None:
    tone = uri(sample_tone(0.8, hz=300.0), "audio/wav")
    async with encoder_for("qwen2_audio", grpc_port=0) as (server, http), PullReceiver() as pull:
        r = await http.post("/encode", json={"req_id": "a", "modality": "audio", "mm_items": [tone]})
        assert r.status_code == 200, r.text
        inline = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="a", modality="audio", mm_items=[pb.Item(url=tone)]))
        pushed = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="az", modality="audio", mm_items=[pb.Item(url=tone)],
            zmq=pb.Zmq(endpoints=[pull.last_endpoint])))
        with trio.fail_after(30):
            header, payload = await pull.receive()
        image = await rpc(server, "Encode", pb.EncodeRequest(
            req_id="i", modality="image", mm_items=[pb.Item(url=data_uri(png_bytes(56, 56)))]))
    assert not isinstance(inline, grpc.RpcError) and not isinstance(pushed, grpc.RpcError)
    assert same_inline(inline.safetensors, r.content)
    tensor, meta = decode_safetensors(r.content)
    assert list(inline.meta.grid_thw) == [] and json.loads(pushed.meta.extras_json) == meta["extras"]
    assert header.extras == meta["extras"] and payload is not None and torch.equal(payload.tensor(), tensor)
    assert image.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not encode 'image'" in image.details()


# ---- abort and model info -------------------------------------------------------------
async def test_abort_ends_a_live_encode_cancelled(encoder: Any) -> None:
    """The forward waits on an event (the scheduler's ``run_sync`` is wrapped), so the
    Encode is surely live when Abort arrives."""
    image = data_uri(png_bytes(56, 56, seed=9))
    async with encoder(grpc_port=0) as (server, http):
        scheduler = server.service.engine.scheduler
        real_run_sync, gate = scheduler.run_sync, trio.Event()

        async def held(fn: Any, payloads: Any, **kw: Any) -> Any:
            await gate.wait()
            return await real_run_sync(fn, payloads, **kw)

        scheduler.run_sync = held
        outcome: list[Any] = []
        try:
            async with trio.open_nursery() as nursery:
                async def encode() -> None:
                    outcome.append(await rpc(server, "Encode", pb.EncodeRequest(
                        req_id="live", modality="image", mm_items=[pb.Item(url=image)])))

                nursery.start_soon(encode)
                await wait_live(server, 1)
                unknown_part = await rpc(server, "Abort", pb.AbortRequest(req_id="live", part_idx=3))
                aborted = await rpc(server, "Abort", pb.AbortRequest(req_id="live", part_idx=0))
        finally:
            gate.set()
        unknown = await rpc(server, "Abort", pb.AbortRequest(req_id="nobody"))
        await wait_live(server, 0)
        stats = (await http.get("/stats")).json()
    (cancelled,) = outcome
    assert cancelled.code() == grpc.StatusCode.CANCELLED and "abort" in cancelled.details()
    assert (aborted.req_id, aborted.aborted, aborted.released) == ("live", 1, True)  # let go
    for missing in (unknown_part, unknown):
        assert missing.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.details() == "no live request 'nobody'"
    assert stats["registry"]["aborted"] == 1


async def test_the_client_deadline_is_the_request_deadline(encoder: Any) -> None:
    """The forward is held; the call's 3 s deadline (far below --request-timeout) ends the
    request: the ZMQ receiver is told, nothing stays live. Real time: gRPC runs on its own thread."""
    image = data_uri(png_bytes(56, 56, seed=10))
    async with encoder(grpc_port=0, request_timeout=120.0) as (server, _), PullReceiver() as pull:
        scheduler = server.service.engine.scheduler
        real_run_sync, gate = scheduler.run_sync, trio.Event()

        async def held(fn: Any, payloads: Any, **kw: Any) -> Any:
            await gate.wait()
            return await real_run_sync(fn, payloads, **kw)

        scheduler.run_sync = held
        try:
            with trio.fail_after(30):
                late = await rpc(server, "Encode", pb.EncodeRequest(
                    req_id="late", modality="image", mm_items=[pb.Item(url=image)],
                    zmq=pb.Zmq(endpoints=[pull.last_endpoint])), timeout=3.0)
                header, payload = await pull.receive()
                await wait_live(server, 0)
        finally:
            gate.set()
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (header.kind, header.req_id, payload) == ("error", "late", None)
    assert header.error is not None and header.error.status in (499, 504), header.error


async def test_model_info_equals_http(encoder_for: Any) -> None:
    async with encoder_for("qwen3_vl", grpc_port=0) as (server, http):
        info = (await http.get("/model_info")).json()
        answer = await rpc(server, "GetModelInfo", pb.ModelInfoRequest())
    assert not isinstance(answer, grpc.RpcError), answer
    got = {"model_type": answer.model_type, "modalities": list(answer.modalities), "dim": answer.dim,
           "dtype": answer.dtype, "device": answer.device, "max_batch_size": answer.max_batch_size,
           "random_weights": answer.random_weights,
           "embedding_layout": [{"name": b.name, "width": b.width} for b in answer.embedding_layout],
           "embedding_description": answer.embedding_description, "version": answer.version}
    assert got == info
    assert len(info["embedding_layout"]) > 1  # Qwen3-VL's deepstack levels: a layout worth checking


async def test_reflection_lists_and_describes_the_service(encoder: Any) -> None:
    """What ``grpcurl list`` and ``grpcurl describe epd_trio.v1.Encoder`` (docs/grpc.md) ask for."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    async with encoder(grpc_port=0) as (server, _):
        target = server.grpc.url.removeprefix("grpc://")

        def reflect() -> tuple[list[str], list[str]]:
            with grpc.insecure_channel(target) as channel:
                database = ProtoReflectionDescriptorDatabase(channel)
                service = DescriptorPool(database).FindServiceByName("epd_trio.v1.Encoder")
                return sorted(database.get_services()), [m.name for m in service.methods]

        services, methods = await trio.to_thread.run_sync(reflect)
    assert services == sorted(["epd_trio.v1.Encoder", "sglang.grpc.encoder.SglangEncoder",
                               "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])
    assert methods == ["Encode", "Send", "Abort", "GetModelInfo"]
