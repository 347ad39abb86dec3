"""Running SGLang 0.5.23's own code (``sglang_driver.py``) in subprocesses.

SGLang's tree lives in ``<repo>/.sglang`` (or ``EPD_SGLANG_DIR``), installed by
``tools/sglang_env.sh``, and is put on ``PYTHONPATH`` only for the driver's
processes: importing it in the test process would drag its pinned
FastAPI/pydantic stack, its import-time warnings and its global state along.

Tests take the ``sglang_env`` fixture (imported from here: a ``conftest.py`` in
this folder would shadow ``tests/conftest.py``, which other tests import by
name). Without the environment they skip, unless ``EPD_REQUIRE_SGLANG=1`` (CI),
where a missing or stale one fails them.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tools" / "sglang-requirements.txt"
DRIVER = Path(__file__).with_name("sglang_driver.py")
STAMP_NAME = ".epd-sglang-installed"  # written by tools/sglang_env.sh once SGLang imports
DRIVER_TIMEOUT = 600.0  # importing SGLang alone takes ~10 s, a minute on a busy machine


def sglang_dir() -> Path:
    return Path(os.environ.get("EPD_SGLANG_DIR") or ROOT / ".sglang")


def expected_stamp() -> str:
    """Must match what tools/sglang_env.sh writes: the pinned list's hash and the Python."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    return f"{digest} py{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class SGLangEnv:
    path: Path

    def command(self, *args: str) -> list[str]:
        return [sys.executable, str(DRIVER), *args]

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {**env, "PYTHONPATH": str(self.path), "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="session")
def sglang_env() -> SGLangEnv:
    """The interop environment; skip (or, required, fail) when missing or stale."""
    path = sglang_dir()
    stamp = path / STAMP_NAME
    have = stamp.read_text().strip() if stamp.is_file() else None
    if have == expected_stamp():
        return SGLangEnv(path)
    problem = (f"the SGLang interop environment in {path} is "
               f"{'missing' if have is None else 'stale'}: run `bash tools/sglang_env.sh`")
    if os.environ.get("EPD_REQUIRE_SGLANG") == "1":
        pytest.fail(problem)
    pytest.skip(problem)


class DriverProcess:
    """One long-lived ``sglang_driver.py MODE``: a command line in, an ``EPD-DRIVER`` line back.

    Synchronous, so one process serves a whole test module (or the session) and
    SGLang is imported once; its stderr (SGLang's logs) goes to a file the
    failure message quotes.
    """

    def __init__(self, env: SGLangEnv, mode: str, log: Path, extra_env: dict[str, str] | None = None) -> None:
        self._log = log
        with self._log.open("wb") as out:
            self._process = subprocess.Popen(env.command(mode), env={**env.environ(), **(extra_env or {})},
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                             text=True)
        self._lines: queue.Queue[list[str] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            assert self._next(DRIVER_TIMEOUT) == ["READY"], self.log_tail()
        except BaseException:
            self.close()  # a driver that never got ready is not left running
            raise

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("EPD-DRIVER "):
                self._lines.put(line.rstrip("\n").split(" ", 2)[1:])
        self._lines.put(None)

    def _next(self, timeout: float) -> list[str]:
        try:
            words = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the SGLang driver said nothing for {timeout} s\n{self.log_tail()}") from None
        assert words is not None, f"the SGLang driver exited\n{self.log_tail()}"
        return words

    def command(self, line: str, timeout: float) -> list[str]:
        """Send one command line; the driver's answer as its words (the first, then the rest)."""
        assert self._process.stdin is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        return self._next(timeout)

    def log_tail(self, chars: int = 6000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


class LanguageServer(DriverProcess):
    """``sglang_driver.py serve``: SGLang's language-server receiver code, one request at a time."""

    def __init__(self, env: SGLangEnv, workdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self._workdir = workdir
        self._count = 0
        # Loopback only; Mooncake over TCP; no GPU embedding pool (SGLang's default would be one).
        super().__init__(env, "serve", workdir / "sglang-language-side.log",
                         {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1",
                          "SGLANG_EMBEDDING_POOL_SIZE_MB": "0", **(extra_env or {})})

    def request(self, timeout: float = 300.0, **command: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """One request through SGLang's code; its JSON answer and the tensors SGLang assembled."""
        from safetensors.torch import load_file

        self._count += 1
        out = self._workdir / f"result{self._count}.safetensors"
        word, payload = self.command(json.dumps({**command, "out": str(out)}), timeout)
        assert word == "RESULT", (word, payload)
        answer = json.loads(payload)
        assert "crash" not in answer, f"{answer['crash']}\n{self.log_tail()}"
        return answer, load_file(out)


class Decoder(DriverProcess):
    """``sglang_driver.py decode-serve``: SGLang's receiver reads the messages in a directory.

    One process for the whole session: importing SGLang's receiver takes ~15 s here,
    and each test that decodes used to pay it in a fresh ``decode`` process.
    """

    def __init__(self, env: SGLangEnv, workdir: Path) -> None:
        super().__init__(env, "decode-serve", workdir / "sglang-decoder.log")

    def decode(self, directory: Path) -> None:
        """What ``decode DIR`` does (see ``sglang_driver``), in this process."""
        words = self.command(str(directory), DRIVER_TIMEOUT)
        assert words[0] == "DONE", f"{words}\n{self.log_tail()}"


@pytest.fixture(scope="module")
def language_server(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[LanguageServer]:
    server = LanguageServer(sglang_env, tmp_path_factory.mktemp("sglang_language_side"))
    try:
        yield server
    finally:
        server.close()


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)


def once_per_session(request: pytest.FixtureRequest, key: pytest.StashKey[T], make: Callable[[], T]) -> T:
    """``make()`` once for the whole session, closed at its end.

    Each test module imports a session fixture from here, and so gets its own instance
    of it: the object lives in the session's stash instead.
    """
    found = request.config.stash.get(key, None)
    if found is None:
        found = request.config.stash[key] = make()
        request.config.add_cleanup(found.close)
    return found


_DECODER = pytest.StashKey[Decoder]()


@pytest.fixture(scope="session")
def sglang_decoder(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> Decoder:
    return once_per_session(request, _DECODER,
                            lambda: Decoder(sglang_env, tmp_path_factory.mktemp("sglang_decoder")))
