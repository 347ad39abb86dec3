"""`epd-trio encoder` as an operator runs it: flags, env, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import platform
import signal

import httpx
import trio

from conftest import image_uri, listening_url, spawn


async def test_encoder_serves_and_exits_cleanly_on_sigterm(qwen25_path: str, monkeypatch) -> None:
    monkeypatch.setitem(os.environ, "EPD_MAX_BATCH_SIZE", "3")
    with spawn("encoder", "--port", "0", "--model-path", qwen25_path, "--log-level", "INFO") as proc:
        url = await listening_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            info = (await http.get("/model_info")).json()
            r = await http.post("/encode", json={"req_id": "a", "modality": "image", "mm_items": [image_uri()]})
        assert info["max_batch_size"] == 3  # from EPD_MAX_BATCH_SIZE
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: proc.wait(timeout=60))
        log = proc.stderr.read()  # type: ignore[union-attr]
        assert code == 0, log
        # on this CPU device, once serving, glibc's malloc keeps freed memory (engine.heap)
        if platform.libc_ver()[0] == "glibc":
            assert "malloc keeps freed memory for the next batch" in log
