"""The encoder's HTTP face (quart-trio): parse, call the service, shape the answer.

Handlers stay thin: bodies are validated by ``epd_trio.protocol.requests``,
work is done by ``EncoderService``, and every error — ours, Quart's (404, 405,
413) or a bug — leaves as the protocol's JSON error shape with the status from
``epd_trio.errors.http_status``. Never a traceback, never HTML.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from epd_trio._version import __version__
from epd_trio.encoder.service import EncoderService
from epd_trio.encoder.staging import SendOrder
from epd_trio.errors import EPDError, PayloadTooLargeError, error_body, http_status
from epd_trio.protocol.codec import encode_safetensors
from epd_trio.protocol.requests import (
    parse_abort_request,
    parse_encode_request,
    parse_json_body,
    parse_send_request,
)

__all__ = ["create_app"]

log = logging.getLogger(__name__)

SAFETENSORS_MIME = "application/vnd.safetensors"


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _error(exc: BaseException, req_id: str | None = None) -> Response:
    return _json(error_body(exc, req_id), http_status(exc))


async def _body() -> dict[str, Any]:
    return parse_json_body(await request.get_data(cache=False))


def _peek_req_id(body: dict[str, Any]) -> str | None:
    value = body.get("req_id")
    return value if isinstance(value, str) and len(value) <= 256 else None


def create_app(service: EncoderService) -> QuartTrio:
    """One app per service: no module-level state."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = service.config.request_timeout
    _routes(app, service)
    _error_handlers(app)
    return app


def _routes(app: QuartTrio, service: EncoderService) -> None:
    @app.post("/encode")
    async def encode() -> Response:
        body = await _body()
        try:
            req = parse_encode_request(body, max_items=service.config.max_items)
            answer = await service.encode(req)
        except EPDError as exc:
            return _error(exc, _peek_req_id(body))
        if req.deliver.backend == "inline":
            data = encode_safetensors(answer.embedding, {
                "req_id": req.req_id, "part_idx": req.part_idx, "num_parts": req.num_parts,
                "modality": answer.modality, "token_counts": answer.token_counts,
                "grid_thw": answer.grid_thw})
            return Response(data, status=200, mimetype=SAFETENSORS_MIME)
        meta = dataclasses.asdict(answer.meta())
        if req.deliver.backend == "mooncake":
            meta["nbytes"] = answer.nbytes
        return _json(meta)

    @app.post("/send")
    async def send() -> Response:
        body = await _body()
        try:
            req = parse_send_request(body)
            order = SendOrder(req.session, req.buffer_address, req.buffer_length)
            nbytes = await service.send(req.req_id, req.part_idx, order)
        except EPDError as exc:
            return _error(exc, _peek_req_id(body))
        return _json({"req_id": req.req_id, "part_idx": req.part_idx, "nbytes": nbytes})

    @app.post("/abort")
    async def abort() -> Response:
        req = parse_abort_request(await _body())
        return _json({"req_id": req.req_id, "aborted": service.abort(req.req_id, req.part_idx)})

    @app.get("/health")
    async def health() -> Response:
        if service.draining:
            return _json({"status": "draining"}, 503)
        report = await service.health.check()
        status = "ok" if report.healthy else "unhealthy"
        return _json({"status": status, "probed": report.probed, "detail": report.detail},
                     200 if report.healthy else 503)

    @app.get("/model_info")
    async def model_info() -> Response:
        info = dataclasses.asdict(service.engine.model_info)
        return _json({**info, "modalities": list(info["modalities"]), "version": __version__})

    @app.get("/stats")
    async def stats() -> Response:
        return _json(service.statistics())


def _error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(EPDError)
    async def epd_error(exc: EPDError) -> Response:
        return _error(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        if exc.code == 413:
            # The body was refused unread: the connection cannot carry another
            # request (its leftover bytes would be taken for one), so close it.
            response = _error(PayloadTooLargeError("request body is over the size limit"))
            response.headers["Connection"] = "close"
            return response
        body = {"error": {"type": exc.name.replace(" ", ""), "message": exc.description or exc.name},
                "req_id": None}
        return _json(body, exc.code or 500)

    @app.errorhandler(Exception)
    async def bug(exc: Exception) -> Response:
        log.exception("unhandled error in a handler")
        return _error(exc)
