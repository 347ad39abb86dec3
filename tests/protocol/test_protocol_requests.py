"""POST bodies of wire protocol v1: parsed or refused with a message naming the field."""

from __future__ import annotations

import pytest

from epd_trio.errors import RequestError
from epd_trio.protocol.requests import (
    Delivery,
    parse_abort_request,
    parse_encode_request,
    parse_json_body,
    validate_endpoint,
)

BASE = {"req_id": "r", "modality": "Image", "mm_items": ["data:x", {"url": "http://h/a.png", "content_hash": "h"}]}


def test_defaults_and_normalisation() -> None:
    req = parse_encode_request(BASE)
    assert (req.modality, req.num_parts, req.part_idx, req.hashes) == ("image", 1, 0, None)
    assert req.deliver == Delivery() and req.key == ("r", 0)


def test_zmq_fan_out_deduplicates_endpoints() -> None:
    eps = ["tcp://10.0.0.1:5000", "ipc:///tmp/x", "tcp://10.0.0.1:5000"]
    req = parse_encode_request({**BASE, "deliver": {"backend": "zmq", "endpoints": eps}})
    assert req.deliver.endpoints == ("tcp://10.0.0.1:5000", "ipc:///tmp/x")
    one = parse_encode_request({**BASE, "deliver": {"backend": "zmq", "endpoint": "tcp://[::1]:7"}})
    assert one.deliver.endpoints == ("tcp://[::1]:7",)


def test_mooncake_receive_count_and_hashes() -> None:
    req = parse_encode_request({**BASE, "hashes": ["a", "b"], "deliver": {"backend": "mooncake", "receive_count": 4}})
    assert req.deliver.receive_count == 4 and req.hashes == ["a", "b"]


@pytest.mark.parametrize(("change", "message"), [
    ({"req_id": ""}, "'req_id'"),
    ({"req_id": "x" * 257}, "'req_id'"),
    ({"hashes": ["a"]}, "'hashes' must be a list of 2"),
    ({"mm_items": [{"url": "u", "extra": 1}]}, "item 0"),
    ({"mm_items": ["a"] * 5}, "at most 4"),
    ({"deliver": "zmq"}, "'deliver' must be an object"),
    ({"deliver": {"backend": "zmq"}}, "ZMQ endpoint"),
    ({"deliver": {"backend": "zmq", "endpoints": []}}, "1..64 endpoints"),
    ({"deliver": {"backend": "mooncake", "receive_count": 0}}, "receive_count"),
    ({"num_parts": 0}, "part_idx < num_parts"),
    ({"part_idx": -1}, "part_idx < num_parts"),
    # past msgpack's 2^64 an error notice about the part could not even be written
    ({"num_parts": 2**64, "part_idx": 0}, r"num_parts must be in 1..4096, got more"),
    ({"num_parts": 4097, "part_idx": 0}, r"num_parts must be in 1..4096, got 4097"),
])
def test_refusals_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_encode_request({**BASE, **change}, max_items=4)


@pytest.mark.parametrize("endpoint", ["tcp://h:0", "tcp://h", "udp://h:1", "ipc://", "tcp://h:1/x", 5,
                                      "tcp://" + "h" * 600 + ":1",
                                      "tcp://h:\u0661\u0662\u0663"])  # Arabic-Indic digits: not a port
def test_bad_endpoints(endpoint: object) -> None:
    with pytest.raises(RequestError):
        validate_endpoint(endpoint)
    assert validate_endpoint("tcp://0.0.0.0:0", bind=True)


def test_json_body_limits() -> None:
    deep = ("[" * 40 + "1" + "]" * 40).join(['{"a": ', "}"]).encode()
    with pytest.raises(RequestError, match="nested deeper"):
        parse_json_body(deep)
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json_body(b"\xff\xfe")
    with pytest.raises(RequestError, match="JSON object"):
        parse_json_body(b"null")


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400}',
                                 b'{"a": "\\ud800"}', b"\xef\xbb\xbf{}", b"", b"  "])
def test_json_body_is_strict_json(raw: bytes) -> None:
    """What the standard library would take but JSON is not (or what no field could hold)."""
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json_body(raw)


def test_json_body_keeps_big_ints_and_the_last_duplicate() -> None:
    assert parse_json_body(b'{"a": 123456789012345678901234567890, "b": 1, "b": 2}') == \
        {"a": 123456789012345678901234567890, "b": 2}


def test_abort_bodies() -> None:
    assert parse_abort_request({"req_id": "r"}).part_idx is None
    assert parse_abort_request({"req_id": "r", "part_idx": 3}).part_idx == 3
    with pytest.raises(RequestError, match="'part_idx'"):
        parse_abort_request({"req_id": "r", "part_idx": "3"})


@pytest.mark.parametrize("endpoint", ["tcp://[::1]:7", "tcp://[fe80::1]:5000", "tcp://[::]:1", "tcp://[::ffff:10.0.0.1]:9",
                                      "tcp://[2001:DB8:0:0:8:800:200C:417A]:65535", "tcp://10.0.0.1:5000",
                                      "tcp://enc-0.svc.local:5000"])
def test_good_tcp_endpoints(endpoint: str) -> None:
    assert validate_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://[::::]:5", "tcp://[1:2:3:4:5:6:7:8:9]:5", "tcp://[12345::1]:5",
                                      "tcp://[:1]:5", "tcp://[::1::2]:5", "tcp://[1.2.3.4]:5", "tcp://[::1.2.3]:5"])
def test_a_bracketed_host_must_be_an_ipv6_address(endpoint: str) -> None:
    with pytest.raises(RequestError, match="tcp://host:port") as refused:
        validate_endpoint(endpoint)
    assert refused.value.status_code == 400
    with pytest.raises(RequestError, match="ZMQ endpoint must be tcp://host:port"):  # the body's deliver.endpoint
        parse_encode_request({**BASE, "deliver": {"backend": "zmq", "endpoint": endpoint}})
