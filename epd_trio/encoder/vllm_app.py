"""The vLLM face (``--api vllm``): an encoder instance of vLLM 0.32's disaggregated encoder (EPD).

vLLM's EPD proxy sends each multimodal item of a chat request, text removed,
to an encoder instance's ``POST /v1/chat/completions`` and waits for 200
before it forwards the original request to a prefill/decode instance started
with ``--ec-transfer-config`` (``ec_role: ec_consumer``). This face is such an
instance: it writes each item's embedding where that consumer's EC connector
looks for it, or pushes it into the memory of the consumer the request names
(``protocol.vllm_requests.EcProducer`` says which), under the item's
``mm_hash``, and answers as vLLM's producer does (a chat completion with
``ec_transfer_params``).

Routes: ``POST /v1/chat/completions`` (``x-request-id`` honoured and echoed),
``GET /v1/models``, ``GET /health``, ``POST /start_profile`` and
``/stop_profile``; ``/abort``, ``/model_info``, ``/stats`` and ``/metrics`` as
the native face serves them (``encoder.http_face``). Errors are OpenAI's JSON
error object with the status from ``epd_trio.errors.http_status``, never a
traceback.

The model id inside every ``mm_hash`` is ``--vllm-model`` (the consumer's
``--model`` string, by default ``--model-path`` as given); requests may name
``--served-model-name`` (by default that same id), another name is a 404.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from epd_trio._http import BearerAuth, JoinedBodyRequest, install_error_handlers, json_response
from epd_trio.encoder.http_face import JsonBodies, add_shared_routes, quart_app
from epd_trio.encoder.profiling import parse_profile_request
from epd_trio.encoder.service import EncoderService
from epd_trio.encoder.vllm_items import VllmItems
from epd_trio.errors import EPDError, PayloadTooLargeError, UnknownRequestError
from epd_trio.protocol.vllm_requests import (
    EcProducer,
    chat_completion,
    ec_transfer_params,
    openai_error,
    parse_chat_request,
)

__all__ = ["create_vllm_app", "vllm_model_id"]

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


def vllm_model_id(service: EncoderService) -> str:
    """The consumer's ``--model`` string: ``--vllm-model``, else ``--model-path`` as given."""
    config = service.config
    return config.vllm_model or config.engine.model_path or str(service.engine.encoder.model_dir)


def error_response(exc: BaseException, request_id: str | None = None) -> Response:
    if isinstance(exc, HTTPException) and exc.code != 413:  # a framework's 404 or 405
        body = {"error": {"message": exc.description or exc.name, "type": exc.name.replace(" ", ""),
                          "param": None, "code": exc.code}}
        return _with_id(json_response(body, exc.code or 500), request_id)
    closing = isinstance(exc, HTTPException)  # 413: the body was refused unread
    if closing:
        exc = PayloadTooLargeError("request body is over the size limit")
    body, status = openai_error(exc)
    response = _with_id(json_response(body, status), request_id)
    if closing:
        response.headers["Connection"] = "close"
    return response


def _with_id(response: Response, request_id: str | None) -> Response:
    if request_id is not None:
        response.headers["x-request-id"] = request_id
    return response


def create_vllm_app(service: EncoderService) -> QuartTrio:
    """One app per service: no module-level state."""
    config = service.config
    app, bodies = quart_app(__name__, config), JsonBodies()
    app.request_class = JoinedBodyRequest  # large bodies copied once, not per chunk
    if config.require_auth_for_encode:
        auth = BearerAuth(config.auth_token)

        @app.before_request
        async def check_encode_token() -> None:
            if request.path == CHAT_PATH:
                auth.check(request.headers.get("Authorization"), request.path)

    model_id = vllm_model_id(service)
    served = config.served_model_name or model_id
    producer = EcProducer.of(config.vllm_ec)
    log.info("vLLM face: mm_hash model id %r (must equal the consumer's --model), served as %r, %s",
             model_id, served, producer.described)
    items = VllmItems(service, model_id, config.mm_hasher_algorithm, producer)
    _chat_route(app, service, bodies, items, served)
    _operation_routes(app, service, served, model_id)
    add_shared_routes(app, service, bodies)
    install_error_handlers(app, "vLLM-face", respond=error_response)
    return app


def _chat_route(app: QuartTrio, service: EncoderService, bodies: JsonBodies, items: VllmItems,
                served: str) -> None:
    @app.post(CHAT_PATH)
    async def chat_completions() -> Response:
        header_id = request.headers.get("x-request-id")
        try:
            with service.parsing():
                chat = parse_chat_request(await bodies.of_request(), header_request_id=header_id,
                                          max_items=service.config.max_items)
        except EPDError as exc:
            return error_response(exc, header_id)
        try:
            if chat.model is not None and chat.model != served:
                raise UnknownRequestError(f"The model `{chat.model}` does not exist.", req_id=chat.request_id)
            if not chat.items:
                log.info("request %s has no media items: nothing to encode", chat.request_id)
                return _with_id(json_response(chat_completion(chat.request_id, served, 0, None)),
                                chat.request_id)
            done = await items.encode(chat)
        except EPDError as exc:
            return error_response(exc, chat.request_id)
        params = ec_transfer_params(chat.items, done.hashes, done.metas, done.transfer_ids)
        tokens = sum(meta.tokens for meta in done.metas.values())
        return _with_id(json_response(chat_completion(chat.request_id, served, tokens, params)),
                        chat.request_id)


def _operation_routes(app: QuartTrio, service: EncoderService, served: str, model_id: str) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        report = await service.check_health()
        return json_response({"status": report.status, "probed": report.probed, "detail": report.detail},
                             200 if report.healthy else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        card: dict[str, Any] = {"id": served, "object": "model", "created": started,
                                "owned_by": "epd-trio", "root": model_id, "parent": None}
        return json_response({"object": "list", "data": [card]})

    @app.post("/start_profile")
    async def start_profile() -> Response:
        await request.get_data(cache=False)  # vLLM's proxy may send a body; its fields are not ours
        output_dir, num_steps = parse_profile_request({})
        service.profiler.start(output_dir, num_steps)
        return Response("", status=200)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        await service.profiler.stop()
        return Response("", status=200)
