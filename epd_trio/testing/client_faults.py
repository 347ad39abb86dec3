"""Fault installation for the receiver library: ``client_dispatch``, ``client_gather``, ``demux``.

Each point wraps one of the client's seams, as instance attributes over the
class's own methods, so the client has no fault branch and removing a plan
(``install(None, client)``) leaves exactly the class's code:

- ``client_dispatch`` — before ``client.router.post`` (a part's ``/encode``);
  a cancellation fails the request with ``AbortedError``.
- ``client_gather`` — before ``client._assemble`` (received parts into a slot;
  ZMQ and inline only); likewise.
- ``demux`` — before ``client.demux.hand_off`` (a received message to its part):
  a delay holds the socket, an error loses the message (counted as dropped, as
  a network would lose one); the demultiplexer itself never dies of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from epd_trio.errors import AbortedError, EPDError

if TYPE_CHECKING:
    from epd_trio.client.demux import Demultiplexer
    from epd_trio.client.state import LiveRequest
    from epd_trio.testing import FaultPlan

__all__ = ["install"]

_SEAMS = (("router", "post"), (None, "_assemble"), ("demux", "hand_off"))


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it is an ``EncoderClient``; False if it is not."""
    from epd_trio.client.client import EncoderClient

    if not isinstance(owner, EncoderClient):
        return False
    for holder, name in _SEAMS:
        vars(owner if holder is None else getattr(owner, holder)).pop(name, None)
    if plan is not None:
        owner.router.post = _dispatch(plan, owner.router.post)  # type: ignore[method-assign,assignment]
        owner._assemble = _gather(plan, owner._assemble)  # type: ignore[method-assign,assignment]
        owner.demux.hand_off = _demux(plan, owner.demux)  # type: ignore[method-assign,assignment]
    return True


def _failer(req: LiveRequest) -> Callable[[], None]:
    return lambda: req.fail(AbortedError("injected cancellation", req_id=req.req_id))


def _dispatch(plan: FaultPlan, post: Callable[..., Awaitable[Any]]
              ) -> Callable[..., Awaitable[Any]]:
    async def post_with_faults(http: Any, req: LiveRequest, state: Any, body: Any,
                               **options: Any) -> Any:
        await plan.inject("client_dispatch", cancel=_failer(req))
        return await post(http, req, state, body, **options)
    return post_with_faults


def _gather(plan: FaultPlan, assemble: Callable[[LiveRequest], Awaitable[Any]]
            ) -> Callable[[LiveRequest], Awaitable[Any]]:
    async def assemble_with_faults(req: LiveRequest) -> Any:
        await plan.inject("client_gather", cancel=_failer(req))
        return await assemble(req)
    return assemble_with_faults


def _demux(plan: FaultPlan, demux: Demultiplexer) -> Callable[..., Awaitable[None]]:
    hand_off = demux.hand_off

    async def hand_off_with_faults(header: Any, payload: Any) -> None:
        try:
            await plan.inject("demux")
        except EPDError:
            demux.drop(header, "lost to an injected fault")
            return
        await hand_off(header, payload)
    return hand_off_with_faults
