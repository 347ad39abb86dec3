"""``tools/bench_engine.py``: its table from known runs, and a tiny real run (no timings asserted:
benchmarks report, they do not assert)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_engine.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_engine_is_held_to_the_best_bare_loop(bench: ModuleType) -> None:
    """16 images: bare batch 1 in 4 s (4 img/s) beats batch 8 in 5 s; the engine's learned pass
    took 4.2 s, its first 4.4 s, the fixed ceiling 5.6 s."""
    def engine(seconds: float, sizes: list[int], cap: int | None) -> object:
        return bench.EngineRun(seconds, seconds, seconds, sum(sizes), len(sizes), sizes, [], cap)

    def bare(pre: float, fwd: float, sizes: list[int]) -> object:
        return bench.BareRun(sizes, pre, fwd, pre + fwd, [])

    m = bench.Measured(first=engine(4.4, [1, 1, 1, 2, 2, 2] + [1] * 7, 256),
                       engine=engine(4.2, [1] * 16, 256), bare=bare(1.0, 3.0, [1] * 16),
                       fixed_bare={1: bare(1.0, 3.0, [1] * 16), 8: bare(1.0, 4.0, [8, 8])},
                       fixed_engine=engine(5.6, [8, 8], None))
    row = dict(zip(bench.COLUMNS, bench.table_row("quick", 16, 8, m, 16)))
    assert (row["cap tok"], row["avg_bs"], row["engine img/s"]) == ("256", "1.00", "3.81")
    assert (row["bare bs1 img/s"], row["bare bsmax img/s"]) == ("4.00", "3.20")
    assert row["engine/best bare"] == f"{4.0 / 4.2:.3f}"
    assert row["1st pass/best bare"] == f"{4.0 / 4.4:.3f}"
    assert row["fixed/best bare"] == f"{4.0 / 5.6:.3f}"
    skipped = bench.Measured(m.first, m.engine, m.bare, m.fixed_bare, None)
    assert dict(zip(bench.COLUMNS, bench.table_row("quick", 16, 8, skipped, 16)))["fixed/best bare"] == "-"


def test_an_embedders_process_is_the_default(bench: ModuleType) -> None:
    assert bench.parse_args([]).malloc_tuned is False
    assert bench.parse_args(["--malloc-tuned"]).malloc_tuned is True


def test_a_tiny_run_reports_the_learned_cap_beside_the_ratios(tmp_path: Path) -> None:
    args = ["--quick", "--images", "4", "--sizes", "56", "--concurrency", "2", "--max-batch-size", "2",
            "--repeat", "1", "--checkpoint-dir", str(tmp_path / "ckpt")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "malloc: glibc's default, as in a program that embeds the engine" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config "))
    names = re.split(r"\s{2,}", lines[header].strip())  # some hold a space: 'cap tok'
    row = dict(zip(names, lines[header + 1].split(), strict=True))
    assert row["config"] == "quick" and (row["C"], row["max_bs"]) == ("2", "2")
    # 56 x 56: 4 tokens an image; the cap is a power of two once three forwards were timed
    assert int(row["cap tok"]) in (4, 8)
    for ratio in ("engine/best bare", "1st pass/best bare", "fixed/best bare"):
        assert float(row[ratio]) > 0, row
    assert "max rel diff" in out and " | engine fixed " in out
