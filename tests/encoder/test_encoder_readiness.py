"""A shutdown takes the encoder out of rotation at once: ``/health`` (a Kubernetes readiness
probe, a registry's health loop) says 503 "draining" from its first moment, while requests
from clients that have not heard yet are still served until the drain."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from conftest import image_uri
from epd_trio.bootstrap import registration
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import run_encoder


async def _silent_registry(seen: list[bytes], goodbye: trio.Event,
                           task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A registry that reads each request's first line and never answers: the encoder's
    goodbye (``DELETE /unregister_encoder_url``) hangs until its bound."""
    async def hold(stream: trio.SocketStream) -> None:
        line = b""
        with trio.move_on_after(30):
            while b"\r\n" not in line:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                line += chunk
            seen.append(line.split(b"\r\n", 1)[0])
            if line.startswith(b"DELETE"):
                goodbye.set()
            await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(hold, listeners)


async def test_health_fails_from_the_start_of_a_shutdown_while_requests_are_still_served(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registration, "UNREGISTER_TIMEOUT", 20.0)  # the window we look through
    seen: list[bytes] = []
    goodbye = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_silent_registry, seen, goodbye)
        config = EncoderConfig(port=0, register_url=(f"http://127.0.0.1:{port}",),
                               engine=EngineConfig(model_path=qwen25_path))
        server: Any = await nursery.start(run_encoder, config)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            server.shutdown()
            with trio.fail_after(30):
                await goodbye.wait()  # shutting down: saying goodbye to the registry
            health = await http.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            body = {"req_id": "late-client", "modality": "image", "mm_items": [image_uri()]}
            assert (await http.post("/encode", json=body)).status_code == 200  # still admitted
        nursery.cancel_scope.cancel()
    assert any(line.startswith(b"DELETE /unregister_encoder_url") for line in seen)
