"""Flags and EPD_* variables map onto the config dataclasses in one place."""

from __future__ import annotations

import argparse

import pytest

from epd_trio.config import EngineConfig, add_config_arguments, config_from_args, config_from_env


def parse(argv: list[str], env: dict[str, str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    return config_from_args(EngineConfig, parser.parse_args(argv), env)


def test_precedence_flag_then_env_then_default() -> None:
    cfg = parse(["--max-batch-size", "4"], {"EPD_MAX_BATCH_SIZE": "2", "EPD_DEVICE": "cuda:1"})
    assert (cfg.max_batch_size, cfg.device, cfg.max_pending) == (4, "cuda:1", 256)


def test_types_and_optional_fields() -> None:
    cfg = config_from_env(EngineConfig, {"EPD_COALESCE_DELAY": "0.25", "EPD_MEDIA_ROOT": "/srv/media"})
    assert cfg.coalesce_delay == 0.25 and cfg.media_root == "/srv/media" and cfg.model_path is None


@pytest.mark.parametrize(("env", "message"), [
    ({"EPD_MAX_BATCH_SIZE": "eight"}, "EPD_MAX_BATCH_SIZE: expected int"),
    ({"EPD_MAX_BATCH_SIZE": "0"}, "max_batch_size must be at least 1"),
])
def test_bad_values_say_which(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_env(EngineConfig, env)


def test_every_field_has_help() -> None:
    import dataclasses

    assert all(f.metadata.get("help") for f in dataclasses.fields(EngineConfig))


def test_readme_config_table_is_current() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = subprocess.run([sys.executable, str(root / "tools" / "config_table.py")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert table in (root / "README.md").read_text(), "run tools/config_table.py and update README"


@pytest.mark.parametrize(("env", "message"), [
    ({"EPD_VIDEO_FPS": "0"}, "video_fps must be > 0"),
    ({"EPD_MAX_AUDIO_SECONDS": "-1"}, "max_audio_seconds must be > 0"),
    ({"EPD_MAX_VIDEO_FRAMES": "0"}, "max_video_frames must be at least 1"),
    ({"EPD_VIDEO_MIN_FRAMES": "8", "EPD_VIDEO_MAX_FRAMES": "4"}, "video_max_frames .4. must be at least"),
])
def test_bad_media_settings_say_which(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_env(EngineConfig, env)


def test_fetch_deny_private_flag_and_variable() -> None:
    assert EngineConfig().fetch_deny_private is False  # loopback and private media servers work by default
    assert config_from_env(EngineConfig, {"EPD_FETCH_DENY_PRIVATE": "1"}).fetch_deny_private is True
    assert parse(["--fetch-deny-private"], {}).fetch_deny_private is True
    assert parse(["--no-fetch-deny-private"], {"EPD_FETCH_DENY_PRIVATE": "yes"}).fetch_deny_private is False
