"""vLLM's Mooncake EC control plane, sans-IO: what a producer sends, and what it accepts back.

The replies here are the ones vLLM 0.32's consumer sends (``tests/vllm``
exchanges them with its own classes); the malformed ones are what a peer
must never be trusted not to send.
"""

from __future__ import annotations

from typing import Any

import pytest

from epd_trio.config import parse_ec_transfer_config
from epd_trio.errors import PeerUnavailable, ProtocolError, RequestError
from epd_trio.protocol.vllm_ec import (
    MAX_SHARDS,
    PushItem,
    Reservation,
    cancel_request,
    complete_batch_request,
    parse_cancelled,
    parse_completions,
    parse_reservations,
    reserve_batch_request,
    result_of,
    shard_endpoints,
)
from epd_trio.protocol.vllm_requests import ChatItem, ChatRequest, EcParams, EcProducer, transfer_ids

WRITE = {"reservation_id": "r1", "dst_session": "10.0.0.2:16583", "dst_ptr": 1 << 40, "nbytes": 48,
         "write": True, "ready": False, "cached": False}


def test_requests_are_vllms_json() -> None:
    item = PushItem("t1", "h1", (3, 4), "float32", 48)
    assert reserve_batch_request([item]) == {"op": "reserve_batch", "items": [
        {"transfer_id": "t1", "mm_hash": "h1", "nbytes": 48, "shape": [3, 4], "dtype": "float32"}]}
    assert complete_batch_request([("t1", "r1")]) == {
        "op": "complete_batch", "items": [{"transfer_id": "t1", "reservation_id": "r1"}]}
    assert cancel_request("t1", "") == {"op": "cancel", "transfer_id": "t1", "reservation_id": "",
                                        "abandon": True}


def test_a_refusal_is_peer_unavailable_with_the_consumers_reason() -> None:
    assert result_of({"ok": True, "result": {"ports": [1]}}, "peers") == {"ports": [1]}
    with pytest.raises(PeerUnavailable, match="reserve at x: the EC consumer refused: pool is full"):
        result_of({"ok": False, "error": "pool is full"}, "reserve at x")
    with pytest.raises(PeerUnavailable, match="no reason given"):
        result_of({"ok": False, "error": 7}, "reserve")


@pytest.mark.parametrize("reply", [None, [], {"result": 1}, {"ok": "yes"}, "ok"])
def test_a_reply_that_is_no_reply_is_a_protocol_error(reply: Any) -> None:
    with pytest.raises(ProtocolError):
        result_of(reply, "peers")


def test_shards_are_the_consumers_host_at_each_port() -> None:
    assert shard_endpoints("tcp://10.0.0.2:14579", {"ports": [14579, 14580, 14579]}) == (
        "tcp://10.0.0.2:14579", "tcp://10.0.0.2:14580")
    assert shard_endpoints("tcp://[fe80::1]:5", {"ports": [7]}) == ("tcp://[fe80::1]:7",)


@pytest.mark.parametrize("result", [None, {}, {"ports": []}, {"ports": [0]}, {"ports": [65536]},
                                    {"ports": [True]}, {"ports": ["1"]}, {"ports": list(range(1, MAX_SHARDS + 2))}])
def test_shards_that_are_no_ports_are_a_protocol_error(result: Any) -> None:
    with pytest.raises(ProtocolError, match="ports"):
        shard_endpoints("tcp://h:1", result)


def test_reservations_say_where_and_whether_to_write() -> None:
    cancelled = {"reservation_id": "", "dst_session": "", "dst_ptr": 0, "nbytes": 48, "write": False,
                 "ready": False, "cancelled": True}
    follower = {**WRITE, "reservation_id": "r2", "write": False}
    cached = {**WRITE, "reservation_id": "r3", "write": False, "ready": True, "cached": True}
    parsed = parse_reservations({"items": [{"ok": True, "result": r} for r in (WRITE, cancelled, follower, cached)]
                                 + [{"ok": False, "error": "shape and dtype do not match nbytes"}]}, 5)
    assert parsed[0] == Reservation("r1", "10.0.0.2:16583", 1 << 40, 48, True, False, False, False)
    assert [r.writable for r in parsed[:4]] == [True, False, False, False]  # type: ignore[union-attr]
    assert parsed[4] == "shape and dtype do not match nbytes"


@pytest.mark.parametrize(("result", "count"), [
    ({"items": [{"ok": True, "result": WRITE}]}, 2),
    ({"items": "x"}, 1),
    ({"items": [{"result": WRITE}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "dst_ptr": "1"}}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "write": 1}}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "dst_session": ""}}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "dst_session": "host; rm -rf"}}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "dst_ptr": 0}}]}, 1),
    ({"items": [{"ok": True, "result": {**WRITE, "reservation_id": ""}}]}, 1),
])
def test_a_reservation_a_producer_cannot_act_on_is_a_protocol_error(result: Any, count: int) -> None:
    with pytest.raises(ProtocolError):
        parse_reservations(result, count)


def test_completions_and_cancels() -> None:
    assert parse_completions({"items": [{"completed": True, "became_ready": True},
                                        {"completed": False, "became_ready": False}]}, 2) == [True, False]
    assert parse_cancelled({"cancelled": False}) is False
    for bad in ({"items": [{"completed": 1}]}, {"items": []}, None):
        with pytest.raises(ProtocolError):
            parse_completions(bad, 1)
    with pytest.raises(ProtocolError):
        parse_cancelled({"cancelled": "yes"})


def test_transfer_ids_by_position_then_by_mm_hash_then_named_by_request_and_index() -> None:
    """The same rule as vLLM's producer (checked against vLLM's own code in ``tests/vllm``)."""
    chat = ChatRequest("req", None, (), EcParams("tcp://h:1", (("other", "a"), (None, "b"), ("h0", "c"))))
    assert transfer_ids(chat, ["h0", "h1", "h2", "h3"]) == [
        ("c", True), ("b", True), ("req:2", False), ("req:3", False)]


def _producer(connector: str, extra: str) -> EcProducer:
    return EcProducer.of(parse_ec_transfer_config(
        f'{{"ec_connector": "{connector}", "ec_role": "ec_producer", "ec_connector_extra_config": {extra}}}'))


def test_the_connector_says_where_each_items_delivery_goes() -> None:
    """ECExampleConnector: written to the shared storage; ECMooncakeConnector: pushed to the
    consumer the request names, as each item's transfer_id, which the answer reports."""
    items = (ChatItem("image", "a", None, 0), ChatItem("image", "b", None, 1))
    chat = ChatRequest("req", None, items, EcParams("tcp://10.0.0.2:5", ()))
    ids = [("req:0", False), ("t1", True)]

    storage = _producer("ECExampleConnector", '{"shared_storage_path": "/srv/ec"}')
    assert (storage.pushes, storage.described) == (False, "shared storage /srv/ec")
    assert storage.delivery(chat, items[1:], ["req:0", "t1"]).backend == "vllm_storage"
    assert storage.answered_ids(ids) == ()
    storage.check(ChatRequest("req", None, items))  # no consumer needed

    push = _producer("ECMooncakeConnector", '{"mooncake_protocol": "tcp"}')
    assert (push.pushes, push.described) == (True, "ECMooncakeConnector (tcp)")
    delivery = push.delivery(chat, items[1:], ["req:0", "t1"])
    assert (delivery.backend, delivery.endpoints, delivery.transfer_ids) == (
        "vllm_mooncake", ("tcp://10.0.0.2:5",), ("t1",))
    assert push.answered_ids(ids) == tuple(ids)
    with pytest.raises(RequestError, match=r"ec_transfer_params.consumer_zmq") as caught:
        push.check(ChatRequest("req", None, items))
    assert caught.value.req_id == "req"
