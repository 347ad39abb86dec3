"""The SGLang face's Mooncake routes, in SGLang's exact sequence, with a real TransferEngine.

SGLang's own Mooncake receiver lands the bytes in CUDA memory, so on CPU a test
receiver plays it with a real TransferEngine over TCP: ``/scheduler_receive_meta_data``
(posted before the ``/encode``: it waits until the sizes are known) → reserve
→ ``/send`` per rank → the completion notice on the rank's PULL socket,
decoded by SGLang's ``safe_pickle_loads`` in the driver process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from conftest import data_uri, png_bytes
from sglang_face_kit import decode_with_sglang, encode_body, rank, stats, until
from sglang_harness import Decoder, sglang_decoder, sglang_env  # noqa: F401 (fixtures)

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.transport.mooncake import open_mooncake


async def test_meta_then_send_per_rank_then_completion(
        encoder: Any, sglang_decoder: Decoder, tmp_path: Path) -> None:
    image = png_bytes(84, 56, seed=9)
    rid, part = "mc", "mc_local_part_0"
    async with encoder(api="sglang", encoder_transfer_backend="mooncake") as (server, http), \
            open_mooncake("127.0.0.1") as mooncake, rank() as r0, rank() as r1:
        buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        async with mooncake.registered(buffer.data_ptr(), buffer.numel()):
            answers: dict[str, Any] = {}

            async def post(name: str, path: str, body: dict[str, Any]) -> None:
                answers[name] = await http.post(path, json=body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "meta", "/scheduler_receive_meta_data",
                                   {"req_id": part, "part_idx": 0})
                await until(http, lambda s: s["sglang_rendezvous"]["waiters"] == 1)
                nursery.start_soon(post, "encode", "/encode", encode_body(rid, 0, 1, [data_uri(image)]))
            meta = answers["meta"].json()
            sends = []
            for i, r in enumerate((r0, r1)):  # two TP ranks, each with its own landing slot
                send = {**meta, "prefill_host": "127.0.0.1", "embedding_port": r.port,
                        "session_id": mooncake.session, "buffer_address": buffer.data_ptr() + i * 65536,
                        "receive_count": 2}
                sends.append(await http.post("/send", json=send))
            notices = [await r0.receive(), await r1.receive()]
            late = await http.post("/send", json={**send, "embedding_port": r0.port})
            after = await until(http, lambda s: s["live_requests"] == 0)
        local = await server.service.engine.encode([data_uri(image)], "image")
    encoded = answers["encode"].json()
    nbytes = local.embedding.numel() * local.embedding.element_size()
    assert answers["encode"].status_code == 200 and "mm_items" not in encoded
    assert encoded["req_id"] == part and encoded["encoder_idx"] == 0
    assert (encoded["embedding_size"], encoded["embedding_len"], encoded["embedding_dim"]) == (
        nbytes, *local.embedding.shape)
    assert answers["meta"].status_code == 200 and meta == {
        "req_id": part, "part_idx": 0, "embedding_size": nbytes,
        "embedding_len": local.embedding.shape[0], "embedding_dim": local.embedding.shape[1]}
    assert [s.status_code for s in sends] == [200, 200] and sends[0].json() is None
    assert late.status_code == 404 and late.json()["status"] == "error"  # released after 2 ranks
    assert "has already been delivered and released" in late.json()["message"]
    for i in range(2):
        landed = buffer[i * 65536:i * 65536 + nbytes].view(local.embedding.dtype)
        assert torch.equal(landed.view(local.embedding.shape), local.embedding)
    assert after["sglang_rendezvous"]["entries"] == 0 and after["mooncake"]["registered_regions"] == 0
    assert all(len(n) == 1 for n in notices)
    results, _ = decode_with_sglang(sglang_decoder, tmp_path, {
        f"rank{i}": {"rid": rid, "messages": [n]} for i, n in enumerate(notices)})
    for i in range(2):
        seen = results[f"rank{i}"]["parts"][0]
        assert seen["matches"] is True and seen["state"]["error_msg"] is None
        assert seen["state"]["shape"] == list(local.embedding.shape)
        assert seen["state"]["grid_dim"]["tensor"]["values"] == [list(g) for g in local.grid_thw]


async def test_a_failed_part_fails_its_meta_request(encoder: Any) -> None:
    async with encoder(api="sglang", encoder_transfer_backend="mooncake") as (_, http):
        answers: dict[str, Any] = {}

        async def post(name: str, path: str, body: dict[str, Any]) -> None:
            answers[name] = await http.post(path, json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "meta", "/scheduler_receive_meta_data",
                               {"req_id": "f_local_part_0", "part_idx": 0})
            await until(http, lambda s: s["sglang_rendezvous"]["waiters"] == 1)
            nursery.start_soon(post, "encode", "/encode",
                               encode_body("f", 0, 1, ["data:image/png;base64,AAAA"]))
        # A rank's /send after the part failed hears why (SGLang's encoder keeps an error
        # record for it), not just that the part is unknown.
        late = await http.post("/send", json={
            "req_id": "f_local_part_0", "part_idx": 0, "prefill_host": "127.0.0.1",
            "embedding_port": 1, "session_id": "127.0.0.1:1", "buffer_address": 4096,
            "embedding_size": 16, "receive_count": 1})
        after = await stats(http)
    assert answers["encode"].status_code == 400
    assert answers["meta"].status_code == 400
    assert answers["meta"].json()["message"] == answers["encode"].json()["message"]
    assert late.status_code == 400 and late.json()["message"] == answers["encode"].json()["message"]
    assert after["live_requests"] == 0 and after["sglang_rendezvous"]["entries"] == 0
