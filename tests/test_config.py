"""Flags and EPD_* variables map onto the config dataclasses in one place."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
from pathlib import Path
from typing import Any

import pytest

from epd_trio._options import GROUPS, config_fields, default_text, parse_size
from epd_trio.config import (
    APIS,
    BootstrapConfig,
    ClientConfig,
    EncoderConfig,
    EngineConfig,
    ProxyConfig,
    _opt,
    add_config_arguments,
    available_cores,
    config_from_args,
    config_from_env,
    env_name,
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
    with pytest.raises(ValueError, match=r"profile_dir .* must be a directory"):
        EncoderConfig(profile_dir=str(tmp_path / "file"))
    assert EncoderConfig(profile_dir=str(tmp_path / "new")).profile_dir == str(tmp_path / "new")


@pytest.mark.parametrize(("env", "message"), [
    ({"EPD_MAX_BATCH_SIZE": "eight"}, "EPD_MAX_BATCH_SIZE: expected int"),
    ({"EPD_MAX_BATCH_SIZE": "0"}, r"max_batch_size \(--max-batch-size\) must be at least 1"),
])
def test_bad_values_say_which(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_env(EngineConfig, env)


COMPONENTS = (EncoderConfig, BootstrapConfig, ProxyConfig, ClientConfig)  # EncoderConfig holds EngineConfig
# What a component cannot start without (the proxy: where to send requests, whom to ask).
REQUIRED: dict[type, dict[str, str]] = {
    ProxyConfig: {"EPD_ENCODER_URLS": "http://e:1", "EPD_PREFILL_DECODE_URLS": "http://l:2"}}


@pytest.mark.parametrize("cls", COMPONENTS)
def test_every_field_has_help_and_a_group(cls: type) -> None:
    # A field added without a group lands in "other" in --help; this says where to fix it.
    for f, _ in config_fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help: give its _opt(...) one"
        assert f.metadata.get("group") in GROUPS, (
            f"{cls.__name__}.{f.name} has no option group: give its _opt(...) group=... "
            f"(one of {', '.join(GROUPS)}); it decides where --help and docs/configuration.md show it")


def test_a_field_without_a_group_still_gets_its_flag_under_other() -> None:
    @dataclasses.dataclass(frozen=True)
    class Late:
        grouped: int = _opt(1, "has a group", group="serving")
        orphan: int = _opt(2, "has none")

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Late)
    titles = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert titles["serving"] == ["grouped"] and titles["other"] == ["orphan"]
    assert config_from_args(Late, parser.parse_args(["--orphan", "5"]), {}).orphan == 5
    with pytest.raises(ValueError, match="unknown option group 'servng': one of serving, model"):
        _opt(1, "a typo", group="servng")


def test_help_texts_speak_of_the_project_only() -> None:
    for cls in COMPONENTS:
        for f, _ in config_fields(cls):
            text = f.metadata["help"]
            assert not re.search(r"as before|README|issue ?#?\d|previously", text, re.IGNORECASE), (f.name, text)


def test_configuration_page_is_current() -> None:
    root = Path(__file__).resolve().parents[1]
    # The tool's own render(), in this process: a subprocess would only add its imports (~5 s).
    tool = runpy.run_path(str(root / "tools" / "config_table.py"), run_name="config_table")
    page = tool["render"]()
    assert (root / "docs" / "configuration.md").read_text() == page, (
        "docs/configuration.md is stale: run python tools/config_table.py")
    assert tool["main"](["--check"]) == 0
    for cls in COMPONENTS:
        for f, _ in config_fields(cls):
            assert f"`{env_name(f.name)}`" in page, f.name
    for title in GROUPS:
        assert f"### {title}\n" in page
    assert "| `--max-body-bytes SIZE` | `EPD_MAX_BODY_BYTES` | `128MiB` |" in page
    assert f"| `--api {{{','.join(APIS)}}}` | `EPD_API` | `native` |" in page
    assert "| `pool_bytes` | `EPD_POOL_BYTES` | `1GiB` |" in page
    assert not re.search(r"`(None|\(\)|''|134217728|180\.0)`", page)


def test_the_configuration_tool_finds_a_stale_page(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[1]
    tool = runpy.run_path(str(root / "tools" / "config_table.py"), run_name="config_table")
    stale = tmp_path / "configuration.md"
    stale.write_text(tool["render"]().replace("`128MiB`", "`134217728`"))
    tool["main"].__globals__["PAGE"] = stale  # the tool's own module namespace, not ours
    assert tool["main"](["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert tool["main"]([]) == 0 and stale.read_text() == tool["render"]()
    assert tool["main"](["--check"]) == 0


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
    (["--api", "grpc"], rf"api \(--api\) must be one of {', '.join(APIS)}, got 'grpc'"),
    (["--encoder-transfer-backend", "nixl"],
     r"encoder_transfer_backend \(--encoder-transfer-backend\) must be one of"),
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


# The settings that take one of a few values: each field's ``choices`` are what --help shows
# and what the dataclass checks; the values themselves live only in epd_trio/config.py.
ENUMS = [(EncoderConfig, "api"), (EncoderConfig, "http_server"), (EncoderConfig, "transfer_backend"),
         (EncoderConfig, "encoder_transfer_backend"), (EncoderConfig, "mooncake_protocol"),
         (EngineConfig, "dtype"), (EngineConfig, "preprocess_mode"), (BootstrapConfig, "http_server"),
         (ClientConfig, "transfer_backend"), (ClientConfig, "mooncake_protocol")]


@pytest.mark.parametrize(("cls", "name"), ENUMS)
def test_choices_are_one_list_shown_and_checked(cls: type, name: str) -> None:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    choices = field.metadata["choices"]
    assert len(choices) >= 2 and field.default in choices
    for value in choices:
        try:
            assert getattr(cls(**{name: value}), name) == value
        except ValueError as exc:  # a value may need company (--api vllm: --ec-transfer-config)
            assert "must be one of" not in str(exc), exc  # noqa: PT017 - any other refusal may pass
    with pytest.raises(ValueError, match=rf"{name} \(--{name.replace('_', '-')}\) must be one of "
                                         rf"{', '.join(choices)}, got 'bogus'"):
        cls(**{name: "bogus"})
    with pytest.raises(ValueError, match="must be one of"):
        config_from_env(cls, {env_name(name): "bogus"})
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    assert "{" + ",".join(choices) + "}" in parser.format_help().replace("\n", "").replace(" ", "")


def test_the_loader_takes_the_dtypes_the_config_offers() -> None:
    from epd_trio import config
    from epd_trio.model import loader

    assert loader.DTYPES is config.DTYPES


@pytest.mark.parametrize(("raw", "size"), [
    ("134217728", 128 << 20), ("0", 0), ("128MiB", 128 << 20), ("128mib", 128 << 20), ("128M", 128 << 20),
    ("64MB", 64 << 20), ("16 KiB", 16 << 10), ("16K", 16 << 10), ("1.5GiB", 3 << 29), ("2Ti", 2 << 40),
    ("512B", 512)])
def test_a_size_is_bytes_or_a_number_with_a_unit(raw: str, size: int) -> None:
    assert parse_size(raw) == size


@pytest.mark.parametrize("raw", ["1e9", "1.5", "-1", "12XB", "0.3KiB", "", "MiB", "1 2"])
def test_a_bad_size_says_what_a_size_is(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"expected int, got {re.escape(repr(raw))}: a size is whole bytes"):
        parse_size(raw)


def test_size_settings_take_units_from_flags_and_variables() -> None:
    cfg = encoder_config(["--max-body-bytes", "256MiB"],
                         {"EPD_MAX_ITEM_BYTES": "32MiB", "EPD_MAX_HEADER_BYTES": "8192"})
    sizes = (cfg.max_body_bytes, cfg.engine.max_item_bytes, cfg.max_header_bytes)
    assert sizes == (256 << 20, 32 << 20, 8192)
    assert config_from_env(ClientConfig, {"EPD_POOL_BYTES": "2GiB"}).pool_bytes == 2 << 30
    with pytest.raises(ValueError, match="EPD_MAX_ITEM_BYTES: expected int, got '32 MB please'"):
        config_from_env(EngineConfig, {"EPD_MAX_ITEM_BYTES": "32 MB please"})


def test_defaults_read_as_a_user_types_them() -> None:
    shown = {f.name: default_text(f) for cls in (ClientConfig, EncoderConfig) for f, _ in config_fields(cls)}
    assert {name: shown[name] for name in ("port", "request_timeout", "coalesce_delay", "max_body_bytes",
                                           "max_header_bytes", "pool_bytes", "compile",
                                           "cpu_keep_freed_memory", "grpc_port", "register_url",
                                           "mooncake_device", "video_fps", "host")} == {
        "port": "8000", "request_timeout": "180", "coalesce_delay": "0", "max_body_bytes": "128MiB",
        "max_header_bytes": "16KiB", "pool_bytes": "1GiB", "compile": "off", "cpu_keep_freed_memory": "on",
        "grpc_port": "", "register_url": "", "mooncake_device": "", "video_fps": "2", "host": "127.0.0.1"}


@pytest.mark.parametrize("cls", COMPONENTS)
def test_every_default_as_shown_reads_back_as_the_default(cls: type) -> None:
    # "As a user types them": each shown default, given as its variable, is the default again.
    for f, _ in config_fields(cls):
        if text := default_text(f):
            config = config_from_env(cls, {**REQUIRED.get(cls, {}), env_name(f.name): text})
            owner = config if f.name in {g.name for g in dataclasses.fields(cls)} else config.engine
            assert getattr(owner, f.name) == f.default, (f.name, text)
