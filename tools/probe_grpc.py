"""Probe: the candidate ways to serve gRPC from a trio program, side by side.

grpcio's servers are asyncio- or thread-based and purerpc (trio-native) is unmaintained, so
before building the gRPC face we measure each way of reaching a **trio** service function from a
gRPC handler, with the standard grpcio client in a separate process (no shared GIL):

* **A** ``grpc.aio`` server on its own thread and asyncio loop; each call runs as one trio task
  spawned through ``TrioToken.run_sync_soon`` (no thread per call), answered through an asyncio
  future set with ``call_soon_threadsafe``; an asyncio cancellation cancels the task's scope.
* **A2** A with ``sys.setswitchinterval(0.0005)`` in the server (CPython's default is 5 ms).
* **B** grpcio's thread-pool server; each handler blocks its thread in ``trio.from_thread.run``;
  cancellation through ``context.add_callback``.
* **C** Hypercorn's trio worker serving a minimal gRPC ASGI app over h2c (length-prefixed
  messages, ``grpc-status`` in the ``http.response.trailers`` extension).
* **D** trio-asyncio running ``grpc.aio`` on the trio thread (``--trio-asyncio-path``: a
  ``pip install --target`` folder, never the shared venv).
* **E** purerpc: only whether pip can install it beside this Hypercorn (``pip --dry-run``).

Per candidate: unary echo latency (1 client, p50/p99), calls/s with 16 concurrent clients
(``grpc.aio``, one channel each) and the server process's CPU per call meanwhile (every thread:
the bridging cost, whatever the client's own speed), whether a client cancel and an expired
deadline cancel the trio task of the call (and after how long), and whether
``grpc.health.v1.Health/Watch`` streams a first status and then a change pushed later (and the
stream's trio side ends on cancel).

    python tools/probe_grpc.py [--quick] [--candidates A A2 B C D E]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import outcome
import trio
from grpc_health.v1 import health_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trio.lowlevel

import bench_results  # tools/: the results file the docs are built from

SERVICE = "probe.Probe"
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT_S = 3.0  # how long the trio side waits for a call to start or end before answering anyway
END = object()  # the end of a bridged stream


# ---------------------------------------------------------------- the trio service (all candidates)

@dataclass
class CallRecord:
    """What the trio side saw of one slow call (``time.monotonic`` is system-wide on Linux)."""

    started: float | None = None
    ended: float | None = None
    cancelled: bool = False
    started_event: trio.Event = field(default_factory=trio.Event)
    ended_event: trio.Event = field(default_factory=trio.Event)


class TrioService:
    """The work behind every candidate: trio functions, reached from the gRPC handlers."""

    def __init__(self) -> None:
        self.calls: dict[str, CallRecord] = {}
        self.watchers = 0
        self._status = SERVING
        self._changed = trio.Event()
        self._idle = trio.Event()

    def record(self, call_id: str) -> CallRecord:
        return self.calls.setdefault(call_id, CallRecord())

    async def echo(self, payload: bytes) -> bytes:
        await trio.lowlevel.checkpoint()
        return payload

    async def slow(self, call_id: bytes) -> bytes:
        """Never answers: the client cancels it or its deadline expires."""
        record = self.record(call_id.decode())
        record.started = time.monotonic()
        record.started_event.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            record.cancelled = True
            raise
        finally:
            record.ended = time.monotonic()
            record.ended_event.set()
        return b""  # pragma: no cover

    async def wait_started(self, call_id: bytes) -> bytes:
        with trio.move_on_after(WAIT_S):
            await self.record(call_id.decode()).started_event.wait()
        return b""

    async def call_info(self, call_id: bytes) -> bytes:
        """The call's record as JSON, once it has ended (or after ``WAIT_S``)."""
        record = self.record(call_id.decode())
        with trio.move_on_after(WAIT_S):
            await record.ended_event.wait()
        info = {"started": record.started, "ended": record.ended, "cancelled": record.cancelled}
        return json.dumps(info).encode()

    async def set_health(self, status: bytes) -> bytes:
        self._status = int(status)
        self._changed.set()
        self._changed = trio.Event()
        return b""

    async def cpu_seconds(self, _: bytes) -> bytes:
        """The server process's CPU time so far, all threads (what the calls cost it)."""
        return repr(time.process_time()).encode()

    async def wait_no_watchers(self, _: bytes) -> bytes:
        """The number of Watch streams still running on the trio side, after at most ``WAIT_S``."""
        with trio.move_on_after(WAIT_S):
            while self.watchers:
                await self._idle.wait()
        return str(self.watchers).encode()

    async def watch(self, service: str) -> AsyncIterator[int]:
        """Health ``Watch``: the status now, then each change."""
        del service  # one status for every name in this probe
        self.watchers += 1
        try:
            while True:
                changed = self._changed
                yield self._status
                await changed.wait()
        finally:
            self.watchers -= 1
            if not self.watchers:
                self._idle.set()
                self._idle = trio.Event()

    def unary_methods(self) -> dict[str, Callable[[bytes], Awaitable[bytes]]]:
        return {"Echo": self.echo, "Slow": self.slow, "WaitStarted": self.wait_started,
                "CallInfo": self.call_info, "SetHealth": self.set_health,
                "WaitNoWatchers": self.wait_no_watchers, "CpuSeconds": self.cpu_seconds}


async def pump(service: TrioService, name: str, scope: trio.CancelScope,
               emit: Callable[[object], None]) -> None:
    """Run one Watch on the trio side, handing each status (then ``END``) to ``emit``."""
    with scope:
        async with contextlib.aclosing(service.watch(name)) as updates:
            async for status in updates:
                emit(status)
    emit(END)


def watch_response(status: object) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=status)  # type: ignore[arg-type]


# ---------------------------------------------------------------- A: grpc.aio thread + trio tasks

class AsyncioToTrio:
    """Runs trio functions for handlers on an asyncio loop in another thread, one task per call.

    No thread per call: the call is spawned into the trio side's nursery by
    ``TrioToken.run_sync_soon`` and its outcome comes back through ``call_soon_threadsafe``; a
    cancelled handler (client cancel, deadline, server stop) cancels the task's scope.
    """

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self._token = token
        self._nursery = nursery

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[outcome.Outcome] = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: outcome.Outcome) -> None:
            if not done.done():
                done.set_result(result)

        async def run() -> None:
            result: outcome.Outcome = outcome.Error(asyncio.CancelledError())
            with scope:
                try:
                    result = outcome.Value(await fn(*args))
                except Exception as exc:  # noqa: BLE001 - handed to the handler, which raises it
                    result = outcome.Error(exc)
            with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, result)

        self._spawn(run, lambda error: loop.call_soon_threadsafe(settle, error))
        try:
            return (await done).unwrap()
        except asyncio.CancelledError:
            self._cancel(scope)
            raise

    async def stream(self, service: TrioService, name: str) -> AsyncIterator[object]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[object] = asyncio.Queue()  # Watch: a few small statuses at most
        scope = trio.CancelScope()

        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(updates.put_nowait, item)

        self._spawn(functools.partial(pump, service, name, scope, emit), lambda _: emit(END))
        try:
            while (item := await updates.get()) is not END:
                yield item
        finally:
            self._cancel(scope)

    def _spawn(self, fn: Callable[[], Awaitable[None]],
               on_error: Callable[[outcome.Outcome], None]) -> None:
        """Start ``fn`` in the trio side's nursery; if the trio side is gone, tell ``on_error``."""
        def spawn() -> None:
            try:
                self._nursery.start_soon(fn)
            except RuntimeError as exc:  # the nursery is closed: the server is stopping
                on_error(outcome.Error(exc))
        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError as exc:
            on_error(outcome.Error(exc))

    def _cancel(self, scope: trio.CancelScope) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # no trio side, nothing left to cancel
            self._token.run_sync_soon(scope.cancel)


def aio_handlers(service: TrioService,
                 unary: Callable[[Callable[[bytes], Awaitable[bytes]], bytes], Awaitable[bytes]],
                 watch: Callable[[str], AsyncIterator[object]]) -> list[grpc.GenericRpcHandler]:
    """Generic (bytes in, bytes out) handlers for a ``grpc.aio`` server, through one bridge."""
    def method(fn: Callable[[bytes], Awaitable[bytes]]) -> grpc.RpcMethodHandler:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await unary(fn, request)
        return grpc.unary_unary_rpc_method_handler(handle)

    async def handle_watch(request: health_pb2.HealthCheckRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for status in watch(request.service):
            yield watch_response(status)

    probe = {name: method(fn) for name, fn in service.unary_methods().items()}
    health = {"Watch": grpc.unary_stream_rpc_method_handler(
        handle_watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}
    return [grpc.method_handlers_generic_handler(SERVICE, probe),
            grpc.method_handlers_generic_handler(HEALTH, health)]


class AioServerThread:
    """A ``grpc.aio`` server on its own thread and asyncio loop, started and stopped from trio."""

    def __init__(self, bridge: AsyncioToTrio, service: TrioService) -> None:
        self._bridge = bridge
        self._service = service
        self._token = trio.lowlevel.current_trio_token()
        self._ready = trio.Event()
        self._result: outcome.Outcome | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="grpc-aio", daemon=True)

    async def start(self) -> int:
        self._thread.start()
        await self._ready.wait()
        assert self._result is not None
        return self._result.unwrap()

    async def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        await trio.to_thread.run_sync(self._thread.join)

    def _report(self, result: outcome.Outcome) -> None:
        def report() -> None:
            self._result = result
            self._ready.set()
        self._token.run_sync_soon(report)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - the thread's end, reported to the trio side
            if self._result is None:
                self._report(outcome.Error(exc))

    async def _serve(self) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(aio_handlers(
            self._service, self._bridge.call,
            lambda name: self._bridge.stream(self._service, name)))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._report(outcome.Value(port))
        await self._stop.wait()
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def serve_aio_thread(service: TrioService) -> AsyncIterator[int]:
    """Candidate A; yields the bound port."""
    async with trio.open_nursery() as nursery:
        bridge = AsyncioToTrio(trio.lowlevel.current_trio_token(), nursery)
        server = AioServerThread(bridge, service)
        try:
            yield await server.start()
        finally:
            with trio.CancelScope(shield=True):
                await server.stop()
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- B: thread pool + from_thread

def call_from_thread(token: trio.lowlevel.TrioToken, context: grpc.ServicerContext,
                     fn: Callable[[bytes], Awaitable[bytes]], request: bytes) -> bytes:
    """Block this pool thread on ``fn`` in trio; the RPC's end (cancel, deadline) cancels it."""
    scope = trio.CancelScope()

    def cancel() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(scope.cancel)

    async def scoped() -> bytes | None:
        with scope:
            return await fn(request)
        return None

    if not context.add_callback(cancel):
        cancel()  # the RPC has already ended
    answer = trio.from_thread.run(scoped, trio_token=token)
    if answer is None:
        context.abort(grpc.StatusCode.CANCELLED, "cancelled")
    return answer


@contextlib.asynccontextmanager
async def serve_thread_pool(service: TrioService) -> AsyncIterator[int]:
    """Candidate B; yields the bound port."""
    token = trio.lowlevel.current_trio_token()
    async with trio.open_nursery() as nursery:
        def method(fn: Callable[[bytes], Awaitable[bytes]]) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: call_from_thread(token, context, fn, request))

        def watch(request: health_pb2.HealthCheckRequest,
                  context: grpc.ServicerContext) -> Iterator[Any]:
            updates: queue.SimpleQueue[object] = queue.SimpleQueue()
            scope = trio.CancelScope()
            context.add_callback(lambda: token.run_sync_soon(scope.cancel))
            trio.from_thread.run_sync(nursery.start_soon, pump, service, request.service, scope,
                                      updates.put, trio_token=token)
            while (status := updates.get()) is not END:
                yield watch_response(status)

        server = grpc.server(ThreadPoolExecutor(max_workers=64, thread_name_prefix="grpc-pool"))
        server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(
                SERVICE, {name: method(fn) for name, fn in service.unary_methods().items()}),
            grpc.method_handlers_generic_handler(HEALTH, {
                "Watch": grpc.unary_stream_rpc_method_handler(
                    watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                    response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield port
        finally:
            with trio.CancelScope(shield=True):
                stopped = server.stop(grace=None)
                await trio.to_thread.run_sync(stopped.wait)
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- C: Hypercorn trio worker (ASGI)

GRPC_STATUS = {"OK": b"0", "CANCELLED": b"1", "DEADLINE_EXCEEDED": b"4", "UNIMPLEMENTED": b"12",
               "INTERNAL": b"13"}
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def unframe(body: bytes) -> bytes:
    """The single message of a unary request body (the probe's clients never compress)."""
    if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
        raise ValueError("not one uncompressed gRPC message")
    return body[5:]


def grpc_timeout(headers: list[tuple[bytes, bytes]]) -> float:
    """The ``grpc-timeout`` header in seconds (inf when absent)."""
    for name, value in headers:
        if name == b"grpc-timeout" and value[-1:] in TIMEOUT_UNITS:
            return int(value[:-1]) * TIMEOUT_UNITS[value[-1:]]
    return float("inf")


class GrpcAsgi:
    """The least gRPC an ASGI app must speak for this probe: unary calls and Health/Watch."""

    def __init__(self, service: TrioService) -> None:
        self._unary = {f"/{SERVICE}/{name}": fn for name, fn in service.unary_methods().items()}
        self._service = service

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if message["type"] == "http.disconnect":
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._cancel_on_disconnect, receive, nursery.cancel_scope)
            with trio.move_on_after(grpc_timeout(scope["headers"])) as deadline:
                if scope["path"] == f"/{HEALTH}/Watch":
                    await self._watch(unframe(body), send)
                elif (fn := self._unary.get(scope["path"])) is not None:
                    await self._answer(send, "OK", frame(await fn(unframe(body))))
                else:
                    await self._answer(send, "UNIMPLEMENTED", b"")
            if deadline.cancelled_caught:
                await self._answer(send, "DEADLINE_EXCEEDED", b"")
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _cancel_on_disconnect(receive: Callable[[], Awaitable[dict]],
                                    scope: trio.CancelScope) -> None:
        """A client cancel is an HTTP/2 RST_STREAM, which Hypercorn passes on as a disconnect."""
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    @staticmethod
    async def _start(send: Callable[[dict], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": 200, "trailers": True,
                    "headers": [(b"content-type", b"application/grpc")]})

    async def _answer(self, send: Callable[[dict], Awaitable[None]], status: str,
                      body: bytes) -> None:
        await self._start(send)
        await send({"type": "http.response.body", "body": body, "more_body": False})
        await send({"type": "http.response.trailers",
                    "headers": [(b"grpc-status", GRPC_STATUS[status])], "more_trailers": False})

    async def _watch(self, request: bytes, send: Callable[[dict], Awaitable[None]]) -> None:
        name = health_pb2.HealthCheckRequest.FromString(request).service
        await self._start(send)
        async with contextlib.aclosing(self._service.watch(name)) as updates:
            async for status in updates:
                body = frame(watch_response(status).SerializeToString())
                await send({"type": "http.response.body", "body": body, "more_body": True})


@contextlib.asynccontextmanager
async def serve_hypercorn(service: TrioService) -> AsyncIterator[int]:
    """Candidate C; yields the bound port (cleartext HTTP/2 with prior knowledge, as grpcio)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"  # no "Running on" line in the table's output
    config.keep_alive_timeout = 3600.0  # grpcio keeps its connection between calls
    # Hypercorn's default (1000) sends GOAWAY on the 1001st stream of a connection, and grpcio
    # fails that call with UNAVAILABLE ("GOAWAY received; Error code: 1") instead of retrying it.
    config.keep_alive_max_requests = 2**62
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve(
            GrpcAsgi(service), config, shutdown_trigger=stop.wait, task_status=task_status))
        try:
            yield int(urls[0].rsplit(":", 1)[1])
        finally:
            stop.set()


# ---------------------------------------------------------------- D: trio-asyncio + grpc.aio

@contextlib.asynccontextmanager
async def serve_trio_asyncio(service: TrioService) -> AsyncIterator[int]:
    """Candidate D: ``grpc.aio`` on trio-asyncio's loop, on the trio thread; yields the port."""
    import trio_asyncio

    async def unary(fn: Callable[[bytes], Awaitable[bytes]], request: bytes) -> bytes:
        return await trio_asyncio.trio_as_aio(fn)(request)

    def watch(name: str) -> AsyncIterator[object]:
        return trio_asyncio.trio_as_aio(service.watch(name))

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(aio_handlers(service, unary, watch))
        server.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server

    async with trio_asyncio.open_loop():
        server = await trio_asyncio.aio_as_trio(start)()
        try:
            yield server.port
        finally:
            with trio.CancelScope(shield=True):
                await trio_asyncio.aio_as_trio(server.stop)(None)


# ---------------------------------------------------------------- E: purerpc

def purerpc_check() -> str:
    """Whether pip can install purerpc 0.8.0 beside the Hypercorn installed here (dry run)."""
    from importlib.metadata import requires, version

    with tempfile.TemporaryDirectory() as target:
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--target",
                   target, "purerpc==0.8.0", f"hypercorn=={version('hypercorn')}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return "not checked (pip timed out)"
    if done.returncode == 0:
        return "installable beside hypercorn (not measured)"
    needs = ", ".join(r for r in requires("hypercorn") or [] if r.startswith("h2"))
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        if "purerpc 0.8.0 depends on h2" in line:
            return (f"not installable beside hypercorn {version('hypercorn')} (pins "
                    f"{line.split('depends on ', 1)[1].strip()}; hypercorn needs {needs})")
    return f"not installable (pip: {done.stderr.strip().splitlines()[-1:]})"


# ---------------------------------------------------------------- the grpcio client side

def probe_stub(channel: grpc.Channel, name: str) -> Callable[..., Any]:
    return channel.unary_unary(f"/{SERVICE}/{name}")


def echo_calls(target: str, payloads: list[bytes]) -> tuple[list[bytes], list[float]]:
    """Sequential unary echoes from one client: the answers and each call's seconds."""
    answers, seconds = [], []
    with grpc.insecure_channel(target) as channel:
        echo = probe_stub(channel, "Echo")
        for payload in payloads:
            started = time.perf_counter()
            answers.append(echo(payload, timeout=10))
            seconds.append(time.perf_counter() - started)
    return answers, seconds


async def _throughput(target: str, clients: int, seconds: float, payload: bytes) -> float:
    options = [("grpc.use_local_subchannel_pool", 1)]  # one connection per client
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(clients)]
    try:
        stubs = [channel.unary_unary(f"/{SERVICE}/Echo") for channel in channels]
        for stub in stubs:
            await stub(payload, timeout=10)
        count = 0
        deadline = time.perf_counter() + seconds

        async def client(stub: grpc.aio.UnaryUnaryMultiCallable) -> None:
            nonlocal count
            while time.perf_counter() < deadline:
                assert await stub(payload, timeout=10) == payload
                count += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(stub) for stub in stubs))
        return count / (time.perf_counter() - started)
    finally:
        for channel in channels:
            await channel.close()


def throughput(target: str, clients: int, seconds: float, payload: bytes) -> tuple[float, float]:
    """Calls/s of ``clients`` concurrent grpc.aio clients, each on its own channel, and the
    server's CPU seconds per call meanwhile (its process, every thread)."""
    with grpc.insecure_channel(target) as channel:
        cpu = probe_stub(channel, "CpuSeconds")
        before = float(cpu(b"", timeout=10))
        rate = asyncio.run(_throughput(target, clients, seconds, payload))
        used = float(cpu(b"", timeout=10)) - before
    return rate, used / (rate * seconds)


@dataclass(frozen=True)
class CancelResult:
    """Whether the trio task of a call was cancelled, and how long after the client's end."""

    cancelled: bool
    delay_s: float | None
    client_code: str

    def cell(self) -> str:
        if not self.cancelled or self.delay_s is None:
            return f"no (client: {self.client_code})"
        verdict = "yes" if self.delay_s < 1.0 else "late"
        return f"{verdict}, {self.delay_s * 1000:.1f} ms"


def cancel_probe(target: str, deadline_s: float | None) -> CancelResult:
    """A slow call the client cancels (``deadline_s`` None) or lets expire; the trio side's view."""
    call_id = uuid.uuid4().hex.encode()
    with grpc.insecure_channel(target) as channel:
        if deadline_s is None:
            future = probe_stub(channel, "Slow").future(call_id, timeout=30)
            probe_stub(channel, "WaitStarted")(call_id, timeout=10)
            ended_at = time.monotonic()
            future.cancel()
            code = "CANCELLED" if future.cancelled() else "not cancelled"
        else:
            ended_at = time.monotonic() + deadline_s
            try:
                probe_stub(channel, "Slow")(call_id, timeout=deadline_s)
                code = "answered"
            except grpc.RpcError as exc:
                code = exc.code().name
        info = json.loads(probe_stub(channel, "CallInfo")(call_id, timeout=10))
    if not info["cancelled"] or info["ended"] is None:
        return CancelResult(False, None, code)
    return CancelResult(True, max(0.0, info["ended"] - ended_at), code)


@dataclass(frozen=True)
class WatchResult:
    statuses: list[int]
    push_s: float
    watchers_left: int



def watch_cell(results: list[WatchResult]) -> str:
    """Watches in a row: did each see both statuses, and how many trio sides outlived the cancel."""
    if any(result.statuses != [SERVING, NOT_SERVING] for result in results):
        return f"no (saw {[result.statuses for result in results]})"
    push_ms = statistics.median(result.push_s for result in results) * 1000
    left = results[-1].watchers_left  # the count is the server's: it adds up over the row
    ends = (f"trio side ended after each of {len(results)} cancels" if not left
            else f"trio side LEFT RUNNING after {left} of {len(results)} cancels")
    return f"yes, change after {push_ms:.1f} ms; {ends}"


def watch_probe(target: str) -> WatchResult:
    """Health Watch: the first status, then a change set through another call, then cancel."""
    with grpc.insecure_channel(target) as channel:
        watch = channel.unary_stream(
            f"/{HEALTH}/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        stream = watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        statuses = [next(stream).status]
        started = time.perf_counter()
        probe_stub(channel, "SetHealth")(str(NOT_SERVING).encode(), timeout=10)
        statuses.append(next(stream).status)
        pushed = time.perf_counter() - started
        stream.cancel()
        left = int(probe_stub(channel, "WaitNoWatchers")(b"", timeout=10))
        probe_stub(channel, "SetHealth")(str(SERVING).encode(), timeout=10)
    return WatchResult(statuses, pushed, left)


# ---------------------------------------------------------------- the run: one server process each

@dataclass(frozen=True)
class Candidate:
    title: str
    serve: Callable[[TrioService], contextlib.AbstractAsyncContextManager[int]]
    switch_interval_s: float | None = None  # the server's ``sys.setswitchinterval`` (GIL hand-over)


CANDIDATES = {
    "A": Candidate("grpc.aio thread + trio tasks (run_sync_soon)", serve_aio_thread),
    "A2": Candidate("A with sys.setswitchinterval(0.0005)", serve_aio_thread, 0.0005),
    "B": Candidate("grpcio thread pool + trio.from_thread", serve_thread_pool),
    "C": Candidate("Hypercorn trio worker, gRPC ASGI app (h2c)", serve_hypercorn),
    "D": Candidate("trio-asyncio loop + grpc.aio", serve_trio_asyncio),
}


async def _serve_until_told(name: str, conn: Any) -> None:
    service = TrioService()
    async with CANDIDATES[name].serve(service) as port:
        conn.send(("port", port))
        await trio.to_thread.run_sync(conn.recv)


def server_process(name: str, conn: Any, extra_path: str) -> None:
    """The server of one candidate, in its own (spawned) process."""
    if extra_path:
        sys.path.insert(0, extra_path)
    if (interval := CANDIDATES[name].switch_interval_s) is not None:
        sys.setswitchinterval(interval)
    try:
        trio.run(_serve_until_told, name, conn)
    except BaseException as exc:  # noqa: BLE001 - reported in the table
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class Row:
    name: str
    title: str
    p50_ms: float | None = None
    p99_ms: float | None = None
    calls_s: float | None = None
    cpu_us: float | None = None
    cancel: str = ""
    deadline: str = ""
    watch: str = ""
    note: str = ""


def measure(name: str, target: str, args: argparse.Namespace) -> Row:
    row = Row(name, CANDIDATES[name].title)
    payload = b"x" * 64
    answers, seconds = echo_calls(target, [payload] * (args.calls + 50))
    assert set(answers) == {payload}
    seconds = seconds[50:]  # warm-up
    row.p50_ms = statistics.median(seconds) * 1000
    row.p99_ms = statistics.quantiles(seconds, n=100)[98] * 1000
    rounds = [throughput(target, 16, args.seconds, payload) for _ in range(args.rounds)]
    row.calls_s = statistics.median(rate for rate, _ in rounds)
    row.cpu_us = statistics.median(cpu for _, cpu in rounds) * 1e6
    row.cancel = cancel_probe(target, None).cell()
    row.deadline = cancel_probe(target, 0.3).cell()
    try:
        row.watch = watch_cell([watch_probe(target) for _ in range(args.watches)])
    except grpc.RpcError as exc:
        row.watch = f"no ({exc.code().name})"
    return row


def run_candidate(name: str, args: argparse.Namespace) -> Row:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    extra = args.trio_asyncio_path if name == "D" else ""
    process = context.Process(target=server_process, args=(name, child, extra), daemon=True)
    process.start()
    try:
        if not parent.poll(60):
            return Row(name, CANDIDATES[name].title, note="server did not start in 60 s")
        kind, value = parent.recv()
        if kind == "error":
            return Row(name, CANDIDATES[name].title, note=f"server failed: {value}")
        try:
            return measure(name, f"127.0.0.1:{value}", args)
        except Exception as exc:  # noqa: BLE001 - one candidate's failure is its row's note
            note = f"client failed: {type(exc).__name__}: {exc}"
            return Row(name, CANDIDATES[name].title, note=note)
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()


TABLE_HEADER = ["candidate", "unary p50 ms", "unary p99 ms", "calls/s, 16 clients", "× A",
                "server CPU µs/call", "client cancel → trio task", "deadline → trio task",
                "health Watch", "note"]


def table_rows(rows: list[Row]) -> list[list[str]]:
    base = next((row.calls_s for row in rows if row.name == "A" and row.calls_s), None)

    def number(value: float | None, digits: int = 2) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    return [[f"{row.name}. {row.title}", number(row.p50_ms), number(row.p99_ms),
             number(row.calls_s, 0), number(row.calls_s / base) if base and row.calls_s else "",
             number(row.cpu_us, 0), row.cancel, row.deadline, row.watch, row.note]
            for row in rows]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|---" * len(TABLE_HEADER) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (< 60 s)")
    names = [*CANDIDATES, "E"]
    parser.add_argument("--candidates", nargs="+", default=names, choices=names)
    parser.add_argument("--trio-asyncio-path", default="/tmp/probe-trio-asyncio",
                        help="a `pip install --target` folder holding trio-asyncio and greenlet")
    bench_results.add_argument(parser)
    args = parser.parse_args()
    args.calls, args.seconds, args.rounds, args.watches = (
        (300, 1.5, 1, 3) if args.quick else (2000, 4.0, 3, 8))
    with bench_results.recording("probe_grpc", args.results):
        rows = []
        for name in args.candidates:
            if name == "E":
                rows.append(Row("E", "purerpc 0.8.0 (trio-native via anyio)", note=purerpc_check()))
            else:
                rows.append(run_candidate(name, args))
            print(f"done: {name}", file=sys.stderr, flush=True)
        print(table(rows))
        bench_results.record("ways to serve gRPC from trio, side by side", TABLE_HEADER,
                             table_rows(rows), f"{args.calls} unary calls; 16 clients for "
                             f"{args.rounds} x {args.seconds:g} s; {args.watches} Watch streams")


if __name__ == "__main__":
    main()
