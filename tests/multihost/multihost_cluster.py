"""The pieces a multi-host test drives: the agent, the documented recipe, a DNS server.

``AgentProcess`` is ``multihost_agent.py`` on a host, called from the test process
(synchronously: the multi-host tests are plain functions). ``recipe(name)`` is
a code block of ``docs/deployment.md``, the one marked ``<!-- recipe: NAME -->``:
the tests run the deployment page's own commands, so the page cannot drift
from what works.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from multihost_netns import Host

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEPLOYMENT_PAGE = ROOT / "docs" / "deployment.md"
START = 240.0  # seconds a process may take to come up on a busy 2-core machine


def recipe(name: str) -> str:
    """The fenced code block after ``<!-- recipe: name -->`` (and the docs test's own marker,
    if any) in the deployment page."""
    page = DEPLOYMENT_PAGE.read_text()
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*(?:<!-- test:[^\n]*-->\s*)?"
                      rf"```[a-z]*\n(.*?)```", page, re.DOTALL)
    assert found is not None, f"docs/deployment.md has no block marked 'recipe: {name}'"
    return found.group(1)


def run_recipe(host: Host, name: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start the shell block ``name`` on ``host``, as a user would paste it."""
    return host.popen(["bash", "-c", recipe(name)], env={**os.environ, **env}, log=log)


def stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    """SIGTERM its session (the shell and what it started), then wait; SIGKILL past ``timeout``."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=10)


class AgentProcess:
    """``multihost_agent.py`` on ``host``: one JSON line per command, answers matched by id."""

    def __init__(self, host: Host, log: Path) -> None:
        self.log = log
        self.proc = host.popen([sys.executable, str(HERE / "multihost_agent.py")], log=log,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._answers: dict[str, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._box("ready")
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", START)

    def _box(self, key: str) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._answers.setdefault(key, queue.Queue())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("EPD-AGENT "):
                answer = json.loads(line[len("EPD-AGENT "):])
                self._box(str(answer["id"])).put(answer)
        with self._lock:
            for box in self._answers.values():
                box.put({"error": "the agent exited"})

    def send(self, op: str, **fields: Any) -> str:
        key = f"c{next(self._ids)}"
        self._box(key)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": key, "op": op, **fields}) + "\n").encode())
        self.proc.stdin.flush()
        return key

    def wait(self, key: str, timeout: float) -> dict[str, Any]:
        try:
            answer = self._box(key).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the agent did not answer {key} within {timeout} s\n"
                                 f"{self.log_tail()}") from None
        assert answer.get("error") != "the agent exited", self.log_tail()
        return answer

    def call(self, op: str, timeout: float = 120.0, **fields: Any) -> dict[str, Any]:
        return self.wait(self.send(op, timeout=timeout, **fields), timeout + 40)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_until(check: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """``check()`` until truthy (bounded), its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(interval)


class DnsServer:
    """``multihost_dns.py`` on a host, answering from a zone file the test rewrites."""

    def __init__(self, host: Host, zone: Path, log: Path) -> None:
        self.zone = zone
        self.set({})
        self.proc = host.popen([sys.executable, str(HERE / "multihost_dns.py"), host.address, str(zone)],
                               log=log, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        box: list[bytes] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(START)
        assert box and b"EPD-DNS ready" in box[0], log.read_text()[-2000:]

    def set(self, records: dict[str, list[str]]) -> None:
        partial = self.zone.with_suffix(".tmp")
        partial.write_text(json.dumps(records))
        partial.replace(self.zone)  # atomic: a query never reads half a file
