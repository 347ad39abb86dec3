"""epd_trio: a multimodal encoder service for EPD disaggregated LLM serving, on trio.

This module is the public API; everything else is private to the package.
The configuration and the errors load with it; the rest (which imports torch and
transformers: seconds) on first use, so that ``epd-trio`` starts watching for
SIGTERM before those imports, and a program that only needs the errors stays light.
"""

import importlib as _importlib
import typing as _typing

from epd_trio._version import __version__ as __version__  # re-exported
from epd_trio.config import BootstrapConfig, ClientConfig, EncoderConfig, EngineConfig, ProxyConfig
from epd_trio.errors import (
    AbortedError,
    ConflictError,
    DeadlineExceeded,
    DrainingError,
    DuplicateRequestError,
    EncodeError,
    EncodeTimeout,
    EPDError,
    FetchRefusedError,
    HeadersTooLargeError,
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

if _typing.TYPE_CHECKING:
    from epd_trio.bootstrap.server import BootstrapServer, run_bootstrap, serve_bootstrap
    from epd_trio.client import (
        EmbeddingPool,
        EncodedRequest,
        EncoderClient,
        ItemEmbedding,
        RemoteEncodeError,
        open_encoder_client,
    )
    from epd_trio.encoder.server import EncoderServer, run_encoder, serve_encoder
    from epd_trio.engine import EncodeOutput, Engine, EngineStatistics, ModelInfo, open_engine
    from epd_trio.model.tiny import TinySpec, make_tiny_model
    from epd_trio.proxy import ProxyServer, serve_proxy

_LAZY = {
    **dict.fromkeys(("BootstrapServer", "run_bootstrap", "serve_bootstrap"), "epd_trio.bootstrap.server"),
    **dict.fromkeys(("EmbeddingPool", "EncodedRequest", "EncoderClient", "ItemEmbedding",
                     "RemoteEncodeError", "open_encoder_client"), "epd_trio.client"),
    **dict.fromkeys(("EncoderServer", "run_encoder", "serve_encoder"), "epd_trio.encoder.server"),
    **dict.fromkeys(("EncodeOutput", "Engine", "EngineStatistics", "ModelInfo", "open_engine"),
                    "epd_trio.engine"),
    **dict.fromkeys(("TinySpec", "make_tiny_model"), "epd_trio.model.tiny"),
    **dict.fromkeys(("ProxyServer", "serve_proxy"), "epd_trio.proxy"),
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'epd_trio' has no attribute {name!r}")
    return getattr(_importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AbortedError",
    "BootstrapConfig",
    "BootstrapServer",
    "ClientConfig",
    "ConflictError",
    "DeadlineExceeded",
    "DrainingError",
    "DuplicateRequestError",
    "EPDError",
    "EmbeddingPool",
    "EncodeError",
    "EncodeOutput",
    "EncodeTimeout",
    "EncodedRequest",
    "EncoderClient",
    "EncoderConfig",
    "EncoderServer",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "FetchRefusedError",
    "HeadersTooLargeError",
    "ItemEmbedding",
    "ModelInfo",
    "ModelLoadError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PeerUnavailable",
    "ProtocolError",
    "ProxyConfig",
    "ProxyServer",
    "RemoteEncodeError",
    "RequestError",
    "TinySpec",
    "TransferTimeout",
    "TransportError",
    "UnauthorizedError",
    "UnknownRequestError",
    "WorkerDeadError",
    "make_tiny_model",
    "open_encoder_client",
    "open_engine",
    "run_bootstrap",
    "run_encoder",
    "serve_bootstrap",
    "serve_encoder",
    "serve_proxy",
]
