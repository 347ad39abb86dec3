"""The encoder's HTTP face (quart-trio): parse, call the service, shape the answer.

Handlers stay thin: bodies are validated by ``epd_trio.protocol.requests``,
work is done by ``EncoderService``, and every error — ours, Quart's (404, 405,
413) or a bug — leaves as the protocol's JSON error shape with the status from
``epd_trio.errors.http_status``. Never a traceback, never HTML. ``POST /encode``
and ``/send``, the data path, are served in front of Quart as bare ASGI
(``encoder.asgi_route`` says why), under the same limits and token.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from epd_trio._http import (
    BearerAuth,
    Reply,
    error_reply,
    face_error_reply,
    install_error_handlers,
    json_reply,
    json_response,
    parse_json_off_loop,
)
from epd_trio._version import __version__
from epd_trio.encoder.asgi_route import (BareRoutes, ErrorReply, Handler, RouteLimits, UntilGone,
                                         cancelled_when_gone)
from epd_trio.encoder.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from epd_trio.encoder.profiling import parse_profile_request
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import EPDError
from epd_trio.protocol.requests import (
    parse_abort_request,
    parse_encode_request,
    parse_json_body,
    parse_send_request,
)

__all__ = ["access_control", "add_shared_routes", "bare_routes", "create_app", "encode_handler",
           "send_handler"]

log = logging.getLogger(__name__)

SAFETENSORS_MIME = "application/vnd.safetensors"


async def _body(threads: trio.CapacityLimiter) -> dict[str, Any]:
    return await parse_json_off_loop(await request.get_data(cache=False), threads)


def _peek_req_id(body: dict[str, Any]) -> str | None:
    value = body.get("req_id")
    return value if isinstance(value, str) and len(value) <= 256 else None


def create_app(service: EncoderService) -> BareRoutes:
    """One app per service: no module-level state."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = service.config.request_timeout
    access_control(app, service.config)
    _routes(app, service)
    add_shared_routes(app, service)
    install_error_handlers(app, "encoder")
    return bare_routes(app, service.config, {"/encode": encode_handler(service),
                                             "/send": send_handler(service)})


def bare_routes(app: QuartTrio, config: Any, routes: dict[str, Handler],
                error_reply: ErrorReply = face_error_reply) -> BareRoutes:
    """``routes`` in front of ``app``, under the face's limits, token rule and error shape."""
    limits = RouteLimits(max_body_bytes=config.max_body_bytes, max_header_bytes=config.max_header_bytes,
                         body_timeout=config.request_timeout)
    auth = BearerAuth(config.auth_token) if config.require_auth_for_encode else None
    return BareRoutes(app, routes, limits=limits, auth=auth, error_reply=error_reply)


def encode_handler(service: EncoderService) -> Handler:
    """``POST /encode``: the raw body in, the embedding (inline) or its description out."""

    async def encode(raw: bytes, until_gone: UntilGone) -> Reply:
        body: dict[str, Any] = {}
        try:
            body = await parse_json_off_loop(raw, service.deliveries.threads)
            req = parse_encode_request(body, max_items=service.config.max_items)
        except EPDError as exc:
            service.metrics.request("unknown", exc)  # the body's modality is not to be trusted
            return error_reply(exc, _peek_req_id(body))
        try:
            answer = await service.encode(req, until_gone=until_gone)
        except EPDError as exc:
            return error_reply(exc, _peek_req_id(body))
        if answer.body is not None:  # the embedding is the answer (inline)
            return Reply(200, answer.body, SAFETENSORS_MIME)
        meta = answer.meta.to_json()
        if answer.nbytes is not None:  # the receiver pulls it later (Mooncake): reserve this much
            meta["nbytes"] = answer.nbytes
        return json_reply(meta)

    return encode


# Admin endpoints need the auth token whenever one is configured. The data path's routes
# (bare_routes) need it only with --require-auth-for-encode, and never reach Quart.
ADMIN_PATHS = frozenset({"/abort", "/start_profile", "/stop_profile"})


def access_control(app: QuartTrio, config: Any) -> None:
    """The admin token, checked before any body is read (both faces). The head-size limit is
    checked for every route in front of Quart (``BareRoutes``)."""
    auth = BearerAuth(config.auth_token)

    @app.before_request
    async def check_token() -> None:
        # Before the handler, so an unauthenticated request's body is never read or parsed.
        if request.path in ADMIN_PATHS:
            auth.check(request.headers.get("Authorization"), request.path)


def send_handler(service: EncoderService) -> Handler:
    """``POST /send``: a Mooncake receiver's order for its copy; the bytes written."""

    async def send(raw: bytes) -> Reply:
        body = await parse_json_off_loop(raw, service.deliveries.threads)
        try:
            req = parse_send_request(body)
            nbytes = await service.send(req.req_id, req.part_idx, session=req.session,
                                        address=req.buffer_address, length=req.buffer_length)
        except EPDError as exc:
            return error_reply(exc, _peek_req_id(body))
        return json_reply({"req_id": req.req_id, "part_idx": req.part_idx, "nbytes": nbytes})

    return cancelled_when_gone(send)


def _routes(app: QuartTrio, service: EncoderService) -> None:
    @app.get("/health")
    async def health() -> Response:
        report = await service.check_health()
        if report.status == "draining":
            return json_response({"status": "draining"}, 503)
        body = {"status": report.status, "probed": report.probed, "detail": report.detail}
        if report.dead_workers:
            body["dead_workers"] = list(report.dead_workers)
        return json_response(body, 200 if report.healthy else 503)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        raw = await request.get_data(cache=False)
        output_dir, num_steps = parse_profile_request(parse_json_body(raw) if raw.strip() else {})
        target = service.profiler.start(output_dir, num_steps)
        return json_response({"status": "started", "output_dir": str(target), "num_steps": num_steps})

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        trace = await service.profiler.stop()
        return json_response({"status": "stopped", "trace": str(trace)})


def add_shared_routes(app: QuartTrio, service: EncoderService) -> None:
    """What every face serves the same way: /abort, /model_info, /stats, /metrics."""

    @app.post("/abort")
    async def abort() -> Response:
        req = parse_abort_request(await _body(service.deliveries.threads))
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
