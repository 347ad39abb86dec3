"""The SGLang face (``--api sglang``): SGLang 0.5.23's encoder routes and bodies.

An unmodified SGLang language server (``--language-only --encoder-urls …``)
drives it exactly as it drives SGLang's own ``--encoder-only`` server:

- ``POST /encode`` — SGLang's body; answers JSON ``null`` once every
  destination has the part (zmq backends), or for mooncake the body without
  ``mm_items`` plus ``embedding_size``/``embedding_len``/``embedding_dim`` as
  soon as the sizes are known.
- ``POST /scheduler_receive_url`` — one rank's PULL endpoint for one part
  (zmq_to_scheduler), before or after its ``/encode``.
- ``POST /scheduler_receive_meta_data`` and ``POST /send`` — SGLang's
  Mooncake sequence: sizes (waiting until known), then one write per rank.
- ``/health`` and ``/health_generate`` (GET), ``/start_profile`` and
  ``/stop_profile`` (GET and POST); ``/abort``, ``/model_info``, ``/stats``
  and ``/metrics`` as the native face serves them.

Errors are SGLang's shape, ``{"status": "error", "message", "req_id"}``, with
the status from ``epd_trio.errors.http_status``. Thin like ``app.py``: bodies
are parsed by ``epd_trio.protocol.sglang_requests``, work is the service's
(the destinations and sizes its ``announce_receiver`` and ``part_sizes``
keep), and what every HTTP face shares is ``encoder.http_face``'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from epd_trio._http import Reply, as_response, install_error_handlers, json_reply, json_response, with_allow
from epd_trio.encoder.asgi_route import BareRoutes, Handler, UntilGone, cancelled_when_gone
from epd_trio.encoder.http_face import JsonBodies, add_shared_routes, bare_routes, quart_app
from epd_trio.encoder.profiling import parse_profile_request
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import EPDError, PayloadTooLargeError, error_body, http_status
from epd_trio.protocol.requests import parse_json_body
from epd_trio.protocol.sglang_requests import (
    parse_meta_request,
    parse_receive_url,
    parse_sglang_encode,
    parse_sglang_send,
)

__all__ = ["create_sglang_app", "sglang_error"]

# SGLang's ProfileReq fields this encoder reads; the others (activities, ...) are ignored.
_PROFILE_FIELDS = ("output_dir", "num_steps")


def sglang_error_reply(exc: BaseException, req_id: object = None) -> Reply:
    """SGLang's error body; the message is the same safe text as ours (never a traceback)."""
    if isinstance(exc, HTTPException):  # a framework's 404, 405, 413
        if exc.code == 413:  # refused unread: the connection cannot carry another request
            return sglang_error_reply(PayloadTooLargeError("request body is over the size limit")).closing()
        return with_allow(json_reply({"status": "error", "message": exc.description or exc.name,
                                      "req_id": None}, exc.code or 500), exc)
    message = error_body(exc)["error"]["message"]  # type: ignore[index]
    return json_reply({"status": "error", "message": message,
                       "req_id": req_id if isinstance(req_id, str) else None}, http_status(exc))


def sglang_error(exc: BaseException, req_id: object = None) -> Response:
    return as_response(sglang_error_reply(exc, req_id))


def _parse_body(raw: bytes) -> dict[str, Any]:
    """SGLang's routes may get no body, or ``null``: both mean ``{}``."""
    empty = len(raw) <= 16 and raw.strip() in (b"", b"null")  # never strips (copies) a large body
    return {} if empty else parse_json_body(raw)


def create_sglang_app(service: EncoderService) -> BareRoutes:
    """One app per service: no module-level state. The data path's routes are served in
    front of Quart, as the native face's are (``encoder.asgi_route``)."""
    app, bodies = quart_app(__name__, service.config), JsonBodies()
    _operation_routes(app, service, bodies)
    add_shared_routes(app, service, bodies)
    install_error_handlers(app, "SGLang-face", respond=sglang_error)
    return bare_routes(app, service.config, _data_routes(service, bodies), sglang_error_reply)


def encode_handler(service: EncoderService, bodies: JsonBodies) -> Handler:
    """SGLang's ``POST /encode``: its body in; null, or the sizes SGLang reserves, out."""
    config = service.config

    async def encode(raw: bytes, until_gone: UntilGone) -> Reply:
        body: dict[str, Any] = {}
        try:
            with service.parsing():
                body = await bodies.parse(raw, _parse_body)
                req = parse_sglang_encode(body, backend=config.encoder_transfer_backend,
                                          max_items=config.max_items)
        except EPDError as exc:
            return sglang_error_reply(exc, body.get("req_id"))
        try:
            answer = await service.encode(req, until_gone=until_gone)
        except EPDError as exc:
            return sglang_error_reply(exc, req.req_id)
        if answer.nbytes is None:
            return json_reply(None)  # every destination has the part
        echo = {k: v for k, v in body.items() if k not in ("mm_items", "time_stats_json")}
        return json_reply({**echo, "embedding_size": answer.nbytes,
                           "embedding_len": answer.meta.tokens, "embedding_dim": answer.meta.dim})

    return encode


def _data_route(bodies: JsonBodies, answer: Callable[[dict[str, Any]], Awaitable[Any]]) -> Handler:
    """A JSON route of the data path: ``answer(body)`` is the JSON answer, an error SGLang's shape."""

    async def route(raw: bytes) -> Reply:
        body = await bodies.parse(raw, _parse_body)
        try:
            return json_reply(await answer(body))
        except EPDError as exc:
            return sglang_error_reply(exc, body.get("req_id"))

    return cancelled_when_gone(route)


def _data_routes(service: EncoderService, bodies: JsonBodies) -> dict[str, Handler]:
    """Every route SGLang calls per request: served in front of Quart."""

    async def scheduler_receive_url(body: dict[str, Any]) -> None:
        reg = parse_receive_url(body)
        await service.announce_receiver(reg.req_id, reg.receive_count, reg.receive_url)

    async def scheduler_receive_meta_data(body: dict[str, Any]) -> dict[str, Any]:
        req_id, part_idx = parse_meta_request(body)
        sizes = await service.part_sizes(req_id)
        return {"req_id": req_id, "part_idx": part_idx, **sizes}

    async def send(body: dict[str, Any]) -> None:
        order = parse_sglang_send(body)
        # A part already released answers how it ended, as SGLang's error record does.
        await service.send_announced(order.req_id, order.part_idx, session=order.session,
                                     address=order.buffer_address, length=order.length,
                                     completion=order.completion, receive_count=order.receive_count)

    return {"/encode": encode_handler(service, bodies),
            "/scheduler_receive_url": _data_route(bodies, scheduler_receive_url),
            "/scheduler_receive_meta_data": _data_route(bodies, scheduler_receive_meta_data),
            "/send": _data_route(bodies, send)}


def _operation_routes(app: QuartTrio, service: EncoderService, bodies: JsonBodies) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        report = await service.check_health()
        return json_response({"status": report.status, "probed": report.probed,
                              "detail": report.detail}, 200 if report.healthy else 503)

    @app.route("/start_profile", methods=["GET", "POST"])
    async def start_profile() -> Response:
        body = await bodies.of_request(_parse_body)
        output_dir, num_steps = parse_profile_request({k: body[k] for k in _PROFILE_FIELDS
                                                       if body.get(k) is not None})
        target = service.profiler.start(output_dir, num_steps)
        return Response(f"Start profiling. output_dir={target}\n", status=200, mimetype="text/plain")

    @app.route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        trace = await service.profiler.stop()
        return Response(f"Stop profiling. trace={trace}\n", status=200, mimetype="text/plain")
