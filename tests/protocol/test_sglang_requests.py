"""SGLang's encoder bodies, parsed sans-IO: SGLang's own messages first, then ours."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from epd_trio.errors import RequestError
from epd_trio.protocol.sglang_requests import (
    check_send,
    parse_host_port,
    parse_receive_url,
    parse_sglang_encode,
    parse_sglang_send,
    sglang_validation_error,
)

PNG64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(40)).decode()


def body(**over: Any) -> dict[str, Any]:
    return {"req_id": "r_local_part_1", "modality": "IMAGE", "mm_items": ["http://h/x.png"],
            "num_parts": 2, "part_idx": 1, "prefill_host": "10.0.0.1", "embedding_port": None,
            "time_stats_json": "{}", "encoder_idx": 3, "encoder_url": "http://e", **over}


@pytest.mark.parametrize(("over", "message"), [
    ({"req_id": ""}, "missing or invalid req_id"),
    ({"modality": 3}, "missing or invalid modality"),
    ({"modality": "TEXT"}, "unsupported modality: TEXT"),
    ({"modality": "\u0131mage"}, "unsupported modality: \u0131mage"),  # dotless i: upper() is IMAGE
    ({"mm_items": []}, "missing or empty mm_items"),
    ({"num_parts": True}, "num_parts must be a positive integer"),
    ({"part_idx": 2}, "part_idx must be in [0, 2)"),
    ({"hashes": {"a": 1}}, "hashes must be list/scalar, got dict"),
])
def test_sglangs_own_checks_and_messages(over: dict[str, Any], message: str) -> None:
    assert sglang_validation_error(body(**over)) == message
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_sglang_encode(body(**over), backend="zmq_to_scheduler", max_items=8)


def test_items_become_what_the_engine_reads() -> None:
    items = ["data:image/png;base64,AAAA", "https://h/a.png", "file:///srv/m/a%20b.png", PNG64,
             "relative/a.png", {"url": PNG64, "content_hash": "sha256:" + "AB" * 32, "detail": "auto"}]
    req = parse_sglang_encode(body(mm_items=items, modality="image"), backend="zmq_to_scheduler",
                              max_items=8)
    assert req.modality == "image" and (req.req_id, req.part_idx, req.num_parts) == ("r_local_part_1", 1, 2)
    assert req.mm_items == [
        "data:image/png;base64,AAAA", "https://h/a.png", "/srv/m/a b.png",
        f"data:application/octet-stream;base64,{PNG64}", "relative/a.png",
        {"url": f"data:application/octet-stream;base64,{PNG64}", "content_hash": "sha256:" + "ab" * 32}]
    assert req.deliver.backend == "sglang_zmq" and req.deliver.endpoints == ()  # registered later


def _rule_before_pybase64(item: str) -> str:
    """The item rule as it was written with the standard library (regex, then decode)."""
    compact = "".join(item.split())
    if len(compact) >= 32 and len(compact) % 4 == 0 and re.fullmatch(r"[A-Za-z0-9+/]+={0,2}", compact):
        try:
            base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            return item
        return f"data:application/octet-stream;base64,{compact}"
    return item


_TEXT = st.text(alphabet="QUJDRAgw+/=-_. \n\té", max_size=48)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_TEXT, st.binary(min_size=20, max_size=40).map(lambda b: base64.b64encode(b).decode()),
                 st.binary(min_size=24, max_size=40).map(
                     lambda b: base64.encodebytes(b).decode().replace("\n", " \n", 1))))
def test_bare_strings_are_told_apart_as_before(item: str) -> None:
    """Base64 (whitespace dropped) becomes a data: URI, anything else stays a path."""
    req = parse_sglang_encode(body(mm_items=[item or "x"], modality="image"),
                              backend="zmq_to_scheduler", max_items=1)
    assert req.mm_items == [_rule_before_pybase64(item or "x")]


def test_a_single_item_and_a_bad_hash() -> None:
    req = parse_sglang_encode(body(mm_items="https://h/a.png"), backend="mooncake", max_items=1)
    assert req.mm_items == ["https://h/a.png"] and req.deliver.backend == "sglang_mooncake"
    with pytest.raises(RequestError, match="sha256:<64 hex digits>"):
        parse_sglang_encode(body(mm_items=[{"url": "x", "content_hash": "md5:00"}]),
                            backend="mooncake", max_items=1)
    with pytest.raises(RequestError, match="at most 1"):
        parse_sglang_encode(body(mm_items=["a", "b"]), backend="mooncake", max_items=1)


@pytest.mark.parametrize(("host", "port", "endpoints"), [
    ("10.0.0.1", 5000, ("10.0.0.1:5000",)),
    ("::1", [5000, 5001, 5000], ("[::1]:5000", "[::1]:5001")),
    ("[fe80::1]", 7, ("[fe80::1]:7",)),
])
def test_destinations_in_the_encode(host: str, port: Any, endpoints: tuple[str, ...]) -> None:
    req = parse_sglang_encode(body(prefill_host=host, embedding_port=port),
                              backend="zmq_to_tokenizer", max_items=8)
    assert req.deliver.endpoints == endpoints and req.deliver.receive_count == len(endpoints)


def test_zmq_to_tokenizer_needs_a_port() -> None:
    with pytest.raises(RequestError, match="embedding_port"):
        parse_sglang_encode(body(), backend="zmq_to_tokenizer", max_items=8)


def test_receive_url_and_send_bodies() -> None:
    reg = parse_receive_url({"req_id": "r", "receive_count": 2, "receive_url": "[::1]:9", "modality": "IMAGE"})
    assert (reg.receive_count, reg.receive_url) == (2, "[::1]:9")
    for bad in ({"receive_count": 0}, {"receive_url": "nohost"}, {"receive_url": "h:70000"}):
        with pytest.raises(RequestError):
            parse_receive_url({"req_id": "r", "receive_count": 1, "receive_url": "h:1", **bad})
    send = parse_sglang_send({"req_id": "r", "part_idx": 0, "embedding_size": 64, "embedding_len": 4,
                              "embedding_dim": 4, "prefill_host": "::1", "embedding_port": 5,
                              "session_id": "10.0.0.2:12001", "buffer_address": 4096, "receive_count": 2})
    assert (send.session, send.buffer_address, send.length, send.completion, send.receive_count) == (
        "10.0.0.2:12001", 4096, 64, "[::1]:5", 2)


@pytest.mark.parametrize("backend", ["zmq_to_scheduler", "zmq_to_tokenizer"])
def test_send_is_the_mooncake_backends(backend: str) -> None:
    check_send("mooncake", "r")
    with pytest.raises(RequestError, match=f"this encoder serves {backend}, whose Encode delivers") as caught:
        check_send(backend, "r")
    assert caught.value.req_id == "r"


@pytest.mark.parametrize("item", ["file://[x/etc/passwd", {"url": "file://a]b/x"}])
def test_a_file_url_that_is_no_url_is_a_400(item: Any) -> None:
    with pytest.raises(RequestError, match="a file:// item is not a valid URL"):
        parse_sglang_encode(body(mm_items=[item]), backend="zmq_to_scheduler", max_items=8)


def test_ports_are_ascii_digits() -> None:
    with pytest.raises(RequestError):
        parse_receive_url({"req_id": "r", "receive_count": 1, "receive_url": "h:\u0668\u0660",
                           "modality": "IMAGE"})


@pytest.mark.parametrize("host", ["::::", "[::::]", "1:2:3:4:5:6:7:8:9", "[::1::2]", "12345::1", "::1.2.3"])
def test_a_host_with_colons_must_be_an_ipv6_address(host: str) -> None:
    with pytest.raises(RequestError, match="'prefill_host' must be 'host:port'") as refused:
        parse_sglang_encode(body(prefill_host=host, embedding_port=5), backend="zmq_to_tokenizer", max_items=8)
    assert refused.value.status_code == 400
    with pytest.raises(RequestError, match="'prefill_host' must be 'host:port'"):
        parse_sglang_send({"req_id": "r", "part_idx": 0, "embedding_size": 64, "prefill_host": host,
                           "embedding_port": 5, "session_id": "10.0.0.2:12001", "buffer_address": 4096})
    with pytest.raises(RequestError, match="'receive_url' must be 'host:port'"):
        parse_receive_url({"req_id": "r", "receive_count": 1, "receive_url": f"[{host.strip('[]')}]:5",
                           "modality": "IMAGE"})
    with pytest.raises(RequestError, match="'session_id' must be 'host:port'"):
        parse_host_port(f"{host.strip('[]')}:5", "session_id")  # unbracketed, as Mooncake's session ids


@pytest.mark.parametrize("value", ["[::1]:9", "::1:9", "fe80::1:8998", "[::ffff:10.0.0.1]:5", "::ffff:10.0.0.1:5",
                                   "10.0.0.2:12001", "enc-0.svc.local:1", "[2001:db8::]:65535"])
def test_good_host_ports(value: str) -> None:
    assert parse_host_port(value, "session_id") == value
