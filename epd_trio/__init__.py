"""epd_trio: a multimodal encoder service for EPD disaggregated LLM serving, on trio.

This module is the public API; everything else is private to the package.
"""

from epd_trio._version import __version__
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, run_encoder, serve_encoder
from epd_trio.engine import EncodeOutput, Engine, EngineStatistics, ModelInfo, open_engine
from epd_trio.errors import (
    AbortedError,
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

__all__ = [
    "AbortedError",
    "DeadlineExceeded",
    "DuplicateRequestError",
    "EPDError",
    "EncodeError",
    "EncodeOutput",
    "EncodeTimeout",
    "EncoderConfig",
    "EncoderServer",
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
    "run_encoder",
    "serve_encoder",
]
