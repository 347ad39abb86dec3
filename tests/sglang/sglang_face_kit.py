"""What the SGLang-face tests share: a raw PULL socket, SGLang's bodies, SGLang's decoding.

A language-server rank's PULL socket is a real ZMQ socket on loopback whose
frames are kept as bytes; they are decoded by SGLang's own receiver code in
the driver process (``sglang_driver.py decode``), never unpickled here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
import trio
import zmq
from safetensors.torch import load_file

from epd_trio.transport._zmq_socket import TrioSocket
from sglang_harness import Decoder

Message = list[bytes]


class Rank:
    """One language-server rank's PULL socket; ``url`` is SGLang's ``host:port`` for it."""

    def __init__(self, sock: TrioSocket, port: int) -> None:
        self.sock = sock
        self.port = port
        self.url = f"127.0.0.1:{port}"

    async def receive(self, timeout: float = 60.0) -> Message:
        with trio.fail_after(timeout):
            frames = await self.sock.receive_multipart()
        return [bytes(f.buffer) for f in frames]


@asynccontextmanager
async def rank() -> AsyncIterator[Rank]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    wrapped = TrioSocket(sock)
    try:
        yield Rank(wrapped, port)
    finally:
        wrapped.close()
        ctx.term()
        await trio.lowlevel.checkpoint()


def encode_body(rid: str, part_idx: int, num_parts: int, items: list[Any], modality: str = "IMAGE",
                **extra: Any) -> dict[str, Any]:
    """The body an SGLang 0.5.23 tokenizer posts, bookkeeping fields included."""
    return {"encoder_idx": 0, "encoder_url": "http://unused", "mm_items": items,
            "num_parts": num_parts, "part_idx": part_idx, "req_id": f"{rid}_local_part_{part_idx}",
            "modality": modality, "prefill_host": "127.0.0.1", "embedding_port": None,
            "time_stats_json": None, **extra}


def decode_with_sglang(decoder: Decoder, root: Path, cases: dict[str, dict[str, Any]]
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``cases``: name → ``{"rid", "model_type", "messages": [Message, ...]}``; what SGLang saw."""
    manifest: dict[str, Any] = {}
    for name, case in cases.items():
        messages = []
        for i, message in enumerate(case["messages"]):
            files = []
            for k, frame in enumerate(message):
                path = root / f"{name}.{i}.{k}"
                path.write_bytes(frame)
                files.append(str(path))
            messages.append(files)
        manifest[name] = {"rid": case["rid"], "model_type": case.get("model_type"), "messages": messages}
    (root / "manifest.json").write_text(json.dumps(manifest))
    decoder.decode(root)
    return json.loads((root / "result.json").read_text()), load_file(root / "result.safetensors")


async def stats(http: Any) -> dict[str, Any]:
    return (await http.get("/stats")).json()


async def until(http: Any, predicate: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Poll ``/stats`` until ``predicate(stats)``: how a test orders its calls around the server's state."""
    with trio.fail_after(timeout):
        while not predicate(s := await stats(http)):
            await trio.sleep(0.01)
    return s
