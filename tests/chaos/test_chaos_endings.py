"""Seeded real-clock chaos over Mooncake delivery, the SGLang faces and process-mode preprocessing.

The stages and rules are ``endings_scenarios``'s. Each test starts its
encoder(s) once and runs a few seeds over them (starting is most of the cost;
``tools/chaos_soak.py --endings N`` runs many more). A failure names its stage
and seed; ``EPD_CHAOS_SEED=7`` (or ``7,9``) replays those seeds on every stage,
``EPD_CHAOS_VERBOSE=1 pytest -s`` prints each script.
"""

from __future__ import annotations

import os

import pytest

from endings_scenarios import run_endings_scenario
from endings_stages import stage_for
from real_world import Media

if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")

DEFAULT_SEEDS = (0, 1, 2)  # 2 kills a preprocessing child (seed % 4 == 2); odd seeds add server faults


def selected_seeds() -> list[int]:
    raw = os.environ.get("EPD_CHAOS_SEED", "").replace(",", " ").split()
    return [int(s) for s in raw] if raw else list(DEFAULT_SEEDS)


async def run_stage(name: str, model_path: str) -> None:
    outcomes: set[str] = set()
    async with stage_for(name, model_path, Media()) as stage:
        for seed in selected_seeds():
            report = await run_endings_scenario(stage, seed)
            print(report.describe() if os.environ.get("EPD_CHAOS_VERBOSE") else report.summary())
            assert not report.violations, report.describe()
            outcomes |= {c.outcome for c in report.calls if c.label != "after"}
    if not os.environ.get("EPD_CHAOS_SEED"):  # the chaos really happened: both kinds of ending
        assert "ok" in outcomes and outcomes - {"ok"}, (name, outcomes)


@pytest.mark.parametrize("name", ["mooncake", "process"])
async def test_chaos_through_the_client(name: str, qwen25_path: str) -> None:
    await run_stage(name, qwen25_path)


@pytest.mark.parametrize("backend", ["zmq_to_scheduler", "zmq_to_tokenizer", "mooncake"])
async def test_chaos_through_the_sglang_face(backend: str, qwen25_path: str) -> None:
    await run_stage(f"sglang-{backend}", qwen25_path)
