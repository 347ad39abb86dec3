"""The client's bookkeeping: a live request, its parts, and the statistics they add up to.

Plain data owned by ``EncoderClient``; kept apart so the client module holds
only the behaviour.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio

from epd_trio.client.pool import PoolStatistics, Slot
from epd_trio.client.result import PartReport, ReceivedPart
from epd_trio.client.routing import Part
from epd_trio.errors import EPDError
from epd_trio.protocol.messages import EmbeddingHeader
from epd_trio.protocol.payload import Payload
from epd_trio.transport.mooncake import MooncakeStatistics

__all__ = ["ClientStatistics", "LiveRequest", "PartState"]


@dataclass(frozen=True)
class ClientStatistics:
    encoders: tuple[str, ...]
    outstanding: Mapping[str, int]  # parts in flight per encoder
    requests_live: int
    parts_live: int  # parts of the live requests
    requests_done: int
    requests_failed: int
    retries: int  # parts moved to another encoder after a connect error or a draining refusal
    messages_received: int
    messages_dropped: int  # for no live part (late, duplicate or unknown) or a failed request
    malformed_messages: int  # dropped by the PULL receiver (transfer_backend="zmq")
    aborts_sent: int
    aborts_failed: int
    refresh_failures: int  # registry queries and resolutions that failed (the last list was kept)
    pool: PoolStatistics
    mooncake: MooncakeStatistics | None  # the transfer engine, with transfer_backend="mooncake"
    slots_held_after_abort: int = 0  # Mooncake slots held abort_hold s: an /abort went unconfirmed


@dataclass(eq=False)
class PartState:
    part: Part
    encoder_url: str  # where it is (or was last) posted; differs from the plan after a retry
    arrived: trio.Event = dataclasses.field(default_factory=trio.Event)
    message: tuple[EmbeddingHeader, Payload | None] | None = None
    described: ReceivedPart | None = None  # Mooncake: its checked shape, from the /encode answer
    posted: bool = False  # an /encode may have reached encoder_url
    answered: bool = False  # the encoder is done with it: an error, a ZMQ /encode answer or
    # a Mooncake /send answer (a Mooncake /encode answer leaves it staged, waiting for /send)
    settled: bool = False  # no longer counted as outstanding
    started: float = 0.0  # trio.current_time() of the first post
    finished: float = 0.0  # when its embedding arrived


@dataclass(eq=False)
class LiveRequest:
    req_id: str
    wire: dict[str, list[Any]]  # per modality: data URIs (/encode) or content parts (vLLM)
    parts: list[PartState]
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    failure: EPDError | None = None
    slot: Slot | None = None  # the request's until its result takes it

    def reports(self) -> tuple[PartReport, ...]:
        """Where each part ran and for how long (the result's ``parts``)."""
        return tuple(PartReport(st.part.part_idx, st.part.modality, st.encoder_url,
                                st.part.item_indices, st.finished - st.started)
                     for st in self.parts)

    def fail(self, exc: EPDError) -> None:
        """The first failure wins and cancels everything the request still does."""
        if self.failure is None:
            self.failure = exc
        self.scope.cancel()
