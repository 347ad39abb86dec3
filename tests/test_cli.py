"""The epd-trio command."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epd_trio.cli import main
from epd_trio.model.tiny import is_tiny_model


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_make_tiny_model(tmp_path: Path, arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-tiny-model", str(tmp_path / arch), "--arch", arch]) == 0
    assert is_tiny_model(tmp_path / arch)
    assert (tmp_path / arch / "preprocessor_config.json").exists()
    assert f'"model_type": "{arch}"' in (tmp_path / arch / "config.json").read_text()
    assert "RANDOM" in capsys.readouterr().out


def test_demo_prints_a_table(qwen25_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model-path", qwen25_path, "--max-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "1024x768" in out and "grid_thw" in out and "tokens" in out
    assert "RANDOM tiny weights" in out


def test_bad_flag_value_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model-path", "/nonexistent/model"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "log_level", "expected"), [
    (None, "info", "WARNING"), (None, "debug", "INFO"), ("ERROR", "debug", "ERROR")])
def test_the_mooncake_log_level_follows_ours_unless_set(
        monkeypatch: pytest.MonkeyPatch, given: str | None, log_level: str, expected: str) -> None:
    if given is None:
        monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MC_LOG_LEVEL", given)
    monkeypatch.setenv("EPD_LOG_LEVEL", log_level)
    assert main(["demo", "--model-path", "/nonexistent/model"]) == 2
    assert os.environ["MC_LOG_LEVEL"] == expected


def test_demo_over_mooncake(qwen25_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("EPD_REQUIRE_MOONCAKE") != "1":
        pytest.importorskip("mooncake.engine", reason="Mooncake is an optional extra (epd-trio[mooncake-cpu])")
    assert main(["demo", "--model-path", qwen25_path, "--transfer-backend", "mooncake"]) == 0
    out = capsys.readouterr().out
    assert "delivery over Mooncake" in out and "equals a local engine encode: yes" in out
