"""ZMQ: every encoder pushes its parts to the client's one PULL socket.

The receiver owns the socket, the ``Demultiplexer`` task that hands each
message to the part waiting for it, and the endpoints each encoder is told
(``addresses.PullEndpoints``: bound on first need, on the route to that
encoder). A part's ``/encode`` answer announces its message; the part is done
when the message has come and matches the answer; while it is late, the
encoder is asked whether it is alive (``liveness.wait_heard_from``), so a host
lost after its answer fails the part within ``PEER_LOST_AFTER``, not at the
deadline. An ``error`` message fails the request at once (the demultiplexer
does). Payloads are copied into one slot (``CopyingReceiver``).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import trio

from epd_trio.client.addresses import PullEndpoints
from epd_trio.client.answers import Answer, check_message, parse_meta
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.demux import Demultiplexer
from epd_trio.client.liveness import wait_heard_from
from epd_trio.client.pool import EmbeddingPool
from epd_trio.client.receiving.base import CopyingReceiver, ReceiverStatistics, Settle
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.config import ClientConfig
from epd_trio.transport.zmq import PullReceiver

__all__ = ["ZmqReceiver"]


class ZmqReceiver(CopyingReceiver):
    """Parts pushed to one PULL socket, routed by ``(req_id, part_idx)``."""

    def __init__(self, config: ClientConfig, pool: EmbeddingPool, settle: Settle) -> None:
        super().__init__(config, pool, settle)
        self.demux = Demultiplexer()
        self.addresses: PullEndpoints | None = None  # set once open

    async def _open(self, stack: AsyncExitStack) -> None:
        pull = await stack.enter_async_context(PullReceiver(None))
        self.addresses = PullEndpoints(self.config, self.routes, pull)  # binds zmq_bind, if set
        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(self.demux.run, pull)
        stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery exits

    def register(self, req: LiveRequest) -> None:
        self.demux.register(req)

    def unregister(self, req: LiveRequest) -> None:
        self.demux.unregister(req)

    @property
    def endpoint(self) -> str:
        return self.addresses.endpoint if self.addresses is not None else ""

    async def deliver_for(self, encoder_url: str) -> dict[str, Any]:
        assert self.addresses is not None, "the receiver is not open"
        return {"backend": "zmq", "endpoint": await self.addresses.endpoint_for(encoder_url)}

    async def take(self, req: LiveRequest, state: PartState, answer: Answer,
                   calls: EncoderCalls) -> None:
        part = state.part
        meta = parse_meta(answer, req.req_id, part.part_idx, len(req.parts))
        url = state.encoder_url
        # Bounded by the request's deadline, and by the encoder's silence while the message is late.
        await wait_heard_from(state.arrived, lambda: calls.probe(url),
                              f"request {req.req_id} part {part.part_idx}: the ZMQ message {url} announced")
        state.finished = trio.current_time()
        assert state.message is not None
        header = state.message[0]
        if header.kind == "embedding":  # an error one has already failed the request
            check_message(header, meta, part.modality, len(part.item_indices), state.encoder_url)

    def statistics(self) -> ReceiverStatistics:
        s = self.demux.statistics()
        return ReceiverStatistics(parts_live=s.parts_live, messages_received=s.messages_received,
                                  messages_dropped=s.messages_dropped,
                                  malformed_messages=s.malformed_messages)

    def __repr__(self) -> str:
        return f"<ZmqReceiver {self.addresses!r} {self.demux!r}>"
