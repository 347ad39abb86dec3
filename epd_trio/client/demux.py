"""The demultiplexer: one PULL socket, each message handed to the part waiting for it.

Every encoder pushes a client's embeddings to the same socket; a message finds
its part by ``(req_id, part_idx)``. A message for no live part (late, repeated
or unknown), or an embedding for a request that has already failed, is dropped
and counted, never queued, and the hand-off is synchronous, so the socket
never backs up behind a slow request. An ``error``
message fails its request at once. The ZMQ receiver (``receiving.zmq``) owns
one and runs its task; no other receiver has a socket to serve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from epd_trio.client.answers import zmq_error
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.protocol.messages import EmbeddingHeader
from epd_trio.protocol.payload import Payload
from epd_trio.transport.zmq import PullReceiver

__all__ = ["DemuxStatistics", "Demultiplexer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemuxStatistics:
    parts_live: int  # parts a message may be for
    messages_received: int
    messages_dropped: int  # for no live part (late, duplicate, unknown), for a failed request,
    # or lost on the way
    malformed_messages: int  # dropped by the PULL receiver


class Demultiplexer:
    """Routes a PULL socket's messages to live parts; ``run(pull)`` is its one task."""

    def __init__(self) -> None:
        self._pull: PullReceiver | None = None  # the socket ``run`` serves
        self._parts: dict[tuple[str, int], tuple[LiveRequest, PartState]] = {}
        self._received = 0
        self._dropped = 0

    def register(self, req: LiveRequest) -> None:
        for state in req.parts:
            self._parts[(req.req_id, state.part.part_idx)] = (req, state)

    def unregister(self, req: LiveRequest) -> None:
        for state in req.parts:
            del self._parts[(req.req_id, state.part.part_idx)]

    async def run(self, pull: PullReceiver) -> None:
        """Hand each of ``pull``'s messages to its part at once; ends when it closes."""
        self._pull = pull
        async for header, payload in pull:
            self._received += 1
            await self.hand_off(header, payload)

    async def hand_off(self, header: EmbeddingHeader, payload: Payload | None) -> None:
        """Give a message to its part, or drop it; never waits (a seam fault plans wrap)."""
        self._deliver(header, payload)

    def drop(self, header: EmbeddingHeader, why: str) -> None:
        """Count a message that reaches no part."""
        self._dropped += 1
        log.debug("dropped a message for %s part %d: %s", header.req_id, header.part_idx, why)

    def _deliver(self, header: EmbeddingHeader, payload: Payload | None) -> None:
        found = self._parts.get((header.req_id, header.part_idx))
        if found is None or found[1].message is not None:
            self.drop(header, "no part waits for it")
            return
        req, state = found
        if header.kind == "error":
            state.answered = True  # the encoder is done with it
            state.message = (header, payload)
            req.fail(zmq_error(header, state.encoder_url))
        elif req.failure is not None:
            # Nobody will read it (the request's tasks are cancelled): holding it would
            # keep its bytes until the request unregisters.
            self.drop(header, f"its request already failed ({type(req.failure).__name__})")
            return
        else:
            state.message = (header, payload)
        state.arrived.set()

    def statistics(self) -> DemuxStatistics:
        malformed = self._pull.statistics().dropped if self._pull is not None else 0
        return DemuxStatistics(len(self._parts), self._received, self._dropped, malformed)

    def __repr__(self) -> str:
        s = self.statistics()
        where = self._pull.last_endpoint if self._pull is not None else "no socket"
        return (f"<Demultiplexer {where}: {s.parts_live} parts live, received"
                f" {s.messages_received}, dropped {s.messages_dropped} (+{s.malformed_messages}"
                f" malformed)>")
