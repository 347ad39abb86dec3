"""SGLang 0.5.23's gRPC encoder service (``sglang.grpc.encoder.SglangEncoder``) on epd_trio.

End to end, SGLang's own receiver code drives real ``epd-trio encoder --api
sglang --grpc-port P`` subprocesses: a driver process with
``SGLANG_ENCODER_MM_RECEIVER_MODE=grpc`` and ``grpc://`` URLs, so SGLang's
``create_mm_receiver`` picks ``MMReceiverGrpc`` (its ``Encode`` calls) and each
scheduler rank ``WaitingZmqRequestGrpc`` (its ``SchedulerReceiveUrl`` calls).
zmq_to_tokenizer runs unmodified. SGLang's own zmq_to_scheduler dispatch cannot
work over gRPC (it passes ``time_stats_json``, which ``MMReceiverGrpc.encode``
does not take: an upstream bug, shown here too), so those tests call that
``encode`` directly as the dispatch would without it. Embeddings must equal
transformers' own (relative error < 1e-4, float32 on both sides).

The rest uses in-process encoders and the standard grpcio stubs: SGLang's
messages for invalid requests, the error frame a failed part pushes, modalities
said by the items (beyond SGLang, which encodes images only), SGLang's Mooncake
``Encode`` sizes and ``Send`` with a real TransferEngine over TCP (SGLang's
receiver refuses mooncake over gRPC), and the 256 MiB message limit (scaled down).
"""

from __future__ import annotations

import base64
import os
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import trio
from smg_grpc_proto import sglang_encoder_pb2 as pb, sglang_encoder_pb2_grpc as pb_grpc

import sglang_expected as ref
from conftest import image_uri, random_image
from epd_trio.encoder.grpc_server import MESSAGE_LIMIT
from epd_trio.errors import RequestError
from epd_trio.model.samples import sample_video
from epd_trio.protocol.grpc_messages import infer_modality
from sglang_encoders import EncoderPool, SharedEncoder, sglang_encoders  # noqa: F401 (a fixture)
from sglang_face_kit import decode_with_sglang, rank, stats, until
from sglang_harness import Decoder, LanguageServer, SGLangEnv, sglang_decoder, sglang_env  # noqa: F401 (fixtures)
from test_sglang_end_to_end import BAD_IMAGE, assert_close, assert_nothing_left_behind, ok_ranks

IMAGE_SIZES = [(56, 56), (84, 56), (28, 112)]
GRPC_MODE = {"SGLANG_ENCODER_MM_RECEIVER_MODE": "grpc"}
# This module's names for the session's shared encoders (sglang_encoders.ENCODERS).
SHARED = {"tok_a": "vl_tokenizer", "tok_b": "vl_tokenizer_b", "sched_a": "vl_a", "sched_b": "vl_b"}


@pytest.fixture
def encoders(sglang_encoders: EncoderPool) -> Iterator[dict[str, SharedEncoder]]:
    """The shared encoders; after each test, every one of them has released everything."""
    shared = {name: sglang_encoders[pooled] for name, pooled in SHARED.items()}
    yield shared
    assert_nothing_left_behind({name: e.http for name, e in shared.items()},
                               lambda name: shared[name].log.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="module")
def grpc_language_server(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[LanguageServer]:
    server = LanguageServer(sglang_env, tmp_path_factory.mktemp("sglang_grpc_side"), GRPC_MODE)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def images() -> list[str]:
    return [image_uri(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)]


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, str]) -> ref.Expected:
    return ref.images(checkpoints["qwen2_5_vl"],
                      [random_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)])


def rid() -> str:
    return uuid.uuid4().hex


def live(encoder: SharedEncoder) -> list[Any]:
    return [[encoder.http, "live_requests", 1]]


# ---- SGLang's own MMReceiverGrpc, unmodified: zmq_to_tokenizer ----------------------------
@pytest.mark.parametrize("names", [["tok_a"], ["tok_a", "tok_b"]], ids=["one", "split"])
def test_zmq_to_tokenizer(grpc_language_server: LanguageServer, encoders: dict[str, SharedEncoder],
                          images: list[str], expected: ref.Expected, names: list[str]) -> None:
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_tokenizer", rid=rid(), urls=[encoders[n].grpc for n in names],
        items={"image": images}, model_type="qwen2_5_vl")
    (rank_,) = ok_ranks(answer)
    assert_close(tensors["0/IMAGE"], expected.cat())
    assert rank_["meta"]["img_grid_thw"] == {"tensor": expected.grids}


def test_zmq_to_tokenizer_error(grpc_language_server: LanguageServer,
                                encoders: dict[str, SharedEncoder]) -> None:
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_tokenizer", rid=rid(), urls=[encoders["tok_a"].grpc],
        items={"image": [BAD_IMAGE]}, model_type="qwen2_5_vl")
    assert answer["ranks"] == [{"ok": False, "error": None}] and tensors == {}
    assert any(("Encoder error for req_id=" in w and "error_code=400" in w)
               or "Encoder dispatch failed" in w for w in answer["warnings"]), answer


# ---- zmq_to_scheduler: MMReceiverGrpc.encode called as the dispatch would ------------------
@pytest.mark.parametrize("order", ["encode_first", "register_first"])
def test_zmq_to_scheduler_one_encoder(grpc_language_server: LanguageServer,
                                      encoders: dict[str, SharedEncoder], images: list[str],
                                      expected: ref.Expected, order: str) -> None:
    encoder = encoders["sched_a"]
    wait = live(encoder) if order == "encode_first" else \
        [[encoder.http, "sglang_rendezvous.waiters", 1]]  # SchedulerReceiveUrl is there first
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_scheduler", dispatch="direct", order=order, wait_for=wait, rid=rid(),
        urls=[encoder.grpc], items={"image": images[:2]}, model_type="qwen2_5_vl")
    (rank_,) = ok_ranks(answer)
    assert_close(tensors["0/IMAGE"], torch.cat(expected.embeddings[:2]))
    assert rank_["meta"]["img_grid_thw"] == {"tensor": expected.grids[:2]}
    assert answer["dispatch_errors"] == []


def test_zmq_to_scheduler_split_over_two_encoders_two_ranks(
        grpc_language_server: LanguageServer, encoders: dict[str, SharedEncoder],
        images: list[str], expected: ref.Expected) -> None:
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_scheduler", dispatch="direct", rid=rid(), ranks=2,
        urls=[encoders["sched_a"].grpc, encoders["sched_b"].grpc], items={"image": images},
        model_type="qwen2_5_vl")
    assert sorted(answer["assigned"]["IMAGE"]) == [1, 2]  # SGLang's own split: two parts
    for i, rank_ in enumerate(ok_ranks(answer, 2)):
        assert_close(tensors[f"{i}/IMAGE"], expected.cat())
        assert rank_["meta"]["img_grid_thw"] == {"tensor": expected.grids}
    assert answer["dispatch_errors"] == []


def test_sglangs_own_zmq_to_scheduler_dispatch_fails_upstream(
        grpc_language_server: LanguageServer, encoders: dict[str, SharedEncoder],
        images: list[str]) -> None:
    """The upstream bug itself: SGLang 0.5.23's dispatch never reaches the encoder."""
    before = encode_requests_seen(encoders["sched_a"])
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_scheduler", dispatch="sglang", rid=rid(), urls=[encoders["sched_a"].grpc],
        items={"image": images[:1]}, model_type="qwen2_5_vl")
    ((message, status),) = answer["dispatch_errors"]
    assert "time_stats_json" in message and status == 502, answer
    assert [r["ok"] for r in answer["ranks"]] == [False] and tensors == {}
    assert encode_requests_seen(encoders["sched_a"]) == before  # no Encode, not even a refused one


def encode_requests_seen(encoder: SharedEncoder) -> float:
    """Every request the encoder's faces have counted, refused ones too (``/metrics``)."""
    with urllib.request.urlopen(encoder.http + "/metrics", timeout=10) as got:
        lines = got.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("epd_encoder_requests_total{"))


def test_an_encoder_error_reaches_the_dispatch_and_every_rank(
        grpc_language_server: LanguageServer, encoders: dict[str, SharedEncoder],
        images: list[str]) -> None:
    # The dispatch error withheld from the ranks: only the encoder's error frame can fail them.
    answer, tensors = grpc_language_server.request(
        backend="zmq_to_scheduler", dispatch="direct", rid=rid(), ranks=2,
        urls=[encoders["sched_a"].grpc], items={"image": [images[0], BAD_IMAGE]},
        route_dispatch_errors=False, model_type="qwen2_5_vl")
    assert tensors == {}
    ((message, status),) = answer["dispatch_errors"]  # SGLang wraps the failed RPC as a 502
    assert "INVALID_ARGUMENT" in message and status == 502, answer
    for rank_ in answer["ranks"]:
        assert rank_["ok"] is False and rank_["error"][1] == 400, answer
    assert any("Received error signal from encoder" in w for w in answer["warnings"])


# ---- the grpcio stub against in-process encoders -------------------------------------------
def target(server: Any) -> str:
    return str(server.grpc.url.removeprefix("grpc://"))


async def call(server: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(stub)`` on a thread; its answer, or the ``grpc.RpcError`` it raised."""
    def run() -> Any:
        with grpc.insecure_channel(target(server)) as channel:
            try:
                return fn(pb_grpc.SglangEncoderStub(channel))
            except grpc.RpcError as exc:
                return exc
    return await trio.to_thread.run_sync(run)


def encode(**fields: Any) -> Callable[[Any], Any]:
    return lambda stub: stub.Encode(pb.EncodeRequest(**fields), timeout=60)


def failed(answer: Any, code: grpc.StatusCode) -> str:
    assert isinstance(answer, grpc.RpcError), answer
    assert answer.code() == code, (answer.code(), answer.details())
    return str(answer.details())


async def test_invalid_requests_get_sglangs_messages(encoder: Any) -> None:
    image = image_uri()
    cases = {  # SGLang's validate_encode_request, in its order
        "missing or invalid req_id": dict(req_id="", mm_items=[image], num_parts=1),
        "missing or empty mm_items": dict(req_id="r", num_parts=1),
        "num_parts must be a positive integer": dict(req_id="r", mm_items=[image], num_parts=0),
        "part_idx must be in [0, 2)": dict(req_id="r", mm_items=[image], num_parts=2, part_idx=2),
    }
    async with encoder(api="sglang", grpc_port=0) as (server, http):
        for message, fields in cases.items():
            got = await call(server, encode(**fields))
            assert failed(got, grpc.StatusCode.INVALID_ARGUMENT) == message
        mixed = await call(server, encode(req_id="m", num_parts=1, embedding_port=[1],
                                          prefill_host="127.0.0.1",
                                          mm_items=[image, "data:video/mp4;base64,AAAA", image]))
        after = await stats(http)
        metrics = (await http.get("/metrics")).text
    details = failed(mixed, grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith("mm_items mix modalities (image: items 0, 2; video: item 1)")
    assert after["live_requests"] == 0
    # every refusal is counted, as HTTP counts its own (modality unknown: not to be trusted)
    assert f'epd_encoder_requests_total{{modality="unknown",outcome="RequestError"}} {len(cases) + 1.0}' \
        in metrics, metrics


async def test_an_encoder_failure_is_a_status_and_an_error_frame(
        encoder: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    broken = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    async with encoder(api="sglang", grpc_port=0, encoder_transfer_backend="zmq_to_tokenizer") \
            as (server, http), rank() as r:
        got = await call(server, encode(req_id="bad", num_parts=1, mm_items=[broken],
                                        prefill_host="127.0.0.1", embedding_port=[r.port]))
        notice = await r.receive()
        after = await stats(http)
    details = failed(got, grpc.StatusCode.INVALID_ARGUMENT)
    results, _ = decode_with_sglang(sglang_decoder, tmp_path, {"bad": {"rid": "bad", "messages": [notice]}})
    state = results["bad"]["parts"][0]["state"]
    assert len(notice) == 1 and state["error_code"] == 400 and state["error_msg"] == details
    assert after["live_requests"] == 0


@pytest.mark.parametrize("backend", ["zmq_to_tokenizer", "zmq_to_scheduler"])
async def test_embedding_ports(encoder: Any, backend: str) -> None:
    """SGLang's server: zmq_to_tokenizer pushes to the first port only, zmq_to_scheduler to each."""
    first, second = image_uri(56, 56, seed=1), image_uri(84, 56, seed=2)
    async with encoder(api="sglang", grpc_port=0, encoder_transfer_backend=backend) as (server, _), \
            rank() as a, rank() as b:
        both = await call(server, encode(req_id="p1", num_parts=1, mm_items=[first],
                                         prefill_host="127.0.0.1", embedding_port=[a.port, b.port]))
        got_a = await a.receive()
        if backend == "zmq_to_tokenizer":  # b's next message is p2's: it never had p1's
            await call(server, encode(req_id="p2", num_parts=1, mm_items=[second],
                                      prefill_host="127.0.0.1", embedding_port=[b.port]))
        got_b = await b.receive()
        local = [(await server.service.engine.encode([i], "image")).embedding for i in (first, second)]
    sizes = [e.numel() * e.element_size() for e in local]
    assert both == pb.EncodeResponse() and sizes[0] != sizes[1]
    assert len(got_a[1]) == sizes[0]
    assert len(got_b[1]) == sizes[1 if backend == "zmq_to_tokenizer" else 0]


# ---- beyond SGLang: the items say their modality -------------------------------------------
@pytest.mark.parametrize(("item", "modality"), [
    ("data:image/png;base64,AAAA", "image"), ("data:VIDEO/mp4;base64,AAAA", "video"),
    ("data:audio/wav;base64,AAAA", "audio"), ("https://host/clip.mp4?sig=1#t=2", "video"),
    ("file:///media/a.wav", "audio"), ("/media/b.webm", "video"), ("photo.jpeg", "image"),
    ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ", "image"),  # bare base64: SGLang's image
    ("data:application/octet-stream;base64,AAAA", "image"), ("https://host/page", "image"),
])
def test_infer_modality(item: str, modality: str) -> None:
    assert infer_modality([item, item]) == modality


def test_infer_modality_refuses_a_mix() -> None:
    with pytest.raises(RequestError, match=r"mix modalities \(audio: item 1; image: item 0\)"):
        infer_modality(["a.png", "b.wav", "no-extension"])


async def pushed(server: Any, r: Any, req_id: str, items: list[str]) -> tuple[Any, list[bytes]]:
    """One Encode to rank ``r`` (zmq_to_tokenizer's way); the answer and the message."""
    answer = await call(server, encode(req_id=req_id, num_parts=1, mm_items=items,
                                       prefill_host="127.0.0.1", embedding_port=[r.port]))
    assert not isinstance(answer, grpc.RpcError), (answer.code(), answer.details())
    return answer, await r.receive()


def seen_by_sglang(decoder: Decoder, root: Path, rid_: str, message: list[bytes]
                   ) -> tuple[dict[str, Any], torch.Tensor]:
    results, tensors = decode_with_sglang(decoder, root, {"c": {"rid": rid_, "messages": [message]}})
    (part,) = results["c"]["parts"]
    assert part["matches"] is True and results["c"]["ready"] is True
    return part["state"], tensors["c/part0"]


async def test_video_items_encode_as_video(encoder: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    clip = tmp_path / "media" / "clip.mp4"
    clip.parent.mkdir()
    clip.write_bytes(sample_video(10, 4.0, 56, 42, seed=5))
    uri = ref.uri("video/mp4", clip.read_bytes())
    async with encoder(api="sglang", grpc_port=0, media_root=str(clip.parent)) as (server, _), \
            rank() as r:
        answer, by_uri = await pushed(server, r, "v1", [uri])
        _, by_url = await pushed(server, r, "v2", [clip.as_uri()])  # a URL ending .mp4
        local = await server.service.engine.encode([uri], "video")
    assert answer == pb.EncodeResponse()  # zmq: every destination has the part
    for name, message in (("uri", by_uri), ("url", by_url)):
        (tmp_path / name).mkdir()
        state, tensor = seen_by_sglang(sglang_decoder, tmp_path / name, f"v{1 if name == 'uri' else 2}",
                                       message)
        assert state["modality"]["name"] == "VIDEO"
        assert state["grid_dim"]["tensor"]["values"] == [list(g) for g in local.grid_thw]
        assert torch.equal(tensor, local.embedding)


async def test_audio_items_encode_as_audio(encoder_for: Any, sglang_decoder: Decoder,
                                           tmp_path: Path) -> None:
    import numpy as np

    wave = (np.random.default_rng(3).standard_normal(int(1.3 * ref.AUDIO_RATE)) * 0.1).astype(np.float32)
    uri = ref.uri("audio/wav", ref.wav_bytes(wave))
    async with encoder_for("qwen2_audio", api="sglang", grpc_port=0) as (server, _), rank() as r:
        _, message = await pushed(server, r, "a1", [uri])
        local = await server.service.engine.encode([uri], "audio")
    state, tensor = seen_by_sglang(sglang_decoder, tmp_path, "a1", message)
    assert state["modality"]["name"] == "AUDIO"
    assert torch.equal(tensor, local.embedding)


# ---- Mooncake: Encode answers the sizes, Send writes them -----------------------------------
async def test_mooncake_encode_sizes_then_send(encoder: Any, sglang_decoder: Decoder,
                                               tmp_path: Path) -> None:
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")
    from epd_trio.transport.mooncake import open_mooncake

    item = image_uri(84, 56, seed=9)
    async with encoder(api="sglang", grpc_port=0, encoder_transfer_backend="mooncake") \
            as (server, http), open_mooncake("127.0.0.1") as mooncake, rank() as r:
        buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        async with mooncake.registered(buffer.data_ptr(), buffer.numel()):
            sizes = await call(server, encode(req_id="mc", num_parts=1, mm_items=[item],
                                              prefill_host="127.0.0.1", embedding_port=[r.port]))
            send = pb.SendRequest(req_id="mc", prefill_host="127.0.0.1", embedding_port=r.port,
                                  session_id=mooncake.session, buffer_address=buffer.data_ptr() + 4096)
            sent = await call(server, lambda stub: stub.Send(send, timeout=60))
            notice = await r.receive()
            after = await until(http, lambda s: s["live_requests"] == 0)
            late = await call(server, lambda stub: stub.Send(send, timeout=60))
        local = await server.service.engine.encode([item], "image")
    nbytes = local.embedding.numel() * local.embedding.element_size()
    assert (sizes.embedding_size, sizes.embedding_len, sizes.embedding_dim) == (
        nbytes, *local.embedding.shape)
    assert sent == pb.SendResponse()
    landed = buffer[4096:4096 + nbytes].view(local.embedding.dtype).view(local.embedding.shape)
    assert torch.equal(landed, local.embedding)
    assert not buffer[4096 + nbytes:].any() and not buffer[:4096].any()  # exactly that many bytes
    failed(late, grpc.StatusCode.NOT_FOUND)  # released after its one Send, as SGLang's server
    assert after["sglang_rendezvous"]["entries"] == 0 and after["mooncake"]["registered_regions"] == 0
    results, _ = decode_with_sglang(sglang_decoder, tmp_path, {"n": {"rid": "mc", "messages": [notice]}})
    seen = results["n"]["parts"][0]
    assert len(notice) == 1 and seen["matches"] is True and seen["state"]["error_msg"] is None
    assert seen["state"]["shape"] == list(local.embedding.shape)


async def test_send_is_refused_without_mooncake(encoder: Any) -> None:
    async with encoder(api="sglang", grpc_port=0) as (server, _):
        got = await call(server, lambda stub: stub.Send(pb.SendRequest(req_id="x"), timeout=30))
    assert "mooncake" in failed(got, grpc.StatusCode.INVALID_ARGUMENT)


# ---- SGLang's message limits -----------------------------------------------------------------
async def test_messages_up_to_256_mib(encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server reads messages up to MESSAGE_LIMIT, past a smaller max_body_bytes (128 MiB by
    default), and no further. Scaled down: a limit of 8 MiB (over grpcio's 4 MiB default, so
    the limit must be set), max_body_bytes 4 MiB, as 256 and 128 MiB stand."""
    assert MESSAGE_LIMIT == 256 << 20  # SGLang's grpc_server.py, both directions
    limit = 8 << 20
    monkeypatch.setattr("epd_trio.encoder.grpc_server.MESSAGE_LIMIT", limit)
    filler = "x" * (limit - (64 << 10))
    async with encoder(api="sglang", grpc_port=0, max_body_bytes=limit // 2) as (server, _):
        under = await call(server, encode(req_id="", num_parts=1, mm_items=[filler]))
        over = await call(server, encode(req_id="", num_parts=1, mm_items=[filler + "x" * (128 << 10)]))
    assert failed(under, grpc.StatusCode.INVALID_ARGUMENT) == "missing or invalid req_id"  # read
    failed(over, grpc.StatusCode.RESOURCE_EXHAUSTED)
