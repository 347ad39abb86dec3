"""Mooncake delivery with a real TransferEngine over TCP on loopback."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from conftest import data_uri, png_bytes
from epd_trio.errors import EncodeError
from epd_trio.protocol.codec import decode_safetensors

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake


@asynccontextmanager
async def receiver(nbytes: int) -> AsyncIterator[tuple[MooncakeTransport, torch.Tensor]]:
    """The language server's side: one registered buffer."""
    async with open_mooncake("127.0.0.1") as mooncake:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        async with mooncake.registered(buffer.data_ptr(), nbytes):
            yield mooncake, buffer


def body(req_id: str, image: bytes, receive_count: int = 1) -> dict[str, Any]:
    return {"req_id": req_id, "modality": "image", "mm_items": [data_uri(image)],
            "deliver": {"backend": "mooncake", "receive_count": receive_count}}


async def stats(http: Any) -> dict[str, Any]:
    return (await http.get("/stats")).json()


async def test_mooncake_equals_inline_bit_for_bit(encoder: Any) -> None:
    image = png_bytes(100, 70, seed=5)
    async with encoder(transfer_backend="mooncake") as (_, http), receiver(1 << 20) as (mc, buf):
        inline, _ = decode_safetensors((await http.post("/encode", json={**body("i", image), "deliver": None})).content)
        r = await http.post("/encode", json=body("m", image))
        assert r.status_code == 200, r.text
        meta = r.json()
        assert meta["nbytes"] == inline.numel() * inline.element_size() and meta["dtype"] == "float32"
        # the receiver writes its own slot; place it at an offset to prove addressing
        offset = 4096
        s = await http.post("/send", json={"req_id": "m", "session": mc.session,
                                           "buffer_address": buf.data_ptr() + offset,
                                           "buffer_length": meta["nbytes"]})
        assert s.status_code == 200 and s.json()["nbytes"] == meta["nbytes"], s.text
        landed = buf[offset:offset + meta["nbytes"]]
        assert torch.equal(landed, inline.contiguous().view(-1).view(torch.uint8))  # the bytes
        assert not buf[:offset].any()  # and nowhere else
        with trio.fail_after(5):
            while (await stats(http))["live_requests"]:
                await trio.sleep(0.01)
        after = await stats(http)
    assert after["mooncake"]["registered_regions"] == 0 and after["mooncake"]["writes"] == 1


async def test_two_receivers_and_a_retry_are_counted_once(encoder: Any) -> None:
    image = png_bytes(56, 56)
    async with encoder(transfer_backend="mooncake") as (_, http), receiver(1 << 16) as (mc, buf):
        meta = (await http.post("/encode", json=body("tp", image, receive_count=2))).json()
        send = {"req_id": "tp", "session": mc.session, "buffer_length": meta["nbytes"]}
        first = await http.post("/send", json={**send, "buffer_address": buf.data_ptr()})
        retry = await http.post("/send", json={**send, "buffer_address": buf.data_ptr()})
        assert first.status_code == retry.status_code == 200
        assert (await stats(http))["live_requests"] == 1  # still waiting for the 2nd receiver
        second = await http.post("/send", json={**send, "buffer_address": buf.data_ptr() + 8192})
        assert second.status_code == 200
        assert torch.equal(buf[:meta["nbytes"]], buf[8192:8192 + meta["nbytes"]])
        with trio.fail_after(5):
            while (await stats(http))["live_requests"]:
                await trio.sleep(0.01)
        gone = await http.post("/send", json={**send, "buffer_address": buf.data_ptr()})
    assert gone.status_code == 404


async def test_bad_sends_and_releases(encoder: Any) -> None:
    image = png_bytes(56, 56)
    async with encoder(transfer_backend="mooncake", send_timeout=1.0) as (_, http), \
            receiver(1 << 16) as (mc, buf):
        meta = (await http.post("/encode", json=body("b", image))).json()
        base = {"req_id": "b", "session": mc.session, "buffer_address": buf.data_ptr(),
                "buffer_length": meta["nbytes"]}
        for change, status in [({"session": "nohost"}, 400), ({"buffer_address": -5}, 400),
                               ({"buffer_length": 0}, 400), ({"req_id": "zz"}, 404),
                               ({"buffer_length": meta["nbytes"] - 1}, 400)]:
            r = await http.post("/send", json={**base, **change})
            assert r.status_code == status, (change, r.text)
        # a write outside the receiver's registered memory fails on both sides
        r = await http.post("/send", json={**base, "buffer_address": buf.data_ptr() + (1 << 30)})
        assert r.status_code == 502 and r.json()["error"]["type"] == "TransportError"
        # abort between /encode and /send releases the staged output
        await http.post("/encode", json=body("a", image))
        assert (await http.post("/abort", json={"req_id": "a"})).status_code == 200
        # nobody ever calls /send: the encoder gives up after send_timeout
        await http.post("/encode", json=body("t", image))
        with trio.fail_after(10):
            while (await stats(http))["live_requests"]:
                await trio.sleep(0.05)
        after = await stats(http)
    assert after["mooncake"]["registered_regions"] == 0
    assert after["registry"]["aborted"] == 1 and after["registry"]["failed"] >= 2


async def test_mooncake_delivery_refused_without_the_backend(encoder: Any) -> None:
    async with encoder() as (_, http):
        r = await http.post("/encode", json=body("x", png_bytes(56, 56)))
    assert r.status_code == 400 and "--transfer-backend mooncake" in r.json()["error"]["message"]


async def test_send_waiting_on_a_failed_forward_learns_why(encoder: Any) -> None:
    """The forward is held on an event until ``/send`` is waiting for it, so ``/send``
    surely arrives mid-forward (the scheduler's ``run_sync`` and the service's ``send``
    are wrapped; no fault plan, no sleep)."""
    async with encoder(transfer_backend="mooncake") as (server, http), receiver(1 << 16) as (mc, buf):
        scheduler = server.service.engine.scheduler
        forward_running, send_arrived = trio.Event(), trio.Event()
        may_fail = threading.Event()  # the forward (in its worker thread) fails once this is set
        running_at_send: list[int] = []

        token = trio.lowlevel.current_trio_token()  # the device's lane thread is not trio's

        def failing_forward(payloads: Any) -> Any:
            trio.from_thread.run_sync(forward_running.set, trio_token=token)
            if not may_fail.wait(timeout=30):
                raise AssertionError("the test never let the forward fail")
            raise EncodeError("GPU fell off")

        real_run_sync, real_send = scheduler.run_sync, server.service.send

        async def run_sync(fn: Any, payloads: Any, **kw: Any) -> Any:
            return await real_run_sync(failing_forward, payloads, **kw)

        async def send(*args: Any, **kw: Any) -> int:
            running_at_send.append(scheduler.statistics().running)
            send_arrived.set()  # no checkpoint before real_send has posted its order
            return await real_send(*args, **kw)

        scheduler.run_sync, server.service.send = run_sync, send
        try:
            meta = (await http.post("/encode", json=body("f", png_bytes(56, 56)))).json()  # sized early
            answers: list[Any] = []

            async def post_send() -> None:
                answers.append(await http.post("/send", json={
                    "req_id": "f", "session": mc.session, "buffer_address": buf.data_ptr(),
                    "buffer_length": meta["nbytes"]}))

            async with trio.open_nursery() as nursery:
                with trio.fail_after(30):
                    await forward_running.wait()
                    nursery.start_soon(post_send)
                    await send_arrived.wait()
                may_fail.set()  # only now: /send is waiting while the forward runs
        finally:
            may_fail.set()
    assert running_at_send == [1]
    (r,) = answers
    assert r.status_code == 500 and "GPU fell off" in r.json()["error"]["message"]


async def held_write(http: Any, server: Any, mc: MooncakeTransport, buf: torch.Tensor,
                     req_id: str, nursery: trio.Nursery, gate: Any) -> dict[str, Any]:
    """Stage ``req_id``, post its /send, and return once its write is surely in flight
    (held at its submit by the gate). The /send's answer goes to the nursery's task."""
    meta = (await http.post("/encode", json=body(req_id, png_bytes(56, 56)))).json()

    async def send() -> None:
        await http.post("/send", json={"req_id": req_id, "session": mc.session,
                                       "buffer_address": buf.data_ptr(), "buffer_length": meta["nbytes"]})

    nursery.start_soon(send)
    with trio.fail_after(10):
        while gate.waiting < 1:
            await trio.sleep(0.01)
    return meta


async def test_abort_says_not_released_while_a_write_is_in_flight(encoder: Any) -> None:
    """``/abort`` waits up to --send-timeout; a write the engine has not finished by then is
    answered ``released: false`` (the receiver must not reuse its buffer), and the bytes do
    land after that answer. Once the write has ended, the id is unknown (404)."""
    from epd_trio.testing.transport_faults import held_writes

    async with encoder(transfer_backend="mooncake", send_timeout=1.0) as (server, http), \
            receiver(1 << 16) as (mc, buf), trio.open_nursery() as nursery:
        with held_writes(server.service.deliveries.mooncake) as gate:
            meta = await held_write(http, server, mc, buf, "w", nursery, gate)
            started = trio.current_time()
            answer = await http.post("/abort", json={"req_id": "w"})
            waited = trio.current_time() - started
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"req_id": "w", "aborted": 1, "released": False}
            assert waited >= 1.0  # it waited for the part, up to --send-timeout
            assert not buf[:meta["nbytes"]].any()  # nothing has landed yet
        # the gate opens: the write the abort could not stop lands now, after the answer
        with trio.fail_after(15):
            while (await stats(http))["live_requests"]:
                await trio.sleep(0.01)
        assert buf[:meta["nbytes"]].any()
        assert (await http.post("/abort", json={"req_id": "w"})).status_code == 404
        after = await stats(http)
    assert after["registry"]["aborted"] == 1 and after["mooncake"]["registered_regions"] == 0


async def test_abort_says_released_once_the_part_has_let_go(encoder: Any) -> None:
    async with encoder(transfer_backend="mooncake", send_timeout=5.0) as (_server, http), \
            receiver(1 << 16) as (_mc, _buf):
        await http.post("/encode", json=body("r", png_bytes(56, 56)))  # staged, no /send yet
        answer = await http.post("/abort", json={"req_id": "r"})
    assert answer.json() == {"req_id": "r", "aborted": 1, "released": True}


async def test_a_write_left_past_its_settle_bound_keeps_abort_from_saying_released(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scope is released once its write has been waited for its bound; the write may
    still land, so until the engine says it ended an /abort of that id answers
    ``released: false`` rather than a 404 the receiver would take for "let go"."""
    from epd_trio.testing.transport_faults import held_writes

    monkeypatch.setattr("epd_trio.transport.mooncake._SETTLE_LIMIT", 0.2)
    async with encoder(transfer_backend="mooncake", send_timeout=3.0) as (server, http), \
            receiver(1 << 16) as (mc, buf), trio.open_nursery() as nursery:
        with held_writes(server.service.deliveries.mooncake) as gate:
            await held_write(http, server, mc, buf, "o", nursery, gate)
            first = await http.post("/abort", json={"req_id": "o"})
            assert first.json() == {"req_id": "o", "aborted": 1, "released": False}
            during = await stats(http)
            assert during["live_requests"] == 0 and during["registry"]["unsettled"] == 1
            assert during["mooncake"]["unsettled_writes"] == 1
            again = await http.post("/abort", json={"req_id": "o"})
            assert (again.status_code, again.json()["released"]) == (200, False)
        with trio.fail_after(15):
            while (await stats(http))["mooncake"]["unsettled_writes"]:
                await trio.sleep(0.01)
        assert (await http.post("/abort", json={"req_id": "o"})).status_code == 404
        assert (await stats(http))["registry"]["unsettled"] == 0


async def test_a_write_cut_by_the_send_timeout_answers_its_send_with_the_timeout(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /send whose write is still running when the part's send timeout runs out learns
    that (504, naming the timeout), not a 404 "released" that reads like a client error."""
    from epd_trio.testing.transport_faults import held_writes

    monkeypatch.setattr("epd_trio.transport.mooncake._SETTLE_LIMIT", 0.2)
    answers: list[Any] = []
    async with encoder(transfer_backend="mooncake", send_timeout=1.0) as (server, http), \
            receiver(1 << 16) as (mc, buf):
        with held_writes(server.service.deliveries.mooncake) as gate:
            meta = (await http.post("/encode", json=body("t", png_bytes(56, 56)))).json()
            with trio.fail_after(15):  # the part waits for orders: its send timeout runs
                while not (await stats(http))["mooncake"]["registered_regions"]:
                    await trio.sleep(0.01)
            # posted after that, the write's own bound ends after the part's timeout

            async def send() -> None:
                answers.append(await http.post("/send", json={
                    "req_id": "t", "session": mc.session, "buffer_address": buf.data_ptr(),
                    "buffer_length": meta["nbytes"]}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                with trio.fail_after(15):
                    while not answers:
                        await trio.sleep(0.01)
            assert gate.held == 1
    (answer,) = answers
    assert answer.status_code == 504, answer.text
    assert "send timeout (1.0 s)" in answer.json()["error"]["message"]
