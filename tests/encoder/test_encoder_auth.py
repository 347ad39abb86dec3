"""Access control on the encoder: admin endpoints, optionally the data path; no secret leaks."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from conftest import image_uri

TOKEN = "s3cret-token-value"
ENCODE = {"req_id": "a", "modality": "image", "mm_items": [image_uri()]}


async def test_admin_endpoints_need_the_token(encoder: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with encoder(auth_token=TOKEN) as (server, http):
        assert (await http.post("/encode", json=ENCODE)).status_code == 200  # data path open
        for header in (None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", TOKEN):
            headers = {"Authorization": header} if header else {}
            r = await http.post("/abort", json={"req_id": "a"}, headers=headers)
            assert r.status_code == 401, header
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert TOKEN not in r.text
        ok = await http.post("/abort", json={"req_id": "a"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 404  # authorised; nothing live to abort
        assert TOKEN not in repr(server.service.config)
    assert TOKEN not in caplog.text


async def test_require_auth_for_encode(encoder: Any) -> None:
    async with encoder(auth_token=TOKEN, require_auth_for_encode=True) as (_, http):
        assert (await http.post("/encode", json=ENCODE)).status_code == 401
        assert (await http.post("/send", json={})).status_code == 401
        r = await http.post("/encode", json=ENCODE, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        assert (await http.get("/health")).status_code == 200  # probes stay open


def test_config_refuses_bad_token_settings() -> None:
    from epd_trio.config import EncoderConfig

    with pytest.raises(ValueError, match="needs an auth_token"):
        EncoderConfig(require_auth_for_encode=True)
    with pytest.raises(ValueError, match="printable ASCII"):
        EncoderConfig(auth_token="has space")
