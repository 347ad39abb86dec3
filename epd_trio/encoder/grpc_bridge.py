"""Calling the trio runtime from grpcio's asyncio handlers.

grpcio serves on its own thread with its own asyncio loop (``grpc_server``);
every RPC's work is a trio task in the gRPC face's nursery, started with
``TrioToken.run_sync_soon`` (no thread per call) and answered through an
asyncio future. An RPC the client cancels, or whose deadline passes, cancels
that task's cancel scope; the task's own ``finally`` blocks (the service's
abort of a request scope, its receivers' error notice) run as always. Every
task settles its RPC's future however it ends, a cancellation from outside
(the gRPC nursery closing) included, so no handler waits for an answer that
cannot come; a call that arrives once the nursery has closed, or the trio run
has ended, is refused as ``NotReadyError`` (``UNAVAILABLE``).

``unary`` wraps a trio handler into a grpcio one: the bearer token from the
``authorization`` metadata, the client's deadline handed to the handler, and
every error mapped to a gRPC status in one place (``errors.grpc_status_name``).

``DecodeGuard``, the server's interceptor, wraps every unary-request method's
request deserializer: bytes protobuf cannot parse become an ``Undecodable``,
which the method answers as a ``RequestError`` (``INVALID_ARGUMENT``, "the
request is not a valid <message> message"), after ``unary``'s token check, as
HTTP never parses an unauthenticated body. Left to itself, grpcio answers a
deserializer's exception with ``UNKNOWN`` and the exception's Python type.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import trio
from google.protobuf.message import DecodeError

from epd_trio._http import BearerAuth
from epd_trio.errors import AbortedError, DeadlineExceeded, EPDError, NotReadyError, RequestError, grpc_status_name
from epd_trio.protocol.grpc_messages import ERROR_TYPE_KEY

__all__ = ["BridgeStatistics", "Call", "DecodeGuard", "TrioBridge", "Undecodable", "decoded", "error_status",
           "unary"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """What a trio handler knows of its RPC: the client's deadline (trio clock), if any."""

    deadline: float = math.inf
    method: str = ""

    @property
    def request_deadline(self) -> float | None:
        """The deadline as ``EncoderService.encode`` takes it (None: the client set none)."""
        return None if math.isinf(self.deadline) else self.deadline


@dataclass(frozen=True)
class BridgeStatistics:
    calls: int  # started since the bridge opened
    cancelled: int  # cancelled by their RPC (client cancel or deadline)
    inflight: int  # trio tasks running for RPCs now


class _Pending(Generic[T]):
    """One RPC's trio task, seen from both threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[T] = loop.create_future()
        self.cancel_scope: trio.CancelScope | None = None
        self.cancelled = False

    def settle(self, value: T | None, error: BaseException | None) -> None:
        """From the trio thread: hand the outcome to the asyncio side, if it still listens."""
        def _set() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)  # type: ignore[arg-type]
        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def cancel(self) -> None:
        """On the trio thread: cancel the task, or make it start cancelled."""
        self.cancelled = True
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()


class TrioBridge:
    """Runs trio functions for the asyncio loop; their tasks live in ``nursery``."""

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self._token = token
        self._nursery = nursery
        self.calls = 0  # started since the bridge opened
        self.cancelled = 0  # cancelled by their RPC (client cancel or deadline)
        self.inflight = 0  # trio tasks running for RPCs now

    def statistics(self) -> BridgeStatistics:
        return BridgeStatistics(self.calls, self.cancelled, self.inflight)

    def __repr__(self) -> str:
        return f"<TrioBridge {self.inflight} in flight, {self.calls} calls, {self.cancelled} cancelled>"

    async def run(self, fn: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        """On the asyncio loop: ``await fn()`` in trio, within ``timeout`` seconds if given."""
        pending: _Pending[T] = _Pending(asyncio.get_running_loop())
        try:
            self._token.run_sync_soon(self._start, pending, fn, timeout)
        except trio.RunFinishedError:
            raise NotReadyError("the encoder is shutting down") from None
        try:
            return await pending.future
        except asyncio.CancelledError:
            try:
                self._token.run_sync_soon(self._cancelled, pending)
            except trio.RunFinishedError:
                pass
            raise

    def _cancelled(self, pending: _Pending[Any]) -> None:
        self.cancelled += 1
        pending.cancel()

    def _start(self, pending: _Pending[T], fn: Callable[[], Awaitable[T]], timeout: float | None) -> None:
        self.calls += 1
        try:
            self._nursery.start_soon(self._task, pending, fn, timeout)
        except RuntimeError:  # the nursery has closed: we are shutting down
            pending.settle(None, NotReadyError("the encoder is shutting down"))

    async def _task(self, pending: _Pending[T], fn: Callable[[], Awaitable[T]],
                    timeout: float | None) -> None:
        value: T | None = None
        # What the RPC hears if a cancellation from outside (the nursery closing) ends us.
        error: BaseException | None = NotReadyError("the encoder is shutting down")
        self.inflight += 1
        try:
            with trio.CancelScope() as scope:
                pending.cancel_scope = scope
                if pending.cancelled:
                    scope.cancel()
                if timeout is not None:
                    scope.deadline = trio.current_time() + timeout
                try:
                    value, error = await fn(), None
                except Exception as exc:  # noqa: BLE001 - handed to the RPC, which maps it to a status
                    error = exc
            if scope.cancelled_caught:
                error = AbortedError("the client cancelled the call") if pending.cancelled \
                    else DeadlineExceeded("the call's deadline passed")
        finally:
            self.inflight -= 1
            pending.settle(value, error)


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and details a failed RPC ends with; never a traceback."""
    if isinstance(exc, EPDError):
        return grpc.StatusCode[grpc_status_name(exc)], exc.message
    return grpc.StatusCode.INTERNAL, "internal error in the encoder"


Handler = Callable[[Any, Call], Awaitable[Any]]


def unary(bridge: TrioBridge, handler: Handler, *, method: str, auth: BearerAuth | None = None,
          sees_undecodable: bool = False) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """A grpcio unary handler that runs ``handler(request, call)`` in trio.

    Bytes that are not the method's message are refused here, after the token, unless
    ``sees_undecodable``: then ``handler`` gets the ``Undecodable`` and refuses it through
    ``decoded`` (``Encode`` does, to count it as a face counts every refused request).
    """

    async def rpc(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if auth is not None:
                auth.check(_authorization(context), method)
            if isinstance(request, Undecodable) and not sees_undecodable:
                raise request.error()
            remaining = context.time_remaining()
            return await bridge.run(lambda: _with_deadline(handler, request, method, remaining), remaining)
        except Exception as exc:  # noqa: BLE001 - abort() maps every error to a status (a bug: INTERNAL)
            await abort(context, exc, method)

    rpc.checks_undecodable = True  # type: ignore[attr-defined]  # DecodeGuard leaves it the check
    return rpc


async def _with_deadline(handler: Handler, request: Any, method: str, remaining: float | None) -> Any:
    deadline = math.inf if remaining is None else trio.current_time() + remaining
    return await handler(request, Call(deadline, method))


async def abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """End the RPC with ``exc``'s status (raises, as ``context.abort`` does)."""
    if not isinstance(exc, EPDError):
        log.error("unhandled error in gRPC %s", method, exc_info=exc)
    code, details = error_status(exc)
    kind = exc.type_name if isinstance(exc, EPDError) else "InternalError"
    context.set_trailing_metadata(((ERROR_TYPE_KEY, kind),))
    await context.abort(code, details)


# ---- request bytes that are not the method's message ---------------------------------------
class Undecodable:
    """What a guarded request deserializer answers for bytes protobuf cannot parse."""

    __slots__ = ("message_name",)

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name

    def __repr__(self) -> str:
        return f"<Undecodable {self.message_name}>"

    def error(self) -> RequestError:
        return RequestError(f"the request is not a valid {self.message_name} message")


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's ``authorization`` metadata (a text key: never bytes; none: missing)."""
    value = dict(context.invocation_metadata() or ()).get("authorization")
    return value if isinstance(value, str) else None


def decoded(message: Any) -> Any:
    """``message``, or its ``RequestError`` if its bytes did not decode."""
    if isinstance(message, Undecodable):
        raise message.error()
    return message


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    """``EncodeRequest.FromString`` → ``epd_trio.v1.EncodeRequest``."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request"


def _guarded_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    name = _message_name(deserializer)

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError:
            return Undecodable(name)

    return deserialize


def _guard(handler: Any, method: str) -> Any:
    """``handler`` with its request deserializer guarded; its behaviour refuses an
    ``Undecodable`` (unless it does so itself, as ``unary``'s do, after the token).
    A handler we cannot wrap (sync, request-streaming) is left as grpcio has it."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    field = "unary_stream" if handler.response_streaming else "unary_unary"
    behaviour = getattr(handler, field)
    if getattr(behaviour, "checks_undecodable", False):
        wrapped = behaviour
    elif inspect.isasyncgenfunction(behaviour):
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await abort(context, request.error(), method)
            async for response in behaviour(request, context):
                yield response
    elif inspect.iscoroutinefunction(behaviour):
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await abort(context, request.error(), method)
            return await behaviour(request, context)
    else:
        return handler
    return handler._replace(request_deserializer=_guarded_deserializer(handler.request_deserializer),
                            **{field: wrapped})


class DecodeGuard(grpc.aio.ServerInterceptor):
    """The server's interceptor: every unary-request method, of every service, answers
    bytes that are not its message ``INVALID_ARGUMENT`` (``Undecodable``), not grpcio's
    ``UNKNOWN``. Each method's handler is wrapped once, on its first call."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[Any, Any]] = {}  # method → (grpcio's handler, ours)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: grpcio answers UNIMPLEMENTED
            return None
        method = handler_call_details.method
        known = self._guarded.get(method)
        if known is None or known[0] is not handler:
            known = self._guarded[method] = (handler, _guard(handler, method))
        return known[1]
