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

and ``aclose()`` exactly once, when the scope that owns it is released.
Building a delivery acquires nothing, so one refused before admission is
simply dropped.

Every delivery maps its transport's exceptions into ``epd_trio.errors``
inside itself (``map_exceptions``, as httpcore does), so no transport error
reaches a face as a 500.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import trio

from epd_trio.errors import EPDError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

from epd_trio.delivery.sglang_rendezvous import Rendezvous

if TYPE_CHECKING:
    from epd_trio.delivery.vllm_mooncake import EcControl
    from epd_trio.transport.mooncake import MooncakeTransport
    from epd_trio.transport.zmq import PushSocketCache

__all__ = [
    "Answer",
    "Delivery",
    "DeliveryContext",
    "DeliveryFactory",
    "PulledDelivery",
    "first_error",
    "map_exceptions",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """What a face turns into its response; a request gives exactly one.

    ``body`` is set when the embedding travels in the answer itself (inline),
    ``nbytes`` when the receiver pulls it later and must reserve that much.
    """

    meta: EncodeMeta
    embedding: Any = None  # torch.Tensor [tokens, dim]; None in an early answer
    body: bytes | None = None
    nbytes: int | None = None


@runtime_checkable
class Delivery(Protocol):
    """Where one request's embedding goes (see the module docstring)."""

    def sized(self, meta: EncodeMeta) -> Answer | None: ...

    async def deliver(self, embedding: Any, meta: EncodeMeta) -> Answer: ...

    async def fail(self, error: EPDError) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class PulledDelivery(Delivery, Protocol):
    """A delivery its receivers pull: each posts an order (``/send``) for its copy.

    It writes into the receivers' memory, so ``/abort`` waits until it has let go.
    ``order`` carries what a protocol adds to an order (SGLang: where to send
    the completion notice, and how many receivers there are).
    """

    async def take_order(self, session: str, address: int, length: int, **order: Any) -> int: ...


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


def first_error(group: BaseExceptionGroup[EPDError]) -> EPDError:
    """The first error of a group of child-task failures; the others are logged, not dropped."""
    leaves: list[EPDError] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        else:
            leaves.append(exc)  # type: ignore[arg-type]  # split by ``except* EPDError``

    walk(group)
    for sibling in leaves[1:]:
        log.info("also failed: %s: %s", type(sibling).__name__, sibling)
    return leaves[0]
