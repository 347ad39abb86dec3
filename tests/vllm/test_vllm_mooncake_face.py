"""The vLLM face with ECMooncakeConnector, without vLLM: its configuration, its 400s, a consumer that is gone.

vLLM's own consumer is in ``test_vllm_mooncake.py`` (its classes) and
``test_vllm_mooncake_end_to_end.py`` (a vLLM server).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import httpx
import pytest
import trio

from conftest import data_uri, png_bytes
from vllm_mooncake_kit import producer_config

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.testing import assert_quiescent


def _mooncake(**extra: Any) -> str:
    return json.dumps({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                       "ec_connector_extra_config": extra})


def test_config_takes_vllms_mooncake_json_with_vllms_defaults() -> None:
    default = EncoderConfig(api="vllm", ec_transfer_config=_mooncake())
    ec = default.vllm_ec
    assert ec is not None and (ec.connector, ec.mooncake_protocol, ec.control_timeout) == (
        "ECMooncakeConnector", "rdma", 30.0)
    assert default.uses_mooncake and default.effective_mooncake_protocol == "rdma"
    assert default.vllm_storage_path is None
    tcp = EncoderConfig(api="vllm", ec_transfer_config=_mooncake(mooncake_protocol="tcp", control_timeout_s=2))
    assert (tcp.effective_mooncake_protocol, tcp.vllm_ec.control_timeout) == ("tcp", 2.0)  # type: ignore[union-attr]
    storage = EncoderConfig(api="vllm", ec_transfer_config=json.dumps(
        {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}))
    assert not storage.uses_mooncake and storage.effective_mooncake_protocol == "tcp"  # --mooncake-protocol


@pytest.mark.parametrize(("extra", "message"), [
    ({"mooncake_protocol": "RDMA; x"}, "mooncake_protocol"),
    ({"mooncake_protocol": 1}, "mooncake_protocol"),
    ({"control_timeout_s": 0}, "control_timeout_s"),
    ({"control_timeout_s": "30"}, "control_timeout_s"),
    ({"control_timeout_s": True}, "control_timeout_s"),
    ({"control_timeout_s": float("inf")}, "control_timeout_s"),
    ({"cross_encoder_cache": True}, "cross_encoder_cache"),
])
def test_config_refuses_what_it_cannot_serve(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EncoderConfig(api="vllm", ec_transfer_config=_mooncake(**extra))
    with pytest.raises(ValueError, match="must be a JSON object"):
        EncoderConfig(api="vllm", ec_transfer_config=json.dumps(
            {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer", "ec_connector_extra_config": [1]}))


async def _serve(model: str, **overrides: Any) -> Any:
    settings: dict[str, Any] = {"ec_transfer_config": producer_config(), **overrides}
    return serve_encoder(EncoderConfig(port=0, api="vllm", engine=EngineConfig(model_path=model), **settings))


def _body(**ec: Any) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": data_uri(png_bytes(56, 42, 1))}}
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    if ec:
        body["ec_transfer_params"] = ec["params"]
    return body


def _nobody() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(("body", "message"), [
    (_body(), "needs ec_transfer_params.consumer_zmq"),
    (_body(params={"ec_items": [{"transfer_id": "t"}]}), "needs ec_transfer_params.consumer_zmq"),
    (_body(params="tcp://h:1"), "'ec_transfer_params' must be an object"),
    (_body(params={"consumer_zmq": "ipc:///tmp/c"}), "must be the consumer's tcp://host:port"),
    (_body(params={"consumer_zmq": "tcp://h:0"}), "bad port"),
    (_body(params={"consumer_zmq": "tcp://h:1", "ec_items": {"transfer_id": "t"}}), "must be a list"),
    (_body(params={"consumer_zmq": "tcp://h:1", "ec_items": [{"mm_hash": "h"}]}), "needs a transfer_id"),
    (_body(params={"consumer_zmq": "tcp://h:1", "ec_items": [{"transfer_id": 7}]}), "needs a transfer_id"),
    (_body(params={"consumer_zmq": "tcp://h:1", "ec_items": [{"transfer_id": "t", "mm_hash": 1}]}),
     "string mm_hash"),
])
async def test_a_request_that_names_no_usable_consumer_is_a_400_and_nothing_is_encoded(
        qwen25_path: str, body: dict[str, Any], message: str) -> None:
    async with await _serve(qwen25_path) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        with trio.fail_after(30):
            response = await http.post("/v1/chat/completions", json=body)
        stats = server.service.statistics()
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert stats["engine"]["requests_done"] == 0 and stats["vllm_ec"]["pushes"] == 0


async def test_a_consumer_that_is_gone_is_a_504_within_its_control_timeout(qwen25_path: str) -> None:
    gone = _nobody()
    async with await _serve(qwen25_path, ec_transfer_config=producer_config(control_timeout=0.5)) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        with trio.fail_after(30):  # never a hang
            response = await http.post("/v1/chat/completions", json=_body(params={
                "consumer_zmq": gone, "ec_items": [{"transfer_id": "t-gone"}]}))
        control = server.service.deliveries.vllm_control.statistics()
        assert server.service.deliveries.mooncake.session.startswith("127.0.0.1:")
        assert_quiescent({"service": server.service})
    assert response.status_code == 504, response.text
    assert f"peers: no reply from the EC consumer at {gone} within 0.5 s" in response.json()["error"]["message"]
    assert (control.pushes, control.failed_pushes, control.outstanding, control.consumers) == (1, 1, 0, 0)
    assert (control.sockets.timeouts, control.sockets.busy_sockets) == (1, 0)
