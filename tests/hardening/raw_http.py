"""Raw-socket HTTP/1.1 for the hostile suite: bytes out as written, answers parsed as they come,
and ``epd-trio`` servers in subprocesses (a case that kills a process must be seen to kill it).

Blocking sockets with timeouts, no trio: a test reads what a hostile client would see,
including how the connection ended (closed, reset, or still open when the client gave up).
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

CLOSED, RESET, OPEN = "closed", "reset", "open"


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def closes(self) -> bool:
        return self.headers.get(b"connection", b"").lower() == b"close"


@dataclass
class Exchange:
    """What a client read: the answers in order (interim 1xx ones apart) and how it ended."""

    raw: bytes
    ended: str  # CLOSED, RESET or OPEN
    answers: list[Answer] = field(default_factory=list)
    interim: list[int] = field(default_factory=list)
    leftover: bytes = b""  # bytes that parse as no answer (a broken one)

    @property
    def statuses(self) -> list[int]:
        return [a.status for a in self.answers]

    def describe(self) -> str:
        return f"ended={self.ended} statuses={self.statuses} leftover={self.leftover[:80]!r} raw={self.raw[:300]!r}"


def parse_answers(raw: bytes, head_requests: int = 0) -> tuple[list[Answer], list[int], bytes]:
    """Answers framed by Content-Length (or chunked); the first ``head_requests`` have no body."""
    answers: list[Answer] = []
    interim: list[int] = []
    rest = raw
    while rest:
        head, sep, after = rest.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"HTTP/1."):
            break
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            interim.append(status)
            rest = after
            continue
        if len(answers) < head_requests:
            body, rest = b"", after
        elif b"content-length" in headers:
            length = int(headers[b"content-length"])
            if len(after) < length:
                break
            body, rest = after[:length], after[length:]
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, rest = _dechunk(after)
            if body is None:
                break
        else:
            body, rest = after, b""
        answers.append(Answer(status, headers, body))
    return answers, interim, rest


def _dechunk(data: bytes) -> tuple[Any, bytes]:
    body = b""
    while True:
        line, sep, data = data.partition(b"\r\n")
        if not sep:
            return None, b""
        size = int(line.split(b";")[0], 16)
        if size == 0:
            _, _, data = data.partition(b"\r\n")
            return body, data
        body, data = body + data[:size], data[size + 2:]


def connect(port: int, *, timeout: float = 10.0, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window the server sees
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket, *, timeout: float = 10.0) -> tuple[bytes, str]:
    """Read until the server closes or resets, or ``timeout`` passes with the connection open."""
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, OPEN
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return data, OPEN
        except ConnectionResetError:
            return data, RESET
        if not chunk:
            return data, CLOSED
        data += chunk


def exchange(port: int, request: bytes, *, half_close: bool = False, timeout: float = 10.0,
             head_requests: int = 0) -> Exchange:
    """Send ``request`` in one write (optionally half-closing after it), read to the end."""
    with connect(port, timeout=timeout) as sock:
        try:
            sock.sendall(request)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused mid-request: what it answered is still there to read
        raw, ended = read_all(sock, timeout=timeout)
    answers, interim, leftover = parse_answers(raw, head_requests)
    return Exchange(raw, ended, answers, interim, leftover)


# ---- epd-trio servers in subprocesses ---------------------------------------------------------
@dataclass
class Served:
    """An ``epd-trio`` server process: its role, HTTP server, port, and a GET that must answer 200."""

    role: str  # "encoder" or "bootstrap"
    server: str  # "builtin" or "hypercorn"
    args: tuple[str, ...]
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    _log: Any = None  # stderr goes to a file: a process that logs much must not block on a pipe

    @property
    def probe_path(self) -> str:
        return "/model_info" if self.role == "encoder" else "/list_encoder_urls"

    def start(self) -> None:
        env = {**os.environ, "EPD_LOG_LEVEL": "WARNING"}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process; stop() closes it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_trio.cli", self.role, "--port", "0", "--http-server", self.server,
             *self.args], stdout=subprocess.PIPE, stderr=self._log, env=env)

    def wait_listening(self, timeout: float = 180.0) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise AssertionError(f"{self} did not start within {timeout} s")
        line = self.proc.stdout.readline().decode()
        assert "listening on http://" in line, (line, self.stderr())
        self.port = int(line.rsplit(":", 1)[1])

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        """Start it again if an earlier case took it down (so one failure does not fail the rest)."""
        if not self.running():
            self.stop()
            self.start()
            self.wait_listening()

    def assert_serving(self) -> None:
        """The process is alive and answers a new connection's GET with a 200."""
        assert self.running(), f"{self} exited with {self.proc and self.proc.returncode}: {self.stderr()}"
        got = exchange(self.port, f"GET {self.probe_path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                       .encode(), timeout=10)
        assert got.statuses == [200], f"{self} no longer serves: {got.describe()}"

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running ``timeout`` seconds from now."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with proc:  # closes its stdout and reaps it
                proc.kill()  # nothing if it has exited
            self._log.close()

    def __str__(self) -> str:
        return f"epd-trio {self.role} --http-server {self.server}"
