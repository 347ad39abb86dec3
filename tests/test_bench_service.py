"""``tools/bench_service.py`` smoke run: every path, gRPC beside HTTP, answers equal to the
engine's (no timings asserted: benchmarks report, they do not assert)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_service.py"


def test_a_tiny_run_reports_grpc_beside_http(tmp_path: Path) -> None:
    args = ["--requests", "4", "--warmup", "1", "--block", "2", "--breakdown", "--images", "2",
            "--repeat", "1", "--sizes", "56", "--concurrency", "2", "--faces-concurrency", "2",
            "--skip-service-load", "--checkpoint-dir", str(tmp_path / "ckpt")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    latency = out.split("latency, tiny model")[1].split("== 2.")[0]
    rows = {line.split()[0]: line for line in latency.splitlines() if line.split()}
    for path in ("engine", "service", "inline", "grpc", "scope", "http-get", "http-post", "http-bare",
                 "grpc-abort"):
        assert path in rows, out
    assert re.search(r"max rel diff vs engine 0\.0e\+00; p50 vs inline HTTP [+-]\d", rows["grpc"])
    assert "vs engine on image 0: max rel diff service 0.0e+00, inline 0.0e+00, grpc 0.0e+00" in out
    table = out.split("HTTP against gRPC under load, inline answers")[1]
    assert [line.split()[:2] for line in table.splitlines()[3:6]] == \
        [["engine", "2"], ["inline", "2"], ["grpc", "2"]]
    assert "grpc/inline HTTP: " in table
    assert "throughput ratio under load: not measured" in out
