"""Fault installation for the receiver library: ``client_dispatch``, ``client_gather``, ``demux``.

Each point wraps one of the client's seams, as instance attributes over the
class's own methods, so the client has no fault branch and removing a plan
(``install(None, client)``) leaves exactly the class's code:

- ``client_dispatch`` — before ``client.router.post`` (a part's ``/encode``);
  a cancellation fails the request with ``AbortedError``.
- ``client_gather`` — before ``client.receiver.gather`` (the taken parts into
  one slot, whatever the transfer backend); likewise.
- ``demux`` — before ``client.receiver.demux.hand_off`` (a pushed message to its
  part; only a receiver with a demultiplexer has it): a delay holds the socket,
  an error loses the message (counted as dropped, as a network would lose one);
  the demultiplexer itself never dies of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from epd_trio.errors import AbortedError, EPDError

if TYPE_CHECKING:
    from epd_trio.client.calls import EncoderCalls
    from epd_trio.client.demux import Demultiplexer
    from epd_trio.client.result import EncodedRequest
    from epd_trio.client.state import LiveRequest
    from epd_trio.testing import FaultPlan

__all__ = ["install"]

_SEAMS = (("router", "post"), ("receiver", "gather"), ("receiver.demux", "hand_off"))


def _holder(owner: Any, path: str) -> Any:
    """``owner.router``, ``owner.receiver.demux``...; None where the receiver has no such part."""
    for name in path.split("."):
        owner = getattr(owner, name, None)
    return owner


def install(plan: FaultPlan | None, owner: Any) -> bool:
    """Install ``plan`` on ``owner`` if it is an ``EncoderClient``; False if it is not."""
    from epd_trio.client.client import EncoderClient

    if not isinstance(owner, EncoderClient):
        return False
    for path, name in _SEAMS:
        holder = _holder(owner, path)
        if holder is not None:
            vars(holder).pop(name, None)
    if plan is not None:
        receiver = owner.receiver
        owner.router.post = _dispatch(plan, owner.router.post)  # type: ignore[method-assign,assignment]
        receiver.gather = _gather(plan, receiver.gather)  # type: ignore[method-assign,assignment]
        demux = _holder(owner, "receiver.demux")
        if demux is not None:
            demux.hand_off = _demux(plan, demux)
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


_Gather = Callable[["LiveRequest", "EncoderCalls"], Awaitable["EncodedRequest"]]


def _gather(plan: FaultPlan, gather: _Gather
            ) -> Callable[[LiveRequest, EncoderCalls], Coroutine[Any, Any, EncodedRequest]]:
    async def gather_with_faults(req: LiveRequest, calls: EncoderCalls) -> EncodedRequest:
        await plan.inject("client_gather", cancel=_failer(req))
        return await gather(req, calls)
    return gather_with_faults


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
