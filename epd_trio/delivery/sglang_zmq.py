"""SGLang ZMQ delivery: SGLang's two-frame message, to every destination of the part.

The destinations come with ``/encode`` (zmq_to_tokenizer: ``prefill_host:
embedding_port``; an older zmq_to_scheduler: a list of ports on that host), or
are registered by each tensor-parallel rank of the language server with
``/scheduler_receive_url`` (zmq_to_scheduler), possibly before or after the
``/encode``: then the part is sent to each destination as it is registered,
until ``receive_count`` distinct ones have it, within the send timeout.
Each destination gets the whole part; a failure is sent the same way, as a
frame-0-only error message (``epd_trio.protocol.sglang``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from epd_trio.delivery.base import Answer, DeliveryContext, fan_out, push
from epd_trio.delivery.sglang_rendezvous import Entry, Rendezvous
from epd_trio.errors import EPDError, TransferTimeout
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest
from epd_trio.protocol.sglang import embedding_message, error_message, meta_fields
from epd_trio.transport.zmq import PushSocketCache

if TYPE_CHECKING:
    import torch

__all__ = ["SGLangZmqDelivery", "tcp_endpoint"]


def tcp_endpoint(host_port: str) -> str:
    """SGLang's ``host:port`` (IPv6 hosts bracketed or not) as a ZMQ ``tcp://`` endpoint."""
    host, _, port = host_port.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SGLangZmqDelivery:
    """Push SGLang's message (or its error notice) to each destination of one part."""

    def __init__(self, request: EncodeRequest, sockets: PushSocketCache, send_timeout: float,
                 rendezvous: Rendezvous) -> None:
        self._request = request
        self._sockets = sockets
        self._timeout = send_timeout
        self._rendezvous = rendezvous
        self._entry: Entry | None = None  # claimed on first use, released by aclose
        # SGLang's "host:port" destinations from the /encode; empty: the registered ones.
        self.endpoints: tuple[str, ...] = request.deliver.endpoints

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> SGLangZmqDelivery:
        return cls(request, context.zmq, context.send_timeout, context.rendezvous)

    def admitted(self) -> None:
        if not self.endpoints:  # zmq_to_scheduler: its ranks register for it
            self._rendezvous.expect(self._request.req_id)

    def sized(self, meta: EncodeMeta) -> Answer | None:
        self._claim()  # registrations wait for a claim: tell them this part is live
        return None  # SGLang's answer comes after every destination has the part

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        frames = embedding_message(embedding, **meta_fields(meta))
        await self._send_all(frames)
        return Answer(meta, embedding)

    async def fail(self, error: EPDError) -> None:
        r = self._request
        if entry := self._claim():
            entry.publish_error(error)  # remembered: a late registration hears it at once
        await self._send_all(error_message(r.req_id, r.part_idx, r.num_parts, r.modality, error))

    async def aclose(self) -> None:
        if self._entry is not None:
            self._rendezvous.release(self._entry)
            self._entry = None

    def _claim(self) -> Entry | None:
        if not self.endpoints and self._entry is None:
            self._entry = self._rendezvous.claim(self._request.req_id)
        return self._entry

    async def _send_all(self, frames: Sequence[Any]) -> None:
        async with fan_out() as nursery:
            if self.endpoints:
                for destination in self.endpoints:
                    nursery.start_soon(self._send, tcp_endpoint(destination), frames)
            else:
                await self._send_to_registered(nursery, frames)

    async def _send_to_registered(self, nursery: trio.Nursery, frames: Sequence[Any]) -> None:
        """Start a send to each destination as it registers, until ``receive_count`` have one."""
        entry = self._claim()
        assert entry is not None
        started: set[str] = set()
        with trio.move_on_after(self._timeout):
            while True:
                for destination in list(entry.destinations):
                    if destination not in started:
                        started.add(destination)
                        nursery.start_soon(self._send, tcp_endpoint(destination), frames)
                if entry.receive_count is not None and len(started) >= entry.receive_count:
                    return
                await entry.wait_changed()
        raise TransferTimeout(f"{len(started)} of {entry.receive_count or '?'} destinations of "
                              f"{self._request.req_id!r} registered within {self._timeout} s",
                              req_id=self._request.req_id)

    async def _send(self, endpoint: str, frames: Sequence[Any]) -> None:
        await push(self._sockets, endpoint, frames, self._timeout)

    def __repr__(self) -> str:
        where = f"{len(self.endpoints)} endpoint(s)" if self.endpoints else "registered destinations"
        return f"<SGLangZmqDelivery {self._request.req_id!r} to {where}>"
