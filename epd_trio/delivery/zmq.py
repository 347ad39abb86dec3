"""Native ZMQ delivery: a msgpack header and the tensor's frames, fanned out to endpoints.

Each endpoint (e.g. every tensor-parallel rank of a language server) gets the
whole message, sent as a child task; the first failure fails the request. A
failed request sends an ``error`` message the same way, so receivers fail
fast instead of waiting for their timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd_trio.delivery.base import Answer, DeliveryContext, fan_out, push
from epd_trio.errors import EPDError
from epd_trio.protocol.codec import encode_zmq_message, error_message, header_for
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.transport.zmq import PushSocketCache

if TYPE_CHECKING:
    import torch

__all__ = ["ZmqDelivery"]


class ZmqDelivery:
    """Push the embedding (or an error notice) to every endpoint of the request."""

    def __init__(self, request: EncodeRequest, sockets: PushSocketCache, send_timeout: float) -> None:
        self._request = request
        self._sockets = sockets
        self._timeout = send_timeout
        self.endpoints: tuple[str, ...] = request.deliver.endpoints

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> ZmqDelivery:
        return cls(request, context.zmq, context.send_timeout)

    def admitted(self) -> None:
        """Nothing to announce: the endpoints came with the request."""

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return None  # the JSON answer waits until the bytes are handed to ZMQ

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        header = header_for(embedding, req_id=meta.req_id, part_idx=meta.part_idx,
                            num_parts=meta.num_parts, modality=meta.modality,
                            token_counts=meta.token_counts, grid_thw=meta.grid_thw,
                            extras=meta.extras)
        await self._send_all(encode_zmq_message(header, embedding))
        return Answer(meta, embedding)

    async def fail(self, error: EPDError) -> None:
        r = self._request
        await self._send_all(error_message(r.req_id, r.part_idx, r.num_parts, r.modality, error))

    async def aclose(self) -> None:
        """The sockets belong to the encoder's cache, not to one request."""

    async def _send_all(self, frames: Sequence[Any]) -> None:
        if len(self.endpoints) == 1:  # the common case: no nursery, no task per message
            await push(self._sockets, self.endpoints[0], frames, self._timeout)
            return
        async with fan_out() as nursery:
            for endpoint in self.endpoints:
                nursery.start_soon(push, self._sockets, endpoint, frames, self._timeout)

    def __repr__(self) -> str:
        return f"<ZmqDelivery {self._request.req_id!r} to {len(self.endpoints)} endpoint(s)>"
