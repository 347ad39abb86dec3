"""The ``epd-trio encoder --api sglang`` subprocesses the SGLang end-to-end tests drive.

One pool for the session: the HTTP tests (``test_sglang_end_to_end``) and the gRPC
tests (``test_sglang_grpc``) ask the same kinds of encoder, and each process costs
~10 s of CPU to import torch and transformers and load its model. Every encoder
serves HTTP and gRPC, so the two modules share them; they start together, at the
first test that needs one, and load in parallel.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import spawn
from sglang_harness import once_per_session

START = 240.0  # seconds for an encoder to load and listen, on a busy 2-core machine

# name: (family, --encoder-transfer-backend)
ENCODERS = {
    "vl_a": ("qwen2_5_vl", "zmq_to_scheduler"),
    "vl_b": ("qwen2_5_vl", "zmq_to_scheduler"),
    "vl_tokenizer": ("qwen2_5_vl", "zmq_to_tokenizer"),
    "vl_tokenizer_b": ("qwen2_5_vl", "zmq_to_tokenizer"),
    "vl3": ("qwen3_vl", "zmq_to_scheduler"),
    "audio": ("qwen2_audio", "zmq_to_scheduler"),
    "vl_mooncake": ("qwen2_5_vl", "mooncake"),
}


@dataclass(frozen=True)
class SharedEncoder:
    http: str  # http://host:port: the HTTP face and /stats
    grpc: str  # grpc://host:port, what SGLang's gRPC receiver is given
    log: Path  # its stderr


class EncoderPool(dict[str, SharedEncoder]):
    """name → a running encoder; closing kills them all."""

    def __init__(self, checkpoints: dict[str, str], root: Path) -> None:
        super().__init__()
        self._stack = ExitStack()
        try:
            ports = {name: free_port() for name in ENCODERS}
            # stderr in a file: a long session must never fill a pipe
            procs = {name: self._stack.enter_context(spawn(
                "encoder", "--api", "sglang", "--encoder-transfer-backend", backend,
                "--port", "0", "--grpc-port", str(ports[name]),
                "--model-path", checkpoints[family], "--dtype", "float32", log=root / f"{name}.log"))
                for name, (family, backend) in ENCODERS.items()}
            for name, proc in procs.items():  # the CLI prints its line once HTTP and gRPC listen
                log = root / f"{name}.log"
                self[name] = SharedEncoder(url_of(proc, log), f"grpc://127.0.0.1:{ports[name]}", log)
        except BaseException:
            self.close()
            raise

    def log_tail(self, name: str, chars: int = 4000) -> str:
        return self[name].log.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        self._stack.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def url_of(proc: subprocess.Popen[str], log: Path) -> str:
    """The encoder's ``listening on`` line, read with a bound (the CLI prints it once ready)."""
    box: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START)
    line = box[0] if box else ""
    assert "listening on http://" in line, (line or "no line in time") + log.read_text()[-4000:]
    return line.rsplit(" ", 1)[1].strip()


_POOL = pytest.StashKey[EncoderPool]()


@pytest.fixture(scope="session")
def sglang_encoders(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                    request: pytest.FixtureRequest) -> EncoderPool:
    return once_per_session(request, _POOL,
                            lambda: EncoderPool(checkpoints, tmp_path_factory.mktemp("sglang_encoders")))
