"""SGLang Mooncake delivery: SGLang's ranks pull the part with ``/send``, then hear it landed.

SGLang's sequence for one part: each language-server rank asks
``/scheduler_receive_meta_data`` (which waits until the sizes are known, see
``sglang_rendezvous``), reserves ``embedding_size`` bytes, then posts ``/send``
with its Mooncake ``session_id``, ``buffer_address``, the ``prefill_host:
embedding_port`` its receive thread PULLs on, and ``receive_count``. For each
order the bytes are written with the transfer engine, then a frame-0-only
completion notice is PUSHed to that endpoint; the part is released once
``receive_count`` distinct endpoints are served. The writing itself is the
native Mooncake delivery's (registration, child task per order, send timeout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from epd_trio.delivery.base import Answer, DeliveryContext, push
from epd_trio.delivery.mooncake import Mailbox, MooncakeDelivery, SendOrder, _nbytes
from epd_trio.delivery.sglang_rendezvous import Entry, Rendezvous
from epd_trio.delivery.sglang_zmq import tcp_endpoint
from epd_trio.errors import EPDError, RequestError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.protocol.sglang import embedding_frame, meta_fields
from epd_trio.transport.mooncake import MooncakeTransport
from epd_trio.transport.zmq import PushSocketCache

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_RECEIVERS", "SGLangMooncakeDelivery", "SGLangOrder"]

# Most ranks one part may be written to (SGLang's receive_count is the TP size).
MAX_RECEIVERS: Final = 64


@dataclass(eq=False)
class SGLangOrder(SendOrder):
    """One SGLang ``/send``: the write, plus where to say it is done."""

    completion: str = ""  # tcp:// endpoint of the rank's PULL socket
    receive_count: int = 1

    @property
    def destination(self) -> tuple[str, int]:
        return (self.completion, 0)  # SGLang counts a rank by its endpoint


class SGLangMooncakeDelivery(MooncakeDelivery):
    """Publish sizes early, write each rank's order, then push its completion notice."""

    def __init__(self, request: EncodeRequest, mooncake: MooncakeTransport, send_timeout: float,
                 sockets: PushSocketCache, rendezvous: Rendezvous) -> None:
        super().__init__(request, mooncake, send_timeout)
        self.mailbox = Mailbox(MAX_RECEIVERS)  # the real count comes with the first /send
        self._receive_count: int | None = None
        self._sockets = sockets
        self._rendezvous = rendezvous
        self._entry: Entry | None = None
        self._notice: bytes | None = None

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> SGLangMooncakeDelivery:
        if context.mooncake is None:
            raise RequestError("this encoder does not serve Mooncake delivery (start it with "
                               "--encoder-transfer-backend mooncake)", req_id=request.req_id)
        return cls(request, context.mooncake, context.send_timeout, context.zmq, context.rendezvous)

    def admitted(self) -> None:
        self._rendezvous.expect(self._request.req_id)  # its ranks ask for its sizes

    def _claimed(self) -> Entry:
        if self._entry is None:
            self._entry = self._rendezvous.claim(self._request.req_id)
        return self._entry

    def sized(self, meta: EncodeMeta) -> Answer | None:
        self._publish(meta)
        return super().sized(meta)

    def _publish(self, meta: EncodeMeta) -> None:
        entry = self._claimed()
        if entry.sizes is None:  # /scheduler_receive_meta_data waiters get these
            entry.publish_sizes({"embedding_size": _nbytes(meta), "embedding_len": meta.tokens,
                                 "embedding_dim": meta.dim})

    def _order(self, session: str, address: int, length: int, **order_fields: Any) -> SendOrder:
        completion, count = order_fields.pop("completion", None), order_fields.pop("receive_count", 1)
        if order_fields or not isinstance(completion, str):
            raise RequestError("an SGLang /send names its completion endpoint and nothing else")
        if self._receive_count is not None and count != self._receive_count:
            raise RequestError(f"receive_count {count} differs from the {self._receive_count} "
                               "of an earlier /send", req_id=self._request.req_id)
        if not 1 <= count <= MAX_RECEIVERS:
            raise RequestError(f"receive_count must be in 1..{MAX_RECEIVERS}", req_id=self._request.req_id)
        self._receive_count = self.mailbox.receive_count = count
        return SGLangOrder(session, address, length, completion=tcp_endpoint(completion),
                           receive_count=count)

    async def written(self, order: SendOrder) -> None:
        assert isinstance(order, SGLangOrder) and self._notice is not None
        await push(self._sockets, order.completion, [self._notice], self._timeout,
                   "ZMQ completion notice")

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        self._publish(meta)  # a cached part was never sized
        self._notice = embedding_frame(dtype=embedding.dtype, shape=embedding.shape,
                                       **meta_fields(meta))
        return await super().deliver(embedding, meta)

    async def fail(self, error: EPDError) -> None:
        self._claimed().publish_error(error)
        await super().fail(error)

    async def aclose(self) -> None:
        await super().aclose()
        if self._entry is not None:
            self._rendezvous.release(self._entry)
            self._entry = None

    def __repr__(self) -> str:
        return (f"<SGLangMooncakeDelivery {self._request.req_id!r} for "
                f"{self._receive_count or '?'} receiver(s){', closed' if self.mailbox.closed else ''}>")
