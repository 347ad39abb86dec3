"""The test's hands on a namespace host: a language server's encoder client, and a probe.

Run as ``python multihost_agent.py`` on a host (``ip netns exec``); the test process, in
the machine's own namespace, cannot reach the hosts' addresses, so every call
into the cluster goes through here. Commands are JSON lines on stdin, each
with an ``id``; each runs in its own task, and its answer is one line
``EPD-AGENT {"id": ..., ...}`` on stdout. Operations:

``http`` {method, url, json?, timeout}: one call → {status, body} or {error}.
``wait_http`` {url, status, timeout}: until ``url`` answers ``status`` → {seconds}.
``open`` {name, config}: an ``EncoderClient`` kept under ``name``.
``encode`` {name, images (paths), timeout?, out?}: one request → {ok, parts, seconds,
retries, endpoints, statistics} or {ok: false, type, message, seconds}; with ``out``
the image embedding goes to that safetensors file.
``load`` {name, images, concurrency, until?, requests?, pause?}: requests until the file
``until`` exists → {done (each one's encoder URLs), failures, took}.
``encoders`` {name}: the client's encoder list. ``close`` {name}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from epd_trio.client import EncoderClient, open_encoder_client
from epd_trio.config import ClientConfig
from epd_trio.errors import EPDError

LONGEST = 300.0  # no command outlives this (seconds)


class Agent:
    def __init__(self) -> None:
        self.clients: dict[str, tuple[EncoderClient, trio.CancelScope]] = {}
        self.nursery: trio.Nursery | None = None
        self.http = httpx.AsyncClient(timeout=10)

    def say(self, answer: dict[str, Any]) -> None:
        sys.stdout.write("EPD-AGENT " + json.dumps(answer) + "\n")
        sys.stdout.flush()

    async def handle(self, command: dict[str, Any]) -> None:
        started = trio.current_time()
        try:
            with trio.fail_after(min(float(command.get("timeout", LONGEST)) + 30, LONGEST)):
                answer = await getattr(self, "op_" + command["op"])(command)
        except Exception as exc:  # noqa: BLE001 (the test reads it; the agent serves on)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answer["seconds"] = round(trio.current_time() - started, 3)
        self.say({"id": command["id"], **answer})

    async def op_http(self, c: dict[str, Any]) -> dict[str, Any]:
        try:
            with trio.fail_after(c.get("timeout", 10)):
                response = await self.http.request(c.get("method", "GET"), c["url"], json=c.get("json"))
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text[:2000]
        return {"status": response.status_code, "body": body}

    async def op_wait_http(self, c: dict[str, Any]) -> dict[str, Any]:
        last: Any = None
        with trio.move_on_after(c["timeout"]):
            while True:
                try:
                    response = await self.http.get(c["url"], timeout=5)
                    last = response.status_code
                    if last == c.get("status", 200):
                        return {"status": last}
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                await trio.sleep(0.2)
        return {"error": f"{c['url']} never answered {c.get('status', 200)} (last: {last})"}

    async def op_open(self, c: dict[str, Any]) -> dict[str, Any]:
        config = ClientConfig(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in c["config"].items()})
        assert self.nursery is not None
        opened = trio.Event()
        failure: list[BaseException] = []

        async def own(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                try:
                    async with open_encoder_client(config) as client:
                        self.clients[c["name"]] = (client, scope)
                        opened.set()
                        await trio.sleep_forever()
                except Exception as exc:  # noqa: BLE001 (open's answer carries it)
                    failure.append(exc)
                    opened.set()
        self.nursery.start_soon(own)
        await opened.wait()
        if failure:
            raise failure[0]
        return {"encoders": list(self.clients[c["name"]][0].encoders)}

    async def op_encode(self, c: dict[str, Any]) -> dict[str, Any]:
        client = self.clients[c["name"]][0]
        images = [Path(p).read_bytes() for p in c["images"]]
        started = time.monotonic()
        try:
            async with await client.encode({"image": images}, timeout=c.get("timeout")) as result:
                if c.get("out"):
                    from safetensors.torch import save_file

                    save_file({"image": result.embeddings["image"].clone()}, c["out"])
                parts = [p.encoder_url for p in result.parts]
        except EPDError as exc:
            return {"ok": False, "type": type(exc).__name__, "message": exc.message,
                    "took": round(time.monotonic() - started, 3)}
        return {"ok": True, "parts": parts, "took": round(time.monotonic() - started, 3),
                **self._state(client)}

    async def op_load(self, c: dict[str, Any]) -> dict[str, Any]:
        """Requests, ``concurrency`` at a time, until the file ``until`` exists (or
        ``requests`` are done); every outcome and how long each took."""
        client = self.clients[c["name"]][0]
        images = [Path(p).read_bytes() for p in c["images"]]
        until = Path(c["until"]) if c.get("until") else None
        todo = iter(range(c.get("requests", 10**9)))
        done: list[list[str]] = []
        failures: list[str] = []
        took: list[float] = []

        async def worker() -> None:
            for _ in todo:
                if until is not None and until.exists():
                    return
                started = trio.current_time()
                try:
                    async with await client.encode({"image": images}) as result:
                        done.append([p.encoder_url for p in result.parts])
                except EPDError as exc:
                    failures.append(f"{type(exc).__name__}: {exc.message}")
                took.append(round(trio.current_time() - started, 3))
                await trio.sleep(c.get("pause", 0))

        async with trio.open_nursery() as nursery:
            for _ in range(c["concurrency"]):
                nursery.start_soon(worker)
        return {"done": done, "failures": failures, "took": took, **self._state(client)}

    async def op_encoders(self, c: dict[str, Any]) -> dict[str, Any]:
        client = self.clients[c["name"]][0]
        return {"encoders": list(client.encoders), **self._state(client)}

    async def op_close(self, c: dict[str, Any]) -> dict[str, Any]:
        _, scope = self.clients.pop(c["name"])
        scope.cancel()
        return {}

    @staticmethod
    def _state(client: EncoderClient) -> dict[str, Any]:
        s = client.statistics()
        addresses = getattr(client.receiver, "addresses", None)  # a ZMQ receiver's
        engine = getattr(client.receiver, "engine", None)  # a Mooncake receiver's
        return {"retries": s.retries, "requests_live": s.requests_live,
                "endpoints": list(addresses.endpoints) if addresses is not None else [],
                "mooncake_session": engine.session if engine is not None else None,
                "discovery": dataclasses.asdict(client.discovery.statistics())
                if client.discovery else None}


async def main() -> None:
    agent = Agent()
    async with agent.http, trio.open_nursery() as nursery:
        agent.nursery = nursery
        agent.say({"id": "ready", "pid": os.getpid()})
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buffer = b""
        while True:
            chunk = await stdin.receive_some(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    nursery.start_soon(agent.handle, json.loads(line))
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
