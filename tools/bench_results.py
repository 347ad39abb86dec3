"""The benchmarks' results files: what a tool printed, as JSON the docs page is built from.

Each benchmark under ``tools/`` takes ``--results FILE``: the tables it prints
are then also written to FILE, with the command that made them, the date and
the machine (CPU model, usable cores, memory, GPU, load average before and
after). ``tools/bench_docs.py`` renders ``docs/benchmarks.md`` from the files
in ``benchmarks/``; ``tools/bench_all.py`` re-runs every tool and re-renders.

A tool records a table with :func:`record` where it prints it; outside a
:func:`recording` block that is a no-op, so a run without ``--results`` (and
the tests that call a tool's functions) write nothing.
"""

from __future__ import annotations

import argparse
import contextvars
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
# A free-text word on the machine that detection cannot see ("2 shared cores, other work
# running"); tools/bench_all.py sets it from --host-note.
HOST_NOTE_ENV = "EPD_BENCH_HOST_NOTE"


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Results:
    """One run of one tool: its command, machine, date and the tables it printed."""

    tool: str
    command: str
    started: str
    host: dict[str, Any]
    tables: list[Table] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Results:
        data = json.loads(text)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"results schema {data.get('schema')!r}, expected {SCHEMA}")
        tables = [Table(**t) for t in data["tables"]]
        return cls(tool=data["tool"], command=data["command"], started=data["started"],
                   host=data["host"], tables=tables)


_ACTIVE: contextvars.ContextVar[Results | None] = contextvars.ContextVar("bench_results", default=None)


def record(title: str, header: Sequence[Any], rows: Sequence[Sequence[Any]], note: str = "") -> None:
    """Add a printed table to the results being recorded (nothing outside :func:`recording`)."""
    results = _ACTIVE.get()
    if results is not None:
        results.tables.append(Table(title, [str(h) for h in header],
                                    [[str(c) for c in row] for row in rows], note))


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="also write the printed tables, the command, the date and the "
                        "machine to FILE as JSON (docs/benchmarks.md is generated from such "
                        "files by tools/bench_docs.py)")


@contextmanager
def recording(tool: str, path: Path | None, argv: Sequence[str] | None = None) -> Iterator[Results | None]:
    """Record the tables printed inside the block; write them to ``path`` when it ends well."""
    if path is None:
        yield None
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    results = Results(tool=tool, command=command_line(tool, argv),
                      started=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                      host=host(load_key="load_before"))
    token = _ACTIVE.set(results)
    try:
        yield results
    finally:
        _ACTIVE.reset(token)
    results.host["load_after"] = host(load_key="load_after")["load_after"]
    if not results.tables:
        raise RuntimeError(f"{tool} printed no table to record in {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results.to_json())
    print(f"results written to {path}")


def command_line(tool: str, argv: Sequence[str]) -> str:
    """``python tools/TOOL.py ARGS`` without the ``--results`` option itself."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--results":
            skip = True
            continue
        if arg.startswith("--results="):
            continue
        kept.append(arg)
    return shlex.join(["python", f"tools/{tool}.py", *kept])


def host(load_key: str = "load_before") -> dict[str, Any]:
    """What a reader needs to weigh the numbers: the machine and how busy it was."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpu": _gpu(),
        "python": platform.python_version(),
        load_key: round(os.getloadavg()[0], 1),
    }
    if note := os.environ.get(HOST_NOTE_ENV):
        info["note"] = note
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpu() -> str:
    """The GPUs ``nvidia-smi`` lists, or "none" (no torch import: some tools never load it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none"
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        return "none"
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
