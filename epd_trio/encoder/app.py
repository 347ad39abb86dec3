"""The encoder's native HTTP face (protocol v1, quart-trio): parse, call the service, shape the answer.

Handlers stay thin: bodies are validated by ``epd_trio.protocol.requests``,
work is done by ``EncoderService``, and every error — ours, Quart's (404, 405,
413) or a bug — leaves as the protocol's JSON error shape with the status from
``epd_trio.errors.http_status``. Never a traceback, never HTML. ``POST /encode``
and ``/send``, the data path, are served in front of Quart as bare ASGI
(``encoder.asgi_route`` says why), under the same limits and token; what every
HTTP face shares (the admin token, ``/abort``, ``/model_info``, ``/stats``,
``/metrics``, JSON bodies) is ``encoder.http_face``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from epd_trio._http import Reply, error_reply, install_error_handlers, json_reply, json_response
from epd_trio.encoder.asgi_route import BareRoutes, Handler, UntilGone, cancelled_when_gone
from epd_trio.encoder.http_face import JsonBodies, add_shared_routes, bare_routes, quart_app
from epd_trio.encoder.profiling import parse_profile_request
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import EPDError
from epd_trio.protocol.requests import (
    parse_encode_request,
    parse_json_body,
    parse_send_request,
)

__all__ = ["create_app", "encode_handler", "send_handler"]

log = logging.getLogger(__name__)

SAFETENSORS_MIME = "application/vnd.safetensors"


def _peek_req_id(body: dict[str, Any]) -> str | None:
    value = body.get("req_id")
    return value if isinstance(value, str) and len(value) <= 256 else None


def create_app(service: EncoderService) -> BareRoutes:
    """One app per service: no module-level state."""
    app, bodies = quart_app(__name__, service.config), JsonBodies()
    _routes(app, service)
    add_shared_routes(app, service, bodies)
    install_error_handlers(app, "encoder")
    return bare_routes(app, service.config, {"/encode": encode_handler(service, bodies),
                                             "/send": send_handler(service, bodies)})


def encode_handler(service: EncoderService, bodies: JsonBodies) -> Handler:
    """``POST /encode``: the raw body in, the embedding (inline) or its description out."""

    async def encode(raw: bytes, until_gone: UntilGone) -> Reply:
        body: dict[str, Any] = {}
        try:
            with service.parsing():
                body = await bodies.parse(raw)
                req = parse_encode_request(body, max_items=service.config.max_items)
        except EPDError as exc:
            return error_reply(exc, _peek_req_id(body))
        try:
            answer = await service.encode(req, until_gone=until_gone)
        except EPDError as exc:
            return error_reply(exc, _peek_req_id(body))
        if answer.body is not None:  # the embedding travels in the answer
            return Reply(200, answer.body, SAFETENSORS_MIME)
        meta = answer.meta.to_json()
        if answer.nbytes is not None:  # the receiver pulls it later: reserve this much
            meta["nbytes"] = answer.nbytes
        return json_reply(meta)

    return encode


def send_handler(service: EncoderService, bodies: JsonBodies) -> Handler:
    """``POST /send``: a pulling receiver's order for its copy; the bytes written."""

    async def send(raw: bytes) -> Reply:
        body = await bodies.parse(raw)
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
        body: dict[str, Any] = {"status": report.status, "probed": report.probed, "detail": report.detail}
        if report.dead_workers:
            body["dead_workers"] = list(report.dead_workers)
        return json_response(body, 200 if report.healthy else 503)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        output_dir, num_steps = parse_profile_request(parse_json_body(raw) if raw.strip() else {})
        target = service.profiler.start(output_dir, num_steps)
        return json_response({"status": "started", "output_dir": str(target), "num_steps": num_steps})

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        trace = await service.profiler.stop()
        return json_response({"status": "stopped", "trace": str(trace)})
