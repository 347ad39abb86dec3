"""The client's gRPC connections: ``grpc://host:port`` encoders through ``epd_trio.v1.Encoder``.

grpcio's client is thread-based; trio cannot await its futures directly, and a
thread per call would cost what the call saves. So a call is started with
``stub.Method.future(...)`` and its done-callback (on a grpcio thread) wakes
the waiting trio task through ``TrioToken.run_sync_soon``; a cancelled trio
task cancels the RPC (``future.cancel()``), which the encoder sees as a client
cancel and turns into a cancel of the request's scope. The call's deadline is
the trio task's effective deadline (the request's timeout, or the bounded
``/abort``), so the encoder's scope ends when the client stops waiting.

``post(url, path, body)`` takes the very ``/encode``, ``/send`` and ``/abort``
bodies the HTTP path posts and gives back a ``GrpcAnswer`` that reads like the
HTTP answer (``answers.Answer``): the inline safetensors bytes as ``content``,
the metadata as ``json()``, a failure as its HTTP status and error body
(``answers.grpc_failure``). One channel per encoder URL, opened on first use
and closed when the client closes; its keepalive pings drop an encoder that
stopped answering as the HTTP path does (``liveness``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import grpc
import trio

from epd_trio._util import wait_done
from epd_trio.client.answers import grpc_failure
from epd_trio.client.liveness import GRPC_CHANNEL_OPTIONS
from epd_trio.errors import PeerUnavailable, ProtocolError, RequestError
from epd_trio.protocol.grpc_messages import (
    ERROR_TYPE_KEY,
    MESSAGE_LIMIT,
    encode_message,
    meta_from_message,
)
from epd_trio.protocol.proto import encoder_pb2 as pb, encoder_pb2_grpc as pb_grpc

__all__ = ["GRPC_SCHEME", "GrpcAnswer", "GrpcChannelStatistics", "GrpcChannels"]

GRPC_SCHEME: Final = "grpc://"
# The codes grpcio gives a call that no server answered (any other code is the server's).
_NO_ANSWER: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# The encoder's own limits (its server takes messages up to 256 MiB, as SGLang's does), and
# a silent encoder dropped as an HTTP one is (``liveness``).
_OPTIONS: Final = (("grpc.max_send_message_length", MESSAGE_LIMIT),
                   ("grpc.max_receive_message_length", MESSAGE_LIMIT), *GRPC_CHANNEL_OPTIONS)


@dataclass(frozen=True)
class GrpcAnswer:
    """A gRPC answer as the HTTP one reads: status, body bytes, JSON."""

    status_code: int
    content: bytes = b""
    body: Any = None

    def json(self) -> Any:
        return self.body

    @property
    def text(self) -> str:
        return json.dumps(self.body)


@dataclass(frozen=True)
class GrpcChannelStatistics:
    channels: int  # open, one per encoder URL called
    calls: int  # started
    in_flight: int  # started and not yet done
    cancelled: int  # cancelled by the trio side (deadline, failure, caller)
    closed: bool


def _encode_answer(message: pb.EncodeResponse, url: str) -> GrpcAnswer:
    try:
        meta = meta_from_message(message.meta)
    except RequestError as exc:
        raise ProtocolError(f"{url} answered Encode with a bad meta: {exc.message}") from None
    return GrpcAnswer(200, message.safetensors,
                      {**dataclasses.asdict(meta), "nbytes": message.nbytes})


def _send_request(body: dict[str, Any]) -> pb.SendRequest:
    return pb.SendRequest(**body)


def _send_answer(message: pb.SendResponse, url: str) -> GrpcAnswer:
    return GrpcAnswer(200, body={"req_id": message.req_id, "part_idx": message.part_idx,
                                 "nbytes": message.nbytes})


def _abort_request(body: dict[str, Any]) -> pb.AbortRequest:
    return pb.AbortRequest(req_id=body["req_id"], part_idx=body.get("part_idx"))


def _abort_answer(message: pb.AbortResponse, url: str) -> GrpcAnswer:
    return GrpcAnswer(200, body={"req_id": message.req_id, "aborted": message.aborted,
                                 "released": message.released})


# HTTP path → (RPC, body → message, answer → GrpcAnswer): the one table of what maps to what.
_RPCS: Final[dict[str, tuple[str, Callable[[dict[str, Any]], Any], Callable[[Any, str], GrpcAnswer]]]] = {
    "/encode": ("Encode", encode_message, _encode_answer),
    "/send": ("Send", _send_request, _send_answer),
    "/abort": ("Abort", _abort_request, _abort_answer),
}


class GrpcChannels:
    """One grpcio channel per ``grpc://`` encoder, owned by an ``async with`` block."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.EncoderStub]] = {}
        self._closed = False
        self._calls = 0
        self._in_flight = 0
        self._cancelled = 0

    async def __aenter__(self) -> GrpcChannels:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every channel (cancelling what is still in flight on it)."""
        self._closed = True
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()

    @staticmethod
    def serves(path: str) -> bool:
        """Whether an HTTP ``path`` has an RPC here (the vLLM face's routes have none)."""
        return path in _RPCS

    def _stub(self, url: str) -> pb_grpc.EncoderStub:
        if self._closed:
            raise RuntimeError("the gRPC channels are closed")
        if url not in self._channels:
            channel = grpc.insecure_channel(url.removeprefix(GRPC_SCHEME), options=_OPTIONS)
            self._channels[url] = (channel, pb_grpc.EncoderStub(channel))
        return self._channels[url][1]

    async def post(self, url: str, path: str, body: dict[str, Any]) -> GrpcAnswer:
        """The RPC that ``POST {url}{path}`` with ``body`` means; its answer, or its failure
        as the HTTP face's status and error body (raises for failures of the call itself)."""
        method, to_message, to_answer = _RPCS[path]
        future = await self._call(getattr(self._stub(url), method), to_message(body))
        if future.exception() is None:
            return to_answer(future.result(), url)
        error_type = dict(future.trailing_metadata() or ()).get(ERROR_TYPE_KEY)  # a text key: str
        status, error = grpc_failure(future.code().name, future.details() or "",
                                     error_type if isinstance(error_type, str) else None, target=f"{url} {method}",
                                     req_id=body.get("req_id"))
        return GrpcAnswer(status, body=error)

    async def probe(self, url: str) -> None:
        """Return once the encoder at ``url`` answers anything (its cheapest RPC, whatever its
        status); ``PeerUnavailable`` when the call could not reach it. The caller bounds it."""
        future = await self._call(self._stub(url).GetModelInfo, pb.ModelInfoRequest())
        if future.exception() is not None and future.code() in _NO_ANSWER:
            raise PeerUnavailable(f"{url} did not answer: {future.code().name} {future.details()}")

    async def _call(self, rpc: grpc.UnaryUnaryMultiCallable, message: Any) -> grpc._CallFuture[Any]:
        """Start ``rpc`` and wait for it without a thread; cancelling the wait cancels it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        deadline = trio.current_effective_deadline()
        timeout = None if math.isinf(deadline) else max(deadline - trio.current_time(), 0.0)
        future = rpc.future(message, timeout=timeout)
        self._calls += 1
        self._in_flight += 1
        try:
            await wait_done(future)
        except BaseException:
            if future.cancel():
                self._cancelled += 1
            raise
        finally:
            self._in_flight -= 1
        return future

    def statistics(self) -> GrpcChannelStatistics:
        return GrpcChannelStatistics(len(self._channels), self._calls, self._in_flight,
                                     self._cancelled, self._closed)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<GrpcChannels {s.channels} channels{' (closed)' if s.closed else ''},"
                f" {s.in_flight} calls in flight, {s.calls} made, {s.cancelled} cancelled>")
