"""The gRPC server (``--grpc-port``), beside HTTP in the same process and runtime.

grpcio's server is asyncio-based, so it runs on a thread of its own with its
own event loop (docs/grpc.md says why this over the other ways measured by
``tools/probe_grpc.py``); every RPC's work is a trio task in this server's nursery, reached
through ``grpc_bridge.TrioBridge``. It serves ``sglang.grpc.encoder.SglangEncoder``,
``epd_trio.v1.Encoder``, ``grpc.health.v1.Health`` and server reflection; on
every unary-request method of them, bytes that are not its request message are
``INVALID_ARGUMENT`` (``grpc_bridge.DecodeGuard``, the server's interceptor).

``open_grpc_server`` is an ``async with`` block: the thread, its loop and the
bound port live exactly as long as it. Leaving it ends the health ``Watch``
streams, stops the server (live RPCs get ``grace`` seconds; new ones are
refused), ends the thread, then cancels what trio work is left. A port that
cannot be bound (in use: ``grpc.so_reuseport`` is off, so another server on
it is an error, not a silent sharing) fails the start with ``ValueError``,
which the CLI reports as a start-up error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import grpc
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import sglang_encoder_pb2_grpc

from epd_trio.encoder import grpc_native, grpc_sglang
from epd_trio.encoder.grpc_bridge import DecodeGuard, TrioBridge
from epd_trio.encoder.grpc_health import HealthServicer
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import RequestError
from epd_trio.protocol.grpc_messages import KEEPALIVE_PING_INTERVAL_S, MESSAGE_LIMIT
from epd_trio.protocol.proto import encoder_pb2_grpc
from epd_trio.protocol.urls import normalize_url

__all__ = ["GrpcServer", "MESSAGE_LIMIT", "SERVICES", "grpc_url", "open_grpc_server"]

log = logging.getLogger(__name__)

START_TIMEOUT: Final = 30.0  # binding and starting the server; then it is an error
SERVICES: Final = (grpc_sglang.SERVICE_NAME, grpc_native.SERVICE_NAME, health_pb2.DESCRIPTOR
                   .services_by_name["Health"].full_name)


@dataclass(frozen=True)
class GrpcServer:
    url: str  # grpc://host:port, as bound, in normalize_url's form
    port: int
    bridge: TrioBridge


def _options(service: EncoderService) -> list[tuple[str, Any]]:
    receive = max(MESSAGE_LIMIT, service.config.max_body_bytes)
    return [("grpc.max_send_message_length", MESSAGE_LIMIT),
            ("grpc.max_receive_message_length", receive),
            ("grpc.so_reuseport", 0),  # a busy port is an error, as for HTTP
            # A client's keepalive pings during a long encode are welcome, not abuse.
            ("grpc.http2.min_ping_interval_without_data_ms",
             (KEEPALIVE_PING_INTERVAL_S - 1) * 1000)]


def _add_services(server: grpc.aio.Server, service: EncoderService, bridge: TrioBridge,
                  health: HealthServicer) -> None:
    sglang_encoder_pb2_grpc.add_SglangEncoderServicer_to_server(
        grpc_sglang.sglang_servicer(service, bridge), server)
    encoder_pb2_grpc.add_EncoderServicer_to_server(grpc_native.native_servicer(service, bridge), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*SERVICES, reflection.SERVICE_NAME), server)


class _LoopThread:
    """The thread that runs grpcio's asyncio loop; reports to trio through its token."""

    def __init__(self, service: EncoderService, bridge: TrioBridge, address: str, grace: float) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.health = HealthServicer(service, bridge, SERVICES)
        self._build: Callable[[grpc.aio.Server], None] = lambda s: _add_services(s, service, bridge, self.health)
        self._options = _options(service)
        self._address = address
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()  # a stop asked for before the loop was there
        self.started = trio.Event()
        self.ended = trio.Event()
        self.port: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"grpc {address}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """From trio: ask the loop to stop the server (idempotent)."""
        self._stopping.set()
        if self._stop is not None:
            self.call_soon(self._stop.set)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """From trio: run ``fn`` on the loop, if it still runs."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn)
            except RuntimeError:  # already closed
                pass

    def _report(self, fn: Callable[[], None]) -> None:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    def _main(self) -> None:
        _name_os_thread("grpc-loop")
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - handed to trio, which raises it
            self.error = exc
        finally:
            self._report(self._finished)

    def _finished(self) -> None:
        self.started.set()  # a thread that died before starting must not leave trio waiting
        self.ended.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = grpc.aio.server(options=self._options, interceptors=(DecodeGuard(),))
        self._build(server)
        port = server.add_insecure_port(self._address)  # raises when it cannot bind
        await server.start()
        self.port = port
        self._report(self.started.set)
        try:
            if not self._stopping.is_set():
                await self._stop.wait()
        finally:
            self.health.close()  # endless Watch streams must not hold the stop for its grace
            await server.stop(self._grace)


def _name_os_thread(name: str) -> None:
    """Give this thread an OS name (``top -H``, ``py-spy``, the capacity benchmark's split);
    Python 3.11 names only its own ``threading`` objects."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:  # not Linux, or /proc read-only: only cosmetic
        pass


def grpc_url(host: str, port: int) -> str:
    """The ``grpc://`` URL of ``host:port`` in the normal form clients compare and dial
    (an IPv6 zone as ``%25``: grpcio would read a bare ``%12`` as the byte 0x12)."""
    address, _, zone = host.partition("%")
    if zone:  # RFC 6874's form: a bare zone starting with "25" would read as the escape
        address += "%25" + zone
    written = f"grpc://[{address}]:{port}" if ":" in address else f"grpc://{address}:{port}"
    try:
        return normalize_url(written, "--host", schemes=("grpc",))
    except RequestError:  # a host the server could bind but no URL names (grpcio's own syntax)
        return written


async def _wake_on_drain(service: EncoderService, thread: _LoopThread) -> None:
    """Health ``Watch`` streams hear of a drain at once, not at their next check."""
    await service.drain_started.wait()
    thread.call_soon(thread.health.wake)


@asynccontextmanager
async def open_grpc_server(service: EncoderService, host: str, port: int, *,
                           grace: float = 2.0) -> AsyncIterator[GrpcServer]:
    """Serve gRPC on ``host:port`` (0 picks a free port) for the duration of the block."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
        thread = _LoopThread(service, bridge, address, grace)
        thread.start()
        try:
            with trio.fail_after(START_TIMEOUT):
                await thread.started.wait()
            if thread.port is None:
                raise ValueError(f"cannot serve gRPC on {address} (--grpc-port): {thread.error}") \
                    from thread.error
            nursery.start_soon(_wake_on_drain, service, thread)
            url = grpc_url(host, thread.port)
            log.info("gRPC serving on %s", url.removeprefix("grpc://"))
            yield GrpcServer(url, thread.port, bridge)
        finally:
            with trio.CancelScope(shield=True):
                thread.stop()
                with trio.move_on_after(grace + 5.0):  # the loop's stop is bounded by grace
                    await thread.ended.wait()
                if not thread.ended.is_set():
                    log.warning("the gRPC thread did not end within %.1f s; leaving it", grace + 5.0)
            nursery.cancel_scope.cancel()
