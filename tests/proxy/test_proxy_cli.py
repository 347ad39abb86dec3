"""``epd-trio proxy`` as an operator runs it."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import trio

from conftest import listening_url, spawn
from proxy_fakes import FakeLanguageServer, serving


async def test_the_proxy_command_serves_until_sigterm() -> None:
    language = FakeLanguageServer()
    async with serving(language) as lm:
        with spawn("proxy", "--port", "0", "--encoder-urls", "http://127.0.0.1:9,http://127.0.0.1:10",
                   "--prefill-decode-urls", lm) as proc:
            url = await listening_url(proc)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                health = (await http.get("/health")).json()
                answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            proc.send_signal(signal.SIGTERM)
            code = await trio.to_thread.run_sync(proc.wait, 60)
    assert health["encoders"] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert health["prefill_decode"][0]["url"] == lm and answer.status_code == 200
    assert code == 0 and language.seen[0].path == "/v1/completions"


def test_a_proxy_without_language_servers_is_refused_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "epd_trio.cli", "proxy", "--encoder-urls",
                           "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "epd-trio: error: prefill_decode_urls (--prefill-decode-urls) needs at least one language "
        "server URL"]
