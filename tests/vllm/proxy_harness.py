"""The EPD proxy's side of the vLLM tests: an encoder, the proxy, requests and their tokens.

Shared by the modules that put ``epd-trio proxy`` in front of a real vLLM
server (``test_vllm_proxy*.py``); the server itself is ``vllm_harness``'s.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from conftest import data_uri, png_bytes, running
from epd_trio import EncoderServer, ProxyConfig, ProxyServer, serve_proxy
from vllm_harness import VllmServer

TOKENS = 8


def producer_config(storage: Path) -> str:
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                       "ec_connector_extra_config": {"shared_storage_path": str(storage)}})


@asynccontextmanager
async def proxy_over(encoders: list[str], vllm: VllmServer) -> AsyncIterator[tuple[ProxyServer, httpx.AsyncClient]]:
    config = ProxyConfig(port=0, encoder_urls=tuple(encoders), prefill_decode_urls=(vllm.url,))
    async with serve_proxy(config) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        yield server, http


@asynccontextmanager
async def encoder(model: str, storage: Path) -> AsyncIterator[EncoderServer]:
    async with running(model, api="vllm", ec_transfer_config=producer_config(storage),
                       dtype="float32") as (server, _):
        yield server


def encoded(server: EncoderServer) -> int:
    return int(server.service.statistics()["requests_done"])


def request(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            **extra}


def tokens(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == TOKENS
    return ids


async def vllm_alone(vllm: VllmServer, parts: list[dict[str, Any]], name: str) -> list[int]:
    """vLLM's own encoder: every part renamed to a uuid no file answers to."""
    named = [{**part, "uuid": f"{name}-{k}"} for k, part in enumerate(parts)]
    return tokens(await trio.to_thread.run_sync(vllm.chat, request(*named)))


def image(seed: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(png_bytes(90, 60, seed=seed))}}


async def through(http: httpx.AsyncClient, vllm: VllmServer, parts: list[dict[str, Any]],
                  **extra: Any) -> httpx.Response:
    return await http.post("/v1/chat/completions", json={"model": vllm.model, **request(*parts, **extra)})
