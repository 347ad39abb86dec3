"""Hypothesis over every JSON endpoint: never a 5xx, never a hang; healthy and quiescent after.

Each test runs its own real encoder and registry (Hypercorn on loopback ports)
in a background thread's trio loop, so no test depends on another or on their
order; the examples are plain synchronous HTTP calls with a short timeout (a
hang fails the example). After its examples, each test waits (bounded) for the
encoder's last request scope to end and checks that it is healthy, quiescent and
still serving.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from epd_trio.bootstrap.server import serve_bootstrap
from epd_trio.config import BootstrapConfig, EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.testing import quiescence_problems
from fuzz_strategies import (
    abort_bodies,
    encode_bodies,
    raw,
    raw_bodies,
    registry_bodies,
    send_bodies,
    sglang_encode_bodies,
    sglang_rank_bodies,
)

# tools/fuzz.py raises the count; CI runs 40 per test, ~300 in all.
EXAMPLES = settings(max_examples=int(os.environ.get("EPD_FUZZ_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class Servers:
    """serve_encoder + serve_bootstrap in a trio loop on another thread."""

    def __init__(self, model_path: str, **config: Any) -> None:
        self.model_path = model_path
        self.config = config  # EncoderConfig fields beside the fuzzing defaults
        self.urls: dict[str, str] = {}
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._encoder: EncoderServer | None = None
        self._thread = threading.Thread(target=lambda: trio.run(self._main), daemon=True)

    async def _main(self) -> None:
        self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
        fields = {"send_timeout": 1.0, "request_timeout": 5.0, "max_body_bytes": 1 << 20,
                  "auth_token": "fuzz-token", **self.config}
        config = EncoderConfig(port=0, engine=EngineConfig(model_path=self.model_path), **fields)
        async with serve_encoder(config) as enc, \
                serve_bootstrap(BootstrapConfig(port=0, auth_token="fuzz-token")) as reg:
            self.urls = {"encoder": enc.url, "registry": reg.url}
            self._encoder = enc
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Servers:
        self._thread.start()
        assert self._ready.wait(120), "servers did not start"
        return self

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the encoder has no live request scope: its registry's idle event, bounded.

        A scope can outlive its HTTP answer (a failed ZMQ delivery still tries to
        tell the receiver, for up to ``send_timeout``).
        """
        async def idle() -> None:
            assert self._encoder is not None
            with trio.fail_after(timeout):
                await self._encoder.service.registry.wait_idle()

        trio.from_thread.run(idle, trio_token=self._token)

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None and self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(60)


@pytest.fixture
def servers(qwen25_path: str) -> Iterator[Servers]:
    """Each test its own servers: nothing carries over from another test."""
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


def healthy_quiescent_and_serving(servers: Servers) -> None:
    """What every fuzz test checks after its examples."""
    servers.wait_idle()
    url = servers.urls["encoder"]
    assert quiescence_problems({"encoder": httpx.get(url + "/stats", timeout=10).json()}) == []
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    good = {"req_id": "after", "modality": "image", "mm_items": ["data:image/png;base64," + _tiny_png()]}
    assert post(servers, "encoder", "/encode", raw(good)).status_code == 200


def test_fuzz_encode(servers: Servers) -> None:
    @EXAMPLES
    @given(body=encode_bodies)
    def examples(body: dict) -> None:
        no_5xx(post(servers, "encoder", "/encode", raw(body)), body)

    examples()
    healthy_quiescent_and_serving(servers)


def test_fuzz_send(servers: Servers) -> None:
    @EXAMPLES
    @given(body=send_bodies)
    def examples(body: dict) -> None:
        no_5xx(post(servers, "encoder", "/send", raw(body)), body)

    examples()
    healthy_quiescent_and_serving(servers)


def test_fuzz_abort(servers: Servers) -> None:
    @EXAMPLES
    @given(body=abort_bodies, token=st.booleans())
    def examples(body: dict, token: bool) -> None:
        response = post(servers, "encoder", "/abort", raw(body), token)
        no_5xx(response, body)
        if not token:
            assert response.status_code == 401

    examples()
    healthy_quiescent_and_serving(servers)


def test_fuzz_registry(servers: Servers) -> None:
    @EXAMPLES
    @given(body=registry_bodies, path=st.sampled_from(["/register_encoder_url", "/unregister_encoder_url"]))
    def examples(body: dict, path: str) -> None:
        no_5xx(post(servers, "registry", path, raw(body), token=True), body)

    examples()
    assert httpx.get(servers.urls["registry"] + "/health", timeout=10).status_code == 200
    healthy_quiescent_and_serving(servers)


def test_fuzz_raw_bytes(servers: Servers) -> None:
    @EXAMPLES
    @given(content=raw_bodies, path=st.sampled_from(["/encode", "/send", "/abort"]))
    def examples(content: bytes, path: str) -> None:
        no_5xx(post(servers, "encoder", path, content, token=True), content)

    examples()
    healthy_quiescent_and_serving(servers)


def _tiny_png() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (1, 2, 3)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("backend", ["zmq_to_scheduler", "mooncake"])
def test_fuzz_sglang_face(qwen25_path: str, backend: str) -> None:
    """``--api sglang``: SGLang's bodies on its routes are answered in SGLang's error shape,
    never a 500 and never a hang; a well-formed part nobody claims ends in a 504 (its
    deadline), and afterwards the encoder is healthy and holds nothing."""
    paths = ["/scheduler_receive_url", "/scheduler_receive_meta_data", "/send"]
    with Servers(qwen25_path, api="sglang", encoder_transfer_backend=backend,
                 request_timeout=0.5, send_timeout=0.5) as servers:
        @EXAMPLES
        @given(body=sglang_encode_bodies, rank=sglang_rank_bodies, path=st.sampled_from(paths))
        def examples(body: dict, rank: dict, path: str) -> None:
            for where, sent in (("/encode", body), (path, rank)):
                response = post(servers, "encoder", where, raw(sent), token=True)
                assert response.status_code < 500 or response.status_code == 504, \
                    (where, response.status_code, response.text[:300], sent)
                if response.status_code >= 400:
                    assert set(response.json()) == {"status", "message", "req_id"}, response.text

        examples()
        servers.wait_idle()
        url = servers.urls["encoder"]
        assert quiescence_problems({"encoder": httpx.get(url + "/stats", timeout=10).json()}) == []
        assert httpx.get(url + "/health", timeout=30).status_code == 200
