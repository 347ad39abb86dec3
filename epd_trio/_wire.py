"""Socket-level rules both HTTP servers' connections follow: bounded writes, telling a client
that half-closed from one that has gone, resetting a connection whose answer was cut short.

* **Writes** (``write_bounded``): what the non-blocking socket takes at once leaves in one
  ``os.write`` (a small answer whole: no timer, no scheduler turn); the rest is sent in
  ``WRITE_PIECE`` pieces, each of which the client must take within ``write_timeout``. That
  measures progress, not the whole answer: a client reading slowly but steadily (over
  ``WRITE_PIECE`` per ``write_timeout``, ~1 KiB/s by default) gets any answer; one that stops
  reading is cut off one ``write_timeout`` after the socket buffers fill.
* **A client's FIN** ends its sending, not its reading (a half-close): requests already read
  are answered. Whether it has gone altogether shows only when something is written to it:
  once the answer is ``PROBE_AFTER`` late, a connection writes an interim ``100 Continue``
  (``INTERIM``: every HTTP/1.1 client must accept and skip a 1xx; none goes to HTTP/1.0) and
  ``wait_reset`` watches for the reset a closed socket answers data with.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from typing import Final

import trio

__all__ = ["INTERIM", "PROBE_AFTER", "WRITE_PIECE", "after", "peer_reset", "reset_on_close", "wait_reset",
           "write_bounded"]

WRITE_PIECE: Final = 1 << 16  # bytes a client must take per write_timeout once its buffers are full
INTERIM: Final = b"HTTP/1.1 100 Continue\r\n\r\n"  # the probe: RFC 9110 15.2, clients skip a 1xx
PROBE_AFTER: Final = 0.1  # seconds an answer may take after a client's FIN before it is probed
_POLL_FIRST, _POLL_MAX = 0.01, 1.0  # seconds between looks for the peer's reset, growing
_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
_TCP_CLOSE: Final = 7  # tcpi_state once the peer has reset the connection (linux/tcp_states.h)


async def write_bounded(stream: trio.SocketStream, data: bytes | memoryview, write_timeout: float) -> bool:
    """Write ``data`` → False if the client took less than ``WRITE_PIECE`` bytes within one
    ``write_timeout`` (the caller must then reset the connection: part of it may be on the wire).

    Raises ``trio.BrokenResourceError`` when the client is gone (reset, closed).
    """
    view = memoryview(data)
    sent = _write_now(stream, view)
    for start in range(sent, len(view), WRITE_PIECE):
        with trio.move_on_after(write_timeout):
            await stream.send_all(view[start:start + WRITE_PIECE])
            continue
        return False
    return True


def _write_now(stream: trio.SocketStream, data: memoryview) -> int:
    """As much of ``data`` as the socket takes without waiting (it is non-blocking): trio's
    ``send_all`` would add a cancel scope and a turn of the scheduler even when nothing waits."""
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as exc:  # reset, closed: the client is gone
        raise trio.BrokenResourceError(str(exc)) from exc


def peer_reset(sock: trio.socket.SocketType) -> bool:
    """Whether the peer has reset the connection (a closed socket's answer to data)."""
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        if hasattr(socket, "TCP_INFO"):
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
    except OSError:
        return True
    return False


async def wait_reset(sock: trio.socket.SocketType) -> None:
    """Return once the peer has reset the connection; look more rarely the longer it has not."""
    wait = _POLL_FIRST
    while not peer_reset(sock):
        await trio.sleep(wait)
        wait = min(wait * 2, _POLL_MAX)


def reset_on_close(stream: trio.SocketStream) -> None:
    """Make the coming close a reset, not a FIN: a cut answer must not pass for a whole one."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    except OSError:
        pass


def after(seconds: float) -> float:
    """The trio deadline ``seconds`` from now (inf stays inf)."""
    return trio.current_time() + seconds if math.isfinite(seconds) else math.inf
