"""What every HTTP face of the encoder shares, whichever protocol it speaks.

A face module (``app``: protocol v1, ``sglang_app``, ``vllm_app``) builds its
app from these parts and its own routes; this module knows no face, and no
face imports another:

- ``quart_app``: the face's Quart app, under ``--max-body-bytes`` and
  ``--request-timeout`` for a body, with the admin token checked before any
  body is read (``access_control``);
- ``add_shared_routes``: what every face serves the same way (``/abort``,
  ``/model_info``, ``/stats``, ``/metrics``);
- ``bare_routes``: the data path's routes served in front of Quart
  (``encoder.asgi_route`` says why), under the face's limits, token rule and
  error shape;
- ``JsonBodies``: JSON bodies, a large one parsed on a worker thread under
  the faces' own limiter (never the deliveries' threads, which build inline
  answers and write files: a burst of large bodies must neither wait behind
  them nor hold them up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final

import trio
from quart import Response, request
from quart_trio import QuartTrio

from epd_trio._http import BearerAuth, face_error_reply, json_response, parse_json_off_loop
from epd_trio._version import __version__
from epd_trio.config import EncoderConfig
from epd_trio.encoder.asgi_route import BareRoutes, ErrorReply, Handler, RouteLimits
from epd_trio.encoder.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from epd_trio.encoder.service import EncoderService
from epd_trio.protocol.requests import parse_abort_request, parse_json_body

__all__ = ["ADMIN_PATHS", "JSON_THREADS", "JsonBodies", "access_control", "add_shared_routes",
           "bare_routes", "quart_app"]

# Admin endpoints need the auth token whenever one is configured. The data path's routes
# (bare_routes) need it only with --require-auth-for-encode, and never reach Quart.
ADMIN_PATHS: Final = frozenset({"/abort", "/start_profile", "/stop_profile"})

# Large JSON bodies parsed at once, each on a worker thread (each holds its body's parse).
JSON_THREADS: Final = 2

JsonParser = Callable[[bytes], dict[str, Any]]


class JsonBodies:
    """One face's JSON bodies: parsed on the trio thread when small, on a worker thread under
    this face's own limiter from ``_http.OFFLOAD_BODY_BYTES`` on."""

    def __init__(self, threads: int = JSON_THREADS) -> None:
        self.threads = trio.CapacityLimiter(threads)

    async def parse(self, raw: bytes, parse: JsonParser = parse_json_body) -> dict[str, Any]:
        """``parse(raw)``: a JSON object, or a ``RequestError`` (400)."""
        return await parse_json_off_loop(raw, self.threads, parse)

    async def of_request(self, parse: JsonParser = parse_json_body) -> dict[str, Any]:
        """The body of the Quart request being handled, parsed."""
        return await self.parse(await request.get_data(cache=False, as_text=False, parse_form_data=False), parse)

    def __repr__(self) -> str:
        return f"<JsonBodies {self.threads.borrowed_tokens}/{self.threads.total_tokens} threads busy>"


def quart_app(import_name: str, config: EncoderConfig) -> QuartTrio:
    """A face's Quart app: the body limits and the admin token (one app per service: no
    module-level state)."""
    app = QuartTrio(import_name)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["BODY_TIMEOUT"] = config.request_timeout
    access_control(app, config)
    return app


def access_control(app: QuartTrio, config: EncoderConfig) -> None:
    """The admin token, checked before any body is read (every face). The head-size limit is
    checked for every route in front of Quart (``BareRoutes``)."""
    auth = BearerAuth(config.auth_token)

    @app.before_request
    async def check_token() -> None:
        # Before the handler, so an unauthenticated request's body is never read or parsed.
        if request.path in ADMIN_PATHS:
            auth.check(request.headers.get("Authorization"), request.path)


def bare_routes(app: QuartTrio, config: EncoderConfig, routes: Mapping[str, Handler],
                error_reply: ErrorReply = face_error_reply) -> BareRoutes:
    """``routes`` in front of ``app``, under the face's limits, token rule and error shape."""
    limits = RouteLimits(max_body_bytes=config.max_body_bytes, max_header_bytes=config.max_header_bytes,
                         body_timeout=config.request_timeout)
    auth = BearerAuth(config.auth_token) if config.require_auth_for_encode else None
    return BareRoutes(app, routes, limits=limits, auth=auth, error_reply=error_reply)


def add_shared_routes(app: QuartTrio, service: EncoderService, bodies: JsonBodies) -> None:
    """What every face serves the same way: /abort, /model_info, /stats, /metrics."""

    @app.post("/abort")
    async def abort() -> Response:
        req = parse_abort_request(await bodies.of_request())
        result = await service.abort(req.req_id, req.part_idx)
        return json_response({"req_id": req.req_id, "aborted": result.aborted, "released": result.released})

    @app.get("/model_info")
    async def model_info() -> Response:
        info = dataclasses.asdict(service.model_info)
        layout = [{"name": name, "width": width} for name, width in info["embedding_layout"]]
        return json_response({**info, "modalities": list(info["modalities"]),
                              "embedding_layout": layout, "version": __version__})

    @app.get("/stats")
    async def stats() -> Response:
        return json_response(service.statistics())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), status=200, content_type=METRICS_CONTENT_TYPE)
