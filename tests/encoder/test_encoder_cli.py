"""`epd-trio encoder` as an operator runs it: flags, env, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import trio

from conftest import image_uri


async def test_encoder_serves_and_exits_cleanly_on_sigterm(qwen25_path: str) -> None:
    env = {**os.environ, "EPD_MAX_BATCH_SIZE": "3", "EPD_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd_trio.cli", "encoder", "--port", "0", "--model-path", qwen25_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
        assert "listening on http://" in line, line + proc.stderr.read()  # type: ignore[union-attr]
        url = line.rsplit(" ", 1)[1].strip()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            info = (await http.get("/model_info")).json()
            r = await http.post("/encode", json={"req_id": "a", "modality": "image", "mm_items": [image_uri()]})
        assert info["max_batch_size"] == 3  # from EPD_MAX_BATCH_SIZE
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: proc.wait(timeout=60))
        assert code == 0, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
