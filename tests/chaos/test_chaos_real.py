"""Seeded real-clock chaos over real Hypercorn + ZMQ (kinds in ``real_scenarios``).

One test runs every seed over shared servers, since starting them is most of
the cost: two chaos encoders in process (``serve_encoder``, send timeout 1 s,
``--zmq-sndhwm`` 4),
an encoder subprocess that ``encoder_killed`` scenarios SIGKILL and restart on
the same port, and a clean encoder whose own client sends requests beside
every scenario. Each scenario must leave everything idle, which is checked
after it, so the next one starts from a quiet world.

A failure names its seed and kind; ``EPD_CHAOS_SEED=17`` (or ``17,23``) runs
only those seeds, with the same scripts (``EPD_CHAOS_VERBOSE=1 pytest -s`` prints
each script).
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from conftest import image_uri
from epd_trio.client import open_encoder_client
from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import serve_encoder
from epd_trio.protocol.requests import parse_encode_request
from epd_trio.transport.zmq import PullReceiver
from real_scenarios import KINDS, LONG, kind_of, run_scenario
from real_world import Media, References, ServerProcess, World

# httpx's ``ByteStream.__aiter__`` is an async generator that httpcore never closes
# when a request is cancelled while its body is being sent (a client timeout
# does that): trio warns when it is collected (encode/httpx#3686, fix pending
# upstream in encode/httpx#3777). It holds nothing; only that warning is ignored.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object ByteStream.__aiter__"
    ":pytest.PytestUnraisableExceptionWarning")

# 12 seeds whose draws cover every kind at least twice (abort 3, connection_drop 3, client_timeout 2,
# stuck_receiver 2, encoder_killed 2: 1840 falls back to a peer, 1861 has none and is killed mid-batch).
# A kill costs a model load (10-20 s), so there are two; ``tools/chaos_soak.py`` runs many more.
DEFAULT_SEEDS = (1840, *range(1850, 1860), 1861)
SEND_TIMEOUT = 1.0  # a receiver that stops reading costs a request 1 s, not the default 60
# Messages queued per destination before a send waits: with the default 64, a fresh stuck
# receiver took 65 posts of large images (~20 s) before its first send timed out; the same
# path is reached after a handful.
SNDHWM = 4


def selected_seeds() -> list[int]:
    raw = os.environ.get("EPD_CHAOS_SEED", "").replace(",", " ").split()
    return [int(s) for s in raw] if raw else list(DEFAULT_SEEDS)


def test_the_default_seeds_draw_every_kind() -> None:
    kinds = Counter(kind_of(seed) for seed in DEFAULT_SEEDS)
    assert len(DEFAULT_SEEDS) >= 12 and all(kinds[k] >= 2 for k in KINDS), kinds


async def test_real_clock_chaos(qwen25_path: str, tmp_path: Path) -> None:
    seeds = selected_seeds()
    kinds = {seed: kind_of(seed) for seed in seeds}
    killable = ServerProcess("encoder", ["--model-path", qwen25_path, "--send-timeout", str(SEND_TIMEOUT)],
                             tmp_path / "killable-encoder.log", name="killable encoder")
    async with AsyncExitStack() as stack:
        if "encoder_killed" in kinds.values():
            killable.launch(0)  # loads its model while the in-process servers start
            stack.push_async_callback(killable.stop)

        def config() -> EncoderConfig:
            return EncoderConfig(port=0, send_timeout=SEND_TIMEOUT, zmq_sndhwm=SNDHWM,
                                 engine=EngineConfig(model_path=qwen25_path))

        chaos = [await stack.enter_async_context(serve_encoder(config())) for _ in range(2)]
        clean = await stack.enter_async_context(serve_encoder(config()))
        if killable.proc is not None:
            await killable.ready()
        options = dict(timeout=LONG, abort_timeout=0.5, pool_bytes=64 << 20)
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0))
        chaos_client = await stack.enter_async_context(
            open_encoder_client(encoder_urls=[s.url for s in chaos], **options))
        clean_client = await stack.enter_async_context(open_encoder_client(encoder_urls=[clean.url], **options))
        media = Media()
        refs = References(media)
        await refs.from_engine(clean.service.engine)
        world = World(http=http, media=media, refs=refs, chaos_urls=[s.url for s in chaos],
                      chaos_client=chaos_client, killables=[killable] if killable.proc else [],
                      clean_client=clean_client, clean_urls=[clean.url], client_options=options)
        stack.callback(world.close_stuck)
        for seed in seeds:
            try:
                report = await run_scenario(world, seed)
            except Exception as exc:
                raise AssertionError(f"[chaos seed={seed} kind={kinds[seed]}] crashed: {exc!r}\n"
                                     f"  replay: EPD_CHAOS_SEED={seed} pytest {__file__}\n"
                                     f"  killable encoder log:\n{killable.log_tail()}") from exc
            print(report.describe() if os.environ.get("EPD_CHAOS_VERBOSE") else report.summary())
            assert not report.violations, report.describe()


# ---- regressions found by the scenarios above -------------------------------------------------------
async def test_a_caller_cancelled_while_its_scope_starts_still_aborts_and_delivers(encoder: Any) -> None:
    """Seed 1837 (connection_drop, under load): Hypercorn cancelled an /encode handler
    between ``nursery.start`` spawning the request scope and the scope's first step.
    The scope then stayed in the handler's cancelled context: it was counted as
    failed (with "the encoder is shutting down"), and its ZMQ receiver never heard
    of it. A pre-cancelled caller hits that window every time."""
    async with encoder(send_timeout=1.0) as (server, _), PullReceiver() as pull:
        service = server.service
        request = parse_encode_request({
            "req_id": "gone-early", "modality": "image", "mm_items": [image_uri()],
            "deliver": {"backend": "zmq", "endpoint": pull.last_endpoint}})
        with trio.CancelScope() as caller:
            caller.cancel()  # the client disconnected: the handler is cancelled
            await service.encode(request)
        assert caller.cancelled_caught
        with trio.fail_after(5):
            header, tensor = await pull.receive()
            while service.registry.statistics().live_requests:
                await trio.sleep(0.01)
        assert (header.req_id, header.kind, tensor) == ("gone-early", "error", None)
        assert header.error is not None and header.error.type == "AbortedError", header.error
        stats = service.registry.statistics()
        assert (stats.started, stats.aborted, stats.failed) == (1, 1, 0), stats
