"""Mooncake: every part written by its encoder straight into its place in one slot.

The receiver owns a transfer engine, named for its life by the host encoders
reach it at (``addresses.choose_mooncake_host``), with the pool's one buffer
registered once (a stable address). A part's ``/encode`` answer comes early,
with its shape and ``nbytes``, and leaves the part staged on its encoder; once
all are in, ``gather`` reserves one slot laid out exactly as a copying
receiver lays it out (``plan_layout``) and posts ``/send`` per part with the
address of that part's place. A ``/send`` answer means the bytes are in place,
so the result is views over the slot, with no copy.

Until an encoder hears of a failure it may still write into the slot, so a
failed request's slot is released only after the parts' ``/abort`` calls, and
held ``abort_hold`` seconds more when one of them went unconfirmed.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import Any

import httpx
import trio

from epd_trio.client.addresses import check_session, choose_mooncake_host
from epd_trio.client.answers import (
    Answer,
    check_sent,
    check_sized_meta,
    http_error,
    parse_sized_meta,
)
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.pool import EmbeddingPool, Slot
from epd_trio.client.receiving.base import Receiver, ReceiverStatistics, Settle
from epd_trio.client.result import EncodedRequest, ReceivedPart, plan_layout, slot_views
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.config import ClientConfig
from epd_trio.errors import EPDError, PeerUnavailable
from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake

__all__ = ["MooncakeReceiver"]

log = logging.getLogger(__name__)


class MooncakeReceiver(Receiver):
    """Parts written into the registered pool by the encoders' transfer engines."""

    staged = True  # a 200 /encode leaves the part waiting for its /send

    def __init__(self, config: ClientConfig, pool: EmbeddingPool, settle: Settle) -> None:
        super().__init__(config, pool, settle)
        self.engine: MooncakeTransport | None = None  # set once open
        self._host = ""  # the engine's name, where encoders reach it (set once open)
        self._holds: trio.Nursery | None = None  # where held slots wait; None once closing
        self._slots_held = 0

    async def _open(self, stack: AsyncExitStack) -> None:
        self._host = host = await choose_mooncake_host(self.config, self.routes)
        engine = await stack.enter_async_context(
            open_mooncake(host, self.config.mooncake_protocol, self.config.mooncake_device))
        await stack.enter_async_context(engine.registered(self.pool.address, self.pool.capacity))
        self.engine = engine
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # ends the holds before the pool is unregistered
        stack.callback(self._stop_holding)
        self._holds = nursery

    def _stop_holding(self) -> None:
        self._holds = None

    async def deliver_for(self, encoder_url: str) -> dict[str, Any]:
        assert self._host, "the receiver is not open"
        await check_session(self.routes, self._host, encoder_url)
        return {"backend": "mooncake"}

    async def take(self, req: LiveRequest, state: PartState, answer: Answer,
                   calls: EncoderCalls) -> None:
        part = state.part
        meta, nbytes = parse_sized_meta(answer, req.req_id, part.part_idx, len(req.parts))
        check_sized_meta(meta, nbytes, part.modality, len(part.item_indices), state.encoder_url)
        state.described = ReceivedPart.from_meta(part, meta)

    async def gather(self, req: LiveRequest, calls: EncoderCalls) -> EncodedRequest:
        """Reserve the slot, have every encoder write its part there, view it."""
        assert self.engine is not None, "the receiver is not open"
        described: list[ReceivedPart] = []
        for state in req.parts:
            assert state.described is not None  # every part was taken
            described.append(state.described)
        layouts, nbytes = plan_layout(described)
        req.slot = slot = await self.pool.acquire(nbytes)
        session = self.engine.session
        states = {state.part.part_idx: state for state in req.parts}
        async with trio.open_nursery() as nursery:
            for layout in layouts:
                for r, offset in layout.placements():
                    nursery.start_soon(self._send_part, calls, req, states[r.part.part_idx],
                                       session, slot.address + offset)
        if req.failure is not None:
            raise req.failure
        req.slot = None  # the result owns it now
        return EncodedRequest(req.req_id, slot, layouts, slot_views(slot, layouts), req.reports())

    async def _send_part(self, calls: EncoderCalls, req: LiveRequest, state: PartState,
                         session: str, address: int) -> None:
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
            self.settle(state)

    def release_failed(self, req: LiveRequest, slot: Slot, confirmed: bool) -> None:
        """Free the slot, unless an encoder that did not confirm its abort may still write
        into it: then hold it ``abort_hold`` seconds first (the pool never hands out memory
        a late write could land in)."""
        if confirmed or self._holds is None:
            slot.release()
            return
        self._slots_held += 1
        log.warning("request %s: an encoder did not confirm its /abort; its pool slot is held "
                    "%g s in case a Mooncake write still lands there", req.req_id,
                    self.config.abort_hold)
        self._holds.start_soon(self._hold_then_release, slot)

    async def _hold_then_release(self, slot: Slot) -> None:
        try:
            await trio.sleep(self.config.abort_hold)
        finally:  # the client closing ends the hold: its registered memory goes with it
            slot.release()

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics(
            slots_held_after_abort=self._slots_held,
            transfer_engine=self.engine.statistics() if self.engine is not None else None)

    def __repr__(self) -> str:
        return f"<MooncakeReceiver {self.engine!r}, {self._slots_held} slots held after abort>"
