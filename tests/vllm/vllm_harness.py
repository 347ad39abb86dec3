"""A real vLLM 0.32 server (its CPU build) for the interop tests, from its own venv.

vLLM lives in ``<repo>/.vllm`` (or ``EPD_VLLM_DIR``), a venv built by
``tools/vllm_env.sh``; the tests only run its Python in subprocesses. Tests
take the ``vllm_env`` fixture (imported from here: a ``conftest.py`` in this
folder would shadow ``tests/conftest.py``). Without the environment they
skip, unless ``EPD_REQUIRE_VLLM=1`` (CI), where a missing or stale one fails.
A module that imports the ``storage`` and ``vllm`` fixtures too, and defines a
``model`` fixture (a checkpoint path), gets one vLLM server for all its tests.

``VllmServer`` starts ``vllm.entrypoints.openai.api_server`` on a free port
as an EC consumer of a shared-storage directory, with the settings its CPU
build needs here (``--dtype float32 --enforce-eager``, 1 GiB of KV cache, no
OpenMP pinning); one start costs 25-40 s and ~4 GB, so a test module starts
one and shares it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tools" / "vllm-requirements.txt"
STAMP_NAME = ".epd-vllm-installed"  # written by tools/vllm_env.sh once vLLM imports
START_TIMEOUT = 300.0  # 25-40 s alone; minutes on a busy 2-core machine
SIDE_HASHER = Path(__file__).with_name("vllm_side_hash.py")


def vllm_dir() -> Path:
    return Path(os.environ.get("EPD_VLLM_DIR") or ROOT / ".vllm")


def expected_stamp(python: Path) -> str:
    """Must match what tools/vllm_env.sh writes: the pinned list's hash and the Python."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    version = subprocess.run([str(python), "-c", "import sys; print(f'py{sys.version_info.major}."
                              "{sys.version_info.minor}')"], capture_output=True, text=True,
                             check=True).stdout.strip()
    return f"{digest} {version}"


@dataclass(frozen=True)
class VllmEnv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def environ(self, **extra: str) -> dict[str, str]:
        """The project's PYTHONPATH stays out: vLLM runs on its own packages only."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
                **extra}

    def side_hashes(self, cases: list[dict[str, Any]]) -> list[str]:
        """vLLM's own mm_hash of each case (``vllm_side_hash.py``)."""
        done = subprocess.run([str(self.python), str(SIDE_HASHER)], input=json.dumps(cases),
                              capture_output=True, text=True, env=self.environ(), timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    """The vLLM environment; skip (or, required, fail) when missing or stale."""
    env = VllmEnv(vllm_dir())
    stamp = env.path / STAMP_NAME
    have = stamp.read_text().strip() if stamp.is_file() else None
    if have is not None and env.python.exists() and have == expected_stamp(env.python):
        return env
    problem = (f"the vLLM environment in {env.path} is {'missing' if have is None else 'stale'}: "
               "run `bash tools/vllm_env.sh`")
    if os.environ.get("EPD_REQUIRE_VLLM") == "1":
        pytest.fail(problem)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's shared-storage directory (the EC connectors' ``shared_storage_path``)."""
    return tmp_path_factory.mktemp("ec-storage")


@pytest.fixture(scope="module")
def vllm(vllm_env: VllmEnv, model: str, storage: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The module's vLLM server, an EC consumer of ``storage``, serving the module's ``model``."""
    with vllm_consumer(vllm_env, model, storage, tmp_path_factory.mktemp("logs") / "vllm.log") as server:
        yield server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmServer:
    url: str
    model: str
    log: Path
    process: subprocess.Popen[bytes]

    def chat(self, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        response = httpx.post(f"{self.url}/v1/chat/completions", json={"model": self.model, **body},
                              timeout=timeout)
        assert response.status_code == 200, response.text
        return response.json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def vllm_consumer(env: VllmEnv, model: str, storage: Path | None, log: Path, *,
                  ec: dict[str, Any] | None = None, args: tuple[str, ...] = ()) -> Iterator[VllmServer]:
    """A vLLM server that loads encoder outputs from ``storage`` (ECExampleConnector, ec_consumer),
    or as another ``--ec-transfer-config`` says (its host is 127.0.0.1); ``args`` are more flags."""
    port = free_port()
    if ec is None:
        ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
              "ec_connector_extra_config": {"shared_storage_path": str(storage)}}
    command = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
               "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4",
               "--ec-transfer-config", json.dumps(ec), *args]
    extra = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
             "VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
             "VLLM_HOST_IP": "127.0.0.1"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env.environ(**extra),
                                   start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}", model, log, process)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


def _wait_ready(server: VllmServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"vLLM exited with {server.process.returncode}:\n{server.log_text()[-6000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vLLM did not start in {START_TIMEOUT} s:\n{server.log_text()[-6000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """vLLM's API server and its engine-core child share the session started for them."""
    if process.poll() is None:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
    try:  # the engine core may outlive its parent for a moment
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass
