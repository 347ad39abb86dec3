"""The stages of the endings chaos: one encoder in this process and its receiver side.

``mooncake``       our client with ``transfer_backend="mooncake"`` (a real
                   TransferEngine over TCP on both sides);
``sglang-*``       the SGLang face with one of its backends (``zmq_to_scheduler``,
                   ``zmq_to_tokenizer``, ``mooncake``); for ``mooncake`` our own
                   Mooncake peer plays the language server (SGLang's receiver lands
                   bytes in CUDA memory), with a registered landing buffer;
``process``        our client (ZMQ) against an encoder preprocessing in two child
                   processes (``--preprocess-mode process``).

Each encoder's send timeout is 1 s; the references are its own engine's output.
Shared by ``tests/chaos/test_chaos_endings.py`` and ``tools/chaos_soak.py --endings``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from epd_trio.client import open_encoder_client
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.testing import FaultPlan, install_faults
from real_world import Media, References

__all__ = ["ABORT_HOLD", "SEND_TIMEOUT", "STAGES", "Stage", "stage_for"]

STAGES = ("mooncake", "sglang-zmq_to_scheduler", "sglang-zmq_to_tokenizer", "sglang-mooncake",
          "process")
SEND_TIMEOUT = 1.0
ABORT_HOLD = 1.0  # the client holds an unconfirmed slot this long
POOL_BYTES = 16 << 20


@dataclass
class Stage:
    """One encoder in this process and its receiver side (see the module docstring)."""

    name: str
    server: Any  # EncoderServer
    http: httpx.AsyncClient
    media: Media
    refs: References
    client: Any = None  # EncoderClient: mooncake and process
    client_idle: dict[str, int] = field(default_factory=dict)
    peer: Any = None  # MooncakeTransport: sglang-mooncake
    buffer: torch.Tensor | None = None  # the peer's registered landing memory

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def backend(self) -> str:
        return self.name.removeprefix("sglang-")

    def install(self, plan: FaultPlan | None) -> None:
        service = self.server.service
        owners = [service.engine, *service.engine.schedulers, service]
        if service.deliveries.mooncake is not None:
            owners.append(service.deliveries.mooncake)
        install_faults(plan, *owners)



@asynccontextmanager
async def stage_for(name: str, model_path: str, media: Media) -> AsyncIterator[Stage]:
    """One stage: its encoder, its receiver side, the references from its own engine."""
    engine = EngineConfig(model_path=model_path,
                          **({"preprocess_mode": "process", "preprocess_workers": 2}
                             if name == "process" else {}))
    config = EncoderConfig(port=0, send_timeout=SEND_TIMEOUT, engine=engine)
    if name == "mooncake":
        config = dataclasses.replace(config, transfer_backend="mooncake")
    elif name.startswith("sglang-"):
        config = dataclasses.replace(config, api="sglang",
                                     encoder_transfer_backend=name.removeprefix("sglang-"))
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(serve_encoder(config))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
        refs = References(media)
        await refs.from_engine(server.service.engine)
        stage = Stage(name, server, http, media, refs)
        if name in ("mooncake", "process"):
            backend = "mooncake" if name == "mooncake" else "zmq"
            stage.client = await stack.enter_async_context(open_encoder_client(
                encoder_urls=[server.url], transfer_backend=backend, pool_bytes=POOL_BYTES,
                abort_timeout=0.5, abort_hold=ABORT_HOLD))
            if backend == "mooncake":
                stage.client_idle = {"client.mooncake.registered_regions": 1,
                                     "client.mooncake.registered_bytes": stage.client.pool.capacity}
        if name == "sglang-mooncake":
            from epd_trio.transport.mooncake import open_mooncake

            stage.peer = await stack.enter_async_context(open_mooncake("127.0.0.1"))
            stage.buffer = torch.zeros(4 << 20, dtype=torch.uint8)
            await stack.enter_async_context(stage.peer.registered(stage.buffer.data_ptr(),
                                                                  stage.buffer.numel()))
        yield stage
