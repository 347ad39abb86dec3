"""The epd-trio commands' help: a version, short pages, option groups, examples that parse."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator

import pytest

from epd_trio import __version__
from epd_trio._options import GROUPS, config_fields, flag_name, grouped_fields
from epd_trio.cli import build_parser, main
from epd_trio.config import (
    APIS,
    BootstrapConfig,
    EncoderConfig,
    EngineConfig,
    config_from_args,
)

CONFIG_OF = {"encoder": EncoderConfig, "bootstrap": BootstrapConfig, "demo": EngineConfig}


@pytest.fixture(autouse=True)
def terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse wraps to the terminal: the same width wherever the tests run."""
    monkeypatch.setenv("COLUMNS", "100")


def run_help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    assert exited.value.code == 0 and not err, err
    return out


def subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_help(capsys, "--version") == f"epd-trio {__version__}\n"


def test_the_main_help_lists_the_commands_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, "--help")
    for command in ("encoder", "bootstrap", "demo", "make-tiny-model"):
        assert re.search(rf"^    {command}\b", out, re.MULTILINE), command
    assert "--version" in out and "examples:\n" in out


@pytest.mark.parametrize("command", ["encoder", "bootstrap", "demo"])
def test_the_short_page_names_every_group_and_shows_few_options(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, command, "--help")
    assert out.startswith(f"usage: epd-trio {command} [options]\n\n")
    assert "options most runs need:" in out and "examples:\n" in out
    groups = grouped_fields(CONFIG_OF[command])
    for title in groups:
        assert re.search(rf"^  {title} +{re.escape(GROUPS[title][:20])}", out, re.MULTILINE), title
    shown = set(re.findall(r"^  (--[a-z-]+)", out, re.MULTILINE))
    assert 2 <= len(shown) <= 9 and len(out.splitlines()) < 80, out


def test_demo_help_leaves_the_engine_options_to_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, "demo", "--help")
    assert "--encoders N" in out and "--transfer-backend {zmq,mooncake}" in out and "--model-path" in out
    assert "--max-video-pixels" not in out and "--preprocess-mode" not in out
    assert "--max-video-pixels N" in run_help(capsys, "demo", "--help=all")


@pytest.mark.parametrize("command", ["encoder", "bootstrap", "demo"])
def test_help_all_shows_every_option_in_its_group_with_readable_defaults(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, command, "--help=all")
    headings = re.findall(r"^([a-z]+):\n  \S", out, re.MULTILINE)
    assert headings == ["options", *grouped_fields(CONFIG_OF[command]), "examples"], headings
    for f, _ in config_fields(CONFIG_OF[command]):
        assert flag_name(f.name) in out, f.name
    flat = " ".join(out.split())
    for wrong in ("default: None", "default: ()", "default: ''", "134217728", "default: 180.0",
                  "default 'INFO'"):
        assert wrong not in flat
    if command != "demo":
        assert "--log-level {DEBUG,INFO,WARNING,ERROR,CRITICAL}" in out and "[default: INFO]" in flat
    if command == "encoder":
        assert "--max-body-bytes SIZE" in out and "[default: 128MiB]" in flat
        assert f"--api {{{','.join(APIS)}}}" in out and "--dtype {auto,float32,bfloat16,float16}" in out
        assert "[env: EPD_REQUEST_TIMEOUT; with --api sglang also SGLANG_ENCODER_REQ_TIMEOUT]" in flat


def test_help_on_one_group_shows_that_group_only(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, "encoder", "--help=delivery")
    assert out.startswith("delivery:\n  " + GROUPS["delivery"])
    flags = set(re.findall(r"^  (--[a-z-]+)", out, re.MULTILINE))
    assert flags == {flag_name(f.name) for f, _ in grouped_fields(EncoderConfig)["delivery"]}
    assert run_help(capsys, "encoder", "--help", "security").startswith("security:\n")


@pytest.mark.parametrize("word", ["timeout", "EPD_SEND_TIMEOUT", "send_timeout"])
def test_help_on_a_word_shows_the_options_whose_names_hold_it(
        word: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_help(capsys, "encoder", f"--help={word}")
    flags = re.findall(r"^  (--[a-z-]+)", out, re.MULTILINE)
    assert "--send-timeout" in flags and all(f.endswith("timeout") for f in flags), flags


def test_help_on_nothing_known_is_one_line_naming_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bootstrap", "--help=gpu"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert ("no option group or option matches 'gpu'; the groups: serving, registry, security, "
            "operations") in err


def test_make_tiny_model_explains_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    parser = subparsers()["make-tiny-model"]
    assert all(action.help for action in parser._actions)
    out = run_help(capsys, "make-tiny-model", "--help")
    flat = " ".join(out.split())
    assert "random weights" in flat and "examples:" in out
    for arch in ("qwen2_5_vl (Qwen2.5-VL)", "qwen2_audio (Qwen2-Audio)"):
        assert arch in flat
    assert "seed of the random weights" in flat and "[default: 0]" in flat


def test_every_command_has_a_description_and_examples() -> None:
    for name, parser in subparsers().items():
        assert parser.description and len(parser.description) > 80, name
        assert parser.epilog and parser.epilog.startswith("examples:\n"), name


def examples() -> Iterator[tuple[str, str]]:
    """Every command line in the commands' examples, continuation lines joined."""
    for name, parser in {"epd-trio": build_parser(), **subparsers()}.items():
        text = re.sub(r"\\\n\s*", "", parser.epilog or "")
        for line in text.splitlines():
            if "epd-trio " in line and not line.lstrip().startswith("#") and "COMMAND" not in line:
                yield name, line.strip()


@pytest.mark.parametrize(("where", "line"), list(examples()))
def test_every_example_parses_into_a_valid_config(where: str, line: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    words = shlex.split(line)
    environ = dict(word.split("=", 1) for word in words if re.fullmatch(r"[A-Z_]+=.*", word))
    argv = [word for word in words if word.split("=", 1)[0] not in environ][1:]
    if any(word.startswith("--help") for word in argv):
        assert run_help(capsys, *argv)
        return
    args = build_parser().parse_args(argv)
    if args.command in CONFIG_OF:
        config_from_args(CONFIG_OF[args.command], args, environ)  # raises if the example is wrong
