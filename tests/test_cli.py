"""The epd-trio command."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import spawn
from epd_trio import cli
from epd_trio._util import leaves
from epd_trio.cli import configure_logging, main
from epd_trio.errors import ModelLoadError
from epd_trio.model.loader import INDEX_FILE
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


@pytest.mark.parametrize(("argv", "message"), [
    (["encoder", "--port", "abc"], "epd-trio encoder: error: argument --port: expected int, got 'abc'"),
    (["encoder", "--max-body-bytes", "1e9"], "argument --max-body-bytes: expected int, got '1e9'"),
    (["demo", "--encoders", "0"], "argument --encoders: must be in 1..16, got 0"),
    (["make-tiny-model", "x", "--seed", str(2**64)], "argument --seed: must be in 0..9223372036854775807"),
])
def test_a_flag_value_of_the_wrong_kind_is_one_line(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(("argv", "message"), [
    (["encoder", "--log-level", "garbage"], "log_level (--log-level, EPD_LOG_LEVEL) must be one of"),
    (["bootstrap", "--health-interval", "nan"], "health_interval (--health-interval) must be a finite"),
    (["encoder", "--device", "cuda:0,meta"], "device (--device) must be cpu, cuda or cuda:N"),
])
def test_a_value_no_component_can_use_is_one_line_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-trio: error: {message}") and len(err.splitlines()) == 1, err


def test_make_tiny_model_never_writes_over_other_files(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    for target, message in (("", "needs a directory"), (str(tmp_path / "real"), "holds files that are no tiny model"),
                            (str(tmp_path / "file"), "is a file, not a directory")):
        assert main(["make-tiny-model", target]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "real" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "real"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket is listening on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.mark.parametrize("command", ["bootstrap", "encoder"])
def test_a_port_in_use_is_one_line_naming_it(command: str, busy_port: int,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The port is bound before the model loads: a missing checkpoint is never reached.
    extra = ["--model-path", "/nonexistent/model"] if command == "encoder" else []
    assert main([command, "--port", str(busy_port), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-trio: error: cannot listen on 127.0.0.1:{busy_port} (--host, --port): "
                          "[Errno "), err
    assert len(err.splitlines()) == 1 and "config.json" not in err


def test_a_grpc_port_in_use_is_said_before_the_model_loads(busy_port: int,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # grpcio binds after the load: checked beforehand, it is our one line, not grpcio's log.
    assert main(["encoder", "--port", "0", "--grpc-port", str(busy_port),
                 "--model-path", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-trio: error: cannot listen on 127.0.0.1:{busy_port} "
                          "(--host, --grpc-port): [Errno "), err
    assert len(err.splitlines()) == 1 and "config.json" not in err


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


@pytest.fixture
def quiet_loggers_restored() -> Iterator[None]:
    """``main`` configures the process's logging: give the next test what it had."""
    saved = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.usefixtures("quiet_loggers_restored")
def test_the_demo_prints_no_http_request_lines(qwen25_path: str, caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_LOG_LEVEL", "info")
    with caplog.at_level(logging.INFO):
        assert main(["demo", "--model-path", qwen25_path, "--encoders", "1"]) == 0
    assert caplog.records, "the demo logged nothing at INFO: the check below proves nothing"
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


@pytest.mark.usefixtures("quiet_loggers_restored")
@pytest.mark.parametrize(("log_level", "httpx_level"), [("info", logging.WARNING), ("debug", logging.NOTSET)])
def test_http_request_lines_only_at_debug(log_level: str, httpx_level: int) -> None:
    configure_logging(log_level)
    assert logging.getLogger("httpx").level == logging.getLogger("httpcore").level == httpx_level


def failing_with(exc: BaseException) -> Callable[[Any], int]:
    def run(args: Any) -> int:
        raise exc
    return run


def group(*excs: BaseException) -> BaseExceptionGroup:
    return BaseExceptionGroup("start-up", [BaseExceptionGroup("inner", list(excs[:1])), *excs[1:]])


def test_a_group_of_expected_errors_is_a_clean_error(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    exc = group(ModelLoadError("no config.json in /x"), ValueError("port in use"))
    monkeypatch.setattr(cli, "_make_tiny_model", failing_with(exc))
    assert main(["make-tiny-model", "unused"]) == 2
    err = capsys.readouterr().err
    assert "epd-trio: error: no config.json in /x" in err and "epd-trio: error: port in use" in err


def test_a_bug_beside_an_expected_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    bug = ZeroDivisionError("a bug")
    monkeypatch.setattr(cli, "_make_tiny_model",
                        failing_with(group(ModelLoadError("no config.json"), bug)))
    with pytest.raises(BaseExceptionGroup) as raised:
        main(["make-tiny-model", "unused"])
    assert bug in list(leaves(raised.value))


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), group(ModelLoadError("expected"), KeyboardInterrupt()),
                                 group(KeyboardInterrupt(), ZeroDivisionError("a bug"))])
def test_an_interrupt_anywhere_exits_as_ctrl_c(monkeypatch: pytest.MonkeyPatch, exc: BaseException,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_make_tiny_model", failing_with(exc))
    assert main(["make-tiny-model", "unused"]) == 130
    assert "interrupted" in capsys.readouterr().err


async def test_ctrl_c_during_the_model_load_exits_promptly(tmp_path: Path, qwen25_path: str) -> None:
    """SIGINT while the encoder loads its model: the load is abandoned and the process exits 0.

    The checkpoint's weight index is a named pipe held open without data: the
    load blocks there for as long as this test wants, the way a slow disk
    would (``read`` releases the GIL). Opening the pipe's writing end returns
    once the encoder has opened it to read: from then on it is loading.
    """
    checkpoint = tmp_path / "slow"
    checkpoint.mkdir()
    for file in Path(qwen25_path).iterdir():
        if file.name != INDEX_FILE:
            (checkpoint / file.name).symlink_to(file)
    fifo = checkpoint / INDEX_FILE
    os.mkfifo(fifo)
    with spawn("encoder", "--port", "0", "--model-path", str(checkpoint)) as proc:
        writer = None
        try:
            with trio.fail_after(120):
                writer = await trio.to_thread.run_sync(os.open, fifo, os.O_WRONLY, abandon_on_cancel=True)
            proc.send_signal(signal.SIGINT)
            code = await trio.to_thread.run_sync(lambda: proc.wait(timeout=30))
            assert code == 0, proc.stderr.read()  # type: ignore[union-attr]
        finally:
            if writer is None:  # let our own abandoned open go
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            else:
                os.close(writer)


def test_start_up_objects_leave_garbage_collection() -> None:
    """The CLI freezes what start-up made once the server is up: a full collection then walks
    only what came after (the embedded model's process held ~4e5 objects, ~0.4 s a walk here)."""
    import gc

    assert gc.get_freeze_count() == 0
    try:
        cli._freeze_startup_objects()
        assert gc.get_freeze_count() > 1000  # pytest, torch and the suite's modules, at least
    finally:
        gc.unfreeze()
