"""Seeded real-clock chaos over the gRPC face (``epd_trio.v1.Encoder``, grpcio clients).

As ``test_chaos_real`` does for HTTP: one chaos encoder and one clean encoder
run in process with ``--grpc-port``, shared by every seed. A seed draws its
whole script first: gRPC callers (inline or ZMQ to a read sink) whose client
deadline is tiny, short or long, that ``cancel()`` their call, or that are
cut off by an ``Abort`` RPC; half the seeds also install a random server
``FaultPlan`` (delays, errors, cancellations at the engine's, scheduler's and
service's points). Clean gRPC traffic on the clean encoder runs beside.

For every caller: a correct embedding, or a typed status (``epd-error-type``
trailing metadata) or its own deadline/cancel, within its deadline + ``SLACK``;
with client-side faults only, never a 5xx-like status or a 5xx error notice.
Every request the chaos encoder started tells the ZMQ receiver how it ended.
Afterwards: ``/stats`` idle, no bridged RPC in flight, and the encoder still
encodes right; at the end health is ``SERVING``, and once the servers are
closed no gRPC thread is left and no socket leaked. ``EPD_CHAOS_SEED=5`` (or
``5,9``) replays seeds; ``EPD_CHAOS_VERBOSE=1 pytest -s`` prints each script.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import grpc
import httpx
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.grpc_bridge import ERROR_TYPE_KEY
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc
from epd_trio.testing import FaultPlan, install_faults
from real_calls import Call, ScenarioReport, req_id_for
from real_world import SLACK, Media, MessageSink, References, encoder_stats, settle

DEFAULT_SEEDS = range(24)
SEND_TIMEOUT = 1.0
LONG = 30.0
SERVER_POINTS = ("media_load", "preprocess", "admission", "forward", "send", "release")
# Statuses the client library makes itself: the call's own deadline and cancel.
CLIENT_SIDE = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
SERVER_FAULTY = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}


def selected_seeds() -> list[int]:
    raw = os.environ.get("EPD_CHAOS_SEED", "").replace(",", " ").split()
    return [int(s) for s in raw] if raw else list(DEFAULT_SEEDS)


class GrpcWorld:
    """The servers, their channels and what checks their answers."""

    def __init__(self, chaos: EncoderServer, clean: EncoderServer, http: httpx.AsyncClient,
                 media: Media, refs: References) -> None:
        self.chaos, self.clean, self.http, self.media, self.refs = chaos, clean, http, media, refs
        self.channels = {name: grpc.insecure_channel(s.grpc.url.removeprefix("grpc://"))  # type: ignore[union-attr]
                         for name, s in (("chaos", chaos), ("clean", clean))}
        self.stubs = {name: pb_grpc.EncoderStub(channel) for name, channel in self.channels.items()}

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def request(self, req_id: str, indices: Sequence[int], endpoint: str | None) -> pb.EncodeRequest:
        request = pb.EncodeRequest(req_id=req_id, modality="image",
                                   mm_items=[pb.Item(url=u) for u in self.media.items(indices)])
        if endpoint is not None:
            request.zmq.endpoints.append(endpoint)
        return request


async def finished(future: grpc.Future) -> None:
    """Wait for a grpcio future without a thread: its callback wakes trio."""
    done, token = trio.Event(), trio.lowlevel.current_trio_token()

    def wake(_: Any) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(wake)
    await done.wait()


def typed(future: grpc.Future) -> str | None:
    """The ``epd-error-type`` the server put in the trailers, if any."""
    return dict(future.trailing_metadata() or ()).get(ERROR_TYPE_KEY)


# ---- one gRPC caller ----------------------------------------------------------------------------
async def grpc_encode(world: GrpcWorld, report: ScenarioReport, label: str, req_id: str,
                      indices: Sequence[int], *, endpoint: str | None, timeout: float,
                      cancel_at: float | None, faults: bool) -> tuple[Call, Any]:
    deadline = timeout if cancel_at is None else min(timeout, cancel_at)
    call = Call(label, "grpc", deadline, client_fault_only=not faults)
    report.calls.append(call)
    t0 = trio.current_time()
    future = world.stubs["chaos"].Encode.future(world.request(req_id, indices, endpoint), timeout=timeout)
    with trio.move_on_after(deadline + SLACK + 10.0) as hard:
        with trio.move_on_after(cancel_at if cancel_at is not None else float("inf")):
            await finished(future)
        if not future.done():
            future.cancel()
            await finished(future)
    call.elapsed = trio.current_time() - t0
    if hard.cancelled_caught:
        call.outcome = "hung"
        future.cancel()
    if call.elapsed > deadline + SLACK:
        report.violate("hang", f"{label}: {call.outcome} after {call.elapsed:.2f} s, deadline {deadline:.3f} s")
    if call.outcome == "hung":
        return call, None
    if future.cancelled():
        call.outcome = "cancelled"
        return call, None
    code = future.code()
    if code == grpc.StatusCode.OK:
        call.outcome = "ok"
        answer = future.result()
        if endpoint is None:
            tensor, meta = decode_safetensors(answer.safetensors)
            if problem := world.refs.check(indices, tensor, meta["token_counts"]):
                report.violate("wrong", f"{label}: {problem}")
        return call, answer
    call.outcome, call.error = "error", typed(future) or code.name
    if code not in CLIENT_SIDE and typed(future) is None:
        report.violate("untyped", f"{label}: {code.name} {future.details()!r} without {ERROR_TYPE_KEY}")
    if not faults and code in SERVER_FAULTY:
        report.violate("client_5xx", f"{label}: {code.name} {future.details()!r}")
    return call, None


# ---- a seed's script ---------------------------------------------------------------------------
def draw(seed: int, media: Media) -> dict[str, Any]:
    rng = random.Random(seed)
    script: dict[str, Any] = {"faults": seed % 2 == 1, "backend": rng.choice(["inline", "zmq"]),
                              "callers": []}
    for i in range(rng.randint(1, 4)):
        indices = rng.sample(media.small, rng.randint(1, 2))
        if rng.random() < 0.3:
            indices.append(rng.choice(media.large))
        mode = rng.choice(["deadline", "cancel", "abort", "whole"])
        at = rng.choice([rng.uniform(0.001, 0.02), rng.uniform(0.02, 0.2), rng.uniform(0.2, 0.8)])
        script["callers"].append((f"g{i}", indices, mode, at, rng.uniform(0, 0.2)))
    return script


async def run_seed(world: GrpcWorld, seed: int) -> ScenarioReport:
    script = draw(seed, world.media)
    report = ScenarioReport(seed, f"grpc-{'faults' if script['faults'] else 'client'}-{script['backend']}")
    report.script = [f"{label}: items {idx} {mode} {at:.3f}s after {d:.2f}s"
                     for label, idx, mode, at, d in script["callers"]]
    plan = FaultPlan.random(seed, points=SERVER_POINTS, max_delay=0.5) if script["faults"] else None
    service = world.chaos.service
    install_faults(plan, service.engine, *service.engine.schedulers, service)
    before = await encoder_stats(world.http, world.chaos.url)
    t0 = trio.current_time()
    answered: dict[str, tuple[list[int], bool]] = {}
    try:
        async with trio.open_nursery() as nursery:
            sink = await nursery.start(MessageSink().run) if script["backend"] == "zmq" else None
            async with trio.open_nursery() as callers:
                stop = trio.Event()
                nursery.start_soon(clean_traffic, world, random.Random(f"clean-{seed}"), stop, report)
                for args in script["callers"]:
                    callers.start_soon(caller, world, report, sink, answered, plan is not None, *args)
            stop.set()
            if sink is not None:
                await settle(world.http, [world.chaos.url], {})
                await check_sink(world, report, sink, answered, before, plan is not None)
            nursery.cancel_scope.cancel()
    finally:
        install_faults(None, service.engine, *service.engine.schedulers, service)
    if plan is not None:
        report.script.append(plan.describe())
    await aftermath(world, report, random.Random(f"check-{seed}"))
    report.elapsed = trio.current_time() - t0
    return report


async def caller(world: GrpcWorld, report: ScenarioReport, sink: MessageSink | None,
                 answered: dict[str, tuple[list[int], bool]], faults: bool, label: str,
                 indices: list[int], mode: str, at: float, delay: float) -> None:
    await trio.sleep(delay)
    req_id = req_id_for(report.seed, label)
    endpoint = None if sink is None else sink.endpoint
    timeout = at if mode == "deadline" else LONG
    cancel_at = at if mode == "cancel" else None
    async with trio.open_nursery() as nursery:
        aborted: list[float] = []
        if mode == "abort":
            nursery.start_soon(abort_later, world, report, label, req_id, at, aborted)
        call, answer = await grpc_encode(world, report, label, req_id, indices, endpoint=endpoint,
                                         timeout=timeout, cancel_at=cancel_at, faults=faults)
        ended = trio.current_time()
    answered[req_id] = (indices, answer is not None)
    if mode == "abort" and call.outcome == "error" and aborted and ended - aborted[0] > SLACK:
        report.violate("hang", f"{label}: failed {ended - aborted[0]:.2f} s after its Abort")


async def abort_later(world: GrpcWorld, report: ScenarioReport, label: str, req_id: str, at: float,
                      aborted: list[float]) -> None:
    await trio.sleep(at)
    aborted.append(trio.current_time())
    future = world.stubs["chaos"].Abort.future(pb.AbortRequest(req_id=req_id), timeout=LONG)
    await finished(future)
    if future.code() not in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND):
        report.violate("unexpected", f"{label} Abort: {future.code().name} {future.details()!r}")


async def check_sink(world: GrpcWorld, report: ScenarioReport, sink: MessageSink,
                     answered: dict[str, tuple[list[int], bool]], before: dict[str, Any], faults: bool) -> None:
    """Every request the encoder started told the receiver how it ended."""
    after = await encoder_stats(world.http, world.chaos.url)
    started = after["registry"]["started"] - before["registry"]["started"]
    with trio.move_on_after(2.0):  # loopback: in flight for milliseconds
        while len([r for r in answered if sink.messages.get(r)]) < started:
            await trio.sleep(0.02)
    heard = len([r for r in answered if sink.messages.get(r)])
    if heard != started:
        report.violate("wrong", f"the encoder started {started} requests; the receiver heard of {heard}")
    for req_id, (indices, ok) in answered.items():
        messages = sink.messages.get(req_id, [])
        if ok and not any(h.kind == "embedding" for h, _ in messages):
            report.violate("wrong", f"{req_id}: answered OK but no embedding arrived")
        for header, tensor in messages:
            if header.kind == "embedding":
                assert tensor is not None
                if problem := world.refs.check(indices, tensor, header.token_counts):
                    report.violate("wrong", f"{req_id} over ZMQ: {problem}")
            elif not faults and header.error is not None and \
                    header.error.type not in ("AbortedError", "DeadlineExceeded"):
                report.violate("client_5xx", f"{req_id}: error notice {header.error}")


async def clean_traffic(world: GrpcWorld, rng: random.Random, stop: trio.Event, report: ScenarioReport) -> None:
    """gRPC requests on the clean encoder until ``stop`` (at least one): all must succeed."""
    n = 0
    while True:
        indices = rng.sample(world.media.small, rng.randint(1, 2))
        t0 = trio.current_time()
        future = world.stubs["clean"].Encode.future(
            world.request(req_id_for(report.seed, f"clean{n}"), indices, None), timeout=LONG)
        await finished(future)
        if future.code() != grpc.StatusCode.OK:
            report.violate("clean", f"clean request {n}: {future.code().name} {future.details()!r}")
        else:
            tensor, meta = decode_safetensors(future.result().safetensors)
            if problem := world.refs.check(indices, tensor, meta["token_counts"]):
                report.violate("clean", f"clean request {n}: {problem}")
        report.clean_latencies.append(trio.current_time() - t0)
        n += 1
        if stop.is_set():
            return
        await trio.sleep(rng.uniform(0.01, 0.05))


async def aftermath(world: GrpcWorld, report: ScenarioReport, rng: random.Random) -> None:
    """Everything idle (``/stats``, the bridges), and the chaos encoder still encodes right."""
    for problem in await settle(world.http, [world.chaos.url, world.clean.url], {}):
        report.violate("leak", problem)
    with trio.move_on_after(5.0):
        while any(s.grpc.bridge.statistics().inflight for s in (world.chaos, world.clean)):  # type: ignore[union-attr]
            await trio.sleep(0.02)
    for name, server in (("chaos", world.chaos), ("clean", world.clean)):
        if inflight := server.grpc.bridge.statistics().inflight:  # type: ignore[union-attr]
            report.violate("leak", f"{name} gRPC bridge: {inflight} calls still in flight")
    indices = [rng.choice(world.media.small)]
    future = world.stubs["chaos"].Encode.future(
        world.request(req_id_for(report.seed, "check"), indices, None), timeout=LONG)
    await finished(future)
    if future.code() != grpc.StatusCode.OK:
        report.violate("broken", f"chaos encoder: {future.code().name} {future.details()!r}")
    else:
        tensor, meta = decode_safetensors(future.result().safetensors)
        if problem := world.refs.check(indices, tensor, meta["token_counts"]):
            report.violate("broken", f"chaos encoder: {problem}")


def grpc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("grpc ") and t.is_alive()]


def open_sockets() -> set[str]:
    """The inodes of this process's open sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def tcp_sockets() -> set[str]:
    """Those that are TCP (listening or connected): what servers, channels and sinks hold."""
    tcp = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            tcp.update(line.split()[9] for line in list(lines)[1:])
    return open_sockets() & tcp


async def test_grpc_chaos(qwen25_path: str) -> None:
    seeds = selected_seeds()
    tcp_before = tcp_sockets()
    async with AsyncExitStack() as stack:
        def config() -> EncoderConfig:
            return EncoderConfig(port=0, grpc_port=0, send_timeout=SEND_TIMEOUT,
                                 engine=EngineConfig(model_path=qwen25_path))

        chaos = await stack.enter_async_context(serve_encoder(config()))
        clean = await stack.enter_async_context(serve_encoder(config()))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0))
        media = Media()
        refs = References(media)
        await refs.from_engine(clean.service.engine)
        world = GrpcWorld(chaos, clean, http, media, refs)
        stack.callback(world.close)
        warm: int | None = None  # sockets once the first seed has opened what is lazily kept
        for seed in seeds:
            report = await run_seed(world, seed)
            print(report.describe() if os.environ.get("EPD_CHAOS_VERBOSE") else report.summary())
            assert not report.violations, report.describe()
            warm = len(open_sockets()) if warm is None else warm
        assert warm is not None and len(open_sockets()) <= warm, "sockets grew over the seeds"
        assert len(grpc_threads()) == 2
        health = health_pb2_grpc.HealthStub(world.channels["chaos"]).Check.future(
            health_pb2.HealthCheckRequest(), timeout=LONG)
        await finished(health)
        assert health.result().status == health_pb2.HealthCheckResponse.SERVING
    assert grpc_threads() == []
    # Servers, channels and sinks are closed: no TCP socket they opened is left.
    with trio.fail_after(10):
        while tcp_sockets() - tcp_before:
            await trio.sleep(0.05)
