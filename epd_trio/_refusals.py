"""What the HTTP edge refuses before any app sees a request, and the answers the servers give
of their own, in the protocol's JSON error shape (``epd_trio.errors``: the one status mapping).

Refused, closing the connection (the body is not read, so nothing after it can be trusted):

* ``Content-Length`` with ``Transfer-Encoding`` (RFC 9112 6.1: a smuggling shape; the server
  "MUST close the connection after responding"), however the coding is spelled;
* a method name with lower-case letters (``head`` is not ``HEAD``: names are case-sensitive,
  RFC 9110 9.1, and serving one as the other breaks the answer's framing);
* an HTTP version other than 1.0 and 1.1 (``PRI * HTTP/2.0``: HTTP/2 is not served).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import h11

from epd_trio.errors import HeadersTooLargeError, RequestError, error_body, http_status

__all__ = ["error_answer", "framing_error", "refusal"]

_VERSIONS = frozenset({b"1.0", b"1.1"})


def refusal(method: bytes, http_version: bytes, headers: Iterable[tuple[bytes, bytes]]) -> RequestError | None:
    """The error a request head earns before any app runs, or None (header names in lower case)."""
    if http_version not in _VERSIONS:
        return RequestError(f"HTTP/{http_version.decode('latin-1')} is not served here (HTTP/1.1 only)")
    if method != method.upper():
        return RequestError(f"unknown method {method.decode('latin-1')!r} (method names are case-sensitive)")
    names = {name for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return RequestError("a request may not have both Content-Length and Transfer-Encoding")
    return None


def framing_error(exc: h11.RemoteProtocolError, max_header_bytes: int, *, body: bool) -> RequestError:
    """The 4xx for a head or body that breaks HTTP/1.1's framing (h11's refusal)."""
    if exc.error_status_hint == 431:  # a head, or a chunk header, over the limit
        what = "a chunk header" if body else "request head"
        return HeadersTooLargeError(f"{what} is over {max_header_bytes} bytes")
    return RequestError(f"malformed HTTP request{' body' if body else ''}: {exc}")


def error_answer(exc: BaseException) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` of the protocol's JSON error for ``exc``, closing the connection."""
    body = json.dumps(error_body(exc)).encode()
    return http_status(exc), [(b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode()), (b"connection", b"close")], body
