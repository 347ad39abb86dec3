"""``tools/bench_loop_stall.py`` runs and prints its tables: the inline build, and other requests'
latency while a client streams tiny chunks, a row per HTTP server from one run."""

from __future__ import annotations

from types import ModuleType

import pytest
import trio

from conftest import load_tool


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_tool("bench_loop_stall")


def test_the_quick_mode_is_small(bench: ModuleType) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.mib, args.chunks, args.http_repeat) == (16, 50_000, 1)
    assert args.sections == ["inline", "http"] and args.http_server == ["builtin", "hypercorn"]


def test_both_sections_print_their_rows(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args(["--mib", "1", "--repeat", "1", "--chunks", "3000", "--probes", "5",
                             "--http-repeat", "1"])
    trio.run(bench.main, args)
    out = capsys.readouterr().out
    assert "on loop" in out and "off loop" in out
    table = out[out.index("streams 3000 one-byte chunks"):].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:] if line.strip()}
    assert set(rows) == {"builtin", "hypercorn"}
    for cells in rows.values():
        assert len(cells) == 7 and all(float(cell) > 0 for cell in cells), cells
