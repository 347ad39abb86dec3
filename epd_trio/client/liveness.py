"""How soon the client gives up on an encoder that stopped answering.

A host that dies or loses its link sends nothing: no reset, no FIN. Without
probes a call to it waits out the request's whole timeout. Both of the client's
transports probe the connection and drop it at most ``PEER_LOST_AFTER`` seconds
after the encoder was last heard from, however long an encode takes (a live peer
answers a probe while it works):

- HTTP: TCP keepalive on every socket, and TCP_USER_TIMEOUT for data the peer
  never acknowledges (``tcp_socket_options``);
- gRPC: HTTP/2 keepalive pings while a call is in flight (``GRPC_CHANNEL_OPTIONS``),
  as often as the encoder's gRPC server accepts them (``KEEPALIVE_PING_INTERVAL_S``).

Between calls nothing is in flight to probe: a ZMQ part whose ``/encode`` was
answered waits for a message the encoder has handed to ZMQ, on a connection the
client cannot watch. ``wait_heard_from`` asks the encoder directly while that
message is late.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from epd_trio.errors import PeerUnavailable
from epd_trio.protocol.grpc_messages import KEEPALIVE_PING_INTERVAL_S

__all__ = ["GRPC_CHANNEL_OPTIONS", "PEER_LOST_AFTER", "tcp_socket_options", "wait_heard_from"]

log = logging.getLogger(__name__)

_KEEPIDLE, _KEEPINTVL, _KEEPCNT = KEEPALIVE_PING_INTERVAL_S, 2, 3  # seconds, seconds, probes
PEER_LOST_AFTER: Final = _KEEPIDLE + _KEEPINTVL * _KEEPCNT  # seconds

# A ping every 5 s during a call (grpc times them from the last ping, not from the last data),
# the connection dropped if one is not answered in the 6 s after: 6 to 11 s, TCP's 11 s at
# most. grpc (1.85) enforces an unanswered ping by its ping timeout (one minute by default),
# not by the keepalive timeout, so both are set. Pings only while a call runs (an idle
# channel is left alone), without a cap on pings between data frames (grpc's default stops
# after two).
_PING_ANSWERED_WITHIN_MS: Final = (PEER_LOST_AFTER - _KEEPIDLE) * 1000
GRPC_CHANNEL_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", _KEEPIDLE * 1000),
    ("grpc.keepalive_timeout_ms", _PING_ANSWERED_WITHIN_MS),
    ("grpc.http2.ping_timeout_ms", _PING_ANSWERED_WITHIN_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)


def tcp_socket_options() -> list[tuple[int, int, int]]:
    """Socket options for dead-peer detection within ``PEER_LOST_AFTER`` (Linux has them
    all; elsewhere keepalive with the kernel's timings)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", _KEEPIDLE), ("TCP_KEEPINTVL", _KEEPINTVL),
                        ("TCP_KEEPCNT", _KEEPCNT), ("TCP_USER_TIMEOUT", PEER_LOST_AFTER * 1000)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


async def wait_heard_from(arrived: trio.Event, probe: Callable[[], Awaitable[None]], what: str) -> None:
    """Wait for ``arrived``; while it is late, ``probe`` the peer after ``KEEPALIVE_PING_INTERVAL_S``
    and again that long after each answer.

    A probe not answered within the rest of ``PEER_LOST_AFTER`` (or that fails to
    reach the peer) raises ``PeerUnavailable``: the peer is given up on at most
    ``PEER_LOST_AFTER`` seconds after it was last heard from, as on a call. A peer
    that answers is waited for (the caller's deadline bounds that); ``arrived``
    during a probe ends the wait at once.
    """
    while True:
        with trio.move_on_after(KEEPALIVE_PING_INTERVAL_S):
            await arrived.wait()
            return
        log.info("%s: not come after %s s; asking whether the encoder is alive", what,
                 KEEPALIVE_PING_INTERVAL_S)
        lost: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on, arrived, nursery.cancel_scope)
            try:
                with trio.fail_after(PEER_LOST_AFTER - KEEPALIVE_PING_INTERVAL_S):
                    await probe()
            except (trio.TooSlowError, PeerUnavailable) as exc:
                lost = exc
            nursery.cancel_scope.cancel()
        if arrived.is_set():
            return
        if lost is not None:
            reason = "no answer" if isinstance(lost, trio.TooSlowError) else str(lost)
            raise PeerUnavailable(f"{what}: the encoder was not heard from for {PEER_LOST_AFTER} s "
                                  f"({reason})") from lost


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
