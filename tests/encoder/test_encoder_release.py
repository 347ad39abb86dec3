"""A release cannot break: whatever a delivery's ``aclose`` does, the scope leaves the registry.

The service runs on a real engine (the tiny checkpoint) with its blocking work
inline, so virtual time (``autojump_clock``) measures every bound exactly. The
deliveries are the real ones the service builds; one test request's ``aclose``
is made to misbehave after the real one has run.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from conftest import image_uri
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.delivery import Answer, Delivery
from epd_trio.encoder.scope import CLOSE_TIMEOUT
from epd_trio.encoder.service import EncoderService, open_encoder_service
from epd_trio.engine import open_engine
from epd_trio.protocol.requests import EncodeRequest, parse_encode_request
from epd_trio.testing import run_threads_inline

DRAIN_TIMEOUT = 30.0


async def raise_key_error() -> None:
    raise KeyError("a bug in a delivery")


@asynccontextmanager
async def service_for(qwen25_path: str) -> AsyncIterator[EncoderService]:
    config = EncoderConfig(engine=EngineConfig(model_path=qwen25_path, max_batch_size=4),
                           drain_timeout=DRAIN_TIMEOUT)
    async with open_engine(config.engine) as engine:
        run_threads_inline(engine)
        async with open_encoder_service(config, engine) as service:
            yield service


def misbehaving_for(service: EncoderService, req_id: str, misbehave: Callable[[], Any]) -> list[str]:
    """The first request named ``req_id`` gets its own delivery, whose ``aclose`` does
    ``misbehave`` after closing it; the rest are untouched."""
    build, wrapped = service.delivery_for, []

    def delivery_for(request: EncodeRequest) -> Delivery:
        delivery = build(request)
        if request.req_id == req_id and not wrapped:
            wrapped.append(req_id)
            close = delivery.aclose

            async def aclose() -> None:
                await close()
                await misbehave()

            delivery.aclose = aclose  # type: ignore[method-assign]
        return delivery

    service.delivery_for = delivery_for
    return wrapped


def request(req_id: str, seed: int = 0) -> EncodeRequest:
    return parse_encode_request({"req_id": req_id, "modality": "image",
                                 "mm_items": [image_uri(seed=seed)]})


async def test_a_delivery_whose_aclose_raises_a_bug_is_released_while_others_go_on(
        qwen25_path: str, autojump_clock: trio.testing.MockClock,
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``KeyError`` from one delivery's ``aclose``, with other requests in flight: they
    finish, the id can be admitted again, the bug is logged and counted, and a drain
    does not wait for the scope (it has left the registry)."""
    async with service_for(qwen25_path) as service:
        wrapped = misbehaving_for(service, "buggy", raise_key_error)
        answers: dict[str, Answer] = {}

        async def encode(req_id: str, seed: int) -> None:
            answers[req_id] = await service.encode(request(req_id, seed))

        with caplog.at_level(logging.ERROR, logger="epd_trio.encoder.scope"):
            async with trio.open_nursery() as nursery:
                for n, req_id in enumerate(["a", "buggy", "b", "c"]):
                    nursery.start_soon(encode, req_id, n)
        assert wrapped == ["buggy"] and sorted(answers) == ["a", "b", "buggy", "c"]
        assert all(a.body for a in answers.values())  # every answer is the embedding itself
        assert "KeyError: 'a bug in a delivery'" in caplog.text and "Traceback" in caplog.text
        stats = service.registry.statistics()
        assert (stats.live_requests, stats.completed, stats.release_errors) == (0, 4, 1), stats
        assert b"epd_encoder_release_errors_total 1.0" in service.metrics.exposition()

        again = await service.encode(request("buggy", 5))  # the id is free again
        assert again.meta.req_id == "buggy"
        started = trio.current_time()
        await service.drain()
        assert trio.current_time() - started == 0  # nothing live: no wait at all
    assert service.registry.statistics().live_requests == 0


async def test_an_aclose_that_hangs_is_cut_at_its_bound_and_the_scope_released(
        qwen25_path: str, autojump_clock: trio.testing.MockClock) -> None:
    async with service_for(qwen25_path) as service:
        misbehaving_for(service, "stuck", trio.sleep_forever)
        other: list[Answer] = []
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.encode, request("stuck"))
            await trio.sleep(0.01)
            other.append(await service.encode(request("beside", 1)))  # not held up by it
            assert trio.current_time() - started < 1.0
            with trio.fail_after(CLOSE_TIMEOUT + 1):
                while service.registry.statistics().live_requests:
                    await trio.sleep(0.1)
        released_after = trio.current_time() - started
        stats = service.registry.statistics()
        assert (stats.live_requests, stats.release_timeouts, stats.release_errors) == (0, 1, 0), stats
        assert CLOSE_TIMEOUT <= released_after < CLOSE_TIMEOUT + 0.5, released_after
        assert b"epd_encoder_release_timeouts_total 1.0" in service.metrics.exposition()
        await service.encode(request("stuck", 2))  # admitted again
