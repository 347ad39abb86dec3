"""The client with ``grpc://`` encoder URLs: the native ``epd_trio.v1.Encoder`` service of
real encoders (gRPC on port 0 beside Hypercorn), the same answers as over HTTP.

gRPC runs on real time on grpcio's threads, so these tests use short real
deadlines under ``trio.fail_after`` and wait on real conditions (``/stats``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import grpc
import httpx
import pytest
import torch
import trio

from conftest import png_bytes
from epd_trio.client import EncoderClient, RemoteEncodeError, open_encoder_client
from epd_trio.client.answers import EncoderUnreachable, grpc_failure
from epd_trio.client.discovery import fetch_encoder_urls
from epd_trio.config import ClientConfig, EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.errors import EncodeTimeout, PeerUnavailable, ProtocolError
from epd_trio.protocol.grpc_messages import encode_body, encode_message

IMAGES = [png_bytes(56, 56, seed=1), png_bytes(84, 56, seed=2), png_bytes(56, 112, seed=3)]


@asynccontextmanager
async def encoders(model_path: str, count: int) -> AsyncIterator[list[EncoderServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_encoder(EncoderConfig(
            port=0, grpc_port=0, engine=EngineConfig(model_path=model_path))))
            for _ in range(count)]


def grpc_url(server: EncoderServer) -> str:
    assert server.grpc is not None
    return server.grpc.url


def assert_clean(client: EncoderClient) -> None:
    s = client.statistics()
    assert (s.requests_live, s.parts_live, sum(s.outstanding.values())) == (0, 0, 0), s
    assert (s.pool.slots, s.pool.used_bytes, s.pool.waiters, s.pool.leaked) == (0, 0, 0, 0), s
    assert client.grpc.statistics().in_flight == 0


async def wait_idle(servers: list[EncoderServer], timeout: float = 10.0) -> None:
    """Well under the encoders' 60 s send timeout: only a cancel or an abort ends them this fast."""
    with trio.fail_after(timeout):
        while any(s.service.registry.statistics().live_requests for s in servers):
            await trio.sleep(0.02)


async def encode_with(urls: list[str], backend: str, items: list[bytes],
                      **config: Any) -> tuple[torch.Tensor, list[int], list[tuple[str, tuple[int, ...]]]]:
    async with open_encoder_client(encoder_urls=urls, transfer_backend=backend,
                                   pool_bytes=1 << 20, **config) as client:
        async with await client.encode({"image": items}) as result:
            out = (result.embeddings["image"].clone(), list(result.token_counts["image"]),
                   [(p.encoder_url, p.item_indices) for p in result.parts])
        assert_clean(client)
        assert client.statistics().messages_dropped == 0
    return out


@pytest.mark.parametrize("backend", ["inline", "zmq"])
async def test_grpc_answers_equal_http_answers(qwen25_path: str, backend: str) -> None:
    async with encoders(qwen25_path, 1) as (server,):
        by_http = await encode_with([server.url], backend, IMAGES)
        by_grpc = await encode_with([grpc_url(server)], backend, IMAGES)
        reference = await server.service.engine.encode(IMAGES, "image")
    assert torch.equal(by_grpc[0], by_http[0]) and torch.equal(by_grpc[0], reference.embedding)
    assert by_grpc[1] == by_http[1] == reference.token_counts
    assert by_grpc[2] == [(grpc_url(server), (0, 1, 2))]


async def test_split_over_two_grpc_encoders_and_over_http_and_grpc(qwen25_path: str) -> None:
    async with encoders(qwen25_path, 2) as (s0, s1):
        by_http = await encode_with([s0.url, s1.url], "zmq", IMAGES)
        by_grpc = await encode_with([grpc_url(s0), grpc_url(s1)], "zmq", IMAGES)
        mixed = await encode_with([s0.url, grpc_url(s1)], "inline", IMAGES)
        assert s0.service.registry.statistics().live_requests == s1.service.registry.statistics().live_requests == 0
    assert torch.equal(by_grpc[0], by_http[0]) and torch.equal(mixed[0], by_http[0])
    assert by_grpc[1] == mixed[1] == by_http[1]
    assert [url for url, _ in by_grpc[2]] == [grpc_url(s0), grpc_url(s1)]
    assert mixed[2] == [(s0.url, (0, 1)), (grpc_url(s1), (2,))]


async def test_an_encoder_error_is_the_same_typed_error_as_over_http(qwen25_path: str) -> None:
    async with encoders(qwen25_path, 1) as (server,):
        errors = []
        for url in (server.url, grpc_url(server)):
            async with open_encoder_client(encoder_urls=[url], transfer_backend="inline",
                                           pool_bytes=1 << 20) as client:
                with pytest.raises(RemoteEncodeError) as info:
                    await client.encode({"image": [b"not an image"]}, req_id="bad")
                e = info.value
                errors.append((e.status_code, e.error_type, e.req_id, e.part_idx,
                               e.message.removeprefix(f"{url} part 0: ")))
                assert e.encoder_url == url
                assert_clean(client)
        assert errors[0] == errors[1] and errors[0][:2] == (400, "RequestError")
        await wait_idle([server])


async def test_an_unreachable_grpc_encoder_is_skipped(qwen25_path: str) -> None:
    with socket_port() as port:
        dead = f"grpc://127.0.0.1:{port}"
        async with encoders(qwen25_path, 1) as (server,), open_encoder_client(
                encoder_urls=[dead, grpc_url(server)], transfer_backend="inline",
                pool_bytes=1 << 20) as client:
            async with await client.encode({"image": IMAGES[:2]}) as result:
                assert [p.encoder_url for p in result.parts] == [grpc_url(server)] * 2
            assert client.statistics().retries == 1
            assert_clean(client)


async def test_a_cancel_and_a_timeout_end_the_scopes_on_the_encoder(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The encoder pushes to an endpoint nobody binds, so its Encode stays live in the
    # send (send_timeout 60 s) until the call is cancelled or its deadline passes.
    # A failed scope's last error notice to that receiver waits out its bound (5 s)
    # before the scope is released: 0.1 s here.
    monkeypatch.setattr("epd_trio.encoder.service._ERROR_NOTICE_TIMEOUT", 0.1)
    with socket_port() as port:
        async with encoders(qwen25_path, 1) as (server,), open_encoder_client(
                encoder_urls=[grpc_url(server)], pool_bytes=1 << 20,
                zmq_bind="tcp://127.0.0.1:0", zmq_advertise=f"tcp://127.0.0.1:{port}") as client:
            with pytest.raises(EncodeTimeout):
                await client.encode({"image": IMAGES[:1]}, timeout=1.5)
            await wait_idle([server])
            assert_clean(client)
            # 0 or 1: the call's own gRPC deadline and the client's timeout race to end it.
            timed_out = client.grpc.statistics().cancelled

            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.encode, {"image": IMAGES[:1]})
                with trio.fail_after(15):
                    while not server.service.registry.statistics().live_requests:
                        await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
            await wait_idle([server])
            assert_clean(client)
            assert timed_out <= 1
            assert client.grpc.statistics().cancelled == timed_out + 1  # the caller's cancel
            assert client.statistics().requests_failed == 2


async def test_closing_the_client_closes_its_channels(qwen25_path: str) -> None:
    async with encoders(qwen25_path, 2) as (s0, s1):
        client = open_encoder_client(encoder_urls=[grpc_url(s0), grpc_url(s1)],
                                     transfer_backend="inline", pool_bytes=1 << 20)
        async with client:
            assert client.grpc.statistics().channels == 0  # opened on first use
            async with await client.encode({"image": IMAGES[:2]}):
                pass
            channels = [channel for channel, _ in client.grpc._channels.values()]
            assert client.grpc.statistics().channels == len(channels) == 2
        s = client.grpc.statistics()
        assert (s.channels, s.in_flight, s.closed) == (0, 0, True)
        assert repr(client.grpc) == "<GrpcChannels 0 channels (closed), 0 calls in flight, 2 made, 0 cancelled>"
        with pytest.raises(ValueError, match="closed channel"):
            channels[0].unary_unary("/epd_trio.v1.Encoder/GetModelInfo")(b"")


# ---- the mapping and the conversions, without a network ---------------------------
@pytest.mark.parametrize(("code", "details", "error_type", "expected"), [
    ("INVALID_ARGUMENT", "bad", "RequestError", (400, "RequestError")),
    ("ALREADY_EXISTS", "dup", "DuplicateRequestError", (409, "DuplicateRequestError")),
    ("RESOURCE_EXHAUSTED", "head", "HeadersTooLargeError", (431, "HeadersTooLargeError")),
    ("RESOURCE_EXHAUSTED", "body", "PayloadTooLargeError", (413, "PayloadTooLargeError")),
    ("UNAVAILABLE", "out of memory", "EncodeError", (503, "EncodeError")),  # its own status
    ("CANCELLED", "aborted", "AbortedError", (499, "AbortedError")),
    ("INTERNAL", "internal error in the encoder", "InternalError", (500, "InternalError")),
    ("NOT_FOUND", "x", "os", (404, "os")),  # not an error class: the code decides
    ("UNIMPLEMENTED", "no such method", None, (500, "UNIMPLEMENTED")),
    ("RESOURCE_EXHAUSTED", "message larger than max", None, (413, "RESOURCE_EXHAUSTED")),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", None, EncodeTimeout),
    ("DEADLINE_EXCEEDED", "the call's deadline passed", "DeadlineExceeded", EncodeTimeout),
    ("UNAVAILABLE", "failed to connect to all addresses", None, EncoderUnreachable),
    ("UNAVAILABLE", "Socket closed", None, PeerUnavailable),
    ("CANCELLED", "Cancelled", None, PeerUnavailable),
])
def test_grpc_failures_map_onto_the_error_tree(code: str, details: str, error_type: str | None,
                                                expected: Any) -> None:
    assert code in grpc.StatusCode.__members__
    if isinstance(expected, tuple):
        status, body = grpc_failure(code, details, error_type, target="t", req_id="r")
        assert (status, body["error"]["type"], body["error"]["message"]) == (*expected, details)
    else:
        with pytest.raises(expected) as info:
            grpc_failure(code, details, error_type, target="t", req_id="r")
        assert type(info.value) is expected and info.value.req_id == "r"


@pytest.mark.parametrize("deliver", [
    None, {"backend": "inline"}, {"backend": "zmq", "endpoints": ["tcp://a:1", "tcp://b:2"]},
    {"backend": "mooncake", "receive_count": 2}])
def test_encode_message_is_the_inverse_of_encode_body(deliver: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"req_id": "r", "modality": "image", "num_parts": 3, "part_idx": 1,
                            "mm_items": ["data:x", {"url": "u", "content_hash": "sha256:0"}],
                            "hashes": ["h1", "h2"]}
    if deliver is not None:
        body["deliver"] = deliver
    back = encode_body(encode_message(body))
    assert back == {**body, "deliver": deliver} if deliver and deliver["backend"] != "inline" \
        else back == {k: v for k, v in body.items() if k != "deliver"}
    one = encode_message({**body, "deliver": {"backend": "zmq", "endpoint": "tcp://c:3"}})
    assert list(one.zmq.endpoints) == ["tcp://c:3"]


async def test_config_and_registry_lists_take_grpc_urls() -> None:
    assert ClientConfig(encoder_urls=("grpc://e:1",)).encoder_urls == ("grpc://e:1",)
    with pytest.raises(ValueError, match="grpc://"):
        ClientConfig(encoder_urls=("ftp://e:1",))
    listed = {"encoder_urls": ["grpc://E2:2/", "http://e3:3", "ftp://e4:4"]}

    def registry(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=listed)

    async with httpx.AsyncClient(transport=httpx.MockTransport(registry)) as http:
        with pytest.raises(ProtocolError, match="http://, https:// or grpc://"):
            await fetch_encoder_urls(http, "http://reg:1", 5)
        listed["encoder_urls"].pop()
        assert await fetch_encoder_urls(http, "http://reg:1", 5) == ["grpc://e2:2", "http://e3:3"]


# ---- Mooncake: an encoder process with --grpc-port ------------------------------------
class socket_port:  # noqa: N801 - used as a function: with socket_port() as port
    """A free loopback port (closed on entry: nobody listens on it)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture(scope="module")
def mooncake_encoder(qwen25_path: str) -> Iterator[tuple[str, str]]:
    """One Mooncake-capable encoder process: its (http, grpc) URLs."""
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra")
    with socket_port() as port:
        env = {**os.environ, "EPD_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR",
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with its process, below
        proc = subprocess.Popen(
            [sys.executable, "-m", "epd_trio.cli", "encoder", "--port", "0", "--grpc-port",
             str(port), "--transfer-backend", "mooncake", "--model-path", qwen25_path],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if "listening on http://" not in line:
                log.seek(0)
                pytest.fail(f"encoder did not start: {line!r}\n{log.read()[-3000:]}")
            yield line.rsplit(" ", 1)[1].strip(), f"grpc://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()


async def test_mooncake_over_grpc_equals_http(mooncake_encoder: tuple[str, str]) -> None:
    http_url, grpc = mooncake_encoder
    by_http = await encode_with([http_url], "mooncake", IMAGES)
    by_grpc = await encode_with([grpc], "mooncake", IMAGES)
    inline = await encode_with([grpc], "inline", IMAGES)
    assert torch.equal(by_grpc[0], by_http[0]) and torch.equal(by_grpc[0], inline[0])
    assert by_grpc[1] == by_http[1] and by_grpc[2] == [(grpc, (0, 1, 2))]
