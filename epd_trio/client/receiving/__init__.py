"""Receivers: how parts come back to the client, one transfer backend per module.

``RECEIVERS`` is the registration table: ``ClientConfig.transfer_backend``
names the class the client holds. Adding a backend on this side is one module
(a ``Receiver`` subclass: ``deliver_for``, ``take``, ``gather``, and, where it
owns resources or writes in place, ``_open`` and ``release_failed``) and one
line here; ``EncoderClient`` never names a backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from epd_trio.client.pool import EmbeddingPool
from epd_trio.client.receiving.base import (
    CopyingReceiver,
    Receiver,
    ReceiverStatistics,
    Settle,
)
from epd_trio.client.receiving.inline import InlineReceiver
from epd_trio.client.receiving.mooncake import MooncakeReceiver
from epd_trio.client.receiving.zmq import ZmqReceiver
from epd_trio.config import ClientConfig

__all__ = [
    "RECEIVERS",
    "CopyingReceiver",
    "InlineReceiver",
    "MooncakeReceiver",
    "Receiver",
    "ReceiverStatistics",
    "ZmqReceiver",
    "build_receiver",
]

RECEIVERS: Mapping[str, type[Receiver]] = MappingProxyType({
    "inline": InlineReceiver,
    "zmq": ZmqReceiver,
    "mooncake": MooncakeReceiver,
})


def build_receiver(config: ClientConfig, pool: EmbeddingPool, settle: Settle) -> Receiver:
    """The receiver ``config.transfer_backend`` names (built, not yet open)."""
    cls = RECEIVERS.get(config.transfer_backend)
    if cls is None:  # ClientConfig refuses other names; a table out of step with it is a bug
        raise ValueError(f"no receiver for transfer_backend {config.transfer_backend!r}"
                         f" (known: {', '.join(RECEIVERS)})")
    return cls(config, pool, settle)
