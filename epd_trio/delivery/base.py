"""The delivery contract: how one request's embedding leaves the encoder.

A ``Delivery`` hides one transport behind three calls, made by the request
lifecycle (``epd_trio.encoder.service``) in this order:

- ``sized(meta)`` once preprocessing knows the output's size, before the
  forward. A delivery whose receiver must reserve memory first (Mooncake)
  returns the face's answer here, early; the others return None.
- ``deliver(embedding, meta)`` with the finished embedding; returns the answer
  a face gives (unless ``sized`` gave one).
- ``fail(error)`` when the request failed, was aborted or timed out: the
  receiver hears of it instead of waiting for its own timeout.

and ``admitted()`` once its request holds its key (after the duplicate check:
a delivery may make itself known then), ``aclose()`` exactly once, when the
scope that owns it is released. Building a delivery acquires and changes
nothing, so one refused before admission (a 409 duplicate) is simply dropped.

Every delivery maps its transport's exceptions into ``epd_trio.errors``
inside itself (``map_exceptions``, as httpcore does), so no transport error
reaches a face as a 500.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import trio
import zmq

from epd_trio._util import first_leaf
from epd_trio.delivery.sglang_rendezvous import Rendezvous
from epd_trio.errors import EPDError, PeerUnavailable, TransferTimeout, TransportError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

if TYPE_CHECKING:
    import torch

    from epd_trio.delivery.vllm_mooncake import EcControl
    from epd_trio.transport.mooncake import MooncakeTransport
    from epd_trio.transport.zmq import PushSocketCache

__all__ = [
    "Answer",
    "Delivery",
    "DeliveryContext",
    "DeliveryFactory",
    "PulledDelivery",
    "TRANSPORT_ERRORS",
    "fan_out",
    "map_exceptions",
    "push",
]

# What the transports and their threads can raise on a send or a write, as our errors
# (a transfer engine's return codes are already ``TransportError``s).
TRANSPORT_ERRORS: Final[Mapping[type[Exception], type[EPDError]]] = {
    trio.TooSlowError: TransferTimeout,
    trio.BrokenResourceError: PeerUnavailable,  # Broken: the peer or the environment failed
    trio.ClosedResourceError: TransportError,  # Closed: we closed it (eviction, shutdown)
    zmq.ZMQError: TransportError,
    OSError: TransportError,
}


@dataclass(frozen=True)
class Answer:
    """What a face turns into its response; a request gives exactly one.

    ``body`` is set when the embedding travels in the answer itself (inline),
    ``nbytes`` when the receiver pulls it later and must reserve that much.
    """

    meta: EncodeMeta
    embedding: torch.Tensor | None = None  # [tokens, dim]; None in an early answer
    body: bytes | None = None
    nbytes: int | None = None


@runtime_checkable
class Delivery(Protocol):
    """Where one request's embedding goes (see the module docstring)."""

    def admitted(self) -> None: ...

    def sized(self, meta: EncodeMeta) -> Answer | None: ...

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer: ...

    async def fail(self, error: EPDError) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class PulledDelivery(Delivery, Protocol):
    """A delivery its receivers pull: each posts an order (``/send``) for its copy.

    It writes into the receivers' memory, so ``/abort`` waits until it has let go.
    ``order`` carries what a protocol adds to an order (SGLang: where to send
    the completion notice, and how many receivers there are). ``unsettled``
    is true while a write it started may still land (one the transfer engine
    did not stop within its bound): until then a receiver must not reuse that
    memory, even after the delivery was closed.
    """

    async def take_order(self, session: str, address: int, length: int, **order: Any) -> int: ...

    @property
    def unsettled(self) -> bool: ...


@dataclass(frozen=True)
class DeliveryContext:
    """What the encoder lends its deliveries: transports, bounds, the thread limiter."""

    zmq: PushSocketCache
    mooncake: MooncakeTransport | None
    send_timeout: float
    threads: trio.CapacityLimiter  # inline bodies built off the event loop
    # SGLang's destinations and sizes, which may come before their /encode.
    rendezvous: Rendezvous = dataclasses.field(default_factory=Rendezvous)
    # vLLM's shared-storage directory (ECExampleConnector's shared_storage_path); None: no vLLM face.
    vllm_storage: str | None = None
    # The control plane of vLLM's ECMooncakeConnector consumers; None: not that connector.
    vllm_control: EcControl | None = None

    def statistics(self) -> dict[str, Any]:
        """Each transport's statistics by name, for ``/stats`` (None: not opened)."""
        control = self.vllm_control
        return {"zmq": dataclasses.asdict(self.zmq.statistics()),
                "mooncake": dataclasses.asdict(self.mooncake.statistics()) if self.mooncake else None,
                "sglang_rendezvous": dataclasses.asdict(self.rendezvous.statistics()),
                "vllm_ec": dataclasses.asdict(control.statistics()) if control else None}


DeliveryFactory = Callable[[EncodeRequest, DeliveryContext], Delivery]


@contextmanager
def map_exceptions(mapping: Mapping[type[Exception], type[EPDError]], what: str) -> Iterator[None]:
    """Re-raise a transport's exception as the ``epd_trio.errors`` class it maps to.

    Our own errors pass through; an exception not in ``mapping`` is a bug and
    is left alone (the lifecycle turns it into a logged 500).
    """
    try:
        yield
    except EPDError:
        raise
    except Exception as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                raise target(f"{what}: {type(exc).__name__}: {exc}") from exc
        raise


@asynccontextmanager
async def fan_out() -> AsyncIterator[trio.Nursery]:
    """A nursery for sends to several destinations at once (a child task each).

    The first failure is the one raised (the others are logged, ``first_leaf``);
    a bug is not an ``EPDError`` and leaves as it is.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except* EPDError as group:
        raise first_leaf(group) from None


async def push(sockets: PushSocketCache, endpoint: str, frames: Sequence[Any], timeout: float,
               what: str = "ZMQ send") -> None:
    """One ZMQ message to ``endpoint`` through the encoder's socket cache, errors typed."""
    with map_exceptions(TRANSPORT_ERRORS, f"{what} to {endpoint}"):
        await sockets.send(endpoint, frames, timeout)
