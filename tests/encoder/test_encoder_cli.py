"""`epd-trio encoder` as an operator runs it: flags, env, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal

import httpx
import trio

from conftest import image_uri, listening_url, spawn


async def test_encoder_serves_and_exits_cleanly_on_sigterm(qwen25_path: str, monkeypatch) -> None:
    monkeypatch.setitem(os.environ, "EPD_MAX_BATCH_SIZE", "3")
    with spawn("encoder", "--port", "0", "--model-path", qwen25_path) as proc:
        url = await listening_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            info = (await http.get("/model_info")).json()
            r = await http.post("/encode", json={"req_id": "a", "modality": "image", "mm_items": [image_uri()]})
        assert info["max_batch_size"] == 3  # from EPD_MAX_BATCH_SIZE
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: proc.wait(timeout=60))
        assert code == 0, proc.stderr.read()  # type: ignore[union-attr]
