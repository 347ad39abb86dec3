"""epd_trio: a multimodal encoder service for EPD disaggregated LLM serving, on trio.

This module is the public API; everything else is private to the package.
"""

from epd_trio.config import EngineConfig
from epd_trio.engine import EncodeOutput, Engine, EngineStatistics, ModelInfo, open_engine
from epd_trio.errors import (
    DeadlineExceeded,
    DuplicateRequestError,
    EncodeError,
    EncodeTimeout,
    EPDError,
    ModelLoadError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    PeerUnavailable,
    ProtocolError,
    RequestError,
    TransferTimeout,
    TransportError,
    UnauthorizedError,
    UnknownRequestError,
    WorkerDeadError,
)
from epd_trio.model.tiny import TinySpec, make_tiny_model

__version__ = "0.1.0"

__all__ = [
    "DeadlineExceeded",
    "DuplicateRequestError",
    "EPDError",
    "EncodeError",
    "EncodeOutput",
    "EncodeTimeout",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "ModelInfo",
    "ModelLoadError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PeerUnavailable",
    "ProtocolError",
    "RequestError",
    "TinySpec",
    "TransferTimeout",
    "TransportError",
    "UnauthorizedError",
    "UnknownRequestError",
    "WorkerDeadError",
    "make_tiny_model",
    "open_engine",
]
