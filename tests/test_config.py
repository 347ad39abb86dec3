"""Flags and EPD_* variables map onto the config dataclasses in one place."""

from __future__ import annotations

import argparse
import os

import pytest

from epd_trio.config import (
    EncoderConfig,
    EngineConfig,
    add_config_arguments,
    config_from_args,
    config_from_env,
)


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


def test_readme_config_table_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # The script's own main(), in this process: a subprocess would only add its imports (~5 s).
    tool = runpy.run_path(str(root / "tools" / "config_table.py"), run_name="config_table")
    capsys.readouterr()
    assert tool["main"]() == 0
    table = capsys.readouterr().out.strip()
    assert table.startswith("**EncoderConfig**")
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


def encoder_config(argv: list[str], env: dict[str, str]) -> EncoderConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EncoderConfig)
    return config_from_args(EncoderConfig, parser.parse_args(argv), env)


def test_sglang_face_flags_and_sglangs_own_timeout_variables() -> None:
    sglang_env = {"SGLANG_ENCODER_REQ_TIMEOUT": "90", "SGLANG_ENCODER_SEND_TIMEOUT": "45"}
    native = encoder_config([], sglang_env)
    assert (native.api, native.request_timeout, native.send_timeout) == ("native", 180.0, 60.0)
    cfg = encoder_config(["--api", "sglang", "--encoder-transfer-backend", "mooncake"], sglang_env)
    assert (cfg.request_timeout, cfg.send_timeout, cfg.uses_mooncake) == (90.0, 45.0, True)
    ours = encoder_config(["--send-timeout", "5"], {**sglang_env, "EPD_API": "sglang",
                                                    "EPD_REQUEST_TIMEOUT": "30"})
    assert (ours.api, ours.encoder_transfer_backend) == ("sglang", "zmq_to_scheduler")
    assert (ours.request_timeout, ours.send_timeout, ours.uses_mooncake) == (30.0, 5.0, False)
    with pytest.raises(ValueError, match="SGLANG_ENCODER_SEND_TIMEOUT: expected float"):
        encoder_config(["--api", "sglang"], {"SGLANG_ENCODER_SEND_TIMEOUT": "soon"})


@pytest.mark.parametrize(("flags", "message"), [
    (["--api", "grpc"], "api must be one of native, sglang"),
    (["--encoder-transfer-backend", "nixl"], "encoder_transfer_backend must be one of"),
    (["--zmq-sndhwm", "0"], "zmq_sndhwm must be at least 1"),
])
def test_bad_sglang_settings_say_which(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encoder_config(flags, {})


def test_sglang_api_reads_the_real_process_environment() -> None:
    # os.environ refuses a None key: a field without an SGLang alias must not be looked up.
    assert config_from_env(EncoderConfig, environ=os.environ, api="sglang").api == "sglang"
