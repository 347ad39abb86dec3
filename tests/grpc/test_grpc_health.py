"""grpc.health.v1 and server reflection, as Kubernetes, grpc_health_probe and grpcurl use them.

Everything goes through the standard grpcio client (sync stubs, called in
``trio.to_thread``): gRPC runs on real time on its own thread, so waits are
real conditions bounded by ``trio.fail_after``, never sleeps.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import trio
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from conftest import image_uri
from epd_trio.encoder import grpc_health
from epd_trio.encoder.grpc_server import SERVICES
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc
from epd_trio.transport.zmq import PullReceiver

Status = health_pb2.HealthCheckResponse
SERVING, NOT_SERVING, SERVICE_UNKNOWN = Status.SERVING, Status.NOT_SERVING, Status.SERVICE_UNKNOWN


def target(server: Any) -> str:
    return server.grpc.url.removeprefix("grpc://")


async def in_thread(fn: Callable[[], Any]) -> Any:
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(fn)


def check(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                      timeout=30).status


def check_code(channel: grpc.Channel, service: str) -> grpc.StatusCode:
    try:
        check(channel, service)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class Watcher:
    """One Watch stream; ``next()`` is its next message, read in a thread."""

    def __init__(self, channel: grpc.Channel, service: str = "") -> None:
        self.stream: Any = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=60)

    async def next(self) -> int:
        return (await in_thread(lambda: next(self.stream))).status

    async def rest(self) -> tuple[list[int], grpc.StatusCode]:
        """The messages left and the status the stream ended with."""
        def drain() -> list[int]:
            return [message.status for message in self.stream]
        return await in_thread(drain), self.stream.code()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_check_is_serving_for_every_service_and_not_found_for_others(encoder: Any) -> None:
    async with encoder(grpc_port=0) as (server, http):
        with grpc.insecure_channel(target(server)) as channel:
            statuses = await in_thread(lambda: {name: check(channel, name) for name in ("", *SERVICES)})
            unknown = await in_thread(lambda: check_code(channel, "no.such.Service"))
        health = (await http.get("/health")).status_code
    assert statuses == dict.fromkeys(("", *SERVICES), SERVING) and health == 200
    assert unknown == grpc.StatusCode.NOT_FOUND


async def test_a_failing_probe_is_not_serving_and_watchers_share_one_check(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the probe failing nothing is ever fresh: each check would probe again.
    Watch streams opened one after another within ``WATCH_INTERVAL`` share the
    first stream's check instead (this interval is made long, so any second
    probe would come from a stream of its own)."""
    monkeypatch.setattr(grpc_health, "WATCH_INTERVAL", 600.0)
    async with encoder(grpc_port=0, health_timeout=1e-6) as (server, http):
        with grpc.insecure_channel(target(server)) as channel:
            watchers = []
            for _ in range(4):
                watchers.append(Watcher(channel))
                assert await watchers[-1].next() == NOT_SERVING
            probes = (await http.get("/stats")).json()["health"]["probes"]
            status = await in_thread(lambda: check(channel))  # Check is never cached
            after = (await http.get("/stats")).json()["health"]
            for watcher in watchers:
                watcher.stream.cancel()
    assert probes == 1
    assert status == NOT_SERVING and after["probes"] == 2 and after["probe_failures"] == 2


async def test_drain_is_not_serving_and_pushed_to_watchers_at_once(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live request holds the drain open: it sends to a ZMQ endpoint nobody has
    bound yet, and its receiver binds once the draining status has been seen.
    The watch interval is made long, so NOT_SERVING can only come from the wake."""
    monkeypatch.setattr(grpc_health, "WATCH_INTERVAL", 600.0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    held = {"req_id": "held", "modality": "image", "mm_items": [image_uri()],
            "deliver": {"backend": "zmq", "endpoint": endpoint}}
    results: dict[str, Any] = {}
    async with encoder(grpc_port=0) as (server, http):
        channel = grpc.insecure_channel(target(server))
        watcher, unknown = Watcher(channel), Watcher(channel, "no.such.Service")
        assert await watcher.next() == SERVING
        assert await unknown.next() == SERVICE_UNKNOWN
        async with trio.open_nursery() as nursery:
            async def hold() -> None:
                results["held"] = await http.post("/encode", json=held)

            nursery.start_soon(hold)
            with trio.fail_after(10):
                while (await http.get("/stats")).json()["live_requests"] != 1:
                    await trio.sleep(0.01)
            nursery.start_soon(server.service.drain)
            results["pushed"] = await watcher.next()  # the same stream, woken by the drain
            results["check"] = await in_thread(lambda: check(channel))
            results["encode"] = await in_thread(lambda: encode_code(channel))
            results["unknown_open"] = unknown.stream.is_active()
            async with PullReceiver(endpoint) as pull:  # now the held request can finish
                with trio.fail_after(10):
                    header, _ = await pull.receive()
    # Leaving the block stopped the server: the streams end, they are not cut off after a grace.
    rest, code = await watcher.rest()
    unknown_rest, unknown_code = await unknown.rest()
    channel.close()
    assert results["pushed"] == NOT_SERVING and results["check"] == NOT_SERVING
    assert results["encode"] == grpc.StatusCode.UNAVAILABLE
    assert results["held"].status_code == 200 and (header.req_id, header.kind) == ("held", "embedding")
    assert results["unknown_open"]
    assert (rest, code) == ([], grpc.StatusCode.OK)
    assert (unknown_rest, unknown_code) == ([], grpc.StatusCode.OK)


def encode_code(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        pb_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(
            req_id="late", modality="image", mm_items=[pb.Item(url=image_uri())]), timeout=30)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def reflected(channel: grpc.Channel) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """What grpcurl sees without a proto file: the services, and Encoder's methods."""
    database = ProtoReflectionDescriptorDatabase(channel)
    services = sorted(database.get_services())
    pool = descriptor_pool.DescriptorPool(database)
    encoder = pool.FindServiceByName("epd_trio.v1.Encoder")
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in encoder.methods}
    return services, methods


async def test_reflection_lists_the_services_and_describes_the_native_one(encoder: Any) -> None:
    async with encoder(grpc_port=0) as (server, _):
        with grpc.insecure_channel(target(server)) as channel:
            services, methods = await in_thread(lambda: reflected(channel))
    assert set(services) >= {"sglang.grpc.encoder.SglangEncoder", "epd_trio.v1.Encoder",
                             "grpc.health.v1.Health", reflection.SERVICE_NAME}
    assert methods == {
        "Encode": ("epd_trio.v1.EncodeRequest", "epd_trio.v1.EncodeResponse"),
        "Send": ("epd_trio.v1.SendRequest", "epd_trio.v1.SendResponse"),
        "Abort": ("epd_trio.v1.AbortRequest", "epd_trio.v1.AbortResponse"),
        "GetModelInfo": ("epd_trio.v1.ModelInfoRequest", "epd_trio.v1.ModelInfo"),
    }
