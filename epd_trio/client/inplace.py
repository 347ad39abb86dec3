"""Mooncake delivery, receiver side: every part written straight into its place in one slot.

The client registers its pool's one buffer with a transfer engine once, for its
whole life (``open_registered_engine``). A request's ``/encode`` answers come
early, with each part's shape and ``nbytes``; once all are in, the client
reserves one slot laid out exactly as the ZMQ path lays it out
(``plan_layout``) and ``write_parts`` posts ``/send`` per part with the address
of that part's place. A ``/send`` answer means the bytes are in place, so the
result is views over the slot, with no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

import httpx
import trio

from epd_trio.client.answers import check_sent, http_error
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.pool import EmbeddingPool, Slot
from epd_trio.client.result import ModalityLayout
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.config import ClientConfig
from epd_trio.errors import EPDError, PeerUnavailable
from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake

__all__ = ["open_registered_engine", "write_parts"]


async def open_registered_engine(stack: AsyncExitStack, config: ClientConfig,
                                 pool: EmbeddingPool, host: str) -> MooncakeTransport:
    """A transfer engine on ``stack``, named ``host`` (where encoders reach it: see
    ``addresses``), with ``pool``'s buffer registered (a stable address)."""
    engine = await stack.enter_async_context(
        open_mooncake(host, config.mooncake_protocol, config.mooncake_device))
    await stack.enter_async_context(engine.registered(pool.address, pool.capacity))
    return engine


async def write_parts(calls: EncoderCalls, req: LiveRequest, slot: Slot,
                      layouts: list[ModalityLayout], session: str,
                      settle: Callable[[PartState], None]) -> None:
    """Have every part's encoder write it into ``slot``; failures go to ``req.fail``."""
    states = {state.part.part_idx: state for state in req.parts}
    async with trio.open_nursery() as nursery:
        for layout in layouts:
            for r, offset in layout.placements():
                nursery.start_soon(_send_part, calls, req, states[r.part.part_idx], session,
                                   slot.address + offset, settle)


async def _send_part(calls: EncoderCalls, req: LiveRequest, state: PartState, session: str,
                     address: int, settle: Callable[[PartState], None]) -> None:
    """/send (HTTP or gRPC); its 200 answer means the bytes are at ``address``."""
    part = state.part
    assert state.described is not None
    nbytes = state.described.nbytes
    body = {"req_id": req.req_id, "part_idx": part.part_idx, "session": session,
            "buffer_address": address, "buffer_length": nbytes}
    try:
        try:
            response = await calls.post(state.encoder_url, "/send", body)
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{state.encoder_url} failed /send of part {part.part_idx}"
                                  f" of {req.req_id}: {type(exc).__name__}: {exc}",
                                  req_id=req.req_id) from None
        if response.status_code != 200:
            raise http_error(response, req.req_id, state.encoder_url, part.part_idx)
        check_sent(response, req.req_id, part.part_idx, nbytes, state.encoder_url)
        state.answered = True  # in place, and the encoder has released the part
        state.finished = trio.current_time()
    except EPDError as exc:
        req.fail(exc)
    finally:
        settle(state)
