"""The registry's HTTP face (quart-trio): register, unregister, list, inspect.

Handlers stay thin: URLs are checked by ``protocol.urls.normalize_url``, state
lives in ``Registry``, and every error leaves as the protocol's JSON error shape
with the status from ``epd_trio.errors.http_status``. With a token configured
the mutating endpoints need ``Authorization: Bearer <token>``, compared in
constant time; the token is never logged or echoed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from epd_trio._http import BearerAuth, install_error_handlers, json_response
from epd_trio._version import __version__
from epd_trio.bootstrap.health import HealthLoop
from epd_trio.bootstrap.registry import EncoderEntry, Registry
from epd_trio.errors import RequestError
from epd_trio.protocol.requests import parse_json_body
from epd_trio.protocol.urls import normalize_url

__all__ = ["MAX_BODY_BYTES", "MAX_HEADER_BYTES", "create_app"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024  # a body is one URL: anything bigger is not a registration
MAX_HEADER_BYTES = 16 * 1024  # a request head (→ 431), as the encoder's --max-header-bytes default


def create_app(registry: Registry, health: HealthLoop, *, auth_token: str | None = None) -> QuartTrio:
    """One app per registry: no module-level state."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BODY_TIMEOUT"] = 10
    _routes(app, registry, health, BearerAuth(auth_token))
    install_error_handlers(app, "registry")
    return app


async def _url_from_body() -> str:
    body = parse_json_body(await request.get_data(cache=False, as_text=False, parse_form_data=False))
    if "url" not in body:
        raise RequestError("body must be {\"url\": \"http://host:port\"}")
    return normalize_url(body["url"])


def _entry_view(entry: EncoderEntry, now: float, wall: float) -> dict[str, Any]:
    """Trio times (monotonic) as Unix times, so operators can read them."""
    def unix(t: float | None) -> float | None:
        return None if t is None else round(wall - (now - t), 3)

    return {"url": entry.url, "healthy": entry.healthy, "failures": entry.failures,
            "last_ok": unix(entry.last_ok), "evicted_at": unix(entry.evicted_at),
            "registered_at": unix(entry.registered_at)}


def _routes(app: QuartTrio, registry: Registry, health: HealthLoop, auth: BearerAuth) -> None:
    @app.post("/register_encoder_url")
    async def register() -> Response:
        auth.check(request.headers.get("Authorization"), "register and unregister")
        url = await _url_from_body()
        added = registry.register(url, trio.current_time())
        if added:
            log.info("registered encoder %s", url)
        return json_response({"url": url, "registered": added})

    @app.route("/unregister_encoder_url", methods=["DELETE", "POST"])
    async def unregister() -> Response:
        auth.check(request.headers.get("Authorization"), "register and unregister")
        url = await _url_from_body()
        removed = registry.unregister(url)
        if removed:
            log.info("unregistered encoder %s", url)
        return json_response({"url": url, "unregistered": removed})

    @app.get("/list_encoder_urls")
    async def list_encoder_urls() -> Response:
        return json_response({"encoder_urls": registry.healthy_urls()})

    @app.get("/encoders")
    async def encoders() -> Response:
        now, wall = trio.current_time(), time.time()
        return json_response({"encoders": [_entry_view(e, now, wall) for e in registry.entries()]})

    @app.get("/health")
    async def health_endpoint() -> Response:
        s = registry.statistics()
        loop = "running" if health.statistics().running else "restarting"
        return json_response({"status": "ok", "encoders": s.encoders, "healthy": s.healthy,
                      "health_loop": loop, "version": __version__})

    @app.get("/stats")
    async def stats() -> Response:
        return json_response({"registry": dataclasses.asdict(registry.statistics()),
                      "health_loop": dataclasses.asdict(health.statistics())})
