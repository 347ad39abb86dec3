"""``tools/bench_preprocess.py``: a failing mode is dropped and named; the others' tables survive."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import trio

from conftest import load_tool
from epd_trio.model.preprocess import EncoderPreprocessor

SMALL = ["--modes", "thread", "--workers", "1", "--sizes", "224", "--images", "2", "--repeat", "1"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_tool("bench_preprocess")


def run(bench: ModuleType, tiny_model: str, *extra: str) -> int:
    args = bench.parse_args([*SMALL, "--model-path", tiny_model, *extra])
    try:
        trio.run(bench.main, args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def thread_row(out: str) -> list[str]:
    """The images/s table's JPEG 224 row, split into cells."""
    table = out[out.index("images/s"):]
    row = next(line for line in table.splitlines() if line.startswith("| JPEG 224"))
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where CUDA is refused")
def test_a_device_mode_that_cannot_start_leaves_the_cpu_tables(bench, qwen25_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert run(bench, qwen25_path, "--device", "cuda") == 1
    out = capsys.readouterr().out
    assert "mode device:cuda FAILED" in out and "no CUDA device" in out
    assert float(thread_row(out)[1]) > 0  # the thread mode's images/s
    assert "device x1" not in out  # the failed mode has no column


def test_a_mode_failing_mid_run_is_dropped_and_the_others_reported(bench, qwen25_path, capsys,  # type: ignore[no-untyped-def]
                                                                    monkeypatch) -> None:
    real = EncoderPreprocessor.preprocess

    def broken_on_device(self, *args):  # type: ignore[no-untyped-def]
        if self.device is not None:
            raise RuntimeError("nvjpeg: decode failed")
        return real(self, *args)

    monkeypatch.setattr(EncoderPreprocessor, "preprocess", broken_on_device)
    assert run(bench, qwen25_path, "--device", "cpu") == 1
    out = capsys.readouterr().out
    assert "mode device:cpu FAILED" in out and "nvjpeg: decode failed" in out
    assert float(thread_row(out)[1]) > 0
    assert "device x1" not in out


def test_all_modes_working_exit_zero_with_every_column(bench, qwen25_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert run(bench, qwen25_path, "--device", "cpu") == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert "| thread x1 | device x1 |" in out
