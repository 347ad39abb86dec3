"""The receiver contract: how one transfer backend's parts come back to the client.

The encoder hides each transport behind a ``Delivery``; the client mirrors it
with a ``Receiver``, one per ``transfer_backend``, which ``EncoderClient``
holds and never looks past. It answers four questions, in the order a request
asks them:

- ``deliver_for(encoder_url)``: what a part's ``/encode`` tells its encoder
  (the ``deliver`` object: where this client can be reached, chosen per encoder
  and per attempt);
- ``take(req, state, answer, calls)``: what a part's 200 ``/encode`` answer means: its
  payload (inline), the message it announces (pushed: waited for, its encoder
  probed through ``calls`` while it is late), or only its
  size (``staged``: the encoder holds the part until ``gather`` fetches it);
- ``gather(req, calls)``: every part taken, the request's result in one pool
  slot (``req.slot`` holds the slot until the result owns it);
- ``release_failed(req, slot, confirmed)``: a failed request's slot, once its
  parts' ``/abort`` calls have ended (``confirmed``: every encoder said it let
  go). A backend whose encoders write into the slot may hold it longer.

A receiver owns its backend's resources (sockets, a transfer engine, the tasks
that serve them) for the life of its ``async with`` block, which the client
enters into its own; building one acquires nothing. ``register``/``unregister``
make a live request's parts findable by whatever delivers to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Final, Self

import trio

from epd_trio._routes import Routes
from epd_trio.client.answers import Answer
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.pool import EmbeddingPool, Slot
from epd_trio.client.result import EncodedRequest, ReceivedPart, copy_parts, plan_layout
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.config import ClientConfig
from epd_trio.transport.mooncake import MooncakeStatistics

__all__ = ["CopyingReceiver", "Receiver", "ReceiverStatistics", "Settle"]

# Copying this much (~2 ms at memcpy speed) is worth a thread hop off the trio loop.
_COPY_IN_THREAD_BYTES: Final = 16 << 20


# The router's ``settle``: count a part back in (its encoder no longer works on it).
Settle = Callable[[PartState], None]


@dataclass(frozen=True)
class ReceiverStatistics:
    """What a receiver adds to ``ClientStatistics`` (zero where its backend has no such thing)."""

    parts_live: int = 0  # parts a delivery may still reach (registered, not yet unregistered)
    messages_received: int = 0  # pushed messages read from the socket
    messages_dropped: int = 0  # for no live part (late, duplicate, unknown) or a failed request
    malformed_messages: int = 0  # dropped by the socket's reader
    slots_held_after_abort: int = 0  # slots held abort_hold s: an /abort went unconfirmed
    transfer_engine: MooncakeStatistics | None = None  # the engine writes land through


class Receiver(ABC):
    """One transfer backend, receiver side (see the module docstring)."""

    # A 200 /encode leaves the part on its encoder (still outstanding, still to /abort)
    # until ``gather`` fetches it.
    staged: ClassVar[bool] = False

    def __init__(self, config: ClientConfig, pool: EmbeddingPool, settle: Settle) -> None:
        self.config = config
        self.pool = pool
        self.settle = settle
        self.routes = Routes(timeout=config.connect_timeout)  # to encoders: whom to tell what
        self._stack = AsyncExitStack()

    # ---- resources ----------------------------------------------------------------
    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:  # a failed open releases what it had acquired
            await self._open(stack)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._stack.aclose()

    async def _open(self, stack: AsyncExitStack) -> None:  # noqa: B027 - a hook: nothing to acquire by default
        """Acquire the backend's resources onto ``stack`` (released in reverse at exit)."""

    # ---- one request ------------------------------------------------------------------
    def register(self, req: LiveRequest) -> None:  # noqa: B027 - a hook: nothing to do by default
        """``req``'s parts may now receive what is delivered to them (synchronous)."""

    def unregister(self, req: LiveRequest) -> None:  # noqa: B027 - a hook: nothing to do by default
        """``req`` is gone: what arrives for it from now on is dropped."""

    @property
    def endpoint(self) -> str:
        """The one address every encoder is told, when the configuration names one; else ""."""
        return ""

    @abstractmethod
    async def deliver_for(self, encoder_url: str) -> dict[str, Any]:
        """The ``deliver`` object of a part's ``/encode`` to ``encoder_url``.

        May raise ``EncoderUnreachable`` (the part moves to another encoder) or
        ``PeerUnavailable`` (this encoder cannot reach this client as configured).
        """

    @abstractmethod
    async def take(self, req: LiveRequest, state: PartState, answer: Answer,
                   calls: EncoderCalls) -> None:
        """Read a part's 200 ``/encode`` answer; raises an ``EPDError`` when it is wrong."""

    @abstractmethod
    async def gather(self, req: LiveRequest, calls: EncoderCalls) -> EncodedRequest:
        """Every part taken: the result in one slot; raises the request's failure."""

    def release_failed(self, req: LiveRequest, slot: Slot, confirmed: bool) -> None:
        """Free a failed request's slot once its ``/abort`` calls have ended: nothing
        written by an encoder lands there, so at once."""
        slot.release()

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.statistics()}>"


class CopyingReceiver(Receiver):
    """A backend whose parts arrive as payloads (``state.message``), copied into one slot."""

    async def gather(self, req: LiveRequest, calls: EncoderCalls) -> EncodedRequest:
        received = []
        for state in req.parts:
            assert state.message is not None
            header, payload = state.message
            assert payload is not None  # an error message has already failed the request
            received.append(ReceivedPart.from_message(state.part, header, payload))
        layouts, nbytes = plan_layout(received)
        req.slot = slot = await self.pool.acquire(nbytes)
        if nbytes >= _COPY_IN_THREAD_BYTES:  # not cancellable: the copy always finishes
            embeddings = await trio.to_thread.run_sync(copy_parts, slot, layouts)
        else:
            embeddings = copy_parts(slot, layouts)
        req.slot = None  # the result owns it now
        return EncodedRequest(req.req_id, slot, layouts, embeddings, req.reports())
