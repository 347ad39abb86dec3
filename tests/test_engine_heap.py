"""Freed memory kept for the next batch (``engine.heap``) and who applies it (the CLI)."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from epd_trio import cli
from epd_trio.config import EncoderConfig, EngineConfig, config_from_args, config_from_env
from epd_trio.engine import heap

HEAP_MODULE = Path(heap.__file__)

# A process that asks for the same 48 MiB block four times, as a CPU forward asks for its
# activations every batch; bytearray() writes zeros into it, so every page is touched. It
# loads heap.py alone (not the package: no torch), in a fresh process: the tuning is for good.
_PROBE = f"""
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("heap", {str(HEAP_MODULE)!r})
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(48 << 20)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _page_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [int(n) for n in out.split()]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's")
def test_a_block_asked_for_again_costs_no_page_faults_once_kept() -> None:
    untouched, kept = _page_faults("default"), _page_faults("keep")
    # Left alone, glibc maps every 48 MiB block afresh (over its 32 MiB mmap threshold) and
    # the kernel faults its pages in again; kept, the second block reuses the first's pages.
    assert sum(untouched[1:]) > 0
    assert sum(kept[1:]) * 4 <= sum(untouched[1:]), (untouched, kept)
    assert kept[0] > 0  # the first block is paid for once


def test_not_glibc_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    with caplog.at_level(logging.INFO, "epd_trio.engine.heap"):
        assert heap.keep_freed_memory() is False
    assert "not glibc" in caplog.text


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's")
def test_a_refused_mallopt_is_said_and_reported(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """mallopt answers 0 for a value it refuses; the tuning then reports False, with a warning
    (no glibc refuses these values, so the C library is swapped for one that refuses all)."""
    class Refusing:
        @staticmethod
        def mallopt(param: int, value: int) -> int:
            return 0

    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: Refusing())
    with caplog.at_level(logging.WARNING, "epd_trio.engine.heap"):
        assert heap.keep_freed_memory() is False
    assert "refused the malloc tuning" in caplog.text


@pytest.mark.parametrize("trim", [-1, 1 << 31])
def test_a_trim_mallopt_cannot_take_is_refused(trim: int) -> None:
    with pytest.raises(ValueError, match="trim_bytes"):
        heap.keep_freed_memory(trim)


@pytest.mark.parametrize(("config", "applied"), [
    (EncoderConfig(), True),  # the default device is the CPU
    (EncoderConfig(engine=EngineConfig(device="cuda:0,cpu")), True),
    (EncoderConfig(engine=EngineConfig(device="cuda:0")), False),
    (EncoderConfig(cpu_keep_freed_memory=False), False),
])
def test_the_encoder_process_keeps_freed_memory_on_a_cpu_device(
        monkeypatch: pytest.MonkeyPatch, config: EncoderConfig, applied: bool) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli._tune_process(config) is applied
    assert len(calls) == applied


def test_the_flag_and_the_variable_turn_it_off() -> None:
    args = cli.build_parser().parse_args(["encoder", "--no-cpu-keep-freed-memory"])
    assert config_from_args(EncoderConfig, args).cpu_keep_freed_memory is False
    env = config_from_env(EncoderConfig, {"EPD_CPU_KEEP_FREED_MEMORY": "0"})
    assert env.cpu_keep_freed_memory is False
    assert EncoderConfig().cpu_keep_freed_memory is True
