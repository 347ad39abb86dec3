"""docs/benchmarks.md is generated from the benchmarks' results files, and the tools write them.

No timings are asserted: benchmarks report. What is checked is that the page says what the
files say, that every tool the runner knows has a section and a results file, and that a
tool run with ``--results`` writes a file the page renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def docs_tool():  # type: ignore[no-untyped-def]
    return load_tool("bench_docs")


def test_the_page_is_what_the_results_say(docs_tool) -> None:  # type: ignore[no-untyped-def]
    expected = docs_tool.render(docs_tool.load(docs_tool.RESULTS))
    assert docs_tool.PAGE.read_text() == expected, "run python tools/bench_docs.py"


def test_every_tool_has_a_section_and_current_results(docs_tool) -> None:  # type: ignore[no-untyped-def]
    runner = load_tool("bench_all")
    assert list(runner.TOOLS) == list(docs_tool.SECTIONS)
    results = docs_tool.load(docs_tool.RESULTS)
    assert sorted(results) == sorted(docs_tool.SECTIONS), "run python tools/bench_all.py --only ..."
    for tool, result in results.items():
        assert result.tool == tool and result.tables, tool
        assert result.command.startswith(f"python tools/{tool}.py") and "--results" not in result.command
        for table in result.tables:
            assert all(len(row) == len(table.header) for row in table.rows), (tool, table.title)
    for tool in docs_tool.SECTIONS:
        assert (ROOT / "tools" / f"{tool}.py").exists(), tool


def test_a_tool_run_writes_results_the_page_renders(docs_tool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench_loop_stall.json"
    done = subprocess.run([sys.executable, "tools/bench_loop_stall.py", "--sections", "inline", "--mib", "1",
                           "--repeat", "1", "--results", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"] == "python tools/bench_loop_stall.py --sections inline --mib 1 --repeat 1"
    assert data["host"]["cores"] and "load_after" in data["host"]
    [table] = data["tables"]
    assert [row[0] for row in table["rows"]] == ["on loop", "off loop"]
    page = docs_tool.render(docs_tool.load(tmp_path))
    assert "| on loop |" in page and "python tools/bench_loop_stall.py --sections inline --mib 1 --repeat 1" in page
    assert "Not measured yet: run `python tools/bench_all.py --only bench_engine`" in page


def test_a_run_without_results_writes_nothing(tmp_path: Path) -> None:
    results = load_tool("bench_results")
    results.record("outside any recording", ["a"], [["1"]])  # a no-op, not an error
    with results.recording("bench_x", None) as recorded:
        results.record("t", ["a"], [["1"]])
    assert recorded is None and not list(tmp_path.iterdir())
    with results.recording("bench_x", tmp_path / "x.json", ["--quick", "--results", "x.json"]):
        results.record("t", ["a", "b"], [[1, 2.5]])
    saved = results.Results.from_json((tmp_path / "x.json").read_text())
    assert saved.command == "python tools/bench_x.py --quick"
    assert saved.tables[0].rows == [["1", "2.5"]]
