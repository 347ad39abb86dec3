"""The fetch rules through a real encoder (Hypercorn on port 0): the issue's reproduction."""

from __future__ import annotations

from typing import Any

import pytest


def body(url: str) -> dict[str, Any]:
    return {"req_id": "r1", "modality": "image", "mm_items": [url]}


@pytest.mark.parametrize(("url", "message"), [
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a cloud metadata address (refused always)"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "fd00:ec2::254 is a cloud metadata address (refused always)"),
    ("http://100.100.100.200/latest/meta-data/", "100.100.100.200 is a cloud metadata address (refused always)"),
    ("http://169.254.170.2/v2/credentials", "169.254.170.2 is link-local (refused always)"),
])
async def test_metadata_and_link_local_are_refused_by_default(encoder: Any, url: str, message: str) -> None:
    async with encoder() as (_, http):
        r = await http.post("/encode", json=body(url))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "FetchRefusedError"
        assert error["message"] == f"item 0: {url} is refused: {message}"
        assert (await http.get("/stats")).json()["live_requests"] == 0


async def test_loopback_is_fetched_by_default_and_refused_with_deny_private(encoder: Any) -> None:
    async with encoder() as (server, http):  # the encoder's own /health: fetched, but no image
        r = await http.post("/encode", json=body(server.url + "/health"))
        assert r.status_code == 400 and "bytes are not an image" in r.json()["error"]["message"]
    async with encoder(fetch_deny_private=True) as (server, http):
        r = await http.post("/encode", json=body(server.url + "/health"))
        assert r.status_code == 400 and r.json()["error"]["type"] == "FetchRefusedError"
        assert "127.0.0.1 is loopback (refused by --fetch-deny-private)" in r.json()["error"]["message"]
