"""Mooncake delivery inside a request scope: staged output, served ``/send`` orders.

The forward's output (host memory; on GPU hosts pinned, and synchronized
before the worker returns it) is registered with the transfer engine as it is
— no staging copy. ``/send`` handlers post ``SendOrder``s to the scope's
mailbox; the scope performs each write as a child task, so the registration
is released only after every write has finished (or is held by the
transport's reaper). The scope ends once ``receive_count`` distinct
destinations are served; a retried ``/send`` to a served destination writes
again but is not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from epd_trio._util import first_leaf
from epd_trio.errors import EPDError, OverloadedError, RequestError, TransferTimeout, UnknownRequestError
from epd_trio.transport.mooncake import MooncakeTransport

__all__ = ["Mailbox", "SendOrder", "serve_send_orders"]


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
    """Where ``/send`` handlers leave orders for a request scope."""

    def __init__(self, receive_count: int) -> None:
        self.receive_count = receive_count
        # Room for each receiver's order plus retries; more is a misbehaving client.
        self._send, self.orders = trio.open_memory_channel[SendOrder](4 * receive_count)

    def post(self, order: SendOrder) -> None:
        try:
            self._send.send_nowait(order)
        except trio.WouldBlock:
            raise OverloadedError("too many /send calls pending for this request") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise UnknownRequestError("the request was released") from None

    def close(self, reason: EPDError) -> None:
        """No more orders; fail the ones never served (their handlers wait)."""
        self._send.close()
        while True:
            try:
                self.orders.receive_nowait().finish(outcome.Error(reason))
            except (trio.WouldBlock, trio.EndOfChannel):
                break


async def serve_send_orders(mooncake: MooncakeTransport, mailbox: Mailbox, embedding: Any,
                            send_timeout: float) -> None:
    """Serve orders until ``receive_count`` destinations have the bytes.

    Raises ``TransferTimeout`` when they do not all ask within ``send_timeout``,
    and the first write failure (the request fails on both sides).
    """
    nbytes = embedding.numel() * embedding.element_size()
    served: set[tuple[str, int]] = set()
    all_served = trio.Event()

    async def write(order: SendOrder) -> None:
        try:
            await write_once(order)
        finally:  # cancelled once every destination was served: tell its handler
            order.finish(outcome.Error(UnknownRequestError("the request was released")))

    async def write_once(order: SendOrder) -> None:
        if order.length < nbytes:
            order.finish(outcome.Error(RequestError(
                f"buffer_length {order.length} is smaller than the embedding's {nbytes} bytes")))
            return
        try:
            await mooncake.write(order.session, embedding.data_ptr(), order.address, nbytes,
                                 timeout=send_timeout, keepalive=embedding)
        except EPDError as exc:
            order.finish(outcome.Error(exc))
            raise
        served.add(order.destination)
        order.finish(outcome.Value(nbytes))
        if len(served) >= mailbox.receive_count:
            all_served.set()

    async with mooncake.registered(embedding.data_ptr(), nbytes):
        try:
            async with trio.open_nursery() as writers:
                async def take_orders() -> None:
                    async for order in mailbox.orders:
                        writers.start_soon(write, order)

                writers.start_soon(take_orders)
                with trio.move_on_after(send_timeout) as waiting:
                    await all_served.wait()
                writers.cancel_scope.cancel()
        except* EPDError as group:
            raise first_leaf(group) from None
        if waiting.cancelled_caught:
            raise TransferTimeout(f"{mailbox.receive_count - len(served)} of {mailbox.receive_count} "
                                  f"receivers did not /send within {send_timeout} s")
