"""The real-clock chaos world: servers in subprocesses, receivers, media and checks.

Shared by ``tests/chaos/test_chaos_real.py`` (CI) and ``tools/chaos_soak.py``
(the soak), which both drive the scenarios of ``real_scenarios`` against real
Hypercorn servers and real ZMQ sockets on loopback. Nothing here is a fake:
``ServerProcess`` runs ``python -m epd_trio.cli encoder|bootstrap`` and can
SIGKILL and restart it on the same port; ``StuckReceiver`` is a bound ZMQ PULL
socket that is never read; ``settle`` polls ``/stats`` until
``quiescence_problems`` finds nothing live.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import trio
import zmq
from PIL import Image

from epd_trio.client import EncoderClient
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.messages import EmbeddingHeader
from epd_trio.testing import quiescence_problems
from epd_trio.transport.zmq import PullReceiver

__all__ = [
    "Media",
    "MessageSink",
    "References",
    "ServerProcess",
    "StuckReceiver",
    "World",
    "check_inline",
    "encoder_stats",
    "settle",
]

# Past its deadline by more than this, a caller counts as hung. Loopback round
# trips take milliseconds; this covers a loaded 2-core machine (the client's
# shielded /abort after a timeout is bounded by its abort_timeout, set below it).
SLACK = 1.0
# /stats must be back to idle within this: an error notice to a receiver that
# vanished or stopped reading may take min(send_timeout, 5 s) after the answer.
SETTLE_TIMEOUT = 10.0
RTOL = ATOL = 1e-4

REPO = Path(__file__).resolve().parents[2]


# ---- media and the reference embeddings ----------------------------------------------------
# Small images keep requests short (timeouts, drops and aborts land at every stage);
# large ones keep a forward busy long enough to be killed mid-batch, and their
# embeddings (~100-160 KB each) fill a stuck receiver's buffers within a few requests.
SMALL = [(56, 56), (84, 56), (112, 112), (140, 112), (168, 168), (224, 196)]
LARGE = [(448, 448), (504, 448), (560, 504)]


class Media:
    """A fixed bank of random PNG images as ``data:`` URIs; an item is its index."""

    def __init__(self) -> None:
        self.sizes = SMALL + LARGE
        self.small = list(range(len(SMALL)))
        self.large = list(range(len(SMALL), len(self.sizes)))
        self.uris = [_png_uri(w, h, seed=100 + i) for i, (w, h) in enumerate(self.sizes)]

    def items(self, indices: Sequence[int]) -> list[str]:
        return [self.uris[i] for i in indices]


def _png_uri(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class References:
    """Each bank item's embedding, encoded alone on a clean path; checks what callers got."""

    def __init__(self, media: Media) -> None:
        self.media = media
        self.embeddings: dict[int, torch.Tensor] = {}

    async def from_engine(self, engine: Any) -> None:
        """From an in-process engine (the CI test): the encoder's own output."""
        for i, uri in enumerate(self.media.uris):
            out = await engine.encode([uri], "image")
            self.embeddings[i] = out.embedding.detach().clone().float()

    async def from_client(self, client: EncoderClient) -> None:
        """From a clean earlier encode through the client (the soak: encoders are remote)."""
        for i, uri in enumerate(self.media.uris):
            async with await client.encode({"image": [uri]}) as result:
                self.embeddings[i] = result.embeddings["image"].clone().float()

    def check(self, indices: Sequence[int], tensor: torch.Tensor, token_counts: Sequence[int]) -> str | None:
        """None when ``tensor`` (items concatenated) matches the references, else what differs."""
        want = [self.embeddings[i] for i in indices]
        if list(token_counts) != [w.shape[0] for w in want]:
            return f"token_counts {list(token_counts)} != {[w.shape[0] for w in want]} for items {list(indices)}"
        got = tensor.float()
        if got.shape != (sum(token_counts), want[0].shape[1]):
            return f"shape {tuple(got.shape)} for items {list(indices)}"
        row = 0
        for i, w in zip(indices, want):
            part = got[row:row + w.shape[0]]
            if not torch.allclose(part, w, rtol=RTOL, atol=ATOL):
                return f"item {i}: max |diff| {(part - w).abs().max().item():.3g} (rtol {RTOL})"
            row += w.shape[0]
        return None

    def check_result(self, indices: Sequence[int], result: Any) -> str | None:
        """An ``EncodedRequest`` of ``{"image": items}``."""
        return self.check(indices, result.embeddings["image"], result.token_counts["image"])


def check_inline(refs: References, indices: Sequence[int], body: bytes) -> str | None:
    """A 200 inline answer (safetensors) against the references."""
    tensor, meta = decode_safetensors(body)
    return refs.check(indices, tensor, meta["token_counts"])


# ---- receivers -------------------------------------------------------------------------------
class MessageSink:
    """A PULL socket that is read: every message kept by ``req_id`` (tensors copied)."""

    def __init__(self) -> None:
        self.messages: dict[str, list[tuple[EmbeddingHeader, torch.Tensor | None]]] = defaultdict(list)
        self.endpoint = ""

    async def run(self, *, task_status: trio.TaskStatus[MessageSink] = trio.TASK_STATUS_IGNORED) -> None:
        async with PullReceiver("tcp://127.0.0.1:0") as pull:
            self.endpoint = pull.last_endpoint
            task_status.started(self)
            async for header, tensor in pull:
                self.messages[header.req_id].append(
                    (header, None if tensor is None else tensor.tensor().clone()))


class StuckReceiver:
    """A bound PULL socket that is never read, with tiny buffers (``RCVHWM`` 1,
    ``RCVBUF`` 4 KiB): after a few hundred KB a sender's queue is full."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 1)
        self._sock.setsockopt(zmq.RCVBUF, 4096)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


# ---- servers in subprocesses -------------------------------------------------------------------
def subprocess_env() -> dict[str, str]:
    # One OpenMP thread per server: several servers share 2 cores, and spinning
    # OpenMP threads of one would starve the others.
    return {**os.environ, "MC_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "EPD_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "1"}


class ServerProcess:
    """``epd-trio encoder|bootstrap`` in a subprocess: start, SIGKILL, restart on the same port."""

    def __init__(self, what: str, args: Sequence[str], log_path: Path, name: str = "") -> None:
        self.what, self.args, self.log_path = what, list(args), log_path
        self.name = name or what
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0
        self.starts = 0

    async def start(self, port: int | None = None, timeout: float = 90.0) -> None:
        self.launch(port)
        await self.ready(timeout)

    def launch(self, port: int | None = None) -> None:
        """Start the process (``ready`` waits for it to listen): others can start meanwhile."""
        port = self.port if port is None else port
        with open(self.log_path, "a") as log:
            log.write(f"---- start {self.name} on port {port}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "epd_trio.cli", self.what, "--port", str(port), *self.args],
                stdout=subprocess.PIPE, stderr=log, text=True, env=subprocess_env(), cwd=REPO)

    async def ready(self, timeout: float = 90.0) -> None:
        """Wait for its "listening on URL" line."""
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        with trio.move_on_after(timeout):
            line = await trio.to_thread.run_sync(stdout.readline, abandon_on_cancel=True)
            if "listening on" in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                self.port = int(self.url.rsplit(":", 1)[1])
                self.starts += 1
                return
        self._reap()
        raise RuntimeError(f"{self.name} did not start; its log ends:\n{self.log_tail()}")

    async def restart(self, attempts: int = 20) -> None:
        """Start again on the same port (the URL clients and registries know stays valid)."""
        for attempt in range(attempts):
            try:
                await self.start(self.port)
                return
            except RuntimeError:  # the port may linger for a moment after SIGKILL
                if attempt == attempts - 1:
                    raise
                await trio.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL: no drain, no unregister, sockets reset by the kernel."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self._reap()

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL past ``timeout``; the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(timeout):
                await trio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
        code = proc.poll()
        self.kill()
        return code

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _reap(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# ---- the world the scenarios act on -----------------------------------------------------------
@dataclass
class World:
    """What a scenario may use. ``exclusive``: no other scenario runs at the same
    time, so per-encoder counter deltas belong to this scenario alone."""

    http: httpx.AsyncClient  # raw calls: /stats, /abort, direct /encode
    media: Media
    refs: References
    chaos_urls: list[str]  # encoders taking direct chaos (drops, aborts, stuck receivers)
    chaos_client: EncoderClient  # over chaos_urls (static, or discovered from a registry)
    killables: list[ServerProcess]  # encoder subprocesses that may be SIGKILLed and restarted
    clean_client: EncoderClient | None  # on a separate clean encoder: must never notice the chaos
    clean_urls: list[str]  # that encoder (checked idle after each scenario, too)
    client_options: dict[str, Any] = field(default_factory=dict)  # for the clients scenarios open
    exclusive: bool = True
    stuck: list[StuckReceiver] = field(default_factory=list)  # kept for reuse by later scenarios

    def all_urls(self) -> list[str]:
        return list(dict.fromkeys([*self.chaos_urls, *(p.url for p in self.killables if p.alive)]))

    def close_stuck(self) -> None:
        while self.stuck:
            self.stuck.pop().close()


async def encoder_stats(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await http.get(f"{url}/stats", timeout=5.0)
    response.raise_for_status()
    return response.json()


def _indexed(value: Any) -> Any:
    """Lists of mappings (``/stats`` ``workers``) as mappings by index, so their counts are walked."""
    if isinstance(value, dict):
        return {key: _indexed(sub) for key, sub in value.items()}
    if isinstance(value, list) and all(isinstance(sub, dict) for sub in value):
        return {str(i): _indexed(sub) for i, sub in enumerate(value)}
    return value


async def settle(http: httpx.AsyncClient, urls: Sequence[str],
                 clients: dict[str, EncoderClient], timeout: float = SETTLE_TIMEOUT) -> list[str]:
    """Poll every encoder's ``/stats`` (and the clients) until nothing is live; what is left."""
    problems: list[str] = []
    with trio.move_on_after(timeout):
        while True:
            problems = quiescence_problems(clients)
            for url in urls:
                try:
                    stats = await encoder_stats(http, url)
                except httpx.HTTPError as exc:
                    problems.append(f"{url}/stats failed: {type(exc).__name__}: {exc}")
                    continue
                problems += quiescence_problems({f"encoder {url}": _indexed(stats)})
            if not problems:
                return []
            await trio.sleep(0.05)
    return problems
