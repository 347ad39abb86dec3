"""The HTTP servers (``epd_trio._http11``, the built-in one, and ``epd_trio._hypercorn``,
Hypercorn's protocol on our connections): real sockets on port 0, raw bytes where the framing
matters, each ASGI promise the faces rely on checked on the wire, under both."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from epd_trio._listen import bound_listener
from epd_trio._serving import HTTPServerConfig, LifespanFailure
from http_apps import SERVERS, answer, connect, echo_app, lifespan, read_body, read_until_closed, serving, split_answers


@pytest.fixture(params=list(SERVERS))
def server(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs under both servers."""
    return str(request.param)


async def test_keep_alive_requests_and_the_scope(server: str) -> None:
    seen: list[dict[str, Any]] = []
    async with serving(echo_app(seen), server) as (url, _), httpx.AsyncClient(base_url=url) as client:
        first = await client.post("/a%20b", params={"x": "1"}, content=b"hello")
        second = await client.get("/again")
    assert first.status_code == 200 and first.text == "POST /a b?x=1 hello"
    assert second.text == "GET /again? "
    assert first.headers["date"].endswith(" GMT")
    scope = seen[0]
    assert scope["raw_path"] == b"/a%20b" and scope["http_version"] == "1.1"
    assert scope["client"][0] == "127.0.0.1" and scope["server"][1] == int(url.rsplit(":", 1)[1])
    assert (b"content-length", b"5") in scope["headers"]
    assert seen[0]["client"] == seen[1]["client"]  # one connection, kept alive


async def test_pipelined_requests_are_answered_in_order_on_one_connection(server: str) -> None:
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST /1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
                                  b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n"
                                  b"GET /3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = split_answers(await read_until_closed(stream))
    assert [body for _, body in answers] == [b"POST /1? one", b"GET /2? ", b"GET /3? "]


async def test_a_chunked_body_after_100_continue(server: str) -> None:
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                  b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
            with trio.fail_after(10):
                interim = await stream.receive_some(65536)
            assert interim.startswith(b"HTTP/1.1 100 ")
            await stream.send_all(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            raw = await read_until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b"POST /c? abcde")


async def test_a_head_over_the_limit_in_pieces_is_431_json_and_closes(server: str) -> None:
    async with serving(echo_app(), server, max_header_bytes=1024) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            for _ in range(40):  # the head never ends; h11 refuses it once it is over the limit
                try:
                    await stream.send_all(b"X-Pad: " + b"p" * 60 + b"\r\n")
                except trio.BrokenResourceError:
                    break
            raw = await read_until_closed(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["type"] == "HeadersTooLargeError"


async def test_a_malformed_request_is_400_json_and_closes(server: str) -> None:
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            raw = await read_until_closed(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    error = json.loads(body)
    assert error["error"]["type"] == "RequestError" and "malformed" in error["error"]["message"]


@pytest.mark.parametrize("fault", ["raises", "leaves"])
async def test_an_app_that_gives_no_answer_is_a_500_and_the_connection_closes(server: str, fault: str,
                                                                               caplog: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif fault == "raises":
            raise ZeroDivisionError("a bug")

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await read_until_closed(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["type"] == "InternalError"
    assert ("a bug" in caplog.text) == (fault == "raises")


async def test_a_client_that_leaves_is_a_disconnect_to_the_app(server: str) -> None:
    told = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        assert (await receive())["type"] == "http.disconnect"  # blocks until the client leaves
        told.set()

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            await trio.sleep(0.05)
            assert not told.is_set()
            await stream.aclose()
            with trio.fail_after(10):
                await told.wait()


async def test_receive_after_the_answer_is_a_disconnect_and_pipelined_bytes_are_kept(server: str) -> None:
    """A disconnect watcher blocked in ``receive()`` is released by the answer, and a next
    request that arrived while it read is served, not lost."""
    watched = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)

        async def watch() -> None:
            watched.append((await receive())["type"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.sleep(0.1)  # the pipelined request arrives while the watcher reads
            await answer(send, scope["path"].encode())

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(0.02)
            await stream.send_all(b"GET /2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = split_answers(await read_until_closed(stream))
    assert [body for _, body in answers] == [b"/1", b"/2"]
    assert watched == ["http.disconnect", "http.disconnect"]


async def test_head_sends_no_body_and_a_streamed_answer_is_chunked(server: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await send({"type": "http.response.body", "body": b"cd"})

    async with serving(app, server) as (url, _), httpx.AsyncClient(base_url=url) as client:
        streamed = await client.get("/")
        head = await client.head("/")
    assert streamed.headers["transfer-encoding"] == "chunked" and streamed.content == b"abcd"
    assert head.status_code == 200 and head.content == b""


async def test_an_idle_connection_closes_after_the_keep_alive_timeout(server: str,
        autojump_clock: trio.testing.MockClock) -> None:
    async with serving(echo_app(), server, keep_alive_timeout=5.0) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            start = trio.current_time()
            raw = await read_until_closed(stream)  # the answer, then the close of the idle connection
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert trio.current_time() - start == pytest.approx(5.0, abs=0.5)


async def test_shutdown_closes_idle_connections_and_lets_a_busy_one_finish(server: str) -> None:
    release = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await read_body(receive)
        if scope["path"] == "/slow":
            await release.wait()
        await answer(send, b"done")

    async with serving(app, server, graceful_timeout=30.0, keep_alive_timeout=60.0) as (url, stop):
        async with await connect(url) as idle, await connect(url) as busy:
            await idle.send_all(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            with trio.fail_after(10):
                while not first.endswith(b"done"):  # the whole answer (Hypercorn writes it in parts)
                    first += await idle.receive_some(65536)
            assert first.startswith(b"HTTP/1.1 200 ")
            await busy.send_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(0.05)
            stop.set()
            with trio.fail_after(5):  # at once, not after its 60 s keep-alive
                assert await read_until_closed(idle) == b""
            release.set()
            raw = await read_until_closed(busy)
    assert raw.startswith(b"HTTP/1.1 200 ") and b"connection: close" in raw.lower()
    with pytest.raises(OSError):  # and nothing listens any more
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5).close()


async def test_a_request_past_the_graceful_timeout_is_cancelled(server: str,
        autojump_clock: trio.testing.MockClock) -> None:
    cancelled = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with serving(app, server, graceful_timeout=3.0) as (url, stop):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(1)
            start = trio.current_time()
            stop.set()
            assert await read_until_closed(stream) == b""
            await cancelled.wait()
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.5)


async def test_lifespan_startup_runs_before_the_first_request_and_a_failure_is_raised(server: str) -> None:
    order: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send, on_startup=lambda: order.append("startup"))
        order.append("request")
        await answer(send, b"")

    async with serving(app, server) as (url, _), httpx.AsyncClient(base_url=url) as client:
        await client.get("/")
    assert order == ["startup", "request"]

    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no model"})

    async with bound_listener("127.0.0.1", 0) as listener:
        with pytest.raises(LifespanFailure, match="no model"):
            await SERVERS[server](failing, [listener.sock], HTTPServerConfig(), shutdown_trigger=trio.sleep_forever)


async def test_an_app_without_lifespan_support_is_served(server: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError("only http")
        await answer(send, b"ok")

    async with serving(app, server) as (url, _), httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/")).text == "ok"


async def test_an_answer_before_the_body_is_read_reaches_a_client_still_sending_it(server: str) -> None:
    """A 413 given on the head alone closes the connection; the close drops the rest of the
    body instead of resetting the connection, which would destroy the answer unread."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await answer(send, b"too large", status=413, headers=((b"connection", b"close"),))

    size = 8 << 20
    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            with trio.fail_after(10):
                for _ in range(size // 65536):  # the whole body, as clients that write first do
                    await stream.send_all(b"b" * 65536)
            raw = await read_until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 413 ") and raw.endswith(b"too large")


@pytest.mark.parametrize("closes_after_app", [True, False])
async def test_guarded_sends_are_shielded_only_where_the_server_closes_inside_a_send(
        closes_after_app: bool, autojump_clock: trio.testing.MockClock) -> None:
    """Hypercorn's own worker closes a ``Connection: close`` socket inside the last ``send``, so
    a cancelled handler must not cut that send short; our servers close after the app returns."""
    from epd_trio._http import guarded_app
    from epd_trio._serving import CLOSES_AFTER_APP

    finished: list[bool] = []

    async def send(message: dict[str, Any]) -> None:
        await trio.sleep(1)  # cancelled here unless shielded
        finished.append(True)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        with trio.move_on_after(0.01):
            await send({"type": "http.response.start", "status": 200, "headers": []})

    scope = {"type": "http", "headers": [], "path": "/", "raw_path": b"/", "query_string": b"",
             "extensions": {CLOSES_AFTER_APP: {}} if closes_after_app else {}}
    await guarded_app(app, max_header_bytes=1024)(scope, None, send)
    assert finished == ([] if closes_after_app else [True])


async def test_a_client_that_reads_no_answer_is_dropped_after_the_write_timeout(server: str,
        autojump_clock: trio.testing.MockClock) -> None:
    sent = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await answer(send, b"x" * (64 << 20))  # far more than the socket buffers hold
        sent.set()

    async with serving(app, server, write_timeout=60.0) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            start = trio.current_time()
            await sent.wait()  # the app's send returns: the server gave up on this client
            assert trio.current_time() - start == pytest.approx(60.0, abs=1.0)
            got = 0
            with trio.fail_after(120), pytest.raises(trio.BrokenResourceError):
                while chunk := await stream.receive_some(1 << 20):  # what was sent, then the reset
                    got += len(chunk)
    assert 0 < got < 64 << 20  # cut short, and reset: a cut answer must not look complete


async def test_a_client_that_resets_before_it_is_served_does_not_end_the_server(server: str) -> None:
    """``getpeername`` fails on a connection reset before its task runs: that one closes."""
    async with serving(echo_app(), server) as (url, _), httpx.AsyncClient(base_url=url) as client:
        port = int(url.rsplit(":", 1)[1])

        def connect_and_reset() -> None:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()

        for _ in range(3):
            # Run with the trio thread held (a blocking join): the server accepts only after
            # the reset has landed, as a busy server does.
            thread = threading.Thread(target=connect_and_reset)
            thread.start()
            thread.join()
            await trio.sleep(0.05)
        assert (await client.get("/still")).text == "GET /still? "


async def test_content_length_with_transfer_encoding_is_400_and_closes(server: str) -> None:
    seen: list[dict[str, Any]] = []
    async with serving(echo_app(seen), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                                  b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await read_until_closed(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower()
    assert b"Transfer-Encoding" in body and seen == []  # the app never saw either request


async def test_an_answer_that_leaves_the_body_unread_says_it_closes(server: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await answer(send, scope["path"].encode())  # reads no body

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /bodiless HTTP/1.1\r\nHost: x\r\n\r\n"
                                  b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
            answers = split_answers(await read_until_closed(stream))
    assert [body for _, body in answers] == [b"/bodiless", b"/unread"]
    assert b"connection: close" not in answers[0][0].lower()  # a body-less request keeps it
    assert b"connection: close" in answers[1][0].lower()


async def test_a_malformed_chunked_body_is_400(server: str) -> None:
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"zz\r\nnot a chunk\r\n")
            raw = await read_until_closed(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["type"] == "RequestError"


async def test_http_1_0_is_answered_and_closed(server: str) -> None:
    async with serving(echo_app(), server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /old HTTP/1.0\r\n\r\n")
            raw = await read_until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b"GET /old? ")


async def test_an_app_that_stops_mid_answer_resets_the_connection(server: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part1", "more_body": True})
        raise RuntimeError("a bug mid-answer")

    async with serving(app, server) as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")  # HTTP/1.0: a close ends the body
            raw = b""
            with pytest.raises(trio.BrokenResourceError), trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    raw += chunk
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b"part1")


async def test_100_continue_and_an_early_answer_from_quart_reach_the_client_whole(server: str) -> None:
    """quart-trio reads the body (and so sends the 100) in one task and answers in another:
    the two writes take turns, never a ``BusyResourceError`` and a lost answer."""
    from quart_trio import QuartTrio

    quart = QuartTrio(__name__)

    @quart.route("/", methods=["POST"])
    async def refuse() -> tuple[str, int]:
        return "no", 401

    async with serving(quart, server) as (url, _):
        for _ in range(20):
            async with await connect(url) as stream:
                await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                                      b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
                raw = await read_until_closed(stream)
            assert b"HTTP/1.1 401 " in raw and raw.endswith(b"no"), raw


async def test_a_shielded_send_that_waits_forever_ends_after_its_limit(
        autojump_clock: trio.testing.MockClock) -> None:
    """Under a server that closes inside a send, sends are shielded; one waiting on something
    that never comes (Hypercorn's HTTP/2 stream buffer after its connection closed) held the
    process's shutdown forever. The shield now gives up after ``SHIELDED_SEND_LIMIT``."""
    from epd_trio._http import SHIELDED_SEND_LIMIT, guarded_app

    async def send(message: dict[str, Any]) -> None:
        await trio.sleep_forever()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        with trio.CancelScope() as handler:
            handler.cancel()  # the client left: the handler is cancelled, its send shielded
            await send({"type": "http.response.start", "status": 200, "headers": []})

    scope = {"type": "http", "headers": [], "path": "/", "raw_path": b"/", "query_string": b"", "extensions": {}}
    await guarded_app(app, max_header_bytes=1024)(scope, None, send)
    assert trio.current_time() == SHIELDED_SEND_LIMIT


async def test_an_answer_sent_from_a_task_cancelled_as_it_answers_still_leaves() -> None:
    """The built-in server writes what the socket takes at once without a checkpoint: an app's
    last send is often cancelled by its own disconnect watcher (quart-trio's, when a broken
    body ends the request), and its answer — here the 400 that replaces it — must still leave."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        with trio.CancelScope() as handler:
            handler.cancel()  # the watcher has cancelled the handler as it answers
            await answer(send, b"answered")

    async with serving(app, "builtin") as (url, _):
        for request, expected in ((b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"answered"),
                                  (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                                   b"RequestError")):
            async with await connect(url) as stream:
                await stream.send_all(request)
                raw = await read_until_closed(stream)
            assert expected in raw, raw
