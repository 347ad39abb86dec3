"""A real HTTP/1.1 media server on a loopback port, scripted per path, for fetch tests.

A few lines over ``trio.serve_tcp`` rather than a mock transport: the loader's
client connects, reads headers and streams bodies for real, so lying
Content-Lengths, trickling bodies and redirect chains are what a server sends.
One request per connection (``Connection: close``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import trio

__all__ = ["NO_LENGTH", "FakeDNS", "MediaServer", "Route", "redirect"]

TRUE_LENGTH = -1  # send the body's real Content-Length
NO_LENGTH = -2    # send none: the body ends when the connection closes


@dataclass(frozen=True)
class Route:
    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    content_length: int = TRUE_LENGTH  # or a lie, or NO_LENGTH
    trickle: float = 0.0  # seconds between bytes of the body (0: all at once)
    stall: bool = False  # send the head, then never the body


def redirect(location: str, status: int = 302) -> Route:
    return Route(status, headers=(("Location", location),))


@dataclass
class MediaServer:
    routes: dict[str, Route] = field(default_factory=dict)
    port: int = 0
    connections: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, headers)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def start(self, nursery: trio.Nursery) -> MediaServer:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._serve, 0,
                                                          host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]
        return self

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
            lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in lines[1:])}
            self.requests.append((path, headers))
            try:
                await self._answer(stream, self.routes.get(path, Route(404, b"not found")))
            except trio.BrokenResourceError:
                pass  # the client left (over a cap, past its deadline): what the tests provoke

    async def _answer(self, stream: trio.SocketStream, route: Route) -> None:
        out = [f"HTTP/1.1 {route.status} X", "Connection: close",
               *(f"{k}: {v}" for k, v in route.headers)]
        if route.content_length != NO_LENGTH:
            length = len(route.body) if route.content_length == TRUE_LENGTH else route.content_length
            out.append(f"Content-Length: {length}")
        await stream.send_all(("\r\n".join(out) + "\r\n\r\n").encode())
        if route.stall:
            await trio.sleep_forever()
        if not route.trickle:
            await stream.send_all(route.body)
            return
        for i in range(len(route.body)):
            if i:
                await trio.sleep(route.trickle)
            await stream.send_all(route.body[i:i + 1])


class FakeDNS:
    """The loader's resolver seam: fixed answers, and a record of every name asked."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: bytes, port: int) -> list[str]:
        import socket

        name = host.decode()
        self.asked.append(name)
        if name not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.answers[name]
