"""Run every benchmark, keep each one's results file, and regenerate the docs page.

    python tools/bench_all.py --quick --host-note "2 shared cores"   # each tool's quick mode
    python tools/bench_all.py                                         # the full runs (long)
    python tools/bench_all.py --quick --only bench_service bench_transfer

Each tool runs in its own process with ``--results benchmarks/TOOL.json``; a
tool that fails or runs past ``--timeout`` keeps its previous results file and
is named at the end (exit status 1). Then ``tools/bench_docs.py`` renders
``docs/benchmarks.md`` from ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_docs  # noqa: E402
import bench_results  # noqa: E402

# tool → (quick arguments, full arguments); the order is the docs page's.
TOOLS: dict[str, tuple[list[str], list[str]]] = {
    # The quick case is an embedder's on a CPU (docs/batching.md): 16 callers, max batch 8.
    "bench_engine": (["--quick", "--concurrency", "16", "--max-batch-size", "8", "--images", "16",
                      "--sizes", "448"], []),
    "bench_service": (["--quick"], []),
    "bench_capacity": (["--quick", "--null-forward"], ["--null-forward"]),
    "bench_preprocess": (["--quick"], []),
    "bench_production": (["--quick"], []),
    "bench_transfer": (["--quick", "--plot", ""], ["--plot", ""]),
    "bench_loop_stall": (["--repeat", "3"], []),
    "bench_grpc_guard": (["--calls", "1000", "--repeat", "3"], []),
    "probe_grpc": (["--quick", "--candidates", "A", "A2", "B", "C"], ["--candidates", "A", "A2", "B", "C"]),
    "chaos_soak": (["--duration", "60"], ["--duration", "600"]),
    "bench_epd": (["--quick"], []),
}


def run_tool(tool: str, extra: Sequence[str], out: Path, timeout: float) -> str | None:
    """Run one tool; ``None`` when it wrote its results, else why not."""
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *extra, "--results", str(out)]
    print(f"\n==== {tool}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"ran past {timeout:g} s"
    print(f"==== {tool}: exit {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    return None if done.returncode == 0 else f"exit status {done.returncode}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each tool's quick mode")
    parser.add_argument("--only", nargs="+", choices=list(TOOLS), metavar="TOOL",
                        help=f"run only these tools ({', '.join(TOOLS)})")
    parser.add_argument("--host-note", default=None,
                        help="a word on the machine detection cannot see, shown with the results "
                        "(e.g. '2 shared cores, other work running')")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per tool (default 3600)")
    parser.add_argument("--results-dir", type=Path, default=bench_docs.RESULTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.host_note:
        os.environ[bench_results.HOST_NOTE_ENV] = args.host_note
    env_defaults = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
                    "MC_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}
    for key, value in env_defaults.items():
        os.environ.setdefault(key, value)
    failed: dict[str, str] = {}
    for tool in args.only or TOOLS:
        quick, full = TOOLS[tool]
        why = run_tool(tool, quick if args.quick else full, args.results_dir / f"{tool}.json", args.timeout)
        if why:
            failed[tool] = why
    bench_docs.write_page(args.results_dir)
    print(f"\nwrote {bench_docs.PAGE.relative_to(ROOT)}")
    for tool, why in failed.items():
        print(f"{tool} FAILED ({why}): its previous results, if any, are kept")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
