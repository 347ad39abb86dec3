"""The SGLang face over ZMQ: real Hypercorn, real PULL sockets, frames read by SGLang's own code.

Each test drives an in-process ``--api sglang`` encoder with the bodies an
SGLang 0.5.23 language server sends, in its orders (a rank's
``/scheduler_receive_url`` before and after the ``/encode``), and hands what
its ranks' PULL sockets got to SGLang's receiver code (``safe_pickle_loads``,
its part check, frame 1 into a tensor, ``MultiModalEmbeddingData`` merging).
Embeddings must equal the engine's own output bit for bit.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
import trio

from conftest import data_uri, png_bytes
from epd_trio.model.samples import sample_tone
from epd_trio.testing import Fault, FaultPlan, install_faults
from sglang_face_kit import decode_with_sglang, encode_body, rank, stats, until
from sglang_harness import Decoder, sglang_decoder, sglang_env  # noqa: F401 (fixtures)


def tensor_of(seen: dict[str, Any]) -> torch.Tensor:
    t = seen["tensor"]
    return torch.tensor(t["values"])


async def test_two_ranks_registering_before_and_after_encode(
        encoder: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    image = png_bytes(56, 84, seed=3)
    rid = "two"
    async with encoder(api="sglang") as (server, http), rank() as a, rank() as b:
        answers: dict[str, Any] = {}

        async def post(name: str, path: str, body: dict[str, Any]) -> None:
            answers[name] = await http.post(path, json=body)

        registration = {"req_id": f"{rid}_local_part_0", "receive_count": 2, "modality": "IMAGE"}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "a", "/scheduler_receive_url", {**registration, "receive_url": a.url})
            await until(http, lambda s: s["sglang_rendezvous"]["waiters"] == 1)  # a is early
            nursery.start_soon(post, "encode", "/encode", encode_body(rid, 0, 1, [data_uri(image)]))
            await until(http, lambda s: s["sglang_rendezvous"]["claimed"] == 1)  # /encode is live
            nursery.start_soon(post, "b", "/scheduler_receive_url", {**registration, "receive_url": b.url})
            got_a, got_b = await a.receive(), await b.receive()
        local = await server.service.engine.encode([data_uri(image)], "image")
        after = await stats(http)
    assert answers["a"].status_code == answers["b"].status_code == 200 and answers["a"].json() is None
    assert answers["encode"].status_code == 200 and answers["encode"].json() is None
    assert after["live_requests"] == 0 and after["sglang_rendezvous"] == {
        "entries": 0, "claimed": 0, "waiters": 0, "destinations": 0, "ended": 1, "early": 0,
        "refused": 0}
    assert got_a == got_b and len(got_a) == 2
    results, tensors = decode_with_sglang(sglang_decoder, tmp_path, {
        "a": {"rid": rid, "messages": [got_a]}})
    seen = results["a"]["parts"][0]
    assert seen["matches"] is True and results["a"]["ready"] is True
    assert seen["state"]["grid_dim"]["tensor"]["values"] == [list(g) for g in local.grid_thw]
    assert seen["state"]["shape"] == list(local.embedding.shape)
    assert torch.equal(tensors["a/part0"], local.embedding)


async def test_a_reused_req_id_serves_a_rank_that_registers_during_preprocessing(encoder: Any) -> None:
    """The second ``/encode`` of an ended part id is admitted, then preprocessed for a while: a
    rank registering in that time gets the new part, not a 404 saying the old one was delivered."""
    registration = {"req_id": "again_local_part_0", "receive_count": 1, "modality": "IMAGE"}
    body = encode_body("again", 0, 1, [data_uri(png_bytes(56, 56, seed=5))])
    async with encoder(api="sglang") as (server, http), rank() as a:
        answers: dict[str, Any] = {}

        async def post(name: str, path: str, body: dict[str, Any]) -> None:
            answers[name] = await http.post(path, json=body)

        for turn in ("first", "second"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, f"{turn} encode", "/encode", body)
                await until(http, lambda s: s["live_requests"] == 1)  # admitted (second: held)
                nursery.start_soon(post, f"{turn} rank", "/scheduler_receive_url",
                                   {**registration, "receive_url": a.url})
                received = await a.receive()
            assert len(received) == 2
            install_faults(FaultPlan(0, [Fault("preprocess", delay=3.0)]), server.service.engine)
        after = await stats(http)
    assert {name: answer.status_code for name, answer in answers.items()} == dict.fromkeys(answers, 200)
    assert len(answers) == 4 and after["sglang_rendezvous"]["ended"] == 1


async def test_a_duplicate_refused_with_409_leaves_how_an_earlier_part_ended(encoder: Any) -> None:
    """A part of ``dup`` is live (held in preprocessing) when another part with that id
    ends; a duplicate of the live one is refused (409) and must change nothing: ranks
    that ask about ``dup`` still hear how the earlier part ended."""
    from epd_trio.errors import RequestError

    body = encode_body("dup", 0, 1, [data_uri(png_bytes(56, 56, seed=6))])
    async with encoder(api="sglang") as (server, http):
        install_faults(FaultPlan(0, [Fault("preprocess", delay=5.0)]), server.service.engine)
        rendezvous = server.service.deliveries.rendezvous
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(http.post, "/encode", json=body))
            await until(http, lambda s: s["live_requests"] == 1)  # admitted, preprocessing
            ended = rendezvous.claim("dup_local_part_0")  # another part with this id ends now
            ended.publish_error(RequestError("the earlier part's image could not be decoded"))
            rendezvous.release(ended)
            duplicate = await http.post("/encode", json=body)
            assert duplicate.status_code == 409, duplicate.text
            try:
                rendezvous.check_not_ended("dup_local_part_0")
            except RequestError as exc:
                heard = exc.message
            else:
                heard = None
            install_faults(None, server.service.engine)
            aborted = await http.post("/abort", json={"req_id": "dup_local_part_0"})
    assert heard == "the earlier part's image could not be decoded"
    assert aborted.json() == {"req_id": "dup_local_part_0", "aborted": 1, "released": True}


async def test_errors_are_answered_and_pushed_to_every_rank(
        encoder: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    async with encoder(api="sglang") as (_, http), rank() as a:
        bad_body = await http.post("/encode", json={"modality": "IMAGE", "mm_items": ["x"]})
        bad_modality = await http.post("/encode", json=encode_body("m", 0, 1, ["x"], modality="TEXT"))
        bad_url = await http.post("/scheduler_receive_url", json={
            "req_id": "u_local_part_0", "receive_count": 1, "receive_url": "no-port", "modality": "IMAGE"})
        answers: dict[str, Any] = {}

        async def register() -> None:
            answers["a"] = await http.post("/scheduler_receive_url", json={
                "req_id": "bad_local_part_0", "receive_count": 1, "receive_url": a.url,
                "modality": "IMAGE"})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(register)
            await until(http, lambda s: s["sglang_rendezvous"]["waiters"] == 1)
            other_count = await http.post("/scheduler_receive_url", json={
                "req_id": "bad_local_part_0", "receive_count": 2, "receive_url": "127.0.0.1:1",
                "modality": "IMAGE"})
            broken = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
            failed = await http.post("/encode", json=encode_body("bad", 0, 1, [broken]))
            notice = await a.receive()
        late = await http.post("/scheduler_receive_url", json={  # after the end: answered at once
            "req_id": "bad_local_part_0", "receive_count": 1, "receive_url": a.url, "modality": "IMAGE"})
        after = await stats(http)
    assert bad_body.status_code == 400 and bad_body.json() == {
        "status": "error", "message": "missing or invalid req_id", "req_id": None}
    assert bad_modality.status_code == 400 and bad_modality.json()["message"] == "unsupported modality: TEXT"
    assert bad_url.status_code == 400 and bad_url.json()["req_id"] == "u_local_part_0"
    assert other_count.status_code == 400 and "receive_count 2" in other_count.json()["message"]
    assert failed.status_code == 400 and failed.json()["status"] == "error"
    assert failed.json()["req_id"] == "bad_local_part_0" and answers["a"].status_code == 200
    assert late.status_code == 400 and late.json()["message"] == failed.json()["message"]
    assert len(notice) == 1
    assert after["live_requests"] == 0 and after["sglang_rendezvous"]["entries"] == 0
    results, _ = decode_with_sglang(sglang_decoder, tmp_path, {"bad": {"rid": "bad", "messages": [notice]}})
    state = results["bad"]["parts"][0]["state"]
    assert state["error_code"] == 400 and state["error_msg"] == failed.json()["message"]
    assert results["bad"]["ready"] is False


async def test_waits_are_bounded_and_leave_nothing(encoder: Any) -> None:
    # The three waits are independent, so they run side by side: a registration nobody's
    # /encode claims and a sizes query nobody answers (request_timeout each), and a part
    # no rank registers for (send_timeout, well inside the request's deadline).
    calls = {
        "lonely": ("/scheduler_receive_url", {"req_id": "lonely_local_part_0", "receive_count": 1,
                                              "receive_url": "127.0.0.1:9", "modality": "IMAGE"}),
        "unheard": ("/encode", encode_body("unheard", 0, 1, [data_uri(png_bytes(28, 28))])),
        "no_sizes": ("/scheduler_receive_meta_data", {"req_id": "x", "part_idx": 0}),
    }
    answers: dict[str, Any] = {}
    async with encoder(api="sglang", request_timeout=1.5, send_timeout=1.0) as (_, http):
        async def call(name: str) -> None:
            answers[name] = await http.post(calls[name][0], json=calls[name][1])

        async with trio.open_nursery() as nursery:
            for name in calls:
                nursery.start_soon(call, name)
        # The unheard part's error notice (bounded by send_timeout) outlives its 504.
        after = await until(http, lambda s: s["live_requests"] == 0, timeout=5.0)
    lonely, unheard, no_sizes = (answers[k] for k in ("lonely", "unheard", "no_sizes"))
    assert lonely.status_code == 504 and lonely.json()["req_id"] == "lonely_local_part_0"
    assert unheard.status_code == 504 and unheard.json()["req_id"] == "unheard_local_part_0"
    assert no_sizes.status_code == 504
    assert after["live_requests"] == 0 and after["sglang_rendezvous"] == {
        "entries": 0, "claimed": 0, "waiters": 0, "destinations": 0, "ended": 1, "early": 0,
        "refused": 0}


async def test_early_calls_over_the_bound_are_a_503_at_once(encoder: Any) -> None:
    registration = {"req_id": "early_local_part_0", "receive_count": 1, "receive_url": "127.0.0.1:9",
                    "modality": "IMAGE"}
    async with encoder(api="sglang", sglang_max_early_calls=1) as (_, http):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(http.post, "/scheduler_receive_url", json=registration))
            await until(http, lambda s: s["sglang_rendezvous"]["early"] == 1)
            refused = [await http.post("/scheduler_receive_meta_data",
                                       json={"req_id": "other_local_part_0", "part_idx": 0}),
                       await http.post("/scheduler_receive_url",
                                       json={**registration, "receive_url": "127.0.0.1:10"})]
            nursery.cancel_scope.cancel()  # the early rank goes away: its place is free again
        after = await until(http, lambda s: s["sglang_rendezvous"]["early"] == 0)
    for answer, req_id in zip(refused, ("other_local_part_0", "early_local_part_0")):
        assert answer.status_code == 503, answer.text
        assert answer.json()["status"] == "error" and answer.json()["req_id"] == req_id
        assert "at most 1" in answer.json()["message"]
    assert after["sglang_rendezvous"] == {"entries": 0, "claimed": 0, "waiters": 0, "destinations": 0,
                                          "ended": 0, "early": 0, "refused": 2}


async def test_zmq_to_tokenizer_audio_grid_is_mel_frames_and_content_hash_is_checked(
        encoder_for: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    tones = [sample_tone(0.8, hz=300.0), sample_tone(1.5, hz=220.0)]
    uris = [data_uri(t).replace("image/png", "audio/wav") for t in tones]
    right = {"url": uris[1], "content_hash": "sha256:" + hashlib.sha256(tones[1]).hexdigest(),
             "detail": "auto"}
    wrong = {"url": uris[1], "content_hash": "sha256:" + "0" * 64}
    async with encoder_for("qwen2_audio", api="sglang", encoder_transfer_backend="zmq_to_tokenizer"
                           ) as (server, http), rank() as a:
        to_rank = {"embedding_port": a.port}
        ok = await http.post("/encode", json=encode_body("aud", 0, 1, [uris[0], right], "AUDIO", **to_rank))
        message = await a.receive()
        mismatch = await http.post("/encode", json=encode_body("mis", 0, 1, [wrong], "AUDIO", **to_rank))
        mismatch_notice = await a.receive()
        no_port = await http.post("/encode", json=encode_body("np", 0, 1, [uris[0]], "AUDIO"))
        local = await server.service.engine.encode(uris, "audio")
    assert ok.status_code == 200 and ok.json() is None, ok.text
    assert mismatch.status_code == 400 and "content_hash" in mismatch.json()["message"]
    assert len(mismatch_notice) == 1
    assert no_port.status_code == 400 and "embedding_port" in no_port.json()["message"]
    results, tensors = decode_with_sglang(sglang_decoder, tmp_path, {
        "aud": {"rid": "aud", "model_type": "qwen2_audio", "messages": [message]}})
    assert results["aud"]["ready"] is True
    assert results["aud"]["extra_meta"]["audio_feature_lens"]["tensor"]["values"] == \
        local.extras["mel_frames"] == [80, 150]
    assert torch.equal(tensors["aud/part0"], local.embedding)


async def test_operation_routes_answer_as_sglangs_do(encoder: Any, tmp_path: Path) -> None:
    async with encoder(api="sglang", profile_dir=str(tmp_path)) as (_, http):
        health = [await http.get(path) for path in ("/health", "/health_generate")]
        started = await http.get("/start_profile")
        stopped = await http.post("/stop_profile")
        again = await http.post("/start_profile", json={"output_dir": "run", "num_steps": 1,
                                                        "activities": ["CPU"], "with_stack": None})
        stopped_again = await http.get("/stop_profile")
        shared = [await http.get(path) for path in ("/model_info", "/stats", "/metrics")]
        missing = await http.get("/nowhere")
        native_body = await http.post("/encode", json={"req_id": "n", "modality": "image",
                                                       "mm_items": ["x"], "deliver": {"backend": "zmq"}})
    assert [h.status_code for h in health] == [200, 200]
    assert started.status_code == 200 and started.text.startswith("Start profiling.")
    assert stopped.status_code == 200 and stopped.text.startswith("Stop profiling.")
    assert again.status_code == stopped_again.status_code == 200 and str(tmp_path / "run") in again.text
    assert [s.status_code for s in shared] == [200, 200, 200]
    assert missing.status_code == 404 and missing.json()["status"] == "error"
    # a native body is not SGLang's: SGLang's own check refuses it
    assert native_body.status_code == 400 and native_body.json()["message"] == \
        "num_parts must be a positive integer"
