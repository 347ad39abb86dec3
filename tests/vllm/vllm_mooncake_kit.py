"""vLLM's ECMooncakeConnector consumer for the Mooncake tests, and an epd_trio producer beside it.

``ec_consumer`` runs ``vllm_ec_consumer.py`` (vLLM's own connector classes)
in vLLM's venv; ``EcConsumer.command`` sends one JSON command and waits, at
most ``timeout`` seconds, for its one-line answer. ``producer_config`` is the
encoder's ``--ec-transfer-config`` for it.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_harness import VllmEnv, free_port

DRIVER = Path(__file__).with_name("vllm_ec_consumer.py")
START_TIMEOUT = 300.0  # importing vLLM: ~15 s alone, minutes on a busy 2-core machine


def producer_config(control_timeout: float = 5.0) -> str:
    """The encoder's --ec-transfer-config: vLLM's JSON for an ECMooncakeConnector producer."""
    return json.dumps({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                       "ec_connector_extra_config": {"mooncake_protocol": "tcp",
                                                     "control_timeout_s": control_timeout}})


def consumer_config(port: int, buffer_bytes: int) -> dict[str, Any]:
    """A vLLM server's --ec-transfer-config: an ECMooncakeConnector consumer on the CPU."""
    return {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer", "ec_ip": "127.0.0.1",
            "ec_port": port, "ec_buffer_device": "cpu", "ec_buffer_size": buffer_bytes,
            "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}


@dataclass
class EcConsumer:
    control: str  # tcp://127.0.0.1:port, what a request names as consumer_zmq
    process: subprocess.Popen[str]
    log: Path

    def command(self, timeout: float = 60.0, **command: Any) -> dict[str, Any]:
        """Blocking: run it from a thread (``trio.to_thread.run_sync``)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._line(timeout)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                raise AssertionError(f"vLLM's consumer did not answer within {timeout} s:\n"
                                     f"{self.log.read_text(errors='replace')[-6000:]}")
            ready, _, _ = select.select([self.process.stdout], [], [], min(left, 1.0))
            if ready:
                return json.loads(self.process.stdout.readline())

    def stats(self) -> dict[str, Any]:
        return self.command(op="stats")


@contextmanager
def ec_consumer(env: VllmEnv, log: Path, *, buffer_bytes: int = 64 << 20,
                push_wait_timeout: float = 60.0) -> Iterator[EcConsumer]:
    settings = {"port": free_port(), "buffer_bytes": buffer_bytes, "push_wait_timeout_s": push_wait_timeout}
    with log.open("w") as err:
        process = subprocess.Popen([str(env.python), str(DRIVER), json.dumps(settings)], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                   env=env.environ(VLLM_HOST_IP="127.0.0.1"))
    consumer = EcConsumer("", process, log)
    try:
        consumer.control = consumer._line(START_TIMEOUT)["control"]
        yield consumer
    finally:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()  # the driver's end of input: it shuts the connector down
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
