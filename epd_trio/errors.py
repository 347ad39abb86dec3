"""The one error tree of epd_trio; every class knows its HTTP status.

::

    EPDError (500)                     root: anything epd_trio raises on purpose
    ├── RequestError (400)             the caller sent something we cannot encode
    │   ├── UnauthorizedError (401)
    │   ├── UnknownRequestError (404)
    │   ├── BodyTimeoutError (408)     the request body did not arrive in time
    │   ├── ConflictError (409)        the server is in the wrong state for it
    │   │   └── DuplicateRequestError (409)
    │   ├── FetchRefusedError (400)   a media URL the fetch rules refuse; nothing was fetched
    │   ├── PayloadTooLargeError (413)
    │   └── HeadersTooLargeError (431)
    ├── OverloadedError (503)          admission refused: queue full
    │   └── NotReadyError (503)        starting, draining, or the worker is gone
    │       └── DrainingError (503)    refused at admission while draining: not taken at all
    ├── DeadlineExceeded (504)         a request's own deadline passed
    │   └── EncodeTimeout (504)        the receiver gave up waiting for a part
    ├── TransportError (502)           delivering bytes between processes failed
    │   ├── TransferTimeout (504)
    │   ├── PeerUnavailable (503)      the peer is down or unreachable (Broken)
    │   └── ProtocolError (502)        the peer sent something that breaks the protocol
    ├── AbortedError (499)             cancelled by /abort or by its client leaving
    ├── EncodeError (500)              the forward (or an encoder we called) failed
    ├── WorkerDeadError (503)          the device worker died; its requests fail
    └── ModelLoadError (500)           the checkpoint cannot be served (start-up)

HTTP status mapping lives here only: ``http_status(exc)``; the gRPC status
(``grpc_status_name(exc)``) is derived from it in one table, ``GRPC_STATUS``.
Anything that is not an ``EPDError`` is a bug and maps to 500 (``INTERNAL``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = [
    "AbortedError",
    "BodyTimeoutError",
    "ConflictError",
    "DeadlineExceeded",
    "DrainingError",
    "DuplicateRequestError",
    "EPDError",
    "EncodeError",
    "EncodeTimeout",
    "FetchRefusedError",
    "GRPC_STATUS",
    "HeadersTooLargeError",
    "ModelLoadError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PeerUnavailable",
    "ProtocolError",
    "RequestError",
    "TransferTimeout",
    "TransportError",
    "UnauthorizedError",
    "UnknownRequestError",
    "WorkerDeadError",
    "error_body",
    "grpc_status_name",
    "http_status",
]


class EPDError(Exception):
    """Root of every error epd_trio raises on purpose."""

    status_code: int = 500

    def __init__(self, message: str, *, req_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.req_id = req_id

    @property
    def type_name(self) -> str:
        return type(self).__name__


class RequestError(EPDError):
    """Bad input: the same request will never succeed."""

    status_code = 400


class UnauthorizedError(RequestError):
    status_code = 401


class UnknownRequestError(RequestError):
    status_code = 404


class BodyTimeoutError(RequestError):
    status_code = 408


class ConflictError(RequestError):
    """The request conflicts with the server's state (a profile already running, say)."""

    status_code = 409


class DuplicateRequestError(ConflictError):
    status_code = 409


class FetchRefusedError(RequestError):
    """A media URL (or a redirect hop) the fetch rules refuse, before any connection to it."""

    status_code = 400


class PayloadTooLargeError(RequestError):
    status_code = 413


class HeadersTooLargeError(RequestError):
    status_code = 431


class OverloadedError(EPDError):
    """Admission refused; retrying later (or elsewhere) may succeed."""

    status_code = 503


class NotReadyError(OverloadedError):
    status_code = 503


class DrainingError(NotReadyError):
    """A request refused at admission because the encoder drains for shutdown: it was never
    taken, so a client may send it to another encoder as it is."""

    status_code = 503


class DeadlineExceeded(EPDError):
    status_code = 504


class EncodeTimeout(DeadlineExceeded):
    status_code = 504


class TransportError(EPDError):
    status_code = 502


class TransferTimeout(TransportError):
    status_code = 504


class PeerUnavailable(TransportError):
    status_code = 503


class ProtocolError(TransportError):
    status_code = 502


class AbortedError(EPDError):
    """The request was cancelled on purpose (``/abort``, client disconnect)."""

    status_code = 499  # "client closed request": nobody is waiting for a real answer


class EncodeError(EPDError):
    """The forward failed, or a remote encoder reported a failure."""

    status_code = 500

    def __init__(
        self, message: str, *, req_id: str | None = None, status_code: int | None = None
    ) -> None:
        super().__init__(message, req_id=req_id)
        if status_code is not None:
            self.status_code = status_code


class WorkerDeadError(EPDError):
    status_code = 503


class ModelLoadError(EPDError):
    status_code = 500


def http_status(exc: BaseException) -> int:
    """The HTTP status for ``exc``; anything unplanned is a bug (500)."""
    if isinstance(exc, EPDError):
        return exc.status_code
    return 500


def error_body(exc: BaseException, req_id: str | None = None) -> dict[str, object]:
    """The JSON error shape of the wire protocol; never a traceback."""
    if isinstance(exc, EPDError):
        kind, message = exc.type_name, exc.message
        req_id = req_id if req_id is not None else exc.req_id
    else:
        kind, message = "InternalError", "internal error in the encoder"
    return {"error": {"type": kind, "message": message}, "req_id": req_id}


# HTTP status → gRPC status code name (``grpc.StatusCode[name]``); anything else is INTERNAL.
# 413 and 431 (a body, media or head over a limit) are RESOURCE_EXHAUSTED, the code grpcio itself
# gives a message over its size limit, so a caller sees one code for "too large" either way.
GRPC_STATUS: Final[Mapping[int, str]] = MappingProxyType({
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
    409: "ALREADY_EXISTS",
    413: "RESOURCE_EXHAUSTED", 431: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
})


def grpc_status_name(exc: BaseException) -> str:
    """The gRPC status code name for ``exc`` (derived from its HTTP status, one table)."""
    return GRPC_STATUS.get(http_status(exc), "INTERNAL")
