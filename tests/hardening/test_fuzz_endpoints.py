"""Hypothesis over every JSON endpoint: never a 5xx, never a hang; healthy and quiescent after.

A real encoder and a real registry (Hypercorn on loopback ports) run in a
background thread's trio loop for the whole module; the examples are plain
synchronous HTTP calls with a short timeout (a hang fails the example).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_trio.bootstrap.server import serve_bootstrap
from epd_trio.config import BootstrapConfig, EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.testing import quiescence_problems
from fuzz_strategies import abort_bodies, encode_bodies, raw, raw_bodies, registry_bodies, send_bodies

# tools/fuzz.py raises the count; CI runs a few hundred examples in all.
EXAMPLES = settings(max_examples=int(os.environ.get("EPD_FUZZ_EXAMPLES", "120")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class Servers:
    """serve_encoder + serve_bootstrap in a trio loop on another thread."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.urls: dict[str, str] = {}
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=lambda: trio.run(self._main), daemon=True)

    async def _main(self) -> None:
        self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
        config = EncoderConfig(port=0, engine=EngineConfig(model_path=self.model_path), send_timeout=1.0,
                               request_timeout=5.0, max_body_bytes=1 << 20, auth_token="fuzz-token")
        async with serve_encoder(config) as enc, \
                serve_bootstrap(BootstrapConfig(port=0, auth_token="fuzz-token")) as reg:
            self.urls = {"encoder": enc.url, "registry": reg.url}
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Servers:
        self._thread.start()
        assert self._ready.wait(120), "servers did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None and self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(60)


@pytest.fixture(scope="module")
def servers(qwen25_path: str) -> Iterator[Servers]:
    with Servers(qwen25_path) as running:
        yield running


def post(servers: Servers, which: str, path: str, content: bytes, token: bool = False) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer fuzz-token"
    # A hang would show as a timeout here and fail the example.
    return httpx.post(servers.urls[which] + path, content=content, headers=headers, timeout=20)


def no_5xx(response: httpx.Response, body: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300], body)
    if response.headers.get("content-type", "").startswith("application/json"):
        error = response.json()
        if response.status_code >= 400:
            assert set(error) == {"error", "req_id"} and set(error["error"]) == {"type", "message"}


@EXAMPLES
@given(body=encode_bodies)
def test_fuzz_encode(servers: Servers, body: dict) -> None:
    no_5xx(post(servers, "encoder", "/encode", raw(body)), body)


@EXAMPLES
@given(body=send_bodies)
def test_fuzz_send(servers: Servers, body: dict) -> None:
    no_5xx(post(servers, "encoder", "/send", raw(body)), body)


@EXAMPLES
@given(body=abort_bodies, token=st.booleans())
def test_fuzz_abort(servers: Servers, body: dict, token: bool) -> None:
    response = post(servers, "encoder", "/abort", raw(body), token)
    no_5xx(response, body)
    if not token:
        assert response.status_code == 401


@EXAMPLES
@given(body=registry_bodies, path=st.sampled_from(["/register_encoder_url", "/unregister_encoder_url"]))
def test_fuzz_registry(servers: Servers, body: dict, path: str) -> None:
    no_5xx(post(servers, "registry", path, raw(body), token=True), body)


@EXAMPLES
@given(content=raw_bodies, path=st.sampled_from(["/encode", "/send", "/abort"]))
def test_fuzz_raw_bytes(servers: Servers, content: bytes, path: str) -> None:
    no_5xx(post(servers, "encoder", path, content, token=True), content)


def test_healthy_and_quiescent_after_fuzzing(servers: Servers) -> None:
    # Runs after the fuzz tests in this module (pytest keeps file order).
    url = servers.urls["encoder"]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    for _ in range(100):
        stats = httpx.get(url + "/stats", timeout=10).json()
        if not quiescence_problems({"encoder": stats}):
            break
        trio.run(trio.sleep, 0.1)
    assert quiescence_problems({"encoder": stats}) == []
    good = {"req_id": "after", "modality": "image", "mm_items": ["data:image/png;base64," + _tiny_png()]}
    assert post(servers, "encoder", "/encode", raw(good)).status_code == 200


def _tiny_png() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (1, 2, 3)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
