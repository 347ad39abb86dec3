"""A client connection's socket as both HTTP servers drive it (``Wire``): bounded writes in
order, telling a client that half-closed from one that has gone, resetting a connection whose
answer was cut short, and a close that does not destroy an early answer.

* **Writes** (``write_bounded``): what the non-blocking socket takes at once leaves in one
  ``os.write`` (a small answer whole: no timer, no scheduler turn); the rest is sent in
  ``WRITE_PIECE`` pieces, each of which the client must take within ``write_timeout``. That
  measures progress, not the whole answer: a client reading slowly but steadily (over
  ``WRITE_PIECE`` per ``write_timeout``, ~1 KiB/s by default) gets any answer; one that stops
  reading is cut off one ``write_timeout`` after the socket buffers fill.
* **A client's FIN** ends its sending, not its reading (a half-close): requests already read
  are answered. Whether it has gone altogether shows only when something is written to it:
  once the answer is ``PROBE_AFTER`` late, a connection writes an interim ``100 Continue``
  (every HTTP/1.1 client must accept and skip a 1xx, RFC 9110 15.2; none goes to HTTP/1.0)
  and watches for the reset a closed socket answers data with (``Wire.wait_gone``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Final

import trio

__all__ = ["PROBE_AFTER", "WRITE_PIECE", "Wire", "after", "peer_reset", "wait_reset", "write_bounded"]

log = logging.getLogger(__name__)

MAX_RECV: Final = 1 << 16

WRITE_PIECE: Final = 1 << 16  # bytes a client must take per write_timeout once its buffers are full
PROBE_AFTER: Final = 0.1  # seconds an answer may take after a client's FIN before it is probed
_POLL_FIRST, _POLL_MAX = 0.01, 1.0  # seconds between looks for the peer's reset, growing
_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
_CLOSE_TIMEOUT: Final = 5.0  # seconds a closing socket may take to flush (shielded)
_LINGER: Final = 2.0  # seconds a close reads (and drops) a body the client is still sending
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


def after(seconds: float) -> float:
    """The trio deadline ``seconds`` from now (inf stays inf)."""
    return trio.current_time() + seconds if math.isfinite(seconds) else math.inf


class Wire:
    """A client connection's socket; both servers' connections are one."""

    def __init__(self, stream: trio.SocketStream, write_timeout: float) -> None:
        self.stream = stream
        self.write_timeout = write_timeout
        self.gone = False  # the client has reset or vanished: nothing more can reach it
        self.eof = False  # the client has finished sending (its FIN): it may still read
        self.broken = False  # a write was cut short: the stream cannot carry another answer
        self.client = address(stream.socket.getpeername)
        self.local = address(stream.socket.getsockname)
        self._writing = trio.Lock()  # two tasks may write (quart-trio's 100 Continue, an app task)

    async def read(self) -> bytes:
        """The next bytes; b"" at the client's FIN (``eof``) or once it has reset (``gone`` too)."""
        try:
            data = await self.stream.receive_some(MAX_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
            data = b""
        self.eof = self.eof or not data
        return data

    async def write(self, data: bytes) -> None:
        """Send ``data`` in order with any other task's (h11 made the bytes in order); a client
        gone, or one that stops reading (``write_bounded``), ends the connection, and so does a
        writer cancelled before all of ``data`` left (h11 has moved on: the stream is broken).
        What the socket takes at once leaves even from a cancelled task (no checkpoint first):
        an app's last send is often cancelled by its own disconnect watcher."""
        if self.gone or self.broken:
            return
        try:
            try:
                self._writing.acquire_nowait()  # no checkpoint when nothing else writes
            except trio.WouldBlock:
                await self._writing.acquire()
        except BaseException:
            self.broken = True
            raise
        try:
            if not await write_bounded(self.stream, data, self.write_timeout):
                log.info("HTTP client %s took too little of its answer within %g s: resetting",
                         self.client, self.write_timeout)
                self.broken = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
        except BaseException:  # cancelled mid-write: part of an answer may be on the wire
            self.broken = True
            raise
        finally:
            self._writing.release()

    async def wait_gone(self, interim: Callable[[], bytes | None]) -> None:
        """After the client's FIN, return once it turns out to have gone altogether: once its
        answer is ``PROBE_AFTER`` late, ``interim()`` (a 100 Continue, or None where none may go)
        is written, and a closed socket answers it with a reset. Runs until cancelled (the
        answer completes) if the client is still reading."""
        await trio.sleep(PROBE_AFTER)
        probe = interim()
        if probe:
            await self.write(probe)
        await wait_reset(self.stream.socket)
        self.gone = True

    async def close(self, *, unread_body: bool) -> None:
        """A reset after a cut answer (it must not pass for a whole one); else a FIN, and with
        ``unread_body`` (an answer given before the request was read whole: 413, 431) what the
        client still sends is read and dropped for up to ``_LINGER`` seconds, since closing a
        socket with unread bytes resets the connection, which can destroy that answer unread."""
        if self.broken:
            try:
                self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:
                pass
            await self.stream.aclose()
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
            try:
                await self.stream.send_eof()
                if unread_body and not (self.eof or self.gone):
                    with trio.move_on_after(_LINGER):
                        while await self.read():
                            pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass
            await self.stream.aclose()


def address(get: Callable[[], Any]) -> tuple[str, int] | None:
    """``(host, port)`` of a socket's end; None once the client has reset the connection."""
    try:
        raw = get()
    except OSError:
        return None
    return (raw[0], raw[1]) if isinstance(raw, tuple) and len(raw) >= 2 else None
