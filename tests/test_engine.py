"""The engine as a user drives it: errors, overload, cancellation, default model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from conftest import png_bytes
from epd_trio import EngineConfig, OverloadedError, RequestError, open_engine
from epd_trio.testing import run_threads_inline


async def test_bad_input_is_a_request_error_naming_the_item(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path) as engine:
        with pytest.raises(RequestError, match="item 1: bytes are not an image"):
            await engine.encode([png_bytes(32, 32), b"garbage"], "image")
        with pytest.raises(RequestError, match="unknown modality 'smell'"):
            await engine.encode([png_bytes(32, 32)], "smell")
        with pytest.raises(RequestError, match="does not encode 'audio'"):
            await engine.encode([png_bytes(32, 32)], "audio")
        with pytest.raises(RequestError, match=r"aspect ratio|item 0"):
            await engine.encode([png_bytes(3000, 10)], "image")
        ok = await engine.encode([png_bytes(32, 32)], "image")  # still serving
        stats = engine.statistics()
    assert ok.embedding.shape[0] == sum(ok.token_counts)
    assert (stats.admitted, stats.preprocessing, stats.requests_done) == (0, 0, 1)


async def test_overloaded_refuses_at_once(qwen25_path: str, autojump_clock: trio.testing.MockClock) -> None:
    """Refused in no virtual time (under the autojump clock any sleep or timeout would move it),
    before any preprocessing (counted at the engine's seam) or forward, while the slot is held."""
    async with open_engine(model_path=qwen25_path, max_pending=1) as engine:
        run_threads_inline(engine)
        preprocessed = []
        step = engine.preprocess_step

        async def counted(*args: object, **kwargs: object) -> object:
            preprocessed.append(trio.current_time())
            return await step(*args, **kwargs)

        engine.preprocess_step = counted
        with engine.scheduler.admit():
            started = trio.current_time()
            with pytest.raises(OverloadedError):
                await engine.encode([png_bytes(32, 32)])
            assert trio.current_time() == started and preprocessed == []
            held = engine.statistics()
        await engine.encode([png_bytes(32, 32)])
        after = engine.statistics()
    assert (held.admitted, held.queued, held.requests_done, held.batches_run) == (1, 0, 0, 0)
    assert (after.admitted, after.requests_done) == (0, 1) and len(preprocessed) == 1


async def test_random_cancellations_leave_others_correct_and_nothing_behind(qwen25_path: str) -> None:
    rng = random.Random(1234)
    images = [png_bytes(28 * rng.randint(1, 8), 28 * rng.randint(1, 8), seed=i) for i in range(24)]
    async with open_engine(model_path=qwen25_path, max_batch_size=4) as engine:
        expected = [await engine.encode([img]) for img in images]
        survived: dict[int, torch.Tensor] = {}

        async def call(i: int, deadline: float | None) -> None:
            with trio.move_on_after(deadline if deadline is not None else 60):
                survived[i] = (await engine.encode([images[i]])).embedding

        async with trio.open_nursery() as nursery:
            for i in range(len(images)):
                deadline = rng.choice([None, 0.0, 0.001, 0.005, 0.02])
                nursery.start_soon(call, i, deadline)
        stats = engine.statistics()
    assert survived, "every caller was cancelled: the test proves nothing"
    for i, emb in survived.items():
        assert torch.allclose(emb, expected[i].embedding, rtol=1e-5, atol=1e-6), i
    assert (stats.admitted, stats.preprocessing, stats.queued, stats.running) == (0, 0, 0, 0)


async def test_default_model_is_generated_once(tmp_path: Path) -> None:
    async with open_engine(EngineConfig(cache_dir=str(tmp_path))) as engine:
        info = engine.model_info
        out = await engine.encode([png_bytes(56, 56)])
    assert info.random_weights and info.model_type == "qwen2_5_vl"
    assert out.embedding.shape == (4, info.dim)
    (generated,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    stamp = generated.stat().st_mtime_ns
    async with open_engine(EngineConfig(cache_dir=str(tmp_path))):
        pass
    assert generated.stat().st_mtime_ns == stamp
