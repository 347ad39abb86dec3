"""gRPC status mapping and parity with HTTP: the same bad body, sent to ``/encode`` and as an
``epd_trio.v1.Encoder`` message, fails with the mapped status, the same message as details and
the same error class in the ``epd-error-type`` trailer, so the two faces cannot drift apart."""

from __future__ import annotations

import inspect
from typing import Any

import grpc
import pytest
import trio
from grpc_health.v1 import health_pb2

from conftest import image_uri
from epd_trio import errors
from epd_trio.encoder.grpc_bridge import ERROR_TYPE_KEY, error_status
from epd_trio.errors import GRPC_STATUS, EncodeError, EPDError, grpc_status_name
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc

TOKEN = "grpc-s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
TINY = image_uri(28, 28)  # the smallest image the tiny model takes: one merged patch
MAX_BODY = 16384

# The issue's table: HTTP status → gRPC code; 413 (and 431) RESOURCE_EXHAUSTED, anything else INTERNAL.
EXPECTED = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
            409: "ALREADY_EXISTS", 413: "RESOURCE_EXHAUSTED", 431: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
            503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


# ---- the one table -------------------------------------------------------------------
def error_classes() -> list[type[EPDError]]:
    found = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, EPDError)]
    assert len(found) >= 20  # the whole tree, not an import accident
    return found


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_maps_as_the_issue_says(cls: type[EPDError]) -> None:
    exc = cls("why it failed")
    expected = EXPECTED.get(cls.status_code, "INTERNAL")
    assert grpc_status_name(exc) == expected
    assert error_status(exc) == (grpc.StatusCode[expected], "why it failed")


def test_the_table_is_the_issues_and_bugs_are_internal() -> None:
    assert dict(GRPC_STATUS) == EXPECTED
    assert grpc_status_name(EncodeError("remote said", status_code=503)) == "UNAVAILABLE"
    assert grpc_status_name(EncodeError("remote said", status_code=502)) == "INTERNAL"
    try:
        raise KeyError("secret internals")
    except KeyError as bug:
        code, details = error_status(bug)
    assert (code, details) == (grpc.StatusCode.INTERNAL, "internal error in the encoder")


# ---- end to end ------------------------------------------------------------------------
async def rpc(server: Any, method: str, message: Any, *,
              metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """One grpcio call in a worker thread: the answer, or the ``RpcError``."""
    target = server.grpc.url.removeprefix("grpc://")

    def call() -> Any:
        with grpc.insecure_channel(target) as channel:
            try:
                return getattr(pb_grpc.EncoderStub(channel), method)(message, metadata=metadata, timeout=60)
            except grpc.RpcError as exc:
                return exc

    return await trio.to_thread.run_sync(call)


def error_type(exc: grpc.RpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(ERROR_TYPE_KEY)


def encode_message(body: dict[str, Any]) -> pb.EncodeRequest:
    """The ``/encode`` JSON body as the message that means it."""
    deliver, extra = body.get("deliver") or {}, {}
    if deliver.get("backend") == "zmq":
        extra["zmq"] = pb.Zmq(endpoints=deliver["endpoints"])
    elif deliver.get("backend") == "mooncake":
        extra["mooncake"] = pb.Mooncake(receive_count=deliver["receive_count"])
    items = [pb.Item(url=i) if isinstance(i, str) else pb.Item(**i) for i in body["mm_items"]]
    return pb.EncodeRequest(req_id=body["req_id"], modality=body["modality"], mm_items=items,
                            num_parts=body.get("num_parts", 0), part_idx=body.get("part_idx", 0),
                            hashes=body.get("hashes", []), **extra)


def enc(**change: Any) -> dict[str, Any]:
    return {"req_id": "bad", "modality": "image", "mm_items": [TINY], **change}


BAD_ENCODES = {
    "empty req_id": enc(req_id=""),
    "req_id too long": enc(req_id="r" * 257),
    "bad modality": enc(modality="smell"),
    "no items": enc(mm_items=[]),
    "too many items": enc(mm_items=[TINY] * 3),  # max_items=2
    "part_idx past num_parts": enc(num_parts=2, part_idx=2),
    "bad zmq endpoint": enc(deliver={"backend": "zmq", "endpoints": ["tcp://nohost"]}),
    "no zmq endpoint": enc(deliver={"backend": "zmq", "endpoints": []}),
    "hashes count": enc(hashes=["a", "b"]),
    "empty hash": enc(hashes=[""]),
    "receive_count over 64": enc(deliver={"backend": "mooncake", "receive_count": 65}),
    "content_hash mismatch": enc(mm_items=[{"url": TINY, "content_hash": "sha256:" + "0" * 64}]),
    "undecodable image": enc(mm_items=["data:image/png;base64,AAAA"]),
    "over max_body_bytes": enc(mm_items=["data:image/png;base64," + "A" * (MAX_BODY + 1)]),
}


async def assert_parity(http_answer: Any, failed: Any, what: str) -> None:
    """The gRPC failure says what HTTP's error said: mapped status, message, class."""
    assert isinstance(failed, grpc.RpcError), (what, failed)
    error = http_answer.json()["error"]
    assert failed.code() == grpc.StatusCode[GRPC_STATUS[http_answer.status_code]], (what, http_answer.text)
    assert failed.details() == error["message"], what
    assert error_type(failed) == error["type"], what


async def test_bad_requests_fail_as_over_http(encoder: Any) -> None:
    async with encoder(grpc_port=0, transfer_backend="mooncake", max_items=2, max_body_bytes=MAX_BODY,
                       auth_token=TOKEN) as (server, http):
        codes = {}
        for what, body in BAD_ENCODES.items():
            r = await http.post("/encode", json=body)
            failed = await rpc(server, "Encode", encode_message(body))
            await assert_parity(r, failed, what)
            codes[what] = failed.code()
        metrics = (await http.get("/metrics")).text
        # a live (req_id, part_idx) — a Mooncake part waits for its /send — cannot be admitted twice
        dup = enc(req_id="dup", deliver={"backend": "mooncake", "receive_count": 1})
        assert (await http.post("/encode", json=dup)).status_code == 200
        await assert_parity(await http.post("/encode", json=dup), await rpc(server, "Encode", encode_message(dup)),
                            "duplicate")
        send = {"req_id": "dup", "part_idx": 0, "session": "127.0.0.1:1", "buffer_address": 4096,
                "buffer_length": 1}
        for what, change in {"unknown req": {"req_id": "zz"}, "empty req_id": {"req_id": ""},
                             "bad session": {"session": "nohost"}, "buffer too short": {}}.items():
            body = {**send, **change}
            await assert_parity(await http.post("/send", json=body),
                                await rpc(server, "Send", pb.SendRequest(**body)), f"send: {what}")
        unknown = {"req_id": "nobody"}
        await assert_parity(await http.post("/abort", json=unknown, headers={"Authorization": f"Bearer {TOKEN}"}),
                            await rpc(server, "Abort", pb.AbortRequest(**unknown), metadata=AUTH), "abort")
        assert (await rpc(server, "Abort", pb.AbortRequest(req_id="dup"), metadata=AUTH)).aborted == 1
        await server.service.drain()  # nothing live: returns at once, still draining
        late = enc(req_id="late")
        await assert_parity(await http.post("/encode", json=late), await rpc(server, "Encode", encode_message(late)),
                            "draining")
        stats = (await http.get("/stats")).json()
    assert codes["over max_body_bytes"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert {c for w, c in codes.items() if w != "over max_body_bytes"} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert stats["live_requests"] == 0
    # refused before parsing finished, each face counts it once under modality "unknown"
    # (HTTP's oversized body is refused by Quart, before the handler: only gRPC's is counted)
    unknown = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("epd_encoder_requests_total{") and 'modality="unknown"' in line}
    assert unknown == {'epd_encoder_requests_total{modality="unknown",outcome="RequestError"}': 2 * 11,
                       'epd_encoder_requests_total{modality="unknown",outcome="PayloadTooLargeError"}': 1}


async def test_the_token_rides_in_authorization_metadata(encoder: Any) -> None:
    async with encoder(grpc_port=0, transfer_backend="mooncake", auth_token=TOKEN) as (server, _):
        live = await rpc(server, "Encode", encode_message(enc(  # data path open without the flag
            req_id="a", deliver={"backend": "mooncake", "receive_count": 1})))
        refused = [await rpc(server, "Abort", pb.AbortRequest(req_id="a"), metadata=metadata)
                   for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                    (("authorization", f"Bearer {TOKEN}x"),))]
        allowed = await rpc(server, "Abort", pb.AbortRequest(req_id="a"), metadata=AUTH)
    assert not isinstance(live, grpc.RpcError), live
    for failed in refused:
        assert failed.code() == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in failed.details() and error_type(failed) == "UnauthorizedError"
    assert (allowed.req_id, allowed.aborted) == ("a", 1)


async def test_require_auth_for_encode_guards_encode_and_send(encoder: Any) -> None:
    async with encoder(grpc_port=0, auth_token=TOKEN, require_auth_for_encode=True) as (server, _):
        send = pb.SendRequest(req_id="zz", session="127.0.0.1:1", buffer_address=4096, buffer_length=8)
        without = [await rpc(server, "Encode", encode_message(enc(req_id="e"))), await rpc(server, "Send", send)]
        encoded = await rpc(server, "Encode", encode_message(enc(req_id="e")), metadata=AUTH)
        sent = await rpc(server, "Send", send, metadata=AUTH)
        info = await rpc(server, "GetModelInfo", pb.ModelInfoRequest())  # open, as /model_info
    assert [f.code() for f in without] == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert not isinstance(encoded, grpc.RpcError) and encoded.meta.req_id == "e"
    assert sent.code() == grpc.StatusCode.NOT_FOUND  # authorised: nothing live to send
    assert not isinstance(info, grpc.RpcError) and info.dim > 0


async def test_a_bug_is_internal_without_its_traceback(encoder: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with encoder(grpc_port=0) as (server, _):
        async def broken(req_id: str, part_idx: int | None) -> int:
            raise ZeroDivisionError("secret internals of the encoder")

        server.service.abort = broken  # type: ignore[method-assign]
        failed = await rpc(server, "Abort", pb.AbortRequest(req_id="x"))
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert failed.details() == "internal error in the encoder"
    assert error_type(failed) == "InternalError"
    assert "ZeroDivisionError" in caplog.text  # the operator's log has it; the caller does not


# ---- bytes that are not the request message ---------------------------------------------
BAD_UTF8 = bytes.fromhex("0a02fffe")  # field 1, a string, whose bytes are not UTF-8
TRUNCATED = b"\x0a\x09ab"  # field 1 says nine bytes; two follow
UNDECODABLE_RPCS = [  # (method, its request message, the payloads it cannot parse)
    ("/epd_trio.v1.Encoder/Encode", "epd_trio.v1.EncodeRequest", (BAD_UTF8, TRUNCATED)),
    ("/epd_trio.v1.Encoder/Send", "epd_trio.v1.SendRequest", (BAD_UTF8, TRUNCATED)),
    ("/epd_trio.v1.Encoder/Abort", "epd_trio.v1.AbortRequest", (BAD_UTF8, TRUNCATED)),
    ("/epd_trio.v1.Encoder/GetModelInfo", "epd_trio.v1.ModelInfoRequest", (TRUNCATED,)),
    ("/sglang.grpc.encoder.SglangEncoder/Encode", "sglang.grpc.encoder.EncodeRequest", (BAD_UTF8, TRUNCATED)),
    ("/sglang.grpc.encoder.SglangEncoder/Send", "sglang.grpc.encoder.SendRequest", (BAD_UTF8, TRUNCATED)),
    ("/sglang.grpc.encoder.SglangEncoder/SchedulerReceiveUrl", "sglang.grpc.encoder.SchedulerReceiveUrlRequest",
     (BAD_UTF8, TRUNCATED)),
    ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest", (BAD_UTF8, TRUNCATED)),
]


async def raw_rpc(server: Any, method: str, payload: bytes, *, stream: bool = False,
                  metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """Send ``payload`` as the request's bytes, unserialized: the answer's bytes, or the ``RpcError``."""
    target = server.grpc.url.removeprefix("grpc://")

    def call() -> Any:
        with grpc.insecure_channel(target) as channel:
            try:
                if stream:
                    return next(iter(channel.unary_stream(method)(payload, metadata=metadata, timeout=60)))
                return channel.unary_unary(method)(payload, metadata=metadata, timeout=60)
            except grpc.RpcError as exc:
                return exc

    return await trio.to_thread.run_sync(call)


def assert_not_a_message(failed: Any, message_name: str, what: str) -> None:
    assert isinstance(failed, grpc.RpcError), (what, failed)
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, failed.code(), failed.details())
    assert failed.details() == f"the request is not a valid {message_name} message", what
    assert "<class" not in failed.details() and "DecodeError" not in failed.details(), what
    assert error_type(failed) == "RequestError", what


async def test_bytes_that_are_not_the_request_message_are_invalid_argument(encoder: Any) -> None:
    async with encoder(grpc_port=0) as (server, http):
        for method, message_name, payloads in UNDECODABLE_RPCS:
            for payload in payloads:
                failed = await raw_rpc(server, method, payload)
                assert_not_a_message(failed, message_name, f"{method} {payload!r}")
        metrics = (await http.get("/metrics")).text
        # each refused Encode is counted, as HTTP counts a body that does not parse
        assert 'epd_encoder_requests_total{modality="unknown",outcome="RequestError"} 4.0' in metrics
        watched = await raw_rpc(server, "/grpc.health.v1.Health/Watch", BAD_UTF8, stream=True)
        assert_not_a_message(watched, "grpc.health.v1.HealthCheckRequest", "Watch")
        # the same methods still take their messages, as raw bytes too
        info = await raw_rpc(server, "/epd_trio.v1.Encoder/GetModelInfo", b"")
        health = await raw_rpc(server, "/grpc.health.v1.Health/Check", b"")
    assert pb.ModelInfo.FromString(info).dim > 0
    assert health_pb2.HealthCheckResponse.FromString(health).status == health_pb2.HealthCheckResponse.SERVING


async def test_the_token_is_checked_before_the_message_is(encoder: Any) -> None:
    """As HTTP, which never parses an unauthenticated body: no token, UNAUTHENTICATED."""
    async with encoder(grpc_port=0, auth_token=TOKEN, require_auth_for_encode=True) as (server, _):
        without = [await raw_rpc(server, method, BAD_UTF8) for method in (
            "/epd_trio.v1.Encoder/Encode", "/epd_trio.v1.Encoder/Abort",
            "/sglang.grpc.encoder.SglangEncoder/Encode")]
        with_token = await raw_rpc(server, "/epd_trio.v1.Encoder/Abort", BAD_UTF8, metadata=AUTH)
    assert [f.code() for f in without] == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert_not_a_message(with_token, "epd_trio.v1.AbortRequest", "Abort with the token")
