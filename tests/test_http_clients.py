"""Clients the HTTP edge must survive, in process, under both servers: framing broken while the
server reads ahead, bodies of tiny chunks, half-closes, slow and never-reading readers, what is
refused before any app runs. Timeouts at exact virtual times where a timeout is the subject."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from epd_trio._wire import WRITE_PIECE
from http_apps import SERVERS, answer, connect, echo_app, lifespan, read_body, read_until_closed, serving, split_answers


@pytest.fixture(params=list(SERVERS))
def server(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def error_type(raw: bytes) -> str:
    return str(json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["type"])


def quick_app(seen: list[str] | None = None) -> Any:
    """Answers its path at once, reading no body."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if seen is not None:
            seen.append(scope["path"])
        await answer(send, scope["path"].encode())

    return app


def answering(body: bytes) -> Any:
    """Answers ``body`` to every request."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await answer(send, body)

    return app


# ---- framing broken where the server reads ahead ------------------------------------------------
async def test_a_bad_chunk_footer_read_with_its_data_is_400_not_a_reset(server: str) -> None:
    """The chunk's data and its broken footer arrive in one read: the footer was found while
    joining the body, and the built-in server dropped the connection with no answer."""
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST /abort HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b'f\r\n{"req_id":"zz"}XX0\r\n\r\n')
            raw = await read_until_closed(stream)
    assert status_of(raw) == 400 and error_type(raw) == "RequestError", raw
    assert b"connection: close" in raw.lower()


async def test_an_answer_to_a_request_whose_unread_body_is_broken_becomes_its_400(server: str) -> None:
    """A GET answered without reading its (broken) chunked body: the 400 goes out instead of
    the app's answer. Under Hypercorn's own worker the two raced, and the process died."""
    seen: list[str] = []
    async with serving(quick_app(seen), server) as (url, _):
        for _ in range(5):
            async with await connect(url) as stream:
                await stream.send_all(b"GET /info HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                raw = await read_until_closed(stream)
            assert len(split_answers(raw)) == 1 and status_of(raw) == 400, raw
        async with await connect(url) as stream:  # and it still serves
            await stream.send_all(b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert split_answers(await read_until_closed(stream))[0][1] == b"/after"


async def test_a_chunk_header_over_the_head_limit_is_431(server: str) -> None:
    async with serving(echo_app(), server, max_header_bytes=1024) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;"
                                  + b"e" * 5000)  # an unfinished chunk header, already over the limit
            raw = await read_until_closed(stream)
    assert status_of(raw) == 431 and error_type(raw) == "HeadersTooLargeError", raw


# ---- refused before any app runs ----------------------------------------------------------------
@pytest.mark.parametrize("head", [b"head / HTTP/1.1\r\nHost: x", b"Get / HTTP/1.1\r\nHost: x",
                                  b"PRI * HTTP/2.0", b"GET / HTTP/2.0\r\nHost: x",
                                  b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: CHUNKED"],
                         ids=["lower-case-head", "mixed-case-get", "http2-preface", "http2-version", "cl-and-te"])
async def test_what_is_refused_before_any_app_runs(server: str, head: bytes) -> None:
    seen: list[str] = []
    async with serving(quick_app(seen), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(head + b"\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await read_until_closed(stream)
    assert status_of(raw) == 400 and error_type(raw) == "RequestError", raw
    assert len(split_answers(raw)) == 1 and seen == []


@pytest.mark.parametrize("upgrade", [b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                                     b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                     b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"], ids=["websocket", "h2c"])
async def test_an_upgrade_is_declined_by_answering_over_http_1_1(server: str, upgrade: bytes) -> None:
    seen: list[str] = []
    async with serving(quick_app(seen), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /up HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n\r\n"
                                  b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = await read_until_closed(stream)
    assert b" 101 " not in raw and [body for _, body in split_answers(raw)] == [b"/up", b"/next"]
    assert seen == ["/up", "/next"]


# ---- a body of tiny chunks ----------------------------------------------------------------------
async def test_a_body_of_tiny_chunks_lets_other_tasks_run(server: str) -> None:
    """h11 parses each chunk on the trio thread: the body is handed over with a checkpoint per
    bounded number of chunks, so a task that only yields gets a turn at least once per 256 of
    them (the built-in server gave it one per socket read: ~11 000 one-byte chunks)."""
    chunks = 30_000
    turns = 0
    done = trio.Event()
    received: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        received.append(await read_body(receive))
        done.set()
        await answer(send, b"ok")

    async def ticker() -> None:
        nonlocal turns
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            turns += 1

    letters = bytes(97 + i % 26 for i in range(chunks))
    body = b"".join(b"1\r\n%c\r\n" % letter for letter in letters) + b"0\r\n\r\n"
    async with serving(app, server) as (url, _):
        async with await connect(url) as stream, trio.open_nursery() as nursery:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            await trio.sleep(0.05)
            nursery.start_soon(ticker)
            await stream.send_all(body)
            with trio.fail_after(30):
                await done.wait()
    assert received == [letters]
    assert turns >= chunks // 256, turns


# ---- half-closes --------------------------------------------------------------------------------
def watching_app(work: Any) -> Any:
    """Answers its path after ``await work(path)``, cancelled if its client leaves first (a
    watcher task on ``receive()``, as quart-trio and the bare routes have)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                await receive()  # http.disconnect: the client left, or the answer is complete
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await work(scope["path"])
            await answer(send, scope["path"].encode())

    return app


async def test_a_client_that_half_closes_gets_every_answer(server: str) -> None:
    """Its FIN ended only its sending: the built-in server took it for leaving, the app was
    cancelled, and the answers were lost."""
    async def work(path: str) -> None:
        if path == "/slow":
            await trio.sleep(0.5)  # answered well after the FIN: probed, and still there

    app = watching_app(work)

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                                  b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n")
            await stream.send_eof()
            raw = await read_until_closed(stream)
    assert [body for _, body in split_answers(raw)] == [b"/1", b"/slow", b"/3"]
    assert raw.count(b"HTTP/1.1 100 ") <= 1  # at most the probe, before the slow answer


async def test_an_http_1_0_client_that_half_closes_gets_no_interim_answer(server: str) -> None:
    async def work(path: str) -> None:
        await trio.sleep(0.5)

    async with serving(watching_app(work), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /late HTTP/1.0\r\n\r\n")
            await stream.send_eof()
            raw = await read_until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b"/late")  # RFC 9110 15.2: no 1xx to 1.0


async def test_a_client_that_closes_altogether_during_a_slow_answer_is_a_disconnect(server: str) -> None:
    """Its FIN alone could be a half-close: the probe's reset tells the app it has gone."""
    told = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        assert (await receive())["type"] == "http.disconnect"
        told.set()

    async with serving(app, server) as (url, _):
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.05)
        sock.close()
        with trio.fail_after(10):
            await told.wait()


# ---- slow and never-reading clients -------------------------------------------------------------
async def test_a_head_dribbled_slower_than_the_keep_alive_timeout_is_closed(
        server: str, autojump_clock: trio.testing.MockClock) -> None:
    async with serving(echo_app(), server, keep_alive_timeout=5.0) as (url, _):
        async with await connect(url) as stream:
            start = trio.current_time()
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            with pytest.raises(trio.BrokenResourceError):
                for _ in range(10):  # a header line a second: the head never completes
                    await trio.sleep(1)
                    await stream.send_all(b"X-Slow: 1\r\n")  # fails once the server has closed
            closed = trio.current_time() - start
    assert 5.0 <= closed <= 7.0, closed

async def test_a_slow_but_steady_reader_gets_its_whole_answer(server: str,
                                                              autojump_clock: trio.testing.MockClock) -> None:
    """~8 KiB/s: far under the 1 MiB per write timeout that cut such a reader at ~67 s, far over
    ``WRITE_PIECE`` per ``write_timeout`` (the progress a client must make)."""
    size = 4 << 20
    async with serving(answering(b"x" * size), server, write_timeout=60.0) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = b""
            while chunk := await stream.receive_some(8192):
                raw += chunk
                await trio.sleep(1)
    assert raw.endswith(b"x" * 100) and len(split_answers(raw)[0][1]) == size
    assert trio.current_time() > size / 8192 / 2  # it really was read slowly


async def test_a_reader_slower_than_a_piece_per_write_timeout_is_reset(server: str,
                                                                       autojump_clock: trio.testing.MockClock) -> None:
    size = 32 << 20
    async with serving(answering(b"x" * size), server, write_timeout=10.0) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = 0
            with pytest.raises(trio.BrokenResourceError):
                while chunk := await stream.receive_some(WRITE_PIECE // 32):
                    got += len(chunk)
                    await trio.sleep(1)  # WRITE_PIECE / 32 per second: a piece takes 32 s > 10 s
    assert 0 < got < size


# ---- shutdown -----------------------------------------------------------------------------------
async def test_shutdown_waits_no_longer_than_its_grace_for_a_half_sent_body(
        server: str, autojump_clock: trio.testing.MockClock) -> None:
    """A request whose body never completes is cancelled at the grace; its close then reads
    and drops nothing more (the 2 s linger is for early answers, not for shutting down)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        await answer(send, b"never")

    async with serving(app, server, graceful_timeout=3.0) as (url, stop):
        stream = await connect(url)  # open (and silent) until the server has stopped
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nhalf")
        await trio.sleep(1)
        start = trio.current_time()
        stop.set()
    stopped = trio.current_time()
    await stream.aclose()
    assert stopped - start == pytest.approx(3.0, abs=0.1)
