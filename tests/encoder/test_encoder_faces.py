"""The faces stay thin: each parses on threads of its own and refuses through the service's one
path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from epd_trio._http import OFFLOAD_BODY_BYTES
from epd_trio.encoder.server import FACES


def _vllm_face(tmp_path: Path) -> dict[str, Any]:
    return {"api": "vllm", "ec_transfer_config": json.dumps({
        "ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})}


# Each HTTP face's request route, and the settings that serve it.
FACE_ROUTES = {
    "native": ("/encode", lambda tmp_path: {}),
    "sglang": ("/encode", lambda tmp_path: {"api": "sglang"}),
    "vllm": ("/v1/chat/completions", _vllm_face),
}


def unknown_refusals(metrics: str) -> float:
    prefix = 'epd_encoder_requests_total{modality="unknown",outcome="RequestError"} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("api", sorted(FACE_ROUTES))
async def test_a_large_body_is_parsed_while_every_delivery_thread_is_busy(
        api: str, encoder: Any, tmp_path: Path) -> None:
    """A face parses a large JSON body on threads of its own: with the deliveries' threads all
    held (inline answers being built, files being written), it is still answered, refused
    once and counted once."""
    path, settings = FACE_ROUTES[api]
    assert set(FACES) == set(FACE_ROUTES)
    large = json.dumps({"pad": "x" * (2 * OFFLOAD_BODY_BYTES)})  # parsed off the loop; no request
    async with encoder(**settings(tmp_path)) as (server, http):
        threads = server.service.deliveries.threads
        holders = [object() for _ in range(int(threads.total_tokens))]
        for holder in holders:
            threads.acquire_on_behalf_of_nowait(holder)
        try:
            with trio.fail_after(20):
                response = await http.post(path, content=large,
                                           headers={"content-type": "application/json"})
        finally:
            for holder in holders:
                threads.release_on_behalf_of(holder)
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 400, response.text
    assert unknown_refusals(metrics) == 1
