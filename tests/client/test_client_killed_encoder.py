"""An encoder killed with SIGKILL mid-request: the client fails fast, typed, clean."""

from __future__ import annotations

import signal

import httpx
import pytest
import trio

from conftest import listening_url, png_bytes, spawn
from epd_trio import PeerUnavailable, open_encoder_client


async def test_encoder_killed_mid_request(qwen25_path: str) -> None:
    with spawn("encoder", "--port", "0", "--model-path", qwen25_path) as proc:
        url = await listening_url(proc)
        images = [png_bytes(1000, 1000, seed=i) for i in range(6)]  # keeps the encoder busy a while
        async with open_encoder_client(encoder_urls=[url], timeout=60) as client, \
                httpx.AsyncClient(base_url=url) as http, trio.open_nursery() as nursery:
            async def kill_when_busy() -> None:
                with trio.fail_after(60):  # bounded: a request that never shows must not hang the test
                    while (await http.get("/stats")).json()["live_requests"] == 0:
                        await trio.sleep(0.01)
                proc.send_signal(signal.SIGKILL)

            nursery.start_soon(kill_when_busy)
            t0 = trio.current_time()
            with pytest.raises(PeerUnavailable):
                await client.encode({"image": images})
            assert trio.current_time() - t0 < 30  # fails fast, not at the 60 s deadline
            stats = client.statistics()
        assert (stats.requests_live, stats.parts_live, stats.pool.used_bytes) == (0, 0, 0)
        assert sum(stats.outstanding.values()) == 0
