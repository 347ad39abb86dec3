"""Inline delivery: the embedding travels in the face's answer as a safetensors file.

Building a large body copies the whole embedding (several times, inside
safetensors); on the event loop that stalls every other request for as long.
Above ``OFFLOAD_BYTES`` the body is built in a worker thread under the
encoder's thread limiter instead (``tools/bench_loop_stall.py`` measures both).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import trio

from epd_trio.delivery.base import Answer, DeliveryContext
from epd_trio.errors import EPDError
from epd_trio.protocol.codec import encode_safetensors
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

if TYPE_CHECKING:
    import torch

__all__ = ["OFFLOAD_BYTES", "InlineDelivery"]

# Below this a body builds in well under a millisecond: a thread hop would cost more.
OFFLOAD_BYTES: Final = 1 << 20

RunSync = Callable[..., Awaitable[Any]]


class InlineDelivery:
    """The answer carries the embedding; a failure is the face's error answer alone."""

    def __init__(self, *, threads: trio.CapacityLimiter, offload_bytes: int = OFFLOAD_BYTES) -> None:
        self._threads = threads
        self.offload_bytes = offload_bytes
        self.run_sync: RunSync = trio.to_thread.run_sync  # a seam, like the engine's
        self.built_off_loop = 0  # bodies built in a worker thread

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> InlineDelivery:
        return cls(threads=context.threads)

    def admitted(self) -> None:
        """Nothing to announce: the answer is the delivery."""

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return None

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        build = functools.partial(encode_safetensors, embedding, {
            "req_id": meta.req_id, "part_idx": meta.part_idx, "num_parts": meta.num_parts,
            "modality": meta.modality, "token_counts": meta.token_counts,
            "grid_thw": meta.grid_thw, "extras": meta.extras})
        if embedding.nbytes < self.offload_bytes:
            body = build()
        else:
            self.built_off_loop += 1
            body = await self.run_sync(build, limiter=self._threads)
        return Answer(meta, embedding, body=body)

    async def fail(self, error: EPDError) -> None:
        """Nothing to tell: the face's own answer carries the error."""

    async def aclose(self) -> None:
        """Holds nothing."""

    def __repr__(self) -> str:
        return f"<InlineDelivery offload above {self.offload_bytes} bytes>"
