"""Mooncake delivery: receivers pull the embedding with ``/send`` orders.

The face answers as soon as preprocessing has sized the output (``sized``),
so each receiver registers a buffer while the forward runs and posts an order
naming it. The forward's output (host memory; on GPU hosts pinned, and
synchronized before the worker returns it) is registered with the transfer
engine as it is, no staging copy, and each order is written by a child task,
so the registration is released only after every write has finished (or is
held by the transport's reaper). The delivery is done once ``receive_count``
distinct destinations are served; a retried order to a served destination
writes again but is not counted twice. Orders that arrive after the end are
answered with the reason it ended. A write the transfer engine did not stop
within its bound leaves the delivery ``unsettled`` until it has (see
``PulledDelivery``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import outcome
import torch
import trio

from epd_trio.delivery.base import TRANSPORT_ERRORS, Answer, DeliveryContext, fan_out, map_exceptions
from epd_trio.errors import (
    EPDError,
    OverloadedError,
    RequestError,
    TransferTimeout,
    UnknownRequestError,
)
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.transport.mooncake import MooncakeTransport

__all__ = ["Mailbox", "MooncakeDelivery", "SendOrder"]


@dataclass(eq=False)
class SendOrder:
    """One ``/send``: write the request's bytes into ``address`` at ``session``."""

    session: str
    address: int
    length: int
    done: trio.Event = field(default_factory=trio.Event)
    result: outcome.Outcome | None = None

    @property
    def destination(self) -> tuple[str, int]:
        return (self.session, self.address)

    def finish(self, result: outcome.Outcome) -> None:
        if self.result is None:
            self.result = result
            self.done.set()


class Mailbox:
    """Where ``/send`` handlers leave orders for the delivery."""

    def __init__(self, receive_count: int) -> None:
        self.receive_count = receive_count
        # Room for each receiver's order plus retries; more is a misbehaving client.
        self._send, self.orders = trio.open_memory_channel[SendOrder](4 * receive_count)
        self.closed = False

    def post(self, order: SendOrder) -> None:
        try:
            self._send.send_nowait(order)
        except trio.WouldBlock:
            raise OverloadedError("too many /send calls pending for this request") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise UnknownRequestError("the request was released") from None

    def close(self, reason: EPDError) -> None:
        """No more orders; fail the ones never served (their handlers wait)."""
        self.closed = True
        self._send.close()
        while True:
            try:
                self.orders.receive_nowait().finish(outcome.Error(reason))
            except (trio.WouldBlock, trio.EndOfChannel):
                break


def _nbytes(meta: EncodeMeta) -> int:
    return meta.tokens * meta.dim * torch.empty((), dtype=getattr(torch, meta.dtype)).element_size()


class MooncakeDelivery:
    """Answer early with ``nbytes``; write to each receiver that posts an order."""

    def __init__(self, request: EncodeRequest, mooncake: MooncakeTransport, send_timeout: float) -> None:
        self._request = request
        self._mooncake = mooncake
        self._timeout = send_timeout
        self.mailbox = Mailbox(request.deliver.receive_count)
        self._targets: set[tuple[str, int]] = set()  # (session, address) of every write started

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> MooncakeDelivery:
        if context.mooncake is None:
            raise RequestError("this encoder does not serve Mooncake delivery "
                               "(start it with --transfer-backend mooncake)", req_id=request.req_id)
        return cls(request, context.mooncake, context.send_timeout)

    def admitted(self) -> None:
        """Nothing to announce: receivers learn of the part from its early answer."""

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return Answer(meta, nbytes=_nbytes(meta))  # receivers reserve while the forward runs

    @property
    def unsettled(self) -> bool:
        return any(self._mooncake.still_writing(session, address) for session, address in self._targets)

    async def take_order(self, session: str, address: int, length: int, **order_fields: Any) -> int:
        """A ``/send``: post the order, wait until it is served; the bytes written."""
        order = self._order(session, address, length, **order_fields)
        self.mailbox.post(order)
        await order.done.wait()  # bounded: every posted order is finished (served or failed)
        assert order.result is not None
        return order.result.unwrap()

    def _order(self, session: str, address: int, length: int, **order_fields: Any) -> SendOrder:
        """The order of one ``/send`` (a protocol may add fields; ours has none)."""
        if order_fields:
            raise RequestError(f"unexpected /send fields {sorted(order_fields)}")
        return SendOrder(session, address, length)

    async def written(self, order: SendOrder) -> None:
        """After one order's bytes are in place, before it counts as served (a hook)."""

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        with map_exceptions(TRANSPORT_ERRORS, "mooncake delivery"):
            await self._serve(embedding)
        self.mailbox.close(self._released())
        return Answer(meta, embedding, nbytes=_nbytes(meta))

    async def fail(self, error: EPDError) -> None:
        self.mailbox.close(error)  # /send callers waiting for this request learn why it ended

    async def aclose(self) -> None:
        if not self.mailbox.closed:
            self.mailbox.close(self._released())

    def _released(self) -> EPDError:
        r = self._request
        return UnknownRequestError(f"request {r.req_id!r} part {r.part_idx} was released", req_id=r.req_id)

    async def _serve(self, embedding: torch.Tensor) -> None:
        """Serve orders until ``receive_count`` destinations have the bytes.

        Raises ``TransferTimeout`` when they do not all ask within the send
        timeout, and the first write failure (the request fails on both sides).
        """
        nbytes = embedding.numel() * embedding.element_size()
        served: set[tuple[str, int]] = set()
        all_served = trio.Event()
        cut: list[EPDError] = [UnknownRequestError("the request was released")]

        async def write(order: SendOrder) -> None:
            try:
                await write_once(order)
            finally:  # cancelled (every destination served, or the time ran out): say which
                order.finish(outcome.Error(cut[0]))

        async def write_once(order: SendOrder) -> None:
            if order.length < nbytes:
                order.finish(outcome.Error(RequestError(
                    f"buffer_length {order.length} is smaller than the embedding's {nbytes} bytes")))
                return
            self._targets.add((order.session, order.address))
            try:
                with map_exceptions(TRANSPORT_ERRORS, f"mooncake write to {order.session}"):
                    await self._mooncake.write(order.session, embedding.data_ptr(), order.address,
                                               nbytes, timeout=self._timeout, keepalive=embedding)
                await self.written(order)
            except EPDError as exc:
                order.finish(outcome.Error(exc))
                raise
            served.add(order.destination)
            order.finish(outcome.Value(nbytes))
            if len(served) >= self.mailbox.receive_count:  # read now: a protocol may learn it late
                all_served.set()

        async with self._mooncake.registered(embedding.data_ptr(), nbytes):
            async with fan_out() as writers:
                async def take_orders() -> None:
                    async for order in self.mailbox.orders:
                        writers.start_soon(write, order)

                writers.start_soon(take_orders)
                with trio.move_on_after(self._timeout) as waiting:
                    await all_served.wait()
                if waiting.cancelled_caught:
                    wanted = self.mailbox.receive_count
                    cut[0] = TransferTimeout(
                        f"{wanted - len(served)} of {wanted} receivers were not written within the "
                        f"send timeout ({self._timeout} s): no /send came, or its write ran over")
                writers.cancel_scope.cancel()
            if waiting.cancelled_caught:
                raise cut[0]

    def __repr__(self) -> str:
        return (f"<MooncakeDelivery {self._request.req_id!r} for {self.mailbox.receive_count} "
                f"receiver(s){', closed' if self.mailbox.closed else ''}>")
