"""The gRPC runtime's lifecycle: start, graceful SIGTERM, busy port, hard cancel,
client deadlines and cancels, and the trio bridge underneath.

All through the standard grpcio client. gRPC runs on real time on its own
thread: a request is held open by a fault plan's real delay, or by sending to
a ZMQ endpoint that nobody has bound yet (its receiver binds when the test
wants the request to finish); waits are real conditions under
``trio.fail_after``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import image_uri, listening_url, spawn
from epd_trio.encoder import server as server_module
from epd_trio.encoder.grpc_bridge import TrioBridge, _Pending, error_status
from epd_trio.errors import NotReadyError
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc
from epd_trio.testing import Fault, FaultPlan, install_faults
from epd_trio.transport.zmq import PullReceiver

HOLD = 30.0  # a preprocessing delay no test waits out: its request ends only by cancellation


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def encode_request(req_id: str, endpoint: str | None = None) -> pb.EncodeRequest:
    request = pb.EncodeRequest(req_id=req_id, modality="image", mm_items=[pb.Item(url=image_uri())])
    if endpoint is not None:
        request.zmq.endpoints.append(endpoint)
    return request


def code_of(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def in_thread(fn: Callable[[], Any], timeout: float = 30) -> Any:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn)


async def until(condition: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll a real condition (gRPC is on real time), bounded."""
    with trio.fail_after(timeout):
        while not await condition():
            await trio.sleep(0.01)


def grpc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("grpc ") and t.is_alive()]


def trio_tasks() -> list[str]:
    tasks, stack = [], [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        tasks.append(task.name)
        stack.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return sorted(tasks)


def hold_preprocessing(server: Any) -> FaultPlan:
    plan = FaultPlan(0, [Fault("preprocess", delay=HOLD)])
    install_faults(plan, server.service.engine)
    return plan


# ---- the CLI, as an operator runs it ------------------------------------------------------
async def test_cli_serves_grpc_and_sigterm_drains_it(qwen25_path: str) -> None:
    """SIGTERM with a gRPC Encode in flight: it completes, a new one is UNAVAILABLE, exit 0."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # bound only once the drain has been seen
    with spawn("encoder", "--port", "0", "--grpc-port", "0", "--model-path", qwen25_path) as proc:
        url = await listening_url(proc)
        line = await in_thread(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.startswith("epd-trio encoder serving gRPC on grpc://"), line
        target = line.rsplit(" ", 1)[1].strip().removeprefix("grpc://")
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.EncoderStub(channel)
            health = await in_thread(lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30).status)
            assert health == health_pb2.HealthCheckResponse.SERVING
            inflight = stub.Encode.future(encode_request("inflight", endpoint), timeout=60)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                async def stats() -> dict[str, Any]:
                    return (await http.get("/stats")).json()

                await until(lambda: _is(stats, "live_requests", 1))
                proc.send_signal(signal.SIGTERM)
                await until(lambda: _is(stats, "draining", True))
                late = await in_thread(lambda: code_of(
                    lambda: stub.Encode(encode_request("late"), timeout=30)))
            async with PullReceiver(endpoint) as pull:
                with trio.fail_after(30):
                    header, _ = await pull.receive()
            answer = await in_thread(lambda: inflight.result(timeout=30))
        code = await in_thread(lambda: proc.wait(timeout=60), timeout=90)
        stderr = proc.stderr.read()  # type: ignore[union-attr]
    assert late == grpc.StatusCode.UNAVAILABLE
    assert answer.meta.req_id == "inflight" and (header.req_id, header.kind) == ("inflight", "embedding")
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr


async def _is(stats: Callable[[], Any], key: str, value: Any) -> bool:
    return (await stats())[key] == value


async def test_a_busy_grpc_port_is_a_clear_start_up_error(qwen25_path: str) -> None:
    """Another gRPC server (grpcio sets SO_REUSEPORT on its sockets) holds the port: the
    encoder cannot silently share it, and says so before its model loads, in one line."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with spawn("encoder", "--port", "0", "--grpc-port", str(port), "--model-path", qwen25_path) as proc:
            code = await in_thread(lambda: proc.wait(timeout=120), timeout=150)
            stdout, stderr = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    assert code == 2, stderr
    assert f"epd-trio: error: cannot listen on 127.0.0.1:{port} (--host, --grpc-port)" in stderr, stderr
    assert "Traceback" not in stderr and "listening" not in stdout and "loading" not in stderr


async def test_a_busy_port_leaves_no_thread_in_process(encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port taken while the model loads, after the encoder's own check: grpcio's bind fails."""
    async def taken_after_the_check(*args: Any) -> None:
        return None

    monkeypatch.setattr(server_module, "check_bindable", taken_after_the_check)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="cannot serve gRPC"), flatten_subgroups=True):
            async with encoder(grpc_port=other.getsockname()[1]):
                pass  # pragma: no cover
    assert grpc_threads() == []


# ---- hard stops, deadlines and cancels in process -------------------------------------------
async def test_a_hard_cancel_with_calls_in_flight_ends_everything(encoder: Any) -> None:
    before = trio_tasks()
    channel: grpc.Channel | None = None
    with trio.fail_after(60), trio.CancelScope() as hard:
        async with encoder(grpc_port=0) as (server, _):
            hold_preprocessing(server)
            channel = grpc.insecure_channel(server.grpc.url.removeprefix("grpc://"))
            stub = pb_grpc.EncoderStub(channel)
            calls = [stub.Encode.future(encode_request(f"h{i}"), timeout=60) for i in range(3)]
            registry = server.service.registry
            await until(lambda: _live(registry, 3))
            hard.cancel()
    assert hard.cancelled_caught and channel is not None
    codes = await in_thread(lambda: [code_of(lambda c=c: c.result(timeout=20)) for c in calls])
    channel.close()
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, codes
    assert grpc_threads() == []
    assert trio_tasks() == before


async def _live(registry: Any, count: int) -> bool:
    return registry.statistics().live_requests == count


async def test_the_client_deadline_is_the_request_deadline(encoder: Any) -> None:
    async with encoder(grpc_port=0) as (server, _), PullReceiver() as pull:
        hold_preprocessing(server)
        with grpc.insecure_channel(server.grpc.url.removeprefix("grpc://")) as channel:
            stub = pb_grpc.EncoderStub(channel)
            code = await in_thread(lambda: code_of(
                lambda: stub.Encode(encode_request("short", pull.last_endpoint), timeout=0.5)))
        with trio.fail_after(10):
            header, payload = await pull.receive()
        await until(lambda: _live(server.service.registry, 0))
        registry, bridge = server.service.registry.statistics(), server.grpc.bridge.statistics()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (header.req_id, header.kind, payload) == ("short", "error", None)
    assert header.error is not None and header.error.type in ("DeadlineExceeded", "AbortedError")
    assert registry.live_requests == 0 and registry.completed == 0
    assert bridge.inflight == 0


async def test_a_client_cancel_aborts_the_scope(encoder: Any) -> None:
    async with encoder(grpc_port=0) as (server, http), PullReceiver() as pull:
        hold_preprocessing(server)
        with grpc.insecure_channel(server.grpc.url.removeprefix("grpc://")) as channel:
            call = pb_grpc.EncoderStub(channel).Encode.future(
                encode_request("gone", pull.last_endpoint), timeout=60)
            await until(lambda: _live(server.service.registry, 1))
            assert call.cancel()
            with trio.fail_after(10):
                header, payload = await pull.receive()
            await until(lambda: _live(server.service.registry, 0))
        stats = (await http.get("/stats")).json()
        bridge = server.grpc.bridge.statistics()
    assert (header.req_id, header.kind, payload) == ("gone", "error", None)
    assert header.error is not None and header.error.type == "AbortedError", header.error
    assert stats["live_requests"] == 0 and stats["registry"]["aborted"] == 1
    assert bridge.cancelled == 1 and bridge.inflight == 0


# ---- the bridge on its own: an asyncio loop in a thread, a trio nursery here ----------------
def run_asyncio(main: Callable[[], Any]) -> Any:
    return asyncio.run(main())


async def test_a_cancelled_call_cancels_its_trio_task() -> None:
    started, cancelled = threading.Event(), trio.Event()

    async def work() -> None:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)

        async def main() -> bool:
            task = asyncio.ensure_future(bridge.run(work, None))
            await asyncio.to_thread(started.wait, 10)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return task.cancelled()

        assert await in_thread(lambda: run_asyncio(main))
        with trio.fail_after(10):
            await cancelled.wait()
        await until(lambda: _true(bridge.statistics().inflight == 0))
    assert bridge.statistics().cancelled == 1 and bridge.statistics().calls == 1


async def _true(value: bool) -> bool:
    return value


async def test_a_call_the_closing_nursery_cancels_is_answered() -> None:
    """Cancelled from outside (the gRPC nursery closing at a hard stop), the task
    still settles its RPC: the handler hears UNAVAILABLE instead of waiting on."""
    started = threading.Event()

    async def work() -> None:
        started.set()
        await trio.sleep_forever()

    token, error = trio.lowlevel.current_trio_token(), None
    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(token, nursery)

        async def main() -> BaseException | None:
            task = asyncio.ensure_future(bridge.run(work, None))
            await asyncio.to_thread(started.wait, 10)
            token.run_sync_soon(nursery.cancel_scope.cancel)
            done, _ = await asyncio.wait([task], timeout=10)
            return task.exception() if done else None

        # Not abandoned on cancel: the nursery's own cancellation waits for this thread.
        error = await trio.to_thread.run_sync(lambda: run_asyncio(main))
    assert isinstance(error, NotReadyError) and error_status(error)[0] == grpc.StatusCode.UNAVAILABLE


async def test_a_call_after_the_nursery_closed_is_unavailable() -> None:
    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)

    async def work() -> int:
        return 1  # pragma: no cover - never started

    async def main() -> BaseException | None:
        try:
            await bridge.run(work, None)
        except NotReadyError as exc:
            return exc
        return None

    error = await in_thread(lambda: run_asyncio(main))
    assert error is not None and error_status(error)[0] == grpc.StatusCode.UNAVAILABLE


def test_a_call_after_the_trio_run_ended_is_unavailable() -> None:
    async def opened() -> TrioBridge:
        async with trio.open_nursery() as nursery:
            return TrioBridge(trio.lowlevel.current_trio_token(), nursery)

    bridge = trio.run(opened)

    async def work() -> int:
        return 1  # pragma: no cover - never started

    with pytest.raises(NotReadyError):
        asyncio.run(bridge.run(work, None))


def test_settling_after_the_loop_closed_does_not_raise() -> None:
    loop = asyncio.new_event_loop()
    pending: _Pending[int] = _Pending(loop)
    loop.close()
    pending.settle(1, None)
    pending.settle(None, NotReadyError("late"))
