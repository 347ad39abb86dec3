"""Flags and EPD_* variables map onto the config dataclasses in one place."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from epd_trio.config import (
    BootstrapConfig,
    ClientConfig,
    EncoderConfig,
    EngineConfig,
    add_config_arguments,
    available_cores,
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


def test_types_and_optional_fields(tmp_path: Path) -> None:
    cfg = config_from_env(EngineConfig, {"EPD_COALESCE_DELAY": "0.25", "EPD_MEDIA_ROOT": str(tmp_path)})
    assert cfg.coalesce_delay == 0.25 and cfg.media_root == str(tmp_path) and cfg.model_path is None


@pytest.mark.parametrize(("cls", "values", "message"), [
    (EncoderConfig, {"request_timeout": float("nan")}, r"request_timeout \(--request-timeout\) must be a finite"),
    (EncoderConfig, {"drain_timeout": float("inf")}, "drain_timeout .* must be a finite number, got inf"),
    (BootstrapConfig, {"health_interval": float("nan")}, "health_interval .* must be a finite"),
    (ClientConfig, {"timeout": float("nan")}, "timeout .* must be a finite"),
    (EngineConfig, {"coalesce_delay": float("nan")}, "coalesce_delay .* must be a finite"),
    (EncoderConfig, {"zmq_sndhwm": 10**20}, "zmq_sndhwm .* must fit in 64 bits"),
    (EncoderConfig, {"zmq_sndhwm": 2**31}, r"zmq_sndhwm .* must be at most 2147483647"),
    (EncoderConfig, {"zmq_idle_close": -1.0}, r"zmq_idle_close \(--zmq-idle-close\) must be > 0"),
    (EncoderConfig, {"health_fresh": -5.0}, "health_fresh .* must be >= 0"),
    (EncoderConfig, {"port": 9000, "grpc_port": 9000}, "grpc_port .* must differ from port"),
    (EncoderConfig, {"log_level": "garbage"}, "log_level .* must be one of DEBUG, INFO"),
    (BootstrapConfig, {"log_level": "loud"}, "log_level .* must be one of"),
    (EngineConfig, {"max_redirects": -1}, "max_redirects .* must be >= 0"),
    (EngineConfig, {"cpu_threads": available_cores() + 1}, "cpu_threads .* must be at most the"),
    (EngineConfig, {"preprocess_threads": 1025}, "preprocess_threads .* must be at most 1024"),
    (EngineConfig, {"device": "cuda", "cpu_threads": 1025}, "cpu_threads .* must be at most 1024"),
    (EngineConfig, {"device": "meta"}, r"device \(--device\) must be cpu, cuda or cuda:N"),
    (EngineConfig, {"device": "cuda:0,tpu"}, "got 'tpu'"),
    (EngineConfig, {"preprocess_device": "garbage"}, "preprocess_device .* must be cpu, cuda"),
    (EngineConfig, {"media_root": "/nonexistent/media"}, "media_root .* must be an existing directory"),
])
def test_values_no_component_could_use_are_refused_naming_the_flag(
        cls: type, values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**values)


def test_what_a_gpu_or_logging_user_writes_is_still_taken() -> None:
    assert EngineConfig(device="cuda:0,cuda:1", cpu_threads=available_cores() + 8).cpu_threads > 0
    assert EngineConfig(device="cpu:0").devices == ("cpu:0",)
    assert EncoderConfig(log_level="warn").log_level == "warn"


def test_a_profile_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="profile_dir .* must be a directory"):
        EncoderConfig(profile_dir=str(tmp_path / "file"))
    assert EncoderConfig(profile_dir=str(tmp_path / "new")).profile_dir == str(tmp_path / "new")


@pytest.mark.parametrize(("env", "message"), [
    ({"EPD_MAX_BATCH_SIZE": "eight"}, "EPD_MAX_BATCH_SIZE: expected int"),
    ({"EPD_MAX_BATCH_SIZE": "0"}, r"max_batch_size \(--max-batch-size\) must be at least 1"),
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
    assert table in (root / "docs" / "configuration.md").read_text(), \
        "run tools/config_table.py and update docs/configuration.md"


@pytest.mark.parametrize(("env", "message"), [
    ({"EPD_VIDEO_FPS": "0"}, r"video_fps \(--video-fps\) must be > 0"),
    ({"EPD_MAX_AUDIO_SECONDS": "-1"}, r"max_audio_seconds \(--max-audio-seconds\) must be > 0"),
    ({"EPD_MAX_VIDEO_FRAMES": "0"}, r"max_video_frames \(--max-video-frames\) must be at least 1"),
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
    (["--zmq-sndhwm", "0"], r"zmq_sndhwm \(--zmq-sndhwm\) must be at least 1"),
])
def test_bad_sglang_settings_say_which(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encoder_config(flags, {})


def test_sglang_api_reads_the_real_process_environment() -> None:
    # os.environ refuses a None key: a field without an SGLang alias must not be looked up.
    assert config_from_env(EncoderConfig, environ=os.environ, api="sglang").api == "sglang"


def test_http_server_is_one_of_the_two() -> None:
    assert EncoderConfig().http_server == "builtin" and BootstrapConfig().http_server == "builtin"
    assert EncoderConfig(http_server="hypercorn").http_server == "hypercorn"
    for cls in (EncoderConfig, BootstrapConfig):
        with pytest.raises(ValueError, match=r"http_server \(--http-server\) must be one of builtin, hypercorn"):
            cls(http_server="nginx")
