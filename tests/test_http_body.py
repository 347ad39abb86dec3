"""Large JSON bodies are parsed off the event loop, with the same results and errors."""

from __future__ import annotations

import json
import threading

import pytest
import trio

from epd_trio._http import OFFLOAD_BODY_BYTES, parse_json_off_loop
from epd_trio.errors import RequestError
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.requests import parse_json_body


async def test_small_bodies_parse_on_the_loop_and_large_ones_in_a_thread() -> None:
    threads = trio.CapacityLimiter(1)
    seen: list[str] = []
    body = {"req_id": "r", "pad": "x" * OFFLOAD_BODY_BYTES}

    def parse(raw: bytes) -> dict:
        seen.append(threading.current_thread().name)
        return json.loads(raw)

    assert await parse_json_off_loop(b'{"a": 1}', threads, parse) == {"a": 1}
    assert await parse_json_off_loop(json.dumps(body).encode(), threads, parse) == body
    assert seen[0] == threading.current_thread().name and seen[1] != seen[0]


@pytest.mark.parametrize("raw", [
    b"[" * (OFFLOAD_BODY_BYTES + 10),                      # nested too deep
    b'"a string"' + b" " * OFFLOAD_BODY_BYTES,              # not an object
    b'{"req_id": "' + b"x" * OFFLOAD_BODY_BYTES,            # cut short
])
async def test_a_large_bad_body_is_the_same_400(raw: bytes) -> None:
    with pytest.raises(RequestError) as on_loop:
        parse_json_body(raw)
    with pytest.raises(RequestError) as off_loop:
        await parse_json_off_loop(raw, trio.CapacityLimiter(1))
    assert off_loop.value.message == on_loop.value.message


async def test_joined_body_gives_quarts_results_with_one_copy() -> None:
    from werkzeug.exceptions import RequestEntityTooLarge

    from epd_trio._http import JoinedBody

    body = JoinedBody(None, 100)
    for chunk in (b"ab", bytearray(b"cd"), b"", b"ef"):
        body.append(chunk)
    body.set_complete()
    assert await body == b"abcdef" and await body == b"abcdef"  # awaiting twice, as Quart allows
    body.clear()
    assert await body == b""

    over = JoinedBody(None, 5)
    over.append(b"abc")
    over.append(b"def")
    with pytest.raises(RequestEntityTooLarge):
        await over
    with pytest.raises(RequestEntityTooLarge):  # a declared length over the limit: refused unread
        await JoinedBody(10, 5)

    streamed = JoinedBody(None, None)
    streamed.append(b"12")
    streamed.append(b"34")
    streamed.set_complete()
    assert [part async for part in streamed] == [b"1234"]


async def test_a_large_body_through_the_real_server(encoder) -> None:
    """A ~3 MB /encode body (a 1024 px noisy PNG as a data URI) arrives whole."""
    import base64

    from conftest import png_bytes

    image = png_bytes(1024, 1024)
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    assert len(uri) > 2 * OFFLOAD_BODY_BYTES
    async with encoder() as (_server, http):
        answer = await http.post("/encode", json={"req_id": "big", "modality": "image",
                                                  "mm_items": [uri]}, timeout=60)
        assert answer.status_code == 200, answer.text
        tensor, meta = decode_safetensors(answer.content)
        assert meta["req_id"] == "big" and tensor.shape[0] > 0
