"""``tools/bench_epd.py``'s reading of streams and its table (the run itself needs vLLM:
the docs' numbers come from it on a quiet machine)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from conftest import load_tool
from epd_trio._listen import bound_listener, start_http_server

bench = load_tool("bench_epd")


def _event(**choice: Any) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, **choice}]})


@pytest.mark.parametrize(("line", "token"), [
    (_event(delta={"role": "assistant", "content": ""}), False),  # vLLM's first, role-only event
    (_event(delta={"content": "a"}), True),
    (_event(delta={"content": ""}, token_ids=[17]), True),  # a token that decodes to no text yet
    ("data: [DONE]", False),
    (": keep-alive", False),
    ("data: {not json", False),
    ('data: {"choices": []}', False),
])
def test_a_token_is_an_event_with_text_or_token_ids(line: str, token: bool) -> None:
    assert bench.first_token(line) is token


def test_a_failed_stream_is_an_error_not_a_token() -> None:
    with pytest.raises(RuntimeError, match="the stream failed"):
        bench.first_token('data: {"error": {"message": "gone", "code": 504}}')


def test_the_table_gives_each_epd_setup_as_ratios_to_vllm_alone() -> None:
    cells = [bench.Cell(1, bench.ALONE, (0.100, 0.200, 0.300)),
             bench.Cell(1, bench.setup_name(2), (0.050, 0.100, 0.600)),
             bench.Cell(4, bench.ALONE, (0.400,)),
             bench.Cell(4, bench.setup_name(1), (0.200,))]
    rows = bench.rows(cells)
    assert rows[0] == ("1", "vLLM alone", "3", "200", "300", "", "")
    assert rows[1] == ("1", "EPD, 2 encoders", "3", "100", "600", "0.50", "2.00")
    assert rows[3] == ("4", "EPD, 1 encoder", "1", "200", "200", "0.50", "0.50")


def test_quick_and_full_runs_take_their_defaults_and_flags_win() -> None:
    quick = bench.parse_args(["--quick"])
    assert (quick.images, quick.encoders, quick.requests, quick.image_size) == ([1, 4], [1, 2], 3, 224)
    full = bench.parse_args(["--encoders", "3"])
    assert (full.images, full.encoders, full.requests, full.image_size) == ([1, 4, 8], [3], 20, 448)
    with pytest.raises(SystemExit):
        bench.parse_args(["--images", "0"])


async def test_ttft_runs_to_the_first_token_not_the_first_event() -> None:
    async def slow_stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for line, delay in ((_event(delta={"role": "assistant", "content": ""}), 0.0),
                            (_event(delta={"content": "x"}), 0.3), ("data: [DONE]", 0.0)):
            await trio.sleep(delay)
            await send({"type": "http.response.body", "body": (line + "\n\n").encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with bound_listener("127.0.0.1", 0) as listener, trio.open_nursery() as nursery:
        stop = trio.Event()
        url = await start_http_server(nursery, slow_stream, listener, server="builtin",
                                      graceful_timeout=1.0, shutdown_trigger=stop.wait)
        async with httpx.AsyncClient() as http:
            seconds = await bench.ttft(http, url, b"{}")
        stop.set()
    assert 0.3 <= seconds < 5
