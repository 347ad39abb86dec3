"""The ZMQ delivery backend: a cache of PUSH sockets and a PULL receiver.

Both sit on ``TrioSocket`` (trio-native pyzmq). Time comes from
``trio.current_time()`` only, so a ``MockClock`` drives the idle closing; the
idle decision itself is pure (``expired_endpoints``, ``next_expiry``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType

import trio
import zmq

from epd_trio.errors import ProtocolError, RequestError, TransferTimeout, TransportError
from epd_trio.protocol import EmbeddingHeader, Payload, decode_zmq_message
from epd_trio.protocol.codec import FrameLike
from epd_trio.protocol.requests import validate_endpoint
from epd_trio.transport._zmq_socket import TrioSocket

__all__ = [
    "PullReceiver",
    "PullStatistics",
    "PushCacheStatistics",
    "PushSocketCache",
    "TrioSocket",
    "expired_endpoints",
    "next_expiry",
    "validate_endpoint",
]

logger = logging.getLogger(__name__)

TERM_GRACE = 2.0  # seconds past the linger that closing waits for libzmq to let go
# Bytes per PUSH socket that a send may leave unreleased and return (``ReleaseLedger``):
# messages of up to a few MiB (one image's embedding) then cost no completion poll. Kept after
# measuring (tools/bench_transfer.py): watching every send cost a 1 MiB message ~40 % more Python
# calls and ~15 % more time (interleaved, loaded 2 cores); from 16 MiB up every send is watched
# anyway. 8 MiB lets two 1-4 MiB messages per destination be in flight; a stuck receiver
# still makes sends wait and time out once its socket holds that much.
RELEASE_BUDGET = 8 << 20


async def terminate(ctx: zmq.Context[zmq.Socket[bytes]], linger_ms: int) -> None:
    """``ctx.term()``: shielded (a final release) but bounded.

    term() waits while closed sockets still hold unsent messages, up to their
    linger (forever with linger -1, or while a socket is left open). It runs
    in a thread, so trio stays responsive, for at most the linger plus
    ``TERM_GRACE`` seconds; then the thread is left to finish alone. It holds
    nothing we free: only the context, and queued zero-copy frames keep their
    own buffers alive.
    """
    bound = max(linger_ms, 0) / 1000 + TERM_GRACE
    with trio.CancelScope(shield=True, deadline=trio.current_time() + bound) as scope:
        await trio.to_thread.run_sync(ctx.term, abandon_on_cancel=True)
    if scope.cancelled_caught:
        logger.warning("a ZMQ context still had unsent messages %g s after closing: left to "
                       "finish alone", bound)

def connect(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, options: Mapping[zmq.SocketOption, int],
            endpoint: str) -> zmq.Socket[bytes]:
    """A new socket of ``kind`` with ``options``, connected to ``endpoint``; a ``RequestError``
    (the endpoint came with a request) when libzmq refuses it."""
    sock = ctx.socket(kind)
    try:
        for option, value in options.items():
            sock.setsockopt(option, value)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise RequestError(f"cannot connect to {endpoint}: {exc}") from None
    return sock


def expired_endpoints(last_used: Mapping[str, float], now: float, idle_close: float) -> list[str]:
    """Idle sockets whose time is up (pure: the caller supplies ``now``)."""
    return [ep for ep, t in last_used.items() if now - t >= idle_close]


def next_expiry(last_used: Mapping[str, float], idle_close: float) -> float:
    """When the next idle socket expires; ``inf`` when none is idle."""
    return min(last_used.values(), default=math.inf) + idle_close


@dataclass(frozen=True)
class PushCacheStatistics:
    open_sockets: int
    busy_sockets: int
    max_sockets: int
    sends: int
    send_timeouts: int
    idle_closed: int
    evicted: int
    unreleased_bytes: int = 0  # sent, answered, and not yet let go of by libzmq (all sockets)


@dataclass
class _Entry:
    sock: TrioSocket
    last_used: float
    busy: int = 0


class PushSocketCache:
    """One zmq.Context and a bounded LRU of PUSH sockets, one per destination.

    Connecting is the slow part of a first send, so sockets are kept; those
    idle for ``idle_close`` seconds are closed by a task in the cache's own
    nursery. ``IMMEDIATE`` makes a send to a destination nobody listens on
    wait (and time out) instead of queueing for a peer that may never come.
    A send returns without waiting for libzmq to release its zero-copy
    buffers while that socket's unreleased bytes stay within ``release_budget``
    (``ReleaseLedger``); a larger message waits as before.
    """

    def __init__(
        self,
        *,
        max_sockets: int = 64,
        idle_close: float = 300.0,
        sndhwm: int = 64,  # messages, each up to hundreds of MB: bound the memory
        linger_ms: int = 500,
        release_budget: int = RELEASE_BUDGET,
    ) -> None:
        if max_sockets < 1 or idle_close <= 0 or release_budget < 0:
            raise ValueError("max_sockets must be >= 1, idle_close > 0 and release_budget >= 0")
        self._release_budget = release_budget
        self._max, self._idle_close = max_sockets, idle_close
        # IPV6: a destination may be an IPv6 endpoint (IPv4 ones connect as before).
        self._options = {zmq.IMMEDIATE: 1, zmq.LINGER: linger_ms, zmq.SNDHWM: sndhwm, zmq.IPV6: 1}
        self._linger_ms = linger_ms
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._counts = dict(sends=0, send_timeouts=0, idle_closed=0, evicted=0)
        self._changed = trio.Event()
        self._wake_at = math.inf  # when the idle-closing task next looks by itself
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> PushSocketCache:
        self._ctx = zmq.Context()
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(self._close_idle_loop)
        self._stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery exits
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The body's exception is not passed to the nursery, so it is not wrapped in a group.
        try:
            await self._stack.aclose()
        finally:
            await self._close_all()

    async def send(self, endpoint: str, frames: Sequence[FrameLike], timeout: float) -> None:
        """Send one message to ``endpoint``; see ``TrioSocket.send_multipart``."""
        entry = self._checkout(endpoint)
        try:
            await entry.sock.send_multipart(frames, timeout=timeout)
        except TransferTimeout:
            self._counts["send_timeouts"] += 1
            raise
        finally:
            entry.busy -= 1
            entry.last_used = trio.current_time()
            if entry.last_used + self._idle_close < self._wake_at:  # else it looks in time anyway
                self._changed.set()
        self._counts["sends"] += 1

    def statistics(self) -> PushCacheStatistics:
        busy = sum(1 for e in self._entries.values() if e.busy)
        return PushCacheStatistics(
            open_sockets=len(self._entries), busy_sockets=busy, max_sockets=self._max,
            **self._counts,
            unreleased_bytes=sum(e.sock.unreleased_bytes for e in self._entries.values()),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<PushSocketCache sockets: {s.open_sockets}/{s.max_sockets} ({s.busy_sockets} busy),"
            f" sends: {s.sends}, timeouts: {s.send_timeouts}, idle closed: {s.idle_closed},"
            f" evicted: {s.evicted}>"
        )

    def _checkout(self, endpoint: str) -> _Entry:
        if self._ctx is None:
            raise RuntimeError("use PushSocketCache in an 'async with' block")
        entry = self._entries.get(endpoint) if type(endpoint) is str else None
        if entry is None:  # checked once, when its socket is made
            validate_endpoint(endpoint)
            self._evict_for_one_more()
            entry = self._entries[endpoint] = _Entry(self._connect(self._ctx, endpoint), 0.0)
        self._entries.move_to_end(endpoint)
        entry.busy += 1
        return entry

    def _connect(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> TrioSocket:
        return TrioSocket(connect(ctx, zmq.PUSH, self._options, endpoint), release_budget=self._release_budget)

    def _evict_for_one_more(self) -> None:
        """Close least-recently-used idle sockets; busy ones (sending, or with messages
        not yet released) may overfill briefly."""
        idle = [ep for ep, e in self._entries.items()
                if not e.busy and not e.sock.unreleased_bytes]
        for endpoint in idle[: max(0, len(self._entries) - self._max + 1)]:
            self._entries.pop(endpoint).sock.close(self._linger_ms)
            self._counts["evicted"] += 1

    async def _close_idle_loop(self) -> None:
        while True:
            changed = self._changed
            idle = {ep: e.last_used for ep, e in self._entries.items() if not e.busy}
            for endpoint in expired_endpoints(idle, trio.current_time(), self._idle_close):
                self._entries.pop(endpoint).sock.close(self._linger_ms)
                self._counts["idle_closed"] += 1
                del idle[endpoint]
            self._wake_at = next_expiry(idle, self._idle_close)
            with trio.move_on_at(self._wake_at):
                await changed.wait()
            if changed.is_set():
                self._changed = trio.Event()

    async def _close_all(self) -> None:
        while self._entries:
            self._entries.popitem()[1].sock.close(self._linger_ms)
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await terminate(ctx, self._linger_ms)


@dataclass(frozen=True)
class PullStatistics:
    received: int
    dropped: int
    last_drop_reason: str | None


class PullReceiver:
    """A bound PULL socket yielding decoded messages; malformed ones are dropped.

    A peer's garbage must never crash the receiving task: it is counted in
    ``statistics()`` and logged instead. ``bind=None`` opens it unbound: ``bind()``
    adds endpoints while it runs (one socket may listen on several addresses).
    """

    def __init__(
        self,
        bind: str | None = "tcp://127.0.0.1:0",
        *,
        rcvhwm: int = 64,
        max_message_bytes: int = 1 << 31,  # libzmq drops a peer that sends more
    ) -> None:
        self._bind = None if bind is None else validate_endpoint(bind, bind=True)
        # IPV6: an IPv6 address may be bound beside IPv4 ones ("[::]" takes both).
        self._options = {zmq.RCVHWM: rcvhwm, zmq.MAXMSGSIZE: max_message_bytes, zmq.LINGER: 0,
                         zmq.IPV6: 1}
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: TrioSocket | None = None
        self.last_endpoint = ""
        self.endpoints: list[str] = []  # every endpoint bound, in order
        self._received = self._dropped = 0
        self._last_drop: str | None = None

    async def __aenter__(self) -> PullReceiver:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.PULL)
        try:
            for option, value in self._options.items():
                sock.setsockopt(option, value)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            await self.aclose()
            raise TransportError(f"cannot set up a PULL socket: {exc}") from None
        self._sock = TrioSocket(sock)
        if self._bind is not None:
            try:
                self.bind(self._bind)
            except TransportError:
                await self.aclose()
                raise
        return self

    def bind(self, endpoint: str) -> str:
        """Listen on ``endpoint`` too (port 0 picks a free one) → the endpoint as bound."""
        if self._sock is None:
            raise trio.ClosedResourceError("PullReceiver is not open")
        endpoint = validate_endpoint(endpoint, bind=True)
        try:
            self._sock.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot bind {endpoint}: {exc}") from None
        bound = self._sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("tcp://"):  # as asked, with the port bound: libzmq would name an
            # IPv4 address as IPv4-mapped IPv6 ("[::ffff:127.0.0.1]"), which IPv4 peers cannot dial
            bound = f"{endpoint.rsplit(':', 1)[0]}:{bound.rsplit(':', 1)[1]}"
        self.last_endpoint = bound
        self.endpoints.append(bound)
        return bound

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close; a task blocked in ``receive`` gets ``trio.ClosedResourceError``."""
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()  # nothing lingers: every socket closed with linger 0
            self._ctx = None
        await trio.lowlevel.checkpoint()

    async def receive(self) -> tuple[EmbeddingHeader, Payload | None]:
        """The next well-formed message (header, payload or None for an error)."""
        if self._sock is None:
            raise trio.ClosedResourceError("PullReceiver is not open")
        while True:
            frames = await self._sock.receive_multipart()
            try:
                message = decode_zmq_message([f.buffer for f in frames])
            except ProtocolError as exc:
                self._dropped += 1
                self._last_drop = exc.message
                logger.warning("dropped a malformed ZMQ message: %s", exc.message)
                continue
            self._received += 1
            return message

    def __aiter__(self) -> PullReceiver:
        return self

    async def __anext__(self) -> tuple[EmbeddingHeader, Payload | None]:
        """Iteration ends when the receiver is closed."""
        try:
            return await self.receive()
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None

    def statistics(self) -> PullStatistics:
        return PullStatistics(self._received, self._dropped, self._last_drop)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<PullReceiver {self.last_endpoint or self._bind}: received {s.received},"
            f" dropped {s.dropped}>"
        )
