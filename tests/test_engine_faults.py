"""Faults reach the engine by wrapping its seams: each point is hit where a request passes it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from conftest import png_bytes
from epd_trio import open_engine
from epd_trio.testing import Fault, FaultPlan, InjectedFault, install_faults, run_threads_inline

IMAGE = png_bytes(32, 32)


async def test_every_engine_point_is_hit_once_per_request_and_removal_restores_the_seams(
        qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path) as engine:
        seams = (engine.media, engine.preprocess_step, engine.admission, engine.scheduler.forward)
        plan = FaultPlan(0)
        install_faults(plan, engine, engine.scheduler)
        install_faults(plan, engine, engine.scheduler)  # again: replaces, never stacks
        await engine.encode([IMAGE])
        assert plan.hits == {"admission": 1, "media_load": 1, "preprocess": 1, "forward": 1}
        install_faults(None, engine, engine.scheduler)
        assert (engine.media, engine.preprocess_step, engine.admission, engine.scheduler.forward) == seams
        await engine.encode([IMAGE])
        assert plan.hits == {"admission": 1, "media_load": 1, "preprocess": 1, "forward": 1}


async def test_a_full_cache_hit_passes_only_admission(qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path, cache_mb=8) as engine:
        plan = FaultPlan(0)
        install_faults(plan, engine, engine.scheduler)
        first = await engine.encode([IMAGE], hashes=["a"])
        again = await engine.encode([IMAGE], hashes=["a"])
        assert plan.hits == {"admission": 2, "media_load": 1, "preprocess": 1, "forward": 1}
    assert again.embedding.equal(first.embedding)


@pytest.mark.parametrize("point", ["admission", "media_load", "preprocess", "forward"])
async def test_an_error_at_any_point_fails_the_request_and_leaves_nothing_behind(
        point: str, qwen25_path: str) -> None:
    async with open_engine(model_path=qwen25_path) as engine:
        install_faults(FaultPlan(0, [Fault(point, error=InjectedFault)]), engine, engine.scheduler)
        with pytest.raises(InjectedFault, match=point):
            await engine.encode([IMAGE])
        stats = engine.statistics()
        install_faults(None, engine, engine.scheduler)
        await engine.encode([IMAGE])
    assert (stats.admitted, stats.preprocessing, stats.queued, stats.running) == (0, 0, 0, 0)


async def test_a_delay_before_preprocessing_is_virtual_time(
        qwen25_path: str, autojump_clock: trio.testing.MockClock) -> None:
    async with open_engine(model_path=qwen25_path) as engine:
        run_threads_inline(engine)
        install_faults(FaultPlan(0, [Fault("preprocess", delay=2.5)]), engine)
        started = trio.current_time()
        await engine.encode([IMAGE])
        assert trio.current_time() - started == 2.5
