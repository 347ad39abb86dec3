"""Fault installation for the encoder service: its points ``send`` and ``release``.

The service builds each request's delivery through one seam,
``EncoderService.delivery_for``; installing a plan wraps what it builds, so a
fault fires where the delivery would send (``send``, before the embedding
leaves) and where the scope releases it (``release``, at ``aclose``). The
service itself never looks for a plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epd_trio.delivery import Answer, Delivery, InlineDelivery, PulledDelivery
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import AbortedError, EPDError, UnknownRequestError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

if TYPE_CHECKING:
    import torch

    from epd_trio.testing import FaultPlan

__all__ = ["FaultyDelivery", "FaultyPulledDelivery", "install"]


class FaultyDelivery:
    """A delivery with the plan's faults at ``send`` and ``release``."""

    def __init__(self, inner: Delivery, plan: FaultPlan, service: EncoderService,
                 request: EncodeRequest) -> None:
        self.inner = inner
        self._plan = plan
        self._service = service
        self._request = request

    def admitted(self) -> None:
        self.inner.admitted()

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return self.inner.sized(meta)

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        if not isinstance(self.inner, InlineDelivery):  # the answer is no transport that can fail
            await self._plan.inject("send", cancel=self._cancel)
        return await self.inner.deliver(embedding, meta)

    async def fail(self, error: EPDError) -> None:
        await self.inner.fail(error)

    async def aclose(self) -> None:
        """A delay or error at ``release`` must not stop the release."""
        try:
            await self._plan.inject("release")
        except EPDError:
            await self.inner.aclose()
            raise
        await self.inner.aclose()

    def _cancel(self) -> None:
        """Cancel the request's scope, as ``/abort`` would."""
        reason = AbortedError("injected cancellation", req_id=self._request.req_id)
        try:
            self._service.registry.get(self._request.key).abort(reason)
        except UnknownRequestError:
            pass


class FaultyPulledDelivery(FaultyDelivery):
    """The same, for a delivery its receivers pull with orders."""

    async def take_order(self, session: str, address: int, length: int, **order: Any) -> int:
        assert isinstance(self.inner, PulledDelivery)
        return await self.inner.take_order(session, address, length, **order)

    @property
    def unsettled(self) -> bool:
        assert isinstance(self.inner, PulledDelivery)
        return self.inner.unsettled


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it is an encoder service; False if it is not."""
    if not isinstance(owner, EncoderService):
        return False
    build = owner._build_delivery  # the unwrapped seam: installing twice does not stack
    if plan is None:
        owner.delivery_for = build
        return True

    def faulty(request: EncodeRequest) -> Delivery:
        inner = build(request)
        wrapper = FaultyPulledDelivery if isinstance(inner, PulledDelivery) else FaultyDelivery
        return wrapper(inner, plan, owner, request)

    owner.delivery_for = faulty
    return True
