"""``tools/bench_grpc_guard.py`` runs: both measures give a number for each side."""

from __future__ import annotations

from conftest import load_tool


def test_the_guard_benchmark_measures_both_sides() -> None:
    bench = load_tool("bench_grpc_guard")
    rows = bench.in_process(200, 1)
    assert [what for what, _, _ in rows] == ["interceptor (find the handler)", "request deserializer",
                                            "handler (checks for an undecodable request)"]
    assert all(bare > 0 and guarded > 0 for _, bare, guarded in rows)
    for guarded in (False, True):  # a real server process each; the guarded one still answers Check
        latency, cpu = bench.end_to_end(guarded, 20)
        assert latency > 0 and cpu >= 0
