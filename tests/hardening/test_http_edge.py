"""The HTTP edge against hostile clients, raw sockets, under both HTTP servers, for the encoder
and the registry as operators run them (``epd-trio`` subprocesses): each case has its expected
answer, and after each the process must still be serving.

Smuggling shapes, malformed framing, upgrades, pipelining, half-closes, slow and never-reading
clients. A case that once killed a process or made it ignore SIGTERM is run where that shows:
the processes are checked after every case (and started again if a case took one down, so the
other cases still run), and the last test leaves what once hung a shutdown behind, then stops
all four with SIGTERM.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from raw_http import CLOSED, Served, connect, exchange

pytestmark = pytest.mark.slow

SERVERS = ("builtin", "hypercorn")
ROLES = ("encoder", "bootstrap")


@dataclass(frozen=True)
class Post:
    """A POST the target serves: its path, a JSON body and the status that body gets."""

    path: str
    body: bytes
    status: int


POSTS = {"encoder": Post("/abort", b'{"req_id":"zz"}', 404),
         "bootstrap": Post("/unregister_encoder_url", b'{"url":"http://h:1"}', 200)}


@pytest.fixture(scope="module")
def processes(qwen25_path: str) -> Iterator[dict[str, Served]]:
    """One process per role and server, started together (they load in parallel)."""
    procs = {f"{role}-{server}": Served(role, server, ("--model-path", qwen25_path) if role == "encoder" else ())
             for role in ROLES for server in SERVERS}
    try:
        for proc in procs.values():
            proc.start()
        for proc in procs.values():
            proc.wait_listening()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(params=[f"{role}-{server}" for role in ROLES for server in SERVERS])
def target(request: pytest.FixtureRequest, processes: dict[str, Served]) -> Iterator[Served]:
    """A running process; after the test it must still serve a new connection."""
    proc = processes[request.param]
    proc.ensure_running()
    yield proc
    proc.assert_serving()


def get(target: Served, *headers: str, version: str = "1.1", method: str = "GET") -> bytes:
    lines = [f"{method} {target.probe_path} HTTP/{version}", "Host: x", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post_head(target: Served, *headers: str) -> bytes:
    return (f"POST {POSTS[target.role].path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def assert_refused(got, status: int | tuple[int, ...] = 400) -> None:  # type: ignore[no-untyped-def]
    """One answer with ``status``, and the connection closed after it (nothing else served)."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert len(got.answers) == 1 and got.statuses[0] in statuses, got.describe()
    assert got.ended == CLOSED and got.leftover == b"", got.describe()
    assert got.answers[0].closes, got.describe()


# ---- smuggling shapes ------------------------------------------------------------------------
TE_SHAPES = {"plain": "Transfer-Encoding: chunked", "trailing space": "Transfer-Encoding: chunked ",
             "tab": "Transfer-Encoding:\tchunked", "upper case": "Transfer-Encoding: CHUNKED",
             "obs-fold": "Transfer-Encoding:\r\n chunked"}


@pytest.mark.parametrize("shape", list(TE_SHAPES))
def test_content_length_with_transfer_encoding_is_400_and_the_smuggled_request_is_never_served(
        target: Served, shape: str) -> None:
    body = POSTS[target.role].body
    request = post_head(target, f"Content-Length: {len(chunked(body))}", TE_SHAPES[shape]) + chunked(body) \
        + get(target)  # a request "inside" the body, for a front end that framed it by Content-Length
    assert_refused(exchange(target.port, request))


def test_two_content_lengths_are_400(target: Served) -> None:
    body = POSTS[target.role].body
    request = post_head(target, f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 5}") + body
    assert_refused(exchange(target.port, request))


def test_a_transfer_coding_other_than_chunked_is_refused(target: Served) -> None:
    request = post_head(target, "Transfer-Encoding: gzip, chunked") + chunked(b"x") + get(target)
    assert_refused(exchange(target.port, request), (400, 501))


# ---- malformed framing -----------------------------------------------------------------------
def test_a_broken_chunk_header_on_a_get_is_400_every_time(target: Served) -> None:
    """Under Hypercorn this raced the app's own answer: a BusyResourceError ended the process."""
    request = get(target, "Transfer-Encoding: chunked") + b"zz\r\n"
    for _ in range(20):
        assert_refused(exchange(target.port, request))
        assert target.running(), target.stderr()


def test_a_broken_chunk_footer_read_ahead_with_its_data_is_400(target: Served) -> None:
    body = POSTS[target.role].body
    request = post_head(target, "Transfer-Encoding: chunked") + b"%x\r\n%sXX0\r\n\r\n" % (len(body), body)
    assert_refused(exchange(target.port, request))


def test_content_length_with_transfer_encoding_and_a_broken_chunk_is_400(target: Served) -> None:
    request = post_head(target, "Content-Length: 4", "Transfer-Encoding: chunked") + b"zz\r\n"
    assert_refused(exchange(target.port, request))


def test_a_chunk_extension_over_the_head_limit_is_431(target: Served) -> None:
    request = post_head(target, "Transfer-Encoding: chunked") + b"1;" + b"e" * 100_000 + b"\r\nx\r\n0\r\n\r\n"
    assert_refused(exchange(target.port, request), 431)


@pytest.mark.parametrize("shape", ["one long header", "many headers"])
def test_a_head_over_the_limit_with_a_pipelined_request_is_431_then_closed(target: Served, shape: str) -> None:
    pad = [f"X-Pad: {'a' * 70_000}"] if shape == "one long header" else [f"X-Pad-{i}: {'a' * 50}" for i in range(400)]
    assert_refused(exchange(target.port, get(target, *pad) + get(target)), 431)


def test_a_malformed_request_line_is_400(target: Served) -> None:
    assert_refused(exchange(target.port, b"NOT HTTP AT ALL\r\n\r\n" + get(target)))


def test_methods_are_case_sensitive(target: Served) -> None:
    """``head`` is no HEAD: Hypercorn served it as one and broke the answer's framing."""
    for method in ("head", "get"):
        assert_refused(exchange(target.port, get(target, method=method) + get(target)))


def test_http2_prior_knowledge_is_refused(target: Served) -> None:
    assert_refused(exchange(target.port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))


# ---- upgrades: declined, the request answered over HTTP/1.1 ------------------------------------
UPGRADES = {
    "websocket": ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="),
    "h2c": ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"),
}


@pytest.mark.parametrize("upgrade", list(UPGRADES))
def test_an_upgrade_is_declined_and_a_pipelined_request_still_answered(target: Served, upgrade: str) -> None:
    got = exchange(target.port, get(target, *UPGRADES[upgrade]) + get(target, "Connection: close"))
    assert got.statuses == [200, 200] and got.interim == [], got.describe()  # no 101
    assert got.ended == CLOSED


@pytest.mark.parametrize("upgrade", list(UPGRADES))
def test_an_upgrade_then_a_half_close_is_answered(target: Served, upgrade: str) -> None:
    got = exchange(target.port, get(target, *UPGRADES[upgrade]) + get(target), half_close=True)
    assert got.statuses == [200, 200] and got.ended == CLOSED, got.describe()


# ---- pipelining --------------------------------------------------------------------------------
def test_pipelined_requests_are_answered_in_order(target: Served) -> None:
    got = exchange(target.port, get(target) * 2 + get(target, "Connection: close"))
    assert got.statuses == [200, 200, 200] and got.ended == CLOSED, got.describe()
    assert got.answers[2].closes and not got.answers[0].closes


@pytest.mark.parametrize("first", ["Connection: close", "HTTP/1.0"])
def test_nothing_after_a_request_that_closes_is_served(target: Served, first: str) -> None:
    opening = get(target, version="1.0") if first == "HTTP/1.0" else get(target, first)
    got = exchange(target.port, opening + get(target) + get(target))
    assert got.statuses == [200] and got.ended == CLOSED and got.leftover == b"", got.describe()


# ---- half-closes -----------------------------------------------------------------------------
def test_a_client_that_half_closes_after_its_requests_gets_every_answer(target: Served) -> None:
    got = exchange(target.port, get(target) * 3, half_close=True)
    assert got.statuses == [200, 200, 200] and got.ended == CLOSED, got.describe()


def test_a_post_then_a_half_close_is_answered(target: Served) -> None:
    post = POSTS[target.role]
    got = exchange(target.port, post_head(target, f"Content-Length: {len(post.body)}") + post.body,
                   half_close=True)
    assert got.statuses == [post.status] and got.ended == CLOSED, got.describe()
    assert set(json.loads(got.answers[0].body)) >= ({"error"} if post.status >= 400 else {"url"})


def test_a_body_cut_short_by_a_half_close_ends_the_connection(target: Served) -> None:
    got = exchange(target.port, post_head(target, "Content-Length: 100") + b'{"req', half_close=True)
    assert got.ended == CLOSED and got.statuses in ([], [400]), got.describe()


# ---- slow and never-reading clients ----------------------------------------------------------
def test_a_client_dribbling_its_head_holds_nothing_else_up(target: Served) -> None:
    with connect(target.port) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):
            slow.sendall(b"X-Slow: 1\r\n")
            target.assert_serving()


def test_a_client_that_never_reads_holds_nothing_else_up(target: Served) -> None:
    with never_reading_client(target):
        target.assert_serving()


def pipeline_without_reading(target: Served, sock: socket.socket, seconds: float = 3.0) -> None:
    """Pipeline GETs and read none of the answers, until the server has taken none for 0.5 s
    (its writes wait on this client, its reads on its writes) or ``seconds`` have passed."""
    request = get(target) * 64
    sock.setblocking(False)
    deadline = time.monotonic() + seconds
    stalled_since = None
    while time.monotonic() < deadline:
        try:
            sock.send(request)
            stalled_since = None
        except BlockingIOError:
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 0.5:
                return
            time.sleep(0.02)
        except OSError:
            return


@contextmanager
def never_reading_client(target: Served) -> Iterator[socket.socket]:
    """A connection whose answers fill the socket buffers both ways, left open for the block."""
    with connect(target.port, rcvbuf=4096) as sock:
        pipeline_without_reading(target, sock)
        yield sock


def test_the_answer_parser_reads_interim_and_chunked_answers() -> None:
    """The suite's own parser, on bytes whose answers are known."""
    from raw_http import parse_answers

    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
           b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\nHTTP/1.1 4")
    answers, interim, leftover = parse_answers(raw)
    assert [(a.status, a.body) for a in answers] == [(200, b"ok"), (200, b"abc")]
    assert interim == [100] and leftover == b"HTTP/1.1 4"


# ---- last: SIGTERM, after every case above --------------------------------------------------------
SIGTERM_WITHIN = 30.0  # seconds: the encoder's drain is bounded, the HTTP grace is 2 s


def test_every_process_answers_sigterm_after_the_cases(processes: dict[str, Served]) -> None:
    """What once made a process ignore SIGTERM, left behind, then SIGTERM to all four at once:
    an h2c upgrade with a pipelined request whose client left (Hypercorn's HTTP/2 stream buffer
    waited forever behind a shielded send), a websocket upgrade likewise, and a client that
    reads nothing while its answers fill the socket buffers (Hypercorn shields its writes)."""
    with ExitStack() as clients:
        for proc in processes.values():
            proc.ensure_running()
            for upgrade in UPGRADES.values():  # the client reads its first answer, then leaves
                exchange(proc.port, get(proc, *upgrade) + get(proc), timeout=0.5)
            clients.enter_context(never_reading_client(proc))
            proc.assert_serving()
        for proc in processes.values():
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SIGTERM_WITHIN
        codes = {name: proc.wait_exit(max(0.1, deadline - time.monotonic())) for name, proc in processes.items()}
    assert codes == dict.fromkeys(processes, 0), {n: p.stderr() for n, p in processes.items() if codes[n] != 0}
