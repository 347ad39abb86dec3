"""Moving embeddings between processes: trio-native ZMQ (Mooncake and inline apart)."""

from epd_trio.transport.zmq import (
    PullReceiver,
    PullStatistics,
    PushCacheStatistics,
    PushSocketCache,
    TrioSocket,
    validate_endpoint,
)

__all__ = [
    "PullReceiver",
    "PullStatistics",
    "PushCacheStatistics",
    "PushSocketCache",
    "TrioSocket",
    "validate_endpoint",
]
