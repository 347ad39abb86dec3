"""Seeded real-clock chaos for how requests end: Mooncake, the SGLang faces, process mode.

A *stage* (``endings_stages``) is one encoder in this process and the
receiver side of its kind: our Mooncake client, the SGLang face with each of
its three backends driven with SGLang 0.5.23's bodies in SGLang's orders
(``zmq_to_scheduler``: a rank's ``/scheduler_receive_url`` before or after the
``/encode``; ``zmq_to_tokenizer``: ``embedding_port``; ``mooncake``: sizes,
``/send`` to our own Mooncake peer, the notice), or our client against an
encoder preprocessing in child processes, which a scenario may SIGKILL.

A seed draws each caller's items, deadline, cancellation, ``/abort`` time and
connection drop, and (every other seed) a ``FaultPlan`` over the encoder's
points, ``write`` (the Mooncake transport) included. The rules are the real
chaos suite's: every caller gets its correct embedding (the rank: the bytes of
frame 1, or of the landing buffer) or a typed error within its deadline +
``SLACK``; no 5xx when only the client misbehaved; afterwards ``/stats``, the
client and the pool are idle (nothing registered, reaping, unsettled or held),
and the stage still encodes correctly.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import trio

from endings_stages import ABORT_HOLD, Stage
from epd_trio.client import RemoteEncodeError
from epd_trio.errors import EncodeTimeout, EPDError
from epd_trio.testing import FaultPlan, quiescence_problems
from real_calls import Call, ScenarioReport, client_call, req_id_for
from real_world import SETTLE_TIMEOUT, SLACK, _indexed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang"))
from sglang_face_kit import encode_body, rank  # a rank's PULL socket, SGLang's bodies

__all__ = ["run_endings_scenario"]

SERVER_POINTS = ("media_load", "preprocess", "forward", "send", "release", "write")
LONG = 30.0
SCENARIO_LIMIT = 60.0
# A rank's wait for a part (registration, sizes) whose /encode its client dropped before the
# encoder saw it would last --request-timeout: the rank gives up after this instead.
WAITER = 5.0
_CLIENT_SIDE = frozenset({"AbortedError", "UnknownRequestError"})  # how an aborted part can end


@dataclass(frozen=True)
class Caller:
    label: str
    indices: list[int]
    deadline: float
    cancel_after: float | None = None
    abort_at: float | None = None
    drop_after: float | None = None  # the HTTP client gives up (SGLang stages)
    register_first: bool = False  # zmq_to_scheduler: the rank registers before the /encode


_FAULTS = ("none", "deadline", "cancel", "abort", "abort", "drop")


def _draw(rng: random.Random, stage: Stage) -> list[Caller]:
    """1-3 callers; each with at most one client-side fault, timed where requests are short
    (small items take tens of milliseconds, a large one a few hundred)."""
    callers = []
    sglang = stage.name.startswith("sglang")
    for i in range(rng.randint(1, 3)):
        indices = rng.sample(stage.media.small, rng.randint(1, 2))
        if rng.random() < 0.3:
            indices.append(rng.choice(stage.media.large))
        fault = rng.choice(_FAULTS)
        at = rng.choice([rng.uniform(0.0, 0.02), rng.uniform(0.02, 0.15), rng.uniform(0.15, 0.5)])
        callers.append(Caller(
            f"e{i}", indices,
            deadline=at if fault == "deadline" and not sglang else LONG,
            cancel_after=at if fault == "cancel" and not sglang else None,
            abort_at=at if fault == "abort" else None,
            drop_after=at if fault in ("drop", "deadline", "cancel") and sglang else None,
            register_first=rng.random() < 0.5))
    return callers


async def run_endings_scenario(stage: Stage, seed: int) -> ScenarioReport:
    """Draw ``seed``'s script for ``stage``, run it, then check the aftermath."""
    rng = random.Random(f"{stage.name}-{seed}")
    report = ScenarioReport(seed, stage.name, replay=f"EPD_CHAOS_SEED={seed} pytest "
                            f"tests/chaos/test_chaos_endings.py -k {stage.backend.split('_')[-1]}")
    callers = _draw(rng, stage)
    # Odd seeds add server-side faults; one seed in four kills a preprocessing child (process).
    plan = FaultPlan.random(seed, points=SERVER_POINTS, rate=0.3, max_delay=0.5) if seed % 2 else None
    kill_at = rng.uniform(0.0, 0.2) if stage.name == "process" and seed % 4 == 2 else None
    report.script += [f"{c.label}: {c}" for c in callers]
    t0 = trio.current_time()
    pool = stage.server.service.engine.preprocess_pool
    restarts = pool.statistics().restarts if pool is not None else 0
    stage.install(plan)
    try:
        with trio.move_on_after(SCENARIO_LIMIT) as limit:
            async with trio.open_nursery() as nursery:
                server_faults = plan is not None or kill_at is not None
                for caller in callers:
                    nursery.start_soon(_run_caller, stage, report, caller, server_faults)
                if kill_at is not None:
                    nursery.start_soon(_kill_a_child, report, kill_at)
    finally:
        stage.install(None)
    report.script.append(plan.describe() if plan else "no server faults")
    if limit.cancelled_caught:
        report.violate("hang", f"the scenario did not finish within {SCENARIO_LIMIT} s")
    for problem in await _settle(stage):
        report.violate("leak", problem)
    if kill_at is not None:  # the pool learns of a dead child from a call, which fails (500)
        await _discover_a_dead_child(stage, restarts)
    clean = Caller("after", [rng.choice(stage.media.small)], deadline=LONG)
    before = len(report.violations)
    await _run_caller(stage, report, clean, server_faults=False, must_succeed=True)
    if len(report.violations) > before:
        report.violate("broken", f"{stage.name} no longer encodes correctly after the scenario")
    report.elapsed = trio.current_time() - t0
    return report


async def _run_caller(stage: Stage, report: ScenarioReport, caller: Caller, server_faults: bool,
                      must_succeed: bool = False) -> None:
    req_id = req_id_for(report.seed, caller.label)
    async with trio.open_nursery() as nursery:
        if caller.abort_at is not None:
            part = f"{req_id}_local_part_0" if stage.name.startswith("sglang") else req_id
            nursery.start_soon(_abort_later, stage, report, caller.label, part, caller.abort_at)
        if stage.client is not None:
            call = await client_call(stage, report, stage.client, caller.label, caller.indices,  # type: ignore[arg-type]
                                     timeout=caller.deadline, cancel_after=caller.cancel_after,
                                     req_id=req_id, expect=lambda e: server_faults or _client_side(e),
                                     client_fault_only=not server_faults)
        else:
            call = await _sglang_call(stage, report, caller, req_id, server_faults)
    if must_succeed and call.outcome != "ok":
        report.violate("broken", f"{caller.label}: {call.outcome} {call.error or ''}")


def _client_side(exc: EPDError) -> bool:
    if isinstance(exc, RemoteEncodeError):
        return exc.error_type in _CLIENT_SIDE
    return isinstance(exc, EncodeTimeout)


async def _abort_later(stage: Stage, report: ScenarioReport, label: str, req_id: str, at: float) -> None:
    await trio.sleep(at)
    response = await stage.http.post(f"{stage.url}/abort", json={"req_id": req_id}, timeout=LONG)
    if response.status_code == 200 and not isinstance(response.json().get("released"), bool):
        report.violate("unexpected", f"{label} /abort: no 'released' in {response.text[:200]}")
    elif response.status_code not in (200, 404):
        report.violate("client_5xx" if response.status_code >= 500 else "unexpected",
                       f"{label} /abort: {response.status_code} {response.text[:200]}")


async def _kill_a_child(report: ScenarioReport, at: float) -> None:
    await trio.sleep(at)
    children = [p for p in multiprocessing.active_children() if p.pid is not None]
    if children:  # the pool's children: spawned, this process's own
        victim = random.Random(report.seed).choice(children)
        os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
        report.script.append(f"killed preprocessing child {victim.pid} at +{at:.2f}s")


async def _discover_a_dead_child(stage: Stage, restarts: int) -> None:
    """Calls until the pool has met its dead child and restarted (``restarts`` was the count
    before the kill): each may fail with the pool's 500, the one way a death is learnt."""
    pool = stage.server.service.engine.preprocess_pool
    with trio.fail_after(SCENARIO_LIMIT):
        while pool.statistics().restarts == restarts:
            try:
                async with await stage.client.encode(
                        {"image": stage.media.items(stage.media.small[:1])}, timeout=LONG):
                    pass
            except RemoteEncodeError as exc:
                if "preprocessing process died" not in exc.message:
                    raise
            await trio.sleep(0.05)


# ---- the SGLang faces, driven as SGLang 0.5.23 drives them -------------------------------------------
async def _sglang_call(stage: Stage, report: ScenarioReport, caller: Caller, rid: str,
                       server_faults: bool) -> Call:
    call = Call(caller.label, "http", caller.drop_after or caller.deadline,
                client_fault_only=not server_faults)
    report.calls.append(call)
    part, backend = f"{rid}_local_part_0", stage.backend
    t0 = trio.current_time()
    async with rank() as r:
        body = encode_body(rid, 0, 1, stage.media.items(caller.indices))
        if backend == "zmq_to_tokenizer":
            body["embedding_port"] = [r.port]
        answers: dict[str, Any] = {}

        async def post(name: str, path: str, json: dict[str, Any], timeout: float = LONG) -> None:
            try:
                answers[name] = await stage.http.post(f"{stage.url}{path}", json=json, timeout=timeout)
            except httpx.TimeoutException:
                answers[name] = None  # the client went away (a drop)

        with trio.move_on_after(caller.deadline + SLACK + 10.0) as hard:
            async with trio.open_nursery() as nursery:
                if backend == "zmq_to_scheduler":
                    registration = {"req_id": part, "receive_count": 1, "receive_url": r.url,
                                    "modality": "IMAGE"}
                    nursery.start_soon(post, "register", "/scheduler_receive_url", registration, WAITER)
                    if caller.register_first:
                        await trio.sleep(0.01)
                if backend == "mooncake":
                    nursery.start_soon(post, "meta", "/scheduler_receive_meta_data",
                                       {"req_id": part, "part_idx": 0}, WAITER)
                await post("encode", "/encode", body, caller.drop_after or LONG)
                encoded = answers["encode"]
                if backend == "mooncake" and encoded is not None and encoded.status_code == 200:
                    await _mooncake_send(stage, caller, part, r.port, encoded.json(), post)
            messages = await _drain(r)
    call.elapsed = trio.current_time() - t0
    if hard.cancelled_caught:
        call.outcome = "hung"
        report.violate("hang", f"{caller.label}: still running {call.elapsed:.2f} s in")
    _judge_sglang(stage, report, call, caller, answers, messages)
    return call


async def _mooncake_send(stage: Stage, caller: Caller, part: str, port: int, sizes: dict[str, Any],
                         post: Any) -> None:
    assert stage.buffer is not None and stage.peer is not None
    offset = _landing_offset(caller)
    stage.buffer[offset:offset + sizes["embedding_size"]].zero_()
    await post("send", "/send", {"req_id": part, "part_idx": 0, "prefill_host": "127.0.0.1",
                                 "embedding_port": port, "session_id": stage.peer.session,
                                 "buffer_address": stage.buffer.data_ptr() + offset,
                                 "embedding_size": sizes["embedding_size"], "receive_count": 1})


def _landing_offset(caller: Caller) -> int:
    """Each caller of a scenario lands in its own MiB of the peer's buffer (the check after: the last)."""
    return (3 if caller.label == "after" else int(caller.label.removeprefix("e"))) << 20


async def _drain(r: Any, wait: float = 0.3) -> list[list[bytes]]:
    """What the rank got: the messages already there and any arriving within ``wait``."""
    messages = []
    with trio.move_on_after(wait):
        while True:
            messages.append(await r.receive(timeout=LONG))
    return messages


def _judge_sglang(stage: Stage, report: ScenarioReport, call: Call, caller: Caller,
                  answers: dict[str, Any], messages: list[list[bytes]]) -> None:
    encoded = answers.get("encode")
    for name, answer in answers.items():
        if answer is None or answer.status_code == 200:
            continue
        if not _sglang_error(answer):
            report.violate("untyped", f"{caller.label} {name}: {answer.status_code} {answer.text[:200]}")
        if answer.status_code >= 500 and call.client_fault_only:
            report.violate("client_5xx", f"{caller.label} {name}: {answer.status_code} {answer.text[:200]}")
    if encoded is None:
        call.outcome = "dropped"
        return
    call.status = encoded.status_code
    embedding_messages = [m for m in messages if len(m) == 2]
    if encoded.status_code != 200:
        call.outcome, call.error = "error", (_sglang_error(encoded) or "untyped")[:40]
        if embedding_messages:
            report.violate("wrong", f"{caller.label}: failed ({encoded.status_code}) yet an embedding arrived")
        return
    if stage.backend == "mooncake":
        send = answers.get("send")
        if send is None or send.status_code != 200:
            call.outcome = "error"
            return
        if len(messages) != 1 or len(messages[0]) != 1:
            report.violate("wrong", f"{caller.label}: /send answered but {len(messages)} notices arrived")
        assert stage.buffer is not None
        offset = _landing_offset(caller)
        landed = stage.buffer[offset:offset + encoded.json()["embedding_size"]]
        problem = _check_bytes(stage, caller, landed.numpy().tobytes())
    elif len(embedding_messages) != 1:
        report.violate("wrong", f"{caller.label}: answered 200 but {len(embedding_messages)} embeddings arrived")
        return
    else:
        problem = _check_bytes(stage, caller, embedding_messages[0][1])
    call.outcome = "ok"
    if problem:
        report.violate("wrong", f"{caller.label}: {problem}")


def _sglang_error(answer: httpx.Response) -> str | None:
    """The message of SGLang's error shape, ``{"status": "error", "message", "req_id"}``; else None."""
    try:
        body = answer.json()
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("status") == "error" and body.get("message"):
        return str(body["message"])
    return None


def _check_bytes(stage: Stage, caller: Caller, raw: bytes) -> str | None:
    """Frame 1 (or the landing buffer): the part's embedding, items end to end."""
    dtype = getattr(torch, stage.server.service.model_info.dtype)
    dim = stage.server.service.model_info.dim
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).view(-1, dim)
    counts = [stage.refs.embeddings[i].shape[0] for i in caller.indices]
    return stage.refs.check(caller.indices, tensor, counts)


# ---- afterwards: nothing live, nothing held -------------------------------------------------------------
async def _settle(stage: Stage) -> list[str]:
    problems: list[str] = []
    with trio.move_on_after(SETTLE_TIMEOUT + ABORT_HOLD):
        while problems := await _live(stage):
            await trio.sleep(0.05)
    return problems


async def _live(stage: Stage) -> list[str]:
    stats = (await stage.http.get(f"{stage.url}/stats")).json()
    problems = quiescence_problems({"encoder": _indexed(stats)})
    if stats["registry"]["unsettled"]:
        problems.append(f"encoder.registry.unsettled={stats['registry']['unsettled']}")
    rendezvous = stats["sglang_rendezvous"]
    if rendezvous["entries"] or rendezvous["claimed"]:
        problems.append(f"encoder.sglang_rendezvous={rendezvous}")
    if stats["mooncake"] and stats["mooncake"]["unsettled_writes"]:
        problems.append(f"encoder.mooncake.unsettled_writes={stats['mooncake']['unsettled_writes']}")
    if stage.client is not None:
        problems += quiescence_problems({"client": stage.client}, stage.client_idle)
    if stage.peer is not None:
        problems += quiescence_problems({"peer": stage.peer}, {"peer.registered_regions": 1,
                                                               "peer.registered_bytes": stage.buffer.numel()})
    pool = stage.server.service.engine.preprocess_pool
    if pool is not None:
        s = pool.statistics()
        if s.running:
            problems.append(f"preprocess pool: {s.running} running")
    return problems
