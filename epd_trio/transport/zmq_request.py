"""``RequestSockets``: trio-native ZMQ REQ sockets for JSON request/reply control planes.

A REQ socket takes turns strictly (send, receive, send, ...): one whose reply
never came can send nothing more. So a socket serves one exchange at a time
and is closed, never reused, after any failure (a timeout, a cancellation, a
reply that is not one JSON frame). Sockets whose exchange went well wait in a
bounded pool, per endpoint, for the next one: connecting is the slow part.

Requests and replies are JSON (msgspec: strict); nothing received is ever
unpickled. A reply over ``max_reply_bytes`` is refused by libzmq
(``MAXMSGSIZE``: it drops the connection), which reaches the caller as its
timeout.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec
import trio
import zmq

from epd_trio.errors import ProtocolError, TransferTimeout
from epd_trio.protocol.requests import validate_endpoint
from epd_trio.transport._zmq_socket import TrioSocket
from epd_trio.transport.zmq import connect, terminate

__all__ = ["RequestSockets", "RequestStatistics"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestStatistics:
    idle_sockets: int
    busy_sockets: int
    max_idle: int
    exchanges: int  # replies received
    failures: int  # exchanges that closed their socket (timeouts included)
    timeouts: int


class RequestSockets:
    """One zmq.Context, REQ sockets connected on demand, a bounded pool of idle ones."""

    def __init__(self, *, max_idle: int = 64, max_reply_bytes: int = 1 << 20, linger_ms: int = 0) -> None:
        if max_idle < 1 or max_reply_bytes < 1:
            raise ValueError("max_idle and max_reply_bytes must be >= 1")
        self._max_idle = max_idle
        self._options = {zmq.LINGER: linger_ms, zmq.MAXMSGSIZE: max_reply_bytes, zmq.IPV6: 1}
        self._linger_ms = linger_ms
        self._idle: OrderedDict[str, list[TrioSocket]] = OrderedDict()  # least recently used first
        self._busy: set[TrioSocket] = set()
        self._counts = dict(exchanges=0, failures=0, timeouts=0)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None

    async def __aenter__(self) -> RequestSockets:
        self._ctx = zmq.Context()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for sock in [*self._busy, *(s for socks in self._idle.values() for s in socks)]:
            sock.close()  # a task still waiting on one gets trio.ClosedResourceError
        self._busy.clear()
        self._idle.clear()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await terminate(ctx, self._linger_ms)

    async def request(self, endpoint: str, payload: Mapping[str, Any], *, timeout: float) -> Any:
        """Send ``payload`` as JSON to ``endpoint``'s REP socket; its decoded JSON reply.

        ``TransferTimeout`` when no reply comes within ``timeout`` seconds,
        ``ProtocolError`` when the reply is not one JSON frame.
        """
        body = msgspec.json.encode(payload)
        sock = self._checkout(endpoint)
        done = False
        try:
            with trio.move_on_after(timeout) as waiting:
                await sock.send_multipart([body], timeout=timeout)
                frames = await sock.receive_multipart()
            if waiting.cancelled_caught:
                self._counts["timeouts"] += 1
                raise TransferTimeout(f"no reply from {endpoint} within {timeout:g} s")
            reply = _decode(frames, endpoint)
            done = True
        finally:
            self._busy.discard(sock)
            if done:
                self._checkin(endpoint, sock)
            else:
                self._counts["failures"] += 1
                sock.close()
        self._counts["exchanges"] += 1
        return reply

    def statistics(self) -> RequestStatistics:
        idle = sum(len(socks) for socks in self._idle.values())
        return RequestStatistics(idle, len(self._busy), self._max_idle, **self._counts)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<RequestSockets idle: {s.idle_sockets}/{s.max_idle}, busy: {s.busy_sockets}, "
                f"exchanges: {s.exchanges}, failures: {s.failures}>")

    def _checkout(self, endpoint: str) -> TrioSocket:
        if self._ctx is None:
            raise RuntimeError("use RequestSockets in an 'async with' block")
        idle = self._idle.get(endpoint)
        if idle:
            sock = idle.pop()
            if not idle:
                del self._idle[endpoint]
        else:
            sock = TrioSocket(connect(self._ctx, zmq.REQ, self._options, validate_endpoint(endpoint)))
        self._busy.add(sock)
        return sock

    def _checkin(self, endpoint: str, sock: TrioSocket) -> None:
        self._idle.setdefault(endpoint, []).append(sock)
        self._idle.move_to_end(endpoint)
        while sum(len(socks) for socks in self._idle.values()) > self._max_idle:
            oldest, socks = next(iter(self._idle.items()))
            socks.pop(0).close(self._linger_ms)
            if not socks:
                del self._idle[oldest]


def _decode(frames: list[zmq.Frame], endpoint: str) -> Any:
    if len(frames) != 1:
        raise ProtocolError(f"{endpoint} replied with {len(frames)} frames, not one JSON frame")
    try:
        return msgspec.json.decode(frames[0].buffer)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"{endpoint} replied with something that is not JSON: {exc}") from None
